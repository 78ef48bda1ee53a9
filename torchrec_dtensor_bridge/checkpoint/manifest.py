"""Checksums of a DCP checkpoint's data files, written at commit and checked by every read.

Format 2 (written by :func:`~.api.save` and :func:`~.migrate.migrate`): each
data file is cut into fixed-size blocks (:data:`BLOCK`, counted from the start
of the file) and the manifest holds the xxh3-64 of every block, one hex string
per file. The blocks are hashed from the bytes as they are written
(:class:`BlockHasher`), so a save never reads its files back, and a load
verifies exactly the blocks it reads: a rank that needs a few rows of a saved
chunk reads and checks a few blocks, never the whole chunk. (xxh3 hashes at
memory speed, ~3x faster than ``zlib.crc32`` here.)

Format 3 (written since, with everything of format 2) covers the checkpoint's
own records: the manifest file starts with a header line holding the xxh3-64
and length of its JSON body, and the body holds the size and xxh3-64 of
``.metadata``. Both are verified before either is parsed (:mod:`.validate`),
so a damaged byte in either is reported naming the file, never parsed.
Format 2 manifests are plain JSON (still read; their ``.metadata`` is
unprotected, but still parsed with the restricted unpickler).

Format 1 (older checkpoints, still read): one xxh3-64 per storage item (one
chunk of one tensor, or one pickled object); a load reads and verifies whole
items. :class:`Checksums` answers "which byte ranges must I read, and what
must they hash to?" for both formats.

The manifest also records the save id that DCP writes into ``.metadata``, so
a ``.metadata`` from another save is refused, and any data file from another
save fails its block checksums.
"""

from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

__all__ = [
    "BLOCK",
    "FORMAT",
    "MANIFEST",
    "Block",
    "BlockHasher",
    "Checksums",
    "FileSums",
    "ItemSum",
    "checksum_items",
    "item_key",
    "read_manifest",
    "write_manifest",
    "write_manifest_v1",
]

MANIFEST = "tdb_manifest.json"
FORMAT = 3
MAX_MANIFEST_BYTES = 2 << 30
"""Larger manifests are refused before being read (a 1 TiB checkpoint's is ~70 MB)."""
_HEADER = b"TDBMANIFEST"
BLOCK = 256 << 10
"""Bytes per checksummed block. A ranged read of one saved chunk reads at most four blocks more than its
rows: the partial blocks at either end, and the blocks holding the zip's head and central directory."""
_HEX = 16  # hex digits of one xxh3-64 digest
_READ = 16 << 20


@dataclass(frozen=True)
class FileSums:
    """The block checksums of one data file: ``size`` bytes, ``blocks`` = concatenated 16-digit hex digests."""

    size: int
    block: int
    blocks: str

    def digest(self, k: int) -> int:
        return int(self.blocks[k * _HEX : (k + 1) * _HEX], 16)


@dataclass(frozen=True)
class ItemSum:
    """Format 1: where one storage item lives and what its bytes hash to."""

    file: str
    offset: int
    length: int
    digest: int


@dataclass(frozen=True)
class Block:
    """A byte range ``[start, end)`` of a file and the xxh3-64 its bytes must have."""

    start: int
    end: int
    digest: int


class BlockHasher:
    """Hashes a stream of bytes written from offset 0 into :data:`BLOCK`-sized block digests."""

    def __init__(self, block: int = BLOCK) -> None:
        self.block = block
        self.size = 0
        self._hex: list[str] = []
        self._h = xxhash.xxh3_64()
        self._fill = 0

    def update(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        pos = 0
        while pos < len(mv):
            take = min(self.block - self._fill, len(mv) - pos)
            self._h.update(mv[pos : pos + take])
            self._fill += take
            pos += take
            if self._fill == self.block:
                self._hex.append(self._h.hexdigest())
                self._h.reset()
                self._fill = 0
        self.size += len(mv)

    def finish(self) -> FileSums:
        if self._fill:
            self._hex.append(self._h.hexdigest())
            self._h.reset()
            self._fill = 0
        return FileSums(self.size, self.block, "".join(self._hex))


def file_sums(path: Path, block: int = BLOCK) -> FileSums:
    """Block checksums of a whole file, read from disk (for files not hashed as they were written)."""
    h = BlockHasher(block)
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_READ):
            h.update(chunk)
    return h.finish()


def item_key(index: MetadataIndex) -> str:
    """A stable text key for a storage item: ``fqn`` plus its chunk offsets."""
    return index.fqn if index.offset is None else f"{index.fqn}@{','.join(map(str, index.offset))}"


class Checksums:
    """The blocks a read of a byte range must cover and verify, from a manifest of either format."""

    def __init__(self, manifest: dict[str, Any]) -> None:
        self.format: int = manifest["format"]
        self._files: dict[str, FileSums] = {}
        self._items: dict[str, tuple[list[int], list[Block]]] = {}
        if self.format == 1:
            per_file: dict[str, list[Block]] = {}
            for rec in manifest["items"].values():
                per_file.setdefault(rec["file"], []).append(
                    Block(rec["offset"], rec["offset"] + rec["length"], rec["digest"])
                )
            for rel, blocks in per_file.items():
                blocks.sort(key=lambda b: b.start)
                self._items[rel] = ([b.start for b in blocks], blocks)
        else:
            block = manifest["block"]
            self._files = {rel: FileSums(rec["size"], block, rec["blocks"]) for rel, rec in manifest["files"].items()}

    def size(self, rel: str) -> int | None:
        """The size the file had when saved (format 2; ``None`` for format 1)."""
        sums = self._files.get(rel)
        return None if sums is None else sums.size

    def blocks(self, rel: str, start: int, end: int) -> list[Block]:
        """The checksummed blocks covering bytes ``[start, end)`` of ``rel`` (``end > start``).

        Raises ``KeyError`` if the manifest has no checksum for some of those bytes.
        """
        if self.format == 1:
            starts, items = self._items.get(rel, ([], []))
            i = bisect.bisect_right(starts, start) - 1
            out = []
            while 0 <= i < len(items) and items[i].start < end:
                if items[i].end > start:
                    out.append(items[i])
                i += 1
            if not out or out[0].start > start or out[-1].end < end:
                raise KeyError(f"bytes {start}-{end} of {rel} have no checksum in the manifest")
            return out
        sums = self._files.get(rel)
        if sums is None or end > sums.size:
            raise KeyError(f"bytes {start}-{end} of {rel} have no checksum in the manifest")
        from .plan import block_span

        b = sums.block
        return [Block(k * b, min((k + 1) * b, sums.size), sums.digest(k)) for k in block_span(start, end, b)]


