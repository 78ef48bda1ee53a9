"""Verified byte ranges of a checkpoint's data files: every byte a load reads passes through :class:`VerifiedFile`,
which reads it once and checks it block by block against the manifest (:mod:`.manifest`) before handing it on.

Example::

    >>> vf = VerifiedFile(generation, "__0_0.distcp", Checksums(manifest))
    >>> vf.read(4096, 8192, "key 'emb.weight'")  # verified bytes, or BadData naming the file and the key
"""

from __future__ import annotations

import io
import mmap
from dataclasses import dataclass
from typing import Any

import xxhash

from ..common import format_bytes
from .manifest import Block, Checksums
from ..storage import Loc, NotAnObject

__all__ = ["BadData", "ItemView", "ReadStats", "VerifiedFile", "read_buffer"]


class BadData(Exception):
    """A problem with the checkpoint's bytes (corrupt, truncated, missing); the message names file and key."""


_POPULATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


def read_buffer(n: int) -> memoryview:
    """``n`` writable bytes for a read to fill.

    Anonymous memory mapped with its pages populated in one call: faster to
    fill than ``bytearray(n)``, which zero-fills page by page, faulting each
    (BENCHMARKS.md, "Checkpoints"); every byte read lands here.
    """
    return memoryview(mmap.mmap(-1, n, flags=_POPULATE)) if n else memoryview(bytearray())


@dataclass
class ReadStats:
    """What a reader read on this rank; what :func:`~.api.load` returns.

    Attributes:
        bytes_read: bytes read from data files, every pass counted (a verify-first load reads twice, but for
            the rows of objects a store certifies unchanged: :mod:`.reader`).
        files_opened: data files opened (once per pass).
        verified: whether every byte read was checked against the checkpoint's manifest (``verify=True``).

    Example::

        >>> tdb.checkpoint.load(sd, "/ckpt/step100")
        ReadStats(read 1.20 MiB from 3 data files on this rank, checksums verified)
    """

    bytes_read: int = 0
    files_opened: int = 0
    verified: bool = False

    def __repr__(self) -> str:
        files = f"{self.files_opened} data file{'' if self.files_opened == 1 else 's'}"
        checked = "checksums verified" if self.verified else "not verified (verify=False)"
        return f"ReadStats(read {format_bytes(self.bytes_read)} from {files} on this rank, {checked})"


