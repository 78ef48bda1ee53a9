"""The checkpoint's kinds of problem, on the package's one agreement module.

Every checkpoint step agrees through :mod:`torchrec_dtensor_bridge.agreement`:
a rank that finds a problem records an :class:`~..agreement.Problem` (a typed
kind, a message naming the file and key, the exception every rank raises)
instead of raising; one gather (:func:`~..agreement.gather_objects`, or
:func:`raise_if_any`) then lets every rank raise the same exception, listing
every rank's messages with the (global) ranks that found them. What this
module adds is checkpoint-specific only:

- :class:`Kind`: the checkpoint's kinds of problem, each an agreement
  :class:`~..agreement.ProblemKind` and the checkpoint exception it raises;
  ``Problem(Kind.CORRUPT, message)`` builds the agreement Problem;
- :func:`problem_from`: the Problem of an exception caught on this rank;
- :func:`raise_if_any` / :func:`raise_gathered`: the agreement's, raising
  :class:`.CheckpointError` when the ranks' problems are of different kinds,
  and listing on the exception the keys of the problems about keys
  (:class:`KeysProblem`, built by :mod:`.keylists`);
- :func:`member_group`: the :class:`~..groups.CommGroup` a step runs
  on, refused (ValueError) on a rank that is not one of its members;
- :func:`from_rank0`: a decision rank 0 of the group took, on every rank.

The object collectives put their tensors on the group's device themselves
(the current CUDA device for NCCL, CPU for gloo).
"""

from __future__ import annotations

import enum
import errno
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .. import agreement
from ..agreement import ProblemKind
from ..groups import CommGroup, of_group
from .errors import (
    BrokenChainError,
    CheckpointBusyError,
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotACheckpointError,
)

__all__ = [
    "ATTRIBUTES",
    "SHOWN",
    "Wording",
    "key_problems",
    "listed",
    "KeysProblem",
    "Kind",
    "Problem",
    "from_rank0",
    "member_group",
    "problem_from",
    "raise_gathered",
    "raise_if_any",
]


class Kind(enum.Enum):
    """A checkpoint problem's kind: the agreement's kind and the exception every rank raises."""

    VALUE = (ProblemKind.BAD_VALUE, ValueError)  # the caller's arguments or state_dict
    TYPE = (ProblemKind.BAD_TYPE, TypeError)  # a state_dict value of a kind that cannot be saved or loaded
    INCOMPLETE = (ProblemKind.INCOMPLETE, IncompleteCheckpointError)  # no committed checkpoint
    NOT_A_CHECKPOINT = (ProblemKind.FAILURE, NotACheckpointError)  # a file, or a directory of other things
    NOT_A_DIRECTORY = (ProblemKind.BAD_VALUE, NotADirectoryError)  # a path under a regular file
    CORRUPT = (ProblemKind.FAILURE, CorruptCheckpointError)  # damaged, hostile or inconsistent files
    BROKEN_CHAIN = (ProblemKind.FAILURE, BrokenChainError)  # a link of an incremental checkpoint gone or replaced
    BUSY = (ProblemKind.FAILURE, CheckpointBusyError)  # another save holds the path
    IO = (ProblemKind.FAILURE, CheckpointError)  # the file system refused (OSError, errno named)

    @property
    def problem_kind(self) -> ProblemKind:
        return self.value[0]

    @property
    def exception(self) -> type[Exception]:
        return self.value[1]


class Problem(agreement.Problem):
    """An agreement :class:`~..agreement.Problem` built from a checkpoint :class:`Kind`.

    Example::

        >>> p = Problem(Kind.CORRUPT, "data file __0_0.distcp is truncated: ...")
        >>> (p.kind, p.exception)
        (<ProblemKind.FAILURE: 6>, <class '...CorruptCheckpointError'>)
    """

    def __init__(self, kind: Kind, message: str) -> None:
        super().__init__(kind.problem_kind, message, kind.exception)


ATTRIBUTES = ("missing_keys", "unexpected_keys", "mismatched_keys")
"""The attributes of a refusal's exception that list every key of its problems about keys
(:class:`KeysProblem`), by kind (as ``torch.nn.Module.load_state_dict`` names them)."""


class KeysProblem(Problem):
    """A :class:`Problem` about keys (``Kind.VALUE``) with the keys it is about, by kind: ``missing`` (the
    state_dict names them, the checkpoint lacks them), ``unexpected`` (only the checkpoint holds them),
    ``mismatched`` (another shape or dtype). Built by :func:`.keylists.key_problems`."""

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatched: tuple[str, ...]

    def __init__(self, message: str, missing: Iterable[str] = (), unexpected: Iterable[str] = (),
                 mismatched: Iterable[str] = ()) -> None:
        super().__init__(Kind.VALUE, message)
        for name, keys in zip(("missing", "unexpected", "mismatched"), (missing, unexpected, mismatched)):
            object.__setattr__(self, name, tuple(keys))


