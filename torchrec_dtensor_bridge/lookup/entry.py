"""The one entry path of every lookup: resolve, agree, route, plan, run.

The public lookups (:mod:`.functional`, :mod:`.tables`) and ``shard_module``'s collection forward all go
through here, in this order, on every rank (the same order on all ranks, so nothing can hang):

1. :func:`call_group` and :func:`resolve_table` - the call's group (the weights' meshes, or
   ``process_group``) and each weight resolved once (layout in the group's ranks, local shards, its
   strategy, picked by :func:`pick_strategy`); collective-free;
2. (the caller's argument checks, :mod:`.arguments`, recording - not raising - a failure);
3. :func:`agree_and_route` - each table's route (its strategy's ``route``: which ids go to which rank),
   then ONE agreement ``all_gather`` (:func:`.agree.agree`) carrying every rank's verdict, options and
   routed counts; any failure or disagreement raises on every rank;
4. :func:`run_tables` - the ids of every table that needs them travel in ONE ``all_to_all``
   (:func:`gather_bags`), ``max_norm`` renormalises, each table's :class:`.plan.LookupPlan` is fixed and
   the autograd Function runs (:func:`.function.pooled_lookup`);
5. :func:`finish` - ``mean`` divides by the true bag size, ``max``'s empty bags give 0.

A DTensor whose local tensor is a shards wrapper without a layout (TorchRec's own) would need a
collective to learn its layout; lookups refuse it with a clear error on every rank instead (through the
agreement step): ``tdb.to_dtensor(w)`` (collective, zero-copy) gives the same table with its layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..agreement import Rejected, RejectedArguments, timeouts_named
from ..collectives import all_to_all_flat
from ..convert.dtensor import layout_of, local_shards_of, needs_layout_gather
from ..groups import CommGroup, comm_group, of_group
from ..layout import ShardLayout
from ..optim.state import Binding
from .agree import InputKind, RankInfo, TableCodes, agree
from .arguments import Bags, TableOptions, read_together
from .function import AFTER_AGREEMENT, pooled_lookup
from .plan import ALL, NONE, BatchPlan, LookupPlan, PendingRoute, PoolOptions, ResolvedTable, Route, Strategy
from .renorm import renormalize
from .strategies import COLUMNS, ROWS, WHOLE

__all__ = ["agree_and_route", "call_group", "finish", "gather_bags", "pick_strategy", "psw_grad", "refuse",
           "resolve_routes", "resolve_table", "run_tables"]


def pick_strategy(layout: ShardLayout, world: int) -> Strategy:
    """The cheapest correct strategy for ``layout`` on ``world`` ranks: the one place that picks."""
    full = {s.rank for s in layout.shards if s.sizes == layout.global_shape}
    if full >= set(range(world)):
        return WHOLE
    rows = layout.global_shape[0]
    if all(s.sizes[0] == rows for s in layout.unique_shards() if s.numel):
        return COLUMNS
    return ROWS


def call_group(
    fn: str, weights: Sequence[object], process_group: dist.ProcessGroup | None, input_mesh_group: CommGroup | None
) -> CommGroup:
    """The group a lookup runs on (module docstring); collective-free.

    Raises ``ValueError`` directly (not through an agreement: there is no group to
    agree on) when the weights' meshes name different groups, or this rank is
    not in the group: both are structure every rank sees alike.
    """
    if process_group is not None:
        group = of_group(process_group)
    else:
        found: list[CommGroup] = []
        for w in weights:
            if isinstance(w, DTensor) and w.device_mesh.size() > 1:
                g = comm_group(w)
                if all(g.members != f.members for f in found):
                    found.append(g)
        if len(found) > 1:
            raise ValueError(
                f"{fn}: the weights live on meshes of different groups {[list(g.members) for g in found]}; "
                "a lookup runs on one group (pass process_group, or put the tables on one mesh)"
            )
        group = found[0] if found else (input_mesh_group or of_group(None))
    if input_mesh_group is not None and input_mesh_group.members != group.members:
        raise ValueError(
            f"{fn}: the DTensor input lives on ranks {list(input_mesh_group.members)} but the lookup runs on "
            f"ranks {list(group.members)} (the weight's group); put the input on the weight's mesh axis"
        )
    me = dist.get_rank() if dist.is_initialized() else 0
    if me not in group.members:
        raise ValueError(f"{fn}: rank {me} is not in the lookup's group of ranks {list(group.members)}")
    return group


def resolve_table(fn: str, weight: object, group: CommGroup) -> ResolvedTable:
    """``weight`` resolved for a lookup on ``group``; collective-free.

    Raises:
        Rejected: a weight that is not a DTensor, carries no layout (module
            docstring), is not whole inside ``group``, or whose local tensors
            do not match its layout.
    """
    if not isinstance(weight, DTensor):
        raise Rejected(TypeError, f"{fn}: weight must be a DTensor, got {type(weight).__name__}")
    if needs_layout_gather(weight):
        raise Rejected(
            NotImplementedError,
            f"{fn}: the weight's local tensor is a shards wrapper without the table's layout (TorchRec's own "
            "wrapper); a lookup does not gather layouts - attach it once with "
            "tdb.to_dtensor(weight) (collective, zero-copy)",
        )
    try:
        whole = layout_of(weight)
    except (ValueError, NotImplementedError) as e:
        raise Rejected(type(e), f"{fn}: {e}") from None
    if whole.dtype is None:
        whole = dataclasses.replace(whole, dtype=weight.dtype)
    layout = whole.on_ranks(group.members)
    covered = sum(s.numel for s in layout.unique_shards())
    if covered != layout.numel:
        raise Rejected(
            ValueError,
            f"{fn}: the weight's blocks on the lookup's ranks {list(group.members)} cover {covered} of "
            f"{layout.numel} elements; the table must be whole inside the group (a 2-D mesh: look up on its "
            "sharding axis, whose replica axis holds identical data)",
        )
    shards = local_shards_of(weight)
    rank = group.rank
    assert rank is not None, "call_group keeps only members"
    mine = layout.shards_on(rank)
    if len(shards) != len(mine) or any(tuple(t.shape) != s.sizes for t, s in zip(shards, mine)):
        raise Rejected(
            ValueError,
            f"{fn}: rank {group.members[rank]} holds local tensors of shapes {[list(t.shape) for t in shards]} "
            f"but the weight's layout gives it blocks {[list(s.sizes) for s in mine]}",
        )
    return ResolvedTable(
        weight, whole, layout, tuple(shards), group, pick_strategy(layout, group.size), layout.digest()
    )


def resolve_routes(planned: Sequence[Route | PendingRoute | None]) -> list[Route | None]:
    """``planned`` with every :class:`.plan.PendingRoute` finished, their counts read in one host read per
    device (one synchronisation on an accelerator for all tables)."""
    pending = [p for p in planned if isinstance(p, PendingRoute)]
    read = iter(read_together([p.counts for p in pending]))
    return [p.finish(next(read)) if isinstance(p, PendingRoute) else p for p in planned]


def routes_for(tables: list[ResolvedTable], bags: list[Bags], options: list[TableOptions]) -> list[Route | None]:
    """Per table, where this rank's ids go (its strategy's route; every id to every rank for ``max_norm``,
    which renormalises every copy of every referenced row); ``None`` where none travel. The row partitions'
    id counts are read once for all tables."""
    planned: list[Route | PendingRoute | None] = []
    for t, b, o in zip(tables, bags, options):
        if o.max_norm is not None:
            n, world = b.ids.numel(), t.group.size
            planned.append(Route((ALL,) * world, (n,) * world))
        else:
            planned.append(t.strategy.route(t.layout, b, t.group.size))
    return resolve_routes(planned)


def agree_and_route(
    fn: str, error: RejectedArguments | None, tables: list[ResolvedTable], bags: list[Bags] | None,
    options: list[TableOptions], codes: list[TableCodes], group: CommGroup, *,
    kind: InputKind = InputKind.PLAIN, digest: int = 0,
) -> tuple[list[list[RankInfo]], list[Route | None]]:
    """Routes for validated arguments (a failure becomes this rank's verdict), then the agreement step that
    also carries the routed counts; *collective* over ``group``, raises on every rank when any rank failed."""
    routes: list[Route | None] = []
    if error is None and bags is not None:
        try:
            routes = routes_for(tables, bags, options)
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement step
            exc = type(e) if type(e) in (TypeError, ValueError, NotImplementedError) else RuntimeError
            error, bags = RejectedArguments(exc, f"{fn}: {e}"), None
    sends = [None if r is None else r.counts for r in routes] if routes else None
    infos = agree(fn, error, bags, codes, group, sends=sends, kind=kind, digest=digest)
    return infos, routes


def refuse(fn: str, weights: Sequence[object], process_group: dist.ProcessGroup | None,
           error: RejectedArguments) -> NoReturn:
    """Join, as a failing rank, the agreement step of the lookup of ``weights`` the other ranks are entering
    (a caller that found its input bad before it could call the lookup); raises ``error`` on every rank."""
    tables = [w for w in weights if isinstance(w, DTensor)]
    if tables:
        agree(fn, error, None, [], call_group(fn, tables, process_group, None))
    raise error.problem.error()


def run_tables(
    tables: list[ResolvedTable], bags: list[Bags], infos: list[list[RankInfo]], options: list[TableOptions],
    routes: list[Route | None], *, skip_padding: bool, bindings: Sequence[Binding | None] | None = None,
    fn: str = "lookup",
) -> list[torch.Tensor]:
    """Steps 3-5 for validated arguments, all tables at once; per table the pooled (sum or raw max) output of
    this rank's bags. Ids of every table that needs them travel in one exchange (``routes``, agreed in
    ``infos``), outputs in fused collectives."""
    group = tables[0].group
    rank = group.rank
    assert rank is not None, "the call group holds this rank"
    with timeouts_named(fn, group, "its exchanges", AFTER_AGREEMENT):
        return _run(tables, bags, infos, options, routes, skip_padding, bindings, fn, group, rank)


def _run(
    tables: list[ResolvedTable], bags: list[Bags], infos: list[list[RankInfo]], options: list[TableOptions],
    routes: list[Route | None], skip_padding: bool, bindings: Sequence[Binding | None] | None, fn: str,
    group: CommGroup,
    rank: int,
) -> list[torch.Tensor]:
    need = [t for t, r in enumerate(routes) if r is not None]
    dtypes = {tables[t].weight.dtype for t in need}
    float_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float64
    gathered = dict(zip(need, gather_bags(
        [bags[t] for t in need], [infos[t] for t in need], group.group, float_dtype=float_dtype,
        rows=max((t.layout.global_shape[0] for t in tables), default=0),
        routes=[r for r in routes if r is not None],
    )))
    for t, g in gathered.items():
        table = tables[t]
        if g.weights is not None and g.weights.dtype != table.weight.dtype:
            gathered[t] = Bags(g.ids, g.lengths, g.weights.to(table.weight.dtype))
        o = options[t]
        if o.max_norm is not None:
            renormalize(table.layout, table.layout.shards_on(rank), list(table.shards), gathered[t].ids,
                        o.max_norm, o.norm_type, group.group)
    track = torch.is_grad_enabled()
    plans = []
    for t, (table, o) in enumerate(zip(tables, options)):
        batch = BatchPlan(
            bags[t] if table.strategy.own_batch else gathered[t], tuple(i.num_bags for i in infos[t]),
            routed=routes[t] is not None and o.max_norm is None, route=routes[t],
            received=tuple(0 if i.sends is None else i.sends[rank] for i in infos[t]),
        )
        plans.append(make_plan(table, batch, PoolOptions(o.mode == "max", o.padding, skip_padding), fn=fn,
                               binding=None if bindings is None else bindings[t], psw_grad=psw_grad(bags[t])))
    return pooled_lookup(plans, [t.weight for t in tables],
                         [b.weights if p.psw_grad else None for b, p in zip(bags, plans)])


def make_plan(table: ResolvedTable, batch: BatchPlan, pooling: PoolOptions, *, fn: str,
              binding: Binding | None = None, psw_grad: bool = False) -> LookupPlan:
    """One table's plan: its parts, and this rank's blocks and which of them it pools (its strategy's)."""
    rank = table.group.rank
    assert rank is not None, "the call group holds this rank"
    track = torch.is_grad_enabled()
    return LookupPlan(
        table, batch, pooling, rank, table.group.size, table.group.group, table.layout.shards_on(rank),
        table.strategy.computes(table.layout, rank), track=table.weight.requires_grad and track,
        optimizer=binding, psw_grad=psw_grad and track, call=fn,
    )



def finish(out: torch.Tensor, bags: Bags, mode: str, padding: int | None) -> torch.Tensor:
    """After the pooled lookup: ``mean`` divides by the true bag size; ``max``: empty bags give 0."""
    if mode == "sum":
        return out
    valid = bags.ids != padding if padding is not None else torch.ones_like(bags.ids, dtype=torch.bool)
    sizes = bags.count_per_bag(valid).unsqueeze(1)
    if mode == "mean":
        return out / sizes.clamp(min=1).to(out.dtype)
    return out.masked_fill(sizes == 0, 0.0)


def psw_grad(bags: Bags) -> bool:
    """Whether a lookup of ``bags`` computes its per-sample weights' gradient (agreed by every rank)."""
    return bags.weights is not None and bags.weights.requires_grad and torch.is_grad_enabled()


def gather_bags(
    bags: Sequence[Bags],
    infos: Sequence[Sequence[RankInfo]],
    group: dist.ProcessGroup | None,
    *,
    float_dtype: torch.dtype,
    rows: int,
    routes: Sequence[Route],
) -> list[Bags]:
    """Every rank's batch of each table, in rank order, on the ranks that compute it; *collective*.

    ``bags[t]`` is this rank's batch of table ``t``, ``infos[t][r]`` rank
    ``r``'s sizes for it (with how many ids it sends to each rank) and
    ``routes[t]`` which of this rank's ids go where (:mod:`.route`); ``rows``
    bounds every id (the largest table's ``num_embeddings``, agreed by all
    ranks). The ids and bag lengths of ALL tables travel in one
    ``all_to_all``; per-sample weights (as ``float_dtype``) in a second one
    only when some rank passed them for some table (ranks and tables without
    them send ones). A rank receives, per table it computes, every rank's bag
    lengths and the ids routed to it (so a bag's length counts only those); a
    rank that computes nothing of a table gets all bags of it, empty.
    """
    if not bags:
        return []
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dev = bags[0].ids.device
    mine = [t for t, r in enumerate(routes) if r.masks[rank] is not NONE]
    # ids and lengths travel as int32 when every value fits (half the bytes), known alike on every rank
    wide = max(rows, max(i.num_ids for info in infos for i in info)) >= 2**31
    dtype = torch.int64 if wide else torch.int32
    weighted = [any(x.has_weights for x in i) for i in infos]
    factors = [None if not w else b.weights if b.weights is not None else torch.ones(b.ids.numel(), device=dev)
               for b, w in zip(bags, weighted)]  # ones where this rank passed none but another did
    picked = _pick_all(bags, routes, factors, world, dtype)

    def received(info: RankInfo) -> int:
        assert info.sends is not None, "a routed table's sizes travel in the agreement step"
        return info.sends[rank]

    # ONE flat message, written in place: per destination, per table it reads: ids, then bag lengths
    send_sizes = [sum(x.numel() for t, r in enumerate(routes) if r.masks[q] is not NONE for x in picked[q][t][:2])
                  for q in range(world)]
    flat_in = torch.empty(sum(send_sizes), dtype=dtype, device=dev)
    at = 0
    for q in range(world):
        for t, r in enumerate(routes):
            if r.masks[q] is not NONE:
                for x in picked[q][t][:2]:
                    flat_in[at : at + x.numel()].copy_(x)
                    at += x.numel()
    sizes = [sum(received(infos[t][p]) + infos[t][p].num_bags for t in mine) for p in range(world)]
    flat_out = torch.empty(sum(sizes), dtype=dtype, device=dev)
    dist.all_to_all_single(flat_out, flat_in, sizes, send_sizes, group=group)
    del flat_in
    ids: dict[int, list[torch.Tensor]] = {t: [] for t in mine}
    lengths: dict[int, list[torch.Tensor]] = {t: [] for t in mine}
    for p, part in enumerate(flat_out.split(sizes)):
        at = 0
        for t in mine:
            n, nb = received(infos[t][p]), infos[t][p].num_bags
            ids[t].append(part[at : at + n])
            lengths[t].append(part[at + n : at + n + nb])
            at += n + nb
    weights: dict[int, torch.Tensor] = {}
    if any(weighted):
        wsend = [torch.cat([
            w.to(float_dtype) for t, r in enumerate(routes) if r.masks[q] is not NONE and (w := picked[q][t][2]) is not None
        ] + [torch.empty(0, dtype=float_dtype, device=dev)]) for q in range(world)]
        wsizes = [sum(received(infos[t][p]) for t in mine if weighted[t]) for p in range(world)]
        wparts: dict[int, list[torch.Tensor]] = {t: [] for t in mine if weighted[t]}
        for p, part in enumerate(all_to_all_flat(wsend, wsizes, group, dtype=float_dtype, device=dev)):
            at = 0
            for t in wparts:
                wparts[t].append(part[at : at + received(infos[t][p])])
                at += received(infos[t][p])
        weights = {t: torch.cat(w) for t, w in wparts.items()}
    out = []
    for t, b in enumerate(bags):
        if t in ids:
            out.append(Bags(_cat64(ids[t]), _cat64(lengths[t]), weights.get(t)))
        else:  # not read here: every bag of every rank, empty
            total = sum(i.num_bags for i in infos[t])
            out.append(Bags(b.ids.new_empty(0), b.lengths.new_zeros(total), None))
    return out


def _cat64(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` back to back as int64: concatenated, then widened (faster on CPU than one ``torch.cat`` into an
    int64 ``out``, small parts and large)."""
    return torch.cat(parts).to(torch.int64)


Picked = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _pick_all(
    bags: Sequence[Bags], routes: Sequence[Route], factors: Sequence[torch.Tensor | None], world: int,
    dtype: torch.dtype,
) -> list[list[Picked]]:
    """Per destination, per table: (ids as ``dtype``, per-bag lengths, weights or ``None``) routed there."""
    out: list[list[Picked]] = [[] for _ in range(world)]
    for b, r, f in zip(bags, routes, factors):
        ids = b.ids.to(dtype)  # once per table, not once per destination
        if r.per_bag:  # the partition fast path worked them out already
            for q in range(world):
                out[q].append(_pick(ids, b.lengths, r, q, r.per_bag[q], f))
            continue
        cut = [q for q in range(world) if isinstance(r.masks[q], torch.Tensor)]
        last = cut[-1] if r.partition and cut else -1
        per_bag: dict[int, torch.Tensor] = {}
        for q in cut:
            if q != last:
                mask = r.masks[q]
                assert isinstance(mask, torch.Tensor)
                per_bag[q] = b.count_per_bag(mask)
        if last >= 0:  # the masks take every id once: the last one's counts are what the others left
            rest = b.lengths.clone()
            for q in cut[:-1]:
                rest -= per_bag[q]
            per_bag[last] = rest
        for q in range(world):
            out[q].append(_pick(ids, b.lengths, r, q, per_bag.get(q), f))
    return out


def _pick(
    ids: torch.Tensor, lengths: torch.Tensor, route: Route, q: int, per_bag: torch.Tensor | None,
    weights: torch.Tensor | None,
) -> Picked:
    """(ids, per-bag lengths, ``weights`` or ``None``) of one table's batch that ``route`` sends to rank ``q``."""
    mask = route.masks[q]
    if mask is True:
        return ids, lengths, weights
    if mask is False:
        return ids.new_empty(0), lengths.new_zeros(0), None if weights is None else weights.new_empty(0)
    assert per_bag is not None
    at = route.positions[q] if route.positions else None
    if at is None:
        assert isinstance(mask, torch.Tensor)
        at = mask.nonzero().squeeze(1)
    return ids.index_select(0, at), per_bag, None if weights is None else weights.index_select(0, at)


