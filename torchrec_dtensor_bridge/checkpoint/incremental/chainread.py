"""Reading an incremental checkpoint's tensors: each needed row once, from the newest link that holds it.

:class:`ChainReader` runs for every tensor of a load whose checkpoint is a
chain (:mod:`.chain`), on every rank, for this rank's blocks of each
destination (any plan, any world size):

1. plan (:meth:`ChainReader.check`): per destination block, the links newest
   first; a link's sources of a key are its changed-row pieces (their row ids
   read and verified first) or, for the full checkpoint at the end of the
   chain, DCP's saved chunks. Every row (per column cell: links saved under
   different column cuts are combined cell by cell) is taken from the first
   source that holds it; rows a newer link holds are not read again from an
   older one, except where a small gap between needed rows is read through
   (:data:`GAP_BYTES`: one read rather than many);
2. read and verify every byte range (block checksums, :mod:`.manifest`) into
   staging buffers, or, above ``staging_bytes``, verify only (but for the rows
   of objects their store certifies unchanged: :mod:`..format.reader`); problems
   are collected, never raised, so the caller's agreement is reached by every rank;
3. after the agreement, :meth:`ChainReader.copy`: the staged rows into place
   (or read again, verified again, and copied).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from ..agree import Kind, Problem, raise_if_any
from .chain import Chain, Link, Piece
from ..common import leaves, run_dcp
from ..errors import CheckpointError
from .rows import ALIGN, local_blocks
from ..format.manifest import BLOCK, Checksums
from ..loading import SafeObjectPlanner
from ..format.reader import BadData, ItemView, ReadStats, VerifiedFile, VerifiedReader, read_buffer
from ..format.savedtensor import Unreadable, parse_layout

__all__ = ["GAP_BYTES", "SPAN_BYTES", "ChainReader", "load_chain"]

GAP_BYTES = 64 << 10
"""Rows not needed between two needed ones are read through (and not copied) up to this many bytes."""
SPAN_BYTES = 4 << 20
"""The most bytes read at once."""

Cell = tuple[tuple[int, ...], tuple[int, ...]]  # (global starts, lengths) of dims 1..


@dataclass
class _Source:
    """Rows of one saved block in one link: global row ``first + k`` for positions ``k`` (``ids``: which)."""

    link: Link
    file: str
    data_at: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    ids: torch.Tensor | None  # global rows, ascending, one per stored row; None: rows first .. first + count
    first: int = 0
    count: int = 0

    def inside(self, d0: int, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The positions of the rows inside ``[d0, d0 + n)`` and those rows' indices in it; ``None`` if none."""
        if self.ids is None:
            a, b = max(d0, self.first), min(d0 + n, self.first + self.count)
            return (torch.arange(a - self.first, b - self.first), torch.arange(a - d0, b - d0)) if a < b else None
        pos = ((self.ids >= d0) & (self.ids < d0 + n)).nonzero().flatten()
        return (pos, self.ids[pos] - d0) if pos.numel() else None


