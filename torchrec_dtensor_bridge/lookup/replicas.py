"""Replicated copies (the LOCAL strategy, and blocks held by several ranks): their gradients agree.

1. forward: a rank that holds the whole table looks up its own batch on its own copy (no exchange);
   replicated blocks are computed by their first copy only (:class:`.plan.LookupPlan`'s ``computes``);
2. backward (:func:`sync_replicas`): one ``all_reduce`` per replicated box (per table for LOCAL) gives
   every copy the gradient of all ranks' batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..layout import ShardSpec
from .plan import LookupPlan, Strategy

__all__ = ["sync_replicas"]


def sync_replicas(plan: LookupPlan, grads: list[torch.Tensor]) -> None:
    """Give every replica of a block the gradient its computing copy received."""
    if plan.strategy is Strategy.LOCAL:
        whole = next(i for i, c in enumerate(plan.computes) if c)
        if not plan.local_only:
            dist.all_reduce(grads[whole], group=plan.group)
        for i, s in enumerate(plan.mine):
            if i != whole and s.sizes == plan.layout.global_shape:
                grads[i].copy_(grads[whole])
        return
    boxes: dict[tuple, list[ShardSpec]] = {}
    for s in plan.layout.shards:
        if s.numel:
            boxes.setdefault(s.box, []).append(s)
    for box, copies in boxes.items():
        if len(copies) < 2:
            continue
        held = [i for i, s in enumerate(plan.mine) if s.box == box]
        buf = grads[held[0]] if held and plan.computes[held[0]] else torch.zeros(
            box[1], dtype=plan.layout.dtype, device=plan.batch.ids.device
        )
        dist.all_reduce(buf, group=plan.group)
        for i in held:
            grads[i].copy_(buf)
