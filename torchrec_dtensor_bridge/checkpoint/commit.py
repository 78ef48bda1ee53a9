"""Atomic commits of a checkpoint directory, and the locks that keep savers and readers apart.

A checkpoint at ``path`` is a symlink to a generation directory next to it,
``.<name>.tdb-<save_id>``. A save writes a new generation (never touching the
committed one), then swaps the link with one ``rename`` — atomic on POSIX. A
save killed at any point leaves ``path`` pointing at the previous generation
(or at nothing, on a first save); the half-written generation is ignored and
reused or removed by the next save. ``path`` reads as an ordinary DCP directory.

Double buffering: by default the generation a commit supersedes is kept as a
spare, and the next save renames it to its own name and rewrites its files in
place. Rewriting existing files is faster than allocating new ones (BENCHMARKS.md,
"Checkpoints"); the price is a second generation on disk
between saves (``keep_spare=False`` removes it).

Locks (``flock``: the kernel drops them when their holder dies, so a killed
process never leaves one stuck):

* one save at a time per path: rank 0 of a save holds ``.<name>.tdb_lock``
  exclusively; a second save raises :class:`~.errors.CheckpointBusyError` at once;
* readers hold a shared lock on the generation directory they read; a save
  reuses a spare, and a save removes an old generation, only under an
  exclusive lock it gets without waiting — a generation being read is never
  rewritten nor removed (the save takes a fresh directory instead, and the
  next save removes it). A reader that finds its generation renamed or
  locked resolves the link again.

A save calls, in order (rank 0; :func:`~.api.save` runs the collective parts):

1. :class:`SaveLock` on ``path``;
2. :func:`prepare_generation`: a fresh generation, or a spare renamed to it;
3. (every rank writes its files into the generation), then :func:`prune`
   removes a reused spare's files the new save did not write;
4. (the manifest is written into the generation), then :func:`commit` swaps
   ``path`` to it: the commit point;
5. :func:`sweep`: older and interrupted generations removed, the spare kept.

A reader calls :func:`committed_name` then :func:`lock_generation` (again, if
that returns ``None``). :func:`committed_name` also tells a path that holds no
checkpoint of any kind (:class:`~.errors.NotACheckpointError`) from one where
nothing was committed yet (:class:`~.errors.IncompleteCheckpointError`).

Names are never used as patterns: generations are found by prefix on the
directory listing, so ``run[1]`` and ``run1`` never see each other's files.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from pathlib import Path

from .errors import CheckpointBusyError, CheckpointError, IncompleteCheckpointError, NotACheckpointError
from .manifest import MANIFEST

__all__ = [
    "DirLock",
    "SaveLock",
    "commit",
    "committed_name",
    "generation_dir",
    "generations",
    "lock_generation",
    "prepare_generation",
    "prune",
    "remove_generation",
    "resolve",
    "sweep",
    "writable_parent",
]

_TAG = ".tdb-"
_LOCK = ".tdb_lock"
_SHOWN = 5  # entries of a directory that is not a checkpoint named in the message

_EXPECTED = ("expected a checkpoint written by tdb.checkpoint.save (a link to a generation directory holding "
             f".metadata and {MANIFEST}) or a plain DCP directory holding .metadata (written by "
             "torch.distributed.checkpoint.save)")  # what a checkpoint path must hold, as messages say it


def generation_dir(path: Path, save_id: str) -> Path:
    """Where the generation ``save_id`` of the checkpoint at ``path`` is written."""
    return path.parent / f".{path.name}{_TAG}{save_id}"


def _is_ours(path: Path, p: Path) -> bool:
    return p.name.startswith(f".{path.name}{_TAG}")


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DirLock:
    """An ``flock`` on a directory (or file) taken without waiting; ``held`` says whether it was granted."""

    def __init__(self, target: Path, *, exclusive: bool, create: bool = False) -> None:
        self.target = target
        flags = os.O_RDWR | os.O_CREAT if create else os.O_RDONLY
        self._fd: int | None = os.open(target, flags, 0o644)
        try:
            fcntl.flock(self._fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            self.held = True
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                self.release()
                raise
            self.held = False

    def same_inode_as(self, p: Path) -> bool:
        """Whether ``p`` still names the locked directory (not renamed, removed or replaced)."""
        try:
            return self._fd is not None and os.stat(p).st_ino == os.fstat(self._fd).st_ino
        except OSError:
            return False

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock
            self._fd = None


class SaveLock(DirLock):
    """Held by rank 0 for a save's duration; raises :class:`CheckpointBusyError` if another save holds it."""

    def __init__(self, path: Path) -> None:
        lock = path.parent / f".{path.name}{_LOCK}"
        super().__init__(lock, exclusive=True, create=True)
        if not self.held:
            self.release()
            raise CheckpointBusyError(
                f"another save to {path} is in progress (it holds {lock.name}); two jobs cannot save to one path"
            )


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


