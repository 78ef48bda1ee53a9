"""The checksum manifest of a checkpoint: its format, written at commit, read and verified by every read.

The manifest (``tdb_manifest.json`` in each generation) is the checkpoint's
own record of what its bytes must hash to. This module owns all of it:
the format, writing it (:func:`write_manifest`), and reading it as untrusted
input (:func:`read_manifest`), in order:

1. the file is checked to be a regular file no larger than
   :data:`MAX_MANIFEST_BYTES`, then read;
2. the header check (:func:`split_header`, format 3): the header line's
   length and xxh3-64 of the JSON body are verified before the body is parsed,
   so a damaged byte is reported naming the file, never parsed;
3. the body is parsed as JSON and checked for shape (:func:`parse_manifest`):
   format, save id, block size, plain file names, one digest per block;
4. a load then asks :class:`Checksums` "which byte ranges must I read, and what
   must they hash to?", and :func:`item_record` where each item's bytes lie.

Format 3 (written by :func:`~.api.save` and :func:`~.migrate.migrate`): a header
line ``TDBMANIFEST <xxh3-64 hex> <body length>`` before the JSON body. Each data
file is cut into fixed-size blocks (:data:`BLOCK`, counted from the start of the
file) and the body holds the xxh3-64 of every block, one hex string per file,
where each item lies, and the size and xxh3-64 of ``.metadata`` (checked by
:func:`~.validate.read_metadata` before it unpickles anything). The blocks are
hashed from the bytes as they are written (:class:`BlockHasher`), so a save
never reads its files back, and a load verifies exactly the blocks it reads: a
rank that needs a few rows of a saved chunk reads and checks a few blocks, never
the whole chunk. (xxh3 hashes at memory speed, faster than ``zlib.crc32``.)

Format 2 (older checkpoints, still read): the same body as plain JSON, without
the header or the ``.metadata`` checksum (``.metadata`` is still parsed with the
restricted unpickler).

Format 1 (older checkpoints, still read): plain JSON, one xxh3-64 per storage
item (one chunk of one tensor, or one pickled object); a load reads and verifies
whole items.

The manifest also records the save id that DCP writes into ``.metadata``, so
a ``.metadata`` from another save is refused, and any data file from another
save fails its block checksums. Every failure to read it is a
:class:`~.errors.CorruptCheckpointError` naming the file.

Example::

    >>> manifest = read_manifest(resolve("/ckpt/step100"))  # None for a plain DCP directory
    >>> Checksums(manifest).blocks("__0_0.distcp", 0, 4096)  # what bytes 0-4096 must hash to
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from ..errors import CorruptCheckpointError
from .plan import block_span
from ..storage import Loc, NotAnObject, locate

__all__ = [
    "BLOCK",
    "LINK",
    "ROW_DIGESTS",
    "FORMAT",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "Block",
    "BlockHasher",
    "Checksums",
    "FileSums",
    "check_file_name",
    "encode_manifest",
    "item_key",
    "item_record",
    "parse_manifest",
    "read_manifest",
    "split_header",
    "write_manifest",
]

MANIFEST = "tdb_manifest.json"
FORMAT = 3
ROW_DIGESTS = "row_digests"
"""The manifest's record of the row digests: ``tensors`` (key -> [shape, dtype]) and ``blocks`` (key ->
[[offsets, sizes, file, offset, width], ...] for every row of each block; in an incremental link,
[offsets, sizes, file, offset, width, count]: the digests of the ``count`` rows its piece of that block holds,
in the piece's order; a block of the link with no changed row has none: the chain's older links hold them)."""
LINK = "link"
"""An incremental checkpoint's manifest record: ``base`` (``name``, ``generation``, ``save_id``), ``depth``
(links down to a full checkpoint) and ``pieces`` (key -> [[offsets, sizes, file, offset, count, all], ...])."""

MAX_MANIFEST_BYTES = 2 << 30
"""Larger manifests are refused before being read (a 1 TiB checkpoint's is ~70 MB)."""
_HEADER = b"TDBMANIFEST"
BLOCK = 256 << 10
"""Bytes per checksummed block. A ranged read of one saved chunk reads at most four blocks more than its
rows: the partial blocks at either end, and the blocks holding the zip's head and central directory."""
_HEX = 16  # hex digits of one xxh3-64 digest


@dataclass(frozen=True)
class FileSums:
    """The block checksums of one data file: ``size`` bytes, ``blocks`` = concatenated 16-digit hex digests;
    ``version``: the store's version of the object as written (its ETag; ``None`` on a local disk)."""

    size: int
    block: int
    blocks: str
    version: str | None = None

    def digest(self, k: int) -> int:
        return int(self.blocks[k * _HEX : (k + 1) * _HEX], 16)


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

    def finish(self, version: str | None = None) -> FileSums:
        """The file's checksums; ``version``: its storage's version of what was written (an ETag, if any)."""
        if self._fill:
            self._hex.append(self._h.hexdigest())
            self._h.reset()
            self._fill = 0
        return FileSums(self.size, self.block, "".join(self._hex), version)


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
            self._files = {rel: FileSums(rec["size"], block, rec["blocks"], rec.get("version"))
                           for rel, rec in manifest["files"].items()}

    def size(self, rel: str) -> int | None:
        """The size the file had when saved (format 2; ``None`` for format 1)."""
        sums = self._files.get(rel)
        return None if sums is None else sums.size

    def version(self, rel: str) -> str | None:
        """The store's version of the file as its save wrote it (an object store's ETag), if recorded."""
        sums = self._files.get(rel)
        return None if sums is None else sums.version

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
        b = sums.block
        return [Block(k * b, min((k + 1) * b, sums.size), sums.digest(k)) for k in block_span(start, end, b)]


# -------------------------------------------------------------------- writing
def encode_manifest(body: dict[str, Any]) -> bytes:
    """A format-3 manifest's bytes: the header line (``TDBMANIFEST``, the body's xxh3-64 and length), then the
    JSON body. :func:`split_header` is its inverse."""
    data = json.dumps(body).encode()
    return b"%s %s %d\n" % (_HEADER, xxhash.xxh3_64(data).hexdigest().encode(), len(data)) + data


def write_manifest(root: Loc | Path, save_id: str, md: Metadata, files: dict[str, FileSums], extra: dict[str, Any],
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
        metadata = (locate(root) / ".metadata").get(MAX_MANIFEST_BYTES)
    body = {
        "format": FORMAT,
        "checksum": "xxh3_64",
        "save_id": save_id,
        "metadata": {"size": len(metadata), "xxh3_64": xxhash.xxh3_64(metadata).hexdigest()},
        "block": blocks.pop() if blocks else BLOCK,
        "files": {rel: {"size": s.size, "blocks": s.blocks, **({"version": s.version} if s.version else {})}
                  for rel, s in sorted(files.items())},
        "items": dict(sorted(items.items())),
        **extra,
    }
    (locate(root) / MANIFEST).put(encode_manifest(body))  # whole or not at all (storage operation 4)


# -------------------------------------------------------------------- reading
def read_manifest(root: Loc | Path) -> dict[str, Any] | None:
    """The manifest of a checkpoint directory, verified and checked for shape, or ``None`` for a plain DCP
    directory (steps 1-3 of the module docstring).

    Raises:
        CorruptCheckpointError: the manifest is not a regular file, too large, damaged or malformed; the
            message names the file.
    """
    p = locate(root) / MANIFEST  # a Path is taken too
    try:
        size = p.size()
    except NotAnObject:
        raise CorruptCheckpointError(f"manifest {p} is not a regular file") from None
    if size is None:
        return None
    if size > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"manifest {p} has {size} bytes, more than the {MAX_MANIFEST_BYTES} allowed")
    data = p.get(MAX_MANIFEST_BYTES + 1)
    return parse_manifest(data, str(p))


def split_header(data: bytes, where: str) -> bytes:
    """The JSON body of a manifest's bytes, its header's length and checksum verified (format 3); legacy plain
    JSON (formats 1 and 2) is returned as is.

    Raises:
        CorruptCheckpointError: no valid header line, a body of another length than the header says, or a body
            whose xxh3-64 differs from the header's; the message names ``where``.
    """
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


def check_file_name(rel: Any, where: str) -> str:
    """``rel`` if it is a plain file name inside the checkpoint directory (no ``/``, no ``..``), else raise
    :class:`~.errors.CorruptCheckpointError` naming ``where``."""
    if not isinstance(rel, str) or not rel or "/" in rel or "\\" in rel or rel in (".", "..") or "\0" in rel:
        raise CorruptCheckpointError(f"{where}: data file name {rel!r} is not a plain file name inside the "
                                     "checkpoint directory")
    return rel


def _type_err(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"manifest {where} is malformed: {what}")


def parse_manifest(data: bytes, where: str) -> dict[str, Any]:
    """A manifest's bytes, header checksum verified (format 3), parsed and checked for shape.

    Raises:
        CorruptCheckpointError: damaged or malformed bytes; the message names ``where``.

    Example::

        >>> parse_manifest(encode_manifest(body), "tdb_manifest.json")["format"]
        3
    """
    body = split_header(data, where)
    try:
        m = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"manifest {where} is corrupt: {type(e).__name__}: {e}") from None
    if not isinstance(m, dict) or m.get("format") not in (1, 2, 3):
        raise _type_err(where, f"unknown format {m.get('format') if isinstance(m, dict) else m!r}")
    if m.get("format") == 3 and data[:1] == b"{":
        raise _type_err(where, "format 3 without its checksummed header")
    if not isinstance(m.get("save_id"), str) or m.get("checksum") != "xxh3_64":
        raise _type_err(where, "save_id or checksum missing")
    if not isinstance(m.get("items"), dict):
        raise _type_err(where, "no items")
    if m["format"] == 3:
        md = m.get("metadata")
        if not (isinstance(md, dict) and type(md.get("size")) is int and isinstance(md.get("xxh3_64"), str)):
            raise _type_err(where, "no .metadata checksum")
    if m["format"] == 1:
        for key, rec in m["items"].items():
            if not (isinstance(rec, dict) and isinstance(rec.get("file"), str)
                    and all(type(rec.get(k)) is int and rec[k] >= 0 for k in ("offset", "length", "digest"))):
                raise _type_err(where, f"item {key!r}: record {rec!r}")
        return m
    block = m.get("block")
    if type(block) is not int or block <= 0 or not isinstance(m.get("files"), dict):
        raise _type_err(where, f"block size {block!r} or file list")
    for rel, rec in m["files"].items():
        check_file_name(rel, f"manifest {where}")
        if not (isinstance(rec, dict) and type(rec.get("size")) is int and rec["size"] >= 0
                and isinstance(rec.get("blocks"), str) and len(rec["blocks"]) == 16 * -(-rec["size"] // block)):
            raise _type_err(where, f"file {rel!r}: record does not match its size")
        if "version" in rec and not (isinstance(rec["version"], str) and 0 < len(rec["version"]) <= 1024):
            raise _type_err(where, f"file {rel!r}: version {str(rec['version'])[:80]!r}")
    return m


def item_record(manifest: dict[str, Any], key: str, where: str) -> tuple[str, int, int] | None:
    """(file, offset, length) of one item of a format-2/3 manifest, checked; ``None`` if absent."""
    rec = manifest["items"].get(key)
    if rec is None:
        return None
    if not (isinstance(rec, dict) and isinstance(rec.get("file"), str)
            and all(type(rec.get(k)) is int and rec[k] >= 0 for k in ("offset", "length"))):
        raise _type_err(where, f"item {key!r}: record {rec!r}")
    return rec["file"], rec["offset"], rec["length"]
