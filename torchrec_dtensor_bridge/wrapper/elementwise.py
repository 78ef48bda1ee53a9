"""The element-wise families of :class:`LocalShardsWrapper`'s ops: one handler for every op of a kind.

An element-wise op on a table is the same op on each of its blocks, so every handler here runs the op
once per local shard (a ``_foreach_*`` op: once for all the shards of all its tensors) and puts the
results back together as wrappers of the same layout:

- every op tagged ``torch.Tag.pointwise``: functional, in-place and ``out=``;
- every ``_foreach_*`` op of a pointwise op (``torch.optim``'s and ``clip_grad_norm_``'s);
- the ``*_like`` creation ops and the ops that draw random numbers (``uniform_``, ``normal_``,
  ``rand_like``, ``bernoulli``, ``native_dropout``, ...). Random ops fill each shard from its own stream,
  seeded from one draw of the caller's generator and the shard's offsets: ranks that share a seed
  draw the same numbers for the same block, and no two blocks repeat a stream.

The other operands are taken shard by shard (:func:`operand_part`): a wrapper of the same blocks gives
its shard; a 0-dim tensor or a scalar is used as is; a tensor of the table's shape, or one broadcast
against it, gives the slice of each block. A wrapper of other blocks, or a plain tensor that matches
neither the table nor this rank's blocks (DTensor's even split of an operand of another layout), is
refused with a ``ValueError`` naming both.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._compat import pytree
from ..layout import ShardLayout, chunk_span
from .local_shards_wrapper import LocalShardsWrapper
from .op_table import implements_family

__all__ = [
    "check_operand", "describe", "dtensor_even_split", "empty_of", "foreach_expand", "foreach_regroup", "like",
    "operand_part", "rewrap",
]

aten = torch.ops.aten


# --------------------------------------------------------------------------- shared helpers
def describe(w: LocalShardsWrapper) -> str:
    lay = w.layout_of_table
    name = f"table {lay.name!r}: " if lay is not None else ""
    blocks = w.block_key()
    return (f"{name}offsets {[list(o) for o, _ in blocks]} sizes {[list(s) for _, s in blocks]} "
            f"of {list(w.global_shape)}")


def _layout_in(w: LocalShardsWrapper, dtype: torch.dtype) -> ShardLayout | None:
    """``w``'s table layout recording ``dtype`` (what every rank's result of a casting op must agree on)."""
    layout = w.layout_of_table
    if layout is not None and layout.dtype not in (None, dtype):
        layout = dataclasses.replace(layout, dtype=dtype)
    return layout


def like(w: LocalShardsWrapper, shards: list[torch.Tensor]) -> LocalShardsWrapper:
    """A wrapper of ``w``'s blocks over ``shards`` (the layout's dtype follows the shards')."""
    return w._like(shards, _layout_in(w, shards[0].dtype) if shards else w.layout_of_table)


def empty_of(w: LocalShardsWrapper, dtype: torch.dtype | None = None,
             device: torch.device | None = None) -> LocalShardsWrapper:
    """A wrapper of ``w``'s table holding no shard (a rank outside the table), of ``dtype`` and ``device``."""
    dtype = dtype or w.dtype
    return LocalShardsWrapper([], [], w._global_shape, layout=_layout_in(w, dtype), dtype=dtype,
                              device=device or w.device)


def rewrap(w: LocalShardsWrapper, shards: list[torch.Tensor], dtype: torch.dtype | None = None,
           device: torch.device | None = None) -> LocalShardsWrapper:
    """:func:`like`, or, for a wrapper holding no shard, :func:`empty_of`."""
    if shards or not w.is_empty_shard():
        return like(w, shards)
    return empty_of(w, dtype, device)


