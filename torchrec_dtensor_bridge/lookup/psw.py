"""The gradient of per-sample weights, for every strategy.

1. every rank computes, for the ids it pooled, the dot of the bag's output gradient with the row, over
   the columns it holds (:func:`_psw_partials`);
2. ONE ``all_to_all`` for all such tables sends each partial back to the rank whose batch the id came
   from (the reverse of the id routing), which sums the partials of every rank holding a piece of the row.
"""

from __future__ import annotations

import torch

from ..collectives import all_to_all_parts, common_dtype
from .plan import Block, LookupPlan, Route

__all__ = ["psw_backward"]


def _psw_partials(plan: LookupPlan, blocks: list[Block], pieces: list[torch.Tensor]) -> torch.Tensor:
    """Per id of ``plan.batch``: the dot of its bag's output gradient with its row, over this rank's blocks'
    columns (the partial derivative by its per-sample weight; 0 for ids no block here holds)."""
    batch = plan.batch.bags
    out = torch.zeros(batch.ids.numel(), dtype=plan.table.layout.dtype, device=batch.ids.device)
    for b, g in zip(blocks, pieces):
        counts = b.offsets[1:] - b.offsets[:-1]
        bag = torch.repeat_interleave(torch.arange(counts.numel(), device=g.device), counts, output_size=b.ids.numel())
        rows = plan.table.shards[b.index].detach().index_select(0, b.ids)
        dots = (g.index_select(0, bag).to(rows.dtype) * rows).sum(dim=1)
        if b.positions is None:
            out += dots
        else:
            out.index_add_(0, b.positions, dots)
    return out


def psw_backward(
    plans: list[LookupPlan], blocks: list[list[Block]], pieces: list[list[torch.Tensor]]
) -> list[torch.Tensor | None]:
    """Per table, the gradient of this rank's own per-sample weights (``None`` where not asked for).

    Each rank computes, for the ids it pooled, the dot products over the columns
    it holds; ONE ``all_to_all`` for all such tables sends every partial back to
    the rank whose batch the id came from (the reverse of the id routing), which
    sums the partials of every rank holding a piece of the row.
    """
    out: list[torch.Tensor | None] = [None] * len(plans)
    routed = []
    for t, p in enumerate(plans):
        if not p.psw_grad:
            continue
        partial = _psw_partials(p, blocks[t], pieces[t])
        if p.table.strategy.own_batch:
            out[t] = partial  # the rank's own batch against its whole copy
        else:
            routed.append((t, partial))
    if not routed:
        return out
    p0 = plans[routed[0][0]]
    dtype = common_dtype(plans[t].table.layout.dtype for t, _ in routed)
    dev = p0.batch.bags.ids.device
    send = [[partial.split(list(plans[t].batch.received))[q] for t, partial in routed] for q in range(p0.world)]
    sizes = [sum(_route(plans[t]).counts[q] for t, _ in routed) for q in range(p0.world)]
    recv = all_to_all_parts(send, sizes, p0.group, dtype=dtype, device=dev)
    at = [0] * p0.world
    for t, _ in routed:
        route, n = _route(plans[t]), _own_ids(plans[t])
        grad = torch.zeros(n, dtype=plans[t].table.layout.dtype, device=dev)
        for q in range(p0.world):
            c = route.counts[q]
            got = recv[q][at[q] : at[q] + c].to(grad.dtype)
            at[q] += c
            mask = route.masks[q]
            if mask is True:
                grad += got
            elif mask is not False:
                where = route.positions[q] if route.positions else None
                if where is None:
                    assert isinstance(mask, torch.Tensor)
                    where = mask.nonzero().squeeze(1)
                grad.index_add_(0, where, got)
        out[t] = grad
    return out


def _route(plan: LookupPlan) -> Route:
    route = plan.batch.route
    assert route is not None, "a table whose strategy routes ids has a route"
    return route


def _own_ids(plan: LookupPlan) -> int:
    """How many ids this rank's own batch of the table has (the length of its per-sample weights)."""
    route = _route(plan)
    if route.partition:  # every id goes to exactly one rank
        return sum(route.counts)
    for mask, count in zip(route.masks, route.counts):
        if isinstance(mask, torch.Tensor):
            return mask.numel()
        if mask is True:
            return count
    raise AssertionError("a table with per-sample weights is read by some rank")
