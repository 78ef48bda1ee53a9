"""The byte layout of one tensor saved by ``torch.save``, read without unpickling arbitrary code.

DCP stores every tensor chunk as a ``torch.save`` zip. A ranged read needs to
know where the chunk's elements start inside that zip and that they are a
plain contiguous array: :func:`parse_layout` reads the small ``data.pkl``
record with :class:`TensorRecordUnpickler` (it records the arguments of
``_rebuild_tensor_v2`` and resolves no other global) and the storage
member's local zip header. Anything unusual raises :class:`Unreadable`, and
the caller falls back to ``torch.load`` of the whole item.

Our saves write these zips without their CRC-32s (:func:`without_zip_crc`):
every byte is covered by the manifest's block checksums, which a load verifies
(:mod:`.verified`), and a CRC-32 of every record cost the save a third of its
CPU time on a local disk (BENCHMARKS.md). ``torch.load`` and DCP's own reader
load such zips (``torch.serialization.set_crc32_options``); :func:`parse_layout`
reads the records itself, so a zip with or without them parses the same.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from math import prod
from typing import Any, BinaryIO

import torch
import torch.serialization

__all__ = ["SavedLayout", "StorageRef", "TensorRecord", "TensorRecordUnpickler", "Unreadable", "parse_layout",
           "without_zip_crc"]

_STORAGE_DTYPES = {
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}
_LOCAL_HEADER = struct.Struct("<4s22sHH")  # signature, fixed fields, file name length, extra field length


class Unreadable(Exception):
    """The bytes are fine but not in the layout the ranged path understands: read the whole item."""


# ------------------------------------------------------------ writing without CRC-32s
_NO_CRC = threading.local()
_hook_lock = threading.Lock()


def _install_hook() -> None:
    """Make ``torch.save`` skip its CRC-32s on a thread inside :func:`without_zip_crc`, and only there.

    torch reads the choice from ``torch.serialization.get_crc32_options()`` (a process-wide setting, its
    public ``set_crc32_options``) each time it opens a zip writer; this wraps that function once, so that
    every other thread, and this one outside the context, gets torch's setting unchanged. The one use of
    torch's internals for it."""
    with _hook_lock:
        current = torch.serialization.get_crc32_options
        if getattr(current, "_tdb_hook", False):
            return

        def get_crc32_options() -> bool:
            return False if getattr(_NO_CRC, "depth", 0) else current()

        get_crc32_options._tdb_hook = True  # type: ignore[attr-defined]
        torch.serialization.get_crc32_options = get_crc32_options


@contextmanager
def without_zip_crc() -> Iterator[None]:
    """``torch.save`` calls on this thread inside the context write zips without CRC-32s (see the module
    docstring); nesting is allowed, other threads are unaffected."""
    _install_hook()
    _NO_CRC.depth = getattr(_NO_CRC, "depth", 0) + 1
    try:
        yield
    finally:
        _NO_CRC.depth -= 1


# ------------------------------------------------------------ data.pkl, restricted
@dataclass(frozen=True)
class StorageRef:
    dtype: torch.dtype
    key: str
    numel: int


@dataclass(frozen=True)
class TensorRecord:
    storage: StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype


def _record_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> TensorRecord:
    if not isinstance(storage, StorageRef) or not isinstance(storage_offset, int) or len(rest) > 3:
        raise Unreadable("unexpected _rebuild_tensor_v2 arguments")
    return TensorRecord(storage, storage_offset, tuple(size), tuple(stride))


class TensorRecordUnpickler(pickle.Unpickler):
    """Reads a ``torch.save`` of one dense tensor into a :class:`TensorRecord`; resolves no other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _record_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        raise Unreadable(f"data.pkl refers to {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise Unreadable(f"unexpected persistent id {pid!r}")
        return StorageRef(pid[1].dtype, str(pid[2]), int(pid[4]))


def _contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    want = 1
    for n, s in reversed(list(zip(size, stride))):
        if n != 1 and s != want:
            return False
        want *= n
    return True


@dataclass(frozen=True)
class SavedLayout:
    """Where a saved contiguous tensor's elements start inside its item, and its shape."""

    data_start: int
    dtype: torch.dtype
    size: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return prod(self.size[1:]) * self.dtype.itemsize


def _data_start(view: io.RawIOBase | BinaryIO, info: zipfile.ZipInfo) -> int:
    """Where the bytes of the stored (uncompressed) member ``info`` start: after its local header."""
    view.seek(info.header_offset)
    sig, _, name_len, extra_len = _LOCAL_HEADER.unpack(view.read(_LOCAL_HEADER.size))
    if sig != b"PK\x03\x04":
        raise Unreadable("bad local header")
    return info.header_offset + _LOCAL_HEADER.size + name_len + extra_len


def _stored(zf: zipfile.ZipFile, view: io.RawIOBase | BinaryIO, name: str, limit: int) -> bytes:
    """A small stored member's bytes, read at its place (whatever its CRC-32 field says: the block checksums
    cover them)."""
    info = zf.getinfo(name)
    if info.compress_type != zipfile.ZIP_STORED or info.file_size > limit:
        raise Unreadable(f"{name}: compressed or larger than {limit} bytes")
    view.seek(_data_start(view, info))
    data = view.read(info.file_size)
    if data is None or len(data) != info.file_size:
        raise Unreadable(f"{name}: truncated")
    return bytes(data)


def parse_layout(view: io.RawIOBase | BinaryIO, dtype: torch.dtype, size: tuple[int, ...]) -> SavedLayout:
    """The layout of the tensor stored in the ``torch.save`` zip ``view`` (a seekable binary file); raises
    :class:`Unreadable` if unusual."""
    if sys.byteorder != "little":
        raise Unreadable("big-endian host")
    try:
        zf = zipfile.ZipFile(view)
        names = zf.namelist()
        pkl = [n for n in names if n == "data.pkl" or n.endswith("/data.pkl")]
        if len(pkl) != 1:
            raise Unreadable("no single data.pkl")
        prefix = pkl[0][: -len("data.pkl")]
        if prefix + "byteorder" in names and _stored(zf, view, prefix + "byteorder", 16) != b"little":
            raise Unreadable("not little-endian")
        rec = TensorRecordUnpickler(io.BytesIO(_stored(zf, view, pkl[0], 1 << 20))).load()
        if not isinstance(rec, TensorRecord):
            raise Unreadable("data.pkl holds no single tensor")
        info = zf.getinfo(f"{prefix}data/{rec.storage.key}")
    except (zipfile.BadZipFile, pickle.UnpicklingError, KeyError, ValueError, EOFError, TypeError) as e:
        raise Unreadable(str(e)) from None
    es = rec.storage.dtype.itemsize
    if (
        rec.storage.dtype != dtype
        or rec.size != size
        or not _contiguous(rec.size, rec.stride)
        or rec.storage_offset < 0
        or rec.storage_offset + prod(size) > rec.storage.numel
        or info.compress_type != zipfile.ZIP_STORED
        or info.file_size != rec.storage.numel * es
    ):
        raise Unreadable("not a contiguous tensor of the chunk's dtype and shape")
    return SavedLayout(_data_start(view, info) + rec.storage_offset * es, dtype, size)