def committed_name(path: Path) -> str:
    """The name of the generation ``path`` links to, ``""`` for a plain DCP directory; raises if none.

    Raises:
        IncompleteCheckpointError: nothing was committed at ``path``: it does not exist, its link names a
            generation that is gone, or it holds DCP data files without ``.metadata`` (an unfinished DCP save).
        NotACheckpointError: ``path`` is a file, or a directory with neither ``.metadata`` nor a manifest.
        CheckpointError: ``path`` links to something that is not one of its generations.
    """
    if path.is_symlink():
        target = os.readlink(path)
        if "/" in target or not _is_ours(path, path.parent / target):
            raise CheckpointError(f"{path} links to {target!r}, which is not one of its generations")
        if not (path.parent / target).is_dir():
            raise IncompleteCheckpointError(f"{path} points at {target}, which is missing")
        return target
    if path.is_dir():
        _check_plain_directory(path)
        return ""
    if path.exists():
        raise NotACheckpointError(f"{path} is not a checkpoint: it is a file, not a directory; {_EXPECTED}")
    stray = sorted(p.name for p in generations(path)) if path.parent.is_dir() else []
    detail = f"; uncommitted generations {stray} are from interrupted saves" if stray else ""
    raise IncompleteCheckpointError(f"no committed checkpoint at {path}{detail}")


def _check_plain_directory(path: Path) -> None:
    """Raise unless the directory ``path`` holds ``.metadata`` or a manifest (whether they are sound is the
    reader's to check: a damaged one is a corrupt checkpoint, not a missing one)."""
    names = sorted(os.listdir(path))
    if ".metadata" in names or MANIFEST in names:
        return
    data = [n for n in names if n.endswith(".distcp")]
    if data:
        raise IncompleteCheckpointError(
            f"{path} holds DCP data files ({_some(data)}) but no .metadata: a torch.distributed.checkpoint.save "
            "that did not finish (DCP writes .metadata last)"
        )
    holds = "is empty" if not names else f"holds only {_some(names)}"
    inside = [n for n in names if _is_checkpoint_link(path / n)]
    hint = f"; it holds the checkpoints {_some(inside)}: pass one of those paths" if inside else ""
    raise NotACheckpointError(f"{path} is not a checkpoint: the directory {holds}; {_EXPECTED}{hint}")


def _is_checkpoint_link(p: Path) -> bool:
    """Whether ``p`` is the link of a checkpoint written by a save (it names one of its own generations)."""
    try:
        return p.is_symlink() and _is_ours(p, p.parent / os.readlink(p))
    except OSError:
        return False


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown if len(names) <= _SHOWN else f"{shown} and {len(names) - _SHOWN} more"


