"""The one boundary between checkpoints and where their bytes live (:mod:`.base`: the operations and their
atomicity); one module per backend: :mod:`.local` (a POSIX file system, the default), :mod:`.s3` (an
S3-compatible object store). :func:`locate` turns what a user passes (a path, an ``s3://`` URL) into a
:class:`~.base.Loc`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .base import Conflict, Handle, Loc, Lock, NotAnObject, Storage
from .local import LocalStorage
from .s3 import s3_location

__all__ = ["Conflict", "Handle", "Loc", "Lock", "NotAnObject", "Storage", "is_url", "locate"]

_LOCAL = LocalStorage()


def is_url(path: object) -> bool:
    """Whether ``path`` names an object store (``s3://...``) rather than a local path."""
    return isinstance(path, str) and path.startswith("s3://")


def locate(path: str | os.PathLike[str] | Loc, storage_options: Mapping[str, Any] | None = None) -> Loc:
    """The :class:`Loc` of a local path (made absolute) or of an ``s3://bucket/key`` URL.

    ``storage_options`` configure the object store (fsspec's convention: ``endpoint_url``, ``key``, ``secret``,
    ``region``, ``client_kwargs``; see :mod:`.s3`); the standard AWS variables apply where they say nothing.
    """
    if isinstance(path, Loc):
        return path
    if is_url(path):
        return s3_location(str(path), storage_options)
    if storage_options:
        raise ValueError(f"storage_options apply to object stores (s3://...), not to the local path {path}")
    return Loc(_LOCAL, str(Path(path).absolute()))
