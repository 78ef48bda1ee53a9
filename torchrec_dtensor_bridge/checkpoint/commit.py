"""Atomic commits of a checkpoint directory.

A checkpoint at ``path`` is a symlink to a generation directory next to it,
``.<name>.tdb-<save_id>``. A save writes a new generation (never touching the
committed one), then swaps the link with one ``rename`` — atomic on POSIX. A
save killed at any point leaves ``path`` pointing at the previous generation
(or at nothing, on a first save); the half-written generation is ignored and
reused or removed by the next save. ``path`` reads as an ordinary DCP directory.

Double buffering: by default the generation a commit supersedes is kept as a
spare, and the next save renames it to its own name and rewrites its files in
place. On the disks measured here rewriting existing files is 2-3x faster than
allocating new ones (BENCHMARKS.md); the price is a second generation on disk
between saves (``keep_spare=False`` removes it).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = [
    "CheckpointError",
    "IncompleteCheckpointError",
    "commit",
    "generation_dir",
    "prepare_generation",
    "prune",
    "resolve",
    "sweep",
]

_TAG = ".tdb-"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded as asked (an ``Exception``, unlike DCP's)."""


class IncompleteCheckpointError(CheckpointError):
    """No committed checkpoint exists at the path (never saved, or every save was interrupted)."""


def generation_dir(path: Path, save_id: str) -> Path:
    """Where the generation ``save_id`` of the checkpoint at ``path`` is written."""
    return path.parent / f".{path.name}{_TAG}{save_id}"


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(path: Path, gen: Path) -> Path | None:
    """Point ``path`` at ``gen`` atomically; return the generation it pointed at before."""
    if path.exists() and not path.is_symlink():
        raise CheckpointError(
            f"{path} exists and is not a checkpoint written by torchrec_dtensor_bridge; "
            "refusing to replace it (save to a new path, or migrate it first)"
        )
    previous = path.parent / os.readlink(path) if path.is_symlink() else None
    link = path.parent / f".{path.name}{_TAG}link-{gen.name}"
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(gen.name, link)
    os.replace(link, path)
    _fsync_dir(path.parent)
    return previous


def resolve(path: Path) -> Path:
    """The committed directory behind ``path``; raises if there is none."""
    if path.is_symlink():
        target = path.parent / os.readlink(path)
        if not target.is_dir():
            raise IncompleteCheckpointError(f"{path} points at {target.name}, which is missing")
        return target
    if path.is_dir():
        return path  # a plain DCP directory
    stray = sorted(p.name for p in path.parent.glob(f".{path.name}{_TAG}*")) if path.parent.is_dir() else []
    detail = f"; uncommitted generations {stray} are from interrupted saves" if stray else ""
    raise IncompleteCheckpointError(f"no committed checkpoint at {path}{detail}")


def _generations(path: Path) -> list[Path]:
    return [p for p in path.parent.glob(f".{path.name}{_TAG}*") if p.is_dir() and not p.is_symlink()]


def prepare_generation(path: Path, gen: Path, *, reuse: bool) -> bool:
    """Create ``gen``; with ``reuse``, by renaming an uncommitted generation of ``path``
    (whose files the save then overwrites in place). Returns whether one was reused."""
    current = (path.parent / os.readlink(path)).resolve() if path.is_symlink() else None
    if reuse:
        spares = [p for p in _generations(path) if p.resolve() != current]
        if spares:
            os.rename(max(spares, key=lambda p: p.stat().st_mtime), gen)
            for marker in (".metadata", "tdb_manifest.json"):  # never looks complete while rewritten
                (gen / marker).unlink(missing_ok=True)
            return True
    gen.mkdir()
    return False


def prune(gen: Path, keep: set[str]) -> list[str]:
    """Remove files of a reused generation that the new save did not write."""
    removed = []
    for p in gen.iterdir():
        if p.name not in keep and p.is_file():
            p.unlink()
            removed.append(p.name)
    return removed


def sweep(path: Path, keep: Path | None, spare: Path | None = None) -> list[str]:
    """Remove generations of ``path`` other than ``keep`` and ``spare`` (interrupted or superseded saves)."""
    removed = []
    kept = {p.resolve() for p in (keep, spare) if p is not None}
    for p in path.parent.glob(f".{path.name}{_TAG}*"):
        if p.resolve() in kept and not p.is_symlink():
            continue
        if p.is_symlink() or p.is_file():
            p.unlink(missing_ok=True)
        else:
            shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    return removed
