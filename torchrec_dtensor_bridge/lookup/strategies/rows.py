"""The row strategy: rows are cut (row-wise, table-row-wise, grid), so a bag's sum is spread over ranks.

1. route (:func:`plan_route`): a rank needs only the ids inside its blocks' rows (as TorchRec's
   row-wise input distribution), so every id crosses the wire once instead of once per computing rank, and
   the receiver pools without filtering most of them out; a row partition groups the ids by destination in
   one pass (:func:`_partition`), other row ranges take one mask per destination (:func:`.row_route.mask_route`);
2. forward, sum (:class:`ReduceMessage`): each row-cut table's partial sums of ALL ranks' bags go into one
   message (with one batch size, the pooling kernel's own output: nothing copied); ONE reduce-scatter for
   every such table of the call (an ``all_to_all`` of the partials, then a local sum:
   :func:`..collectives.reduce_rows`) leaves each rank its own bags' sums;
3. forward, max (:func:`.row_max.reduce_max`): one ``all_reduce(MAX)`` per table, and where this rank's blocks win
   (ties to the lowest rank), so backward sends gradient only to the winning rows;
4. backward (:func:`gather_grads`): ONE all-gather of the output gradients of every such table (an
   ``all_to_all``: :func:`..collectives.share_flat`); each block reads its columns of every rank's bags;
5. a ``Replicate()`` batch (sum only) needs no exchange: each rank's output is its un-reduced partial sums
   (a ``Partial()`` DTensor), and each block's gradient its columns of the output gradient.

gloo's own ``reduce_scatter`` and ``all_gather`` stage every buffer (BENCHMARKS.md, collectives), hence
``all_to_all``. Tables of different dtypes travel in one common dtype, exact for each.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial
from torch.distributed.tensor.placement_types import Placement

from ...collectives import common_dtype, reduce_rows, row_starts, share_flat, share_rows, side_by_side, sum_into
from ...layout import ShardLayout
from ..arguments import Bags
from ..plan import NONE, Block, LookupPlan, PendingRoute, Route, Strategy
from .copies import sync_copies
from .row_max import partial_output, reduce_max
from .row_route import mask_route

__all__ = ["ROWS", "ReduceMessage", "Rows", "gather_grads", "plan_route", "reduce_max", "reduce_sum"]


class Rows(Strategy):
    """Row cuts: ids routed to their rows' ranks, partial sums reduce-scattered (see the module docstring)."""

    name = "rows"

    def route(self, layout: ShardLayout, bags: Bags, world: int) -> Route | PendingRoute | None:
        return plan_route(layout, bags, world)

    def computes(self, layout: ShardLayout, rank: int) -> tuple[bool, ...]:
        first = set(layout.unique_shards())
        return tuple(s in first and s.numel > 0 for s in layout.shards_on(rank))

    def forward(self, plans: Sequence[LookupPlan], blocks: Sequence[list[Block]]
                ) -> tuple[list[torch.Tensor], list[list[Block]], list[list[torch.Tensor] | None]]:
        outs: list[torch.Tensor] = [torch.empty(0)] * len(plans)
        kept = list(blocks)
        wins: list[list[torch.Tensor] | None] = [None] * len(plans)
        summed = [t for t, p in enumerate(plans) if not p.batch.replicated and not p.pooling.max_mode]
        message = ReduceMessage(plans, summed, blocks) if summed else None
        for t, (p, bl) in enumerate(zip(plans, blocks)):
            if p.batch.replicated:  # this rank's un-reduced partial sums
                outs[t] = partial_output(p, bl, 0.0)
            elif p.pooling.max_mode:
                outs[t], wins[t] = reduce_max(p, bl, p.track)
            else:
                assert message is not None
                kept[t] = message.add(t, bl)
        if message is not None:
            for t, out in zip(summed, message.reduce()):
                outs[t] = out
        return outs, kept, wins

    def backward(self, plans: Sequence[LookupPlan], blocks: Sequence[list[Block]],
                 grad_outs: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        full = list(grad_outs)
        gathered = [t for t, p in enumerate(plans) if not p.batch.replicated]
        for t, g in zip(gathered, gather_grads(plans, grad_outs, gathered)):
            full[t] = g
        return [[g[:, b.cols[0] : b.cols[0] + b.cols[1]] for b in bl] for g, bl in zip(full, blocks)]

    def sums_every_rank(self, plan: LookupPlan) -> bool:
        return False

    def sync_grads(self, plan: LookupPlan, grads: list[torch.Tensor]) -> None:
        sync_copies(plan, grads)

    def for_replicated_batch(self, layout: ShardLayout, world: int, max_mode: bool
                             ) -> tuple[Strategy, Placement] | None:
        return None if max_mode else (self, Partial())


ROWS = Rows()


def _row_ranges(layout: ShardLayout, world: int) -> list[list[tuple[int, int]] | None]:
    """Per rank: the row ranges of the blocks it computes; ``None`` when one spans every row."""
    rows = layout.global_shape[0]
    out: list[list[tuple[int, int]] | None] = [[] for _ in range(world)]
    for s in layout.unique_shards():
        if not s.numel or s.rank is None:
            continue
        ranges = out[s.rank]
        if ranges is None:
            continue
        if s.sizes[0] == rows:
            out[s.rank] = None
        else:
            ranges.append((s.offsets[0], s.offsets[0] + s.sizes[0]))
    return out


def _cuts(per_rank: list[list[tuple[int, int]] | None], rows: int) -> list[tuple[int, int]] | None:
    """When the ranks' row ranges are disjoint and cover ``[0, rows)`` (every id goes to exactly one
    rank): ``(first row, rank)`` of each maximal run of rows one rank holds, in row order; else ``None``."""
    if any(r is None for r in per_rank):
        return None
    ranges = sorted((r0, r1, q) for q, rs in enumerate(per_rank) for r0, r1 in rs or () if r1 > r0)
    runs: list[tuple[int, int]] = []
    at = 0
    for r0, r1, q in ranges:
        if r0 != at:
            return None  # a gap or an overlap
        if not runs or runs[-1][1] != q:
            runs.append((r0, q))
        at = r1
    return runs if at == rows and len(runs) > 1 else None


_IOTA: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _iota(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``arange(n)``, a read-only view of one kept tensor (no arange per call)."""
    key = (dtype, device)
    have = _IOTA.get(key)
    if have is None or have.numel() < n:
        have = _IOTA[key] = torch.arange(max(n, 1024), dtype=dtype, device=device)
    return have[:n]


def _partition(bags: Bags, runs: list[tuple[int, int]], world: int) -> PendingRoute:
    """The route of a row partition without one mask and one ``nonzero`` per destination (each
    ``nonzero`` is a pass and a sync): each id's destination, then ONE stable grouping
    of the ids by destination (a prefix sum for two runs, a stable sort of one byte per id for more).
    How many ids go where is the one value it needs read (:class:`PendingRoute`)."""
    ids, n, dev = bags.ids, bags.ids.numel(), bags.ids.device
    bounds = torch.zeros(bags.num_bags + 1, dtype=torch.int64, device=dev)
    torch.cumsum(bags.lengths, 0, out=bounds[1:])
    if len(runs) == 2:
        (_, low), (cut, high) = runs
        upper = ids >= cut
        small = torch.int32 if n < 2**30 else torch.int64  # int32 arithmetic vectorises (int64 mul does not)
        prefix = torch.zeros(n + 1, dtype=small, device=dev)
        torch.cumsum(upper, 0, dtype=small, out=prefix[1:])

        def two_runs(read: list[int]) -> Route:
            n_low = n - read[0]
            c, i = prefix[1:], _iota(n, small, dev)
            # each id's place when the low run's ids come first, each run in batch order:
            # a low id at i goes to i - c[i], a high one to n_low + c[i] - 1
            slot = c * 2
            slot += n_low - 1
            slot -= i
            slot *= upper
            slot += i
            slot -= c
            perm = torch.empty(n, dtype=torch.int64, device=dev).scatter_(
                0, slot.long(), _iota(n, torch.int64, dev))
            high_per_bag = (prefix[bounds[1:]] - prefix[bounds[:-1]]).long()
            return _route({low: (perm[:n_low], bags.lengths - high_per_bag), high: (perm[n_low:], high_per_bag)},
                          world)

        return PendingRoute(prefix[-1:].long(), two_runs)
    starts = torch.tensor([r0 for r0, _ in runs[1:]], dtype=ids.dtype, device=dev)
    owner = torch.tensor([q for _, q in runs], dtype=torch.int64, device=dev)
    dest = owner.index_select(0, torch.bucketize(ids, starts, right=True))

    def several_runs(sizes: list[int]) -> Route:
        perm = torch.sort(dest.to(torch.uint8) if world < 256 else dest, stable=True).indices
        per = torch.bincount(bags.bag_of_id() * world + dest, minlength=bags.num_bags * world)
        per = per.view(bags.num_bags, world)
        got = {}
        owners = {q for _, q in runs}
        at = 0
        for q in range(world):
            if q in owners:
                got[q] = (perm[at : at + sizes[q]], per[:, q])
            at += sizes[q]
        return _route(got, world)

    return PendingRoute(torch.bincount(dest, minlength=world), several_runs)


def _route(got: dict[int, tuple[torch.Tensor, torch.Tensor]], world: int) -> Route:
    """A partition's route from each destination's (positions, per-bag counts)."""
    masks: list[bool | torch.Tensor | None] = []
    positions: list[torch.Tensor | None] = []
    per_bag: list[torch.Tensor | None] = []
    for q in range(world):
        pos, counts = got.get(q, (None, None))
        masks.append(NONE if pos is None else None)
        positions.append(pos)
        per_bag.append(counts)
    return Route(tuple(masks), tuple(0 if p is None else int(p.numel()) for p in positions), tuple(positions),
                 True, tuple(per_bag))


def plan_route(layout: ShardLayout, bags: Bags, world: int) -> Route | PendingRoute:
    """Where this rank's ids go: each only to the ranks computing a block holding its row; a partition's
    route still waits for its counts (:func:`..entry.resolve_routes` reads every table's at once)."""
    rows = layout.global_shape[0]
    per_rank = _row_ranges(layout, world)
    runs = _cuts(per_rank, rows)
    if runs is not None:
        return _partition(bags, runs, world)
    return mask_route(bags, per_rank, rows, world)


class ReduceMessage:
    """The message of :func:`reduce_sum`, filled table by table as each table's blocks are computed.

    When every table has the same bags per rank (one batch size, as a KJT's features) the message is
    row-major: every rank's bags in rank order, each bag's row holding all the tables side by side,
    ``(bags, sum of dims)``: the layout of one pooling kernel call's output over those tables. When the
    tables' outputs in ``blocks`` (indexed by table) ARE that (one kernel call pooled exactly them, one
    whole block each: :func:`_pooled_message`), the kernel's output is sent as it is, nothing copied. Otherwise a flat buffer holds, per other rank
    ``q``, the partial rows of ``q``'s bags of every table in ``tables`` (in order), and one more this
    rank's own (where the sum is accumulated).

    :meth:`add` places a table's partial output in its slices (or, adopted, leaves it where it is) and
    hands back its blocks with their outputs released (a ``REDUCE`` sum needs no block output after this:
    backward works from the gathered output gradients), so at most one table's partial output is alive
    besides the message; :meth:`reduce` runs the ONE reduce-scatter.

    Example:
        >>> msg = ReduceMessage(plans, [0, 2], blocks)     # doctest: +SKIP
        >>> blocks = [msg.add(t, bl) if t in (0, 2) else bl for t, bl in enumerate(blocks)]  # doctest: +SKIP
        >>> out0, out2 = msg.reduce()                      # doctest: +SKIP
    """

    def __init__(self, plans: Sequence[LookupPlan], tables: list[int], blocks: Sequence[list[Block]]) -> None:
        p0 = plans[tables[0]]
        self.plans, self.tables, self.rank, self.group = plans, tables, p0.rank, p0.group
        # the dtype torch.cat of the partials would give: the message's (each output comes back in its table's)
        self.dtype = dtype = functools.reduce(torch.promote_types, [plans[t].out_dtype for t in tables])
        self.dims = dims = {t: plans[t].table.layout.global_shape[1] for t in tables}
        dev = p0.batch.bags.ids.device
        self.bags = p0.batch.num_bags
        self.side_by_side = all(plans[t].batch.num_bags == self.bags for t in tables)
        if self.side_by_side:
            self.cols = dict(zip(tables, row_starts([dims[t] for t in tables])))
            width = sum(dims.values())
            pooled = _pooled_message([blocks[t] for t in tables], [dims[t] for t in tables], dtype,
                                     (sum(self.bags), width))
            self.adopted = pooled is not None  # then add() has nothing to place
            self.full: torch.Tensor | None = pooled if pooled is not None else torch.empty(
                sum(self.bags), width, dtype=dtype, device=dev)
            return
        rank = self.rank
        self.sizes = [sum(plans[t].batch.num_bags[q] * dims[t] for t in tables) for q in range(p0.world)]
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
                n = plans[t].batch.num_bags[q] * dims[t]
                views.append(self.send[q][at[q] : at[q] + n].view(plans[t].batch.num_bags[q], dims[t]))
                at[q] += n
            self.slots[t] = views

    def add(self, t: int, blocks: list[Block]) -> list[Block]:
        """Place table ``t``'s partial sums (its blocks at their columns, 0 elsewhere) in the message;
        ``blocks`` with their outputs released."""
        plan = self.plans[t]
        dim = self.dims[t]
        whole = len(blocks) == 1 and blocks[0].cols == (0, dim)
        if self.side_by_side:
            if not self.adopted:
                assert self.full is not None, "added before reduce()"
                self._place(self.full[:, self.cols[t] : self.cols[t] + dim], blocks, plan.out_dtype, whole, 0)
        else:
            starts = row_starts(plan.batch.num_bags)
            for q, view in enumerate(self.slots[t]):
                self._place(view, blocks, plan.out_dtype, whole, starts[q])
        return [dataclasses.replace(b, out=b.out.new_empty(0, b.cols[1])) for b in blocks]

    @staticmethod
    def _place(view: torch.Tensor, blocks: list[Block], dtype: torch.dtype, whole: bool, start: int) -> None:
        """``view`` = the blocks' partial sums of bags ``start ..`` at their columns (0 elsewhere)."""
        n = view.shape[0]
        if whole:
            view.copy_(blocks[0].out[start : start + n])
            return
        # summed in the table's own dtype (as the unfused sum), then placed
        acc = view if view.dtype == dtype else torch.empty(n, view.shape[1], dtype=dtype, device=view.device)
        acc.zero_()
        for b in blocks:
            acc[:, b.cols[0] : b.cols[0] + b.cols[1]] += b.out[start : start + n]
        if acc is not view:
            view.copy_(acc)

    def reduce(self) -> list[torch.Tensor]:
        """*Collective*: ONE reduce-scatter of the message (:func:`..collectives.reduce_rows` for the row-major
        layout, :func:`..collectives.sum_into` otherwise); per table this rank's summed rows in the table's
        ``out_dtype``, rounded once from the message's dtype (row-major: column slices of one ``(bags, sum of
        dims)`` tensor; with one rank, the message itself, which may be the pooling kernel's output: no block
        keeps it, :meth:`add` released their outputs)."""
        plans, rank = self.plans, self.rank
        if self.side_by_side:
            full = self.full
            assert full is not None, "reduce() runs once"
            self.full = None  # sent: released before the caller goes on
            mine = reduce_rows(full, self.bags, self.group)
            del full
            return [mine[:, self.cols[t] : self.cols[t] + self.dims[t]].to(plans[t].out_dtype) for t in self.tables]
        summed = sum_into(self.own, self.flat, self.sizes, self.group)
        del self.flat, self.own, self.send, self.slots  # the message is spent: free it before the caller goes on
        pieces = _split_flat(summed, [(plans[t].batch.num_bags[rank], self.dims[t]) for t in self.tables])
        return [piece.to(plans[t].out_dtype) for piece, t in zip(pieces, self.tables)]


def reduce_sum(plans: Sequence[LookupPlan], blocks: Sequence[list[Block]], tables: list[int]) -> list[torch.Tensor]:
    """REDUCE with sum, for ``tables`` together: ONE reduce-scatter of all their partial outputs."""
    if not tables:
        return []
    msg = ReduceMessage(plans, tables, blocks)
    for t in tables:
        msg.add(t, blocks[t])
    return msg.reduce()


def _pooled_message(blocks: Sequence[list[Block]], dims: list[int], dtype: torch.dtype, shape: tuple[int, int]
                    ) -> torch.Tensor | None:
    """The row-major message ``shape`` of ``dtype`` that the tables' pooled outputs (``blocks``, ``dims``: the
    message's tables in order) already are, or ``None``: one whole block per table, adjacent column slices of
    one kernel output spanning all its columns."""
    outs = []
    for bl, dim in zip(blocks, dims):
        if len(bl) != 1 or bl[0].cols != (0, dim):
            return None
        outs.append(bl[0].out)
    whole = side_by_side(outs)
    return whole if whole is not None and whole.dtype == dtype and tuple(whole.shape) == shape else None


def _split_flat(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [piece.view(shape) for piece, shape in zip(flat.split([a * b for a, b in shapes]), shapes)]


def gather_grads(
    plans: Sequence[LookupPlan], grad_outs: Sequence[torch.Tensor], tables: list[int]
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
    dtype = common_dtype(plans[t].out_dtype for t in tables)
    dims = [plans[t].table.layout.global_shape[1] for t in tables]
    bags = p0.batch.num_bags
    if all(plans[t].batch.num_bags == bags for t in tables):
        full = torch.empty(sum(bags), sum(dims), dtype=dtype, device=grad_outs[tables[0]].device)
        start = row_starts(bags)[p0.rank]
        torch.cat([grad_outs[t].to(dtype) for t in tables], dim=1, out=full[start : start + bags[p0.rank]])
        share_rows(full, bags, p0.group)
        return [full[:, a : a + d].to(plans[t].out_dtype) for t, a, d in zip(tables, row_starts(dims), dims)]
    mine = torch.cat([grad_outs[t].reshape(-1).to(dtype) for t in tables])
    counts = [sum(plans[t].batch.num_bags[r] * d for t, d in zip(tables, dims)) for r in range(p0.world)]
    gathered = share_flat(mine, counts, p0.group)
    del mine  # sent: free it before the per-table copies
    per_rank = [_split_flat(flat, [(plans[t].batch.num_bags[r], d) for t, d in zip(tables, dims)])
                for r, flat in enumerate(gathered)]
    del gathered
    return [torch.cat([rows[k] for rows in per_rank]).to(plans[t].out_dtype) for k, t in enumerate(tables)]
