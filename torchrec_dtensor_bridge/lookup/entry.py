"""The one entry path of every lookup: resolve, agree, route, plan, run.

The public lookups (:mod:`.functional`, :mod:`.tables`) and ``shard_module``'s collection forward all go
through here, in this order, on every rank (the same order on all ranks, so nothing can hang):

1. :func:`.functional.lookup_group` and :func:`.functional.resolve_table` - the call's group (the weights' meshes,
   or ``process_group``; its collectives' tensors on the tables' device) and each weight resolved once
   (layout in the group's ranks, local shards, its strategy); collective-free;
2. (the caller's argument checks, :mod:`.arguments`, recording - not raising - a failure);
3. :func:`agree_and_route` - each table's route (its strategy's ``route``: which ids go to which rank),
   then ONE agreement ``all_gather`` (:func:`agree`) carrying every rank's verdict, options and
   routed counts; any failure or disagreement raises on every rank;
4. :func:`run_tables` - the ids of every table that needs them travel in ONE ``all_to_all``
   (:func:`gather_bags`), ``max_norm`` renormalises, each table's :class:`.plan.LookupPlan` is fixed and
   the autograd Function runs (:func:`.function.pooled_lookup`);
5. :func:`finish` - ``mean`` divides by the true bag size, ``max``'s empty bags give 0.

A weight the lookups cannot take (a shards wrapper without a layout, rows in unified memory: :func:`.functional.resolve_table`)
is refused with a clear error on every rank, through the agreement step.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import agreement, kernels
from ..agreement import RejectedArguments, timeouts_named
from ..collectives import all_to_all_jagged
from ..groups import CommGroup
from ..optim.state import Binding
from .arguments import CODE_WIDTH, SIZES, Bags, RankInfo, TableCodes, TableOptions, read_together, table_fields
from .codes import name_the_difference
from .function import AFTER_AGREEMENT, pooled_lookup
from .plan import ALL, NONE, BatchPlan, LookupPlan, PendingRoute, PoolOptions, ResolvedTable, Route
from .renorm import renormalize

__all__ = [
    "FIRST_MESSAGE_TABLES", "InputKind", "agree", "agree_and_route", "finish", "gather_bags", "make_plan", "psw_grad",
    "check_same_codes", "resolve_routes", "run_tables",
]


class InputKind(enum.Enum):
    """How a rank passed its batch; ranks must agree (a ``Replicate()`` input is one batch for all)."""

    PLAIN = 0
    REPLICATE = 1
    SHARD = 2

    def describe(self) -> str:
        return {InputKind.PLAIN: "a plain tensor", InputKind.REPLICATE: "a Replicate() DTensor",
                InputKind.SHARD: "a Shard(0) DTensor"}[self]


_HEADER = 4  # number of tables, input kind, input digest, kernel choices (kernels.choice_code)
FIRST_MESSAGE_TABLES = 16
"""Tables whose sizes and options travel in the agreement's first (fixed-size) message."""


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