def dtensor_even_split(layout: ShardLayout | None) -> bool:
    """Whether ``layout``'s blocks are DTensor's own even split along its Shard dim, in rank order (then a
    plain local tensor of this rank's block shape is the same block). A table in one block is not: it lives
    on a mesh of several ranks (a one-rank mesh holds it exactly, with no wrapper)."""
    if layout is None:
        return True
    dim = layout.nearest_shard_dim
    shards = layout.shards
    if dim is None or len(shards) < 2 or len({s.rank for s in shards}) != len(shards) or list(shards) != sorted(
            shards, key=lambda s: s.rank or 0):
        return False
    extent = layout.global_shape[dim]
    return all(
        (s.offsets[dim], s.sizes[dim]) == chunk_span(extent, len(shards), i)
        and all(s.sizes[d] == layout.global_shape[d] for d in range(layout.ndim) if d != dim)
        for i, s in enumerate(shards)
    )


def check_operand(w: LocalShardsWrapper, other: Any, op: Any) -> None:
    """Refuse an operand that cannot meet ``w``'s blocks, whatever this rank holds (a rank holding nothing
    refuses it too, so every rank of a DTensor op raises alike): a wrapper of other blocks; a plain tensor
    of more dims; on a layout that is not DTensor's own even split, a plain tensor that does not broadcast
    against the whole table (DTensor's even piece of an operand of another layout, moved to this Shard dim).
    """
    if isinstance(other, LocalShardsWrapper):
        if other is not w and other.block_key() != w.block_key():
            raise ValueError(f"{op}: wrappers differ in layout: {describe(w)} vs {describe(other)}")
        return
    if not isinstance(other, torch.Tensor) or other.dim() == 0:
        return
    if other.dim() > w.dim():
        raise ValueError(f"{op}: an operand of shape {list(other.shape)} has more dims than {describe(w)}")
    if dtensor_even_split(w.layout_of_table):
        return
    lead = w.dim() - other.dim()
    if any(size not in (1, w.global_shape[lead + k]) for k, size in enumerate(other.shape)):
        raise ValueError(
            f"{op}: an operand of shape {list(other.shape)} matches neither the table nor this rank's "
            f"blocks ({describe(w)}); a DTensor of another layout? Give both operands one layout "
            f"(tdb.to_dtensor / dtensor_from_local_shards with the table's layout)"
        )


def operand_part(w: LocalShardsWrapper, other: Any, i: int, op: Any) -> Any:
    """The part of ``other`` that meets ``w``'s local shard ``i`` (see the module docstring); the operand
    passed :func:`check_operand`."""
    if isinstance(other, LocalShardsWrapper):
        return other._local_shards[i]
    if not isinstance(other, torch.Tensor) or other.dim() == 0:
        return other
    shards = w.local_shards()
    if w.layout_of_table is None and other.shape == w.shape and len(shards) > 1:
        # a wrapper on its own (no table layout: never a DTensor's of ours) takes its shards packed
        # along their stacked dim; inside a DTensor that shape could be DTensor's even piece instead
        return w.split_packed(other)[i]
    shard, offsets = shards[i], w.local_offsets()[i]
    if other.shape == shard.shape and len(shards) == 1 and dtensor_even_split(w.layout_of_table):
        return other
    lead = shard.dim() - other.dim()
    index: list[slice] = []
    for k, size in enumerate(other.shape):
        d = lead + k
        if size == 1:
            index.append(slice(None))
        elif size == w.global_shape[d]:
            index.append(slice(offsets[d], offsets[d] + shard.shape[d]))
        else:
            raise ValueError(
                f"{op}: an operand of shape {list(other.shape)} matches neither the table nor this rank's "
                f"blocks ({describe(w)}); a DTensor of another layout? Give both operands one layout "
                f"(tdb.to_dtensor / dtensor_from_local_shards with the table's layout)"
            )
    return other[tuple(index)]


def _wrappers_in(tree: Any) -> list[LocalShardsWrapper]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, LocalShardsWrapper)]