def writable_parent(path: Path) -> None:
    """Raise ``NotADirectoryError`` if an existing ancestor of ``path`` is not a directory; writes nothing.

    The directories above ``path`` that do not exist yet are created by the save; one that exists as a regular
    file (or a link to one, or a broken link) would make that fail with a bare ``EEXIST``.

    Example::

        >>> writable_parent(Path("/ckpt/notes.txt/step100"))
        Traceback (most recent call last):
        NotADirectoryError: cannot save to /ckpt/notes.txt/step100: /ckpt/notes.txt is a file, not a directory ...
    """
    for parent in path.parents:
        if parent.is_dir():
            return
        if parent.exists() or parent.is_symlink():
            what = "a file" if parent.exists() else "a broken symbolic link"
            raise NotADirectoryError(
                f"cannot save to {path}: {parent} is {what}, not a directory (a checkpoint's parent directories "
                "must be directories, or not exist yet: they are created); choose another path, or move "
                f"{parent} away"
            )


def resolve(path: Path) -> Path:
    """The committed directory behind ``path``; raises if there is none."""
    name = committed_name(path)
    return path.parent / name if name else path


def lock_generation(path: Path, name: str) -> DirLock | None:
    """A shared lock on the generation ``name`` of ``path`` (``""``: ``path`` itself, a plain DCP directory),
    or ``None`` if it was renamed, removed or is being rewritten (resolve the link again)."""
    root = path.parent / name if name else path
    try:
        lock = DirLock(root, exclusive=False)
    except FileNotFoundError:
        return None
    if not lock.held or not lock.same_inode_as(root):
        lock.release()
        return None
    return lock


def generations(path: Path) -> list[Path]:
    """Generation directories and leftover links of ``path`` (matched by prefix, never as a pattern)."""
    return [p for p in path.parent.iterdir() if _is_ours(path, p)]


def _dirs(path: Path) -> list[Path]:
    return [p for p in generations(path) if p.is_dir() and not p.is_symlink()]


def prepare_generation(path: Path, gen: Path, *, reuse: bool) -> tuple[bool, DirLock]:
    """Create ``gen`` and hold it exclusively; with ``reuse``, by renaming an uncommitted generation of
    ``path`` that no reader holds (the save then overwrites its files in place). Returns whether one was
    reused, and the lock (release it after the commit)."""
    current = (path.parent / os.readlink(path)).resolve() if path.is_symlink() else None
    if reuse:
        spares = sorted((p for p in _dirs(path) if p.resolve() != current), key=lambda p: -p.stat().st_mtime)
        for spare in spares:
            lock = DirLock(spare, exclusive=True)
            if not lock.held or not lock.same_inode_as(spare):
                lock.release()
                continue  # a reader holds it: leave it alone
            os.rename(spare, gen)
            for marker in (".metadata", "tdb_manifest.json"):  # never looks complete while rewritten
                (gen / marker).unlink(missing_ok=True)
            return True, lock
    gen.mkdir()
    return False, DirLock(gen, exclusive=True)


def prune(gen: Path, keep: set[str]) -> list[str]:
    """Remove files of a reused generation that the new save did not write."""
    removed = []
    for p in gen.iterdir():
        if p.name not in keep and p.is_file():
            p.unlink()
            removed.append(p.name)
    return removed


def remove_generation(gen: Path) -> bool:
    """Remove a generation unless a reader holds it; whether it was removed."""
    try:
        lock = DirLock(gen, exclusive=True)
    except FileNotFoundError:
        return True
    try:
        if not lock.held:
            return False
        shutil.rmtree(gen, ignore_errors=True)
        return True
    finally:
        lock.release()


def sweep(path: Path, keep: Path | None, spare: Path | None = None) -> list[str]:
    """Remove generations of ``path`` other than ``keep`` and ``spare`` (interrupted or superseded saves),
    except those a reader holds (a later save removes them)."""
    removed = []
    kept = {p.resolve() for p in (keep, spare) if p is not None}
    for p in generations(path):
        if p.resolve() in kept and not p.is_symlink():
            continue
        if p.is_symlink() or p.is_file():
            p.unlink(missing_ok=True)
        elif not remove_generation(p):
            continue
        removed.append(p.name)
    return removed
