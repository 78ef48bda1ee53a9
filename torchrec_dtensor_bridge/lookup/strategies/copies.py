"""Replicated blocks (several copies of one box, in a column or row cut): their dense gradients agree.

A block held by several ranks is pooled by its first copy only (each strategy's ``computes``); backward
(:func:`sync_copies`) runs one ``all_reduce`` per replicated box, so every copy gets the gradient the
computing copy received.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...layout import ShardSpec
from ..plan import LookupPlan

__all__ = ["sync_copies"]


def sync_copies(plan: LookupPlan, grads: list[torch.Tensor]) -> None:
    """Give every copy of a replicated block the gradient its computing copy received; *collective*."""
    layout = plan.table.layout
    boxes: dict[tuple, list[ShardSpec]] = {}
    for s in layout.shards:
        if s.numel:
            boxes.setdefault(s.box, []).append(s)
    for box, copies in boxes.items():
        if len(copies) < 2:
            continue
        held = [i for i, s in enumerate(plan.mine) if s.box == box]
        buf = grads[held[0]] if held and plan.computes[held[0]] else torch.zeros(
            box[1], dtype=layout.dtype, device=plan.batch.bags.ids.device
        )
        dist.all_reduce(buf, group=plan.group)
        for i in held:
            grads[i].copy_(buf)
