"""Compact an incremental checkpoint's chain into one self-contained checkpoint.

:func:`compact` loads every value of the checkpoint (following its chain, every
link verified, :mod:`.chainread`) into whole tensors in this process, then saves
them as a full checkpoint: the result depends on no other checkpoint (links may
then be deleted) and records row digests, so it can be the base of later
incremental saves. Memory: the checkpoint's tensors, whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..api import load, save
from .inspect import inspect

__all__ = ["compact"]


def compact(src: str | Path, dst: str | Path, *, storage_options: Mapping[str, Any] | None = None) -> str:
    """Write the checkpoint ``src`` (full or incremental) as one self-contained checkpoint at ``dst``.

    Run it in one process with no process group (the CLI's ``compact``), or on every rank of one (then it is
    *collective* and every rank holds every tensor). Every link of ``src`` is verified as a load verifies it.

    Args:
        src: a checkpoint written by :func:`~.api.save` (an incremental one: the newest link of its chain).
        dst: where to write the compacted checkpoint (a new path, or a checkpoint this function or ``save``
            wrote, replaced atomically).
        storage_options: for ``s3://`` URLs, the object store's settings (:func:`~.api.save`).

    Returns:
        The save id of the new checkpoint.

    Raises:
        BrokenChainError: a link of ``src``'s chain is gone or was replaced.
        CheckpointError: as :func:`~.api.load` and :func:`~.api.save`.

    Example::

        >>> tdb.checkpoint.compact("/ckpt/step190", "/ckpt/step190-full")
    """
    described = inspect(src, storage_options=storage_options)
    state: dict[str, Any] = {}
    for key, rec in described.items():
        if rec["type"] == "tensor":
            state[key] = torch.empty(rec["shape"], dtype=getattr(torch, rec["dtype"]))
        else:
            state[key] = None
    load(state, src, storage_options=storage_options)
    return save(state, dst, storage_options=storage_options)
