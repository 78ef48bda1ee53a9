"""Reductions and the gather of :class:`LocalShardsWrapper`: what DTensor asks of a table's local shards.

A DTensor whose local tensor is a wrapper carries one ``Shard`` placement, on the layout's
:attr:`~..layout.ShardLayout.nearest_shard_dim` ``p``. DTensor reduces across ranks along ``p`` only, so:

1. a reduction over ``p`` (a full reduction included) gives one plain tensor of the result's whole shape,
   each local block's partial result combined into its place and the identity elsewhere (0 for a sum or
   a norm, -inf for a maximum): DTensor's ``Partial`` all-reduce then completes it;
2. a reduction over dims no block is cut in gives a wrapper of the reduced blocks (offsets with the
   reduced dims dropped): DTensor keeps its ``Shard`` placement;
3. a reduction over a cut dim other than ``p`` (a grid reduced over its columns alone) would need the
   blocks of other ranks: ``NotImplementedError`` saying so, never a partial answer.

A box held by several ranks of the group DTensor reduces over (or twice by one rank) counts once there:
:func:`mark_reduction_group` (run by DTensor before its own path, for DTensors over a wrapper whose layout
holds copies) records the group's members on the wrapper, and only the first copy of each box among them
(:meth:`~..layout.ShardLayout.first_copies`) enters a combined result; copies on other lines of a 2-D mesh
reduce in their own groups.

A mean is not a sum of means on an uneven cut: :func:`dtensor_mean` (run by DTensor for DTensors over a
wrapper) takes the table's sum and divides by the table's count. ``_foreach_norm`` gives each table's
norm from its shards' norms. The gather DTensor runs to replicate a table (``full_tensor()``,
``redistribute``) assembles the table from every rank's blocks by the layout, so it is right for uneven
cuts, several blocks per rank and grids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._compat import group_ranks, outside_tracing_modes
from ..blocks import check_covered, contributions, pack, unpack
from ..groups import comm_group
from ..layout import ShardLayout, ShardSpec, chunk_span
from .elementwise import describe, dtensor_even_split, foreach_expand, foreach_regroup
from .local_shards_wrapper import LocalShardsWrapper
from .op_table import implements

__all__ = ["REDUCTIONS_OVER_GROUPS", "dtensor_mean", "mark_reduction_group"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

_KIND = {
    aten.sum.default: "sum", aten.sum.dim_IntList: "sum",
    aten.mean.default: "mean", aten.mean.dim: "mean",
    aten.amax.default: "max", aten.max.default: "max",
    aten.amin.default: "min", aten.min.default: "min",
    aten.linalg_vector_norm.default: "norm",
    aten.any.default: "max", aten.any.dim: "max", aten.any.dims: "max",
    aten.all.default: "min", aten.all.dim: "min",
}
_FULL = (aten.sum.default, aten.mean.default, aten.max.default, aten.min.default, aten.any.default,
         aten.all.default)


def _arg(args: tuple, kwargs: dict, pos: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[pos] if len(args) > pos else default


def _dims_of(func: Any, args: tuple, kwargs: dict, ndim: int) -> tuple[list[int], bool]:
    """The reduced dims (sorted, non-negative) and ``keepdim`` of a reduction call."""
    if func in _FULL:
        return list(range(ndim)), False
    pos = 2 if func is aten.linalg_vector_norm.default else 1
    dims = _arg(args, kwargs, pos, "dim", None)
    keepdim = bool(_arg(args, kwargs, pos + 1, "keepdim", False))
    if dims is None or (isinstance(dims, Sequence) and len(dims) == 0):
        return list(range(ndim)), keepdim
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted({d % ndim if ndim else 0 for d in dims}), keepdim


def _reduced(offsets: Sequence[int], sizes: Sequence[int], dims: list[int], keepdim: bool):
    off, size = [], []
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        if d not in dims:
            off.append(o)
            size.append(s)
        elif keepdim:
            off.append(0)
            size.append(1)
    return tuple(off), tuple(size)


def _result_dtype(func: Any, w: LocalShardsWrapper, args: tuple, kwargs: dict) -> torch.dtype:
    one = torch.zeros((1,) * w.dim(), dtype=w.dtype, device="meta")
    return func(one, *args[1:], **kwargs).dtype


def _identity(kind: str, ord_: float, dtype: torch.dtype) -> float:
    """What a rank holding nothing of a result element contributes (norms are never negative: 0)."""
    if kind == "max":
        return False if dtype is torch.bool else -math.inf if dtype.is_floating_point else torch.iinfo(dtype).min
    if kind == "min" or (kind == "norm" and ord_ == -math.inf):
        return True if dtype is torch.bool else math.inf if dtype.is_floating_point else torch.iinfo(dtype).max
    return 0


def combine_norms(norms: torch.Tensor, ord_: float, dim: int = 0) -> torch.Tensor:
    """The norm of a whole from the norms of its parts (stacked along ``dim``)."""
    if ord_ == math.inf:
        return norms.amax(dim)
    if ord_ == -math.inf:
        return norms.amin(dim)
    if ord_ == 0:
        return norms.sum(dim)
    return torch.linalg.vector_norm(norms, ord_, dim=dim)


def _norm_ord(func: Any, args: tuple, kwargs: dict) -> float:
    return float(_arg(args, kwargs, 1, "ord", 2))


def _at(box: tuple[Sequence[int], Sequence[int]]) -> tuple[slice, ...]:
    """The index of the block ``box`` (offsets, sizes) in a tensor of the whole."""
    return tuple(slice(o, o + s) for o, s in zip(*box))


def _place(out: torch.Tensor, box, part: torch.Tensor, kind: str, ord_: float) -> None:
    """Combine one block's partial result into ``out`` at ``box``."""
    view = out[_at(box)]
    if kind == "max" or (kind == "norm" and ord_ == math.inf):
        torch.maximum(view, part.to(view.dtype), out=view)
    elif kind == "min" or (kind == "norm" and ord_ == -math.inf):
        torch.minimum(view, part.to(view.dtype), out=view)
    elif kind == "norm" and ord_ != 0:
        view.add_(part.to(view.dtype).abs().pow(ord_))
    else:
        view.add_(part.to(view.dtype))