def agree(
    fn: str,
    error: RejectedArguments | None,
    bags: Sequence[Bags] | None,
    codes: Sequence[TableCodes],
    group: CommGroup,
    sends: Sequence[Sequence[int] | None] | None = None,
    *,
    kind: InputKind = InputKind.PLAIN,
    digest: int = 0,
) -> list[list[RankInfo]]:
    """The agreement step for a lookup of one or several tables; *collective* over ``group``.

    Returns ``infos[table][rank]``: every rank's batch sizes for each table
    (ranks are group ranks). ONE ``all_gather`` (:func:`..agreement.agree`)
    carries the verdict, the number of tables, the input's kind and digest and
    the sizes and codes of the first :data:`FIRST_MESSAGE_TABLES` tables,
    padded to that many - the same size whatever the call, so ranks that
    disagree even on the number of tables or on the input's kind still meet in
    it and raise. Only a lookup of more tables needs a second ``all_gather``.

    Args:
        fn: public function name, for messages.
        error: this rank's validation failure, if any.
        bags: this rank's canonical batch per table (``None`` when ``error`` is set).
        codes: per table, what every rank must agree on.
        group: the lookup's group.
        sends: per table, how many ids this rank will send to each rank (:mod:`.route`), or ``None``.
        kind: how this rank passed its batch.
        digest: for a ``Replicate()`` input, :func:`batch_digest` of it (0 otherwise).

    Raises:
        The failing rank's exception kind on every rank, or ``ValueError`` when ranks disagree.
    """
    n, world = len(codes), group.size
    per_table = [None] * n if bags is None else list(bags)
    routes = [None] * n if sends is None or bags is None else list(sends)
    nf = CODE_WIDTH + world
    try:
        fields = [x for b, c, r in zip(per_table, codes, routes) for x in table_fields(b, c, r, world)]
        device = per_table[0].ids.device if per_table and per_table[0] is not None else torch.device("cpu")
        header = [n, kind.value, digest if kind is InputKind.REPLICATE else 0, kernels.choice_code(device)]
    except Exception as e:  # noqa: BLE001 - this rank still meets the others in the agreement, failing
        if error is None:
            error = RejectedArguments(RuntimeError, f"{fn}: this rank could not prepare its part of the "
                                      f"agreement step: {type(e).__name__}: {e}")
        fields, header = [], [n, kind.value, 0, 0]
    width = _HEADER + FIRST_MESSAGE_TABLES * nf
    rows = agreement.agree(fn, None if error is None else error.problem, header + fields, group, width=width)
    counts = [r[0] for r in rows]
    if len(set(counts)) > 1:
        raise ValueError(f"{fn}: ranks passed different numbers of tables: {counts} (rank order)")
    agreement.check_same(fn, "the input's kind", [r[1] for r in rows],
                         shown=[InputKind(r[1]).describe() for r in rows],
                         hint="every rank must pass its input alike")
    agreement.check_same(fn, "the Replicate() input's values (digests)", [r[2] for r in rows],
                         hint="a Replicate() input must be the same batch on every rank")
    kernels.settle(device, [r[3] for r in rows])  # the ranks run the same kernels, or fall back together
    tables = [r[_HEADER:] for r in rows]
    if n > FIRST_MESSAGE_TABLES:
        more = agreement.exchange(fields[FIRST_MESSAGE_TABLES * nf :], group)
        tables = [t + m for t, m in zip(tables, more)]
    return [check_same_codes(fn, [t[i * nf : (i + 1) * nf] for t in tables], i if n > 1 else None) for i in range(n)]


def check_same_codes(fn: str, rows: list[list[int]], table: int | None) -> list[RankInfo]:
    """Compare one table's codes across ranks (``rows``: per rank, its :func:`.arguments.table_fields`); raises the
    ``ValueError`` naming the first difference; else every rank's sizes."""
    if any(r[SIZES:CODE_WIDTH] != rows[0][SIZES:CODE_WIDTH] for r in rows):
        name_the_difference(fn, rows, table)
    return [RankInfo(r[0], r[1], bool(r[2]), None if r[CODE_WIDTH] < 0 else tuple(r[CODE_WIDTH:])) for r in rows]


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
        plans.append(make_plan(table, batch, PoolOptions(o.mode == "max", o.padding, skip_padding, o.out_dtype), fn=fn,
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
        out_dtype=pooling.out_dtype or table.layout.dtype or table.weight.dtype,
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

    send = [[picked[q][t] if r.masks[q] is not NONE else None for t, r in enumerate(routes)] for q in range(world)]
    recv = [[(received(infos[t][p]), infos[t][p].num_bags) if t in mine else None for t in range(len(bags))]
            for p in range(world)]
    got = all_to_all_jagged(send, recv, weighted, group, dtype=dtype, float_dtype=float_dtype, device=dev)
    ids = {t: [g[t][0] for g in got] for t in mine}
    lengths = {t: [g[t][1] for g in got] for t in mine}
    weights = {t: torch.cat([w for g in got if (w := g[t][2]) is not None]) for t in mine if weighted[t]}
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


