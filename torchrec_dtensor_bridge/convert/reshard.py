"""Copy a table from any layout into the local shards of another: in memory, point to point.

Each rank sends exactly the overlaps its blocks have with other ranks' blocks
and receives exactly what its own blocks need; no rank ever holds the whole
table. A full (unsharded) source tensor needs no communication at all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._compat import ShardedTensor, shape_and_dtype
from ..layout import ShardLayout, ShardSpec, box_intersection
from .dtensor import layout_of, local_shards_of

__all__ = ["copy_into"]


def _intersect(a: ShardSpec, b: ShardSpec) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    return box_intersection(a.offsets, a.sizes, b.offsets, b.sizes)


def _view(t: torch.Tensor, owner: ShardSpec, box: tuple[tuple[int, ...], tuple[int, ...]]) -> torch.Tensor:
    """The part of ``t`` (the block ``owner``) covered by the global ``box``."""
    offsets, sizes = box
    idx = tuple(slice(o - base, o - base + s) for o, base, s in zip(offsets, owner.offsets, sizes))
    return t[idx]


def copy_into(
    dst_layout: ShardLayout,
    dst_shards: list[torch.Tensor],
    src: torch.Tensor,
    *,
    name: str = "table",
) -> None:
    """Fill this rank's ``dst_shards`` (blocks of ``dst_layout`` on this rank) from ``src``.

    ``src`` is a full tensor (no communication), or a DTensor / ShardedTensor of
    any layout: then *collective* — every rank calls it for the same table,
    and only overlapping pieces travel (``isend``/``irecv`` per overlap).
    Shapes and dtypes are checked first and raise ``ValueError`` naming ``name``.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = dst_layout.shards_on(rank)
    shape, dtype = shape_and_dtype(src)
    if shape != dst_layout.global_shape:
        raise ValueError(f"{name}: source shape {list(shape)} != destination shape {list(dst_layout.global_shape)}")
    if dst_shards and dtype != dst_shards[0].dtype:
        raise ValueError(f"{name}: source dtype {dtype} != destination dtype {dst_shards[0].dtype}")
    if not isinstance(src, (DTensor, ShardedTensor)):
        for spec, t in zip(mine, dst_shards):
            t.copy_(src[spec.slices()])
        return
    src_layout = layout_of(src, name=name)
    src_local = dict(zip(src_layout.shards_on(rank), local_shards_of(src)))
    dst_local = dict(zip(mine, dst_shards))
    pending = []
    received = []
    # Every rank walks the same pairs in the same order, so sends and receives match up.
    for d in dst_layout.shards:
        for s in src_layout.unique_shards():
            box = _intersect(d, s)
            if box is None:
                continue
            if s.rank == rank and d.rank == rank:
                _view(dst_local[d], d, box).copy_(_view(src_local[s], s, box))
            elif s.rank == rank:
                pending.append(dist.isend(_view(src_local[s], s, box).contiguous(), dst=d.rank))
            elif d.rank == rank:
                buf = torch.empty(box[1], dtype=dtype, device=dst_local[d].device)
                pending.append(dist.irecv(buf, src=s.rank))
                received.append((_view(dst_local[d], d, box), buf))
    for work in pending:
        assert work is not None, "isend/irecv returned no work handle"
        work.wait()
    for view, buf in received:
        view.copy_(buf)