def _attach_keys(error: BaseException, problems: Iterable[agreement.Problem]) -> None:
    """Set :data:`ATTRIBUTES` on ``error``: the keys of every :class:`KeysProblem` of ``problems``, sorted;
    nothing when none is one."""
    found = [p for p in problems if isinstance(p, KeysProblem)]
    if found:
        for attribute, kind in zip(ATTRIBUTES, ("missing", "unexpected", "mismatched")):
            setattr(error, attribute, sorted({key for p in found for key in getattr(p, kind)}))


def problem_from(e: BaseException, where: str = "") -> Problem:
    """The :class:`Problem` of an exception caught on this rank (``where`` prefixes the message).

    Example::

        >>> problem_from(FileNotFoundError(2, "No such file", "/ckpt"), "cannot open /ckpt").message
        "cannot open /ckpt: OSError [2 ENOENT] [Errno 2] No such file: '/ckpt'"
    """
    prefix = f"{where}: " if where else ""
    if isinstance(e, CheckpointBusyError):
        return Problem(Kind.BUSY, f"{prefix}{e}")
    if isinstance(e, IncompleteCheckpointError):
        return Problem(Kind.INCOMPLETE, f"{prefix}{e}")
    if isinstance(e, NotACheckpointError):
        return Problem(Kind.NOT_A_CHECKPOINT, f"{prefix}{e}")
    if isinstance(e, BrokenChainError):
        return Problem(Kind.BROKEN_CHAIN, f"{prefix}{e}")
    if isinstance(e, CorruptCheckpointError):
        return Problem(Kind.CORRUPT, f"{prefix}{e}")
    if isinstance(e, OSError):
        errno_name = f"[{e.errno} {errno.errorcode.get(e.errno, '?')}] " if e.errno else ""
        return Problem(Kind.IO, f"{prefix}OSError {errno_name}{e}")
    if isinstance(e, CheckpointError):
        return Problem(Kind.IO, f"{prefix}{e}")
    return Problem(Kind.CORRUPT, f"{prefix}{type(e).__name__}: {e}")


def raise_if_any(problems: Sequence[agreement.Problem], group: CommGroup | dist.ProcessGroup | None,
                 what: str) -> None:
    """Every rank raises if any rank reported a problem, with every rank's messages; *collective*."""
    g = group if isinstance(group, CommGroup) else of_group(group)
    raise_gathered(what, agreement.gather_objects(list(problems), g), g)


def raise_gathered(what: str, everyone: Sequence[Sequence[agreement.Problem]],
                   group: CommGroup | dist.ProcessGroup | None, common: Sequence[agreement.Problem] = ()) -> None:
    """Raise on every rank for problems already gathered (see :func:`~..agreement.raise_gathered`); no collective.

    The exception lists every key of the problems about keys in its ``missing_keys``, ``unexpected_keys`` and
    ``mismatched_keys`` (:data:`ATTRIBUTES`), where there are such problems (:class:`KeysProblem`)."""
    try:
        agreement.raise_gathered(what, everyone, group, common=common, mixed=CheckpointError)
    except Exception as e:
        _attach_keys(e, [p for ps in everyone for p in ps] + list(common))
        raise


def from_rank0(obj: Any, group: CommGroup | dist.ProcessGroup | None) -> Any:
    """Rank 0's (of ``group``) ``obj``, on every rank; *collective* (one broadcast).

    Example::

        >>> name = from_rank0(committed_name(path) if rank == 0 else None, group)
    """
    g = group if isinstance(group, CommGroup) else of_group(group)
    if not (dist.is_available() and dist.is_initialized()) or g.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=g.members[0], group=g.group)
    return box[0]


def member_group(group: dist.ProcessGroup | None, what: str) -> CommGroup:
    """The :class:`~..groups.CommGroup` of ``group`` (``None``: the default group); no collective.

    Raises:
        ValueError: this rank is not a member (a rank outside a group takes no part in its collectives).

    Example::

        >>> member_group(None, "checkpoint.save(/ckpt)").members
        (0, 1)
    """
    g = of_group(group)
    if g.rank is None:
        me = dist.get_rank() if dist.is_initialized() else 0
        raise ValueError(f"{what}: process_group holds ranks {list(g.members)}, not this rank {me}")
    return g


