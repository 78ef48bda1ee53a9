"""Sharded pooled lookups for every layout, as one differentiable autograd Function.

Steps of a lookup (every rank, in this order):

1. Every shard this rank computes for (the first replica of each distinct
   block) pools, for each bag of the batch, the ids that fall in its rows.
   Ids stored elsewhere, and ``padding_idx`` in a bag lookup, are filtered out
   before the kernel runs: this is the SPEC's "spare row" without allocating
   one (a spare row would need a copy of the shard). A bag with no local id
   gives 0 for a sum and ``-inf`` for a max, so it does not contribute.
2. The partial bags are combined according to the strategy the layout allows:

   * ``LOCAL`` - every rank holds the whole table (replicated): no gather, no
     exchange; the batch is the rank's own. Backward all-reduces the gradient
     so every replica gets the gradient of all ranks' batches.
   * ``COLUMNS`` - every block spans all rows (column-wise, table-wise,
     table-column-wise): each (bag, column) is computed by exactly one rank, so
     one ``all_to_all`` hands every rank the columns of its own bags.
     Backward is the reverse ``all_to_all``.
   * ``REDUCE`` - rows are cut (row-wise, table-row-wise, grid): the partial
     bags of all ranks' batches are summed with one ``reduce_scatter`` back to
     each rank's own bags (max: one ``all_reduce(MAX)``, which also tells every
     rank where the winning rows are). Backward all-gathers the output
     gradient (masked to the winning rows for max).
3. ``mean`` (dividing by the true bag size) and max's "empty bag is 0" are
   applied by the caller after this Function, with plain autograd ops.

The weight's gradient is returned as a DTensor with the weight's own mesh,
placements and layout (a :class:`LocalShardsWrapper` of per-shard gradients
when the weight has one), equal shard by shard to the unsharded gradient of
all ranks' batches.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..layout import ShardLayout, ShardSpec
from ..wrapper import LocalShardsWrapper
from .exchange import all_to_all_rows, gather_rows, reduce_scatter_rows, row_starts
from .tbe import pool_rows, pool_rows_backward
from .validate import Bags

__all__ = ["LookupPlan", "Strategy", "pooled_lookup", "strategy_for"]


class Strategy(enum.Enum):
    """How partial results are combined across ranks (see the module docstring)."""

    LOCAL = "local"
    COLUMNS = "columns"
    REDUCE = "reduce"


def strategy_for(layout: ShardLayout, world: int) -> Strategy:
    """The cheapest correct strategy for ``layout`` on ``world`` ranks."""
    full = {s.rank for s in layout.shards if s.sizes == layout.global_shape}
    if full >= set(range(world)):
        return Strategy.LOCAL
    rows = layout.global_shape[0]
    if all(s.sizes[0] == rows for s in layout.unique_shards() if s.numel):
        return Strategy.COLUMNS
    return Strategy.REDUCE


@dataclass
class LookupPlan:
    """Everything one lookup needs, fixed before the autograd Function runs.

    Attributes:
        layout: the weight's layout.
        shards: this rank's shard tensors, in ``layout.shards_on(rank)`` order.
        batch: the bags to compute: this rank's own (``LOCAL``) or all ranks' in rank order.
        num_bags: every rank's number of bags, in rank order.
        max_mode: element-wise max instead of sum.
        padding_idx: the padding row (non-negative), or ``None``.
        skip_padding: True for bags (padding ids contribute nothing); False for an
            un-pooled lookup (the padding row is returned but gets no gradient).
        track: record what backward needs (the weight requires grad and grad mode is on).
        group: the process group.
        local_only: the batch is REPLICATED (the same on every rank, from a
            ``Replicate`` DTensor input): no exchange at all. ``LOCAL`` returns the
            rank's lookup and backward does not all-reduce (every rank already has
            the gradient of the whole batch); ``COLUMNS`` returns this rank's blocks
            side by side (``(num_bags, width of its blocks)``, to be carried as a
            ``Shard(1)`` output); ``REDUCE`` returns this rank's un-reduced partial
            ``(num_bags, dim)`` (a ``Partial()`` output). Backward uses the output
            gradient as is. Only replicated blocks (several copies of one box)
            still all-reduce their gradient.
    """

    layout: ShardLayout
    shards: list[torch.Tensor]
    batch: Bags
    num_bags: list[int]
    max_mode: bool
    padding_idx: int | None
    skip_padding: bool
    track: bool = False
    group: dist.ProcessGroup | None = None
    local_only: bool = False
    rank: int = field(init=False)
    world: int = field(init=False)
    strategy: Strategy = field(init=False)
    mine: tuple[ShardSpec, ...] = field(init=False)
    computes: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.strategy = strategy_for(self.layout, self.world)
        self.mine = self.layout.shards_on(self.rank)
        if self.strategy is Strategy.LOCAL:
            whole = [s.sizes == self.layout.global_shape for s in self.mine]
            self.computes = [w and i == whole.index(True) for i, w in enumerate(whole)]
        else:
            first = set(self.layout.unique_shards())
            self.computes = [s in first and s.numel > 0 for s in self.mine]

    def columns_of(self, rank: int) -> list[tuple[int, int]]:
        """(first column, width) of each block ``rank`` computes, in its order (COLUMNS)."""
        first = self.layout.unique_shards()
        return [(s.offsets[1], s.sizes[1]) for s in first if s.rank == rank and s.numel]


@dataclass
class _Block:
    """One computed shard: its pooled output and what its backward needs."""

    index: int
    out: torch.Tensor
    counts: torch.Tensor
    cols: tuple[int, int]
    ids: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None
    argmax: torch.Tensor | None


def _compute_block(plan: LookupPlan, i: int, bag_of_id: torch.Tensor) -> _Block:
    spec, shard = plan.mine[i], plan.shards[i]
    ids, batch = plan.batch.ids, plan.batch
    r0, h = spec.offsets[0], spec.sizes[0]
    keep = (ids >= r0) & (ids < r0 + h)
    if plan.skip_padding and plan.padding_idx is not None:
        keep &= ids != plan.padding_idx
    local = ids[keep] - r0
    counts = torch.bincount(bag_of_id[keep], minlength=batch.num_bags)
    offsets = torch.zeros(batch.num_bags + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    psw = None if batch.weights is None else batch.weights[keep]
    out, argmax = pool_rows(shard.detach(), local, offsets, psw, max_mode=plan.max_mode)
    return _Block(i, out, counts, (spec.offsets[1], spec.sizes[1]), local, offsets, psw, argmax)


def _combine_reduce(plan: LookupPlan, blocks: list[_Block], ctx: Any, track: bool) -> torch.Tensor:
    total, dim = sum(plan.num_bags), plan.layout.global_shape[1]
    fill = float("-inf") if plan.max_mode else 0.0
    partial = torch.full((total, dim), fill, dtype=plan.layout.dtype, device=plan.batch.ids.device)
    for b in blocks:
        c0, w = b.cols
        val = b.out
        if plan.max_mode:
            val = val.masked_fill(b.counts.unsqueeze(1) == 0, fill)
            partial[:, c0 : c0 + w] = torch.maximum(partial[:, c0 : c0 + w], val)
        else:
            partial[:, c0 : c0 + w] += val
    if not plan.max_mode:
        return reduce_scatter_rows(partial, plan.num_bags, plan.group, dist.ReduceOp.SUM)
    best = partial.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=plan.group)
    if track:
        ctx.win = _winners(plan, blocks, partial, best)
    start = row_starts(plan.num_bags)[plan.rank]
    return best[start : start + plan.num_bags[plan.rank]].clone()


def _winners(plan: LookupPlan, blocks: list[_Block], partial: torch.Tensor, best: torch.Tensor) -> list[torch.Tensor]:
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


def _combine_columns(plan: LookupPlan, blocks: list[_Block]) -> torch.Tensor:
    dim, dtype, dev = plan.layout.global_shape[1], plan.layout.dtype, plan.batch.ids.device
    assert dtype is not None, "layout_of(DTensor) always records the dtype"
    mine = torch.cat([b.out for b in blocks], dim=1) if blocks else torch.empty(
        sum(plan.num_bags), 0, dtype=dtype, device=dev
    )
    send = list(mine.split(plan.num_bags))
    own = plan.num_bags[plan.rank]
    widths = [sum(w for _, w in plan.columns_of(p)) for p in range(plan.world)]
    recv = all_to_all_rows(send, [(own, w) for w in widths], plan.group, dtype=dtype, device=dev)
    out = torch.zeros(own, dim, dtype=dtype, device=dev)
    for p, piece in enumerate(recv):
        at = 0
        for c0, w in plan.columns_of(p):
            out[:, c0 : c0 + w] = piece[:, at : at + w]
            at += w
    return out


class _PooledLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plan: LookupPlan, weight: DTensor) -> torch.Tensor:
        track = plan.track
        bag_of_id = plan.batch.bag_of_id()
        blocks = [_compute_block(plan, i, bag_of_id) for i, c in enumerate(plan.computes) if c]
        if plan.strategy is Strategy.LOCAL:
            out = blocks[0].out
            ctx.win = [blocks[0].counts.unsqueeze(1) > 0] if plan.max_mode else None
        elif plan.local_only:
            ctx.win = [b.counts.unsqueeze(1) > 0 for b in blocks] if plan.max_mode else None
            out = _local_output(plan, blocks)
        elif plan.strategy is Strategy.COLUMNS:
            out = _combine_columns(plan, blocks)
            ctx.win = [b.counts.unsqueeze(1) > 0 for b in blocks] if plan.max_mode else None
        else:
            ctx.win = None
            out = _combine_reduce(plan, blocks, ctx, track)
        ctx.plan, ctx.blocks, ctx.weight_meta = plan, blocks, (weight.to_local(), weight.device_mesh,
                                                               weight.placements, weight.shape, weight.stride())
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[None, DTensor]:
        plan: LookupPlan = ctx.plan
        blocks: list[_Block] = ctx.blocks
        grad_out = grad_out.contiguous()
        if plan.strategy is Strategy.LOCAL:
            pieces = [grad_out]
        elif plan.local_only and plan.strategy is Strategy.COLUMNS:
            pieces = list(grad_out.split([b.cols[1] for b in blocks], dim=1))
        elif plan.local_only:
            pieces = [grad_out[:, b.cols[0] : b.cols[0] + b.cols[1]] for b in blocks]
        elif plan.strategy is Strategy.COLUMNS:
            pieces = _columns_backward(plan, blocks, grad_out)
        else:
            full = gather_rows(grad_out, plan.num_bags, plan.group)
            pieces = [full[:, b.cols[0] : b.cols[0] + b.cols[1]] for b in blocks]
        grads = [torch.zeros_like(s) for s in plan.shards]
        for k, (b, g) in enumerate(zip(blocks, pieces)):
            if ctx.win is not None:
                g = g * ctx.win[k]
            grads[b.index] = pool_rows_backward(g, plan.shards[b.index].detach(), b.ids, b.offsets, b.weights, b.argmax)
        _mask_padding(plan, grads)
        _sync_replicas(plan, grads)
        return None, _grad_dtensor(ctx.weight_meta, plan, grads)


def _local_output(plan: LookupPlan, blocks: list[_Block]) -> torch.Tensor:
    """``local_only``: this rank's blocks side by side (COLUMNS) or summed into a partial (REDUCE)."""
    n, dtype, dev = plan.batch.num_bags, plan.layout.dtype, plan.batch.ids.device
    if plan.strategy is Strategy.COLUMNS:
        return torch.cat([b.out for b in blocks], dim=1) if blocks else torch.empty(n, 0, dtype=dtype, device=dev)
    partial = torch.zeros(n, plan.layout.global_shape[1], dtype=dtype, device=dev)
    for b in blocks:
        c0, w = b.cols
        partial[:, c0 : c0 + w] += b.out
    return partial