def checksum_items(root: Path, md: Metadata, indexes: list[MetadataIndex]) -> dict[str, ItemSum]:
    """Format 1: the xxh3-64 of each storage item in ``indexes`` (kept to write format-1 checkpoints in tests)."""
    out = {}
    for idx in indexes:
        info = md.storage_data[idx]
        with open(root / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        out[item_key(idx)] = ItemSum(info.relative_path, info.offset, info.length, xxhash.xxh3_64(data).intdigest())
    return out


def _write(root: Path, body: dict[str, Any], *, header: bool = True) -> None:
    """Write the manifest atomically and durably (temporary file, fsync, rename); ``header``: format 3's
    checksummed header line before the JSON body."""
    tmp = root / f".{MANIFEST}.tmp"
    data = json.dumps(body).encode()
    if header:
        data = b"%s %s %d\n" % (_HEADER, xxhash.xxh3_64(data).hexdigest().encode(), len(data)) + data
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST)


def write_manifest(root: Path, save_id: str, md: Metadata, files: dict[str, FileSums], extra: dict[str, Any],
                   metadata: bytes | None = None) -> None:
    """Write a format-3 manifest: block checksums of ``files``, where each item of ``md`` lives, and the size and
    checksum of ``.metadata`` (its bytes: ``metadata``, else read from ``root``).

    Raises ``ValueError`` if an item's bytes lie outside the checksummed files.
    """
    items = {}
    for idx, info in md.storage_data.items():
        sums = files.get(info.relative_path)
        if sums is None or info.offset + info.length > sums.size:
            raise ValueError(f"item {item_key(idx)} lies in {info.relative_path}, whose checksums were not computed")
        items[item_key(idx)] = {"file": info.relative_path, "offset": info.offset, "length": info.length}
    blocks = {s.block for s in files.values()}
    if len(blocks) > 1:
        raise ValueError(f"files hashed with different block sizes {sorted(blocks)}")
    if metadata is None:
        metadata = (root / ".metadata").read_bytes()
    body = {
        "format": FORMAT,
        "checksum": "xxh3_64",
        "save_id": save_id,
        "metadata": {"size": len(metadata), "xxh3_64": xxhash.xxh3_64(metadata).hexdigest()},
        "block": blocks.pop() if blocks else BLOCK,
        "files": {rel: {"size": s.size, "blocks": s.blocks} for rel, s in sorted(files.items())},
        "items": dict(sorted(items.items())),
        **extra,
    }
    _write(root, body)


def write_manifest_v1(root: Path, save_id: str, items: dict[str, ItemSum], extra: dict[str, Any]) -> None:
    """Write a format-1 manifest (one checksum per item), as releases before block checksums did."""
    body = {
        "format": 1,
        "checksum": "xxh3_64",
        "save_id": save_id,
        "items": {k: vars(v) for k, v in sorted(items.items())},
        **extra,
    }
    _write(root, body, header=False)


def read_manifest(root: Path) -> dict[str, Any] | None:
    """The manifest of a checkpoint directory, verified and checked for shape, or ``None`` for a plain DCP
    directory; raises :class:`~.commit.CorruptCheckpointError` naming the file (see :mod:`.validate`)."""
    from .validate import parse_manifest

    p = root / MANIFEST
    try:
        size = os.lstat(p).st_size
    except FileNotFoundError:
        return None
    from .commit import CorruptCheckpointError

    if not os.path.isfile(p) or os.path.islink(p):
        raise CorruptCheckpointError(f"manifest {p} is not a regular file")
    if size > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"manifest {p} has {size} bytes, more than the {MAX_MANIFEST_BYTES} allowed")
    with open(p, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    return parse_manifest(data, str(p))


def split_header(data: bytes, where: str) -> bytes:
    """The JSON body of a manifest's bytes, its header's checksum verified (format 3); legacy plain JSON
    (formats 1 and 2) is returned as is."""
    from .commit import CorruptCheckpointError

    if data[:1] == b"{":
        return data
    nl = data.find(b"\n", 0, 128)
    head = data[:nl].split(b" ") if nl > 0 else []
    if len(head) != 3 or head[0] != _HEADER or len(head[1]) != _HEX or not head[2].isdigit():
        raise CorruptCheckpointError(f"manifest {where} is corrupt: no valid header line")
    body = data[nl + 1 :]
    if int(head[2]) != len(body):
        raise CorruptCheckpointError(f"manifest {where} is truncated or corrupt: its header says {int(head[2])} "
                                     f"bytes of body, it has {len(body)}")
    got = xxhash.xxh3_64(body).hexdigest()
    if got.encode() != head[1]:
        raise CorruptCheckpointError(f"manifest {where} is corrupt: its body's checksum is {got}, its header "
                                     f"says {head[1].decode(errors='replace')}")
    return body
