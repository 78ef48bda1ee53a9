"""Zero-copy ShardedTensor <-> DTensor, for single tensors and whole state_dicts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .._compat import ShardedTensor, make_sharded_tensor, sharded_tensor_process_group
from ..layout import LayoutKind, ShardLayout, ShardSpec, contiguous_strides
from ..wrapper import LocalShardsWrapper
from .metadata import layout_from_sharded_tensor, layout_to_sharded_tensor_metadata
from .placements import layout_from_placements, placement_for_layout

__all__ = [
    "dtensor_from_local_shards",
    "layout_of",
    "local_shards_of",
    "state_dict_to_dtensor",
    "state_dict_to_sharded_tensor",
    "to_dtensor",
    "to_sharded_tensor",
]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def dtensor_from_local_shards(
    layout: ShardLayout,
    local_shards: list[torch.Tensor],
    *,
    device_mesh: DeviceMesh | None = None,
    process_group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    wrap: bool = False,
) -> DTensor:
    """A DTensor over this rank's ``local_shards`` (in ``layout.shards_on(rank)`` order).

    Not collective and zero-copy: the DTensor's local shards are ``local_shards``.
    The local tensor is a plain tensor where the placements describe the layout
    exactly, else a :class:`LocalShardsWrapper` carrying the layout; ``wrap=True``
    always gives the wrapper (the form TorchRec's ``load_state_dict`` reads).
    """
    rank = _rank()
    mine = layout.shards_on(rank)
    if len(mine) != len(local_shards):
        raise ValueError(
            f"table {layout.name!r}: rank {rank} holds {len(mine)} shards in the layout "
            f"but {len(local_shards)} local tensors were given"
        )
    for i, (spec, t) in enumerate(zip(mine, local_shards)):
        if tuple(t.shape) != spec.sizes:
            raise ValueError(
                f"table {layout.name!r}: local shard {i} on rank {rank} has shape {list(t.shape)}, "
                f"layout says {list(spec.sizes)} at offsets {list(spec.offsets)}"
            )
    dev = torch.device(device) if device is not None else (
        local_shards[0].device if local_shards else _device_of_layout(layout)
    )
    dtype = local_shards[0].dtype if local_shards else (layout.dtype or torch.get_default_dtype())
    if layout.dtype is None:
        layout = ShardLayout(layout.global_shape, layout.shards, dtype, layout.name)
    where = placement_for_layout(layout, dev.type, device_mesh, process_group)
    if where.exact and len(local_shards) <= 1 and not wrap:
        local = local_shards[0] if local_shards else torch.empty(
            (0,) * layout.ndim, dtype=dtype, device=dev
        )
    else:
        local = LocalShardsWrapper(
            local_shards, [s.offsets for s in mine], layout.global_shape, layout=layout, dtype=dtype, device=dev,
            _trusted=_consistent(local_shards),
        )
    shape = torch.Size(layout.global_shape)
    return DTensor.from_local(
        local, where.mesh, where.placements, run_check=False, shape=shape, stride=contiguous_strides(shape)
    )


def _consistent(shards: list[torch.Tensor]) -> bool:
    """Shards already matched to a validated layout need only agree in dtype and device."""
    return all(s.dtype == shards[0].dtype and s.device == shards[0].device for s in shards[1:])


def _device_of_layout(layout: ShardLayout) -> torch.device:
    for s in layout.shards:
        if s.device:
            return torch.device(torch.device(s.device).type)
    return torch.device("cpu")


def to_dtensor(
    sharded_tensor: ShardedTensor, device_mesh: DeviceMesh | None = None, *, name: str | None = None
) -> DTensor:
    """The DTensor view of a ShardedTensor; not collective, zero-copy.

    The result's local shards are the ShardedTensor's local tensors (same
    ``data_ptr``). Works for every TorchRec sharding type. The local tensor is
    always a :class:`LocalShardsWrapper` carrying the whole layout (as in
    TorchRec's own DTensors), so TorchRec's ``load_state_dict`` of a
    ShardedTensor or ``output_dtensor=True`` module reads it directly.

    Example::

        >>> dt = tdb.to_dtensor(model.state_dict()["ebc.embedding_bags.t0.weight"])
        >>> tdb.full_tensor(dt)  # the whole table on every rank
    """
    if not isinstance(sharded_tensor, ShardedTensor):
        raise TypeError(f"to_dtensor expects a ShardedTensor, got {type(sharded_tensor).__name__}")
    layout = layout_from_sharded_tensor(sharded_tensor, name=name or "table")
    tensors = _in_layout_order(sharded_tensor, layout.shards_on(_rank()))
    return dtensor_from_local_shards(
        layout,
        tensors,
        device_mesh=device_mesh,
        process_group=sharded_tensor_process_group(sharded_tensor),
        wrap=True,
    )


def _is_shards_wrapper(t: Any) -> bool:
    return callable(getattr(t, "local_shards", None)) and callable(getattr(t, "local_offsets", None))


def layout_of(t: DTensor | ShardedTensor | LocalShardsWrapper, *, name: str = "table") -> ShardLayout:
    """The layout of a DTensor, ShardedTensor or layout-carrying wrapper.

    Collective only for a DTensor whose local tensor is a shards wrapper without
    a layout (TorchRec's own wrapper): then every rank's offsets are gathered.
    """
    if isinstance(t, ShardedTensor):
        return layout_from_sharded_tensor(t, name=name)
    if isinstance(t, LocalShardsWrapper):
        if t.layout_of_table is None:
            raise ValueError(f"table {name!r}: this LocalShardsWrapper carries no layout of the whole table")
        return t.layout_of_table.with_name(name)
    if not isinstance(t, DTensor):
        raise TypeError(f"table {name!r}: expected a DTensor or ShardedTensor, got {type(t).__name__}")
    local = t._local_tensor
    if isinstance(local, LocalShardsWrapper) and local.layout_of_table is not None:
        return local.layout_of_table.with_name(name)
    if _is_shards_wrapper(local):
        return _gather_layout(t, local, name)
    return layout_from_placements(t.device_mesh, t.placements, t.shape, dtype=t.dtype, name=name)


def _gather_layout(t: DTensor, local: Any, name: str) -> ShardLayout:
    rank = _rank()
    mine = [
        (tuple(int(v) for v in o), tuple(int(v) for v in s.shape))
        for o, s in zip(local.local_offsets(), local.local_shards())
    ]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (rank, mine))
    shards = [ShardSpec(r, o, s) for r, blocks in everyone for o, s in blocks]
    lay = ShardLayout(tuple(t.shape), tuple(shards), t.dtype, name)
    lay.validate()
    return lay


def _in_layout_order(st: ShardedTensor, specs: tuple[ShardSpec, ...]) -> list[torch.Tensor]:
    """``st``'s local tensors ordered as ``specs`` (a ShardedTensor may keep its local
    shards in another order than its metadata). Matched by offsets AND sizes: an
    empty block may share its offsets with a real one."""
    pool: dict[tuple, list[torch.Tensor]] = {}
    for s in st.local_shards():
        key = (tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes))
        pool.setdefault(key, []).append(s.tensor)
    return [pool[(spec.offsets, spec.sizes)].pop(0) for spec in specs]


def local_shards_of(t: DTensor | ShardedTensor) -> list[torch.Tensor]:
    """This rank's shard tensors (real storage), in the layout's order for this rank."""
    if isinstance(t, ShardedTensor):
        return _in_layout_order(t, layout_from_sharded_tensor(t).shards_on(_rank()))
    local: Any = t._local_tensor
    if _is_shards_wrapper(local):
        return list(local.local_shards())
    if t.device_mesh.get_coordinate() is None:
        return []  # a rank outside the mesh holds nothing
    return [local]


def to_sharded_tensor(dtensor: DTensor, process_group: dist.ProcessGroup | None = None) -> ShardedTensor:
    """The ShardedTensor view of a DTensor; zero-copy; the inverse of :func:`to_dtensor`.

    The metadata lists every shard of every rank (offsets, sizes, placement) as
    TorchRec builds it. Replicated (data-parallel) DTensors have no
    ShardedTensor form and raise ``ValueError``.
    """
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"to_sharded_tensor expects a DTensor, got {type(dtensor).__name__}")
    return _sharded_from_layout(dtensor, layout_of(dtensor), process_group)


def _sharded_from_layout(
    dtensor: DTensor, layout: ShardLayout, process_group: dist.ProcessGroup | None
) -> ShardedTensor:
    """:func:`to_sharded_tensor` once ``layout_of(dtensor)`` is known (it may be collective)."""
    if layout.kind is LayoutKind.REPLICATED or len(layout.unique_shards()) != len(layout.shards):
        raise ValueError(
            f"a replicated DTensor (placements {dtensor.placements}) has no ShardedTensor form; "
            "use its local tensor"
        )
    rank = _rank()
    mine = layout.shards_on(rank)
    tensors = local_shards_of(dtensor)
    if len(tensors) != len(mine):
        raise ValueError(f"rank {rank} holds {len(tensors)} local tensors but the layout lists {len(mine)} shards")
    device = tensors[0].device if tensors else _device_of_layout(layout)
    md = layout_to_sharded_tensor_metadata(
        layout, process_group=process_group, device=device, requires_grad=dtensor.requires_grad
    )
    local_md = [m for m, s in zip(md.shards_metadata, layout.shards) if s.rank == rank]
    return make_sharded_tensor(list(zip(tensors, local_md)), md, process_group)


def _map_state(sd: Any, fn: Any, prefix: str = "") -> Any:
    """Apply ``fn(key, value)`` to every leaf of a (nested) state_dict; keeps containers' types."""
    if isinstance(sd, Mapping):
        out = {k: _map_state(v, fn, f"{prefix}{k}.") for k, v in sd.items()}
        if type(sd) is dict:
            return out
        container: Any = type(sd)
        res = container(out)  # OrderedDict stays OrderedDict, with a module's _metadata
        if hasattr(sd, "_metadata"):
            res._metadata = sd._metadata
        return res
    if isinstance(sd, list):
        return [_map_state(v, fn, f"{prefix}{i}.") for i, v in enumerate(sd)]
    return fn(prefix[:-1], sd)


def state_dict_to_dtensor(sd: Mapping[str, Any]) -> dict[str, Any]:
    """Every ShardedTensor in ``sd`` as a DTensor (zero-copy); other values unchanged.

    Nested dicts and lists are walked, so a TorchRec fused optimizer's
    ``state_dict()`` (per-row ``momentum1`` etc.) converts too. Not collective.
    """
    return _map_state(sd, lambda k, v: to_dtensor(v, name=k) if isinstance(v, ShardedTensor) else v)


def _dtensor_to_sharded(key: str, v: Any) -> Any:
    if not isinstance(v, DTensor):
        return v
    lay = layout_of(v, name=key)  # gathered once even for TorchRec's layout-less wrapper
    return v.to_local() if lay.kind is LayoutKind.REPLICATED else _sharded_from_layout(v, lay, None)


def state_dict_to_sharded_tensor(sd: Mapping[str, Any]) -> dict[str, Any]:
    """Every sharded DTensor in ``sd`` (nested containers included) as a ShardedTensor (zero-copy).

    A replicated DTensor becomes its local tensor (TorchRec keeps data-parallel
    tables as plain tensors); other values are unchanged.
    """
    return _map_state(sd, _dtensor_to_sharded)
