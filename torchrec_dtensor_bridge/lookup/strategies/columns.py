"""The column strategy: every block spans all rows (table-wise, column-wise, table-column-wise).

Each (bag, column) is computed by exactly one rank, so no sum is needed:

1. route: every rank that computes a block of the table takes all of this rank's ids;
2. forward (:func:`exchange_columns`): every rank pools, for ALL ranks' bags, the blocks it holds; ONE
   ``all_to_all`` for every such table of the call hands each rank the columns of its own bags (a rank's
   own columns never travel; a table whose columns all come from one piece is that piece);
3. backward (:func:`columns_backward`): the reverse ``all_to_all`` brings each block the output gradient
   of every rank's bags, in its columns;
4. a ``Replicate()`` batch on the even ``Shard(1)`` split needs no exchange: each rank's output is its
   blocks side by side (a ``Shard(1)`` DTensor); on any other column layout the row strategy's partial
   sums answer it (a ``Partial()`` DTensor).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Shard
from torch.distributed.tensor.placement_types import Placement

from ...collectives import all_to_all_parts, common_dtype, row_starts, side_by_side
from ...layout import ShardLayout, chunk_sizes
from ..arguments import Bags
from ..plan import ALL, NONE, Block, LookupPlan, PendingRoute, Route, Strategy
from .copies import sync_copies
from .rows import ROWS

__all__ = ["COLUMNS", "Columns", "columns_backward", "exchange_columns"]


class Columns(Strategy):
    """Blocks spanning all rows: one ``all_to_all`` each way (see the module docstring)."""

    name = "columns"

    def route(self, layout: ShardLayout, bags: Bags, world: int) -> Route | PendingRoute | None:
        readers = {s.rank for s in layout.unique_shards() if s.numel}
        n = bags.ids.numel()
        return Route(tuple(ALL if q in readers else NONE for q in range(world)),
                     tuple(n if q in readers else 0 for q in range(world)))

    def computes(self, layout: ShardLayout, rank: int) -> tuple[bool, ...]:
        first = set(layout.unique_shards())
        return tuple(s in first and s.numel > 0 for s in layout.shards_on(rank))

    def forward(self, plans: Sequence[LookupPlan], blocks: Sequence[list[Block]]
                ) -> tuple[list[torch.Tensor], list[list[Block]], list[list[torch.Tensor] | None]]:
        wins = [[b.counts.unsqueeze(1) > 0 for b in bl] if p.pooling.max_mode else None
                for p, bl in zip(plans, blocks)]
        outs: list[torch.Tensor] = [torch.empty(0)] * len(plans)
        exchanged = []
        for t, (p, bl) in enumerate(zip(plans, blocks)):
            if p.batch.replicated:  # this rank's blocks side by side
                outs[t] = torch.cat([b.out for b in bl], dim=1) if bl else torch.empty(
                    p.batch.bags.num_bags, 0, dtype=p.out_dtype, device=p.batch.bags.ids.device)
            else:
                exchanged.append(t)
        for t, out in zip(exchanged, exchange_columns(plans, blocks, exchanged)):
            outs[t] = out
        return outs, list(blocks), wins

    def backward(self, plans: Sequence[LookupPlan], blocks: Sequence[list[Block]],
                 grad_outs: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        pieces: list[list[torch.Tensor]] = [[] for _ in plans]
        exchanged = []
        for t, (p, bl, g) in enumerate(zip(plans, blocks, grad_outs)):
            if p.batch.replicated:
                pieces[t] = list(g.split([b.cols[1] for b in bl], dim=1))
            else:
                exchanged.append(t)
        for t, got in zip(exchanged, columns_backward(plans, blocks, grad_outs, exchanged)):
            pieces[t] = got
        return pieces

    def sums_every_rank(self, plan: LookupPlan) -> bool:
        return False

    def sync_grads(self, plan: LookupPlan, grads: list[torch.Tensor]) -> None:
        sync_copies(plan, grads)

    def for_replicated_batch(self, layout: ShardLayout, world: int, max_mode: bool
                             ) -> tuple[Strategy, Placement] | None:
        if _even_columns(layout, world):
            return self, Shard(1)
        return None if max_mode else (ROWS, Partial())


COLUMNS = Columns()


def _even_columns(layout: ShardLayout, world: int) -> bool:
    """The blocks (group ranks) are exactly ``Shard(1)``'s even split in rank order, one per rank."""
    n, d = layout.global_shape
    widths = chunk_sizes(d, world)
    want = sorted((r, (0, sum(widths[:r])), (n, widths[r])) for r in range(world))
    return sorted((s.rank, s.offsets, s.sizes) for s in layout.shards) == want


