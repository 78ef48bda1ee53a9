"""Max pooling of row-cut tables (:class:`.rows.Rows`), and a table's partial output at full width.

* :func:`reduce_max` - one ``all_reduce(MAX)`` per table, and where this rank's blocks win (ties to the lowest
  rank), so backward sends gradient only to the winning rows;
* :func:`partial_output` - this rank's blocks at their columns (a ``Replicate()`` batch's un-reduced sums, a
  max's partial maxima).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...collectives import row_starts
from ..plan import Block, LookupPlan

__all__ = ["partial_output", "reduce_max"]


def partial_output(plan: LookupPlan, blocks: list[Block], fill: float) -> torch.Tensor:
    """All bags' partial output at full width: this rank's blocks placed at their columns (``fill`` elsewhere)."""
    total, dim = plan.batch.bags.num_bags, plan.table.layout.global_shape[1]
    if len(blocks) == 1 and blocks[0].cols == (0, dim) and not plan.pooling.max_mode:
        return blocks[0].out
    partial = torch.full((total, dim), fill, dtype=plan.out_dtype, device=plan.batch.bags.ids.device)
    for b in blocks:
        c0, w = b.cols
        if plan.pooling.max_mode:
            val = b.out.masked_fill(b.counts.unsqueeze(1) == 0, fill)
            partial[:, c0 : c0 + w] = torch.maximum(partial[:, c0 : c0 + w], val)
        else:
            partial[:, c0 : c0 + w] += b.out
    return partial


def reduce_max(plan: LookupPlan, blocks: list[Block], track: bool) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """REDUCE with max, one table: the all-reduced max, and (``track``) where this rank's blocks win."""
    partial = partial_output(plan, blocks, float("-inf"))
    best = partial.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=plan.group)
    win = _winners(plan, blocks, partial, best) if track else None
    start = row_starts(plan.batch.num_bags)[plan.rank]
    return best[start : start + plan.batch.num_bags[plan.rank]].clone(), win


def _winners(plan: LookupPlan, blocks: list[Block], partial: torch.Tensor, best: torch.Tensor) -> list[torch.Tensor]:
    """Per block, where it holds the max that torch would pick (one row per (bag, column)).

    Ties between ranks go to the lowest rank, ties between blocks of one rank
    to the first block; -inf (no id anywhere) never wins.
    """
    claim = (partial == best) & torch.isfinite(best)
    who = torch.where(claim, plan.rank, plan.world).to(torch.int32)
    dist.all_reduce(who, op=dist.ReduceOp.MIN, group=plan.group)
    mine = who == plan.rank
    taken = torch.zeros_like(mine)
    out = []
    for b in blocks:
        c0, w = b.cols
        here = mine[:, c0 : c0 + w] & (b.out == best[:, c0 : c0 + w]) & ~taken[:, c0 : c0 + w]
        here &= b.counts.unsqueeze(1) > 0
        taken[:, c0 : c0 + w] |= here
        out.append(here)
    return out
