"""The checkpoint's exceptions; imports nothing else of the package, so every module can raise them.

All are :class:`CheckpointError`, a ``RuntimeError`` (an ``Exception``, unlike
DCP's ``CheckpointException``). Every rank raises the same one when a step
fails on any rank (:mod:`.agree`), and messages name the file and key.

What a load (or ``inspect``) of ``path`` raises when there is nothing usable to read:

- :class:`IncompleteCheckpointError`: nothing was ever committed at ``path``:
  it does not exist (perhaps beside uncommitted generations that interrupted
  saves left), its link names a generation that is gone, or it is a directory
  holding DCP data files (``*.distcp``) but no ``.metadata`` (a
  ``torch.distributed.checkpoint.save`` that did not finish: DCP writes
  ``.metadata`` last). Starting from scratch is the usual answer.
- :class:`NotACheckpointError`: ``path`` exists but holds no checkpoint of any
  kind: a regular file, or a directory with neither ``.metadata`` nor a
  ``tdb_manifest.json`` (empty, or unrelated files). Usually a wrong path:
  starting from scratch would hide the mistake, so it is not an
  :class:`IncompleteCheckpointError`.
- :class:`CorruptCheckpointError`: ``path`` is a checkpoint (its ``.metadata``
  or its manifest exists) whose files are damaged, inconsistent or hostile: a
  ``.metadata`` or manifest that cannot be parsed or fails its checksum, a
  manifest without its ``.metadata``, a data file missing or truncated. Its subclass
  :class:`BrokenChainError`: a link an incremental checkpoint depends on is gone or was replaced.

Example::

    >>> try:
    ...     tdb.checkpoint.load(sd, "/ckpt/step100")
    ... except tdb.checkpoint.IncompleteCheckpointError:
    ...     pass  # nothing committed yet: start from scratch
"""

from __future__ import annotations

__all__ = [
    "BrokenChainError",
    "CheckpointBusyError",
    "CheckpointError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "NotACheckpointError",
]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded as asked (an ``Exception``, unlike DCP's)."""


class IncompleteCheckpointError(CheckpointError):
    """No committed checkpoint exists at the path (never saved, or every save was interrupted)."""


class NotACheckpointError(CheckpointError):
    """The path exists but is no checkpoint: a file, or a directory with neither ``.metadata`` nor a manifest."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files are damaged, inconsistent or hostile; the message names the file and key."""


class CheckpointBusyError(CheckpointError):
    """Another save to the same path is in progress."""


class BrokenChainError(CorruptCheckpointError):
    """A link of an incremental checkpoint's chain is missing or was replaced (the message names the link)."""
