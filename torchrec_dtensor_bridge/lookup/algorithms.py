"""Sharded pooled lookups for every layout, as one differentiable autograd Function.

One call looks up one or several tables (each with its own :class:`LookupPlan`); the collectives of all
tables that combine the same way are fused, so a lookup of many tables costs as many collectives as a
lookup of one. Each layout family's communication lives in its own module: :mod:`.columns` (blocks
spanning all rows), :mod:`.rows` (row cuts), :mod:`.replicas` (whole or replicated copies).

Steps of forward (every rank, in this order):

1. Every shard this rank computes for (the first copy of each distinct block) selects, for each bag of
   the batch, the ids that fall in its rows (:func:`_select`; ids stored elsewhere, and ``padding_idx``
   in a bag lookup, are filtered out, so a bag with no local id gives 0 for a sum and ``-inf`` for a max).
2. All tables' blocks are pooled together, one kernel call per storage (:func:`.local.pool`).
3. The partial bags are combined by the strategy the layout allows: ``LOCAL`` (every rank holds the
   whole table: its own batch, no exchange), ``COLUMNS`` (:func:`.columns.exchange_columns`), ``REDUCE``
   (:class:`.rows.ReduceMessage`, or :func:`.rows.reduce_max`); a ``Replicate()`` batch (``local_only``)
   is not exchanged at all.
4. ``mean`` (dividing by the true bag size) and max's "empty bag is 0" are applied by the caller after
   this Function, with plain autograd ops.

Steps of backward:

1. Each block receives the output gradient of its bags: :func:`.columns.columns_backward`,
   :func:`.rows.gather_grads` (masked to the winning rows for max), or the rank's own.
2. Per-sample weights that require grad get theirs (:func:`.psw.psw_backward`), before any update.
3. Tables with a fused optimizer are updated in place (:func:`.optimizer_step.apply_optimizers`: one
   kernel call per storage where a shard needs nothing from other ranks); they get no gradient.
4. Other tables get their weight gradient (:func:`.local.weight_grad`; replicas synchronised by
   :func:`.replicas.sync_replicas`) as a DTensor with the weight's mesh, placements and layout,
   equal shard by shard to the unsharded gradient of all ranks' batches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..agreement import timeouts_named
from ..groups import of_group
from ..wrapper import LocalShardsWrapper
from .columns import columns_backward, exchange_columns
from .local import Pooling, pool, weight_grad
from .optimizer_step import apply_optimizers
from .psw import psw_backward
from .plan import Block, LookupPlan, Strategy, partial_output, strategy_for
from .replicas import sync_replicas
from .rows import ReduceMessage, gather_grads, reduce_max

__all__ = ["LookupPlan", "Strategy", "pooled_lookup", "strategy_for"]


def _select(plan: LookupPlan, i: int) -> tuple[Pooling, torch.Tensor, torch.Tensor | None]:
    """What shard ``i`` pools: for every bag of ``plan.batch``, the ids it stores, as local rows; the number
    of them per bag; where they are in the batch (``None``: all of it, in order)."""
    spec, shard = plan.mine[i], plan.shards[i]
    ids, batch = plan.batch.ids, plan.batch
    r0, h = spec.offsets[0], spec.sizes[0]
    padding = plan.skip_padding and plan.padding_idx is not None
    whole = r0 == 0 and h == plan.layout.global_shape[0]
    if not padding and (whole or (plan.routed and sum(plan.computes) == 1)):
        # every id of the batch is in this shard's rows: no filtering, the batch's own bag boundaries
        local, counts, psw = (ids if r0 == 0 else ids - r0), batch.lengths, batch.weights
        at = None
        psw = None if psw is None else psw.detach()
    else:
        keep = (ids >= r0) & (ids < r0 + h)
        if padding:
            keep &= ids != plan.padding_idx
        at = keep.nonzero().squeeze(1)  # one nonzero for both gathers below
        local = ids.index_select(0, at) - r0
        counts = batch.count_per_bag(keep)
        psw = None if batch.weights is None else batch.weights.detach().index_select(0, at)
    offsets = torch.zeros(batch.num_bags + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return Pooling(shard.detach(), local, offsets, psw, plan.max_mode), counts, at


def _compute_blocks(plans: list[LookupPlan]) -> list[list[Block]]:
    """Every table's blocks, pooled together: one kernel call per storage (:func:`.local.pool`)."""
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


