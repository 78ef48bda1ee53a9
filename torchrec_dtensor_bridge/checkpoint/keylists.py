"""Keys that do not match, told in a few lines however many there are.

A load compares the state_dict's keys with the checkpoint's, an incremental
save compares them with its base's, and a save compares every rank's with the
others'. Each finds keys of three kinds: missing (the state_dict names a key
the other side lacks), unexpected (the other side holds a key the state_dict
does not name, refused where that is refused) and mismatched (another shape or
dtype). :func:`key_problems` turns them into the problems a refusal lists:

1. mismatched keys first: the first :data:`SHOWN` messages (they carry the
   shapes), and past them one line counting and naming the rest;
2. then missing and unexpected keys: one line per key, the caller's message,
   up to :data:`SHOWN` of a kind; past that, one line that counts them and
   names the first :data:`SHOWN`;
3. when keys are missing, a line naming a few keys only the other side holds
   that are not refused (another model's names, another prefix, show there);
4. when a kind was cut short: a last line saying where every key is: the
   exception's ``missing_keys``, ``unexpected_keys`` and ``mismatched_keys``
   attributes, and ``tdb.checkpoint.inspect`` for the checkpoint's own keys.

Every problem is a :class:`~.agree.KeysProblem` carrying its keys; the refusal
(:func:`~.agree.raise_gathered`) sets those three attributes, every rank's keys
sorted, on the exception it raises.

Example::

    >>> words = Wording(missing="of the state_dict are not in the checkpoint", unexpected="...", mismatched="...")
    >>> problems = key_problems(words, "/ckpt/step100", missing=[(k, f"key {k!r} is not in the checkpoint")
    ...                                                         for k in absent])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .agree import ATTRIBUTES, KeysProblem, Problem

__all__ = ["SHOWN", "Wording", "key_problems", "listed"]

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
