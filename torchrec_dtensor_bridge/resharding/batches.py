"""The order in which :func:`~torchrec_dtensor_bridge.reshard` moves tables, so that no rank's memory grows
by more than one table's new share: from the two layouts of each table alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from ..layout import ShardLayout

__all__ = ["bytes_by_rank", "schedule"]


class Moving(Protocol):
    """A table that moves: its layout now and the one it moves to (global ranks, with its dtype)."""

    @property
    def layout(self) -> ShardLayout: ...

    @property
    def target(self) -> ShardLayout: ...


T = TypeVar("T", bound=Moving)


def bytes_by_rank(layout: ShardLayout) -> dict[int, int]:
    """The bytes of ``layout``'s blocks on each rank holding some."""
    assert layout.dtype is not None, "a live table's layouts carry its dtype"
    per: dict[int, int] = {}
    for s in layout.shards:
        assert s.rank is not None, "a live table's blocks each name their rank"
        per[s.rank] = per.get(s.rank, 0) + s.numel * layout.dtype.itemsize
    return per


def _bytes_on(layout: ShardLayout, members: Sequence[int]) -> list[int]:
    """The bytes of ``layout``'s blocks on each rank of ``members``."""
    per = bytes_by_rank(layout)
    return [per.get(r, 0) for r in members]


def schedule(tables: Sequence[T], members: Sequence[int]) -> list[list[T]]:
    """``tables`` (those that move: each with its ``layout`` now and its ``target``) in the batches they
    move in, in order: from the layouts alone, so the same on every rank.

    A rank's memory while a batch moves is what it holds before the batch plus the batch's new blocks on
    it (the old ones are freed once the batch is in use). Each rank's bound is the larger of its memory
    before and after the whole reshard, plus its largest new share of one table. Greedily: the next batch
    starts with the table that keeps the worst rank furthest under its bound once moved (a table that frees
    memory on the rank where it is tightest goes first), and takes in, in that order, every further table
    with which no rank passes its bound: tables whose new blocks are on different ranks move together,
    each rank filling its own at once. A table alone in its batch may pass the bound where no order avoids
    it.
    """
    moving = list(tables)
    new = [_bytes_on(t.target, members) for t in moving]
    delta = [[n - o for n, o in zip(nb, _bytes_on(t.layout, members))] for t, nb in zip(moving, new)]
    ranks = range(len(members))
    target = [max(0, sum(d[r] for d in delta)) for r in ranks]
    bound = [target[r] + max((n[r] for n in new), default=0) for r in ranks]
    held = [0] * len(members)
    left = list(range(len(moving)))
    batches: list[list[T]] = []
    while left:
        def after(i: int) -> int:  # the worst rank's memory after table i, against where it ends
            return max(held[r] + delta[i][r] - target[r] for r in ranks)

        order = sorted(left, key=lambda i: (after(i), i))
        peak = list(held)
        batch: list[int] = []
        for i in order:
            if batch and any(peak[r] + new[i][r] > bound[r] for r in ranks):
                continue
            batch.append(i)
            for r in ranks:
                peak[r] += new[i][r]
        batch.sort()
        for i in batch:
            left.remove(i)
            for r in ranks:
                held[r] += delta[i][r]
        batches.append([moving[i] for i in batch])
    return batches
