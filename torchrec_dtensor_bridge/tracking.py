"""The rows written since a save, as the writer reports them: what lets an incremental save skip its scan.

An incremental save (:mod:`.checkpoint.incremental`) finds the rows that changed
since its base by digesting every row it saves: a scan of memory at memory
speed, which on a fast disk is most of the save. A writer that knows which rows
it wrote - a :class:`~.optim.FusedOptimizer` built with
``track_changed_rows=True`` updates only the rows a step looked up, and so does
TorchRec's fused kernel for the optimizers :mod:`.torchrec_tracking` lists
(``tdb.track_changed_rows(dmp)``) - reports them here (:func:`before_writes` /
:func:`after_writes`); a save that digests a tensor marks it (:func:`mark`:
the rows written since are counted from that save, and its digests kept); the
next incremental save whose base is that save digests only the rows written
since (:func:`written_since`), and takes every other row's digest from the
mark. What it writes is the same as after a scan: the rows whose digest changed.

Trust and its guard. Rows written by anything but a reporting writer are not
seen by the reports; torch's version counter is. Every in-place operation
through torch (``copy_``, ``index_put_``, ``nn.init``, an optimizer's step, a
load into the tensor, this package's kernels) bumps the counter its tensor
shares with every view of the same base. The tracker keeps the counter's value
after the last write it was told of; a save finding another value (someone else
wrote) scans, and so does a save whose base is not the marking save, or whose
tensor is not a view of the same base tensor as the one reported (a ``detach()``
or a tensor rebuilt over the same memory shares no checked counter). Writes
that torch cannot see - through ``.data``, NumPy or a raw pointer - are not
caught: a writer that makes them must not ask for tracking.

Everything here is local to the process: no collective, no file.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["Known", "after_writes", "before_writes", "is_tracked", "mark", "unwatch", "watch", "written_since"]

Geometry = tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]


@dataclass
class _View:
    """One view of a tracked base: the rows written since its mark."""

    written: torch.Tensor  # bool [rows]
    mark: str | None = None  # the save id it was marked at
    key: Any = None  # what that save called it (its key and block)
    digests: torch.Tensor | None = None  # its rows' digests at the mark
    valid: bool = False  # no write the tracker was not told of since the mark


@dataclass
class _Base:
    version: int
    views: dict[Geometry, _View] = field(default_factory=dict)

    def sync(self, version: int) -> None:
        """Any write since the last one reported (another counter value) voids every view's record."""
        if version != self.version:
            for v in self.views.values():
                v.valid = False
            self.version = version

    def view(self, t: torch.Tensor) -> _View:
        """``t``'s record (a new one, void, the first time)."""
        geometry = _geometry(t)
        found = self.views.get(geometry)
        if found is None:
            found = self.views[geometry] = _View(torch.zeros(t.shape[0] if t.dim() else 1, dtype=torch.bool,
                                                             device=t.device))
        return found


_bases: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _base(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose version counter ``t`` shares as a view (itself when it is none)."""
    b = t._base
    return t if b is None else b


def _geometry(t: torch.Tensor) -> Geometry:
    return (int(t.storage_offset()), tuple(t.shape), tuple(t.stride()), t.dtype)


def watch(tensors: Iterable[torch.Tensor]) -> None:
    """Track ``tensors``' bases from now: a save marks them even before the first reported write."""
    for t in tensors:
        b = _base(t)
        if b not in _bases:
            _bases[b] = _Base(b._version)


def unwatch(tensors: Iterable[torch.Tensor]) -> None:
    """Stop tracking ``tensors``' bases (their writes no longer reported): saves scan them and mark them no
    more."""
    for t in tensors:
        _bases.pop(_base(t), None)


def before_writes(tensors: Iterable[torch.Tensor]) -> dict[int, tuple[torch.Tensor, int]]:
    """The version counters of the bases of ``tensors`` before a reported write (pass to :func:`after_writes`)."""
    out: dict[int, tuple[torch.Tensor, int]] = {}
    for t in tensors:
        b = _base(t)
        out.setdefault(id(b), (b, b._version))
    return out


def after_writes(before: dict[int, tuple[torch.Tensor, int]], written: Sequence[tuple[torch.Tensor, torch.Tensor]]
                 ) -> None:
    """Record that the rows ``rows`` (local row indices, repeats allowed) of each ``(tensor, rows)`` were written,
    and nothing else of their bases since :func:`before_writes` gave ``before``.

    A base whose counter had moved before the writes (someone else wrote) has every view's record voided
    first."""
    for b, version in before.values():
        st = _bases.get(b)
        if st is None:
            st = _bases[b] = _Base(version)
        st.sync(version)
        st.version = b._version
    for t, rows in written:
        view = _bases[_base(t)].view(t)
        if view.valid and rows.numel():
            view.written.index_fill_(0, rows.detach().to(view.written.device, torch.int64), True)


def is_tracked(t: torch.Tensor) -> bool:
    """Whether writes to ``t``'s base were reported (a save then marks ``t``)."""
    return _base(t) in _bases


@dataclass(frozen=True)
class Known:
    """What :func:`written_since` knows of a view: the rows written since the base, and every row's digest at
    the base."""

    rows: torch.Tensor  # int64, ascending
    digests: torch.Tensor  # the tracker's own: the caller may update it in place


def written_since(t: torch.Tensor, save_id: str, key: Any) -> Known | None:
    """The rows of ``t`` written since the save ``save_id`` (which saved it as ``key``), or ``None`` when that
    is not known: not tracked, marked at another save or as another key, or written by anything unreported.

    Taking them voids the record until the next :func:`mark` (the caller may update ``digests`` in place: a
    save that fails before marking leaves the next save to scan)."""
    b = _base(t)
    st = _bases.get(b)
    if st is None:
        return None
    st.sync(b._version)
    view = st.views.get(_geometry(t))
    if view is None or not view.valid or view.mark != save_id or view.key != key or view.digests is None:
        return None
    view.valid = False
    return Known(view.written.nonzero().flatten().cpu(), view.digests)


def mark(t: torch.Tensor, save_id: str, key: Any, digests: torch.Tensor) -> None:
    """``t`` was saved as ``key`` by the save ``save_id``, its rows' digests now ``digests``: count the rows
    written from here (call it when the digests were taken, before any further write)."""
    b = _base(t)
    st = _bases.get(b)
    if st is None:
        return
    st.sync(b._version)
    view = st.view(t)
    view.written.zero_()
    view.mark, view.key, view.digests, view.valid = save_id, key, digests, True
