"""The few collectives that make checkpoint decisions unanimous: every rank raises, or none does.

Every checkpoint collective runs on one process group (``group``; ``None`` is
the default group). The object collectives used here put their tensors on the
group's device themselves (the current CUDA device for NCCL, CPU for gloo).

A rank that finds a problem records a :class:`Problem` (a typed kind and a
message naming the file and key) instead of raising; :func:`raise_if_any`
then gathers every rank's problems and every rank raises the same exception.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .commit import CheckpointBusyError, CheckpointError, CorruptCheckpointError, IncompleteCheckpointError

__all__ = [
    "Kind",
    "Problem",
    "dist_info",
    "from_rank0",
    "gather",
    "problem_from",
    "problems_text",
    "raise_for",
    "raise_if_any",
]


class Kind(enum.Enum):
    """What kind of problem a rank found; decides the exception every rank raises."""

    VALUE = "value"  # the caller's arguments or state_dict: ValueError
    INCOMPLETE = "incomplete"  # no committed checkpoint: IncompleteCheckpointError
    CORRUPT = "corrupt"  # damaged, hostile or inconsistent files: CorruptCheckpointError
    BUSY = "busy"  # another save holds the path: CheckpointBusyError
    IO = "io"  # the file system refused (OSError, errno named): CheckpointError


_EXCEPTIONS: dict[Kind, type[Exception]] = {
    Kind.VALUE: ValueError,
    Kind.INCOMPLETE: IncompleteCheckpointError,
    Kind.CORRUPT: CorruptCheckpointError,
    Kind.BUSY: CheckpointBusyError,
    Kind.IO: CheckpointError,
}


@dataclass(frozen=True)
class Problem:
    """One rank's finding: its kind and a message naming the file, key and values."""

    kind: Kind
    message: str


def problem_from(e: BaseException, where: str = "") -> Problem:
    """A :class:`Problem` for an exception caught on this rank (``where`` prefixes the message)."""
    prefix = f"{where}: " if where else ""
    if isinstance(e, CheckpointBusyError):
        return Problem(Kind.BUSY, f"{prefix}{e}")
    if isinstance(e, IncompleteCheckpointError):
        return Problem(Kind.INCOMPLETE, f"{prefix}{e}")
    if isinstance(e, CorruptCheckpointError):
        return Problem(Kind.CORRUPT, f"{prefix}{e}")
    if isinstance(e, OSError):
        errno_name = f"[{e.errno} {_errno_name(e.errno)}] " if e.errno else ""
        return Problem(Kind.IO, f"{prefix}OSError {errno_name}{e}")
    if isinstance(e, CheckpointError):
        return Problem(Kind.IO, f"{prefix}{e}")
    return Problem(Kind.CORRUPT, f"{prefix}{type(e).__name__}: {e}")


def _errno_name(code: int | None) -> str:
    import errno

    return errno.errorcode.get(code or 0, "?")


def dist_info(group: dist.ProcessGroup | None) -> tuple[int, int, bool]:
    """(rank in ``group``, its size, whether a process group is up); ``(0, 1, False)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group), True
    return 0, 1, False


def gather(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj``, on every rank (``[obj]`` without a process group)."""
    _, world, on = dist_info(group)
    if not on:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def from_rank0(obj: Any, group: dist.ProcessGroup | None) -> Any:
    """Rank 0's (of ``group``) ``obj``, on every rank."""
    _, _, on = dist_info(group)
    if not on:
        return obj
    box = [obj]
    src = dist.get_global_rank(group, 0) if group is not None and group is not dist.GroupMember.WORLD else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def problems_text(everyone: list[list[Problem]], common: list[Problem] | None = None) -> tuple[Kind | None, str]:
    """The kind every rank raises (``None`` if no problem) and one message listing each problem with its ranks;
    ``common``: problems every rank found from the gathered values (listed without ranks)."""
    flat = [(r, p) for r, probs in enumerate(everyone) for p in probs]
    shared = list(common or [])
    if not flat and not shared:
        return None, ""
    seen: dict[str, list[int]] = {}
    for r, p in flat:
        seen.setdefault(p.message, []).append(r)
    lines = [f"{msg} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})" for msg, rs in seen.items()]
    text = "\n  ".join(lines + [p.message for p in shared])
    kinds = {p.kind for _, p in flat} | {p.kind for p in shared}
    kind = kinds.pop() if len(kinds) == 1 else Kind.IO
    return kind, text


def raise_for(kind: Kind, text: str, what: str) -> None:
    """Raise the exception of ``kind`` with every rank's messages."""
    raise _EXCEPTIONS[kind](f"{what}:\n  {text}")


def raise_if_any(problems: list[Problem], group: dist.ProcessGroup | None, what: str) -> None:
    """Every rank raises if any rank reported a problem, with every rank's messages; *collective*."""
    kind, text = problems_text(gather(problems, group))
    if kind is not None:
        raise_for(kind, text, what)
