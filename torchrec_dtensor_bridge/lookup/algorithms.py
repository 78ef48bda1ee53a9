"""Sharded pooled lookups for every layout, as one differentiable autograd Function.

One call looks up one or several tables (each with its own :class:`LookupPlan`);
the collectives of all tables that combine the same way are fused, so a
lookup of many tables costs as many collectives as a lookup of one.

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
     one ``all_to_all`` (for all such tables together) hands every rank the
     columns of its own bags. Backward is the reverse ``all_to_all``.
   * ``REDUCE`` - rows are cut (row-wise, table-row-wise, grid): the partial
     bags of all ranks' batches are summed with one ``reduce_scatter`` (for
     all such tables together) back to each rank's own bags (max: one
     ``all_reduce(MAX)`` per table, which also tells every rank where the
     winning rows are). Backward all-gathers the output gradients of all such
     tables at once (masked to the winning rows for max).
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
from .exchange import all_to_all_flat, gather_flat, row_starts
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


def _compute_block(plan: LookupPlan, i: int, bag_of_id: Any) -> _Block:
    """Pool, for every bag of ``plan.batch``, the ids shard ``i`` stores (``bag_of_id``: a thunk, built once)."""
    spec, shard = plan.mine[i], plan.shards[i]
    ids, batch = plan.batch.ids, plan.batch
    r0, h = spec.offsets[0], spec.sizes[0]
    every_id = r0 == 0 and h == plan.layout.global_shape[0] and not (plan.skip_padding and plan.padding_idx is not None)
    if every_id:  # the shard holds all rows: no filtering, the batch's own bag boundaries
        local, counts, psw = ids, batch.lengths, batch.weights
    else:
        keep = (ids >= r0) & (ids < r0 + h)
        if plan.skip_padding and plan.padding_idx is not None:
            keep &= ids != plan.padding_idx
        local = ids[keep] - r0
        counts = torch.bincount(bag_of_id()[keep], minlength=batch.num_bags)
        psw = None if batch.weights is None else batch.weights[keep]
    offsets = torch.zeros(batch.num_bags + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    out, argmax = pool_rows(shard.detach(), local, offsets, psw, max_mode=plan.max_mode)
    return _Block(i, out, counts, (spec.offsets[1], spec.sizes[1]), local, offsets, psw, argmax)


def _compute_blocks(plan: LookupPlan) -> list[_Block]:
    cache: list[torch.Tensor] = []

    def bag_of_id() -> torch.Tensor:
        if not cache:
            cache.append(plan.batch.bag_of_id())
        return cache[0]

    return [_compute_block(plan, i, bag_of_id) for i, c in enumerate(plan.computes) if c]


def _partial(plan: LookupPlan, blocks: list[_Block], fill: float) -> torch.Tensor:
    """All bags' partial output at full width: this rank's blocks placed at their columns (``fill`` elsewhere)."""
    total, dim = plan.batch.num_bags, plan.layout.global_shape[1]
    if len(blocks) == 1 and blocks[0].cols == (0, dim) and not plan.max_mode:
        return blocks[0].out
    partial = torch.full((total, dim), fill, dtype=plan.layout.dtype, device=plan.batch.ids.device)
    for b in blocks:
        c0, w = b.cols
        if plan.max_mode:
            val = b.out.masked_fill(b.counts.unsqueeze(1) == 0, fill)
            partial[:, c0 : c0 + w] = torch.maximum(partial[:, c0 : c0 + w], val)
        else:
            partial[:, c0 : c0 + w] += b.out
    return partial


def _reduce_max(plan: LookupPlan, blocks: list[_Block], track: bool) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """REDUCE with max, one table: the all-reduced max, and (``track``) where this rank's blocks win."""
    partial = _partial(plan, blocks, float("-inf"))
    best = partial.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=plan.group)
    win = _winners(plan, blocks, partial, best) if track else None
    start = row_starts(plan.num_bags)[plan.rank]
    return best[start : start + plan.num_bags[plan.rank]].clone(), win


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


def _reduce_sum(plans: list[LookupPlan], blocks: list[list[_Block]], tables: list[int]) -> list[torch.Tensor]:
    """REDUCE with sum, for ``tables`` together: ONE ``reduce_scatter`` of all their partial outputs."""
    if not tables:
        return []
    p0 = plans[tables[0]]
    partials = [_partial(plans[t], blocks[t], 0.0) for t in tables]
    starts = [row_starts(plans[t].num_bags) for t in tables]
    send = [
        torch.cat([part[s[q] : s[q] + plans[t].num_bags[q]].reshape(-1) for t, part, s in zip(tables, partials, starts)])
        for q in range(p0.world)
    ]
    mine = torch.empty_like(send[p0.rank])
    dist.reduce_scatter(mine, send, op=dist.ReduceOp.SUM, group=p0.group)
    return _split_flat(mine, [(plans[t].num_bags[p0.rank], plans[t].layout.global_shape[1]) for t in tables])


