"""Random bag batches for the single-process kernel tests."""

from __future__ import annotations

import torch


def random_bags(g: torch.Generator, rows: int, bags: int, max_len: int, *, empty_first: bool = False,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, offsets)``: ``bags`` bags of 0..``max_len`` random int64 ids below ``rows`` (the first bag empty
    when asked), ``offsets`` with ``bags + 1`` entries (the last one the number of ids)."""
    lengths = torch.randint(0, max_len + 1, (bags,), generator=g)
    if empty_first:
        lengths[0] = 0
    ids = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    return ids, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
