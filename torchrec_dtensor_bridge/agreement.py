"""The one agreement mechanism of the package: every rank of a group raises, or none does.

A collective call (a lookup, ``shard_module``, a checkpoint step) first checks
its arguments locally and records - never raises - a :class:`Problem`; then
every rank of the group takes part in ONE agreement collective, and if any
rank reported a problem (or the ranks' values differ) every rank raises. No
rank is ever left waiting in a collective the others skipped.

API, in the order a caller uses it:

1. :class:`ProblemKind` (an Enum: ``BAD_TYPE``, ``BAD_VALUE``, ``UNSUPPORTED``,
   ``DISAGREEMENT``, ``INCOMPLETE``, ``FAILURE``) and :class:`Problem` (a frozen
   dataclass: kind, message, and the exception type every rank raises, by
   default the kind's). ``Problem.error()`` builds the exception.
2. :class:`Rejected` - the exception a local check raises to hand its Problem to
   the caller (``Rejected(ValueError, "...")`` or ``Rejected.of(problem)``);
   ``RejectedArguments`` is the same class.
3. Collectives, on a :class:`~torchrec_dtensor_bridge.groups.CommGroup`
   or a process group (``None``: the default group); their tensors live on the
   group's device (CUDA for NCCL):

   - :func:`agree` - ONE ``all_gather`` of ``[verdict, n, values...]``
     (int64, padded to a ``width`` every rank passes alike); returns every
     rank's values. On any problem, one more ``all_gather_object`` (the error
     path only) shares the messages and every rank raises: a failing rank its
     own problem, the others the first failing rank's, naming it.
   - :func:`exchange` - every rank's int64 values (no verdict): the tail of a
     message too long for one fixed-size agreement.
   - :func:`gather_objects` - every rank's picklable object (error paths:
     naming what differs once digests disagree).
   - :func:`raise_if_any` - every rank's list of problems through
     ``all_gather_object``; raises on every rank with all messages, grouped by
     rank (the checkpoint's form: many problems per rank, strings are fine
     off the hot path); :func:`raise_gathered` - the same on problems already
     gathered with other values (no collective of its own).
   - :func:`timeouts_named` - around a call's later collectives: a backend's
     bare timeout becomes an error naming the call, the step and the group.
4. Helpers for the values: :func:`check_same` (a column of the agreed table
   must hold one value: else a ``DISAGREEMENT`` on every rank),
   :func:`float_code` (a float as exact int64 bits) and
   ``ShardLayout.digest()`` (a layout as 62 bits).

The checkpoint (``checkpoint/agree.py``) adds only its own kinds of problem
(each a :class:`ProblemKind` and a :class:`~.checkpoint.CheckpointError`
subclass) and a broadcast from rank 0 of the group.

Example::

    >>> problem = None
    >>> try:
    ...     check_my_arguments()
    ... except Rejected as e:
    ...     problem = e.problem
    >>> table = agree("my_call", problem, [n_items, float_code(alpha)], group)
    >>> check_same("my_call", "alpha", [row[1] for row in table])
"""

from __future__ import annotations

import contextlib
import enum
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .groups import CommGroup, of_group

__all__ = [
    "Problem",
    "ProblemKind",
    "Rejected",
    "RejectedArguments",
    "agree",
    "check_same",
    "exchange",
    "float_code",
    "gather_objects",
    "raise_gathered",
    "raise_if_any",
    "timeouts_named",
]


class ProblemKind(enum.Enum):
    """What went wrong; each kind has the exception it raises unless a Problem names another."""

    BAD_TYPE = 1
    BAD_VALUE = 2
    UNSUPPORTED = 3
    DISAGREEMENT = 4
    INCOMPLETE = 5
    FAILURE = 6

    @property
    def exception(self) -> type[Exception]:
        return _EXCEPTIONS[self]

    @classmethod
    def for_exception(cls, exc: type[Exception]) -> ProblemKind:
        """The kind of an exception type (``FAILURE`` for anything not a standard argument error)."""
        for kind in (cls.BAD_TYPE, cls.UNSUPPORTED, cls.BAD_VALUE):
            if issubclass(exc, _EXCEPTIONS[kind]):
                return kind
        return cls.FAILURE


