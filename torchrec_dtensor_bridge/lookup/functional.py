"""``sharded_embedding_bag`` and ``sharded_embedding``: torch's functional lookups on DTensor tables.

Order of work on every rank (the same on all ranks, so nothing can hang):

1. validate the arguments locally, recording - not raising - a failure;
0. resolve the weight once (:mod:`.plan`: layout, local shards, the call's
   group - the weight's mesh, its sharding axis on a 2-D mesh, or
   ``process_group`` - and strategy), collective-free;
2. one agreement ``all_gather`` on that group: every rank's verdict, batch
   sizes, options, a digest of the weight's layout and its input's kind; any
   failure or disagreement raises on every rank;
3. send every rank's ids to the ranks that compute blocks of the table - a row-cut
   table's ids each only to the rank holding its row (:mod:`.route`; the counts
   travel in step 2) - in one ``all_to_all``; none when the table is fully
   replicated and needs no ``max_norm``;
4. ``max_norm``: renormalise the referenced stored rows in place;
5. the pooled lookup and its exchange (:mod:`.algorithms`);
6. ``mean``: divide by the true bag size; ``max``: empty bags give 0.

DTensor inputs (``input``, and ``offsets``/``per_sample_weights`` when they are
DTensors too; a plain ``offsets``/``per_sample_weights`` next to a DTensor
``input`` is taken as that rank's local part) must live on a 1-D mesh over the
lookup's group in its rank order:

* ``Shard(0)`` (batch-sharded): each rank's local part is its own batch (local
  ``offsets`` index local ids); the plain-tensor path above runs unchanged and
  the output is a ``Shard(0)`` DTensor of all ranks' bags in rank order, with
  explicit shape. When the ranks' bag counts are not ``torch.chunk``'s even
  split, the output carries its true rows in a :class:`LocalShardsWrapper`
  (``convert.dtensor_from_local_shards``; read it with ``tdb.full_tensor``) and
  is not differentiable - pass even batches to train through it.
* ``Replicate()``: every rank holds the same whole batch - DTensor's contract:
  the caller guarantees it, and no collective checks it (no agreement step; a
  local failure raises on its rank only). Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
  (torch's switch for consistency checks of collectives) ONE small agreement
  ``all_gather`` runs first: a rank whose batch, kind or options differ from the
  others' makes every rank raise. Then:

  - replicated weight: a local lookup, a ``Replicate()`` output; no collective
    in forward or backward;
  - column-cut weight whose blocks are the even ``Shard(1)`` split in mesh order
    (one block per rank): each rank looks up its columns for the whole batch;
    ``Shard(1)`` output (last dim for ``sharded_embedding``); no data
    collective in forward or backward until the output is gathered;
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..convert.dtensor import dtensor_from_local_shards
from ..groups import CommGroup, comm_group
from ..layout import ShardLayout, chunk_sizes, contiguous_strides
from .algorithms import LookupPlan, Strategy, pooled_lookup
from .renorm import renormalize
from .plan import Bags, ResolvedTable, call_group, resolve_table
from .run import TableOptions, agree_and_route, finish, psw_grad, run_tables
from .validate import (
    InputKind,
    RejectedArguments,
    TableCodes,
    agree,
    bags_for_embedding,
    bags_from_input,
    batch_digest,
    bind_optimizer,
    check_options,
)

__all__ = ["sharded_embedding", "sharded_embedding_bag"]


def _input_kind(fn: str, input: object) -> tuple[InputKind, CommGroup | None]:
    """How ``input`` is passed, and the group of a DTensor input's mesh. Local; raises
    :class:`RejectedArguments`."""
    if not isinstance(input, DTensor):
        return InputKind.PLAIN, None
    mesh = input.device_mesh
    if mesh.ndim != 1:
        raise RejectedArguments(
            NotImplementedError, f"{fn}: a DTensor input must live on a 1-D mesh (the lookup group's), got {mesh}"
        )
    p = input.placements[0]
    if isinstance(p, Replicate):
        return InputKind.REPLICATE, comm_group(input)
    if type(p) is Shard and p.dim in (0, -input.dim()):
        return InputKind.SHARD, comm_group(input)
    raise RejectedArguments(
        NotImplementedError, f"{fn}: DTensor input placements {list(input.placements)} are not supported "
        "(use [Replicate()] or [Shard(0)])"
    )


def _local_inputs(fn: str, input: object, **others: object) -> tuple[Any, dict[str, Any]]:
    """The local parts of a DTensor ``input`` and of its companions. Local; raises :class:`RejectedArguments`."""
    if not isinstance(input, DTensor):
        for name, v in others.items():
            if isinstance(v, DTensor):
                raise RejectedArguments(TypeError, f"{fn}: {name} is a DTensor but input is not; pass both as DTensors")
        return input, others
    local = {}
    for name, v in others.items():
        if isinstance(v, DTensor):
            if v.device_mesh != input.device_mesh or list(v.placements) != list(input.placements):
                raise RejectedArguments(
                    ValueError, f"{fn}: {name} must be on input's mesh with input's placements "
                    f"{list(input.placements)}, got {list(v.placements)}"
                )
            v = v.to_local()
        local[name] = v
    return input.to_local(), local


def _edge(fn: str, weight: object, input: object, process_group: dist.ProcessGroup | None
          ) -> tuple[CommGroup, InputKind, Any, ResolvedTable | None, RejectedArguments | None]:
    """The API edge, the same on every rank: the call's group (raises directly when there is none), the
    input's kind, and the weight resolved once (a failure is recorded for the agreement step)."""
    error: RejectedArguments | None = None
    try:
        kind, input_group = _input_kind(fn, input)
    except RejectedArguments as e:
        kind, input_group, error = InputKind.PLAIN, None, e
    group = call_group(fn, [weight], process_group, input_group)
    mesh = input.device_mesh if isinstance(input, DTensor) else None
    table = None
    if error is None:
        try:
            table = resolve_table(fn, weight, group)
        except RejectedArguments as e:
            error = e
    return group, kind, mesh, table, error


