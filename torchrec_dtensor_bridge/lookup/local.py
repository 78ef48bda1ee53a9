"""A lookup's work on this rank's own shards, through the kernel layer: one kernel call per storage.

A TorchRec fused module keeps the tables of a rank that share a kernel configuration in ONE buffer, and the
shards :func:`..state_dict_to_dtensor` makes of them are views of it. The kernel ops (:mod:`..kernels.ops`)
take tables as element offsets into one flat storage, so the blocks of one call whose shards share a
storage are looked up, and updated, together:

1. :func:`pool` - blocks whose shard the ops accept (:func:`..kernels.accepts`: a fp32 contiguous shard, a
   sum) are grouped by storage (and batch size, and whether they carry per-sample weights); each group is
   ONE ``tdb::pool_sum`` over a flat view of the storage spanning its shards (no copy), and each block's
   output is its columns of the result. MAX pooling, other dtypes and strided shards run
   ``torch.embedding_bag`` on the shard itself (fbgemm has no MAX; max keeps its arg-max rows for backward).
2. :func:`weight_grad` - the dense gradient of one block's shard (``tdb::pool_sum_backward``; scattered by
   the arg-max rows for max).
3. :func:`update` - blocks whose fused update needs nothing from other ranks are grouped by weight storage,
   state storage and optimizer step; each group is ONE ``tdb::sparse_update``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..optim.state import Binding
from .plan import Block, LookupPlan

__all__ = ["Pooling", "Update", "pool", "update", "update_supported", "weight_grad"]


@dataclass(frozen=True)
class Pooling:
    """One block's pooled lookup: ``shard`` (read in place), its local ``ids``, ``bags + 1`` ``offsets``."""

    shard: torch.Tensor
    ids: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None
    max_mode: bool