def _columns_of(plan: LookupPlan, rank: int) -> list[tuple[int, int]]:
    """(first column, width) of each block ``rank`` computes, in its order."""
    return [(s.offsets[1], s.sizes[1]) for s in plan.table.layout.unique_shards() if s.rank == rank and s.numel]


def exchange_columns(plans: Sequence[LookupPlan], blocks: Sequence[list[Block]], tables: list[int]) -> list[torch.Tensor]:
    """COLUMNS, for ``tables`` together: ONE ``all_to_all`` hands every rank its bags' columns of every table.

    A rank's own columns never enter the message, and a table whose columns all
    come from one piece (table-wise) is that piece, not a copy of it.
    """
    if not tables:
        return []
    p0, dtype = plans[tables[0]], common_dtype(plans[t].out_dtype for t in tables)
    if all(plans[t].batch.num_bags == p0.batch.num_bags for t in tables):
        received = _exchange_columns_rows(plans, blocks, tables, dtype)
    else:
        received = _exchange_columns_flat(plans, blocks, tables, dtype)
    rank = p0.rank
    outs = []
    for t in tables:
        start, own = row_starts(plans[t].batch.num_bags)[rank], plans[t].batch.num_bags[rank]
        pieces = [(b.cols[0], b.out[start : start + own]) for b in blocks[t]] + received[t]  # (first column, values)
        dim, tdtype = plans[t].table.layout.global_shape[1], plans[t].out_dtype
        if len(pieces) == 1 and pieces[0][1].shape[1] == dim:
            outs.append(pieces[0][1].to(tdtype))
            continue
        out = torch.zeros(own, dim, dtype=tdtype, device=p0.batch.bags.ids.device)
        for c0, values in pieces:
            out[:, c0 : c0 + values.shape[1]] = values
        outs.append(out)
    return outs


def _exchange_columns_flat(plans: Sequence[LookupPlan], blocks: Sequence[list[Block]], tables: list[int],
                           dtype: torch.dtype) -> dict[int, list[tuple[int, torch.Tensor]]]:
    """:func:`exchange_columns`' message when tables differ in their bags per rank: each block's rows for a
    rank back to back. Per table, the (first column, values) pieces other ranks computed."""
    p0 = plans[tables[0]]
    rank, world, dev = p0.rank, p0.world, p0.batch.bags.ids.device
    send = []
    for q in range(world):
        parts = []
        for t in tables if q != rank else ():
            s, n = row_starts(plans[t].batch.num_bags)[q], plans[t].batch.num_bags[q]
            parts += [b.out[s : s + n] for b in blocks[t]]
        send.append(parts)
    own = {t: plans[t].batch.num_bags[rank] for t in tables}
    sizes = [0 if p == rank else sum(own[t] * w for t in tables for _, w in _columns_of(plans[t], p))
             for p in range(world)]
    recv = all_to_all_parts(send, sizes, p0.group, dtype=dtype, device=dev)
    got: dict[int, list[tuple[int, torch.Tensor]]] = {t: [] for t in tables}
    for p, flat in enumerate(recv):
        at = 0
        for t in tables if p != rank else ():
            for c0, w in _columns_of(plans[t], p):
                got[t].append((c0, flat[at : at + own[t] * w].view(own[t], w)))
                at += own[t] * w
    return got


