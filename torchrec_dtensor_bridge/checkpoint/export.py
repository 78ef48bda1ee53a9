"""Export a checkpoint to plain, unsharded tensors in one process: one safetensors or torch file.

For inference or analysis on one machine: no process group, any checkpoint :func:`.api.save` wrote (any
layout, any world size), with bounded memory. Steps of :func:`export`:

1. read what the checkpoint holds (:func:`.inspect.inspect`: its manifest and metadata, verified, no pickle
   run) and pick the tensors whose keys match ``keys`` (glob patterns); objects (non-tensor values) are
   listed as skipped;
2. lay the output file out before any tensor is read: a safetensors header (the format's own: an 8-byte
   little-endian header size, a JSON header with each tensor's dtype, shape and byte range, then the raw
   bytes), or, for torch's format, one scratch file per tensor beside the output;
3. load each tensor with :func:`.api.load` straight into its place in that file (a memory map of it), so
   the checkpoint's checksums are verified as in any load and memory holds at most ``staging_bytes`` of
   verified bytes and the pages the kernel has not yet written back - never a whole table;
4. for torch's format, ``torch.save`` the mapped tensors (their bytes streamed from the scratch files);
5. flush, ``fsync`` and rename into place: ``dst`` appears whole or not at all.

The safetensors file is the format's own layout, written here; torch's DCP reads such files through
``HuggingFaceStorageReader`` (with the ``safetensors`` package installed).
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .api import DEFAULT_STAGING_BYTES, load
from .inspect import inspect
from .common import progress_bar

__all__ = ["FORMATS", "ExportSummary", "export"]

FORMATS = ("safetensors", "torch")

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
"""The dtypes safetensors names (``float8`` and unsigned wider ints are left out: refused by name)."""


@dataclass(frozen=True)
class ExportSummary:
    """What :func:`export` wrote.

    Attributes:
        path: the file written.
        keys: the tensors written, in the file's order.
        bytes: their bytes.
        skipped: keys of the checkpoint left out: objects (non-tensor values).
    """

    path: Path
    keys: list[str]
    bytes: int
    skipped: list[str] = field(default_factory=list)


def export(src: str | Path, dst: str | Path, *, format: str = "safetensors", keys: Sequence[str] | None = None,
           progress: bool = True, staging_bytes: int | None = DEFAULT_STAGING_BYTES) -> ExportSummary:
    """Write the tensors of checkpoint ``src`` to ``dst`` as plain, unsharded tensors, in this process alone.

    Args:
        src: a checkpoint written by :func:`.api.save` (verified as :func:`.api.load` verifies it).
        dst: the file to write (replaced whole if it exists; its directory must exist).
        format: ``"safetensors"`` or ``"torch"`` (a ``torch.save`` file of a ``{key: tensor}`` dict).
        keys: glob patterns (``fnmatch``) of the keys to write; ``None``: every tensor.
        progress: show a progress bar (bytes) on stderr.
        staging_bytes: as for :func:`.api.load`: the most verified bytes held at once.

    Returns:
        What was written.

    Raises:
        ValueError: an unknown ``format``, a pattern of ``keys`` matching no tensor, or a dtype safetensors
            cannot name - before anything is written.
        CheckpointError: as :func:`.api.load` (a damaged or incomplete checkpoint); ``dst`` is then left
            untouched.

    Example::

        >>> tdb.checkpoint.export("/ckpt/step100", "/models/tables.safetensors", keys=["*.weight"])
    """
    if format not in FORMATS:
        raise ValueError(f"export: format must be one of {list(FORMATS)}, got {format!r}")
    src, dst = Path(src), Path(dst)
    described = inspect(src)
    tensors = {k: d for k, d in described.items() if d["type"] == "tensor"}
    chosen = _chosen(tensors, keys)
    specs = {k: (torch.Size(tensors[k]["shape"]), getattr(torch, tensors[k]["dtype"])) for k in chosen}
    if format == "safetensors":
        bad = {k: str(dt) for k, (_, dt) in specs.items() if dt not in _SAFETENSORS_DTYPES}
        if bad:
            raise ValueError(f"export: safetensors cannot name the dtypes of {bad}; use format='torch'")
    skipped = sorted(k for k, d in described.items() if d["type"] != "tensor")
    total = sum(_nbytes(*s) for s in specs.values())
    partial = dst.with_name(f".{dst.name}.partial")
    scratch = dst.with_name(f".{dst.name}.scratch")
    try:
        with progress_bar(total, "export", progress) as bar:
            if format == "safetensors":
                _write_safetensors(src, partial, specs, staging_bytes, bar)
            else:
                _write_torch(src, partial, scratch, specs, staging_bytes, bar)
        _durable_rename(partial, dst)
    finally:
        partial.unlink(missing_ok=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return ExportSummary(dst, list(chosen), total, skipped)


def _chosen(tensors: dict[str, dict[str, Any]], keys: Sequence[str] | None) -> list[str]:
    """The keys of ``tensors`` matching any of the patterns ``keys`` (all of them for ``None``), in order."""
    if keys is None:
        return sorted(tensors)
    if isinstance(keys, str):
        keys = [keys]
    unmatched = [p for p in keys if not any(fnmatch.fnmatchcase(k, p) for k in tensors)]
    if unmatched:
        raise ValueError(f"export: keys {unmatched} match no tensor of the checkpoint; it holds "
                         f"{sorted(tensors)[:20]}{' ...' if len(tensors) > 20 else ''}")
    return sorted(k for k in tensors if any(fnmatch.fnmatchcase(k, p) for p in keys))


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return shape.numel() * torch.empty(0, dtype=dtype).element_size()


def _mapped(path: Path, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` whose bytes are ``path``'s at ``offset`` (a writable memory map)."""
    n = _nbytes(shape, dtype)
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    raw = np.memmap(path, dtype=np.uint8, mode="r+", offset=offset, shape=(n,))
    return torch.from_numpy(raw).view(dtype).view(shape)


def _load_into(src: Path, key: str, target: torch.Tensor, staging_bytes: int | None, bar: Any) -> None:
    load({key: target}, src, staging_bytes=staging_bytes)
    bar.update(target.numel() * target.element_size())


def _write_safetensors(src: Path, out: Path, specs: dict[str, tuple[torch.Size, torch.dtype]],
                       staging_bytes: int | None, bar: Any) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for key, (shape, dtype) in specs.items():
        n = _nbytes(shape, dtype)
        header[key] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    start = 8 + len(text)
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.truncate(start + at)
    for key, (shape, dtype) in specs.items():
        begin = header[key]["data_offsets"][0]
        _load_into(src, key, _mapped(out, start + begin, shape, dtype), staging_bytes, bar)


def _write_torch(src: Path, out: Path, scratch: Path, specs: dict[str, tuple[torch.Size, torch.dtype]],
                 staging_bytes: int | None, bar: Any) -> None:
    scratch.mkdir(exist_ok=True)
    tensors = {}
    for i, (key, (shape, dtype)) in enumerate(specs.items()):
        path = scratch / f"{i}.bin"
        with open(path, "wb") as f:
            f.truncate(_nbytes(shape, dtype))
        tensors[key] = _mapped(path, 0, shape, dtype)
        _load_into(src, key, tensors[key], staging_bytes, bar)
    torch.save(tensors, out)


def _durable_rename(partial: Path, dst: Path) -> None:
    """``partial`` on disk (``fsync`` writes back the pages written through its memory maps too), then renamed
    to ``dst`` and the rename made durable."""
    with open(partial, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(partial, dst)
    fd = os.open(dst.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
