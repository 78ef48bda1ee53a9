"""Sharded pooled lookups for every layout, as one differentiable autograd Function.

One call looks up one or several tables (each with its own :class:`.plan.LookupPlan`); each table's
strategy (:class:`.plan.Strategy`, one module per strategy in :mod:`.strategies`) combines the partial
results of its blocks, for all the call's tables it combines at once, so a lookup of many tables costs as
many collectives as a lookup of one.

Steps of forward (every rank, in this order):

1. Every block this rank pools (the strategy's ``computes``) selects, for each bag of the batch, the ids
   that fall in its rows (:func:`_select`; ids stored elsewhere, and ``padding_idx`` in a bag lookup, are
   filtered out, so a bag with no local id gives 0 for a sum and ``-inf`` for a max).
2. All tables' blocks are pooled together, one kernel call per storage (:func:`..kernels.pool`).
3. Each strategy combines its tables' partial bags (``Strategy.forward``: its forward exchange).
4. ``mean`` (dividing by the true bag size) and max's "empty bag is 0" are applied by the caller after
   this Function, with plain autograd ops.

Steps of backward:

1. Each block receives the output gradient of its bags (``Strategy.backward``: the backward exchange;
   masked to the winning rows for max).
2. Per-sample weights that require grad get theirs (:func:`.psw.psw_backward`), before any update.
3. Tables with a fused optimizer are updated in place (:func:`fused_update`: one kernel call per storage
   where a block's update needs nothing from other ranks, :mod:`.optimizer_step` for the others); they get
   no gradient.
4. Other tables get their weight gradient (:mod:`.gradients`) as a DTensor with the weight's mesh,
   placements and layout, equal shard by shard to the unsharded gradient of all ranks' batches.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..agreement import timeouts_named
from .. import kernels, tracking
from ..kernels import Pooling, pool
from ..optim_kinds import StateKind
from .gradients import grad_dtensor, table_grads
from .optimizer_step import Sharing, apply_optimizers
from .plan import Block, LookupPlan, Strategy
from .psw import psw_backward

__all__ = ["AFTER_AGREEMENT", "IN_BACKWARD", "by_weight", "pooled_lookup"]


def _select(plan: LookupPlan, i: int) -> tuple[Pooling, torch.Tensor, torch.Tensor | None]:
    """What shard ``i`` pools: for every bag of ``plan.batch``, the ids it stores, as local rows; the number
    of them per bag; where they are in the batch (``None``: all of it, in order)."""
    spec, shard = plan.mine[i], plan.table.shards[i]
    batch, pooling = plan.batch.bags, plan.pooling
    ids = batch.ids
    r0, h = spec.offsets[0], spec.sizes[0]
    padding = pooling.skip_padding and pooling.padding_idx is not None
    whole = r0 == 0 and h == plan.table.layout.global_shape[0]
    if not padding and (whole or (plan.batch.routed and sum(plan.computes) == 1)):
        # every id of the batch is in this shard's rows: no filtering, the batch's own bag boundaries
        local, counts, psw = (ids if r0 == 0 else ids - r0), batch.lengths, batch.weights
        at = None
        psw = None if psw is None else psw.detach()
    else:
        keep = (ids >= r0) & (ids < r0 + h)
        if padding:
            keep &= ids != pooling.padding_idx
        at = keep.nonzero().squeeze(1)  # one nonzero for both gathers below
        local = ids.index_select(0, at) - r0
        counts = batch.count_per_bag(keep)
        psw = None if batch.weights is None else batch.weights.detach().index_select(0, at)
    offsets = torch.zeros(batch.num_bags + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return Pooling(shard.detach(), local, offsets, psw, pooling.max_mode, plan.out_dtype), counts, at


def _compute_blocks(plans: list[LookupPlan]) -> list[list[Block]]:
    """Every table's blocks, pooled together: one kernel call per storage (:func:`..kernels.pool`)."""
    chosen = [[(i, *_select(p, i)) for i, c in enumerate(p.computes) if c] for p in plans]
    outs = iter(pool([r for table in chosen for _, r, _, _ in table]))
    blocks = []
    for p, table in zip(plans, chosen):
        bl = []
        for i, r, counts, at in table:
            out, argmax = next(outs)
            spec = p.mine[i]
            bl.append(Block(i, out, counts, (spec.offsets[1], spec.sizes[1]), r.ids, r.offsets, r.weights, argmax,
                            at))
        blocks.append(bl)
    return blocks