def _rows_dtensor(out: torch.Tensor, rows: list[int], mesh: Any) -> DTensor:
    """This rank's ``out`` (``rows[rank]`` rows) as a ``Shard(0)`` DTensor of all ranks' rows."""
    shape = torch.Size((sum(rows),) + tuple(out.shape[1:]))
    if rows == chunk_sizes(sum(rows), len(rows)):
        return DTensor.from_local(out, mesh, [Shard(0)], run_check=False, shape=shape,
                                  stride=contiguous_strides(shape))
    flat = out.reshape(out.shape[0], -1)
    members = [int(r) for r in mesh.mesh.tolist()]
    lay = ShardLayout.row_wise((sum(rows), flat.shape[1]), rows, ranks=members, dtype=out.dtype)
    if len(shape) != 2:
        raise NotImplementedError("uneven Shard(0) batches of a multi-dim sharded_embedding input are not supported")
    return dtensor_from_local_shards(lay, [out.detach()], device_mesh=mesh)


def _split_bags(bags: Bags, world: int, rank: int) -> Bags:
    """This rank's ``torch.chunk`` share of a replicated batch's bags."""
    counts = chunk_sizes(bags.num_bags, world)
    b0 = sum(counts[:rank])
    starts = torch.cat([bags.lengths.new_zeros(1), torch.cumsum(bags.lengths, 0)])
    i0, i1 = int(starts[b0]), int(starts[b0 + counts[rank]])
    w = None if bags.weights is None else bags.weights[i0:i1]
    return Bags(bags.ids[i0:i1], bags.lengths[b0 : b0 + counts[rank]], w)


def _even_columns(layout: ShardLayout, world: int) -> bool:
    """The weight's blocks (group ranks) are exactly ``Shard(1)``'s even split in rank order, one per rank."""
    n, d = layout.global_shape
    widths = chunk_sizes(d, world)
    want = sorted((r, (0, sum(widths[:r])), (n, widths[r])) for r in range(world))
    return sorted((s.rank, s.offsets, s.sizes) for s in layout.shards) == want


