"""Scatter a table's blocks from one source rank: each rank receives exactly its own blocks.

The source packs, for every other rank ``q``, the blocks ``q`` holds into one
flat buffer and sends it point to point (``batch_isend_irecv``: ``isend`` /
``irecv`` on gloo, one coalesced group on NCCL). A rank therefore receives
only the bytes of its own blocks - never the whole table - and a rank holding
nothing of a table takes no part in its transfer. ``dist.scatter`` was not
used: it needs the same size on every rank, so uneven layouts would have to
pad every message to the largest rank's share.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..layout import ShardLayout

__all__ = ["scatter_blocks"]


def _pack(table: torch.Tensor, layout: ShardLayout, rank: int) -> torch.Tensor:
    """``rank``'s blocks back to back; a single row block of a contiguous table is sent as a view, uncopied."""
    blocks = [table[s.slices()] for s in layout.shards_on(rank)]
    if len(blocks) == 1 and blocks[0].is_contiguous():
        return blocks[0].reshape(-1)
    return torch.cat([b.reshape(-1) for b in blocks]) if blocks else table.new_empty(0)


def scatter_blocks(
    table: torch.Tensor, layout: ShardLayout, src_rank: int, ranks: Sequence[int] | None = None
) -> list[torch.Tensor]:
    """This rank's blocks of ``layout``, with ``src_rank``'s values of ``table``; *collective*.

    Only ``src_rank`` reads ``table``'s values; every rank uses its dtype and
    device. The returned tensors are new, contiguous storage (on a receiving
    rank, views of the one buffer it received), in ``layout.shards_on(rank)`` order.

    Args:
        table: the whole table (its values matter on ``src_rank`` only).
        layout: a validated layout whose ranks are global ranks.
        src_rank: the (global) rank whose values are scattered.
        ranks: the global ranks taking part (a mesh's; default every rank).
    """
    rank = dist.get_rank()
    mine = layout.shards_on(rank)
    sizes = [s.numel for s in mine]
    if rank == src_rank:
        own = [table[s.slices()].clone(memory_format=torch.contiguous_format) for s in mine]
        ops = []
        for q in range(dist.get_world_size()) if ranks is None else ranks:
            if q != src_rank and any(s.numel for s in layout.shards_on(q)):
                ops.append(dist.P2POp(dist.isend, _pack(table.detach(), layout, q), q))
        _wait(ops)
        return own
    flat = torch.empty(sum(sizes), dtype=table.dtype, device=table.device)
    if flat.numel():
        _wait([dist.P2POp(dist.irecv, flat, src_rank)])
    return [piece.view(s.sizes) for piece, s in zip(flat.split(sizes), mine)]


def _wait(ops: list[dist.P2POp]) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
