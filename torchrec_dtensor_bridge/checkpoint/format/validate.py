"""Reading a checkpoint's ``.metadata`` as untrusted input: bounded, verified, parsed without running code.

``.metadata`` is a pickle (DCP's format). :func:`read_metadata` reads it as
hostile bytes, in order:

1. its size is checked before anything is read (:data:`MAX_METADATA_BYTES`),
   and against the size the manifest recorded at commit (format 3);
2. its xxh3-64 is verified against the manifest's before it is parsed (the
   manifest itself was verified by :func:`~.manifest.read_manifest`);
3. it is unpickled by :class:`MetadataUnpickler`, which resolves only DCP's
   metadata classes, ``torch.Size``, dtypes, layouts, memory formats and
   paths — no other global, so no checkpoint runs code;
4. the parsed records are checked for shape (:func:`parse_metadata`): types,
   non-negative integers, plain file names (no ``/``, no ``..``), every chunk
   in bounds, and the chunks of every tensor tiling it exactly (no gap, no
   overlap: :func:`check_tiling`).

Every failure is a :class:`~.errors.CorruptCheckpointError` naming the file
and, where there is one, the key.

Example::

    >>> md = parse_metadata(data, "/ckpt/.ck.tdb-1/.metadata")
"""

from __future__ import annotations

import io
import pathlib
import pickle
from math import prod
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..._compat import DcpMemFormat, DcpStorageInfo
from ..errors import CorruptCheckpointError
from .manifest import check_file_name
from ..storage import Loc, NotAnObject, locate

__all__ = [
    "MAX_METADATA_BYTES",
    "MetadataUnpickler",
    "check_tiling",
    "parse_metadata",
    "read_metadata",
]

MAX_METADATA_BYTES = 1 << 30
"""Larger ``.metadata`` files are refused before being read (a 1 TiB checkpoint's is tens of MB)."""
_MAX_DIMS = 64