def _columns_backward(plan: LookupPlan, blocks: list[_Block], grad_out: torch.Tensor) -> list[torch.Tensor]:
    send = [
        torch.cat([grad_out[:, c0 : c0 + w] for c0, w in plan.columns_of(p)], dim=1)
        if plan.columns_of(p) else grad_out.new_zeros(grad_out.shape[0], 0)
        for p in range(plan.world)
    ]
    width = sum(b.cols[1] for b in blocks)
    recv = all_to_all_rows(
        send, [(n, width) for n in plan.num_bags], plan.group, dtype=grad_out.dtype, device=grad_out.device
    )
    full = torch.cat(recv)
    return list(full.split([b.cols[1] for b in blocks], dim=1))


def _mask_padding(plan: LookupPlan, grads: list[torch.Tensor]) -> None:
    """An un-pooled lookup returns the padding row but must not train it."""
    p = plan.padding_idx
    if plan.skip_padding or p is None:
        return
    for spec, g in zip(plan.mine, grads):
        if spec.offsets[0] <= p < spec.offsets[0] + spec.sizes[0]:
            g[p - spec.offsets[0]] = 0


def _sync_replicas(plan: LookupPlan, grads: list[torch.Tensor]) -> None:
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


def _grad_dtensor(meta: tuple, plan: LookupPlan, grads: list[torch.Tensor]) -> DTensor:
    local, mesh, placements, shape, stride = meta
    if isinstance(local, LocalShardsWrapper):
        g_local: torch.Tensor = LocalShardsWrapper(
            grads, [s.offsets for s in plan.mine], plan.layout.global_shape, layout=plan.layout,
            dtype=local.dtype, device=local.device, _trusted=True,
        )
    elif grads:
        g_local = grads[0]
    else:
        g_local = torch.zeros_like(local)
    return DTensor.from_local(g_local, mesh, placements, run_check=False, shape=shape, stride=stride)


def pooled_lookup(plan: LookupPlan, weight: DTensor) -> torch.Tensor:
    """Sum (or max) pooled rows of this rank's own bags; differentiable w.r.t. ``weight``."""
    return _PooledLookup.apply(plan, weight)