def _local_output(plan: LookupPlan, blocks: list[Block]) -> torch.Tensor:
    """``local_only``: this rank's blocks side by side (COLUMNS) or summed into a partial (REDUCE)."""
    if plan.strategy is Strategy.COLUMNS:
        n, dtype, dev = plan.batch.num_bags, plan.layout.dtype, plan.batch.ids.device
        return torch.cat([b.out for b in blocks], dim=1) if blocks else torch.empty(n, 0, dtype=dtype, device=dev)
    return partial_output(plan, blocks, 0.0)


def _reduces_sum(plan: LookupPlan) -> bool:
    """The table's partial sums are combined by the fused reduce-scatter (:class:`.rows.ReduceMessage`)."""
    return plan.strategy is Strategy.REDUCE and not plan.local_only and not plan.max_mode


def _has_win(plan: LookupPlan, blocks: list[Block]) -> list[torch.Tensor] | None:
    """For max: which bags each block saw an id of (a block with none must not receive gradient)."""
    return [b.counts.unsqueeze(1) > 0 for b in blocks] if plan.max_mode else None


AFTER_AGREEMENT = ("every rank passed the agreement step, then another rank of the group stopped or died during "
                   "the call (see that rank's own error)")
IN_BACKWARD = ("another rank of the group did not run this backward (every rank must backpropagate through "
               "the lookups it made, in the same order), or it stopped or died during it")


