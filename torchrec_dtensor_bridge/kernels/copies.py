"""A table listed more than once in one fused update: its copies are ONE table, updated once.

A lookup that names one weight for two features (or a direct caller of ``tdb::sparse_update``) hands the
kernels the same rows twice: tables at one element offset of the storage, with the same columns, rows and
state offsets. The update they owe is the unsharded one: each touched row updated once, with the gradients of
every copy summed (what ``torch.embedding_bag`` twice over one table gives autograd, and what fbgemm's module
does for features its ``feature_table_map`` maps onto one table). Updating each copy on its own instead is a
second optimizer step for the stateful kinds, and on CUDA two segments of one row written concurrently (lost
updates): fbgemm's backward groups the ids by ``hash_size_cumsum[t] + id``.

* :func:`feature_table_map` - per table of a call, the physical table it is (fbgemm's ``feature_table_map``);
  on CUDA the copies share one ``hash_size_cumsum`` offset (:func:`hash_size_cumsum`, for
  :func:`.fbgemm.table_args`), as in fbgemm's module;
* :func:`fold_copies` - on CPU, where the kernels walk the tables one after the other: the call with each
  physical table once, its copies' bags stacked (table ``t``'s ``k``-th copy's bags at bags ``k * B`` to
  ``(k + 1) * B``, empty bags after a table's last copy), the output gradient likewise. Every CPU kernel
  (ours, fbgemm's) then sums a row's gradient over all its occurrences before updating it, as for one table.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from .args import Batch, State, Tables

__all__ = ["feature_table_map", "fold_copies", "hash_size_cumsum", "overlap"]


def feature_table_map(offsets: Sequence[int], dims: Sequence[int], rows: Sequence[int],
                      *state_offsets: Sequence[int]) -> list[int]:
    """Per table of a call (tables at element ``offsets`` with ``dims`` columns and ``rows`` rows; optionally each
    state's offsets), the index of the physical table it is: tables at one element offset with the same columns
    and rows (and the same state offsets) are one. Physical tables are numbered in the order of their rows in the
    storage, as fbgemm's module numbers its tables in its buffer's order.

    Example::

        >>> feature_table_map([64, 0, 64], [4, 4, 4], [16, 16, 16])
        [1, 0, 1]
    """
    keys = [tuple(k) for k in zip(offsets, dims, rows, *(s for s in state_offsets if len(s)))]
    number = {k: p for p, k in enumerate(sorted(set(keys)))}
    return [number[k] for k in keys]


def hash_size_cumsum(offsets: Sequence[int], dims: Sequence[int], rows: Sequence[int], *, copies: bool) -> list[int]:
    """fbgemm's ``hash_size_cumsum`` of a call: per table, the rows of the tables before it, then every table's rows.
    With ``copies``, as fbgemm's module builds it from its ``feature_table_map``
    (``[cumsum[t] for t in feature_table_map] + [total]``): a table listed again is the SAME table
    (:func:`feature_table_map`), its rows counted once. fbgemm's CUDA backward sorts the ids by
    ``hash_size_cumsum[t] + id`` and updates each run once: two offsets for one table would be two runs writing
    its rows at once. Without ``copies`` (fbgemm's CPU kernels, which find a shared table only as adjacent tables
    of one offset), every table its own: the ops fold copies before the CPU kernels (:func:`fold_copies`).

    Example::

        >>> hash_size_cumsum([64, 0, 64], [4, 4, 4], [10, 16, 10], copies=True)
        [16, 0, 16, 26]
    """
    if not copies:
        return list(itertools.accumulate(rows, initial=0))
    fmap = feature_table_map(offsets, dims, rows)
    first = {p: t for t, p in reversed(list(enumerate(fmap)))}
    before = list(itertools.accumulate((rows[first[p]] for p in range(len(first))), initial=0))
    return [before[p] for p in fmap] + [before[-1]]


def _state_offsets(state: State | None) -> tuple[Sequence[int], ...]:
    return () if state is None else (state.momentum1_offsets, state.momentum2_offsets)


def overlap(tables: Tables, state: State | None = None) -> tuple[int, int] | None:
    """Two tables (by index) whose rows overlap in the storage without being copies of one table, or ``None``:
    an update would write their common elements twice, whatever the kernel."""
    fmap = feature_table_map(tables.offsets, tables.dims, tables.rows, *_state_offsets(state))
    spans = sorted((tables.offsets[t], tables.offsets[t] + tables.dims[t] * tables.rows[t], t)
                   for t in range(len(tables.dims)) if tables.dims[t] * tables.rows[t] > 0)
    end, last = -1, -1
    for lo, hi, t in spans:
        if lo < end and fmap[t] != fmap[last]:
            return last, t
        if hi > end:
            end, last = hi, t
    return None


def fold_copies(tables: Tables, batch: Batch, grad: torch.Tensor, state: State,
                ) -> tuple[Tables, Batch, torch.Tensor, State]:
    """The update of ``tables`` with each physical table once (module docstring), for the CPU kernels; the
    arguments themselves when no table is listed twice. Reads the bag boundaries (CPU tensors)."""
    fmap = feature_table_map(tables.offsets, tables.dims, tables.rows, *_state_offsets(state))
    n = len(fmap)
    phys = max(fmap) + 1
    if phys == n:
        return tables, batch, grad, state
    copies = [[t for t in range(n) if fmap[t] == p] for p in range(phys)]
    first = [c[0] for c in copies]
    bags = (batch.offsets.numel() - 1) // n
    most = max(len(c) for c in copies)
    folded_tables = Tables(tables.storage, [tables.offsets[t] for t in first], [tables.dims[t] for t in first],
                           [tables.rows[t] for t in first])
    folded_state = State(state.momentum1, [state.momentum1_offsets[t] for t in first] if state.momentum1_offsets else (),
                         state.momentum2, [state.momentum2_offsets[t] for t in first] if state.momentum2_offsets else (),
                         state.step)
    ids, offsets, psw = batch.ids, batch.offsets, batch.per_sample_weights
    lengths = (offsets[1:] - offsets[:-1]).view(n, bags)
    bounds = offsets[::bags].tolist() if bags else [0] * (n + 1)
    new_lengths = lengths.new_zeros(phys, most * bags)
    cols = list(itertools.accumulate(tables.dims, initial=0))
    width = sum(tables.dims[t] for t in first)
    new_grad = grad.new_zeros(most * bags, width)
    id_parts, psw_parts = [], []
    at = 0
    for p, members in enumerate(copies):
        d = tables.dims[members[0]]
        for k, t in enumerate(members):
            new_lengths[p, k * bags : (k + 1) * bags] = lengths[t]
            id_parts.append(ids[bounds[t] : bounds[t + 1]])
            if psw is not None:
                psw_parts.append(psw[bounds[t] : bounds[t + 1]])
            new_grad[k * bags : (k + 1) * bags, at : at + d] = grad[:, cols[t] : cols[t] + d]
        at += d
    new_offsets = torch.zeros(phys * most * bags + 1, dtype=offsets.dtype, device=offsets.device)
    torch.cumsum(new_lengths.view(-1), 0, out=new_offsets[1:])
    folded = Batch(torch.cat(id_parts) if id_parts else ids[:0], new_offsets,
                   None if psw is None else torch.cat(psw_parts), batch.ids_checked)
    return folded_tables, folded, new_grad, folded_state