def _exchange_columns_rows(plans: Sequence[LookupPlan], blocks: Sequence[list[Block]], tables: list[int],
                           dtype: torch.dtype) -> dict[int, list[tuple[int, torch.Tensor]]]:
    """:func:`exchange_columns` for tables with the same bags per rank: row-major messages (as the backward's).

    The message to a rank is its bags' rows of all this rank's blocks side by side, ``(bags, widths)``. When
    the blocks' outputs are the adjacent column slices of one kernel result (the tables of one storage, in
    order), the other ranks' rows of that result are sent as they are, with no copy, when they are one
    contiguous piece of it (this rank's bags first or last, as always with two ranks). What arrives from a
    rank is ``(this rank's bags, that rank's widths)``; each block is a column slice of it.
    """
    p0 = plans[tables[0]]
    world, rank, dev, bags = p0.world, p0.rank, p0.batch.bags.ids.device, p0.batch.num_bags
    widths = _widths(plans, tables, world)
    outs = [b.out for t in tables for b in blocks[t]]
    starts, mine = row_starts(bags), widths[rank]
    send_sizes = [0 if q == rank else bags[q] * mine for q in range(world)]
    whole = side_by_side(outs) if outs else None
    others = None if whole is None or whole.dtype != dtype else _rows_of_others(whole, starts[rank], bags[rank])
    if others is not None:
        flat_in = others.reshape(-1)
    else:
        flat_in = torch.empty(sum(send_sizes), dtype=dtype, device=dev)
        for q, piece in enumerate(flat_in.split(send_sizes)):
            if q != rank and piece.numel():
                rows = [o[starts[q] : starts[q] + bags[q]].to(dtype) for o in outs]
                torch.cat(rows, dim=1, out=piece.view(bags[q], mine))
    recv_sizes = [0 if p == rank else bags[rank] * widths[p] for p in range(world)]
    flat_out = torch.empty(sum(recv_sizes), dtype=dtype, device=dev)
    dist.all_to_all_single(flat_out, flat_in, recv_sizes, send_sizes, group=p0.group)
    got: dict[int, list[tuple[int, torch.Tensor]]] = {t: [] for t in tables}
    for p, flat in enumerate(flat_out.split(recv_sizes)):
        if p == rank:
            continue
        message, at = flat.view(bags[rank], widths[p]), 0
        for t in tables:
            for c0, w in _columns_of(plans[t], p):
                got[t].append((c0, message[:, at : at + w]))
                at += w
    return got


def columns_backward(
    plans: Sequence[LookupPlan], blocks: Sequence[list[Block]], grad_outs: Sequence[torch.Tensor], tables: list[int]
) -> list[list[torch.Tensor]]:
    """COLUMNS backward for ``tables`` together: ONE reverse ``all_to_all``; per table, each block's gradient.

    When every table has the same bags per rank, each message is rows of all its blocks side by side
    (``(bags, widths)``, written straight into the flat send buffer), so what arrives from all ranks IS
    ``(all bags, this rank's blocks' widths)``: each block's gradient is a column slice of it (strided;
    fbgemm's kernels take it as it is), with no per-block copy. Otherwise blocks travel back to back and
    each block's rows are concatenated.
    """
    if not tables:
        return []
    p0, dtype = plans[tables[0]], common_dtype(plans[t].out_dtype for t in tables)
    world, dev = p0.world, p0.batch.bags.ids.device
    bags = p0.batch.num_bags
    if all(plans[t].batch.num_bags == bags for t in tables):
        return _columns_backward_rows(plans, blocks, grad_outs, tables, dtype)
    send = [[grad_outs[t][:, c0 : c0 + w] for t in tables for c0, w in _columns_of(plans[t], p)] for p in range(world)]
    sizes = [sum(plans[t].batch.num_bags[p] * b.cols[1] for t in tables for b in blocks[t]) for p in range(world)]
    recv = all_to_all_parts(send, sizes, p0.group, dtype=dtype, device=dev)
    got: dict[int, list[list[torch.Tensor]]] = {t: [[] for _ in blocks[t]] for t in tables}
    for p, flat in enumerate(recv):
        at = 0
        for t in tables:
            n = plans[t].batch.num_bags[p]
            for k, b in enumerate(blocks[t]):
                got[t][k].append(flat[at : at + n * b.cols[1]].view(n, b.cols[1]))
                at += n * b.cols[1]
    return [[torch.cat(parts).to(plans[t].out_dtype) for parts in got[t]] for t in tables]


