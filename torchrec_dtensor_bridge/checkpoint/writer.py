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
import os
import threading
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from .manifest import BlockHasher, FileSums

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


class _HashingFileSystem(FileSystem):
    """DCP's local file system, except that data files opened for writing are hashed."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, FileSums] = {}
        self.errors: list[tuple[str, OSError]] = []
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode or not str(path).endswith(".distcp"):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        # A data file of a reused generation is rewritten in place, not truncated first:
        # overwriting allocated, cached blocks is faster than freeing and reallocating them
        # (BENCHMARKS.md, "Checkpoints"). A file that comes out shorter is cut to size afterwards.
        hasher = BlockHasher()
        with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644), "wb") as stream:
            yield _HashingStream(stream, hasher, self.errors, Path(path).name)
        if os.stat(path).st_size > hasher.size:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.ftruncate(fd, hasher.size)
                os.fsync(fd)
            finally:
                os.close(fd)
        with self._lock:
            self.sums[Path(path).name] = hasher.finish()


class ChecksummingWriter(dcp.FileSystemWriter):
    """``dcp.FileSystemWriter`` whose :attr:`file_sums` after ``dcp.save`` hold this rank's block checksums.

    Example::

        >>> w = ChecksummingWriter("/ckpt/gen", sync_files=True)
        >>> dcp.save(sd, storage_writer=w)
        >>> w.file_sums  # {"__0_0.distcp": FileSums(...)}
    """

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._hashing = _HashingFileSystem()
        self.fs = self._hashing

    @property
    def file_sums(self) -> dict[str, FileSums]:
        """Block checksums of the data files this rank wrote, by file name."""
        return dict(self._hashing.sums)

    @property
    def os_errors(self) -> list[tuple[str, OSError]]:
        """The OS errors (file name, error) this rank's data file writes met, e.g. a full disk."""
        return list(self._hashing.errors)
