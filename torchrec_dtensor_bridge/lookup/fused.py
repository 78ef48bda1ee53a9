"""The fused collectives of a lookup of several tables: one message for all tables that combine alike.

Forward: :func:`exchange_columns` (ONE ``all_to_all`` for every table whose
blocks span whole rows) and :class:`ReduceMessage` / :func:`reduce_sum` (ONE
reduce-scatter for every row-cut table, each table's partial copied into the
message as soon as it is computed, its own output then released); backward:
:func:`columns_backward` (the reverse ``all_to_all``) and :func:`gather_grads`
(ONE all-gather of the output gradients). The reduce-scatter and the all-gather
are each one ``all_to_all_single`` (:func:`.exchange.sum_into`,
:func:`.exchange.share_flat`): gloo's own ``reduce_scatter`` and ``all_gather``
stage every buffer (BENCHMARKS.md, collectives). Tables of
different dtypes travel in one common dtype, exact for each (float64 when they
differ).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

from .exchange import all_to_all_parts, row_starts, share_flat, share_rows, sum_into
from .plan import Block, LookupPlan, Strategy

__all__ = ["ReduceMessage", "columns_backward", "exchange_columns", "gather_grads", "psw_backward", "reduce_sum"]


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


def exchange_columns(plans: list[LookupPlan], blocks: list[list[Block]], tables: list[int]) -> list[torch.Tensor]:
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
            parts += [b.out[s : s + n] for b in blocks[t]]
        send.append(parts)
    own = {t: plans[t].num_bags[rank] for t in tables}
    sizes = [0 if p == rank else sum(own[t] * w for t in tables for _, w in plans[t].columns_of(p))
             for p in range(world)]
    recv = all_to_all_parts(send, sizes, p0.group, dtype=dtype, device=dev)
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


def _common_dtype(plans: list[LookupPlan]) -> torch.dtype:
    """One dtype the fused messages of these tables travel in (exact for each table's own dtype)."""
    dtypes = {p.layout.dtype for p in plans}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float64
    assert dtype is not None, "layout_of(DTensor) always records the dtype"
    return dtype


def columns_backward(
    plans: list[LookupPlan], blocks: list[list[Block]], grad_outs: tuple[torch.Tensor, ...], tables: list[int]
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
    p0, dtype = plans[tables[0]], _common_dtype([plans[t] for t in tables])
    world, dev = p0.world, p0.batch.ids.device
    bags = p0.num_bags
    if all(plans[t].num_bags == bags for t in tables):
        return _columns_backward_rows(plans, blocks, grad_outs, tables, dtype)
    send = [[grad_outs[t][:, c0 : c0 + w] for t in tables for c0, w in plans[t].columns_of(p)] for p in range(world)]
    sizes = [sum(plans[t].num_bags[p] * b.cols[1] for t in tables for b in blocks[t]) for p in range(world)]
    recv = all_to_all_parts(send, sizes, p0.group, dtype=dtype, device=dev)
    got: dict[int, list[list[torch.Tensor]]] = {t: [[] for _ in blocks[t]] for t in tables}
    for p, flat in enumerate(recv):
        at = 0
        for t in tables:
            n = plans[t].num_bags[p]
            for k, b in enumerate(blocks[t]):
                got[t][k].append(flat[at : at + n * b.cols[1]].view(n, b.cols[1]))
                at += n * b.cols[1]
    return [[torch.cat(parts).to(plans[t].layout.dtype) for parts in got[t]] for t in tables]


def _columns_backward_rows(
    plans: list[LookupPlan], blocks: list[list[Block]], grad_outs: tuple[torch.Tensor, ...], tables: list[int],
    dtype: torch.dtype,
) -> list[list[torch.Tensor]]:
    """:func:`columns_backward` for tables with the same bags per rank: row-major messages.

    This rank's own bags' columns never travel: they are copied into their rows of the result, and the
    ``all_to_all`` fills the other ranks' rows (in place when those rows are contiguous: this rank's rows
    first or last, as always with two ranks). gloo's ``all_to_all`` copies a rank's piece for itself
    through its transport, which costs more than the copy (BENCHMARKS.md).
    """
    p0 = plans[tables[0]]
    world, rank, dev, bags = p0.world, p0.rank, p0.batch.ids.device, p0.num_bags
    widths = [sum(w for t in tables for _, w in plans[t].columns_of(p)) for p in range(world)]

    def columns(p: int) -> list[torch.Tensor]:
        return [grad_outs[t][:, c0 : c0 + w].to(dtype) for t in tables for c0, w in plans[t].columns_of(p)]

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
    head, tail = full[:start], full[start + bags[rank] :]
    in_place = start == 0 or tail.shape[0] == 0  # the other ranks' rows are one contiguous piece of full
    into = (tail if start == 0 else head) if in_place else torch.empty(total - bags[rank], mine, dtype=dtype,
                                                                        device=dev)
    dist.all_to_all_single(into.view(-1), flat_in, recv_sizes, send_sizes, group=p0.group)
    del flat_in
    if not in_place:
        head.copy_(into[:start])
        tail.copy_(into[start:])
    out, at = [], 0
    for t in tables:
        table = []
        for b in blocks[t]:
            table.append(full[:, at : at + b.cols[1]].to(plans[t].layout.dtype))
            at += b.cols[1]
        out.append(table)
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
    dtype = _common_dtype([plans[t] for t in tables])
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


def _psw_partials(plan: LookupPlan, blocks: list[Block], pieces: list[torch.Tensor]) -> torch.Tensor:
    """Per id of ``plan.batch``: the dot of its bag's output gradient with its row, over this rank's blocks'
    columns (the partial derivative by its per-sample weight; 0 for ids no block here holds)."""
    batch = plan.batch
    out = torch.zeros(batch.ids.numel(), dtype=plan.layout.dtype, device=batch.ids.device)
    for b, g in zip(blocks, pieces):
        counts = b.offsets[1:] - b.offsets[:-1]
        bag = torch.repeat_interleave(torch.arange(counts.numel(), device=g.device), counts, output_size=b.ids.numel())
        rows = plan.shards[b.index].detach().index_select(0, b.ids)
        dots = (g.index_select(0, bag).to(rows.dtype) * rows).sum(dim=1)
        if b.positions is None:
            out += dots
        else:
            out.index_add_(0, b.positions, dots)
    return out


def psw_backward(
    plans: list[LookupPlan], blocks: list[list[Block]], pieces: list[list[torch.Tensor]]
) -> list[torch.Tensor | None]:
    """Per table, the gradient of this rank's own per-sample weights (``None`` where not asked for).

    Each rank computes, for the ids it pooled, the dot products over the columns
    it holds; ONE ``all_to_all`` for all such tables sends every partial back to
    the rank whose batch the id came from (the reverse of the id routing), which
    sums the partials of every rank holding a piece of the row.
    """
    out: list[torch.Tensor | None] = [None] * len(plans)
    routed = []
    for t, p in enumerate(plans):
        if not p.psw_grad:
            continue
        partial = _psw_partials(p, blocks[t], pieces[t])
        if p.strategy is Strategy.LOCAL:
            out[t] = partial  # the rank's own batch against its whole copy
        else:
            routed.append((t, partial))
    if not routed:
        return out
    p0 = plans[routed[0][0]]
    dtype = _common_dtype([plans[t] for t, _ in routed])
    dev = p0.batch.ids.device
    send = [[partial.split(list(plans[t].received))[q] for t, partial in routed] for q in range(p0.world)]
    sizes = [sum(plans[t].route.counts[q] for t, _ in routed) for q in range(p0.world)]
    recv = all_to_all_parts(send, sizes, p0.group, dtype=dtype, device=dev)
    at = [0] * p0.world
    for t, _ in routed:
        route, n = plans[t].route, _own_ids(plans[t])
        grad = torch.zeros(n, dtype=plans[t].layout.dtype, device=dev)
        for q in range(p0.world):
            c = route.counts[q]
            got = recv[q][at[q] : at[q] + c].to(grad.dtype)
            at[q] += c
            mask = route.masks[q]
            if mask is True:
                grad += got
            elif mask is not False:
                where = route.positions[q] if route.positions else None
                if where is None:
                    assert isinstance(mask, torch.Tensor)
                    where = mask.nonzero().squeeze(1)
                grad.index_add_(0, where, got)
        out[t] = grad
    return out


def _own_ids(plan: LookupPlan) -> int:
    """How many ids this rank's own batch of the table has (the length of its per-sample weights)."""
    route = plan.route
    if route.partition:  # every id goes to exactly one rank
        return sum(route.counts)
    for mask, count in zip(route.masks, route.counts):
        if isinstance(mask, torch.Tensor):
            return mask.numel()
        if mask is True:
            return count
    raise AssertionError("a table with per-sample weights is read by some rank")