def _replicated_input(
    table: ResolvedTable, bags: Bags, *, mode: str, padding: int | None, skip_padding: bool,
    max_norm: float | None, norm_type: float, binding: Any = None,
) -> tuple[torch.Tensor, list, bool] | None:
    """The communication-free lookups of an agreed replicated batch: (local output, placements, whether the
    output is this rank's columns); or ``None`` for the fallback (max on a layout that would need a Partial
    max)."""
    group, layout, world = table.group, table.layout, table.group.size
    columns = table.strategy is Strategy.COLUMNS and _even_columns(layout, world)
    if mode == "max" and table.strategy is not Strategy.LOCAL and not columns:
        return None
    rank = group.rank
    assert rank is not None
    if max_norm is not None:
        renormalize(layout, layout.shards_on(rank), list(table.shards), bags.ids, max_norm, norm_type, group.group)
    strategy = Strategy.REDUCE if table.strategy is Strategy.COLUMNS and not columns else table.strategy
    plan = LookupPlan(
        layout=layout, shards=list(table.shards), batch=bags, num_bags=[bags.num_bags] * world,
        max_mode=mode == "max", padding_idx=padding, skip_padding=skip_padding,
        track=table.weight.requires_grad and torch.is_grad_enabled(), group=group.group, local_only=True,
        table_layout=table.table_layout, strategy=strategy, optimizer=binding,
    )
    (out,) = pooled_lookup([plan], [table.weight])
    out = finish(out, bags, mode, padding)
    if table.strategy is Strategy.LOCAL:
        return out, [Replicate()], False
    if columns:
        return out, [Shard(1)], True
    return out, [Partial()], False


def _check_replicated(fn: str, error: RejectedArguments | None, bags: Bags | None, codes: list[TableCodes],
                      group: CommGroup) -> None:
    """A ``Replicate()`` batch follows DTensor's contract: the caller guarantees that every rank holds the same
    batch and options, so no collective checks it - unless ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, torch's switch
    for consistency checks of collectives: then ONE agreement (options, layout, a digest of the batch) makes
    every rank raise on any difference. Without it a local failure raises on this rank only."""
    if dist.get_debug_level() == dist.DebugLevel.DETAIL:
        digest = 0 if bags is None else batch_digest(bags)
        agree(fn, error, None if bags is None else [bags], codes, group, kind=InputKind.REPLICATE, digest=digest)
    elif error is not None:
        raise error.problem.error()


@dataclass(frozen=True)
class _Lookup:
    """One table's lookup, done: this rank's finished output and what shapes it as the caller's result."""

    out: torch.Tensor
    bags: Bags
    kind: InputKind
    mesh: Any
    placements: list | None = None
    """A ``Replicate()`` batch answered without communication: the output's placements (else ``None``)."""
    columns: bool = False
    """... and whether ``out`` is this rank's columns."""
    rows: list[int] = dataclasses.field(default_factory=list)
    """Otherwise: every rank's number of bags (or ids), in rank order."""


