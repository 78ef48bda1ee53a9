"""The REDUCE strategy: rows are cut (row-wise, table-row-wise, grid), so a bag's sum is spread over ranks.

1. forward, sum (:class:`ReduceMessage`): each row-cut table's partial sums of ALL ranks' bags go into one
   message as soon as they are computed; ONE reduce-scatter for every such table of the call (an
   ``all_to_all`` of the partials, then a local sum: :func:`.exchange.sum_into`) leaves each rank its
   own bags' sums;
2. forward, max (:func:`reduce_max`): one ``all_reduce(MAX)`` per table, and where this rank's blocks win
   (ties to the lowest rank), so backward sends gradient only to the winning rows;
3. backward (:func:`gather_grads`): ONE all-gather of the output gradients of every such table (an
   ``all_to_all``: :func:`.exchange.share_flat`); each block reads its columns of every rank's bags.

gloo's own ``reduce_scatter`` and ``all_gather`` stage every buffer (BENCHMARKS.md, collectives), hence
``all_to_all``. Tables of different dtypes travel in one common dtype, exact for each.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

from .exchange import common_dtype, row_starts, share_flat, share_rows, sum_into
from .plan import Block, LookupPlan, partial_output

__all__ = ["ReduceMessage", "gather_grads", "reduce_max", "reduce_sum"]


class ReduceMessage:
    """The message of :func:`reduce_sum`, filled table by table as each table's blocks are computed.

    One flat buffer holds, per other rank ``q``, the partial rows of ``q``'s
    bags of every table in ``tables`` (in order), and one more this rank's own
    (where the sum is accumulated); :meth:`add` copies a
    table's partial output straight into its slices and hands back its blocks
    with their outputs released (a ``REDUCE`` sum needs no block output after
    this: backward works from the gathered output gradients), so at most one
    table's partial output is alive besides the message; :meth:`reduce` runs
    the ONE reduce-scatter.

    Example:
        >>> msg = ReduceMessage(plans, [0, 2])             # doctest: +SKIP
        >>> blocks = [msg.add(t, bl) if t in (0, 2) else bl for t, bl in enumerate(blocks)]  # doctest: +SKIP
        >>> out0, out2 = msg.reduce()                      # doctest: +SKIP
    """

    def __init__(self, plans: list[LookupPlan], tables: list[int]) -> None:
        p0 = plans[tables[0]]
        self.plans, self.tables, self.rank, self.group = plans, tables, p0.rank, p0.group
        # the dtype torch.cat of the partials would give (kept: outputs come back in it)
        dtype = functools.reduce(torch.promote_types, [plans[t].layout.dtype or torch.float32 for t in tables])
        dims = {t: plans[t].layout.global_shape[1] for t in tables}
        self.sizes = [sum(plans[t].num_bags[q] * dims[t] for t in tables) for q in range(p0.world)]
        dev, rank = p0.batch.ids.device, self.rank
        # the pieces for the other ranks back to back (what travels); this rank's own apart (the sum's start)
        self.flat = torch.empty(sum(self.sizes) - self.sizes[rank], dtype=dtype, device=dev)
        self.own = torch.empty(self.sizes[rank], dtype=dtype, device=dev)
        others = iter(self.flat.split([n for q, n in enumerate(self.sizes) if q != rank]))
        self.send = [self.own if q == rank else next(others) for q in range(p0.world)]
        self.slots: dict[int, list[torch.Tensor]] = {}  # per table, per destination: its (bags, dim) view
        at = [0] * p0.world
        for t in tables:
            views = []
            for q in range(p0.world):
                n = plans[t].num_bags[q] * dims[t]
                views.append(self.send[q][at[q] : at[q] + n].view(plans[t].num_bags[q], dims[t]))
                at[q] += n
            self.slots[t] = views

    def add(self, t: int, blocks: list[Block]) -> list[Block]:
        """Place table ``t``'s partial sums (its blocks at their columns, 0 elsewhere) in the message;
        ``blocks`` with their outputs released."""
        plan = self.plans[t]
        starts = row_starts(plan.num_bags)
        dim = plan.layout.global_shape[1]
        whole = len(blocks) == 1 and blocks[0].cols == (0, dim)
        for q, view in enumerate(self.slots[t]):
            s, n = starts[q], plan.num_bags[q]
            if whole:
                view.copy_(blocks[0].out[s : s + n])
                continue
            # summed in the table's own dtype (as the unfused sum), then placed
            acc = view if view.dtype == plan.layout.dtype else torch.empty(n, dim, dtype=plan.layout.dtype,
                                                                              device=view.device)
            acc.zero_()
            for b in blocks:
                acc[:, b.cols[0] : b.cols[0] + b.cols[1]] += b.out[s : s + n]
            if acc is not view:
                view.copy_(acc)
        return [dataclasses.replace(b, out=b.out.new_empty(0, b.cols[1])) for b in blocks]

    def reduce(self) -> list[torch.Tensor]:
        """*Collective*: ONE reduce-scatter of the message (:func:`.exchange.sum_into`); per table this rank's
        summed rows."""
        mine = sum_into(self.own, self.flat, self.sizes, self.group)
        del self.flat, self.own, self.send, self.slots  # the message is spent: free it before the caller goes on
        plans = self.plans
        return _split_flat(mine, [(plans[t].num_bags[self.rank], plans[t].layout.global_shape[1])
                                  for t in self.tables])


def reduce_sum(plans: list[LookupPlan], blocks: list[list[Block]], tables: list[int]) -> list[torch.Tensor]:
    """REDUCE with sum, for ``tables`` together: ONE reduce-scatter of all their partial outputs."""
    if not tables:
        return []
    msg = ReduceMessage(plans, tables)
    for t in tables:
        msg.add(t, blocks[t])
    return msg.reduce()


def _split_flat(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [piece.view(shape) for piece, shape in zip(flat.split([a * b for a, b in shapes]), shapes)]


def reduce_max(plan: LookupPlan, blocks: list[Block], track: bool) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """REDUCE with max, one table: the all-reduced max, and (``track``) where this rank's blocks win."""
    partial = partial_output(plan, blocks, float("-inf"))
    best = partial.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=plan.group)
    win = _winners(plan, blocks, partial, best) if track else None
    start = row_starts(plan.num_bags)[plan.rank]
    return best[start : start + plan.num_bags[plan.rank]].clone(), win


