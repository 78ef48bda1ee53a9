"""The commit protocol: generations under a checkpoint's name, one atomic step, collection; written once, against
:mod:`.storage`, for every backend.

A checkpoint at ``path`` (a directory on disk, a key prefix on S3) holds::

    path/tdb_commit.json     the commit record: which generation is committed (storage operation 9)
    path/gen-<save_id>/      generations: .metadata, DCP data files, tdb_manifest.json, row digests
    path/.tdb_lock           the save lock (operation 10)
    path/.metadata           a copy of the committed generation's, naming its files under it, written after
                             the commit: plain ``dcp.load(checkpoint_id=path)`` reads the checkpoint

Everything of a checkpoint lies under its name, so a copy of the directory
(``cp -r``, ``cp -rL``, ``rsync -a``, an object-store sync) is a complete
checkpoint at its new place. Checkpoints of earlier releases (``path`` a
symbolic link to a generation ``.<name>.tdb-<id>`` beside it) still load.

A save calls, in order (rank 0; :func:`~.api.save` runs the collective parts):

1. :func:`check_target`, then :func:`save_lock`: one save per name at a time
   (a second gets :class:`~.errors.CheckpointBusyError` at once); the commit
   record read (its token kept for step 4);
2. :func:`prepare_generation`: a fresh generation, or (local disk) a spare
   renamed to it and rewritten in place;
3. (every rank writes its objects into the generation), then :func:`prune`
   removes a reused spare's files the new save did not write;
4. (the manifest is written into the generation), then :func:`commit`
   replaces the commit record only if it is still the one read in step 1:
   a ``rename`` on disk, a conditional put on S3. This is the commit point; a
   save killed before it leaves the previous commit in force and nothing of it
   visible; a second saver that got past step 1 (an expired S3 lease) loses
   here and is refused with :class:`~.errors.CheckpointBusyError`;
5. :func:`sweep`: interrupted generations and superseded ones removed.

Readers never read a generation while it is collected. On disk a reader holds
a shared ``flock`` on its generation, and a save removes or reuses a
generation only under an exclusive one it gets without waiting. On S3,
generations are never reused, and a superseded one is kept for
``grace_seconds`` (default 600) after the commit that superseded it: a load
that opens it before then has that long to read it (the commit record lists
the superseded generations and when).

Interrupted generations (never committed) are collected by the next save, or
by :func:`collect` (``python -m torchrec_dtensor_bridge gc PATH``), under the
save lock, so never while a save writes them.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

from .errors import CheckpointBusyError, CheckpointError, CorruptCheckpointError, IncompleteCheckpointError, NotACheckpointError
from .format.manifest import MANIFEST
from .storage import Conflict, Loc, Lock, NotAnObject, locate

__all__ = [
    "COMMIT",
    "SaveTarget",
    "check_target",
    "collect",
    "commit",
    "committed_name",
    "generation",
    "generations",
    "lock_generation",
    "prepare_generation",
    "prune",
    "resolve",
    "root_of",
    "save_lock",
    "sweep",
    "writable_parent",
]

COMMIT = "tdb_commit.json"
_LOCK = ".tdb_lock"
_GEN = "gen-"
_GEN_NAME = re.compile(r"gen-[0-9a-f]{32}")
_OLD_TAG = ".tdb-"
_SHOWN = 5  # entries of a directory that is not a checkpoint named in the message
def _ours(name: str) -> bool:
    """Whether ``name`` is something a save puts beside the commit record and generations (its lock, the plain
    ``.metadata``, and the temporary files of a commit in progress: another save may be committing)."""
    return (name in (_LOCK, ".metadata") or name.startswith((f".{COMMIT}", "..metadata"))
            or _GEN_NAME.fullmatch(name) is not None)



_MARKERS = (".metadata", MANIFEST)  # a reused spare loses them first: it never looks complete while rewritten

_EXPECTED = ("expected a checkpoint written by tdb.checkpoint.save (a directory holding "
             f"{COMMIT} and its generations) or a plain DCP directory holding .metadata (written by "
             "torch.distributed.checkpoint.save)")  # what a checkpoint path must hold, as messages say it


def generation(path: Loc, save_id: str) -> Loc:
    """Where the generation ``save_id`` of the checkpoint at ``path`` is written."""
    return path / f"{_GEN}{save_id}"


def root_of(path: Loc, name: str) -> Loc:
    """The generation ``name`` of ``path`` as :func:`committed_name` names it (``""``: ``path`` itself)."""
    if not name:
        return path
    return path.parent / name if name.startswith(".") else path / name


# -------------------------------------------------------------------- the commit record
def _record(path: Loc) -> tuple[dict[str, Any], Any] | None:
    """The commit record of ``path`` and its token, or ``None``; raises if it is damaged."""
    where = path / COMMIT
    try:
        got = where.read_pointer()
    except NotAnObject as e:
        raise CorruptCheckpointError(f"commit record {where} is not a regular file: {e}") from None
    if got is None:
        return None
    data, token = got
    try:
        rec = json.loads(data)
    except ValueError:
        rec = None
    ok = (isinstance(rec, dict) and rec.get("format") == 1 and isinstance(rec.get("generation"), str)
          and _GEN_NAME.fullmatch(rec["generation"]) is not None and rec.get("save_id") == rec["generation"][4:]
          and isinstance(rec.get("superseded", []), list))
    if not ok:
        raise CorruptCheckpointError(f"commit record {where} is damaged or not one tdb.checkpoint.save writes "
                                     f"({len(data)} bytes)")
    superseded = []
    for s in rec.get("superseded", []):
        if (isinstance(s, list) and len(s) == 2 and isinstance(s[0], str) and _GEN_NAME.fullmatch(s[0])
                and isinstance(s[1], (int, float))):
            superseded.append(s)
    rec["superseded"] = superseded
    return rec, token


def _old_link(path: Loc) -> str | None:
    """The generation an earlier release's link ``path`` names, or ``None`` if ``path`` is no link."""
    target = path.link_target()
    if target is None:
        return None
    if "/" in target or not target.startswith(f".{path.name}{_OLD_TAG}"):
        raise CheckpointError(f"{path} links to {target!r}, which is not one of its generations")
    return target