_MEMBERS = "_reduce_members"
"""The wrapper attribute :func:`mark_reduction_group` sets: the global ranks DTensor reduces it over."""


def _counted(w: LocalShardsWrapper) -> tuple[bool, ...] | None:
    """Which local shards enter a result combined across ranks (``None``: all): the first copy of each box
    among the ranks DTensor reduces over, where :func:`mark_reduction_group` recorded them."""
    members = w.__dict__.get(_MEMBERS)
    layout = w.layout_of_table
    if members is None or layout is None:
        return None
    counted = layout.first_copies(dist.get_rank() if dist.is_initialized() else 0, members)
    return counted if len(counted) == len(w.local_shards()) else None


REDUCTIONS_OVER_GROUPS = (aten.sum.default, aten.sum.dim_IntList, aten.linalg_vector_norm.default,
                          aten._foreach_norm.Scalar)
"""The reductions that add up copies (a maximum or minimum takes a copy twice harmlessly)."""


def mark_reduction_group(op: Any, args: tuple, kwargs: dict) -> Any:
    """Before DTensor reduces a DTensor (or a list of them) over a wrapper whose layout holds a box more than
    once, record on the wrapper the members of the group DTensor reduces it over, so that each box counts
    once among them. Always ``NotImplemented``: DTensor's own path then runs."""
    xs = args[0] if isinstance(args[0], (list, tuple)) else (args[0],)
    for x in xs:
        local = getattr(x, "_local_tensor", None)
        if isinstance(local, LocalShardsWrapper) and local.layout_of_table is not None \
                and local.layout_of_table.has_copies and x.device_mesh.get_coordinate() is not None:
            with outside_tracing_modes():  # the mesh's ranks are a real tensor, also under torch.compile
                setattr(local, _MEMBERS, comm_group(x).members)
    return NotImplemented


