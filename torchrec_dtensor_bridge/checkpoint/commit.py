"""Atomic commits of a checkpoint directory.

A checkpoint at ``path`` is a symlink to a generation directory next to it,
``.<name>.tdb-<save_id>``. A save writes a fresh generation (never touching the
committed one), then swaps the link with one ``rename`` — atomic on POSIX. A
save killed at any point leaves ``path`` pointing at the previous generation
(or at nothing, on a first save); the half-written generation is ignored and
removed by the next save. ``path`` reads as an ordinary DCP directory.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["CheckpointError", "IncompleteCheckpointError", "commit", "generation_dir", "resolve", "sweep"]

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


def sweep(path: Path, keep: Path | None) -> list[str]:
    """Remove generations of ``path`` other than ``keep`` (interrupted or superseded saves)."""
    removed = []
    for p in path.parent.glob(f".{path.name}{_TAG}*"):
        if keep is not None and p.resolve() == keep.resolve():
            continue
        if p.is_symlink() or p.is_file():
            p.unlink(missing_ok=True)
        else:
            shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    return removed
