"""``max_norm``: renormalise the stored rows in place, as ``torch.embedding_renorm_`` does.

Every row referenced by ANY rank's batch whose ``norm_type`` norm exceeds
``max_norm`` is scaled by ``max_norm / (norm + 1e-7)`` before the lookup. The
rows referenced by all ranks are renormalised (not only this rank's), so every
replica of a row changes the same way and the result does not depend on which
rank asked; renormalisation is idempotent, so this equals torch's per-call
behaviour on each rank's batch.

When every shard spans whole rows (row-wise, table-wise, replicated) each rank
runs ``torch.embedding_renorm_`` on its own shards. When rows are cut into
column pieces (column-wise, grid) the norm needs every piece: each rank sums
``|x|^p`` over its pieces of the referenced rows (max for ``p = inf``), one
``all_reduce`` combines the partial sums, then every holder scales its pieces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..layout import LayoutKind, ShardLayout, ShardSpec

__all__ = ["renormalize"]

_WHOLE_ROWS = frozenset({LayoutKind.REPLICATED, LayoutKind.TABLE_WISE, LayoutKind.ROW_WISE})
"""Layout kinds whose every block spans whole rows (no column cut)."""


def _rows_in(unique: torch.Tensor, spec: ShardSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions in ``unique`` of the ids stored in ``spec``, and their local row numbers."""
    r0, h = spec.offsets[0], spec.sizes[0]
    pos = torch.nonzero((unique >= r0) & (unique < r0 + h)).flatten()
    return pos, unique[pos] - r0


@torch.no_grad()
def renormalize(
    layout: ShardLayout,
    mine: Sequence[ShardSpec],
    shards: Sequence[torch.Tensor],
    ids: torch.Tensor,
    max_norm: float,
    norm_type: float,
    group: dist.ProcessGroup | None,
) -> None:
    """Renormalise, in place, the rows of ``shards`` referenced by ``ids``; *collective*
    when rows are cut into column pieces (every rank must pass the same ``ids``)."""
    unique = torch.unique(ids)
    if layout.kind in _WHOLE_ROWS:
        for spec, t in zip(mine, shards):
            if t.numel():
                _, local = _rows_in(unique, spec)
                torch.embedding_renorm_(t, local, max_norm, norm_type)
        return
    inf = math.isinf(norm_type)
    partial = torch.zeros(unique.numel(), dtype=torch.float64, device=ids.device)
    first = set(layout.unique_shards())
    for spec, t in zip(mine, shards):
        if spec not in first or not t.numel():
            continue  # a replica: its first copy contributes for it
        pos, local = _rows_in(unique, spec)
        rows = t.index_select(0, local).to(torch.float64).abs()
        if inf:
            partial[pos] = torch.maximum(partial[pos], rows.amax(dim=1) if rows.shape[1] else partial[pos])
        elif norm_type == 0:
            partial[pos] += (rows != 0).sum(dim=1).to(torch.float64)
        else:
            partial[pos] += rows.pow(norm_type).sum(dim=1)
    dist.all_reduce(partial, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    norms = partial if inf or norm_type == 0 else partial.pow(1.0 / norm_type)
    scale = torch.where(norms > max_norm, max_norm / (norms + 1e-7), torch.ones_like(norms))
    for spec, t in zip(mine, shards):
        if t.numel():
            pos, local = _rows_in(unique, spec)
            t.index_copy_(0, local, t.index_select(0, local) * scale[pos].to(t.dtype).unsqueeze(1))