def committed_name(path: Loc) -> str:
    """The name of the generation committed at ``path`` (:func:`root_of` finds it), ``""`` for a plain DCP
    directory; raises if there is none.

    Raises:
        IncompleteCheckpointError: nothing was committed at ``path``: it does not exist, its record names a
            generation that is gone, it holds only interrupted generations, or it holds DCP data files without
            ``.metadata`` (an unfinished DCP save).
        NotACheckpointError: ``path`` is a file, or a directory with neither ``.metadata`` nor a manifest.
        CorruptCheckpointError: its commit record is damaged.
        CheckpointError: ``path`` is a link to something that is not one of its generations.
    """
    old = _old_link(path)
    if old is not None:
        if root_of(path, old).kind() != "dir":
            raise IncompleteCheckpointError(f"{path} points at {old}, which is missing")
        return old
    kind = path.kind()
    if kind == "dir":
        rec = _record(path)
        if rec is not None:
            name = rec[0]["generation"]
            if (path / name).kind() != "dir":
                raise IncompleteCheckpointError(f"{path}: its commit record names {name}, which is missing")
            return name
        _check_plain_directory(path)
        return ""
    if kind is not None:
        raise NotACheckpointError(f"{path} is not a checkpoint: it is a file, not a directory; {_EXPECTED}")
    raise IncompleteCheckpointError(f"no committed checkpoint at {path}")


def _check_plain_directory(path: Loc) -> None:
    """Raise unless the directory ``path`` holds ``.metadata`` or a manifest (whether they are sound is the
    reader's to check: a damaged one is a corrupt checkpoint, not a missing one)."""
    names = path.list()
    if ".metadata" in names or MANIFEST in names:
        return
    stray = [n for n in names if _GEN_NAME.fullmatch(n)]
    if stray:
        raise IncompleteCheckpointError(f"no committed checkpoint at {path}: uncommitted generations {_some(stray)} "
                                        "are from interrupted saves")
    data = [n for n in names if n.endswith(".distcp")]
    if data:
        raise IncompleteCheckpointError(
            f"{path} holds DCP data files ({_some(data)}) but no .metadata: a torch.distributed.checkpoint.save "
            "that did not finish (DCP writes .metadata last)"
        )
    holds = "is empty" if not names else f"holds only {_some(names)}"
    inside = [n for n in names if _is_checkpoint(path / n)]
    hint = f"; it holds the checkpoints {_some(inside)}: pass one of those paths" if inside else ""
    raise NotACheckpointError(f"{path} is not a checkpoint: the directory {holds}; {_EXPECTED}{hint}")