def _split_flat(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [piece.view(shape) for piece, shape in zip(flat.split([a * b for a, b in shapes]), shapes)]


def _exchange_columns(plans: list[LookupPlan], blocks: list[list[_Block]], tables: list[int]) -> list[torch.Tensor]:
    """COLUMNS, for ``tables`` together: ONE ``all_to_all`` hands every rank its bags' columns of every table.

    A rank's own columns never enter the message, and a table whose columns all
    come from one piece (table-wise) is that piece, not a copy of it.
    """
    if not tables:
        return []
    p0, dtype = plans[tables[0]], _common_dtype([plans[t] for t in tables])
    rank, world, dev = p0.rank, p0.world, p0.batch.ids.device
    send = []
    for q in range(world):
        parts = []
        for t in tables if q != rank else ():
            s, n = row_starts(plans[t].num_bags)[q], plans[t].num_bags[q]
            parts += [b.out[s : s + n].reshape(-1) for b in blocks[t]]
        send.append(_flat(parts, dtype, dev))
    own = {t: plans[t].num_bags[rank] for t in tables}
    sizes = [0 if p == rank else sum(own[t] * w for t in tables for _, w in plans[t].columns_of(p))
             for p in range(world)]
    recv = all_to_all_flat(send, sizes, p0.group, dtype=dtype, device=dev)
    pieces: dict[int, list[tuple[int, torch.Tensor]]] = {t: [] for t in tables}  # (first column, values)
    for t in tables:
        start = row_starts(plans[t].num_bags)[rank]
        pieces[t] += [(b.cols[0], b.out[start : start + own[t]]) for b in blocks[t]]
    for p, flat in enumerate(recv):
        at = 0
        for t in tables if p != rank else ():
            for c0, w in plans[t].columns_of(p):
                pieces[t].append((c0, flat[at : at + own[t] * w].view(own[t], w)))
                at += own[t] * w
    outs = []
    for t in tables:
        dim, tdtype = plans[t].layout.global_shape[1], plans[t].layout.dtype
        if len(pieces[t]) == 1 and pieces[t][0][1].shape[1] == dim:
            outs.append(pieces[t][0][1].to(tdtype))
            continue
        out = torch.zeros(own[t], dim, dtype=tdtype, device=dev)
        for c0, values in pieces[t]:
            out[:, c0 : c0 + values.shape[1]] = values
        outs.append(out)
    return outs


def _flat(parts: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One flat message of ``parts`` in ``dtype`` (empty when there are none)."""
    return torch.cat([p.to(dtype) for p in parts]) if parts else torch.empty(0, dtype=dtype, device=device)


def _common_dtype(plans: list[LookupPlan]) -> torch.dtype:
    """One dtype the fused messages of these tables travel in (exact for each table's own dtype)."""
    dtypes = {p.layout.dtype for p in plans}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float64
    assert dtype is not None, "layout_of(DTensor) always records the dtype"
    return dtype


def _local_output(plan: LookupPlan, blocks: list[_Block]) -> torch.Tensor:
    """``local_only``: this rank's blocks side by side (COLUMNS) or summed into a partial (REDUCE)."""
    if plan.strategy is Strategy.COLUMNS:
        n, dtype, dev = plan.batch.num_bags, plan.layout.dtype, plan.batch.ids.device
        return torch.cat([b.out for b in blocks], dim=1) if blocks else torch.empty(n, 0, dtype=dtype, device=dev)
    return _partial(plan, blocks, 0.0)


def _has_win(plan: LookupPlan, blocks: list[_Block]) -> list[torch.Tensor] | None:
    """For max: which bags each block saw an id of (a block with none must not receive gradient)."""
    return [b.counts.unsqueeze(1) > 0 for b in blocks] if plan.max_mode else None


class _PooledLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plans: list[LookupPlan], *weights: DTensor) -> tuple[torch.Tensor, ...]:
        blocks = [_compute_blocks(p) for p in plans]
        outs: list[torch.Tensor | None] = [None] * len(plans)
        wins: list[list[torch.Tensor] | None] = [None] * len(plans)
        columns, reduce = [], []
        for t, (p, bl) in enumerate(zip(plans, blocks)):
            if p.strategy is Strategy.LOCAL:
                outs[t], wins[t] = bl[0].out, _has_win(p, bl[:1])
            elif p.local_only:
                outs[t], wins[t] = _local_output(p, bl), _has_win(p, bl)
            elif p.strategy is Strategy.COLUMNS:
                columns.append(t)
                wins[t] = _has_win(p, bl)
            elif p.max_mode:
                outs[t], wins[t] = _reduce_max(p, bl, p.track)
            else:
                reduce.append(t)
        for t, out in zip(columns, _exchange_columns(plans, blocks, columns)):
            outs[t] = out
        for t, out in zip(reduce, _reduce_sum(plans, blocks, reduce)):
            outs[t] = out
        ctx.plans, ctx.blocks, ctx.wins = plans, blocks, wins
        ctx.weight_meta = [(w.to_local(), w.device_mesh, w.placements, w.shape, w.stride()) for w in weights]
        done = [o for o in outs if o is not None]
        assert len(done) == len(plans), "every strategy gives every table an output"
        return tuple(done)

    @staticmethod
    def backward(ctx: Any, *grad_outs: torch.Tensor) -> tuple[DTensor | None, ...]:
        plans: list[LookupPlan] = ctx.plans
        blocks: list[list[_Block]] = ctx.blocks
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
        for t, got in zip(columns, _columns_backward(plans, blocks, grad_outs, columns)):
            pieces[t] = got
        for t, full in zip(reduce, _gather_grads(plans, grad_outs, reduce)):
            pieces[t] = [full[:, b.cols[0] : b.cols[0] + b.cols[1]] for b in blocks[t]]
        grads = [_table_grads(p, bl, pc, win) for p, bl, pc, win in zip(plans, blocks, pieces, ctx.wins)]
        return (None, *(_grad_dtensor(m, p, g) for m, p, g in zip(ctx.weight_meta, plans, grads)))


def _table_grads(
    plan: LookupPlan, blocks: list[_Block], pieces: list[torch.Tensor], win: list[torch.Tensor] | None
) -> list[torch.Tensor]:
    """One table's per-shard weight gradients from its blocks' output gradients."""
    computed: dict[int, torch.Tensor] = {}
    for k, (b, g) in enumerate(zip(blocks, pieces)):
        if win is not None:
            g = g * win[k]
        computed[b.index] = pool_rows_backward(g, plan.shards[b.index].detach(), b.ids, b.offsets, b.weights,
                                               b.argmax)
    # only shards no block was computed on (replicas, empty blocks) start from zeros
    grads = [computed[i] if i in computed else torch.zeros_like(s) for i, s in enumerate(plan.shards)]
    _mask_padding(plan, grads)
    _sync_replicas(plan, grads)
    return grads


def _columns_backward(
    plans: list[LookupPlan], blocks: list[list[_Block]], grad_outs: tuple[torch.Tensor, ...], tables: list[int]
) -> list[list[torch.Tensor]]:
    """COLUMNS backward for ``tables`` together: ONE reverse ``all_to_all``; per table, each block's gradient."""
    if not tables:
        return []
    p0, dtype = plans[tables[0]], _common_dtype([plans[t] for t in tables])
    world, dev = p0.world, p0.batch.ids.device
    send = [_flat([grad_outs[t][:, c0 : c0 + w].reshape(-1) for t in tables for c0, w in plans[t].columns_of(p)],
                  dtype, dev) for p in range(world)]
    sizes = [sum(plans[t].num_bags[p] * b.cols[1] for t in tables for b in blocks[t]) for p in range(world)]
    recv = all_to_all_flat(send, sizes, p0.group, dtype=dtype, device=dev)
    got: dict[int, list[list[torch.Tensor]]] = {t: [[] for _ in blocks[t]] for t in tables}
    for p, flat in enumerate(recv):
        at = 0
        for t in tables:
            n = plans[t].num_bags[p]
            for k, b in enumerate(blocks[t]):
                got[t][k].append(flat[at : at + n * b.cols[1]].view(n, b.cols[1]))
                at += n * b.cols[1]
    return [[torch.cat(parts).to(plans[t].layout.dtype) for parts in got[t]] for t in tables]


def _gather_grads(
    plans: list[LookupPlan], grad_outs: tuple[torch.Tensor, ...], tables: list[int]
) -> list[torch.Tensor]:
    """REDUCE backward for ``tables`` together: ONE all-gather of the output gradients; per table all ranks' rows."""
    if not tables:
        return []
    p0 = plans[tables[0]]
    dtype = _common_dtype([plans[t] for t in tables])
    mine = torch.cat([grad_outs[t].reshape(-1).to(dtype) for t in tables])
    dims = [plans[t].layout.global_shape[1] for t in tables]
    counts = [sum(plans[t].num_bags[r] * d for t, d in zip(tables, dims)) for r in range(p0.world)]
    per_rank = [
        _split_flat(flat, [(plans[t].num_bags[r], d) for t, d in zip(tables, dims)])
        for r, flat in enumerate(gather_flat(mine, counts, p0.group))
    ]
    return [torch.cat([rows[k] for rows in per_rank]).to(plans[t].layout.dtype) for k, t in enumerate(tables)]


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


def pooled_lookup(plans: list[LookupPlan], weights: list[DTensor]) -> list[torch.Tensor]:
    """Sum (or max) pooled rows of this rank's own bags, for each table; differentiable w.r.t. ``weights``.

    ``plans[t]`` describes the lookup of ``weights[t]``; the tables' collectives are fused.
    """
    return list(_PooledLookup.apply(plans, *weights))