def _columns_backward_rows(
    plans: Sequence[LookupPlan], blocks: Sequence[list[Block]], grad_outs: Sequence[torch.Tensor], tables: list[int],
    dtype: torch.dtype,
) -> list[list[torch.Tensor]]:
    """:func:`columns_backward` for tables with the same bags per rank: row-major messages.

    This rank's own bags' columns never travel: they are copied into their rows of the result, and the
    ``all_to_all`` fills the other ranks' rows (in place when those rows are contiguous: this rank's rows
    first or last, as always with two ranks). gloo's ``all_to_all`` copies a rank's piece for itself
    through its transport, which costs more than the copy (BENCHMARKS.md).
    """
    p0 = plans[tables[0]]
    world, rank, dev, bags = p0.world, p0.rank, p0.batch.bags.ids.device, p0.batch.num_bags
    widths = _widths(plans, tables, world)

    def columns(p: int) -> list[torch.Tensor]:
        return [grad_outs[t][:, c0 : c0 + w].to(dtype) for t in tables for c0, w in _columns_of(plans[t], p)]

    send_sizes = [0 if p == rank else bags[rank] * widths[p] for p in range(world)]
    flat_in = torch.empty(sum(send_sizes), dtype=dtype, device=dev)
    for p, piece in enumerate(flat_in.split(send_sizes)):
        if p != rank and piece.numel():
            torch.cat(columns(p), dim=1, out=piece.view(bags[rank], widths[p]))
    mine, total, start = widths[rank], sum(bags), row_starts(bags)[rank]
    full = torch.empty(total, mine, dtype=dtype, device=dev)
    if mine and bags[rank]:
        torch.cat(columns(rank), dim=1, out=full[start : start + bags[rank]])
    recv_sizes = [0 if p == rank else n * mine for p, n in enumerate(bags)]
    into = _rows_of_others(full, start, bags[rank])
    in_place = into is not None
    if into is None:
        into = torch.empty(total - bags[rank], mine, dtype=dtype, device=dev)
    dist.all_to_all_single(into.view(-1), flat_in, recv_sizes, send_sizes, group=p0.group)
    del flat_in
    if not in_place:
        full[:start].copy_(into[:start])
        full[start + bags[rank] :].copy_(into[start:])
    out, at = [], 0
    for t in tables:
        table = []
        for b in blocks[t]:
            table.append(full[:, at : at + b.cols[1]].to(plans[t].out_dtype))
            at += b.cols[1]
        out.append(table)
    return out


def _widths(plans: Sequence[LookupPlan], tables: list[int], world: int) -> list[int]:
    """Per rank, how many columns of ``tables`` it computes: the width of its row-major messages."""
    return [sum(w for t in tables for _, w in _columns_of(plans[t], p)) for p in range(world)]


def _rows_of_others(t: torch.Tensor, start: int, n: int) -> torch.Tensor | None:
    """The rows of ``t`` outside ``[start, start + n)`` (this rank's) when they are one contiguous piece of
    it: this rank's rows first or last, as always with two ranks. ``None`` otherwise."""
    if start == 0:
        return t[n:]
    if start + n == t.shape[0]:
        return t[:start]
    return None
