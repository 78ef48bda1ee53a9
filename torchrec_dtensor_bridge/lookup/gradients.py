"""The dense weight gradient of a lookup's tables (those without a fused optimizer).

1. each pooled block's shard gets the gradient of the bags it pooled (:func:`..kernels.weight_grads`, every
   table of the call at once: one kernel call per storage; for max only where it won), every other shard zeros;
2. an un-pooled lookup's padding row gets none;
3. the table's strategy makes every copy of a block agree (``Strategy.sync_grads``);
4. the shards become one DTensor with the weight's mesh, placements and layout (:func:`grad_dtensor`).
"""

from __future__ import annotations


import torch
from torch.distributed.tensor import DTensor

from ..wrapper import LocalShardsWrapper
from ..kernels import Pooling, weight_grads
from .plan import Block, LookupPlan

__all__ = ["grad_dtensor", "table_grads"]


def table_grads(plans: list[LookupPlan], blocks: list[list[Block]], pieces: list[list[torch.Tensor]],
                wins: list[list[torch.Tensor] | None], dense: list[int]) -> dict[int, list[torch.Tensor]]:
    """Per table ``t`` of ``dense``, its per-shard weight gradients from its blocks' output gradients (every
    table's kernel calls made together)."""
    requests: list[tuple[torch.Tensor, Pooling, torch.Tensor | None]] = []
    where: list[tuple[int, int]] = []
    for t in dense:
        plan, win = plans[t], wins[t]
        for k, (b, g) in enumerate(zip(blocks[t], pieces[t])):
            if win is not None:
                g = g * win[k]
            r = Pooling(plan.table.shards[b.index].detach(), b.ids, b.offsets, b.weights, plan.pooling.max_mode)
            requests.append((g, r, b.argmax))
            where.append((t, b.index))
    computed: dict[tuple[int, int], torch.Tensor] = dict(zip(where, weight_grads(requests)))
    out: dict[int, list[torch.Tensor]] = {}
    for t in dense:
        plan = plans[t]
        # only shards no block was computed on (replicas, empty blocks) start from zeros
        grads = [computed[(t, i)] if (t, i) in computed else torch.zeros_like(s)
                 for i, s in enumerate(plan.table.shards)]
        _mask_padding(plan, grads)
        plan.table.strategy.sync_grads(plan, grads)
        out[t] = grads
    return out


def _mask_padding(plan: LookupPlan, grads: list[torch.Tensor]) -> None:
    """An un-pooled lookup returns the padding row but must not train it."""
    p = plan.pooling.padding_idx
    if plan.pooling.skip_padding or p is None:
        return
    for spec, g in zip(plan.mine, grads):
        if spec.offsets[0] <= p < spec.offsets[0] + spec.sizes[0]:
            g[p - spec.offsets[0]] = 0


def grad_dtensor(meta: tuple, plan: LookupPlan, grads: list[torch.Tensor]) -> DTensor:
    local, mesh, placements, shape, stride = meta
    if isinstance(local, LocalShardsWrapper):
        g_local: torch.Tensor = LocalShardsWrapper(
            grads, [s.offsets for s in plan.mine], plan.table.layout.global_shape, layout=plan.table.table_layout,
            dtype=local.dtype, device=local.device, _trusted=True,
        )
    elif grads:
        g_local = grads[0]
    else:
        g_local = torch.zeros_like(local)
    return DTensor.from_local(g_local, mesh, placements, run_check=False, shape=shape, stride=stride)