_EXCEPTIONS: dict[ProblemKind, type[Exception]] = {
    ProblemKind.BAD_TYPE: TypeError,
    ProblemKind.BAD_VALUE: ValueError,
    ProblemKind.UNSUPPORTED: NotImplementedError,
    ProblemKind.DISAGREEMENT: ValueError,
    ProblemKind.INCOMPLETE: RuntimeError,
    ProblemKind.FAILURE: RuntimeError,
}


@dataclass(frozen=True)
class Problem:
    """One rank's reason to refuse a collective call.

    Attributes:
        kind: what went wrong.
        message: the full message (it names the call, the table or argument and the values).
        exception: the exception type every rank raises (the kind's by default).
    """

    kind: ProblemKind
    message: str
    exception: type[Exception]

    @classmethod
    def of(cls, kind: ProblemKind, message: str, exception: type[Exception] | None = None) -> Problem:
        return cls(kind, message, exception or kind.exception)

    @classmethod
    def from_exception(cls, exception: type[Exception], message: str) -> Problem:
        return cls(ProblemKind.for_exception(exception), message, exception)

    def error(self, message: str | None = None) -> Exception:
        """The exception to raise (with ``message`` instead of this problem's own, when given)."""
        return self.exception(self.message if message is None else message)


class Rejected(Exception):
    """A local check's failure, held by the caller until the agreement step raises it everywhere."""

    def __init__(self, exception: type[Exception], message: str, kind: ProblemKind | None = None) -> None:
        super().__init__(message)
        self.problem = Problem.of(kind, message, exception) if kind else Problem.from_exception(exception, message)

    @classmethod
    def of(cls, problem: Problem) -> Rejected:
        return cls(problem.exception, problem.message, problem.kind)

    @property
    def exception(self) -> type[Exception]:
        return self.problem.exception

    @property
    def message(self) -> str:
        return self.problem.message


RejectedArguments = Rejected


def float_code(x: float) -> int:
    """A float as the int64 of its IEEE bits: exact, and equal exactly when the floats are (NaN too)."""
    return int(struct.unpack("<q", struct.pack("<d", float(x)))[0])


def _group(group: CommGroup | dist.ProcessGroup | None) -> CommGroup:
    return group if isinstance(group, CommGroup) else of_group(group)


def _on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _all_rows(values: list[int], group: CommGroup) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank); *collective*."""
    if not _on() or group.size == 1:
        return [list(values)]
    t = torch.tensor(values, dtype=torch.int64, device=group.device)
    rows = [torch.empty_like(t) for _ in range(group.size)]
    dist.all_gather(rows, t, group=group.group)
    return torch.stack(rows).cpu().tolist()


def _objects(obj: Any, group: CommGroup) -> list[Any]:
    if not _on() or group.size == 1:
        return [obj]
    out: list[Any] = [None] * group.size
    dist.all_gather_object(out, obj, group=group.group)
    return out


@contextlib.contextmanager
def timeouts_named(what: str, group: CommGroup, where: str, why: str) -> Iterator[None]:
    """A backend's timeout inside the block (gloo's and NCCL's name no call of ours) re-raised as a
    ``RuntimeError`` that says which call timed out, where, on which group, and why that happens."""
    try:
        yield
    except RuntimeError as e:
        said = str(e).strip()
        if "timed out" not in said.lower() or said.startswith(f"{what}:"):
            raise
        raise RuntimeError(f"{what}: timed out in {where} on the group of ranks {list(group.members)}: {why}. "
                           f"The backend said: {said.splitlines()[0][:300]}") from e


_PAD = -(2**63)


def agree(
    what: str,
    problem: Problem | None,
    values: Sequence[int],
    group: CommGroup | dist.ProcessGroup | None,
    *,
    width: int | None = None,
    refused: str = "rejected its arguments",
) -> list[list[int]]:
    """The agreement step; *collective* over ``group`` (every member calls it, in the same order).

    Args:
        what: the public call's name, for messages.
        problem: this rank's problem, or ``None``.
        values: this rank's int64 values to share (sizes, options, digests).
        group: where to agree.
        width: the message's fixed number of values, the same on every rank
            (default ``len(values)``, which must then be the same on every rank);
            shorter ``values`` are padded, longer ones are cut to ``width``
            (send the rest with :func:`exchange`).
        refused: how other ranks' messages name a failing rank's verdict.

    Returns:
        Every rank's values, in group-rank order (each as long as that rank's
        ``values``, at most ``width``).

    Raises:
        On every rank when any rank reported a problem: its own problem's
        exception on a failing rank, the first failing rank's elsewhere.
    """
    g = _group(group)
    n = len(values) if width is None else width
    mine = list(values)[:n]
    message = [0 if problem is None else problem.kind.value, len(mine)] + mine + [_PAD] * (n - len(mine))
    with timeouts_named(what, g, "its first collective (the agreement step)",
                        "the other ranks of the group did not make this call. It is collective: every rank of the "
                        "group must call it, in the same order (not under an `if rank == ...`)"):
        rows = _all_rows(message, g)
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        problems = _objects(problem, g)
        if problem is not None:
            raise problem.error()
        first = problems[failed[0]]
        assert isinstance(first, Problem), "a failing rank shares its Problem"
        raise first.error(f"{what}: rank {g.members[failed[0]]} {refused}: {first.message}")
    return [row[2 : 2 + row[1]] for row in rows]


def gather_objects(obj: Any, group: CommGroup | dist.ProcessGroup | None) -> list[Any]:
    """Every rank's picklable ``obj``, in group-rank order; *collective*. For error paths and rare steps
    (pickling costs), never a lookup's hot path."""
    return _objects(obj, _group(group))