def _winners(plan: LookupPlan, blocks: list[Block], partial: torch.Tensor, best: torch.Tensor) -> list[torch.Tensor]:
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


def gather_grads(
    plans: list[LookupPlan], grad_outs: tuple[torch.Tensor, ...], tables: list[int]
) -> list[torch.Tensor]:
    """REDUCE backward for ``tables`` together: ONE all-gather of the output gradients; per table all ranks' rows.

    When every table has the same bags per rank (one batch size, as a KJT's features) the
    gradients travel as rows of all the tables side by side, ``(bags, sum of dims)``: what
    arrives IS every table's gradient, a column slice each (strided; fbgemm's kernels
    take it as it is), with no per-table copy. Otherwise each rank's tables travel back
    to back and each table's rows are concatenated.
    """
    if not tables:
        return []
    p0 = plans[tables[0]]
    dtype = common_dtype([plans[t] for t in tables])
    dims = [plans[t].layout.global_shape[1] for t in tables]
    bags = p0.num_bags
    if all(plans[t].num_bags == bags for t in tables):
        full = torch.empty(sum(bags), sum(dims), dtype=dtype, device=grad_outs[tables[0]].device)
        start = row_starts(bags)[p0.rank]
        torch.cat([grad_outs[t].to(dtype) for t in tables], dim=1, out=full[start : start + bags[p0.rank]])
        share_rows(full, bags, p0.group)
        return [full[:, a : a + d].to(plans[t].layout.dtype) for t, a, d in zip(tables, row_starts(dims), dims)]
    mine = torch.cat([grad_outs[t].reshape(-1).to(dtype) for t in tables])
    counts = [sum(plans[t].num_bags[r] * d for t, d in zip(tables, dims)) for r in range(p0.world)]
    gathered = share_flat(mine, counts, p0.group)
    del mine  # sent: free it before the per-table copies
    per_rank = [_split_flat(flat, [(plans[t].num_bags[r], d) for t, d in zip(tables, dims)])
                for r, flat in enumerate(gathered)]
    del gathered
    return [torch.cat([rows[k] for rows in per_rank]).to(plans[t].layout.dtype) for k, t in enumerate(tables)]
