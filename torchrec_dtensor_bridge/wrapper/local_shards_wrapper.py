"""LocalShardsWrapper: every shard of one table that lives on this rank.

It is the ``local_tensor`` of a DTensor whose layout DTensor's placements
cannot express (uneven cuts, several shards per rank, grids), and it is what
DCP sees through the ``_Checkpointable`` dunders. Ops reach it through
``__torch_dispatch__`` and are handled shard by shard (see ``ops.py``).

Example::

    >>> w = LocalShardsWrapper([torch.ones(2, 4), torch.zeros(3, 4)],
    ...                        [(0, 0), (5, 0)], global_shape=(8, 4))
    >>> w.shape, w.local_offsets()
    (torch.Size([5, 4]), [torch.Size([0, 0]), torch.Size([5, 0])])
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..layout import LayoutKind, ShardLayout, ShardSpec, boxes_overlap, contiguous_strides
from .op_table import dispatch

__all__ = ["LocalShardsWrapper"]

_SHARD = "_shard_"
"""The prefix of the inner tensor names of :meth:`LocalShardsWrapper.__tensor_flatten__` (one per shard)."""
_NO_SHARD = "_no_shard"
"""The one inner tensor of a wrapper holding no shard (empty: its dtype and device)."""


class LocalShardsWrapper(torch.Tensor):
    """A tensor subclass holding all of this rank's shards of one table.

    Args:
        local_shards: this rank's shards (may be empty: a rank holding nothing).
        local_offsets: global offsets of each shard, one tuple per shard.
        global_shape: shape of the whole table, when known; enables bounds checks
            and is the size DCP records when the wrapper is saved on its own.
        layout: optional :class:`ShardLayout` of the whole table (all ranks); lets
            converters rebuild global metadata without communication.
        dtype, device: only for a wrapper with no shards.

    The wrapper's own shape is its shards packed together along the one dim in
    which their offsets differ (rows for several row-wise shards, columns for
    several column shards); a single shard gives its own shape; no shard gives
    all-zero sizes. Raises ``ValueError`` naming the shard index and numbers on
    any inconsistency, before anything is built.
    """

    _local_shards: list[torch.Tensor]
    _offsets: list[torch.Size]
    _global_shape: torch.Size | None
    _layout: ShardLayout | None
    _stack_dim: int | None

    @staticmethod
    def __new__(
        cls,
        local_shards: Sequence[torch.Tensor],
        local_offsets: Sequence[Sequence[int]],
        global_shape: Sequence[int] | None = None,
        *,
        layout: ShardLayout | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        _trusted: bool = False,
    ) -> LocalShardsWrapper:
        shards = list(local_shards)
        if layout is not None and global_shape is None:
            global_shape = layout.global_shape
        gshape = None if global_shape is None else torch.Size(tuple(map(int, global_shape)))
        if _trusted:  # the caller checked shards against a validated layout
            offsets = [torch.Size(o) for o in local_offsets]
        else:
            offsets = _validate(shards, local_offsets, gshape)
        ndim = shards[0].ndim if shards else (len(gshape) if gshape is not None else 2)
        shape, stack_dim = _packed_shape(shards, offsets, ndim)
        if not shards:  # else the first shard's
            dtype = dtype or (layout.dtype if layout is not None else None) or torch.float32
        return cls._assemble(shape, contiguous_strides(shape), shards, offsets, gshape, layout, stack_dim, dtype,
                             None if shards else torch.device(device or "cpu"))

    @classmethod
    def _assemble(cls, shape: Sequence[int], stride: Sequence[int], shards: list[torch.Tensor],
                  offsets: list[torch.Size], global_shape: torch.Size | None, layout: ShardLayout | None,
                  stack_dim: int | None, dtype: torch.dtype | None, device: torch.device | None,
                  empty: torch.Tensor | None = None) -> LocalShardsWrapper:
        """A wrapper over ``shards`` already checked against ``offsets`` and the table (dtype, device and
        requires_grad from the first shard; ``dtype`` and ``device`` when there is none).

        A wrapper holding no shard keeps one empty tensor of its dtype and device, the inner tensor
        :meth:`__tensor_flatten__` hands torch.compile: ``empty``, or one made now (in the mode of the op that
        makes the wrapper: fake while torch.compile traces)."""
        first = shards[0] if shards else None
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            strides=stride,
            dtype=first.dtype if first is not None else dtype,
            device=first.device if first is not None else device,
            requires_grad=first.requires_grad if first is not None else False,
        )
        r._local_shards = shards
        r._offsets = offsets
        r._global_shape = global_shape
        r._layout = layout
        r._stack_dim = stack_dim
        if not shards:
            setattr(r, _NO_SHARD, empty if empty is not None else torch.empty(0, dtype=dtype, device=device))
        return r

    # ------------------------------------------------------------- accessors
    def local_shards(self) -> list[torch.Tensor]:
        """This rank's shards (the real storage, not copies)."""
        return self._local_shards

    def block_key(self) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
        """``(offsets, sizes)`` of each local shard, computed once: what two wrappers share when an op may
        combine them shard by shard (shards keep their shapes)."""
        key = self.__dict__.get("_blocks")
        if key is None:
            key = tuple((tuple(o), tuple(s.shape)) for o, s in zip(self._offsets, self._local_shards))
            self.__dict__["_blocks"] = key
        return key

    def local_offsets(self) -> list[torch.Size]:
        """Global offsets of each local shard.

        A wrapper with no shard reports one all-zero offset, paired with the one all-zero size of
        :meth:`local_sizes` (TorchRec's convention: a rank holding nothing holds one empty block at the
        origin); :meth:`local_shards` and :attr:`local_chunks` stay empty, so DCP sees no phantom chunk.
        """
        if not self._local_shards:
            return [torch.Size([0] * self.dim())]
        return list(self._offsets)

    def local_sizes(self) -> list[torch.Size]:
        """Sizes of each local shard.

        A wrapper with no shard reports one all-zero size, as the wrappers of
        torch and TorchRec do (TorchRec's ``EmbeddingCollection`` load reads
        ``local_sizes()[0]`` before it looks at ``local_shards()``).
        """
        if not self._local_shards:
            return [torch.Size([0] * self.dim())]
        return [s.size() for s in self._local_shards]

    @property
    def local_chunks(self) -> list[ChunkStorageMetadata]:
        """DCP chunk metadata of each local shard."""
        return [
            ChunkStorageMetadata(offsets=o, sizes=s.size())
            for o, s in zip(self._offsets, self._local_shards)
        ]

    def storage_metadata(self) -> TensorStorageMetadata:
        """DCP metadata of this rank's shards; ``size`` is the global shape when known."""
        return TensorStorageMetadata(
            properties=self._properties(),
            size=self.global_shape,
            chunks=self.local_chunks,
        )

    def is_empty_shard(self) -> bool:
        """True when this rank holds no shard of the table."""
        return not self._local_shards

    @property
    def global_shape(self) -> torch.Size:
        """The table's shape if known, else this wrapper's packed shape."""
        return self._global_shape if self._global_shape is not None else self.size()

    @property
    def layout_of_table(self) -> ShardLayout | None:
        """The whole table's layout, when the creator supplied it."""
        return self._layout

    @property
    def stack_dim(self) -> int | None:
        """The dim along which local shards are packed (``None``: irregular)."""
        return self._stack_dim

    def is_pinned(self) -> bool:  # type: ignore[override]
        return bool(self._local_shards) and all(s.is_pinned() for s in self._local_shards)

    def requires_grad_(self, requires_grad: bool = True) -> LocalShardsWrapper:
        for s in self._local_shards:
            s.requires_grad_(requires_grad)
        super().requires_grad_(requires_grad)
        return self

    def _properties(self) -> TensorProperties:
        return TensorProperties(dtype=self.dtype, requires_grad=self.requires_grad, pin_memory=False)

    def _like(self, shards: list[torch.Tensor], layout: ShardLayout | None = None) -> LocalShardsWrapper:
        """A wrapper with the same offsets and table metadata over new shards of the
        same sizes (the result of a shard-by-shard op): no re-validation."""
        assert [s.shape for s in shards] == [s.shape for s in self._local_shards], "shard sizes changed"
        # no shard: the same stand-in (an alias, as the result of a shard-by-shard op is)
        return LocalShardsWrapper._assemble(self.shape, self.stride(), shards, self._offsets, self._global_shape,
                                            layout if layout is not None else self._layout, self._stack_dim,
                                            self.dtype, self.device, None if shards else getattr(self, _NO_SHARD))

    def pack(self) -> torch.Tensor:
        """The local shards concatenated along :attr:`stack_dim` (a copy unless one shard)."""
        if len(self._local_shards) == 1:
            return self._local_shards[0]
        if not self._local_shards:
            return torch.empty(self.shape, dtype=self.dtype, device=self.device)
        if self._stack_dim is None:
            raise NotImplementedError(
                f"local shards at offsets {[list(o) for o in self._offsets]} cannot be packed "
                "into one tensor: they differ in more than one dim"
            )
        return torch.cat(self._local_shards, dim=self._stack_dim)

    def split_packed(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """Views of a tensor of this wrapper's shape, one per local shard."""
        if packed.shape != self.shape:
            raise ValueError(f"expected a tensor of shape {list(self.shape)}, got {list(packed.shape)}")
        if len(self._local_shards) <= 1:
            return [packed] if self._local_shards else []
        if self._stack_dim is None:
            raise NotImplementedError("irregular local shards cannot be split from one tensor")
        return list(packed.split([s.shape[self._stack_dim] for s in self._local_shards], self._stack_dim))

    # ------------------------------------------------ torch.compile (flatten)
    def __tensor_flatten__(self) -> tuple[list[str], tuple[Any, ...]]:
        """The shards as inner tensors (``_shard_<i>``), the rest as metadata: what ``torch.compile`` traces
        through (:meth:`__torch_dispatch__` on fake shards) and rebuilds with :meth:`__tensor_unflatten__`."""
        n = len(self._local_shards)
        names = [f"{_SHARD}{i}" for i in range(n)] if n else [_NO_SHARD]  # compile wants >= 1 inner tensor
        return names, (n, tuple(self._offsets), self._global_shape, self._layout, self._stack_dim, self.dtype,
                       self.device)

    def _stable_hash_for_caching(self) -> str:
        """What torch.compile's caches key a compiled graph on (torch's extension point for wrapper subclasses):
        everything :meth:`__tensor_flatten__` carries, the shards' shapes, strides and dtypes, and this rank.
        A graph traced over one rank's or one layout's shards bakes in their blocks (a gather packs this
        rank's blocks, a reduction skips copies), so it must never serve another's. The DTensor over a
        wrapper folds this in (``_compat.key_compiled_dtensors_by_local_shards``)."""
        layout = self._layout
        key = (
            type(self).__qualname__,
            dist.get_rank() if dist.is_initialized() else 0,
            [tuple(o) for o in self._offsets],
            None if self._global_shape is None else tuple(self._global_shape),
            None if layout is None else (layout.global_shape, str(layout.dtype), layout.name,
                                         [(s.rank, s.offsets, s.sizes) for s in layout.shards]),
            self._stack_dim, str(self.dtype), str(self.device), tuple(self.shape),
            [(tuple(t.shape), t.stride(), str(t.dtype), t.requires_grad) for t in self._local_shards],
            self.__dict__.get("_reduce_members"),
        )
        return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: tuple[Any, ...], outer_size: Sequence[int],
                             outer_stride: Sequence[int]) -> LocalShardsWrapper:
        n, offsets, global_shape, layout, stack_dim, dtype, device = meta
        shards = [inner[f"{_SHARD}{i}"] for i in range(n)]
        # no shard: the stand-in as given (a fake one while torch.compile traces)
        return LocalShardsWrapper._assemble(outer_size, outer_stride, shards, list(offsets), global_shape, layout,
                                            stack_dim, dtype, device, None if shards else inner[_NO_SHARD])

    def __getattr__(self, name: str) -> Any:
        # only reached for names not found otherwise: the inner tensors :meth:`__tensor_flatten__` names
        if name.startswith(_SHARD) and name[len(_SHARD):].isdigit():
            shards = self.__dict__.get("_local_shards", [])
            k = int(name[len(_SHARD):])
            if k < len(shards):
                return shards[k]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ------------------------------------------------------------ dispatch
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs or {})

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    # --------------------------------------------------- DCP (_Checkpointable)
    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        """One write item per local shard; none on a rank that holds nothing
        (DCP de-duplicates by offset, an empty item could shadow the owner's)."""
        size = object.size() if object is not self else self.global_shape
        props = self._properties()
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets, i),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=props, size=size),
            )
            for i, chunk in enumerate(self.local_chunks)
            if all(s > 0 for s in chunk.sizes)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [c for c in self.local_chunks if all(s > 0 for s in c.sizes)]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The real local shard at ``index.offset`` (loads copy into it in place).
        ``index.index`` is only a hint: DCP rewrites it to a global position, and on
        load it counts only non-empty chunks. An empty shard may share its offsets
        with a real one; DCP never reads or writes empty chunks, so a non-empty
        shard at the offsets wins."""
        i = index.index
        if (
            i is not None
            and 0 <= i < len(self._offsets)
            and self._offsets[i] == index.offset
            and self._local_shards[i].numel()
        ):
            return self._local_shards[i]
        matches = [s for off, s in zip(self._offsets, self._local_shards) if off == index.offset]
        if matches:
            return next((s for s in matches if s.numel()), matches[0])
        raise ValueError(
            f"{index.fqn!r}: no local shard at offsets {list(index.offset or [])}; "
            f"this rank holds {[list(o) for o in self._offsets]}"
        )

    # ----------------------------------------------------- pickling / copies
    def __reduce_ex__(self, protocol: int):  # type: ignore[override]
        return (
            _rebuild,
            (self._local_shards, [tuple(o) for o in self._offsets], self._global_shape, self._layout,
             self.dtype, str(self.device)),
        )

    def __deepcopy__(self, memo: dict) -> LocalShardsWrapper:
        shards = [copy.deepcopy(s, memo) for s in self._local_shards]
        return self._like(shards)

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        shards = ", ".join(
            f"{list(o)}+{list(s.shape)}" for o, s in zip(self._offsets, self._local_shards)
        )
        return (
            f"LocalShardsWrapper(shape={list(self.shape)}, global_shape="
            f"{None if self._global_shape is None else list(self._global_shape)}, "
            f"dtype={self.dtype}, device={self.device}, shards=[{shards}])"
        )

    __str__ = __repr__

    def __hash__(self) -> int:
        return id(self)


def _rebuild(shards, offsets, global_shape, layout, dtype, device) -> LocalShardsWrapper:
    return LocalShardsWrapper(shards, offsets, global_shape, layout=layout, dtype=dtype, device=device)


def _validate(
    shards: list[torch.Tensor], offsets_in: Sequence[Sequence[int]], gshape: torch.Size | None
) -> list[torch.Size]:
    if not isinstance(shards, list) or not all(isinstance(s, torch.Tensor) for s in shards):
        bad = [type(s).__name__ for s in shards if not isinstance(s, torch.Tensor)]
        raise TypeError(f"local_shards must be a list of Tensors, got {bad or type(shards).__name__}")
    if len(shards) != len(offsets_in):
        raise ValueError(
            f"got {len(shards)} local_shards but {len(offsets_in)} local_offsets; "
            "they must pair up one to one"
        )
    offsets = [torch.Size(tuple(map(int, o))) for o in offsets_in]
    if not shards:
        return offsets
    first = shards[0]
    for i, (s, o) in enumerate(zip(shards, offsets)):
        for what, a, b in (("dtype", s.dtype, first.dtype), ("device", s.device, first.device),
                           ("ndim", s.ndim, first.ndim)):
            if a != b:
                raise ValueError(f"shard {i} has {what} {a}, but shard 0 has {what} {b}")
        if isinstance(s, LocalShardsWrapper):
            raise TypeError(f"shard {i} is itself a LocalShardsWrapper; pass its local_shards()")
        if len(o) != s.ndim:
            raise ValueError(f"shard {i} has {s.ndim} dims but offsets {list(o)} have {len(o)} values")
        if any(v < 0 for v in o):
            raise ValueError(f"shard {i} has negative offsets {list(o)}")
        if gshape is not None:
            if len(gshape) != s.ndim:
                raise ValueError(f"shard {i} has {s.ndim} dims but global_shape {list(gshape)} has {len(gshape)}")
            for d, (off, size, g) in enumerate(zip(o, s.shape, gshape)):
                if off + size > g:
                    raise ValueError(
                        f"shard {i} at offsets {list(o)} with sizes {list(s.shape)} exceeds "
                        f"global_shape {list(gshape)} in dim {d} ({off} + {size} > {g})"
                    )
    for i in range(len(shards)):
        for j in range(i + 1, len(shards)):
            if boxes_overlap(offsets[i], shards[i].shape, offsets[j], shards[j].shape):
                raise ValueError(
                    f"shards {i} (offsets {list(offsets[i])}, sizes {list(shards[i].shape)}) and "
                    f"{j} (offsets {list(offsets[j])}, sizes {list(shards[j].shape)}) overlap"
                )
    return offsets


def _packed_shape(
    shards: list[torch.Tensor], offsets: list[torch.Size], ndim: int
) -> tuple[torch.Size, int | None]:
    if not shards:
        return torch.Size((0,) * ndim), None
    if len(shards) == 1:
        return shards[0].shape, 0
    differing = [d for d in range(ndim) if len({o[d] for o in offsets}) > 1]
    if len(differing) == 1:
        d = differing[0]
        others = {tuple(s.shape[:d]) + tuple(s.shape[d + 1 :]) for s in shards}
        if len(others) == 1:
            shape = list(shards[0].shape)
            shape[d] = sum(s.shape[d] for s in shards)
            return torch.Size(shape), d
    # Irregular (e.g. diagonal grid blocks): rows summed, other dims their maximum.
    shape = [sum(s.shape[0] for s in shards)] + [max(s.shape[d] for s in shards) for d in range(1, ndim)]
    return torch.Size(shape), None


# ShardSpec and LayoutKind too: a wrapper carrying its table layout pickles them
# (the shards, and `kind` once it is cached), and weights_only loads must accept them.
torch.serialization.add_safe_globals([LocalShardsWrapper, _rebuild, ShardLayout, ShardSpec, LayoutKind])
