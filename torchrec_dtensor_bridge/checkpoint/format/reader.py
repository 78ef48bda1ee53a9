"""A ``FileSystemReader`` that reads only the rows a rank needs, verifies them, and writes nothing until all ranks agree.

DCP stores each tensor chunk as a ``torch.save`` zip inside a data file. Plain
``FileSystemReader`` unpickles the whole chunk even when a rank needs three
rows of it. :class:`VerifiedReader` instead, for each chunk it reads:

1. opens the zip on a bounded view of the file and reads the small
   ``data.pkl`` record with a restricted unpickler (it only records the
   arguments of ``_rebuild_tensor_v2``; it never calls anything);
2. when the saved tensor is a contiguous tensor of the chunk's dtype and
   shape, reads just the bytes of the needed rows (dims after the first are
   narrowed in memory: a row-major file stores them interleaved); otherwise
   reads the whole chunk and ``torch.load``\\ s it, as DCP does;
3. expands every byte range it reads to the manifest's checksum blocks and
   verifies each block, zip headers included (:mod:`.manifest`).

``read_data`` runs in three steps, so that a load is all-or-nothing:

1. read and verify everything this rank needs into staging buffers,
   collecting every problem instead of raising;
2. agree: every rank learns every rank's problems (one collective, reached
   by every rank whatever happened in step 1) and, if there are any, raises
   the same error — no destination byte has been written on any rank;
3. copy the staged values into the destinations.

Staging holds as much memory as this rank reads. Above ``staging_bytes``,
step 1 verifies and drops the bytes, and step 3 reads them again (re-verified):
twice the reads, no extra memory. Step 3 reads whole rows bound for a
contiguous CPU tensor of the saved dtype straight into it, verifying them
there (no copy; other destinations get a copy from a scratch buffer). On a
local disk the second pass is served by the page cache. On an object store, an object whose
ETag at open is the one its save recorded in the manifest is the object that
save wrote (a store gives an object replaced or damaged through it another
ETag) and every read of it is conditional on that ETag: step 1 reads and checks
only its zip records, and its rows are read once, in step 3, verified as they
are copied. Bytes that still fail their checksums there (changed in flight, or
inside the store under an unchanged ETag) raise on that rank with destinations
partly written, as a file changed between the two passes does on a disk. An
object with another ETag (a copy made by another tool, a checkpoint saved
before ETags were recorded) is read in both steps.

Verification covers exactly the bytes read: a corrupt block that no rank
needs does not stop a load.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ..agree import Kind, Problem, raise_if_any
from ..common import memory_of
from ..errors import CheckpointError
from .manifest import BLOCK, Checksums
from .plan import ItemPlace, request_span, staged_bytes, zip_spans
from .savedtensor import Unreadable, parse_layout
from ..storage import Loc
from .verified import BadData, ItemView, ReadStats, VerifiedFile, read_buffer
from .validate import read_metadata as read_checked_metadata

__all__ = ["BadData", "ItemView", "ReadStats", "VerifiedFile", "VerifiedReader", "read_buffer"]

_SCRATCH = 8 << 20  # bytes of rows per piece when streaming (verify-first loads)


def _narrow(t: torch.Tensor, offsets: Any, lengths: Any, first: int = 0) -> torch.Tensor:
    for d in range(first, t.dim()):
        t = t.narrow(d, offsets[d], lengths[d])
    return t


# ------------------------------------------------------------ the reader
class VerifiedReader(dcp.FileSystemReader):
    """``dcp.FileSystemReader`` with ranged reads, block verification and an all-rank agreement before any write.

    Args:
        path: the checkpoint directory (a committed generation).
        checksums: the manifest's checksums, or ``None`` to read unverified (plain DCP directories).
        process_group: the group ``dcp.load`` runs over (the agreement collective uses it).
        staging_bytes: stage at most this many bytes per rank (``None``: no limit); above it,
            verify first and read again to copy.
        what: how error messages name the load.
        metadata: the checkpoint's metadata, already read and checked (:mod:`.validate`); ``read_metadata``
            returns it instead of unpickling ``.metadata`` again.
        trusted_pickles: check non-tensor items with ``torch.load(weights_only=False)`` instead of ``True``.

    Example::

        >>> dcp.load(sd, storage_reader=VerifiedReader(root, checksums=Checksums(manifest)))
    """

    def __init__(
        self,
        path: Loc,
        *,
        checksums: Checksums | None,
        process_group: dist.ProcessGroup | None = None,
        staging_bytes: int | None = None,
        what: str = "checkpoint.load",
        metadata: Metadata | None = None,
        trusted_pickles: bool = False,
    ) -> None:
        super().__init__(path.key if path.local else str(path))  # DCP's own reads: local stream transforms only
        self._given_md = metadata
        self._trusted = trusted_pickles
        self._root = path
        self._checksums = checksums
        self._group = process_group
        self._staging_bytes = staging_bytes
        self._what = what
        self._md: Metadata | None = None
        self.staged: bool | None = None  # how the last read_data ran (for tests and benchmarks)
        self.stats = ReadStats(verified=checksums is not None)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._given_md is None:
            self._given_md = read_checked_metadata(self._root, None)
        md = self._given_md
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._md = metadata

    # -- helpers
    def _chunk(self, idx: MetadataIndex) -> tuple[torch.dtype, tuple[int, ...]]:
        assert self._md is not None
        m = self._md.state_dict_metadata[idx.fqn]
        assert isinstance(m, TensorStorageMetadata)
        for c in m.chunks:
            if tuple(c.offsets) == tuple(idx.offset or ()):
                return m.properties.dtype, tuple(c.sizes)
        raise BadData(f"key {idx.fqn!r}: no saved chunk at offsets {list(idx.offset or [])}")

    def _estimate(self, items: dict[MetadataIndex, list[ReadItem]]) -> int:
        """Bytes this rank will read (full rows of every request), to choose staging or not."""
        total = 0
        for idx, reqs in items.items():
            info = self.storage_data[idx]
            if reqs[0].type == LoadItemType.BYTE_IO:
                total += info.length
                continue
            dtype, size = self._chunk(idx)
            total += staged_bytes(dtype.itemsize, size, (r.lengths[0] if size else 1 for r in reqs))
        return total

    def _pieces(self, vf: VerifiedFile, idx: MetadataIndex, reqs: list[ReadItem], scratch: memoryview | None,
                rows: bool = True, planner: LoadPlanner | None = None) -> Iterator[tuple[ReadItem, int, Any]]:
        """Read and verify what ``reqs`` need of one item, as ``(request, first row, value)``.

        Without ``scratch``, one value per request, in staging buffers of its own.
        With it, ranged requests come in pieces of at most :data:`_SCRATCH` bytes
        of rows, each a view of ``scratch`` valid until the next piece.
        Without ``rows``, a saved tensor's zip records are read and checked, not its rows.
        With ``planner`` (the copy step), whole rows bound for a CPU tensor of their dtype whose bytes are
        the file's are read straight into it and committed, not yielded (:func:`_in_place`).
        """
        info = self.storage_data[idx]
        who = f"key {idx.fqn!r}" + (f" (chunk at offsets {list(idx.offset)})" if idx.offset is not None else "")
        if info.offset + info.length > vf.size:
            raise BadData(f"data file {vf.rel} is truncated: {vf.size} bytes, {who} needs bytes up to "
                       f"{info.offset + info.length}")
        if reqs[0].type == LoadItemType.BYTE_IO:
            data = vf.read(info.offset, info.offset + info.length, who)
            try:  # refused here, before the agreement, rather than half-way through the copy
                torch.load(io.BytesIO(data), weights_only=not self._trusted)
            except Exception as e:  # noqa: BLE001 - hostile or damaged object
                raise BadData(f"data file {vf.rel}, {who}: the object cannot be loaded with weights_only="
                           f"{not self._trusted} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                           "load(..., trusted_pickles=True) unpickles trusted objects") from None
            yield from ((r, 0, data) for r in reqs)
            return
        dtype, size = self._chunk(idx)
        view = ItemView(vf, info.offset, info.length, who)
        try:
            lay = parse_layout(view, dtype, size)
        except Unreadable:
            whole = vf.read(info.offset, info.offset + info.length, who)
            t = torch.load(io.BytesIO(whole), map_location="cpu", weights_only=True)
            yield from ((r, 0, _narrow(t, r.storage_offsets, r.lengths)) for r in reqs)
            return
        place = ItemPlace(vf.rel, info.offset, info.length, lay.data_start, size, dtype.itemsize)
        for a, b in zip_spans(place):  # all of the zip's records (parse_layout read parts of them): cached
            vf.read(a, b, who)
        if not rows:
            return
        for r in reqs:
            if planner is not None and (target := _in_place(planner, r, dtype, size)) is not None:
                a, b = request_span(place, r.storage_offsets[0], r.lengths[0])
                vf.read_into(a, b, memory_of(target), who)
                planner.commit_tensor(r, target)
                continue
            if not size:
                a, b = request_span(place, 0, 1)
                raw = vf.read(a, b, who)
                yield r, 0, torch.frombuffer(raw, dtype=dtype).clone().view(())
                continue
            step = r.lengths[0] if scratch is None else max(1, _SCRATCH // max(lay.row_bytes, 1))
            for row in range(0, max(r.lengths[0], 1), step):
                n = min(step, r.lengths[0] - row)
                a, b = request_span(place, r.storage_offsets[0] + row, n)
                big = scratch is not None and n * lay.row_bytes + 2 * BLOCK > len(scratch)
                raw = vf.read(a, b, who, into=None if big else scratch)
                t = torch.frombuffer(raw, dtype=dtype) if len(raw) else torch.empty(0, dtype=dtype)
                yield r, row, _narrow(t.view(n, *size[1:]), r.storage_offsets, r.lengths, first=1)

    def _per_file(self, plan: LoadPlan) -> dict[str, dict[MetadataIndex, list[ReadItem]]]:
        per_file: dict[str, dict[MetadataIndex, list[ReadItem]]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            per_file.setdefault(info.relative_path, {}).setdefault(req.storage_index, []).append(req)
        for rel in per_file:  # in file order: sequential reads
            per_file[rel] = dict(sorted(per_file[rel].items(), key=lambda kv: self.storage_data[kv[0]].offset))
        return per_file

    def _read(self, per_file: dict[str, dict[MetadataIndex, list[ReadItem]]], planner: LoadPlanner | None,
              stage: bool, problems: list[Problem]) -> list[tuple[ReadItem, int, Any]]:
        """Read and verify every item: copy each piece into place if ``planner`` is given, else
        return the values if ``stage``, else only verify (through a reused scratch buffer)."""
        staged: list[tuple[ReadItem, int, Any]] = []
        scratch = None if stage else memoryview(bytearray(_SCRATCH + 3 * BLOCK))
        for rel, items in per_file.items():
            try:
                vf = VerifiedFile(self._root, rel, self._checksums, self.stats)
            except BadData as e:
                keys = sorted({idx.fqn for idx in items})
                problems.append(Problem(Kind.CORRUPT, f"{e} (needed for {keys})"))
                continue
            rows = planner is not None or stage or not vf.pinned  # see the module docstring
            try:
                for idx, reqs in items.items():
                    try:
                        for piece in self._pieces(vf, idx, reqs, scratch, rows, planner):
                            if planner is not None:
                                _copy([piece], planner)
                            elif stage:
                                staged.append(piece)
                    except BadData as e:
                        problems.append(Problem(Kind.CORRUPT, str(e)))
                    except Exception as e:  # noqa: BLE001 - every rank must reach the agreement
                        problems.append(Problem(Kind.CORRUPT, f"data file {rel}, key {idx.fqn!r}: {type(e).__name__}: {e}"))
                    if not stage:
                        vf.drop_cache()
            finally:
                vf.close()
        return staged

    # -- the StorageReader step
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read, verify, agree with every rank, then copy (see the module docstring); *collective*."""
        problems: list[Problem] = []
        delegate = any(self.storage_data[r.storage_index].transform_descriptors for r in plan.items)
        if delegate and not self._root.local:
            problems.append(Problem(Kind.VALUE, f"{self._root}: DCP stream transforms are read from local disks only"))
        elif delegate and self._checksums is not None:
            problems.append(Problem(Kind.VALUE, "the checkpoint's data files use DCP stream transforms, which "
                                                "checksummed loads do not support; load it unverified with "
                                                "tdb.checkpoint.load(..., verify=False)"))
        per_file = self._per_file(plan) if not delegate else {}
        try:
            estimate = self._estimate({k: v for items in per_file.values() for k, v in items.items()})
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement
            problems.append(Problem(Kind.CORRUPT, f"{type(e).__name__}: {e}"))
            estimate = 0
        self.staged = self._staging_bytes is None or estimate <= self._staging_bytes
        staged = self._read(per_file, None, self.staged, problems) if not problems else []
        raise_if_any(problems, self._group, f"{self._what} refused, nothing was modified")
        if delegate:  # unverified, with DCP's own transforms
            return super().read_data(plan, planner)
        if self.staged:
            _copy(staged, planner)
        else:
            late: list[Problem] = []
            self._read(per_file, planner, False, late)
            if late:
                raise CheckpointError(f"{self._what}: the data changed between verification and copy; "
                                      "destinations may be partly written:\n  " + "\n  ".join(p.message for p in late))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def _in_place(planner: LoadPlanner, req: ReadItem, dtype: torch.dtype, size: tuple[int, ...]) -> torch.Tensor | None:
    """The destination of ``req``, when the saved rows it asks for can be read straight into it: whole rows
    (every column), at least one, into a contiguous CPU tensor of the saved dtype; else ``None``."""
    if not size or req.lengths[0] == 0:
        return None
    if any(req.storage_offsets[d] != 0 or req.lengths[d] != size[d] for d in range(1, len(size))):
        return None
    target = planner.resolve_tensor(req).detach()
    if (type(target) is not torch.Tensor or target.device.type != "cpu" or target.dtype != dtype
            or not target.is_contiguous() or tuple(target.size()) != tuple(req.lengths)):
        return None
    return target


def _copy(values: list[tuple[ReadItem, int, Any]], planner: LoadPlanner) -> None:
    """Copy ``(request, first row, value)`` pieces into their destinations."""
    for req, row, value in values:
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(value))
            continue
        target = planner.resolve_tensor(req).detach()
        dest = target.narrow(0, row, value.size(0)) if target.dim() and value.size() != target.size() else target
        if dest.size() != value.size():
            raise CheckpointError(f"read item {req.storage_index}: destination size {list(target.size())}, "
                                  f"read {list(value.size())} at row {row}")
        dest.copy_(value)
        if target.dim() == 0 or row + value.size(0) == target.size(0):
            planner.commit_tensor(req, target)