@dataclass
class _Take:
    """What one destination block takes from one source: the positions read, and per cell what is copied."""

    source: _Source
    dest: torch.Tensor  # the destination block, rows along dim 0
    dest_offsets: tuple[int, ...]
    dtype: torch.dtype
    positions: torch.Tensor
    copies: list[tuple[Cell, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (cell, src pos, dest rows)
    through: bool = False  # the full checkpoint's rows: every row read is copied (newer links' rows land later)

    def spans(self, row_bytes: int) -> list[tuple[int, int]]:
        """Runs of positions ``[a, b)`` to read, small gaps read through, each at most :data:`SPAN_BYTES`."""
        p = self.positions
        if not p.numel():
            return []
        gap = max(1, GAP_BYTES // max(row_bytes, 1))
        breaks = ((p[1:] - p[:-1]) > gap).nonzero().flatten().tolist()
        starts, ends = [int(p[0])] + [int(p[i + 1]) for i in breaks], [int(p[i]) + 1 for i in breaks] + [int(p[-1]) + 1]
        step = max(1, SPAN_BYTES // max(row_bytes, 1))
        return [(a, min(a + step, b)) for s, b in zip(starts, ends) for a in range(s, b, step)]


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1) if t.dim() == 0 else t


def _narrow(t: torch.Tensor, starts: tuple[int, ...], lengths: tuple[int, ...], origin: tuple[int, ...],
            ) -> torch.Tensor:
    for j, (s, n, o) in enumerate(zip(starts, lengths, origin)):
        t = t.narrow(j + 1, s - o, n)
    return t


def _cells(lo: tuple[int, ...], hi: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]],
           ) -> list[Cell]:
    """The cells of dims 1.. of the box ``[lo, hi)`` cut at every edge of ``boxes`` (global starts, ends)."""
    per_dim = []
    for j in range(len(lo)):
        cuts = sorted({lo[j], hi[j], *(min(max(x, lo[j]), hi[j]) for a, b in boxes for x in (a[j], b[j]))})
        per_dim.append([(a, b - a) for a, b in zip(cuts, cuts[1:]) if b > a])
    return [(tuple(c[0] for c in combo), tuple(c[1] for c in combo)) for combo in itertools.product(*per_dim)]


class ChainReader:
    """Reads the tensors of ``view`` from ``chain`` for this rank (the steps of the module docstring)."""

    def __init__(self, chain: Chain, view: Mapping[str, Any], rank: int, *, verify: bool,
                 staging_bytes: int | None, stats: ReadStats) -> None:
        self.chain = chain
        self._rank = rank
        self._verify = verify
        self._staging = staging_bytes
        self.stats = stats
        self._files: dict[tuple[str, str], VerifiedFile] = {}
        self._takes: list[_Take] = []
        self._staged: list[tuple[_Take, int, memoryview]] | None = None
        self._scratch: memoryview | None = None
        self._tensors = [(fqn, v) for fqn, v in leaves(view) if isinstance(v, torch.Tensor) and fqn in chain.tensors]

    # -- files
    def _file(self, link: Link, rel: str) -> VerifiedFile:
        key = (str(link.root), rel)
        vf = self._files.get(key)
        if vf is None:
            checksums = Checksums(link.manifest) if self._verify else None
            try:
                vf = self._files[key] = VerifiedFile(link.root, rel, checksums, self.stats)
            except BadData as e:
                raise BadData(f"{link.label}: {e}") from None
        return vf

    def close(self) -> None:
        for vf in self._files.values():
            vf.close()
        self._files.clear()

    # -- sources
    def _piece_source(self, link: Link, fqn: str, p: Piece) -> _Source:
        first = p.offsets[0] if p.offsets else 0
        if p.every:
            return _Source(link, p.file, p.at, p.offsets, p.sizes, None, first, p.count)
        vf = self._file(link, p.file)
        raw = vf.read(p.at, p.at + 8 * p.count, f"{link.label}: key {fqn!r} row ids") if p.count else b""
        ids = torch.frombuffer(bytearray(raw), dtype=torch.int64) if p.count else torch.empty(0, dtype=torch.int64)
        rows = p.sizes[0] if p.sizes else 1
        if ids.numel() and (int(ids[0]) < 0 or int(ids[-1]) >= rows or bool((ids[1:] <= ids[:-1]).any())):
            raise BadData(f"{link.label}: key {fqn!r}: the row ids of the piece at offsets {list(p.offsets)} are not "
                       f"ascending rows of its {rows}-row block")
        end = p.at + 8 * p.count
        return _Source(link, p.file, end + (-end % ALIGN), p.offsets, p.sizes, first + ids)

    def _chunk_sources(self, link: Link, fqn: str) -> list[_Source]:
        m = link.metadata.state_dict_metadata[fqn]
        assert isinstance(m, TensorStorageMetadata)
        out = []
        for c in m.chunks:
            o, s = tuple(c.offsets), tuple(c.sizes)
            if not prod(s) and s:
                continue
            info = link.metadata.storage_data[MetadataIndex(fqn, c.offsets)]
            vf = self._file(link, info.relative_path)
            who = f"{link.label}: key {fqn!r} (chunk at offsets {list(o)})"
            try:
                lay = parse_layout(ItemView(vf, info.offset, info.length, who), m.properties.dtype, s)
            except Unreadable as e:
                raise BadData(f"{who} is not a contiguous tensor ({e}); compact the chain from a full checkpoint "
                           "written by tdb.checkpoint.save") from None
            first = o[0] if o else 0
            out.append(_Source(link, info.relative_path, info.offset + lay.data_start, o, s, None, first,
                               s[0] if s else 1))
        return out

    def _sources(self, fqn: str, boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[_Source]:
        """Every link's sources of ``fqn`` overlapping any of ``boxes``, newest link first."""
        def overlaps(o: tuple[int, ...], s: tuple[int, ...]) -> bool:
            return any(all(a < c + d and c < a + b for a, b, c, d in zip(o, s, bo, bs)) or not s for bo, bs in boxes)

        out = []
        for link in self.chain.links:
            if link.full:
                out += [src for src in self._chunk_sources(link, fqn) if overlaps(src.offsets, src.sizes)]
            else:
                out += [self._piece_source(link, fqn, p) for p in link.pieces.get(fqn, [])
                        if overlaps(p.offsets, p.sizes)]
        return out

    # -- planning
    def _plan_block(self, fqn: str, d_off: tuple[int, ...], dest: torch.Tensor, sources: list[_Source],
                    dtype: torch.dtype) -> list[_Take]:
        rows = _rows(dest)
        n = rows.shape[0]
        d0 = d_off[0] if d_off else 0
        lo, hi = d_off[1:], tuple(a + b for a, b in zip(d_off[1:], rows.shape[1:]))
        mine = [s for s in sources if all(a < h and b > l for a, b, l, h in
                                          zip(s.offsets[1:], (x + y for x, y in zip(s.offsets[1:], s.sizes[1:])),
                                              lo, hi))]
        cells = _cells(lo, hi, [(s.offsets[1:], tuple(a + b for a, b in zip(s.offsets[1:], s.sizes[1:])))
                                for s in mine])
        filled = torch.zeros(n, len(cells), dtype=torch.bool)
        takes = []
        for src in mine:
            found = src.inside(d0, n)
            if found is None:
                continue
            inside, drows = found
            take = _Take(src, rows, d_off, dtype, inside, through=src.link.full)
            if take.through:  # a run of rows: slices, not gathers
                r0, r1 = int(drows[0]), int(drows[-1]) + 1
                for c, (starts, lens) in enumerate(cells):
                    if all(o <= a and a + m <= o + s for a, m, o, s in zip(starts, lens, src.offsets[1:],
                                                                          src.sizes[1:])):
                        need = (~filled[r0:r1, c]).nonzero().flatten()
                        if need.numel():
                            filled[r0:r1, c] = True
                            take.copies.append(((starts, lens), need, need))
                if take.copies:
                    needed = [sp for _, sp, _ in take.copies]  # each ascending: one cell needs no sort
                    take.positions = (needed[0] if len(needed) == 1 else torch.unique(torch.cat(needed))) + int(
                        inside[0])
                    takes.append(take)
                continue
            needed = []
            for c, (starts, lens) in enumerate(cells):
                if not all(o <= a and a + m <= o + s
                           for a, m, o, s in zip(starts, lens, src.offsets[1:], src.sizes[1:])):
                    continue
                need = ~filled[drows, c]
                if bool(need.any()):
                    dr = drows[need]
                    filled[dr, c] = True
                    needed.append(inside[need])
                    take.copies.append(((starts, lens), inside[need], dr))
            if take.copies:
                take.positions = needed[0] if len(needed) == 1 else torch.unique(torch.cat(needed))
                takes.append(take)
        if not bool(filled.all()):
            missing = (~filled.all(1)).nonzero().flatten()
            raise BadData(f"key {fqn!r}: rows {[d0 + int(r) for r in missing[:5]]} of this rank's block at offsets "
                       f"{list(d_off)} are in no link of the chain")
        return takes

    def _plan(self, problems: list[Problem]) -> None:
        for fqn, value in self._tensors:
            dtype = self.chain.tensors[fqn][1]
            blocks = [(tuple(o), t) for o, t in local_blocks(value, self._rank) if t.numel() or not t.dim()]
            if not blocks:
                continue
            try:
                sources = self._sources(fqn, [(o, tuple(t.shape)) for o, t in blocks])
                for o, t in blocks:
                    self._takes += self._plan_block(fqn, o, t, sources, dtype)
            except BadData as e:
                problems.append(Problem(Kind.CORRUPT, str(e)))
            except Exception as e:  # noqa: BLE001 - every rank must reach the agreement
                problems.append(Problem(Kind.CORRUPT, f"key {fqn!r}: {type(e).__name__}: {e}"))

    # -- reading
    def _row_bytes(self, take: _Take) -> int:
        return prod(take.source.sizes[1:]) * take.dtype.itemsize

    def _read(self, take: _Take, a: int, b: int, into: memoryview | None) -> memoryview:
        """Positions ``[a, b)`` of the take's source, verified, in ``into`` (at least their bytes and two
        checksum blocks more; ``None``: a buffer of their own)."""
        rb = self._row_bytes(take)
        src = take.source
        vf = self._file(src.link, src.file)
        return vf.read(src.data_at + a * rb, src.data_at + b * rb, f"{src.link.label}: rows {a}-{b} of a block",
                       into=into)

    def _scratch_for(self, n: int) -> memoryview | None:
        """The reused scratch buffer, if ``n`` bytes (and two blocks) fit in it: valid until the next read."""
        if self._scratch is None:
            self._scratch = memoryview(bytearray(SPAN_BYTES + 3 * BLOCK))
        return self._scratch if n + 2 * BLOCK <= len(self._scratch) else None

    def check(self) -> list[Problem]:
        """Plan, then read and verify every range (staged when it fits ``staging_bytes``); this rank's problems."""
        problems: list[Problem] = []
        self._plan(problems)
        if problems:
            return problems
        spans = [(t, a, b, (b - a) * self._row_bytes(t)) for t in self._takes for a, b in t.spans(self._row_bytes(t))]
        stage = self._staging is None or sum(n for *_, n in spans) <= self._staging
        self._staged = [] if stage else None
        room = read_buffer(sum(n + 2 * BLOCK for *_, n in spans)) if stage else None  # one staging area, mapped once
        at = 0
        for take, a, b, n in spans:
            if room is None:  # verify-first: rows of an object its store certifies unchanged are read once, in copy
                try:
                    if self._file(take.source.link, take.source.file).pinned:
                        continue
                except BadData as e:
                    problems.append(Problem(Kind.CORRUPT, str(e)))
                    continue
            into = room[at : at + n + 2 * BLOCK] if room is not None else self._scratch_for(n)
            at += n + 2 * BLOCK
            try:
                raw = self._read(take, a, b, into)
            except BadData as e:
                problems.append(Problem(Kind.CORRUPT, str(e)))
                continue
            if self._staged is not None:
                self._staged.append((take, a, raw))
            else:
                self._file(take.source.link, take.source.file).drop_cache()
        return problems

    def copy(self) -> None:
        """Copy every planned row into place (after the agreement); raises if the files changed since
        :meth:`check` verified them (a verify-first load reads again)."""
        pieces = self._staged
        if pieces is None:  # oldest link first: a newer link's rows overwrite the full checkpoint's
            for take in reversed(self._takes):
                for a, b in take.spans(self._row_bytes(take)):
                    try:
                        raw = self._read(take, a, b, self._scratch_for((b - a) * self._row_bytes(take)))
                    except BadData as e:
                        raise CheckpointError(f"the data changed between verification and copy; destinations may "
                                              f"be partly written: {e}") from None
                    _copy(take, a, b, raw)
                    self._file(take.source.link, take.source.file).drop_cache()
            return
        for take, a, raw in reversed(pieces):
            _copy(take, a, a + len(raw) // max(self._row_bytes(take), 1), raw)


def _copy(take: _Take, a: int, b: int, raw: memoryview) -> None:
    """Copy what ``take`` wants of positions ``[a, b)`` (their bytes ``raw``) into the destination block."""
    src = take.source
    if raw.readonly:  # a verified block served from the reader's cache (a copy): read-only
        raw = memoryview(bytearray(raw))
    t = torch.frombuffer(raw, dtype=take.dtype) if len(raw) else torch.empty(0, dtype=take.dtype)
    t = t.view(b - a, *src.sizes[1:])
    if take.through:  # positions a..b are rows of the block, in order: one slice copy per cell
        first = src.first + a - (take.dest_offsets[0] if take.dest_offsets else 0)
        for (starts, lens), _, _ in take.copies:
            dest = _narrow(take.dest, starts, lens, take.dest_offsets[1:]).narrow(0, first, b - a)
            dest.copy_(_narrow(t, starts, lens, src.offsets[1:]))
        return
    for (starts, lens), sp, dr in take.copies:
        lo, hi = int(torch.searchsorted(sp, a)), int(torch.searchsorted(sp, b))
        if lo == hi:
            continue
        s, d = sp[lo:hi] - a, dr[lo:hi]
        values = _narrow(t, starts, lens, src.offsets[1:])
        dest = _narrow(take.dest, starts, lens, take.dest_offsets[1:])
        if values.dtype != dest.dtype or values.device != dest.device:
            values = values.to(device=dest.device, dtype=dest.dtype)
        k = hi - lo
        run = int(s[-1] - s[0]) + 1 == k  # the positions are a run: no gather
        picked = values.narrow(0, int(s[0]), k) if run else values.index_select(0, s.to(values.device))
        if run and int(d[-1] - d[0]) + 1 == k:  # into a run of rows too: a slice copy
            dest.narrow(0, int(d[0]), k).copy_(picked)
        else:
            dest.index_copy_(0, d.to(dest.device), picked)


def _set_leaves(sd: Any, values: Mapping[str, Any], prefix: str = "") -> None:
    """Put ``values`` (flattened keys, as :func:`.common.leaves` names them) back into the nested ``sd``."""
    items: Any = sd.items() if isinstance(sd, Mapping) else enumerate(sd) if isinstance(sd, list) else ()
    for k, v in list(items):
        fqn = f"{prefix}{k}"
        if fqn in values and not isinstance(v, torch.Tensor):
            sd[k] = values[fqn]
        elif isinstance(v, (Mapping, list)):
            _set_leaves(v, values, fqn + ".")


def load_chain(chain: Chain, view: dict[str, Any], reader: VerifiedReader, group: dist.ProcessGroup | None,
               what: str, *, verify: bool, staging_bytes: int | None, trusted_pickles: bool) -> None:
    """Load ``view`` from ``chain``: its tensors through :class:`ChainReader`, its other values with ``dcp.load``
    from the newest link (``reader``); *collective*. Nothing is modified unless every rank read and verified
    everything it needs."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    cr = ChainReader(chain, view, rank, verify=verify, staging_bytes=staging_bytes, stats=reader.stats)
    try:
        raise_if_any(cr.check(), group, f"{what} refused, nothing was modified")
        objects = {fqn: v for fqn, v in leaves(view) if not isinstance(v, torch.Tensor)}
        run_dcp(dcp.load, objects, storage_reader=reader, planner=SafeObjectPlanner(trusted_pickles),
                process_group=group)
        _set_leaves(view, objects)
        cr.copy()
    finally:
        cr.close()
