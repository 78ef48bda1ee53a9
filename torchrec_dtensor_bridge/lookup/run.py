"""What every lookup shares once its arguments are validated: the options, steps 2-6 of a lookup.

:func:`agree_and_route` is the agreement step (with the routed counts);
:func:`run_tables` runs the lookups of one or several tables together (see
:mod:`.functional` for the order of work): the ids of every table that needs
them travel in ONE ``all_to_all`` (routed, :mod:`.route`), ``max_norm``
renormalises, and :func:`.algorithms.pooled_lookup` fuses the tables' output
exchanges. Both work from :class:`.plan.ResolvedTable` objects resolved at
the API edge, on the call's group.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..agreement import timeouts_named
from ..groups import CommGroup
from .algorithms import AFTER_AGREEMENT, LookupPlan, Strategy, pooled_lookup
from .exchange import gather_bags
from .renorm import renormalize
from .plan import Bags, ResolvedTable
from .route import PendingRoute, Route, plan_route, resolve
from .validate import InputKind, RankInfo, RejectedArguments, TableCodes, agree

__all__ = ["TableOptions", "agree_and_route", "finish", "psw_grad", "routes_for", "run_tables"]


def finish(out: torch.Tensor, bags: Bags, mode: str, padding: int | None) -> torch.Tensor:
    """After the pooled lookup: ``mean`` divides by the true bag size; ``max``: empty bags give 0."""
    if mode == "sum":
        return out
    valid = bags.ids != padding if padding is not None else torch.ones_like(bags.ids, dtype=torch.bool)
    sizes = bags.count_per_bag(valid).unsqueeze(1)
    if mode == "mean":
        return out / sizes.clamp(min=1).to(out.dtype)
    return out.masked_fill(sizes == 0, 0.0)


@dataclasses.dataclass(frozen=True)
class TableOptions:
    """One table's validated options."""

    mode: str
    padding: int | None
    max_norm: float | None
    norm_type: float


def routes_for(tables: list[ResolvedTable], bags: list[Bags], options: list[TableOptions]) -> list[Route | None]:
    """Per table, where this rank's ids go (:mod:`.route`); ``None`` for a replicated table that needs none.
    The row partitions' id counts are read once for all tables."""
    planned: list[Route | PendingRoute | None] = []
    for t, b, o in zip(tables, bags, options):
        if t.strategy is Strategy.LOCAL and o.max_norm is None:
            planned.append(None)
        else:
            planned.append(plan_route(t.layout, b, t.group.size, everyone=o.max_norm is not None))
    return resolve(planned)


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
    routes: list[Route | None], *, skip_padding: bool, bindings: list[Any] | None = None, fn: str = "lookup",
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
    routes: list[Route | None], skip_padding: bool, bindings: list[Any] | None, fn: str, group: CommGroup,
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
            renormalize(table.layout, table.layout.shards_on(rank), table.shards, gathered[t].ids, o.max_norm,
                        o.norm_type, group.group)
    track = torch.is_grad_enabled()
    plans = [
        LookupPlan(
            layout=tables[t].layout,
            shards=list(tables[t].shards),
            batch=bags[t] if tables[t].strategy is Strategy.LOCAL else gathered[t],
            num_bags=[i.num_bags for i in infos[t]],
            max_mode=o.mode == "max",
            padding_idx=o.padding,
            skip_padding=skip_padding,
            track=tables[t].weight.requires_grad and track,
            group=group.group,
            routed=routes[t] is not None and o.max_norm is None,
            table_layout=tables[t].table_layout,
            strategy=tables[t].strategy,
            optimizer=None if bindings is None else bindings[t],
            psw_grad=psw_grad(bags[t]) and track,
            route=routes[t],
            received=tuple(0 if i.sends is None else i.sends[rank] for i in infos[t]),
            call=fn,
        )
        for t, o in enumerate(options)
    ]
    return pooled_lookup(plans, [t.weight for t in tables],
                         [b.weights if p.psw_grad else None for b, p in zip(bags, plans)])


def psw_grad(bags: Bags) -> bool:
    """Whether a lookup of ``bags`` computes its per-sample weights' gradient (agreed by every rank)."""
    return bags.weights is not None and bags.weights.requires_grad and torch.is_grad_enabled()