def _lookup(
    fn: str, op: int, input: Any, weight: Any, *, mode: str, max_norm: float | None, norm_type: float,
    skip_padding: bool, process_group: dist.ProcessGroup | None, optimizer: Any,
    prepare: Callable[[Any, InputKind], tuple[Any, int | None, Bags]],
) -> _Lookup:
    """Steps 0-6 of the module docstring for one table, shared by both functions: the API edge, the local
    checks (``prepare(input, kind)`` -> (local input, padding, bags), raising :class:`RejectedArguments`),
    then a ``Replicate()`` batch's communication-free path or the agreement and the lookup."""
    group, kind, mesh, table, error = _edge(fn, weight, input, process_group)
    bags, padding, bind = None, None, None
    shape = tuple(weight.shape) if isinstance(weight, DTensor) else ()
    dtype = weight.dtype if isinstance(weight, DTensor) else None
    if error is None:
        try:
            bind = bind_optimizer(fn, optimizer, weight)
            _, padding, bags = prepare(input, kind)
        except RejectedArguments as e:
            error = e
    codes = [TableCodes.of(op, mode, padding, max_norm, norm_type, shape, dtype, -1 if table is None else table.digest,
                           optimizer=bind, psw_grad=bags is not None and psw_grad(bags))]
    if kind is InputKind.REPLICATE:
        _check_replicated(fn, error, bags, codes, group)
        assert bags is not None and table is not None
        done = _replicated_input(table, bags, mode=mode, padding=padding, skip_padding=skip_padding,
                                 max_norm=max_norm, norm_type=norm_type, binding=bind)
        if done is not None:
            return _Lookup(done[0], bags, kind, mesh, placements=done[1], columns=done[2])
        assert group.rank is not None
        bags = _split_bags(bags, group.size, group.rank)  # max on a layout without a Partial("max")
    opts = [TableOptions(mode, padding, max_norm, norm_type)]
    tables = [] if table is None else [table]
    infos, routes = agree_and_route(fn, error, tables, None if bags is None else [bags], opts, codes, group,
                                    kind=InputKind.PLAIN if kind is InputKind.REPLICATE else kind)
    assert bags is not None
    (out,) = run_tables(tables, [bags], infos, opts, routes, skip_padding=skip_padding, bindings=[bind], fn=fn)
    return _Lookup(finish(out, bags, mode, padding), bags, kind, mesh, rows=[i.num_bags for i in infos[0]])


def _replicated_dtensor(res: _Lookup, shape: tuple[int, ...]) -> DTensor:
    """A communication-free lookup's output as a DTensor of global ``shape``."""
    assert res.placements is not None
    gshape = torch.Size(shape)
    return DTensor.from_local(res.out, res.mesh, res.placements, run_check=False, shape=gshape,
                              stride=contiguous_strides(gshape))


@torch.compiler.disable(recursive=True)  # collectives and data-dependent routing: a graph break
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
    process_group: dist.ProcessGroup | None = None,
    optimizer: Any = None,
) -> torch.Tensor:
    """``F.embedding_bag`` over a DTensor table of any layout; *collective* over the weight's group.

    ``input`` (with ``offsets``/``per_sample_weights``) is THIS rank's own batch;
    ranks may pass batches of different sizes. The result is this rank's own
    ``(num_bags, embedding_dim)`` output as a plain tensor, equal to
    ``F.embedding_bag(input, full_weight, ...)``. When ``weight.requires_grad``,
    backward fills ``weight.grad`` with a DTensor of the weight's layout holding
    the gradient of all ranks' batches. A weight that does not require grad (the
    DTensors of ``state_dict_to_dtensor`` do not) is a frozen table, as in torch:
    the output has no ``grad_fn``; call ``weight.requires_grad_()`` to train it.
    ``max_norm`` renormalises the stored rows referenced by any rank, in place.

    Every rank of the weight's group calls it: the group of its mesh (on a 2-D
    mesh ``(replica, shard)`` the shard axis, whose replica axis must hold
    identical data - each replica group looks up on its own), or
    ``process_group`` when given (needed for a table on a one-rank mesh inside
    a sub-mesh; such a table otherwise uses the default group).

    A DTensor ``input`` (``Replicate()`` or ``Shard(0)`` on a 1-D mesh over the
    same group) gives a DTensor result: ``Shard(0)`` for a batch-sharded input;
    for a replicated input ``Replicate()``/``Shard(1)``/``Partial()`` by the
    weight's layout, with no data collective in forward or backward (see the
    module docstring).

    With ``optimizer`` (a :class:`FusedOptimizer` holding ``weight``), backward
    updates the weight in place instead (``weight.grad`` stays ``None``).

    Raises:
        TypeError, ValueError, NotImplementedError: on every rank, when any rank's
            arguments are invalid, the ranks disagree on an option, on
            the weight's layout or on the input's kind or (replicated) values.

    Example::

        >>> out = sharded_embedding_bag(ids, dt_weight, offsets, mode="sum")
        >>> out.sum().backward()  # dt_weight.grad: a DTensor like dt_weight
    """
    fn = "sharded_embedding_bag"

    def prepare(input: Any, kind: InputKind) -> tuple[Any, int | None, Bags]:
        local_input, local = _local_inputs(fn, input, offsets=offsets, per_sample_weights=per_sample_weights)
        shape = tuple(weight.shape)
        padding = check_options(fn, shape, mode=mode, padding_idx=padding_idx, max_norm=max_norm,
                                norm_type=norm_type, scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)
        bags = bags_from_input(fn, local_input, local["offsets"], local["per_sample_weights"], rows=shape[0],
                               mode=mode, include_last_offset=include_last_offset, weight_dtype=weight.dtype)
        if kind is not InputKind.PLAIN and psw_grad(bags):
            raise RejectedArguments(NotImplementedError, f"{fn}: the gradient of per_sample_weights is computed "
                                    "for plain-tensor inputs only; pass per_sample_weights.detach() with a "
                                    "DTensor input")
        return local_input, padding, bags

    res = _lookup(fn, 0, input, weight, mode=mode, max_norm=max_norm, norm_type=norm_type, skip_padding=True,
                  process_group=process_group, optimizer=optimizer, prepare=prepare)
    if res.placements is not None:
        return _replicated_dtensor(res, (res.bags.num_bags, weight.shape[1]))
    if res.kind is InputKind.PLAIN:
        return res.out
    return _rows_dtensor(res.out, res.rows, res.mesh)