_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.metadata", c.__name__): c
    for c in (Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata, ChunkStorageMetadata,
              BytesStorageMetadata)
}
_ALLOWED[("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")] = DcpMemFormat
_ALLOWED[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = DcpStorageInfo
_ALLOWED[("torch", "Size")] = torch.Size
_ALLOWED[("pathlib", "PosixPath")] = pathlib.PurePosixPath  # a path is data: never touches the file system
_ALLOWED[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath
_ALLOWED[("collections", "OrderedDict")] = dict


def _layout(name: Any) -> torch.layout:
    short = name.removeprefix("torch.") if isinstance(name, str) else None
    value = getattr(torch, short, None) if short else None
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return value


_ALLOWED[("torch.serialization", "_get_layout")] = _layout


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``; resolves only the allow-listed globals above and torch dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which a checkpoint's metadata may not use")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("holds a persistent id, which a checkpoint's metadata may not use")


def read_metadata(root: Loc | pathlib.Path, manifest: dict[str, Any] | None) -> Metadata:
    """``root/.metadata``: size bounded, checksum verified (when the manifest records it), parsed safely."""
    p = locate(root) / ".metadata"  # a Path is taken too
    try:
        size = p.size()
    except NotAnObject:
        size = None
    if size is None:
        raise CorruptCheckpointError(f"{p} is missing or not a regular file")
    want = manifest.get("metadata") if manifest is not None else None
    if want is not None and size != want["size"]:
        raise CorruptCheckpointError(f"{p} has {size} bytes, the manifest recorded {want['size']} "
                                     "(truncated, replaced or from another save)")
    if size > MAX_METADATA_BYTES:
        raise CorruptCheckpointError(f"{p} has {size} bytes, more than the {MAX_METADATA_BYTES} allowed")
    try:
        data = p.get(MAX_METADATA_BYTES + 1)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{p} is missing") from None
    if want is not None:
        got = xxhash.xxh3_64(data).hexdigest()
        if got != want["xxh3_64"]:
            raise CorruptCheckpointError(f"{p} is corrupt or from another save: its checksum is {got}, the "
                                         f"manifest says {want['xxh3_64']}")
    return parse_metadata(data, str(p))


def parse_metadata(data: bytes, where: str) -> Metadata:
    """Unpickle ``.metadata`` bytes with :class:`MetadataUnpickler` and check every record; raises
    :class:`~.errors.CorruptCheckpointError` naming ``where`` and the key."""
    try:
        md = MetadataUnpickler(io.BytesIO(data)).load()
    except (Exception, RecursionError) as e:  # any parse failure: damaged or hostile bytes
        raise CorruptCheckpointError(f"{where} cannot be read ({type(e).__name__}: {e})") from None
    _check_metadata(md, where)
    return md


def _ints(v: Any, n: int | None, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(v, (torch.Size, tuple, list)) or not all(type(x) is int and x >= 0 for x in v):
        raise CorruptCheckpointError(f"{where}: {what} {v!r} is not a list of non-negative integers")
    if n is not None and len(v) != n:
        raise CorruptCheckpointError(f"{where}: {what} {list(v)} has {len(v)} values, expected {n}")
    return tuple(v)


def _check_metadata(md: Any, where: str) -> None:
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise CorruptCheckpointError(f"{where} does not hold DCP metadata (got {type(md).__name__})")
    if md.storage_meta is not None and not isinstance(md.storage_meta, StorageMeta):
        raise CorruptCheckpointError(f"{where}: storage_meta is a {type(md.storage_meta).__name__}")
    storage = md.storage_data
    if not isinstance(storage, dict):
        raise CorruptCheckpointError(f"{where}: storage_data is a {type(storage).__name__}, not a dict")
    for idx, info in storage.items():
        if not isinstance(idx, MetadataIndex) or not isinstance(info, DcpStorageInfo):
            raise CorruptCheckpointError(f"{where}: storage_data holds {type(idx).__name__} -> {type(info).__name__}")
        who = f"{where}: key {idx.fqn!r}"
        check_file_name(info.relative_path, who)
        if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0:
            raise CorruptCheckpointError(f"{who}: offset {info.offset!r} and length {info.length!r} are not "
                                         "non-negative integers")
    for fqn, m in md.state_dict_metadata.items():
        who = f"{where}: key {fqn!r}"
        if not isinstance(fqn, str):
            raise CorruptCheckpointError(f"{where}: key {fqn!r} is not a string")
        if isinstance(m, BytesStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                raise CorruptCheckpointError(f"{who}: the object has no storage record")
            continue
        if not isinstance(m, TensorStorageMetadata) or not isinstance(m.properties, TensorProperties):
            raise CorruptCheckpointError(f"{who}: record is a {type(m).__name__}")
        if not isinstance(m.properties.dtype, torch.dtype):
            raise CorruptCheckpointError(f"{who}: dtype {m.properties.dtype!r} is not a torch dtype")
        size = _ints(m.size, None, "shape", who)
        if len(size) > _MAX_DIMS or not isinstance(m.chunks, list):
            raise CorruptCheckpointError(f"{who}: shape {list(size)} or chunk list is malformed")
        chunks = []
        for c in m.chunks:
            if not isinstance(c, ChunkStorageMetadata):
                raise CorruptCheckpointError(f"{who}: chunk record is a {type(c).__name__}")
            o, s = _ints(c.offsets, len(size), "chunk offsets", who), _ints(c.sizes, len(size), "chunk sizes", who)
            idx = MetadataIndex(fqn, o)
            if idx not in storage:
                raise CorruptCheckpointError(f"{who}: chunk at offsets {list(o)} has no storage record")
            chunks.append((o, s))
        check_tiling(size, chunks, who)


def check_tiling(size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]], where: str) -> None:
    """Raise unless the ``(offsets, sizes)`` chunks lie inside ``size`` and tile it exactly (no gap, no overlap)."""
    for o, s in chunks:
        if any(a + b > g for a, b, g in zip(o, s, size)):
            raise CorruptCheckpointError(f"{where}: chunk at offsets {list(o)} with sizes {list(s)} lies outside "
                                         f"the tensor's shape {list(size)}")
    if not size:
        if len(chunks) != 1:
            raise CorruptCheckpointError(f"{where}: a 0-d tensor has {len(chunks)} chunks, expected 1")
        return
    full = [(o, s) for o, s in chunks if prod(s)]
    covered = sum(prod(s) for _, s in full)
    if covered != prod(size):
        raise CorruptCheckpointError(f"{where}: chunks cover {covered} of {prod(size)} elements of shape "
                                     f"{list(size)} (a gap or an overlap)")
    full.sort(key=lambda c: c[0][0])
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for o, s in full:  # sweep along dim 0: only chunks whose row ranges meet are compared
        active = [c for c in active if c[0][0] + c[1][0] > o[0]]
        for ao, as_ in active:
            if all(a < b + bs and b < a + s_ for a, s_, b, bs in zip(o, s, ao, as_)):
                raise CorruptCheckpointError(f"{where}: chunks at offsets {list(ao)} and {list(o)} overlap")
        active.append((o, s))
