"""TorchRec's per-row optimizer state (row-wise Adagrad's ``momentum1``) of a table cut by columns, as
:func:`~torchrec_dtensor_bridge.reshard` moves it.

The state is 1-D: for a table cut into ``n`` column blocks, ``n`` values per row, block ``k``'s at
``k * rows + row``. It moves as a ``(n, rows)`` table: between two plans with the same column blocks block
for block; into a plan with one column block each row's blocks combined, weighted by their widths, as a
checkpoint load combines them (exact); into another column cut only with ``split_row_states`` (an
approximation, asked for as for a load): each row's blocks combined so, and every new block given that
value (a block's own statistic over its columns was never kept).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..layout import ShardLayout, ShardSpec
from ..optim_kinds import combine_column_blocks

__all__ = ["columns", "combiner", "row_boxes", "row_table", "widths"]

COMBINED_ROWS = 1 << 14  # rows combined at a time: float64 temporaries of about a MiB, not the whole table's


def columns(layout: ShardLayout) -> list[tuple[int, int]]:
    """The column blocks ``(first column, width)`` in the order of the blocks that first hold them."""
    out: list[tuple[int, int]] = []
    for s in layout.shards:
        if s.numel and (s.offsets[1], s.sizes[1]) not in out:
            out.append((s.offsets[1], s.sizes[1]))
    return out


def row_table(layout: ShardLayout, rows: int) -> tuple[ShardLayout, ShardLayout]:
    """TorchRec's 1-D per-row state layout of a table of ``layout``, and the same as a ``(blocks, rows)``
    table (block ``k``'s values at row ``k``)."""
    cols = columns(layout)
    flat, grid = [], []
    for s in layout.shards:
        k = cols.index((s.offsets[1], s.sizes[1])) if s.numel else 0
        flat.append(ShardSpec(s.rank, (k * rows + s.offsets[0],), (s.sizes[0],)))
        grid.append(ShardSpec(s.rank, (k, s.offsets[0]), (1, s.sizes[0])))
    return (ShardLayout((len(cols) * rows,), tuple(flat), torch.float32, layout.name),
            ShardLayout((len(cols), rows), tuple(grid), torch.float32, layout.name))


def widths(layout: ShardLayout) -> list[int]:
    """The widths of :func:`columns`."""
    return [w for _, w in columns(layout)]


def row_boxes(old: ShardLayout, new: ShardLayout, rows: int, key: str, rank: int, device: torch.device,
              ) -> tuple[list[torch.Tensor | None], ShardLayout, list[torch.Tensor]]:
    """Where the new per-row blocks on ``rank`` of a table of ``rows`` rows, cut as ``old`` and to be cut as
    ``new``, take their rows' old values from: one ``(old blocks, rows)`` buffer per distinct row range a
    rank holds, received once however many new column blocks of the rank cover it. Returns, per block of
    ``rank`` (layout order), its buffer (``None``: no rows); the buffers' layout over every rank; and this
    rank's buffers in that layout's order."""
    blocks = len(columns(old))
    ranges: list[tuple[int | None, int, int]] = []
    for s in new.shards:
        if s.sizes[0] and (s.rank, s.offsets[0], s.sizes[0]) not in ranges:
            ranges.append((s.rank, s.offsets[0], s.sizes[0]))
    into = ShardLayout((blocks, rows), tuple(ShardSpec(r, (0, first), (blocks, n)) for r, first, n in ranges),
                       torch.float32, key)
    mine = [(first, n) for r, first, n in ranges if r == rank]
    bufs = [torch.empty((blocks, n), dtype=torch.float32, device=device) for _, n in mine]
    per_block = [bufs[mine.index((s.offsets[0], s.sizes[0]))] if s.sizes[0] else None for s in new.shards_on(rank)]
    return per_block, into, bufs


def combiner(cut: list[int], boxes: list[torch.Tensor | None], dst: list[torch.Tensor]) -> Callable[[], None]:
    """What, once the old values are in, gives every new block its rows' values: the old blocks' (of widths
    ``cut``) weighted by their widths (as a checkpoint load combines them; one old block: its values as
    they are)."""

    def combine() -> None:
        for buf, out in zip(boxes, dst):
            if buf is None:
                continue
            if len(cut) == 1:
                out.copy_(buf[0])
                continue
            for first in range(0, out.shape[0], COMBINED_ROWS):  # a row's value is its own: the same bits
                rows = slice(first, first + COMBINED_ROWS)
                out[rows].copy_(combine_column_blocks(buf[:, rows], cut, out.dtype))

    return combine