def _is_checkpoint(p: Loc) -> bool:
    """Whether ``p`` is a checkpoint written by a save (its commit record exists, or an earlier release's link)."""
    try:
        return _old_link(p) is not None or (p / COMMIT).kind() == "object"
    except (OSError, CheckpointError):
        return False


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown if len(names) <= _SHOWN else f"{shown} and {len(names) - _SHOWN} more"


def resolve(path: Loc | str | os.PathLike[str]) -> Loc:
    """The committed generation behind ``path`` (``path`` itself for a plain DCP directory); raises if none."""
    loc = locate(path)
    return root_of(loc, committed_name(loc))


def lock_generation(path: Loc, name: str) -> Lock | None:
    """A shared lock on the generation ``name`` of ``path`` (``""``: ``path`` itself, a plain DCP directory),
    or ``None`` if it was renamed, removed or is being rewritten (resolve again)."""
    root = root_of(path, name)
    if root.local:
        return root.lock(exclusive=False)
    return root.lock(exclusive=False) if root.kind() == "dir" else None


# -------------------------------------------------------------------- saving
def writable_parent(path: Loc) -> None:
    """Raise ``NotADirectoryError`` if an existing ancestor of a local ``path`` is not a directory; writes nothing.

    The directories above ``path`` that do not exist yet are created by the save; one that exists as a regular
    file (or a link to one, or a broken link) would make that fail with a bare ``EEXIST``.

    Example::

        >>> writable_parent(locate("/ckpt/notes.txt/step100"))
        Traceback (most recent call last):
        NotADirectoryError: cannot save to /ckpt/notes.txt/step100: /ckpt/notes.txt is a file, not a directory ...
    """
    path.storage.check_parents(path.key)


class SaveTarget:
    """What step 1 of a save found and holds: the save lock and the commit record's token."""

    def __init__(self, lock: Lock, record: dict[str, Any] | None, token: Any, created: bool = False) -> None:
        self.lock = lock
        self.record = record
        self.token = token
        self.created = created  # the save made the checkpoint's directory: a refused save removes it again

    def release(self) -> None:
        self.lock.release()


def check_target(path: Loc) -> None:
    """Raise unless ``path`` is free or holds a checkpoint this package may save to again."""
    if _old_link(path) is not None:
        raise CheckpointError(
            f"{path} is a checkpoint in the layout of earlier releases (a link to its generation): it loads, but "
            "saves go to a new path; save to another path, or remove the link and its generations first")
    kind = path.kind()
    if kind is None:
        return
    if kind != "dir":
        raise CheckpointError(f"{path} exists and is not a torchrec_dtensor_bridge checkpoint; refusing to "
                              "overwrite it")
    names = path.list()
    if COMMIT in names or not [n for n in names if not _ours(n)]:
        return
    raise CheckpointError(f"{path} exists and is not a torchrec_dtensor_bridge checkpoint (it holds "
                          f"{_some(names)}); refusing to overwrite it")


def save_lock(path: Loc) -> SaveTarget:
    """Step 1: the save lock of ``path`` (created with its directory) and its commit record read.

    Raises:
        CheckpointBusyError: another save to ``path`` holds the lock.
    """
    created = path.local and path.kind() is None
    path.make_dir()
    lock = (path / _LOCK).lock(exclusive=True)
    if lock is None:
        raise CheckpointBusyError(
            f"another save to {path} is in progress (it holds {_LOCK}); two jobs cannot save to one path"
        )
    try:
        rec = _record(path)
    except BaseException:
        lock.release()
        raise
    return SaveTarget(lock, rec[0] if rec else None, rec[1] if rec else None, created)


