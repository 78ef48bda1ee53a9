"""The whole-table strategy: every rank of the group holds the whole table (replicated).

1. no id travels: each rank looks up its own batch on its own copy (the first whole copy it holds);
2. forward: that copy's output is the rank's output; no exchange;
3. backward: the output gradient is the block's; the dense gradient is all-reduced (every copy gets the
   gradient of all ranks' batches), and a fused update sums every rank's sparse gradient; a
   ``Replicate()`` batch needs neither (every rank already has the gradient of the whole batch).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.placement_types import Placement

from ...layout import ShardLayout
from ..arguments import Bags
from ..plan import Block, LookupPlan, PendingRoute, Route, Strategy

__all__ = ["WHOLE", "Whole"]


class Whole(Strategy):
    """Every rank holds the whole table: its own batch, no exchange (see the module docstring)."""

    name = "whole"
    own_batch = True

    def route(self, layout: ShardLayout, bags: Bags, world: int) -> Route | PendingRoute | None:
        return None

    def computes(self, layout: ShardLayout, rank: int) -> tuple[bool, ...]:
        whole = [s.sizes == layout.global_shape for s in layout.shards_on(rank)]
        first = whole.index(True)
        return tuple(i == first for i in range(len(whole)))

    def forward(self, plans: Sequence[LookupPlan], blocks: Sequence[list[Block]]
                ) -> tuple[list[torch.Tensor], list[list[Block]], list[list[torch.Tensor] | None]]:
        wins = [[bl[0].counts.unsqueeze(1) > 0] if p.pooling.max_mode else None for p, bl in zip(plans, blocks)]
        return [bl[0].out for bl in blocks], list(blocks), wins

    def backward(self, plans: Sequence[LookupPlan], blocks: Sequence[list[Block]],
                 grad_outs: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        return [[g] for g in grad_outs]

    def sums_every_rank(self, plan: LookupPlan) -> bool:
        return not plan.batch.replicated and plan.world > 1  # one rank: alone

    def sync_grads(self, plan: LookupPlan, grads: list[torch.Tensor]) -> None:
        whole = plan.computes.index(True)
        if not plan.batch.replicated:
            dist.all_reduce(grads[whole], group=plan.group)
        shape = plan.table.layout.global_shape
        for i, s in enumerate(plan.mine):
            if i != whole and s.sizes == shape:
                grads[i].copy_(grads[whole])

    def for_replicated_batch(self, layout: ShardLayout, world: int, max_mode: bool
                             ) -> tuple[Strategy, Placement] | None:
        return self, Replicate()


WHOLE = Whole()