def exchange(values: Sequence[int], group: CommGroup | dist.ProcessGroup | None) -> list[list[int]]:
    """Every rank's int64 ``values`` (the same length on every rank), in group-rank order; *collective*."""
    return _all_rows(list(values), _group(group))


def check_same(what: str, name: str, column: Sequence[Any], *, shown: Sequence[Any] | None = None,
               hint: str = "every rank must pass the same") -> None:
    """Raise ``ValueError`` (a ``DISAGREEMENT``) unless every rank's value of ``name`` is the same.

    ``column`` is the agreed values in rank order (every rank holds the same
    column, so every rank raises alike); ``shown`` is what the message lists
    (default ``column``).
    """
    if any(v != column[0] for v in column):
        listed = list(column if shown is None else shown)
        raise Problem.of(ProblemKind.DISAGREEMENT, f"{what}: ranks disagree on {name}: {listed} (rank order); {hint}").error()


def raise_if_any(
    what: str,
    problems: Sequence[Problem],
    group: CommGroup | dist.ProcessGroup | None,
    *,
    mixed: type[Exception] = RuntimeError,
) -> None:
    """Every rank raises if any rank reported a problem, listing every message once with its ranks;
    *collective* (one ``all_gather_object``).

    The exception is the problems' common exception type, or ``mixed`` when they differ.

    Example::

        >>> raise_if_any("checkpoint.load(/ckpt)", problems, group, mixed=CheckpointError)
    """
    g = _group(group)
    raise_gathered(what, _objects(list(problems), g), g, mixed=mixed)


def raise_gathered(
    what: str,
    everyone: Sequence[Sequence[Problem]],
    group: CommGroup | dist.ProcessGroup | None,
    *,
    common: Sequence[Problem] = (),
    mixed: type[Exception] = RuntimeError,
) -> None:
    """:func:`raise_if_any` on problems already gathered (with other values, in one collective); no collective.

    Args:
        what: the call, heading the message.
        everyone: every rank's problems, in group-rank order (as :func:`gather_objects` returns them).
        group: the group they were gathered on (its members name the ranks: global ranks).
        common: problems every rank found alike in the gathered values (a disagreement):
            listed after the others, without ranks.
        mixed: the exception when the problems' exception types differ.

    Example::

        >>> everyone = gather_objects((save_id, problems), group)
        >>> raise_gathered("checkpoint.save(/ckpt)", [p for _, p in everyone], group, mixed=CheckpointError)
    """
    members = _group(group).members
    flat = [(members[r], p) for r, ps in enumerate(everyone) for p in ps]
    if not flat and not common:
        return
    seen: dict[str, list[int]] = {}
    for r, p in flat:
        seen.setdefault(p.message, []).append(r)
    lines = [f"{msg} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})" for msg, rs in seen.items()]
    text = "\n  ".join(lines + [p.message for p in common])
    types = {p.exception for _, p in flat} | {p.exception for p in common}
    exc = types.pop() if len(types) == 1 else mixed
    raise exc(f"{what}:\n  {text}")