@implements(*_KIND)
def _reduce(func, args, kwargs):
    w: LocalShardsWrapper = args[0]
    kind = _KIND[func]
    dims, keepdim = _dims_of(func, args, kwargs, w.dim())
    layout = w.layout_of_table
    p = (layout.nearest_shard_dim if layout is not None else w.stack_dim) if w.dim() else None
    gshape = tuple(w.global_shape)
    out_box = [_reduced(o, s.shape, dims, keepdim) for o, s in zip(w.local_offsets(), w.local_shards())]
    out_shape = _reduced([0] * len(gshape), gshape, dims, keepdim)[1]
    dtype = _result_dtype(func, w, args, kwargs)
    ord_ = _norm_ord(func, args, kwargs) if kind == "norm" else 2.0
    if p is not None and p in dims:  # 1. DTensor completes it with a Partial all-reduce
        parts_func = aten.sum.dim_IntList if kind == "mean" else func
        part_args = (dims, keepdim) if kind == "mean" else args[1:]
        part_kwargs = {"dtype": kwargs.get("dtype")} if kind == "mean" else kwargs
        out = torch.full(out_shape, _identity(kind, ord_, dtype), dtype=dtype, device=w.device)
        count = torch.zeros(out_shape, dtype=torch.int64, device=w.device) if kind == "mean" else None
        counted = _counted(w) or (True,) * len(out_box)
        for shard, box, counts in zip(w.local_shards(), out_box, counted):
            if shard.numel() and counts:
                part = parts_func(shard, *part_args, **part_kwargs)
                _place(out, box, part, kind, ord_)
                if count is not None:
                    count[_at(box)] += math.prod(shard.shape[d] for d in dims)
        if kind == "norm" and ord_ not in (0, math.inf, -math.inf):
            out = out.pow(1.0 / ord_)
        if count is not None:
            out = out / count
        return out
    cut = layout.cut_dims if layout is not None else {
        d for d in range(w.dim()) if len({o[d] for o in w.local_offsets()}) > 1}
    if cut & set(dims):  # 3.
        name = layout.name if layout is not None else "table"
        raise NotImplementedError(
            f"{func} over dims {dims} of table {name!r} (cut along dims {sorted(cut)}, spread over ranks along "
            f"dim {p}) needs the blocks of other ranks; reduce over dim {p} too, or take "
            f"tdb.full_tensor() first"
        )
    parts = [func(s, *args[1:], **kwargs) for s in w.local_shards()]  # 2.
    red_layout = None
    if layout is not None:
        specs = tuple(ShardSpec(s.rank, *_reduced(s.offsets, s.sizes, dims, keepdim), s.device)
                      for s in layout.shards)
        red_layout = ShardLayout(out_shape, specs, dtype, layout.name)
    return LocalShardsWrapper(parts, [b[0] for b in out_box], out_shape, layout=red_layout, dtype=dtype,
                              device=w.device, _trusted=True)


@implements(aten._foreach_norm.Scalar)
def _foreach_norm(func, args, kwargs):
    new_args, new_kwargs, counts = foreach_expand(func, args, kwargs)
    norms = func(*new_args, **new_kwargs) if any(count for _, count in counts) else []
    ord_ = _norm_ord(func, args, kwargs)

    def table_norm(ref: LocalShardsWrapper, parts: list[torch.Tensor]) -> torch.Tensor:
        counted = _counted(ref)
        if counted is not None:
            parts = [p for p, c in zip(parts, counted) if c]
        if parts:
            return combine_norms(torch.stack(parts), ord_)
        dtype = kwargs.get("dtype") or ref.dtype  # holds nothing: what the ranks' combination ignores
        return torch.full((), _identity("norm", ord_, dtype), dtype=dtype, device=ref.device)

    return foreach_regroup(norms, counts, table_norm)


