"""The one boundary between checkpoints and where their bytes live: a local disk or an S3-compatible store.

Every byte the checkpoint package reads or writes goes through a :class:`Storage`;
no other module of the package opens, renames, locks or removes a file. A
backend is one module (S3 with its object streams beside it): :mod:`.local` (a POSIX file system, the default),
:mod:`.s3` (an S3-compatible object store; :mod:`.s3_streams`).
Code above this boundary names things by :class:`Loc`: a storage and a key,
joined with ``/`` like a ``pathlib.Path`` and printed as the user wrote it (a
path, or ``s3://bucket/key``).

The operations, and what each promises (numbered as the commit protocol of
:mod:`..commit` cites them):

1. ``size(key)``: the size of the object at ``key``, ``None`` if there is none;
   a directory or link in its place raises :class:`NotAnObject`.
2. ``open_read(key)``: a handle of the object's bytes for ranged reads
   (``readinto(buf, offset)``), its size fixed at open, and its ``version``:
   on an object store the object's ETag at open, which every read of the
   handle is conditional on (``None`` on a local disk).
3. ``get(key, limit)``: a small object whole (at most ``limit`` bytes read).
4. ``put(key, data)``: a small object written whole; a reader sees the old
   object or the new one, never a part; durable when it returns.
5. ``create(key)``: a stream for a large object written from its start;
   durable when the stream closes without error. Until then readers may see
   nothing (S3) or a part (local): only ever inside an uncommitted generation.
   Once closed, the stream's ``version`` is the object's as a handle opened
   on it would report it while it is unchanged (its ETag; ``None`` locally).
6. ``list(key)``: the names directly under ``key`` (one level).
7. ``kind(key)``: ``"object"``, ``"dir"`` (something lies under it), ``"link"``
   (local only) or ``None``.
8. ``delete(key)`` / ``delete_tree(key)``: an object / everything under a key.
9. ``read_pointer(key)`` and ``swap_pointer(key, data, expected)``: the atomic
   step. ``swap_pointer`` replaces the pointer object only if it is still the
   one ``read_pointer`` returned (its token; ``None``: only if there is none)
   and raises :class:`Conflict` otherwise: a rename under a lock on POSIX, a
   conditional put (``If-Match`` on the ETag, ``If-None-Match: *``) on S3.
10. ``lock(key, exclusive=)``: a lock on a key, taken without waiting (``None``
    when another holder has it), released by its ``release()`` or by the death
    of its holder: ``flock`` on POSIX; on S3 an exclusive lock is a lease
    object renewed while held and taken over once expired, and a shared lock
    is granted at once (readers are protected by a grace period instead: see
    :mod:`..commit`).
11. ``rename(src, dst)`` (only where ``renames`` is true): a directory or
    object renamed atomically (the local double-buffered spare).

Example::

    >>> loc = locate("s3://bucket/ckpt/step100")  # storage.locate
    >>> (loc / "tdb_commit.json").get(1 << 20)
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, BinaryIO

__all__ = ["Conflict", "Handle", "Loc", "Lock", "NotAnObject", "Storage"]


class Conflict(Exception):
    """``swap_pointer`` found another pointer than the one expected (another saver committed first)."""


class NotAnObject(Exception):
    """A directory, link or other non-object lies where an object was expected."""


class Handle(abc.ABC):
    """An object opened for ranged reads (operation 2)."""

    size: int
    version: str | None = None  # the object's ETag at open, which every read is conditional on (object stores)

    @abc.abstractmethod
    def readinto(self, buf: memoryview, offset: int) -> int:
        """Fill ``buf`` from byte ``offset``; the bytes read (fewer only at the end of the object)."""

    def close(self) -> None:
        """Release what the handle holds."""


class Lock(abc.ABC):
    """A held lock (operation 10)."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give the lock up (idempotent)."""

    def still_holds(self) -> bool:
        """Whether the lock is still this holder's (a lease may have been lost)."""
        return True