def generations(path: Loc) -> list[Loc]:
    """The generations under ``path`` (committed or not)."""
    try:
        return [path / n for n in path.list() if _GEN_NAME.fullmatch(n)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def prepare_generation(path: Loc, gen: Loc, committed: str | None, *, reuse: bool) -> tuple[bool, Lock | None]:
    """Step 2: create ``gen`` and hold it exclusively; with ``reuse`` (local disks), by renaming an uncommitted
    generation of ``path`` that no reader holds (the save then overwrites its files in place). Returns whether
    one was reused, and the lock (released after the commit)."""
    if reuse and path.storage.renames:
        spares = [g for g in generations(path) if g.name != committed]
        for spare in sorted(spares, key=lambda g: g.name):
            lock = spare.lock(exclusive=True)
            if lock is None:
                continue  # a reader holds it: leave it alone
            spare.rename(gen)
            for marker in _MARKERS:
                (gen / marker).delete()
            return True, lock
    gen.make_dir()
    return False, gen.lock(exclusive=True) if gen.local else None


def prune(gen: Loc, keep: set[str]) -> list[str]:
    """Step 3: remove files of a reused generation that the new save did not write."""
    removed = []
    for name in gen.list():
        if name not in keep and (gen / name).kind() == "object":
            (gen / name).delete()
            removed.append(name)
    return removed


def commit(path: Loc, gen: Loc, target: SaveTarget) -> str | None:
    """Step 4: make ``gen`` the committed generation of ``path`` if the commit record is still the one
    ``target`` read; the generation it supersedes.

    Raises:
        CheckpointBusyError: another save committed to ``path`` since (this save's generation is not committed).
    """
    previous = target.record["generation"] if target.record else None
    now = time.time()
    superseded = list(target.record["superseded"]) if target.record else []
    if previous is not None:
        superseded = [*superseded[-99:], [previous, now]]
    rec = {"format": 1, "generation": gen.name, "save_id": gen.name[len(_GEN):], "committed_at": now,
           "superseded": superseded}
    try:
        (path / COMMIT).swap_pointer(json.dumps(rec).encode(), target.token)
    except Conflict:
        raise CheckpointBusyError(f"another save to {path} committed while this one ran (this one's lock had "
                                  f"expired); this save's generation {gen.name} was not committed") from None
    target.record, target.token = rec, None
    return previous


def _collectable(path: Loc, keep: set[str], superseded: dict[str, float], grace: float) -> list[Loc]:
    out = []
    for g in generations(path):
        if g.name in keep:
            continue
        when = superseded.get(g.name)
        if not g.local and when is not None and time.time() - when < grace:
            continue  # readers may still be reading it (S3: see the module docstring)
        out.append(g)
    return out


def _remove(g: Loc) -> bool:
    if not g.local:
        g.delete_tree()
        return True
    lock = g.lock(exclusive=True)
    if lock is None:
        return False  # a reader holds it: a later save removes it
    try:
        g.delete_tree()
        return True
    finally:
        lock.release()


def sweep(path: Loc, keep: str, spare: str | None) -> list[str]:
    """Step 5: remove generations of ``path`` other than ``keep`` and ``spare`` (interrupted or superseded),
    except those a reader holds or may hold; the names removed. Call under the save lock."""
    rec = _record(path)
    superseded = {n: t for n, t in rec[0]["superseded"]} if rec else {}
    grace = float(getattr(path.storage, "grace_seconds", 0.0))
    removed = [g.name for g in _collectable(path, {keep} | ({spare} if spare else set()), superseded, grace)
               if _remove(g)]
    return removed


def collect(path: Loc, *, dry_run: bool = False) -> list[str]:
    """Remove what interrupted saves left under ``path`` (never the committed generation, nor one in use, nor
    a superseded one within its grace period); the names removed (or, ``dry_run``, that would be).

    Raises:
        CheckpointBusyError: a save to ``path`` is in progress (it may be writing the generations).
    """
    if _old_link(path) is not None:
        return []
    if path.kind() != "dir":
        raise IncompleteCheckpointError(f"no checkpoint at {path}")
    target = save_lock(path)
    try:
        keep = {target.record["generation"]} if target.record else set()
        superseded = {n: t for n, t in target.record["superseded"]} if target.record else {}
        grace = float(getattr(path.storage, "grace_seconds", 0.0))
        victims = _collectable(path, keep, superseded, grace)
        if dry_run:
            return [g.name for g in victims]
        return [g.name for g in victims if _remove(g)]
    finally:
        target.release()