def dtensor_mean(op: Any, args: tuple, kwargs: dict) -> Any:
    """``aten.mean`` of a DTensor over a wrapper: the table's sum over the table's count (DTensor's own
    mean averages the ranks' means, which is wrong for an uneven cut). ``NotImplemented`` for any other
    DTensor (DTensor's own path runs)."""
    x = args[0]
    if not isinstance(getattr(x, "_local_tensor", None), LocalShardsWrapper):
        return NotImplemented
    dims, keepdim = _dims_of(op, args, kwargs, x.dim())
    dtype = kwargs.get("dtype")
    if dtype is None and not (x.dtype.is_floating_point or x.dtype.is_complex):
        raise RuntimeError(f"mean(): could not infer output dtype. Input dtype must be either a floating point "
                           f"or complex dtype. Got: {x.dtype}")
    total = torch.sum(x, dim=dims, keepdim=keepdim, dtype=dtype)
    return total / math.prod(x.shape[d] for d in dims)


# ------------------------------------------------------------------------------------- gathers
@implements(c10d.all_gather_into_tensor.default)
def _all_gather(func, args, kwargs):
    """DTensor's gather of a table along its Shard dim: the whole table, laid out as DTensor expects
    (``ceil(n / ranks)``-long chunks of the Shard dim, padded, one after another along dim 0)."""
    w, group_size, group_name = args[0], int(args[1]), args[2]
    layout = w.layout_of_table
    if layout is None or (dtensor_even_split(layout) and len(layout.shards) == group_size
                          and layout.global_shape[layout.nearest_shard_dim or 0] % group_size == 0):
        # every rank's local tensor is its chunk of DTensor's own split, none padded (or the layout is
        # unknown); a split with a shorter last chunk (13 rows on 2 ranks: 7 + 6) takes the path below,
        # which sends every rank's buffer at the padded chunk size DTensor expects
        return func(w.pack().contiguous(), *args[1:], **kwargs)
    ranks = group_ranks(group_name)
    part = layout.on_ranks(ranks)  # in group ranks
    check_covered(part, ranks)
    me = ranks.index(dist.get_rank())
    per_rank, width = contributions(part, group_size)
    buf = pack(per_rank[me], list(zip(part.shards_on(me), w.local_shards())), width, w.dtype, w.device)
    gathered = c10d.wait_tensor(func(buf, group_size, group_name)).view(group_size, width)
    full = unpack(torch.empty(layout.global_shape, dtype=w.dtype, device=w.device), per_rank, gathered)
    p = layout.nearest_shard_dim or 0
    chunk = -(-layout.global_shape[p] // group_size)
    pad = chunk * group_size - layout.global_shape[p]
    if pad:
        full = torch.cat([full, full.new_zeros(*full.shape[:p], pad, *full.shape[p + 1:])], dim=p)
    return full if p == 0 else torch.cat(full.split(chunk, dim=p), dim=0)


def _no_redistribution(w: LocalShardsWrapper, func: Any) -> NotImplementedError:
    layout = w.layout_of_table
    cut = sorted(layout.cut_dims) if layout is not None else "unknown"
    return NotImplementedError(
        f"{describe(w)}: DTensor asked for {func} to move the table to another Shard dim (a redistribute(), "
        f"or an op between DTensors of different placements); a table cut along dims {cut} moves to "
        f"Replicate() (full_tensor()), to Shard of its own cut dim, or to Shard of a dim no block is cut in. "
        f"Take redistribute(mesh, [Replicate()]) first, or give both operands the same layout"
    )


@implements(aten.constant_pad_nd.default, aten.pad.default)
def _pad(func, args, kwargs):
    """Constant padding at the end of dims, which DTensor asks for right before it gathers:

    * along the Shard dim (before a gather along it): the gather assembles the table from the layout
      whatever the local sizes, so the shards stay as they are;
    * along a dim no block is cut in (before a move to ``Shard`` of that dim, which a CPU mesh makes as
      a gather then a chunk): every block is padded at its end, and the layout's table with it.

    Anything else (padding before the data, a non-constant mode, a cut dim other than the Shard dim:
    a grid's columns) is refused, on every rank alike (the layout is the same everywhere)."""
    w, pad = args[0], list(args[1])
    mode = "constant"
    if func is aten.pad.default:
        mode = args[2] if len(args) > 2 else kwargs.get("mode", "constant")
    value = args[2] if func is aten.constant_pad_nd.default and len(args) > 2 else kwargs.get("value", 0)
    if func is aten.pad.default and len(args) > 3:
        value = args[3]
    layout = w.layout_of_table
    p = layout.nearest_shard_dim if layout is not None else None
    after = {w.dim() - 1 - k // 2: int(v) for k, v in enumerate(pad) if v and k % 2 == 1}
    before = [k for k, v in enumerate(pad) if v and k % 2 == 0]
    if layout is None or p is None or before or mode != "constant":
        raise _no_redistribution(w, func)
    # DTensor pads this rank's local tensor to a target extent; along an uncut dim the table grows to it
    # (a wrapper holding nothing has size 0 there). Along p DTensor's amount may even be negative.
    held = bool(w.local_shards())
    extra = {d: (w.shape[d] if held else 0) + v - layout.global_shape[d] for d, v in after.items() if d != p}
    if not extra:
        return w._like(list(w.local_shards()))
    if set(extra) & layout.cut_dims or any(v < 0 for v in extra.values()):
        raise _no_redistribution(w, func)
    return _padded(w, layout, extra, value or 0)


def _padded(w: LocalShardsWrapper, layout: ShardLayout, extra: dict[int, int], value: Any) -> LocalShardsWrapper:
    """``w`` with every block and the table padded by ``extra[d]`` elements at the end of each uncut dim
    ``d`` (new storage: padding cannot be a view)."""
    def grown(sizes: Sequence[int]) -> tuple[int, ...]:
        return tuple(n + extra.get(d, 0) for d, n in enumerate(sizes))

    shards = []
    for t in w.local_shards():
        pads: list[int] = []
        for d in reversed(range(t.dim())):
            pads += [0, extra.get(d, 0)]
        shards.append(torch.nn.functional.pad(t, pads, value=value))
    specs = tuple(ShardSpec(s.rank, s.offsets, grown(s.sizes), s.device) for s in layout.shards)
    new_layout = ShardLayout(grown(layout.global_shape), specs, layout.dtype, layout.name)
    return LocalShardsWrapper(shards, list(w.local_offsets()), new_layout.global_shape, layout=new_layout,
                              dtype=w.dtype, device=w.device, _trusted=True)


@implements(torch.ops._dtensor.shard_dim_alltoall.default)
def _shard_dim_alltoall(func, args, kwargs):
    """DTensor's move of a table to ``Shard(shard_dim)`` on an accelerator mesh: this rank's chunk of the
    table along ``shard_dim``, from the layout's gather (as DTensor itself does on a CPU mesh)."""
    w, gather_dim, shard_dim, group_name = args[0], int(args[1]), int(args[2]), args[3]
    ranks = group_ranks(group_name)
    full = _all_gather(c10d.all_gather_into_tensor.default, (w, len(ranks), group_name), {})
    full = torch.cat(full.chunk(len(ranks), dim=0), dim=gather_dim) if gather_dim else full
    start, length = chunk_span(full.shape[shard_dim], len(ranks), ranks.index(dist.get_rank()))
    return full.narrow(shard_dim, start, length).contiguous()


@implements(c10d.all_to_all_single.default)
def _all_to_all(func, args, kwargs):
    raise _no_redistribution(args[0], func)
