"""A ``FileSystemWriter`` that checksums its data files while it writes them.

DCP writes each rank's data file sequentially (``torch.save`` zips, one after
another, never seeking back). Hashing every byte as it passes to the file
gives the block checksums of the file for the cost of hashing alone: no read
back, and no second pass after the write. The checksums cover exactly the
bytes handed to the file, which are exactly the bytes a load verifies.

Data files of a reused (spare) generation are overwritten in place rather
than truncated and rewritten, which is much faster on the disks measured; the
generation is uncommitted while this happens, so a save killed half-way
leaves bytes that are never loaded.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, cast

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .manifest import BlockHasher, FileSums
from .savedtensor import without_zip_crc
from ..storage import Loc

__all__ = ["ChecksummingWriter"]


class _HashingStream(io.RawIOBase):
    """Passes writes to ``raw`` and hashes what it accepted; refuses to seek (the hashes assume appends)."""

    def __init__(self, raw: Any, hasher: BlockHasher, errors: list[tuple[str, OSError]], name: str) -> None:
        super().__init__()
        self._raw = raw
        self._hasher = hasher
        self._errors = errors
        self._name = name

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        try:
            n = self._raw.write(b)
        except OSError as e:  # kept: torch.save's zip writer reports it as "unexpected pos"
            self._errors.append((self._name, e))
            raise
        n = len(memoryview(b).cast("B")) if n is None else n
        self._hasher.update(memoryview(b).cast("B")[:n])
        return n

    def tell(self) -> int:
        return int(self._raw.tell())

    def seekable(self) -> bool:
        return False

    def fileno(self) -> int:
        return int(self._raw.fileno())

    def flush(self) -> None:
        try:
            self._raw.flush()
        except OSError as e:
            self._errors.append((self._name, e))
            raise

    def close(self) -> None:
        if not self.closed:
            self._raw.flush()
        super().close()


class _HashingFileSystem(FileSystemBase):
    """DCP's file system interface over a :class:`~.storage.Loc`; data files opened for writing are hashed."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, FileSums] = {}
        self.errors: list[tuple[str, OSError]] = []
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[io.IOBase, None, None]:
        loc = cast(Loc, path)
        if "w" not in mode:
            raise io.UnsupportedOperation(f"{loc}: the checkpoint writer only writes")
        if not loc.name.endswith(".distcp"):
            with loc.create() as stream:
                yield cast(io.IOBase, stream)
            return
        # A data file of a reused generation is rewritten in place, not truncated first (storage.local).
        hasher = BlockHasher()
        with loc.create() as stream, without_zip_crc():  # the block checksums cover every byte
            yield _HashingStream(stream, hasher, self.errors, loc.name)
        sums = hasher.finish(getattr(stream, "version", None))
        with self._lock:
            self.sums[loc.name] = sums

    def concat_path(self, path: Any, suffix: str) -> Any:
        return cast(Loc, path) / suffix

    def init_path(self, path: Any) -> Any:
        return path

    def rename(self, path: Any, new_path: Any) -> None:
        cast(Loc, path).rename(cast(Loc, new_path))

    def mkdir(self, path: Any) -> None:
        cast(Loc, path).make_dir()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return isinstance(checkpoint_id, Loc)

    def exists(self, path: Any) -> bool:
        return cast(Loc, path).exists()

    def rm_file(self, path: Any) -> None:
        cast(Loc, path).delete()

    def ls(self, path: Any) -> list[str]:
        return cast(Loc, path).list()


PART = "__tdb_rank_part__"
"""The key of the write result each rank adds to DCP's: its files' checksums and its row records."""

Part = dict[str, Any]
Finisher = Callable[[list[Part]], None]


class ChecksummingWriter(dcp.FileSystemWriter):
    """DCP's writer into a generation (:class:`~.storage.Loc`), whose :attr:`file_sums` after ``dcp.save`` hold
    this rank's block checksums. Each object is durable when its stream closes (the storage's ``create``).

    A save's own records travel with DCP's write results, so that the save needs no collective of its own
    after ``dcp.save``'s: each rank writes its row file (``rows``) after DCP's data and adds one result, its
    :data:`PART` (checksums, row digest and piece records); on the coordinator, ``finish`` writes ``.metadata``
    and hands every rank's part to ``finisher`` (the manifest and the commit), whose exception DCP reports to
    every rank.

    Example::

        >>> w = ChecksummingWriter(locate("/ckpt/step100") / "gen-1f2e...")
        >>> dcp.save(sd, storage_writer=w)
        >>> w.file_sums  # {"__0_0.distcp": FileSums(...)}
    """

    def __init__(self, gen: Loc, *, rows: Any = None, rank: int = 0, finisher: Finisher | None = None,
                 stage: Callable[[str], None] | None = None, **kwargs: Any) -> None:
        super().__init__(str(gen), sync_files=False, **kwargs)  # durability: the storage's, as each stream closes
        self._hashing = _HashingFileSystem()
        self.fs = self._hashing  # type: ignore[assignment]  # DCP types it as its local FileSystem
        self.path = gen
        self._shown = Path(gen.key) if gen.local else str(gen)
        self._rows, self._rank, self._finisher, self._stage = rows, rank, finisher, stage

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            results = super().write_data(plan, planner).wait()
            part: Part = {"sums": self.file_sums, "digests": {}, "pieces": {}}
            if self._rows is not None:
                sums, part["digests"], part["pieces"] = self._rows.write(self.path, self._rank)
                part["sums"] = {**part["sums"], **sums}
        except Exception as e:
            if self.os_errors:  # torch.save's zip writer reports a full disk as "unexpected pos": the OS's error
                raise self.os_errors[0][1] from e
            raise
        if self._stage is not None:
            self._stage("dcp_saved")
        results.append(WriteResult(index=MetadataIndex(PART, index=self._rank), size_in_bytes=0, storage_data=part))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        parts = [r.storage_data for rs in results for r in rs if r.index.fqn == PART]
        super().finish(metadata, [[r for r in rs if r.index.fqn != PART] for rs in results])
        if self._finisher is not None:
            self._finisher(parts)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self._shown, save_id=self.save_id)

    @property
    def file_sums(self) -> dict[str, FileSums]:
        """Block checksums of the data files this rank wrote, by file name."""
        return dict(self._hashing.sums)

    @property
    def os_errors(self) -> list[tuple[str, OSError]]:
        """The OS errors (file name, error) this rank's data file writes met, e.g. a full disk."""
        return list(self._hashing.errors)