# -------------------------------------------------------------------- keys that do not match
# Keys that do not match, told in a few lines however many there are.
# 
# A load compares the state_dict's keys with the checkpoint's, an incremental
# save compares them with its base's, and a save compares every rank's with the
# others'. Each finds keys of three kinds: missing (the state_dict names a key
# the other side lacks), unexpected (the other side holds a key the state_dict
# does not name, refused where that is refused) and mismatched (another shape or
# dtype). :func:`key_problems` turns them into the problems a refusal lists:
# 
# 1. mismatched keys first: the first :data:`SHOWN` messages (they carry the
#    shapes), and past them one line counting and naming the rest;
# 2. then missing and unexpected keys: one line per key, the caller's message,
#    up to :data:`SHOWN` of a kind; past that, one line that counts them and
#    names the first :data:`SHOWN`;
# 3. when keys are missing, a line naming a few keys only the other side holds
#    that are not refused (another model's names, another prefix, show there);
# 4. when a kind was cut short: a last line saying where every key is: the
#    exception's ``missing_keys``, ``unexpected_keys`` and ``mismatched_keys``
#    attributes, and ``tdb.checkpoint.inspect`` for the checkpoint's own keys.
# 
# Every problem is a :class:`~.agree.KeysProblem` carrying its keys; the refusal
# (:func:`~.agree.raise_gathered`) sets those three attributes, every rank's keys
# sorted, on the exception it raises.
# 
# Example::
# 
#     >>> words = Wording(missing="of the state_dict are not in the checkpoint", unexpected="...", mismatched="...")
#     >>> problems = key_problems(words, "/ckpt/step100", missing=[(k, f"key {k!r} is not in the checkpoint")
#     ...                                                         for k in absent])

SHOWN = 5
"""The keys of one kind a refusal names before it counts the rest."""


def listed(names: Sequence[str], shown: int = SHOWN) -> str:
    """The first ``shown`` of ``names`` quoted, and how many more: ``'a', 'b' and 3 more``."""
    head = ", ".join(repr(n) for n in names[:shown])
    return head if len(names) <= shown else f"{head} and {len(names) - shown} more"


@dataclass(frozen=True)
class Wording:
    """How one comparison counts each kind of key when it names only the first few.

    Attributes:
        missing: after "N keys": keys of the state_dict that the other side lacks.
        unexpected: after "N keys": keys only the other side holds.
        mismatched: after "and N more keys": keys of another shape or dtype.
        unnamed: the line naming keys only the other side holds that are not refused, told when keys are
            missing (another model's names, another prefix, show there); ``{n}`` and ``{keys}`` filled in.
        other: what ``tdb.checkpoint.inspect`` reads, in the last line (``"the checkpoint"``, ``"base"``).
    """

    missing: str
    unexpected: str
    mismatched: str
    unnamed: str = ""
    other: str = "the checkpoint"


def key_problems(wording: Wording, inspect_path: str | None, *, missing: Sequence[tuple[str, str]] = (),
                 unexpected: Sequence[tuple[str, str]] = (), mismatched: Sequence[tuple[str, str]] = (),
                 unnamed: Sequence[str] = ()) -> list[Problem]:
    """The problems of one rank's keys that do not match, each kind given as (key, one-line message) pairs
    (steps 1-4 of the module docstring).

    Args:
        wording: how the counting lines name each kind.
        inspect_path: the checkpoint whose keys ``tdb.checkpoint.inspect`` lists (``None``: no checkpoint).
        missing: keys of the state_dict the other side lacks.
        unexpected: keys only the other side holds.
        mismatched: keys of another shape or dtype.
        unnamed: keys only the other side holds that are not refused (no problem of their own): a few are
            named after the missing keys, if any.
    """
    out: list[Problem] = [KeysProblem(message, mismatched=[key]) for key, message in mismatched[:SHOWN]]
    cut = len(mismatched) > SHOWN
    if cut:
        rest = [key for key, _ in mismatched[SHOWN:]]
        out.append(KeysProblem(f"and {len(rest)} more keys {wording.mismatched}: {listed(rest)}", mismatched=rest))
    for kind, pairs in (("missing", missing), ("unexpected", unexpected)):
        if len(pairs) <= SHOWN:
            out += [KeysProblem(message, **{kind: [key]}) for key, message in pairs]
            continue
        keys = [key for key, _ in pairs]
        out.append(KeysProblem(f"{len(keys)} keys {getattr(wording, kind)}: {listed(keys)}", **{kind: keys}))
        cut = True
    if missing and unnamed and wording.unnamed:
        out.append(KeysProblem(wording.unnamed.format(n=len(unnamed), keys=listed(unnamed))))
    if cut:
        where = "" if inspect_path is None else (
            f"; {wording.other}'s own keys: tdb.checkpoint.inspect({inspect_path!r})")
        out.append(KeysProblem(f"every key of each kind: the raised exception's {ATTRIBUTES[0]}, {ATTRIBUTES[1]} "
                               f"and {ATTRIBUTES[2]}{where}"))
    return out
