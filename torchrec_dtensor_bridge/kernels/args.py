"""The kernel ops' arguments below the op boundary, grouped (as fbgemm groups its own ``aux_*`` lists).

A ``torch.ops.tdb`` op takes flat tensors and scalars, as a custom op's schema must. :mod:`.ops` groups
them once into these records, checks them once, and passes them to the implementation that runs:

* :class:`Tables`: several tables in ONE flat fp32 storage (fbgemm's form), table ``t``'s ``rows[t] x
  dims[t]`` rows, row-major, at element ``offsets[t]``;
* :class:`Batch`: one batch of ``B`` bags per table: the ids of all tables back to back, ``T * B + 1``
  bag boundaries (table-major, positions in the ids), the per-sample weights, and whether the caller
  already checked the ids (then the ops do not check them again: on CUDA, a device synchronisation);
* :class:`State`: a fused optimizer's state buffers (each table's state at its element offset, one value
  per row or one per element as the kind's states say) and the step count;
* the hyper-parameters, the kind among them: :class:`...optim_kinds.Hyper`.

An output, or an output gradient, is ``(B, sum(dims))``: table ``t`` at its columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Batch", "State", "Tables"]


@dataclass(frozen=True)
class Tables:
    """Tables in one flat storage.

    Attributes:
        storage: the flat storage (1-D fp32), read or written in place.
        offsets: per table, the element its first row starts at.
        dims: per table, its columns.
        rows: per table, its rows.
    """

    storage: torch.Tensor
    offsets: Sequence[int]
    dims: Sequence[int]
    rows: Sequence[int]

    def view(self, t: int) -> torch.Tensor:
        """Table ``t`` as a ``(rows, dim)`` view of the storage."""
        at, rows, dim = self.offsets[t], self.rows[t], self.dims[t]
        return self.storage.narrow(0, at, rows * dim).view(rows, dim)


@dataclass(frozen=True)
class Batch:
    """One batch of ``B`` bags for each of ``T`` tables.

    Attributes:
        ids: int64, every table's ids back to back.
        offsets: int64, ``T * B + 1`` bag boundaries (positions in ``ids``), table-major.
        per_sample_weights: fp32, one per id, or ``None``.
        ids_checked: the caller has checked the ids and offsets (every id inside its table's rows, the
            boundaries in order), so the ops do not check them again (:mod:`.calls`, whose callers, the
            lookups, check them at their API edge); ``False`` for any other caller.
    """

    ids: torch.Tensor
    offsets: torch.Tensor
    per_sample_weights: torch.Tensor | None = None
    ids_checked: bool = False

    def table(self, t: int, bags: int) -> Batch:
        """Table ``t``'s bags alone: its ids, its ``bags + 1`` boundaries counted from its first id, its weights."""
        cut = self.offsets.narrow(0, t * bags, bags + 1)
        lo, hi = int(cut[0]), int(cut[-1])  # two reads: a host path's (the device paths do without)
        psw = self.per_sample_weights
        return Batch(self.ids.narrow(0, lo, hi - lo), cut - lo, None if psw is None else psw.narrow(0, lo, hi - lo),
                     self.ids_checked)


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()``, as a ``clone``: the same copy, and one FakeTensor also traces for a device this build
    of torch has no runtime for."""
    return t if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class State:
    """A fused optimizer's state for tables of one storage, as the kernels take it.

    Attributes:
        momentum1: the kind's first tensor state, flat fp32 (``None`` for a kind without one); table ``t``'s
            at element ``momentum1_offsets[t]``: ``rows[t]`` values for a per-row state, else ``rows[t] x
            dims[t]``.
        momentum1_offsets: per table, where its ``momentum1`` starts.
        momentum2: the kind's second tensor state, likewise (Adam's).
        momentum2_offsets: per table, where its ``momentum2`` starts.
        step: the tables' step count, this step included (read by kinds that count steps).
    """

    momentum1: torch.Tensor | None = None
    momentum1_offsets: Sequence[int] = ()
    momentum2: torch.Tensor | None = None
    momentum2_offsets: Sequence[int] = ()
    step: int = 0