def _written(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The inputs ``func`` writes and returns (in-place ``self``, ``out=``), in the order of its returns."""
    schema = func._schema
    by_set = {}
    for pos, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is not None and info.is_write:
            value = kwargs[arg.name] if arg.name in kwargs else (args[pos] if pos < len(args) else None)
            for s in info.before_set:
                by_set[s] = value
    out = []
    for ret in schema.returns:
        info = ret.alias_info
        if info is None or not info.is_write:
            return []
        out.append(next(by_set[s] for s in info.before_set))
    return out


def _rebuild_outputs(ref: LocalShardsWrapper, per_shard: list[Any], template: Any) -> Any:
    """The results of one op per shard, put together: a wrapper of ``ref``'s blocks per tensor output."""
    if not per_shard:
        leaves, spec = pytree.tree_flatten(template)
        return pytree.tree_unflatten(
            [rewrap(ref, [], x.dtype, x.device) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
    flat = [pytree.tree_flatten(r) for r in per_shard]
    leaves0, spec = flat[0]
    out = []
    for k, leaf in enumerate(leaves0):
        if isinstance(leaf, torch.Tensor):
            out.append(like(ref, [f[0][k] for f in flat]))
        else:
            out.append(leaf)
    return pytree.tree_unflatten(out, spec)


def _stand_in(x: Any) -> Any:
    """For a rank holding no shard: an empty tensor of the wrapper's dtype that keeps its dims."""
    if isinstance(x, LocalShardsWrapper):
        return torch.empty((0,) * x.dim(), dtype=x.dtype, device=x.device)
    return x


def _per_shard(func: Any, args: tuple, kwargs: dict, shard_kwargs: Any = None) -> Any:
    """``func`` once per local shard of the first wrapper among its operands."""
    wrappers = _wrappers_in((args, kwargs))
    ref = wrappers[0]
    written = _written(func, args, kwargs)
    n = len(ref.local_shards())
    results = []
    leaves, spec = pytree.tree_flatten((args, kwargs))
    for x in leaves:  # all checked before any write, on every rank alike (other wrappers' blocks included)
        check_operand(ref, x, func)
    parts = [[operand_part(ref, x, i, func) for x in leaves] for i in range(n)]
    for i in range(n):
        a, k = pytree.tree_unflatten(parts[i], spec)
        if shard_kwargs is not None:
            k = {**k, **shard_kwargs(ref, i)}
        results.append(func(*a, **k))
    if written:
        return written[0] if len(written) == 1 else tuple(written)
    if n:
        return _rebuild_outputs(ref, results, None)
    try:
        template = func(*pytree.tree_map(_stand_in, args), **pytree.tree_map(_stand_in, kwargs))
    except RuntimeError:  # an operand that does not broadcast against the stand-in: keep the dtype
        template = _stand_in(ref)
    return _rebuild_outputs(ref, [], template)


# --------------------------------------------------------------------------- creation and random ops
def _is_pointwise(func: Any) -> bool:
    return torch.Tag.pointwise in getattr(func, "tags", ())


_LIKE = {"empty_like", "zeros_like", "ones_like", "full_like"}


_RANDOM_FILLS = {"uniform_", "normal_", "normal", "random_", "exponential_", "geometric_", "log_normal_",
                 "cauchy_", "bernoulli_", "bernoulli"}


def _is_random(func: Any) -> bool:
    """An element-wise op drawing random numbers (not, say, ``multinomial``, which draws per row)."""
    if not any(a.name == "generator" for a in func._schema.arguments):
        return False
    return _is_pointwise(func) or func._schema.name.split("::")[-1] in _RANDOM_FILLS


def _is_like(func: Any) -> bool:
    return func._schema.name.split("::")[-1] in _LIKE


@implements_family("like", _is_like)
def _like_op(func, args, kwargs):
    return _per_shard(func, args, kwargs)


def _shard_seed(base: int, offsets: Sequence[int]) -> int:
    text = repr((base, tuple(int(o) for o in offsets))).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


@implements_family("random", _is_random)
def _random(func, args, kwargs):
    ref = _wrappers_in((args, kwargs))[0]
    gen = kwargs.get("generator")
    # one draw of the caller's stream (ranks that share a seed agree on it), then one stream per block
    base = int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device if gen is not None else "cpu"))
    kwargs = {k: v for k, v in kwargs.items() if k != "generator"}

    def seeded(w: LocalShardsWrapper, i: int) -> dict:
        shard = w.local_shards()[i]
        g = torch.Generator(device=shard.device)
        g.manual_seed(_shard_seed(base, w.local_offsets()[i]))
        return {"generator": g}

    return _per_shard(func, args, kwargs, shard_kwargs=seeded)


# --------------------------------------------------------------------------- pointwise ops
@implements_family("pointwise", _is_pointwise)
def _pointwise(func, args, kwargs):
    return _per_shard(func, args, kwargs)


# --------------------------------------------------------------------------- _foreach_* ops
def _foreach_base(func: Any) -> Any | None:
    """The single-tensor op a ``_foreach_*`` op applies (``None``: not a foreach op)."""
    name = func._schema.name.split("::")[-1]
    if not name.startswith("_foreach_"):
        return None
    base = name[len("_foreach_"):]
    return getattr(aten, base, None) or getattr(aten, base.rstrip("_"), None)


def _is_foreach_pointwise(func: Any) -> bool:
    base = _foreach_base(func)
    if base is None:
        return False
    return any(torch.Tag.pointwise in getattr(base, o).tags for o in base.overloads()) or base in (
        aten.copy_, aten.zero_)


def _list_args(func: Any, args: tuple, kwargs: dict) -> list[tuple[int | str, list]]:
    found: list[tuple[int | str, list]] = []
    for pos, a in enumerate(args):
        if isinstance(a, (list, tuple)):
            found.append((pos, list(a)))
    for name, a in kwargs.items():
        if isinstance(a, (list, tuple)):
            found.append((name, list(a)))
    return found


def foreach_expand(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict, list[tuple[Any, int]]]:
    """``args`` and ``kwargs`` with every list entry that is (or meets) a wrapper replaced by one entry per
    local shard; and, per original entry, its reference wrapper (or ``None``) and how many entries it became.
    Every operand is checked before anything runs."""
    lists = _list_args(func, args, kwargs)
    length = len(lists[0][1])
    refs: list[Any] = []
    for j in range(length):
        ref = next((lst[j] for _, lst in lists if j < len(lst) and isinstance(lst[j], LocalShardsWrapper)),
                   None)
        refs.append(ref)
    expanded = {}
    for where, lst in lists:
        out: list[Any] = []
        for j, x in enumerate(lst):
            ref = refs[j]
            if ref is None:
                out.append(x)
                continue
            check_operand(ref, x, func)
            if isinstance(x, LocalShardsWrapper):  # its shards, once its blocks match
                out.extend(x._local_shards)
            else:
                out.extend(operand_part(ref, x, i, func) for i in range(len(ref._local_shards)))
        expanded[where] = out
    new_args = tuple(expanded.get(pos, a) for pos, a in enumerate(args))
    new_kwargs = {k: expanded.get(k, v) for k, v in kwargs.items()}
    counts = [(ref, 1 if ref is None else len(ref.local_shards())) for ref in refs]
    return new_args, new_kwargs, counts


@implements_family("foreach", _is_foreach_pointwise)
def _foreach(func, args, kwargs):
    new_args, new_kwargs, counts = foreach_expand(func, args, kwargs)
    if not any(count for _, count in counts):  # only wrappers holding no shard: nothing to run
        if func._schema.name.endswith("_"):
            return None
        return [rewrap(ref, []) for ref, _ in counts]
    result = func(*new_args, **new_kwargs)
    if not isinstance(result, (list, tuple)):  # in place: nothing returned
        return result
    return foreach_regroup(result, counts, rewrap)


def foreach_regroup(results: Sequence[Any], counts: list[tuple[Any, int]],
                    combine: Callable[[LocalShardsWrapper, list[Any]], Any]) -> list[Any]:
    """The results of a foreach op over :func:`foreach_expand`'s lists, one per original entry:
    ``combine(wrapper, its shards' results)`` for a wrapper's entries, the result itself for any other."""
    out, at = [], 0
    for ref, count in counts:
        part = list(results[at:at + count])
        at += count
        out.append(part[0] if ref is None else combine(ref, part))
    return out
