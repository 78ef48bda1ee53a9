"""A lookup's work on this rank's own shards, through the kernel layer (:mod:`..kernels.calls`).

The kernel layer batches the calls (one kernel call per storage) and knows nothing of a lookup; this module
turns a lookup's blocks into its requests:

1. :func:`pool` and :func:`weight_grad` are the kernel layer's own (:class:`Pooling` requests carry a block's
   shard, ids, offsets and per-sample weights).
2. :func:`update_supported` - whether a block's fused update can run in one kernel pass: the kernel layer's
   answer for its shard and optimizer, and no arg-max (max pooling) nor padding row in the shard.
3. :func:`update` - each :class:`Update` (a block, its table's optimizer binding and its output gradient)
   becomes a :class:`..kernels.Update` with the block's state views; the kernel layer groups them by storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..kernels import Pooling, pool, weight_grad
from ..optim.state import Binding
from ..optim_kinds import StateKind
from .plan import Block, LookupPlan

__all__ = ["Pooling", "Update", "pool", "update", "update_supported", "weight_grad"]


@dataclass(frozen=True)
class Update:
    """One block's fused update: the table's optimizer binding, the block, its output gradient."""

    bind: Binding
    plan: LookupPlan
    block: Block
    grad: torch.Tensor


def update_supported(bind: Binding, plan: LookupPlan, block: Block) -> bool:
    """Whether a one-pass kernel can update ``block``'s shard, given that its update needs nothing from other
    ranks (the caller checks that): a sum (no arg-max), a shard and kind the kernels take
    (:func:`..kernels.update_supported`), and, for an un-pooled lookup, no padding row in the shard (the
    kernel would train it)."""
    if block.argmax is not None or not kernels.update_supported(plan.table.shards[block.index], bind.hyper, block.weights):
        return False
    if not plan.pooling.skip_padding and plan.pooling.padding_idx is not None:
        spec = plan.mine[block.index]
        if spec.offsets[0] <= plan.pooling.padding_idx < spec.offsets[0] + spec.sizes[0]:
            return False
    return True


def _request(u: Update) -> kernels.Update:
    """The kernel layer's request for ``u``: the block's shard and batch, and its views of the table's state."""
    table, i = u.bind.table, u.block.index
    state = tuple(table.row_states[table.local_row_index(i)] if s.shape is StateKind.ROW else table.elements[i][s.name]
                  for s in u.bind.hyper.kind.tensor_states)
    return kernels.Update(u.plan.table.shards[i], u.block.ids, u.block.offsets, u.block.weights, u.grad, u.bind.hyper,
                          state, int(table.step))


def update(updates: list[Update]) -> None:
    """Apply each update's optimizer to its block's shard in place, touched rows only; ONE
    ``tdb::sparse_update`` per group of blocks sharing weight storage, state storage and step."""
    kernels.update([_request(u) for u in updates])
