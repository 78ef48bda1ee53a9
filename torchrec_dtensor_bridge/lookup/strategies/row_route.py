"""The row strategy's route (:class:`.rows.Rows`) where the ranks' row ranges do not partition the table's rows
(blocks of one box on several ranks, or ranges one rank holds that span every row): one mask, and one
``nonzero``, per destination rank (a partition's route, grouped in one pass, is :func:`.rows.plan_route`'s).
"""

from __future__ import annotations

import torch

from ..arguments import Bags
from ..plan import ALL, NONE, Route

__all__ = ["mask_route"]


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


def mask_route(bags: Bags, per_rank: list[list[tuple[int, int]] | None], rows: int, world: int) -> Route:
    """The route when the blocks' rows (``per_rank``: per rank, :func:`.rows._row_ranges`) do not partition the
    table's ``rows``: one mask, and one ``nonzero``, per destination."""
    n = bags.ids.numel()
    masks: list[bool | torch.Tensor | None] = []
    positions: list[torch.Tensor | None] = []
    counts = []
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
