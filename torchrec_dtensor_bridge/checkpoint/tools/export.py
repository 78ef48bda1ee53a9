"""Export a checkpoint to plain, unsharded tensors in one process: one safetensors or torch file.

For inference or analysis on one machine: no process group, any checkpoint :func:`.api.save` wrote (any
layout, any world size), with bounded memory. Steps of :func:`export`:

1. read what the checkpoint holds (:func:`.inspect.inspect`: its manifest and metadata, verified, no pickle
   run) and pick the tensors whose keys match ``keys`` (glob patterns); objects (non-tensor values) are
   listed as skipped;
2. lay the output file out before any tensor is read: a safetensors header (the format's own: an 8-byte
   little-endian header size, a JSON header with each tensor's dtype, shape and byte range, then the raw
   bytes), or, for torch's format, one scratch file per tensor beside the output;
3. load each tensor a run of rows at a time into one buffer of at most ``buffer_bytes`` (a shards wrapper
   holding those rows: :func:`.api.load` reads and verifies only the blocks they need, as any resharded
   load does) and write the rows at their place in the file: memory holds the buffer and ``load``'s
   ``staging_bytes``, never a whole table;
4. for torch's format, ``torch.save`` the scratch files' tensors (memory-mapped: their bytes go from the
   page cache to the file; the memory bound is safetensors');
5. ``fsync`` and rename into place: ``dst`` appears whole or not at all.

The safetensors file is the format's own layout, written here; torch's DCP reads such files through
``HuggingFaceStorageReader`` (with the ``safetensors`` package installed).
"""

from __future__ import annotations

import fnmatch
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ...wrapper import LocalShardsWrapper
from ..api import DEFAULT_STAGING_BYTES, load
from .inspect import inspect
from ..common import progress_bar
from ..storage import Loc, locate
from ..storage.local import Scratch

__all__ = ["DEFAULT_BUFFER_BYTES", "FORMATS", "ExportSummary", "export"]

FORMATS = ("safetensors", "torch")
DEFAULT_BUFFER_BYTES = 64 << 20
"""Default ``export(..., buffer_bytes=)``: the rows of a table read at once."""

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
           progress: bool = True, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
           staging_bytes: int | None = DEFAULT_STAGING_BYTES,
           storage_options: Mapping[str, Any] | None = None) -> ExportSummary:
    """Write the tensors of checkpoint ``src`` to ``dst`` as plain, unsharded tensors, in this process alone.

    Args:
        src: a checkpoint written by :func:`.api.save` (verified as :func:`.api.load` verifies it).
        dst: the file to write (replaced whole if it exists; its directory must exist).
        format: ``"safetensors"`` or ``"torch"`` (a ``torch.save`` file of a ``{key: tensor}`` dict).
        keys: glob patterns (``fnmatch``) of the keys to write; ``None``: every tensor.
        progress: show a progress bar (bytes) on stderr.
        buffer_bytes: the rows read at once (one row at least).
        staging_bytes: as for :func:`.api.load`: the most verified bytes held at once.
        storage_options: for ``s3://`` URLs (``src``, and ``dst`` in safetensors format), as for
            :func:`.api.save`.

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
    if not isinstance(buffer_bytes, int) or buffer_bytes < 1:
        raise ValueError(f"export: buffer_bytes must be a positive int, got {buffer_bytes!r}")
    src_loc, out = locate(src, storage_options), locate(dst, storage_options)
    described = inspect(src_loc)
    tensors = {k: d for k, d in described.items() if d["type"] == "tensor"}
    chosen = _chosen(tensors, keys)
    specs = {k: (torch.Size(tensors[k]["shape"]), getattr(torch, tensors[k]["dtype"])) for k in chosen}
    if format == "safetensors":
        bad = {k: str(dt) for k, (_, dt) in specs.items() if dt not in _SAFETENSORS_DTYPES}
        if bad:
            raise ValueError(f"export: safetensors cannot name the dtypes of {bad}; use format='torch'")
    elif not out.local:
        raise ValueError(f"export: format='torch' writes local files only (it maps its scratch in memory), not "
                         f"{out}; export format='safetensors' there, or to a local path")
    skipped = sorted(k for k, d in described.items() if d["type"] != "tensor")
    total = sum(_nbytes(*s) for s in specs.values())
    # on disk: written beside ``dst`` and renamed over it once whole; an object store shows it once whole
    partial = out.parent / f".{out.name}.partial" if out.local else out
    try:
        with progress_bar(total, "export", progress) as bar:
            copy = _Copy(src_loc, buffer_bytes, staging_bytes, bar)
            if format == "safetensors":
                _write_safetensors(copy, partial, specs)
            else:
                with Scratch(out.parent / f".{out.name}.scratch") as scratch:
                    _write_torch(copy, partial, scratch, specs)
        if partial != out:
            partial.rename(out)
    finally:
        if partial != out:
            partial.delete()
    return ExportSummary(Path(out.key) if out.local else str(out), list(chosen), total, skipped)  # type: ignore[arg-type]


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


@dataclass(frozen=True)
class _Copy:
    """Copies tensors of checkpoint ``src`` into a stream, a run of rows at a time (module docstring, step 3)."""

    src: Loc
    buffer_bytes: int
    staging_bytes: int | None
    bar: Any

    def into(self, f: BinaryIO, key: str, shape: torch.Size, dtype: torch.dtype) -> None:
        """Append ``key``'s bytes (row-major) to ``f``."""
        if len(shape) == 0:  # a scalar: one value
            value = torch.empty((), dtype=dtype)
            load({key: value}, self.src, staging_bytes=self.staging_bytes)
            self._write(f, value.reshape(1))
            return
        per_row = _nbytes(shape[1:], dtype)
        step = max(1, self.buffer_bytes // max(per_row, 1))
        buf = torch.empty((min(step, shape[0]), *shape[1:]), dtype=dtype)
        for r0 in range(0, shape[0], step):
            rows = buf[: min(step, shape[0] - r0)]
            offsets = (r0,) + (0,) * (len(shape) - 1)
            load({key: LocalShardsWrapper([rows], [offsets], tuple(shape))}, self.src, staging_bytes=self.staging_bytes)
            self._write(f, rows)

    def _write(self, f: BinaryIO, values: torch.Tensor) -> None:
        f.write(values.reshape(-1).view(torch.uint8).numpy().data)  # no copy
        self.bar.update(values.numel() * values.element_size())


def _write_safetensors(copy: _Copy, out: Loc, specs: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for key, (shape, dtype) in specs.items():
        n = _nbytes(shape, dtype)
        header[key] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with out.create() as f:  # written from its start: the header, then each tensor's rows in order
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for key, (shape, dtype) in specs.items():
            copy.into(f, key, shape, dtype)


def _write_torch(copy: _Copy, out: Loc, scratch: Scratch, specs: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
    tensors = {}
    for i, (key, (shape, dtype)) in enumerate(specs.items()):
        n = _nbytes(shape, dtype)
        with scratch.create(f"{i}.bin") as f:
            copy.into(f, key, shape, dtype)
        tensors[key] = torch.empty(shape, dtype=dtype) if n == 0 else torch.from_numpy(
            scratch.mapped(f"{i}.bin", n)).view(dtype).view(shape)  # copy-on-write: bounded memory
    with out.create() as f:
        torch.save(tensors, f)