AFTER_AGREEMENT = ("every rank passed the agreement step, then another rank of the group stopped or died during "
                   "the call (see that rank's own error)")
IN_BACKWARD = ("another rank of the group did not run this backward (every rank must backpropagate through "
               "the lookups it made, in the same order), or it stopped or died during it")


class _PooledLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plans: list[LookupPlan], *tensors: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        weights = tensors[: len(plans)]  # then one per-sample weights tensor (or None) per table
        n = len(plans)
        outs: list[torch.Tensor | None] = [None] * n
        wins: list[list[torch.Tensor] | None] = [None] * n
        blocks = _compute_blocks(plans)
        for strategy, tables in _by_strategy(plans).items():
            got = strategy.forward([plans[t] for t in tables], [blocks[t] for t in tables])
            for t, out, kept, win in zip(tables, *got):
                outs[t], blocks[t], wins[t] = out, kept, win
        ctx.plans, ctx.blocks, ctx.wins = plans, blocks, wins
        ctx.weight_meta = [(w.to_local(), w.device_mesh, w.placements, w.shape, w.stride())
                           for w in weights if isinstance(w, DTensor)]
        done = [o for o in outs if o is not None]
        assert len(done) == n, "every strategy gives every table an output"
        return tuple(done)

    @staticmethod
    def backward(ctx: Any, *grad_outs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        p0: LookupPlan = ctx.plans[0]
        with timeouts_named(f"{p0.call} (backward)", p0.table.group, "its backward's exchanges", IN_BACKWARD):
            return _backward(ctx, grad_outs)


def _by_strategy(plans: list[LookupPlan]) -> dict[Strategy, list[int]]:
    """The call's tables grouped by strategy (each strategy combines its tables together), in call order."""
    groups: dict[Strategy, list[int]] = {}
    for t, p in enumerate(plans):
        groups.setdefault(p.table.strategy, []).append(t)
    return groups


def _backward(ctx: Any, grad_outs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, ...]:
    plans: list[LookupPlan] = ctx.plans
    blocks: list[list[Block]] = ctx.blocks
    grad_outs = tuple(g.contiguous() for g in grad_outs)
    pieces: list[list[torch.Tensor]] = [[] for _ in plans]
    for strategy, tables in _by_strategy(plans).items():
        got = strategy.backward([plans[t] for t in tables], [blocks[t] for t in tables],
                                [grad_outs[t] for t in tables])
        for t, g in zip(tables, got):
            pieces[t] = g
    psw_grads: list[torch.Tensor | None] = [None] * len(plans)
    if any(p.psw_grad for p in plans):  # before any update: the rows as forward saw them
        psw_grads = psw_backward(plans, blocks, pieces)
    fused = [t for t, p in enumerate(plans) if p.optimizer is not None]
    if fused:  # updated in place; no weight gradient
        fused_update(plans, blocks, pieces, ctx.wins, fused)
    dense = [t for t, p in enumerate(plans) if p.optimizer is None]
    grads = table_grads(plans, blocks, pieces, ctx.wins, dense) if dense else {}
    return (None, *(grad_dtensor(m, p, grads[t]) if t in grads else None
                    for t, (m, p) in enumerate(zip(ctx.weight_meta, plans))), *psw_grads)


def pooled_lookup(
    plans: list[LookupPlan], weights: list[DTensor], per_sample_weights: list[torch.Tensor | None] | None = None
) -> list[torch.Tensor]:
    """Sum (or max) pooled rows of this rank's own bags, for each table; differentiable w.r.t. ``weights``
    and, where ``plans[t].psw_grad``, w.r.t. ``per_sample_weights[t]`` (this rank's own, flat).

    ``plans[t]`` describes the lookup of ``weights[t]``; the tables' collectives are fused.
    """
    psws = per_sample_weights if per_sample_weights is not None else [None] * len(plans)
    return list(_PooledLookup.apply(plans, *weights, *psws))


def fused_update(plans: list[LookupPlan], blocks: list[list[Block]], pieces: list[list[torch.Tensor]],
                 wins: list[list[torch.Tensor] | None], tables: list[int]) -> None:
    """Backward's fused optimizer step for ``tables`` (each with an optimizer), in place; *collective* when a
    table's update needs other ranks' gradients.

    A weight listed for several features of the call is updated once, with their gradients summed (as the
    unsharded table looked up twice): its listings' blocks go to the same path together.

    1. Kinds that count steps (Adam) count this one, once per weight, before any update (the one-pass kernel
       reads it).
    2. Every block whose update needs nothing from other ranks (:data:`.optimizer_step.Sharing`) and that a
       kernel can update goes into ONE ``tdb::sparse_update`` per storage (:func:`..kernels.update`); for an
       optimizer that tracks changed rows, the rows it writes are reported (:mod:`..tracking`).
    3. The others - replicas, row-wise kinds on column cuts, the torch math - are updated by
       :func:`.optimizer_step.apply_optimizers`, with one exchange for every table that needs one.
    """
    one_pass: list[kernels.Update] = []
    written: list[tuple[torch.Tensor, torch.Tensor]] = []  # tracked tensors and the rows the kernels write
    rest: dict[int, Sharing] = {}
    done: dict[int, set[int]] = {}
    exchange = False
    for ts in by_weight(plans, tables):  # a weight listed for several features: one update, their gradients summed
        plan, bind = plans[ts[0]], plans[ts[0]].optimizer
        assert bind is not None
        if bind.hyper.kind.counts_steps:
            bind.table.step += 1
        layout = plan.table.layout
        dim = layout.global_shape[1]
        column_cut = bind.hyper.kind.row_wise and any(s.sizes[1] != dim for s in layout.shards if s.numel)
        copies = Counter(s.box for s in layout.shards if s.numel)
        everyone = plan.table.strategy.sums_every_rank(plan)
        share = (everyone, column_cut, copies)
        alone = not everyone and not column_cut
        needs = not alone or any(c > 1 for c in copies.values())  # its copies need the exchange
        exchange = exchange or needs
        # a block goes through one kernel pass when every listing of it can (the kernel layer sums the listings)
        one = {b.index for b in blocks[ts[0]] if alone and copies[plan.mine[b.index].box] == 1
               and all(_one_pass(plans[t], c) for t in ts for c in blocks[t] if c.index == b.index)}
        for t in ts:
            for k, b in enumerate(blocks[t]):
                if b.index in one:
                    one_pass.append(_request(plans[t], b, pieces[t][k]))
                    done.setdefault(t, set()).add(b.index)
                    if bind.table.track_changed_rows:
                        written += [(x, b.ids) for x in (one_pass[-1].shard, *one_pass[-1].state)]
            if needs or len(one) < len(blocks[t]):
                rest[t] = share
    before = tracking.before_writes(x for x, _ in written) if written else {}
    kernels.update(one_pass)  # one kernel call per storage
    if written:  # (the other paths' writes void the records: tracking's version check)
        tracking.after_writes(before, written)
    if rest:
        apply_optimizers(plans, blocks, pieces, wins, rest, by_weight(plans, list(rest)), done, exchange=exchange)


def _one_pass(plan: LookupPlan, block: Block) -> bool:
    """Whether a kernel can update ``block``'s shard in one pass (its update needing nothing from other ranks):
    a sum (no arg-max), a shard, kind and batch the kernels take (:func:`..kernels.update_supported`), and, for an
    un-pooled lookup, no padding row in the shard (the kernel would train it)."""
    assert plan.optimizer is not None
    if block.argmax is not None or not kernels.update_supported(
            plan.table.shards[block.index], plan.optimizer.hyper, block.weights, ids=block.ids, offsets=block.offsets):
        return False
    padding = plan.pooling.padding_idx
    if plan.pooling.skip_padding or padding is None:
        return True
    spec = plan.mine[block.index]
    return not spec.offsets[0] <= padding < spec.offsets[0] + spec.sizes[0]


def _request(plan: LookupPlan, block: Block, grad: torch.Tensor) -> kernels.Update:
    """The kernel layer's request for ``block``'s update: its shard and batch, its views of the table's state."""
    bind = plan.optimizer
    assert bind is not None
    table, i = bind.table, block.index
    state = tuple(table.row_states[table.local_row_index(i)] if s.shape is StateKind.ROW else table.elements[i][s.name]
                  for s in bind.hyper.kind.tensor_states)
    return kernels.Update(plan.table.shards[i], block.ids, block.offsets, block.weights, grad, bind.hyper, state,
                          int(table.step))


def by_weight(plans: list[LookupPlan], tables: list[int]) -> list[list[int]]:
    """``tables`` grouped by the weight they update (its optimizer state), in call order: a weight listed for
    several features of one call is one group."""
    groups: dict[int, list[int]] = {}
    for t in tables:
        bind = plans[t].optimizer
        assert bind is not None
        groups.setdefault(id(bind.table), []).append(t)
    return list(groups.values())
