"""The data of a table's gather: every rank's blocks in one flat buffer of one width, and back.

A table whose blocks several ranks hold is gathered by ONE all-gather of equal-sized flat buffers. In the
order a caller uses it, on the layout in the group's own ranks (:meth:`~.layout.ShardLayout.on_ranks`):

1. :func:`check_covered`: the group's blocks cover the table (every rank sees one layout: all raise alike);
2. :func:`contributions`: per rank of the group, the blocks it sends (one per distinct block, its first
   replica), and the buffers' width;
3. :func:`pack`: this rank's buffer;
4. the all-gather itself (the caller's: a process group's, or DTensor's functional collective);
5. :func:`unpack`: every rank's buffer into the whole table.

Used by :func:`~.convert.full_tensor` and by the gather DTensor runs on a ``LocalShardsWrapper``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layout import ShardLayout, ShardSpec

__all__ = ["check_covered", "contributions", "pack", "unpack"]


def check_covered(layout: ShardLayout, members: Sequence[int]) -> None:
    """Raise ``ValueError`` unless the blocks of ``layout`` (the group's part of a table) cover the table."""
    covered = sum(s.numel for s in layout.unique_shards())
    if covered != layout.numel:
        raise ValueError(
            f"table {layout.name!r}: the blocks on the group's ranks {list(members)} cover {covered} of "
            f"{layout.numel} elements; a table must be whole inside the group its collectives run on "
            "(on a 2-D mesh, the sharding axis' group)"
        )


def contributions(layout: ShardLayout, size: int) -> tuple[list[list[ShardSpec]], int]:
    """Per group rank ``0 .. size - 1``, the blocks it sends; and the elements of the largest share (every
    buffer's width)."""
    sources = layout.unique_shards()
    per_rank = [[s for s in sources if s.rank == r] for r in range(size)]
    return per_rank, max((sum(s.numel for s in held) for held in per_rank), default=0)


def pack(sends: list[ShardSpec], mine: Sequence[tuple[ShardSpec, torch.Tensor]], width: int,
         dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This rank's buffer: its blocks that are among ``sends`` (its contributions), one after another."""
    buf = torch.zeros(width, dtype=dtype, device=device)
    pos = 0
    for spec, tensor in mine:
        if spec in sends:
            buf[pos : pos + spec.numel].copy_(tensor.reshape(-1))
            pos += spec.numel
    return buf


def unpack(out: torch.Tensor, per_rank: list[list[ShardSpec]], received: Sequence[torch.Tensor]) -> torch.Tensor:
    """``out`` (the whole table) filled from every rank's buffer (``received[r]``: group rank ``r``'s)."""
    for held, buf in zip(per_rank, received):
        pos = 0
        for spec in held:
            out[spec.slices()] = buf[pos : pos + spec.numel].view(spec.sizes)
            pos += spec.numel
    return out
