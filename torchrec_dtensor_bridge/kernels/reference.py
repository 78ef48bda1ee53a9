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
    lengths = offsets.diff()
    bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=grad.device), lengths,
                                  output_size=ids.numel())
    per_id = grad.index_select(0, bag)
    if psw is not None:
        per_id = per_id * psw.unsqueeze(1)
    return out.index_add_(0, ids, per_id.to(out.dtype))


def pool_sum(tables: Tables, batch: Batch) -> torch.Tensor:
    """``(B, sum(dims))``: every table's bag sums side by side (``torch.embedding_bag`` per table on CPU; on a
    device, :func:`_device_bag_sums`: nothing read back)."""
    n = len(tables.dims)
    bags = (batch.offsets.numel() - 1) // n
    on_host = tables.storage.device.type == "cpu"
    sums = [_bag_sums(tables.view(t), batch.table(t, bags)) if on_host
            else _device_bag_sums(tables.view(t), batch, t, bags) for t in range(n)]
    return sums[0] if n == 1 else torch.cat(sums, dim=1)


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


def _in_bags(batch: Batch, t: int, bags: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Table ``t``'s bags among the whole batch's ids without reading a value (on a device, each read is a
    synchronisation; slicing the table's ids out needs two): per id of the batch, its bag of table ``t`` (clamped
    into ``[0, bags)``), its weight in that bag (its per-sample weight, 0 for an id outside the table's bags), and
    the id clamped into the table's rows (an id of another table is read harmlessly, with weight 0)."""
    ids = batch.ids
    cut = batch.offsets.narrow(0, t * bags, bags + 1)
    at = torch.arange(ids.numel(), device=ids.device)
    bag = torch.searchsorted(cut, at, right=True) - 1  # cut[i] <= at < cut[i + 1]: bag i
    weight = ((bag >= 0) & (bag < bags)).to(torch.float32)
    if batch.per_sample_weights is not None:
        weight = weight * batch.per_sample_weights
    return bag.clamp_(0, max(bags - 1, 0)), weight, ids.clamp(0, max(rows - 1, 0))


def _device_bag_sums(rows: torch.Tensor, batch: Batch, t: int, bags: int) -> torch.Tensor:
    """:func:`_bag_sums` of table ``t`` (``rows``) on a device, over every id of the batch (:func:`_in_bags`):
    fp32, nothing read back."""
    out = torch.zeros(bags, rows.shape[1], dtype=torch.float32, device=rows.device)
    if bags == 0 or batch.ids.numel() == 0:
        return out
    bag, weight, ids = _in_bags(batch, t, bags, rows.shape[0])
    looked_up = rows.index_select(0, ids).to(torch.float32) * weight.unsqueeze(1)
    return out.index_add_(0, bag, looked_up)


def dense_grad(grad: torch.Tensor, dims: Sequence[int], rows: Sequence[int], batch: Batch) -> torch.Tensor:
    """Every table's dense weight gradient, flat and back to back (table ``t``'s ``rows[t] x dims[t]``); on a
    device nothing is read back (:func:`_in_bags`)."""
    packed = _starts([r * d for r, d in zip(rows, dims)])
    out = torch.zeros(packed[-1], dtype=torch.float32, device=grad.device)
    scratch = Tables(out, packed[:-1], dims, rows)
    n, starts = len(dims), _starts(dims)
    bags = (batch.offsets.numel() - 1) // n
    for t in range(n):
        g = grad.narrow(1, starts[t], dims[t])
        if out.device.type == "cpu":
            mine = batch.table(t, bags)
            add_bag_grads(scratch.view(t), g, mine.ids, mine.offsets, mine.per_sample_weights)
        elif bags and batch.ids.numel():
            bag, weight, ids = _in_bags(batch, t, bags, rows[t])
            scratch.view(t).index_add_(0, ids, g.index_select(0, bag) * weight.unsqueeze(1))
    return out