def _flat(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """A flat view of the storage ``tensors`` share, spanning them all, and each one's element offset in it."""
    lo = min(int(t.storage_offset()) for t in tensors)
    hi = max(int(t.storage_offset()) + t.numel() for t in tensors)
    return torch.as_strided(tensors[0], (hi - lo,), (1,), lo), [int(t.storage_offset()) - lo for t in tensors]


def _batch(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Several tables' ``(ids, offsets, weights)`` as one batch in the ops' form (offsets table-major)."""
    if len(parts) == 1:
        return parts[0]
    ids = torch.cat([p[0] for p in parts])
    pieces, at = [parts[0][1][:1]], 0
    for p in parts:
        pieces.append(p[1][1:] + at)
        at += p[0].numel()
    psw = None if parts[0][2] is None else torch.cat([p[2] for p in parts if p[2] is not None])
    return ids, torch.cat(pieces), psw


def _home(t: torch.Tensor) -> tuple[int, str]:
    return t.untyped_storage().data_ptr(), str(t.device)


def pool(requests: list[Pooling]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per request, its ``(bags, dim)`` output (a column view when it shared a kernel call) and, for max, the
    arg-max row of every (bag, column) (``None`` for a sum); no autograd graph."""
    out: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * len(requests)
    groups: dict[tuple, list[int]] = {}
    with torch.no_grad():
        for k, r in enumerate(requests):
            if r.max_mode or not kernels.accepts(r.shard):
                res, _, _, argmax = torch.embedding_bag(r.shard, r.ids, r.offsets, False, 2 if r.max_mode else 0,
                                                        False, r.weights, True)
                out[k] = (res, argmax if r.max_mode else None)
                continue
            key = (*_home(r.shard), r.offsets.numel(), r.weights is not None)
            groups.setdefault(key, []).append(k)
        for members in groups.values():
            shards = [requests[k].shard for k in members]
            flat, at = _flat(shards)
            ids, offsets, psw = _batch([(requests[k].ids, requests[k].offsets, requests[k].weights)
                                        for k in members])
            res = torch.ops.tdb.pool_sum(flat, at, [s.shape[1] for s in shards], [s.shape[0] for s in shards],
                                         ids, offsets, None if psw is None else psw.to(torch.float32))
            c0 = 0
            for k, s in zip(members, shards):
                out[k] = (res if len(members) == 1 else res[:, c0 : c0 + s.shape[1]], None)
                c0 += s.shape[1]
    return [o for o in out if o is not None]


def weight_grad(grad: torch.Tensor, r: Pooling, argmax: torch.Tensor | None = None) -> torch.Tensor:
    """The dense gradient of ``r.shard`` given its output gradient (for max: already masked to the rows that
    win across ranks, and ``argmax`` from :func:`pool`)."""
    if argmax is not None:
        return torch.zeros_like(r.shard).scatter_add_(0, argmax.clamp(min=0), grad.to(r.shard.dtype))
    if not kernels.accepts(r.shard):
        return kernels.add_bag_grads(torch.zeros_like(r.shard), grad, r.ids, r.offsets, r.weights)
    grad = grad.to(torch.float32)
    grad = grad if grad.stride(-1) == 1 else grad.contiguous()
    psw = None if r.weights is None else r.weights.to(torch.float32)
    flat = torch.ops.tdb.pool_sum_backward(grad, [r.shard.shape[1]], [r.shard.shape[0]], r.ids, r.offsets, psw)
    return flat.view(r.shard.shape)


@dataclass(frozen=True)
class Update:
    """One block's fused update: the table's optimizer binding, the block, its output gradient."""

    bind: Binding
    plan: LookupPlan
    block: Block
    grad: torch.Tensor


def update_supported(bind: Binding, plan: LookupPlan, block: Block) -> bool:
    """Whether a one-pass kernel can update ``block``'s shard, given that its update needs nothing from other
    ranks (the caller checks that): a sum (no arg-max) over a shard the ops accept, a kind the chosen kernel
    has (:func:`..kernels.update_impl`), and, for an un-pooled lookup, no padding row in the shard (the
    kernel would train it)."""
    hyper = bind.hyper
    shard = plan.table.shards[block.index]
    if block.argmax is not None or not kernels.accepts(shard):
        return False
    if kernels.update_impl(shard.device, hyper.kind.value, hyper.weight_decay) is kernels.Impl.TORCH:
        return False
    if not plan.pooling.skip_padding and plan.pooling.padding_idx is not None:
        spec = plan.mine[block.index]
        if spec.offsets[0] <= plan.pooling.padding_idx < spec.offsets[0] + spec.sizes[0]:
            return False
    return block.weights is None or block.weights.dtype == torch.float32


def _states(u: Update) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    state, kind = u.bind.table, u.bind.hyper.kind.value
    if kind == "rowwise_adagrad":
        return state.row_states[state.local_row_index(u.block.index)], None
    if kind in ("adagrad", "adam"):
        elements = state.elements[u.block.index]
        return elements["momentum1"], elements.get("momentum2")
    return None, None


def _columns(grads: list[torch.Tensor]) -> torch.Tensor:
    """The blocks' output gradients side by side: the base view itself when they are adjacent columns of one
    tensor (as the exchanges hand them), else a copy."""
    g0 = grads[0]
    adjacent = all(g.untyped_storage().data_ptr() == g0.untyped_storage().data_ptr() and g.stride() == g0.stride()
                   and g.shape[0] == g0.shape[0] for g in grads)
    at = g0.storage_offset()
    for g in grads:
        adjacent = adjacent and g.storage_offset() == at and g.stride(-1) == 1
        at += g.shape[1]
    if adjacent:
        width = sum(g.shape[1] for g in grads)
        return torch.as_strided(g0, (g0.shape[0], width), (g0.stride(0) if g0.shape[0] > 1 else width, 1),
                                g0.storage_offset())
    return torch.cat([g.to(torch.float32) for g in grads], dim=1)


def update(updates: list[Update]) -> None:
    """Apply each update's optimizer to its block's shard in place, touched rows only; ONE
    ``tdb::sparse_update`` per group of blocks sharing weight storage, state storage and step."""
    groups: dict[tuple, list[tuple[Update, tuple[torch.Tensor | None, torch.Tensor | None]]]] = {}
    for u in updates:
        shard = u.plan.table.shards[u.block.index]
        held = _states(u)
        m1, m2 = held
        key = (*_home(shard), u.bind.hyper, int(u.bind.table.step), u.block.offsets.numel(),
               u.block.weights is not None, None if m1 is None else _home(m1), None if m2 is None else _home(m2))
        groups.setdefault(key, []).append((u, held))
    for group in groups.values():
        members = [u for u, _ in group]
        states = [st for _, st in group]
        shards = [u.plan.table.shards[u.block.index].detach() for u in members]
        flat, at = _flat(shards)
        m1 = m2 = None
        m1_at: list[int] = []
        m2_at: list[int] = []
        if states[0][0] is not None:
            m1, m1_at = _flat([s[0] for s in states if s[0] is not None])
        if states[0][1] is not None:
            m2, m2_at = _flat([s[1] for s in states if s[1] is not None])
        ids, offsets, psw = _batch([(u.block.ids, u.block.offsets, u.block.weights) for u in members])
        grad = _columns([u.grad for u in members])
        hyper, step = members[0].bind.hyper, int(members[0].bind.table.step)
        torch.ops.tdb.sparse_update(
            flat, at, [s.shape[1] for s in shards], [s.shape[0] for s in shards], grad, ids, offsets, psw,
            hyper.kind.value, m1, m1_at, m2, m2_at, hyper.lr, hyper.eps, hyper.weight_decay,
            hyper.weight_decay_mode.value, hyper.beta1, hyper.beta2, step,
        )