class _PooledLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plans: list[LookupPlan], *tensors: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        weights = tensors[: len(plans)]  # then one per-sample weights tensor (or None) per table
        outs: list[torch.Tensor | None] = [None] * len(plans)
        wins: list[list[torch.Tensor] | None] = [None] * len(plans)
        reduce = [t for t, p in enumerate(plans) if _reduces_sum(p)]
        # each REDUCE-sum table's partial goes into the fused message as soon as it is computed
        message = ReduceMessage(plans, reduce) if reduce else None
        blocks: list[list[Block]] = []
        columns = []
        for t, (p, bl) in enumerate(zip(plans, _compute_blocks(plans))):
            if p.strategy is Strategy.LOCAL:
                outs[t], wins[t] = bl[0].out, _has_win(p, bl[:1])
            elif p.local_only:
                outs[t], wins[t] = _local_output(p, bl), _has_win(p, bl)
            elif p.strategy is Strategy.COLUMNS:
                columns.append(t)
                wins[t] = _has_win(p, bl)
            elif p.max_mode:
                outs[t], wins[t] = reduce_max(p, bl, p.track)
            else:
                assert message is not None
                bl = message.add(t, bl)
            blocks.append(bl)
        for t, out in zip(columns, exchange_columns(plans, blocks, columns)):
            outs[t] = out
        if message is not None:
            for t, out in zip(reduce, message.reduce()):
                outs[t] = out
        ctx.plans, ctx.blocks, ctx.wins = plans, blocks, wins
        ctx.weight_meta = [(w.to_local(), w.device_mesh, w.placements, w.shape, w.stride())
                           for w in weights if isinstance(w, DTensor)]
        done = [o for o in outs if o is not None]
        assert len(done) == len(plans), "every strategy gives every table an output"
        return tuple(done)

    @staticmethod
    def backward(ctx: Any, *grad_outs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        p0: LookupPlan = ctx.plans[0]
        with timeouts_named(f"{p0.call} (backward)", of_group(p0.group), "its backward's exchanges", IN_BACKWARD):
            return _backward(ctx, grad_outs)


def _backward(ctx: Any, grad_outs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, ...]:
    plans: list[LookupPlan] = ctx.plans
    blocks: list[list[Block]] = ctx.blocks
    grad_outs = tuple(g.contiguous() for g in grad_outs)
    pieces: list[list[torch.Tensor]] = [[] for _ in plans]
    columns, reduce = [], []
    for t, (p, bl, g) in enumerate(zip(plans, blocks, grad_outs)):
        if p.strategy is Strategy.LOCAL:
            pieces[t] = [g]
        elif p.local_only and p.strategy is Strategy.COLUMNS:
            pieces[t] = list(g.split([b.cols[1] for b in bl], dim=1))
        elif p.local_only:
            pieces[t] = [g[:, b.cols[0] : b.cols[0] + b.cols[1]] for b in bl]
        elif p.strategy is Strategy.COLUMNS:
            columns.append(t)
        else:
            reduce.append(t)
    for t, got in zip(columns, columns_backward(plans, blocks, grad_outs, columns)):
        pieces[t] = got
    for t, full in zip(reduce, gather_grads(plans, grad_outs, reduce)):
        pieces[t] = [full[:, b.cols[0] : b.cols[0] + b.cols[1]] for b in blocks[t]]
    psw_grads = psw_backward(plans, blocks, pieces)  # before any update: the rows as forward saw them
    fused = [t for t, p in enumerate(plans) if p.optimizer is not None]
    if fused:  # updated in place; no weight gradient
        apply_optimizers(plans, blocks, pieces, ctx.wins, fused)
    grads = [None if p.optimizer is not None else _table_grads(p, bl, pc, win)
             for p, bl, pc, win in zip(plans, blocks, pieces, ctx.wins)]
    return (None, *(None if g is None else _grad_dtensor(m, p, g)
                    for m, p, g in zip(ctx.weight_meta, plans, grads)), *psw_grads)


def _table_grads(
    plan: LookupPlan, blocks: list[Block], pieces: list[torch.Tensor], win: list[torch.Tensor] | None
) -> list[torch.Tensor]:
    """One table's per-shard weight gradients from its blocks' output gradients."""
    computed: dict[int, torch.Tensor] = {}
    for k, (b, g) in enumerate(zip(blocks, pieces)):
        if win is not None:
            g = g * win[k]
        r = Pooling(plan.shards[b.index].detach(), b.ids, b.offsets, b.weights, plan.max_mode)
        computed[b.index] = weight_grad(g, r, b.argmax)
    # only shards no block was computed on (replicas, empty blocks) start from zeros
    grads = [computed[i] if i in computed else torch.zeros_like(s) for i, s in enumerate(plan.shards)]
    _mask_padding(plan, grads)
    sync_replicas(plan, grads)
    return grads


def _mask_padding(plan: LookupPlan, grads: list[torch.Tensor]) -> None:
    """An un-pooled lookup returns the padding row but must not train it."""
    p = plan.padding_idx
    if plan.skip_padding or p is None:
        return
    for spec, g in zip(plan.mine, grads):
        if spec.offsets[0] <= p < spec.offsets[0] + spec.sizes[0]:
            g[p - spec.offsets[0]] = 0


def _grad_dtensor(meta: tuple, plan: LookupPlan, grads: list[torch.Tensor]) -> DTensor:
    local, mesh, placements, shape, stride = meta
    if isinstance(local, LocalShardsWrapper):
        g_local: torch.Tensor = LocalShardsWrapper(
            grads, [s.offsets for s in plan.mine], plan.layout.global_shape, layout=plan.table_layout or plan.layout,
            dtype=local.dtype, device=local.device, _trusted=True,
        )
    elif grads:
        g_local = grads[0]
    else:
        g_local = torch.zeros_like(local)
    return DTensor.from_local(g_local, mesh, placements, run_check=False, shape=shape, stride=stride)


def pooled_lookup(
    plans: list[LookupPlan], weights: list[DTensor], per_sample_weights: list[torch.Tensor | None] | None = None
) -> list[torch.Tensor]:
    """Sum (or max) pooled rows of this rank's own bags, for each table; differentiable w.r.t. ``weights``
    and, where ``plans[t].psw_grad``, w.r.t. ``per_sample_weights[t]`` (this rank's own, flat).

    ``plans[t]`` describes the lookup of ``weights[t]``; the tables' collectives are fused.
    """
    psws = per_sample_weights if per_sample_weights is not None else [None] * len(plans)
    return list(_PooledLookup.apply(plans, *weights, *psws))