@torch.compiler.disable(recursive=True)  # collectives and data-dependent routing: a graph break
def sharded_embedding(
    input: torch.Tensor,
    weight: DTensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    *,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
    process_group: dist.ProcessGroup | None = None,
    optimizer: Any = None,
) -> torch.Tensor:
    """``F.embedding`` over a DTensor table of any layout; *collective* over the weight's group.

    ``input`` (ids of any shape) is THIS rank's own batch; the result is
    ``input.shape + (embedding_dim,)`` as a plain tensor, equal to
    ``F.embedding(input, full_weight, ...)``; the ``padding_idx`` row is looked
    up but receives no gradient, as in torch. The group, DTensor inputs and
    errors are as for :func:`sharded_embedding_bag` (a column-cut output of a
    replicated input is ``Shard`` on the last dim). ``optimizer``: as for
    :func:`sharded_embedding_bag`.

    Example::

        >>> rows = sharded_embedding(ids, dt_weight)  # (*ids.shape, dim)
    """
    fn = "sharded_embedding"

    def prepare(input: Any, kind: InputKind) -> tuple[Any, int | None, Bags]:
        local_input, _ = _local_inputs(fn, input)
        shape = tuple(weight.shape)
        padding = check_options(fn, shape, mode="sum", padding_idx=padding_idx, max_norm=max_norm,
                                norm_type=norm_type, scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)
        return local_input, padding, bags_for_embedding(fn, local_input, shape[0])

    res = _lookup(fn, 1, input, weight, mode="sum", max_norm=max_norm, norm_type=norm_type, skip_padding=False,
                  process_group=process_group, optimizer=optimizer, prepare=prepare)
    ids = input.to_local() if isinstance(input, DTensor) else input
    out = res.out.view(tuple(ids.shape) + (res.out.shape[1],))
    if res.placements is not None:
        if res.columns:
            res = dataclasses.replace(res, placements=[Shard(ids.dim())])
        return _replicated_dtensor(dataclasses.replace(res, out=out), tuple(ids.shape) + (weight.shape[1],))
    if res.kind is InputKind.PLAIN:
        return out
    per_row = max(1, int(torch.Size(ids.shape[1:]).numel()))
    return _rows_dtensor(out, [n // per_row for n in res.rows], res.mesh)