class Storage(abc.ABC):
    """Where a checkpoint's bytes live; the operations of the module docstring."""

    renames: bool = False
    scheme: str = ""

    @abc.abstractmethod
    def show(self, key: str) -> str:
        """How messages name ``key`` (a path, or ``s3://bucket/key``)."""

    @abc.abstractmethod
    def size(self, key: str) -> int | None: ...

    @abc.abstractmethod
    def open_read(self, key: str) -> Handle: ...

    @abc.abstractmethod
    def get(self, key: str, limit: int) -> bytes: ...

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def create(self, key: str) -> AbstractContextManager[BinaryIO]: ...

    @abc.abstractmethod
    def list(self, key: str) -> list[str]: ...

    @abc.abstractmethod
    def kind(self, key: str) -> str | None: ...

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def delete_tree(self, key: str) -> None: ...

    @abc.abstractmethod
    def read_pointer(self, key: str) -> tuple[bytes, Any] | None: ...

    @abc.abstractmethod
    def swap_pointer(self, key: str, data: bytes, expected: Any) -> None: ...

    @abc.abstractmethod
    def lock(self, key: str, *, exclusive: bool) -> Lock | None: ...

    def make_dir(self, key: str) -> None:
        """Create the directory ``key`` and its parents (object stores have none to create)."""

    def link_target(self, key: str) -> str | None:
        """What the symbolic link ``key`` names (local disks: the layout of earlier releases), else ``None``."""
        return None

    def check_parents(self, key: str) -> None:
        """Raise ``NotADirectoryError`` if an existing ancestor of ``key`` is not a directory (local disks)."""

    def rename(self, src: str, dst: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot rename")

    def join(self, key: str, name: str) -> str:
        return f"{key.rstrip('/')}/{name}" if key else name

    def split(self, key: str) -> tuple[str, str]:
        head, _, tail = key.rstrip("/").rpartition("/")
        return head, tail


class Loc:
    """A key in a storage, used like a ``pathlib.Path``: ``loc / "name"``, ``.parent``, ``.name``, ``str(loc)``."""

    __slots__ = ("storage", "key")

    def __init__(self, storage: Storage, key: str) -> None:
        self.storage = storage
        self.key = key

    def __truediv__(self, name: str) -> Loc:
        return Loc(self.storage, self.storage.join(self.key, name))

    @property
    def parent(self) -> Loc:
        return Loc(self.storage, self.storage.split(self.key)[0])

    @property
    def name(self) -> str:
        return self.storage.split(self.key)[1]

    def __str__(self) -> str:
        return self.storage.show(self.key)

    def __fspath__(self) -> str:
        if self.storage.scheme:
            raise TypeError(f"{self} is not a local path")
        return self.key

    def __repr__(self) -> str:
        return f"Loc({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Loc) and other.storage is self.storage and other.key == self.key

    def __hash__(self) -> int:
        return hash((id(self.storage), self.key))

    @property
    def local(self) -> bool:
        """Whether this is a path of the local file system."""
        return not self.storage.scheme

    # The operations, on this key (see the module docstring).
    def size(self) -> int | None:
        return self.storage.size(self.key)

    def open_read(self) -> Handle:
        return self.storage.open_read(self.key)

    def get(self, limit: int) -> bytes:
        return self.storage.get(self.key, limit)

    def put(self, data: bytes) -> None:
        self.storage.put(self.key, data)

    def create(self) -> AbstractContextManager[BinaryIO]:
        return self.storage.create(self.key)

    def list(self) -> list[str]:
        return self.storage.list(self.key)

    def iterdir(self) -> Iterator[Loc]:
        return (self / n for n in self.list())

    def kind(self) -> str | None:
        return self.storage.kind(self.key)

    def exists(self) -> bool:
        return self.kind() is not None

    def delete(self) -> None:
        self.storage.delete(self.key)

    def delete_tree(self) -> None:
        self.storage.delete_tree(self.key)

    def make_dir(self) -> None:
        self.storage.make_dir(self.key)

    def read_pointer(self) -> tuple[bytes, Any] | None:
        return self.storage.read_pointer(self.key)

    def swap_pointer(self, data: bytes, expected: Any) -> None:
        self.storage.swap_pointer(self.key, data, expected)

    def lock(self, *, exclusive: bool) -> Lock | None:
        return self.storage.lock(self.key, exclusive=exclusive)

    def rename(self, dst: Loc) -> None:
        self.storage.rename(self.key, dst.key)

    def link_target(self) -> str | None:
        return self.storage.link_target(self.key)
