"""``sharded_embedding_bag`` and ``sharded_embedding``: torch's functional lookups on DTensor tables.

Order of work on every rank (the same on all ranks, so nothing can hang):

1. validate the arguments locally (SPEC §4), recording - not raising - a failure;
2. one agreement ``all_gather``: every rank's verdict, batch sizes and options;
   any failure or disagreement raises on every rank;
3. send every rank's ids to the ranks that compute blocks of the table - a row-cut
   table's ids each only to the rank holding its row (:mod:`.route`; the counts
   travel in step 2) - in one ``all_to_all``; none when the table is fully
   replicated and needs no ``max_norm``;
4. ``max_norm``: renormalise the referenced stored rows in place;
5. the pooled lookup and its exchange (:mod:`.algorithms`);
6. ``mean``: divide by the true bag size; ``max``: empty bags give 0.

DTensor inputs (``input``, and ``offsets``/``per_sample_weights`` when they are
DTensors too; a plain ``offsets``/``per_sample_weights`` next to a DTensor
``input`` is taken as that rank's local part) must live on a 1-D mesh over all
ranks in rank order:

* ``Shard(0)`` (batch-sharded): each rank's local part is its own batch (local
  ``offsets`` index local ids); the plain-tensor path above runs unchanged and
  the output is a ``Shard(0)`` DTensor of all ranks' bags in rank order, with
  explicit shape. When the ranks' bag counts are not ``torch.chunk``'s even
  split, the output carries its true rows in a :class:`LocalShardsWrapper`
  (``convert.dtensor_from_local_shards``; read it with ``tdb.full_tensor``) and
  is not differentiable - pass even batches to train through it.
* ``Replicate()``: every rank holds the same whole batch. Validation runs
  locally and raises on every rank alike (the input is the same everywhere; the
  options must be too - they are not compared, as no collective runs), then:

  - replicated weight: a local lookup, a ``Replicate()`` output; no collective
    in forward or backward;
  - column-cut weight whose blocks are the even ``Shard(1)`` split in mesh order
    (one block per rank): each rank looks up its columns for the whole batch;
    ``Shard(1)`` output (last dim for ``sharded_embedding``); no collective in
    forward or backward until the output is gathered;
  - any other layout (row-wise, grid, uneven or several column blocks per rank,
    table-wise), ``sum``/``mean``: each rank pools the rows it stores (first
    copy of each block) into a ``Partial()`` (sum) output; ``mean`` divides by
    the true bag size locally, which is linear and so exact under the sum.
    ``full_tensor()`` / ``redistribute(Replicate())`` completes it with ONE
    ``all_reduce``; backward needs none (replicated blocks excepted);
  - ``mode="max"`` on those layouts (a ``Partial("max")`` would give ``-inf``
    for empty bags and could not pick torch's winner): falls back to splitting
    the bags evenly (``torch.chunk``) and running the plain-tensor path on each
    rank's chunk; ``Shard(0)`` output.

  ``max_norm`` still renormalises first (one ``all_reduce`` of partial norms
  when rows are cut into column pieces).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..convert.dtensor import dtensor_from_local_shards, layout_of, local_shards_of
from ..layout import ShardLayout, contiguous_strides
from .algorithms import LookupPlan, Strategy, pooled_lookup, strategy_for
from .renorm import renormalize
from .run import TableOptions, agree_and_route, finish, option_codes, psw_grad, run_tables
from ..optim import FusedOptimizer
from .validate import (
    Bags,
    RejectedArguments,
    bind_optimizer,
    bags_for_embedding,
    bags_from_input,
    check_options,
)

__all__ = ["sharded_embedding", "sharded_embedding_bag"]


def _check_weight(fn: str, weight: object) -> DTensor:
    if not isinstance(weight, DTensor):
        raise RejectedArguments(TypeError, f"{fn}: weight must be a DTensor, got {type(weight).__name__}")
    return weight


_REPLICATE, _SHARD = "replicate", "shard0"


def _dtensor_inputs(fn: str, input: object, **others: object) -> tuple[str | None, Any, dict[str, Any], Any]:
    """Classify a DTensor ``input``; return (kind, local input, local others, mesh). Local; raises
    :class:`RejectedArguments`. ``kind`` is ``None`` for a plain input."""
    if not isinstance(input, DTensor):
        for name, v in others.items():
            if isinstance(v, DTensor):
                raise RejectedArguments(TypeError, f"{fn}: {name} is a DTensor but input is not; pass both as DTensors")
        return None, input, others, None
    mesh = input.device_mesh
    world = dist.get_world_size()
    if mesh.ndim != 1 or mesh.mesh.tolist() != list(range(world)):
        raise RejectedArguments(
            NotImplementedError,
            f"{fn}: a DTensor input must live on a 1-D mesh over all {world} ranks in rank order, got {mesh}",
        )
    p = input.placements[0]
    if isinstance(p, Replicate):
        kind = _REPLICATE
    elif type(p) is Shard and p.dim in (0, -input.dim()):
        kind = _SHARD
    else:
        raise RejectedArguments(
            NotImplementedError, f"{fn}: DTensor input placements {list(input.placements)} are not supported "
            "(use [Replicate()] or [Shard(0)])"
        )
    local = {}
    for name, v in others.items():
        if isinstance(v, DTensor):
            if v.device_mesh != mesh or list(v.placements) != list(input.placements):
                raise RejectedArguments(
                    ValueError, f"{fn}: {name} must be on input's mesh with input's placements "
                    f"{list(input.placements)}, got {list(v.placements)}"
                )
            v = v.to_local()
        local[name] = v
    return kind, input.to_local(), local, mesh


def _chunk_rows(n: int, world: int) -> list[int]:
    block = -(-n // world) if world else 0
    return [max(0, min(block, n - min(r * block, n))) for r in range(world)]


def _rows_dtensor(out: torch.Tensor, rows: list[int], mesh: Any) -> DTensor:
    """This rank's ``out`` (``rows[rank]`` rows) as a ``Shard(0)`` DTensor of all ranks' rows."""
    shape = torch.Size((sum(rows),) + tuple(out.shape[1:]))
    if rows == _chunk_rows(sum(rows), len(rows)):
        return DTensor.from_local(out, mesh, [Shard(0)], run_check=False, shape=shape,
                                  stride=contiguous_strides(shape))
    flat = out.reshape(out.shape[0], -1)
    lay = ShardLayout.row_wise((sum(rows), flat.shape[1]), rows, dtype=out.dtype)
    if len(shape) != 2:
        raise NotImplementedError("uneven Shard(0) batches of a multi-dim sharded_embedding input are not supported")
    return dtensor_from_local_shards(lay, [out.detach()], device_mesh=mesh)


def _split_bags(bags: Bags, world: int, rank: int) -> Bags:
    """This rank's ``torch.chunk`` share of a replicated batch's bags."""
    counts = _chunk_rows(bags.num_bags, world)
    b0 = sum(counts[:rank])
    starts = torch.cat([bags.lengths.new_zeros(1), torch.cumsum(bags.lengths, 0)])
    i0, i1 = int(starts[b0]), int(starts[b0 + counts[rank]])
    w = None if bags.weights is None else bags.weights[i0:i1]
    return Bags(bags.ids[i0:i1], bags.lengths[b0 : b0 + counts[rank]], w)


def _even_columns(layout: ShardLayout, world: int) -> bool:
    """The weight's blocks are exactly ``Shard(1)``'s even split in rank order, one per rank."""
    d = layout.global_shape[1]
    block = -(-d // world)
    want = sorted((r, (0, min(r * block, d)), (layout.global_shape[0], max(0, min(block, d - min(r * block, d)))))
                  for r in range(world))
    return sorted((s.rank, s.offsets, s.sizes) for s in layout.shards) == want


def _replicated_input(
    weight: DTensor, bags: Bags, mesh: Any, *, mode: str, padding: int | None, skip_padding: bool,
    max_norm: float | None, norm_type: float, binding: Any = None,
) -> tuple[torch.Tensor, list, str] | None:
    """The zero-communication lookups of a replicated batch: (local output, placements, kind) with kind
    ``"columns"`` (local output is this rank's columns), ``"full"`` (Replicate/Partial, full width); or
    ``None`` for the fallback (max on a layout that would need a Partial max)."""
    layout = layout_of(weight)
    if layout.dtype is None:
        layout = dataclasses.replace(layout, dtype=weight.dtype)
    world = dist.get_world_size()
    strategy = strategy_for(layout, world)
    columns = strategy is Strategy.COLUMNS and _even_columns(layout, world)
    if mode == "max" and strategy is not Strategy.LOCAL and not columns:
        return None
    shards = local_shards_of(weight)
    if max_norm is not None:
        renormalize(layout, layout.shards_on(dist.get_rank()), shards, bags.ids, max_norm, norm_type, None)
    plan = LookupPlan(
        layout=layout, shards=shards, batch=bags, num_bags=[bags.num_bags] * world, max_mode=mode == "max",
        padding_idx=padding, skip_padding=skip_padding, track=weight.requires_grad and torch.is_grad_enabled(),
        local_only=True, optimizer=binding,
    )
    if strategy is Strategy.COLUMNS and not columns:
        plan.strategy = Strategy.REDUCE  # same blocks compute; summed into a partial instead
    (out,) = pooled_lookup([plan], [weight])
    out = finish(out, bags, mode, padding)
    if strategy is Strategy.LOCAL:
        return out, [Replicate()], "full"
    if columns:
        return out, [Shard(1)], "columns"
    return out, [Partial()], "full"


def sharded_embedding_bag(
    input: torch.Tensor,
    weight: DTensor,
    offsets: torch.Tensor | None = None,
    *,
    mode: str = "mean",
    per_sample_weights: torch.Tensor | None = None,
    padding_idx: int | None = None,
    include_last_offset: bool = False,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
    optimizer: FusedOptimizer | None = None,
) -> torch.Tensor:
    """``F.embedding_bag`` over a DTensor table of any layout; *collective*.

    ``input`` (with ``offsets``/``per_sample_weights``) is THIS rank's own batch;
    ranks may pass batches of different sizes. The result is this rank's own
    ``(num_bags, embedding_dim)`` output as a plain tensor, equal to
    ``F.embedding_bag(input, full_weight, ...)``. When ``weight.requires_grad``,
    backward fills ``weight.grad`` with a DTensor of the weight's layout holding
    the gradient of all ranks' batches. ``max_norm`` renormalises the stored rows
    referenced by any rank, in place.

    A DTensor ``input`` (``Replicate()`` or ``Shard(0)`` on a 1-D mesh over all
    ranks) gives a DTensor result: ``Shard(0)`` for a batch-sharded input;
    for a replicated input ``Replicate()``/``Shard(1)``/``Partial()`` by the
    weight's layout, with no collective in forward or backward (see the module
    docstring).

    With ``optimizer`` (a :class:`FusedOptimizer` holding ``weight``), backward
    updates the weight in place instead (``weight.grad`` stays ``None``).

    Raises:
        TypeError, ValueError, NotImplementedError: on every rank, when any rank's
            arguments are invalid (SPEC §4) or the ranks disagree on an option.

    Example::

        >>> out = sharded_embedding_bag(ids, dt_weight, offsets, mode="sum")
        >>> out.sum().backward()  # dt_weight.grad: a DTensor like dt_weight
    """
    fn = "sharded_embedding_bag"
    error, bags, padding, kind, mesh, bind = None, None, None, None, None, None
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    try:
        w = _check_weight(fn, weight)
        shape, dtype = tuple(w.shape), w.dtype
        bind = bind_optimizer(fn, optimizer, w)
        kind, input, local, mesh = _dtensor_inputs(fn, input, offsets=offsets, per_sample_weights=per_sample_weights)
        offsets, per_sample_weights = local["offsets"], local["per_sample_weights"]
        padding = check_options(
            fn, shape, mode=mode, padding_idx=padding_idx, max_norm=max_norm, norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq, sparse=sparse,
        )
        bags = bags_from_input(
            fn, input, offsets, per_sample_weights, rows=shape[0], mode=mode,
            include_last_offset=include_last_offset, weight_dtype=w.dtype,
        )
        if kind is not None and psw_grad(bags):
            raise RejectedArguments(NotImplementedError, f"{fn}: the gradient of per_sample_weights is computed "
                                    "for plain-tensor inputs only; pass per_sample_weights.detach() with a DTensor "
                                    "input")
    except RejectedArguments as e:
        if kind == _REPLICATE:
            raise e.kind(e.message) from None  # the same input on every rank: every rank raises alike
        error = e
    if kind == _REPLICATE:
        assert bags is not None
        done = _replicated_input(weight, bags, mesh, mode=mode, padding=padding, skip_padding=True,
                                 max_norm=max_norm, norm_type=norm_type, binding=bind)
        if done is not None:
            out, placements, _ = done
            gshape = torch.Size((bags.num_bags, shape[1]))
            return DTensor.from_local(out, mesh, placements, run_check=False, shape=gshape,
                                      stride=contiguous_strides(gshape))
        bags = _split_bags(bags, dist.get_world_size(), dist.get_rank())
    opts = [TableOptions(mode, padding, max_norm, norm_type)]
    infos, routes = agree_and_route(fn, error, [weight], None if bags is None else [bags], opts,
                                    [option_codes(0, mode, padding, max_norm, norm_type, shape, dtype, bind,
                                                  bags is not None and psw_grad(bags))])
    assert bags is not None
    (out,) = run_tables([weight], [bags], infos, opts, routes, skip_padding=True, bindings=[bind])
    out = finish(out, bags, mode, padding)
    if kind is None:
        return out
    return _rows_dtensor(out, [i.num_bags for i in infos[0]], mesh)


def sharded_embedding(
    input: torch.Tensor,
    weight: DTensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    *,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
    optimizer: FusedOptimizer | None = None,
) -> torch.Tensor:
    """``F.embedding`` over a DTensor table of any layout; *collective*.

    ``input`` (ids of any shape) is THIS rank's own batch; the result is
    ``input.shape + (embedding_dim,)`` as a plain tensor, equal to
    ``F.embedding(input, full_weight, ...)``; the ``padding_idx`` row is looked
    up but receives no gradient, as in torch. A DTensor ``input`` gives a
    DTensor result, as for :func:`sharded_embedding_bag` (a column-cut output is
    ``Shard`` on the last dim).

    ``optimizer``: as for :func:`sharded_embedding_bag`.

    Example::

        >>> rows = sharded_embedding(ids, dt_weight)  # (*ids.shape, dim)
    """
    fn = "sharded_embedding"
    error, bags, padding, kind, mesh, bind = None, None, None, None, None, None
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    try:
        w = _check_weight(fn, weight)
        shape, dtype = tuple(w.shape), w.dtype
        bind = bind_optimizer(fn, optimizer, w)
        kind, input, _, mesh = _dtensor_inputs(fn, input)
        padding = check_options(
            fn, shape, mode="sum", padding_idx=padding_idx, max_norm=max_norm, norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq, sparse=sparse,
        )
        bags = bags_for_embedding(fn, input, shape[0])
    except RejectedArguments as e:
        if kind == _REPLICATE:
            raise e.kind(e.message) from None  # the same input on every rank: every rank raises alike
        error = e
    if kind == _REPLICATE:
        assert bags is not None and isinstance(input, torch.Tensor)
        done = _replicated_input(weight, bags, mesh, mode="sum", padding=padding, skip_padding=False,
                                 max_norm=max_norm, norm_type=norm_type, binding=bind)
        assert done is not None  # only max falls back
        out, placements, how = done
        gshape = torch.Size(tuple(input.shape) + (shape[1],))
        out = out.view(tuple(input.shape) + (out.shape[1],))
        if how == "columns":
            placements = [Shard(input.dim())]
        return DTensor.from_local(out, mesh, placements, run_check=False, shape=gshape,
                                  stride=contiguous_strides(gshape))
    opts = [TableOptions("sum", padding, max_norm, norm_type)]
    infos, routes = agree_and_route(fn, error, [weight], None if bags is None else [bags], opts,
                                    [option_codes(1, "sum", padding, max_norm, norm_type, shape, dtype, bind)])
    assert bags is not None and isinstance(input, torch.Tensor)
    (out,) = run_tables([weight], [bags], infos, opts, routes, skip_padding=False, bindings=[bind])
    out = out.view(tuple(input.shape) + (shape[1],))
    if kind is None:
        return out
    per_row = max(1, int(torch.Size(input.shape[1:]).numel()))
    return _rows_dtensor(out, [i.num_bags // per_row for i in infos[0]], mesh)