class VerifiedFile:
    """Byte ranges of one data file, each read once and checked block by block against the manifest."""

    def __init__(self, root: Loc, rel: str, checksums: Checksums | None, stats: ReadStats | None = None) -> None:
        self.rel = rel
        self._stats = stats if stats is not None else ReadStats()
        self._checksums = checksums
        self._cache: dict[int, memoryview] = {}  # verified block start -> its bytes
        try:
            self._handle = (root / rel).open_read()
        except FileNotFoundError:
            raise BadData(f"data file {rel} is missing") from None
        except (OSError, NotAnObject) as e:
            raise BadData(f"data file {rel} cannot be opened: {e}") from None
        except Exception as e:  # an object store's error
            raise BadData(f"data file {rel} cannot be opened: {type(e).__name__}: {e}") from None
        self.size = self._handle.size
        self._stats.files_opened += 1
        saved = checksums.version(rel) if checksums is not None else None
        self.pinned = saved is not None and self._handle.version == saved
        """Whether the store certifies the object is the one its save wrote: its ETag at open is the one the
        manifest recorded, and every read of it is conditional on that ETag (object stores)."""

    def close(self) -> None:
        self._handle.close()

    def drop_cache(self) -> None:
        self._cache.clear()

    def _pread(self, buf: memoryview, offset: int, who: str) -> None:
        done = 0
        while done < len(buf):
            try:
                n = self._handle.readinto(buf[done:], offset + done)
            except OSError:
                raise
            except Exception as e:  # noqa: BLE001  # an object store's error: replaced or removed while read
                raise BadData(f"data file {self.rel} cannot be read: {type(e).__name__}: {e}") from None
            self._stats.bytes_read += n
            if n == 0:
                raise BadData(f"data file {self.rel} is truncated: {self.size} bytes, {who} needs bytes up to "
                           f"{offset + len(buf)}")
            done += n

    def read(self, start: int, end: int, who: str, into: memoryview | None = None) -> memoryview:
        """Bytes ``[start, end)`` of the file, verified; ``who`` names the key in error messages.

        The bytes land in a fresh buffer (kept, with every block verified, for
        later reads), or in ``into`` (a reused scratch buffer, at least
        :data:`_SCRATCH` bytes): then only the last block is kept, as a copy.
        """
        if end <= start:
            return read_buffer(0)
        if self._checksums is None:
            buf = read_buffer(end - start) if into is None else into[: end - start]
            self._pread(buf, start, who)
            return buf
        blocks = self._blocks(start, end, who)
        first = blocks[0]
        if len(blocks) == 1 and first.start in self._cache:
            return self._cache[first.start][start - first.start : end - first.start]
        base = first.start
        buf = read_buffer(blocks[-1].end - base) if into is None else into[: blocks[-1].end - base]
        i = 0
        while i < len(blocks):
            b = blocks[i]
            if b.start in self._cache:
                buf[b.start - base : b.end - base] = self._cache[b.start]
                i += 1
                continue
            j = i
            while j < len(blocks) and blocks[j].start not in self._cache:
                j += 1
            run = blocks[i:j]  # uncached blocks, contiguous in the file: one read
            self._pread(buf[run[0].start - base : run[-1].end - base], run[0].start, who)
            for r in run:
                got = xxhash.xxh3_64(buf[r.start - base : r.end - base]).intdigest()
                if got != r.digest:
                    raise self._corrupt(who, r.start, r.end, got, r.digest)
                if into is None:
                    self._cache[r.start] = buf[r.start - base : r.end - base]
            i = j
        if into is not None:  # the next piece of a streamed range starts in this block
            last = blocks[-1]
            self._cache = {last.start: memoryview(bytes(buf[last.start - base : last.end - base]))}
        return buf[start - base : end - base]

    def read_into(self, start: int, end: int, dest: memoryview, who: str, run: int = 8 << 20) -> None:
        """Bytes ``[start, end)`` of the file read straight into ``dest`` (``end - start`` bytes), verified.

        The parts of the first and last checksum blocks outside the range are
        read beside it (or taken from the cache); the range is read in pieces of
        about ``run`` bytes, each verified while it is still in the CPU's caches.
        On a failed checksum :class:`BadData` is raised with ``dest`` holding
        the bytes read: callers write into their destinations only after every
        rank agreed that everything verified (:mod:`.reader`).
        """
        if end <= start:
            return
        if self._checksums is None:
            self._pread(dest[: end - start], start, who)
            return
        blocks = self._blocks(start, end, who)
        first, last = blocks[0], blocks[-1]
        head, tail = self._edge(first.start, start, who), self._edge(end, last.end, who)
        i = 0
        while i < len(blocks):  # a run of blocks: one read, then its checksums
            j, a = i + 1, max(blocks[i].start, start)
            while j < len(blocks) and blocks[j].end - a <= run:
                j += 1
            b = min(blocks[j - 1].end, end)
            self._pread(dest[a - start : b - start], a, who)
            for r in blocks[i:j]:
                h = xxhash.xxh3_64(head if r.start < start else b"")
                h.update(dest[max(r.start, start) - start : min(r.end, end) - start])
                if r.end > end:
                    h.update(tail)
                if h.intdigest() != r.digest:
                    raise self._corrupt(who, r.start, r.end, h.intdigest(), r.digest)
            i = j
        # the next range may start in the last block
        kept = (bytes(head) if last is first else b"") + bytes(dest[max(last.start, start) - start :]) + bytes(tail)
        self._cache = {last.start: memoryview(kept)}

    def _blocks(self, start: int, end: int, who: str) -> list[Block]:
        assert self._checksums is not None
        try:
            return self._checksums.blocks(self.rel, start, end)
        except KeyError as e:
            raise BadData(f"{who}: {e.args[0]}") from None

    def _corrupt(self, who: str, start: int, end: int, got: int, want: int) -> BadData:
        return BadData(f"data file {self.rel} is corrupt or from another save: {who} reads bytes {start}-{end}, "
                       f"whose checksum is {got:016x}, the manifest says {want:016x}")

    def _edge(self, a: int, b: int, who: str) -> memoryview:
        """Bytes ``[a, b)``, part of one checksum block, unverified (the block is verified whole by the caller):
        from the cache when it holds that block, else read."""
        if b <= a:
            return memoryview(b"")
        for s, cached in self._cache.items():
            if s <= a and b <= s + len(cached):
                return cached[a - s : b - s]
        buf = memoryview(bytearray(b - a))
        self._pread(buf, a, who)
        return buf


class ItemView(io.RawIOBase):
    """A seekable read-only view of bytes ``[offset, offset + length)`` of a :class:`VerifiedFile`."""

    def __init__(self, vf: VerifiedFile, offset: int, length: int, who: str) -> None:
        super().__init__()
        self._vf, self._offset, self._length, self._who = vf, offset, length, who
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = max(0, pos + (0, self._pos, self._length)[whence])
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self._length - self._pos))
        a = self._offset + self._pos
        memoryview(b).cast("B")[:n] = self._vf.read(a, a + n, self._who)
        self._pos += n
        return n
