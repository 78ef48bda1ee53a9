"""Which of this rank's ids of a table go to which rank, decided before the agreement step.

A rank needs the ids of a table only if it computes a block of it (the first
copy of each distinct block), and of those only the ids inside its blocks'
rows: a table-wise or column-wise block spans every row, so it takes the whole
batch; a row-wise or grid block takes only its rows' ids (as TorchRec's
row-wise input distribution does), so every id crosses the wire once instead
of once per computing rank, and the receiver pools without filtering most of
them out. ``max_norm`` renormalises every replica of every referenced row, so
it sends every id to every rank. A replicated table (every rank holds it
whole) sends nothing.

The counts travel in the agreement step, so the id exchange knows its sizes
without a collective of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout import ShardLayout
from .bags import Bags

__all__ = ["Route", "route_for"]

_ALL, _NONE = True, False


@dataclass(frozen=True)
class Route:
    """Per destination rank: ``True`` (every id), ``False`` (nothing: not a reader) or a boolean mask of
    the ids it takes; ``counts``: how many ids each rank receives from this one.

    ``positions[q]``: where a mask destination's ids are in the batch (its mask's ``nonzero``, found
    once here); ``partition``: the mask destinations take every id exactly once (their row ranges
    cover the table and no id is counted twice), so the last one's per-bag counts are the bag
    lengths minus the others'.
    """

    masks: tuple[bool | torch.Tensor, ...]
    counts: tuple[int, ...]
    positions: tuple[torch.Tensor | None, ...] = ()
    partition: bool = False

    def reads(self, rank: int) -> bool:
        """``rank`` takes part in this table's lookup (receives every rank's bag lengths)."""
        return self.masks[rank] is not _NONE


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


def route_for(layout: ShardLayout, bags: Bags, world: int, *, everyone: bool) -> Route:
    """This rank's route for one table; ``everyone``: every rank takes every id (``max_norm``)."""
    n = bags.ids.numel()
    if everyone:
        return Route((_ALL,) * world, (n,) * world)
    rows = layout.global_shape[0]
    masks: list[bool | torch.Tensor] = []
    positions: list[torch.Tensor | None] = []
    counts = []
    per_rank = _row_ranges(layout, world)
    for ranges in per_rank:
        if ranges is None:
            masks.append(_ALL)
            counts.append(n)
            positions.append(None)
        elif not ranges:
            masks.append(_NONE)
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
