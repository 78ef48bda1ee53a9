"""torch's ops behind the kernel ops: the pooled sum and the dense weight gradient, one table at a time.

What runs where neither C kernel can (on a device fbgemm's kernels cannot read, with ``TDB_KERNELS=torch``,
or for a rank that lacks both), and the math the others are tested against. Any device and weights' dtype;
the pooled sum adds in id order and in fp32 (half-precision rows widened), as fbgemm's forward and this
package's C kernels do. There is no fused update here: a kind
without a one-pass kernel is updated by its torch-op math in :mod:`..optim.update`, on the touched rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from .args import Batch, Tables

__all__ = ["add_bag_grads", "dense_grad", "pool_sum"]


def _starts(sizes: Sequence[int]) -> list[int]:
    """Where each of ``sizes`` starts when laid back to back, and the total at the end."""
    return list(itertools.accumulate(sizes, initial=0))


def add_bag_grads(out: torch.Tensor, grad: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                  psw: torch.Tensor | None) -> torch.Tensor:
    """``out`` (a ``(rows, dim)`` gradient) plus the pooled SUM lookup's weight gradient, with torch ops (any
    dtype): each id's row gets its bag's output gradient ``grad`` (times its per-sample weight)."""
    lengths = offsets[1:] - offsets[:-1]
    bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=grad.device), lengths,
                                  output_size=ids.numel())
    per_id = grad.index_select(0, bag)
    if psw is not None:
        per_id = per_id * psw.unsqueeze(1)
    return out.index_add_(0, ids, per_id.to(out.dtype))


def pool_sum(tables: Tables, batch: Batch) -> torch.Tensor:
    """``(B, sum(dims))``: every table's bag sums side by side (``torch.embedding_bag`` per table)."""
    n = len(tables.dims)
    bags = (batch.offsets.numel() - 1) // n
    starts = _starts(tables.dims)
    out = torch.empty(bags, starts[-1], dtype=torch.float32, device=tables.storage.device)
    for t in range(n):
        mine = batch.table(t, bags)
        out[:, starts[t] : starts[t + 1]].copy_(_bag_sums(tables.view(t), mine))
    return out


def _bag_sums(rows: torch.Tensor, batch: Batch) -> torch.Tensor:
    """One table's bag sums in fp32, as the other kernels pool (and the ops take fp32 per-sample weights):
    ``torch.embedding_bag`` on the table itself when it is fp32; for half-precision rows, on the rows looked up,
    widened to fp32 first (``torch.embedding_bag`` takes weights of its table's dtype only, and would add in it)."""
    starts = batch.offsets[:-1]
    if rows.dtype == torch.float32:
        return torch.embedding_bag(rows, batch.ids, starts, False, 0, False, batch.per_sample_weights, False)[0]
    looked_up = rows.index_select(0, batch.ids).to(torch.float32)
    at = torch.arange(batch.ids.numel(), device=batch.ids.device)
    return torch.embedding_bag(looked_up, at, starts, False, 0, False, batch.per_sample_weights, False)[0]


def dense_grad(grad: torch.Tensor, dims: Sequence[int], rows: Sequence[int], batch: Batch) -> torch.Tensor:
    """Every table's dense weight gradient, flat and back to back (table ``t``'s ``rows[t] x dims[t]``)."""
    packed = _starts([r * d for r, d in zip(rows, dims)])
    out = torch.zeros(packed[-1], dtype=torch.float32, device=grad.device)
    scratch = Tables(out, packed[:-1], dims, rows)
    n, starts = len(dims), _starts(dims)
    bags = (batch.offsets.numel() - 1) // n
    for t in range(n):
        mine = batch.table(t, bags)
        add_bag_grads(scratch.view(t), grad[:, starts[t] : starts[t + 1]], mine.ids, mine.offsets,
                      mine.per_sample_weights)
    return out
