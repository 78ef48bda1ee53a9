"""The checkpoint's exceptions; imports nothing else of the package, so every module can raise them.

All are :class:`CheckpointError`, a ``RuntimeError`` (an ``Exception``, unlike
DCP's ``CheckpointException``). Every rank raises the same one when a step
fails on any rank (:mod:`.agree`), and messages name the file and key.

Example::

    >>> try:
    ...     tdb.checkpoint.load(sd, "/ckpt/step100")
    ... except tdb.checkpoint.IncompleteCheckpointError:
    ...     pass  # nothing committed yet: start from scratch
"""

from __future__ import annotations

__all__ = [
    "CheckpointBusyError",
    "CheckpointError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded as asked (an ``Exception``, unlike DCP's)."""


class IncompleteCheckpointError(CheckpointError):
    """No committed checkpoint exists at the path (never saved, or every save was interrupted)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files are damaged, inconsistent or hostile; the message names the file and key."""


class CheckpointBusyError(CheckpointError):
    """Another save to the same path is in progress."""
