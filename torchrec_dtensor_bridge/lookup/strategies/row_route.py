"""Where a row-cut table's ids go: the row strategy's route (:class:`.rows.Rows`).

A rank needs only the ids inside the rows of the blocks it computes (as TorchRec's row-wise input
distribution), so every id crosses the wire once instead of once per computing rank, and the receiver pools
without filtering most of them out.

1. :func:`plan_route` - per destination rank, the row ranges of the blocks it computes (:func:`_row_ranges`);
2. when those ranges partition the table's rows (:func:`_cuts`), :func:`_partition` groups the ids by destination
   in one pass and leaves one value to read (how many ids go where: a :class:`..plan.PendingRoute`, read with
   the other tables' by :func:`..entry.resolve_routes`);
3. otherwise one mask, and one ``nonzero``, per destination.
"""

from __future__ import annotations

import torch

from ...layout import ShardLayout
from ..arguments import Bags
from ..plan import ALL, NONE, PendingRoute, Route

__all__ = ["plan_route"]


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


def _in_range(ids: torch.Tensor, r0: int, r1: int, rows: int) -> torch.Tensor:
    """``r0 <= ids < r1`` with one comparison where the range touches either end of the table."""
    if r0 <= 0:
        return ids < r1
    if r1 >= rows:
        return ids >= r0
    return (ids >= r0) & (ids < r1)


def _covers(ranges: list[list[tuple[int, int]]], rows: int) -> bool:
    """The ranges together cover ``[0, rows)``."""
    at = 0
    for r0, r1 in sorted(r for rs in ranges for r in rs):
        if r0 > at:
            return False
        at = max(at, r1)
    return at >= rows


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
    n = bags.ids.numel()
    rows = layout.global_shape[0]
    masks: list[bool | torch.Tensor | None] = []
    positions: list[torch.Tensor | None] = []
    counts = []
    per_rank = _row_ranges(layout, world)
    runs = _cuts(per_rank, rows)
    if runs is not None:
        return _partition(bags, runs, world)
    for ranges in per_rank:
        if ranges is None:
            masks.append(ALL)
            counts.append(n)
            positions.append(None)
        elif not ranges:
            masks.append(NONE)
            counts.append(0)
            positions.append(None)
        else:
            mask = _in_range(bags.ids, *ranges[0], rows)
            for r0, r1 in ranges[1:]:
                mask = mask | _in_range(bags.ids, r0, r1, rows)
            at = mask.nonzero().squeeze(1)
            masks.append(mask)
            positions.append(at)
            counts.append(int(at.numel()))
    cut = [r for r in per_rank if r]
    partition = (all(r is not None for r in per_rank) and len(cut) > 1
                 and sum(counts) == n and _covers(cut, rows))
    return Route(tuple(masks), tuple(counts), tuple(positions), partition)
