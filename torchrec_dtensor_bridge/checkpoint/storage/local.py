"""A POSIX file system as checkpoint storage: keys are absolute paths.

Atomicity comes from the file system: ``put`` and ``swap_pointer`` write a
temporary file, ``fsync`` it and ``rename`` it over the old one (then ``fsync``
the directory); ``swap_pointer`` compares and swaps under an ``flock`` of a
lock file beside the pointer. Locks are ``flock``: the kernel drops them when
their holder dies, so a killed process never leaves one stuck.

Large objects (``create``) are rewritten in place when they exist (a reused
generation's data files): overwriting allocated, cached blocks is faster than
freeing and reallocating them (BENCHMARKS.md, "Checkpoints"); the file is cut
to what was written and fsynced when the stream closes.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pathlib
import shutil
import stat
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, BinaryIO

import numpy as np

from .base import Conflict, Handle, Loc, Lock, NotAnObject, Storage

__all__ = ["LocalLock", "LocalStorage", "Scratch"]


def fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _File(Handle):
    def __init__(self, key: str) -> None:
        self._fd = os.open(key, os.O_RDONLY)
        self.size = os.fstat(self._fd).st_size

    def readinto(self, buf: memoryview, offset: int) -> int:
        done = 0
        while done < len(buf):
            n = os.preadv(self._fd, [buf[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class LocalLock(Lock):
    """An ``flock`` on a file or directory, taken without waiting; ``held`` says whether it was granted."""

    def __init__(self, target: str, *, exclusive: bool, create: bool = False) -> None:
        self.target = target
        flags = os.O_RDWR | os.O_CREAT if create else os.O_RDONLY
        self._fd: int | None = os.open(target, flags, 0o644)
        try:
            fcntl.flock(self._fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            self.held = True
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                self.release()
                raise
            self.held = False

    def still_holds(self) -> bool:
        """Whether the path still names the locked file (not renamed, removed or replaced)."""
        try:
            return self._fd is not None and os.stat(self.target).st_ino == os.fstat(self._fd).st_ino
        except OSError:
            return False

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock
            self._fd = None


class LocalStorage(Storage):
    """The local file system (see the module docstring)."""

    renames = True

    def show(self, key: str) -> str:
        return key

    def join(self, key: str, name: str) -> str:
        return os.path.join(key, name)

    def split(self, key: str) -> tuple[str, str]:
        return os.path.split(key)

    def size(self, key: str) -> int | None:
        try:
            st = os.lstat(key)
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            return None
        if not stat.S_ISREG(st.st_mode):
            raise NotAnObject(f"{key} is not a regular file")
        return st.st_size

    def open_read(self, key: str) -> Handle:
        return _File(key)

    def get(self, key: str, limit: int) -> bytes:
        with open(key, "rb") as f:
            return f.read(limit)

    def put(self, key: str, data: bytes) -> None:
        d, name = os.path.split(key)
        tmp = os.path.join(d, f".{name}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, key)

    @contextmanager
    def create(self, key: str) -> Generator[BinaryIO, None, None]:
        with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o644), "wb") as f:
            yield f
            f.flush()
            f.truncate(f.tell())
            os.fsync(f.fileno())

    def list(self, key: str) -> list[str]:
        return sorted(os.listdir(key))

    def kind(self, key: str) -> str | None:
        try:
            st = os.lstat(key)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if stat.S_ISLNK(st.st_mode):
            return "link"
        return "dir" if stat.S_ISDIR(st.st_mode) else "object"

    def delete(self, key: str) -> None:
        try:
            os.unlink(key)
        except FileNotFoundError:
            pass

    def delete_tree(self, key: str) -> None:
        if os.path.islink(key) or os.path.isfile(key):
            self.delete(key)
        else:
            shutil.rmtree(key, ignore_errors=True)

    def make_dir(self, key: str) -> None:
        os.makedirs(key, exist_ok=True)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)
        fsync_dir(os.path.dirname(dst) or ".")

    def link_target(self, key: str) -> str | None:
        return os.readlink(key) if os.path.islink(key) else None

    def check_parents(self, key: str) -> None:
        for parent in pathlib.Path(key).parents:
            if parent.is_dir():
                return
            if parent.exists() or parent.is_symlink():
                what = "a file" if parent.exists() else "a broken symbolic link"
                raise NotADirectoryError(
                    f"cannot save to {key}: {parent} is {what}, not a directory (a checkpoint's parent directories "
                    "must be directories, or not exist yet: they are created); choose another path, or move "
                    f"{parent} away"
                )

    def read_pointer(self, key: str) -> tuple[bytes, Any] | None:
        try:
            fd = os.open(key, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise NotAnObject(f"{key} is a symbolic link, not a commit record") from None
            raise
        with open(fd, "rb") as f:
            data = f.read(1 << 20)
        return data, data

    def swap_pointer(self, key: str, data: bytes, expected: Any) -> None:
        d, name = os.path.split(key)
        fd = os.open(os.path.join(d, f".{name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for a read, a write and a rename
            now = self.read_pointer(key)
            if (now[1] if now is not None else None) != expected:
                raise Conflict(f"{key} changed since it was read")
            self.put(key, data)
            fsync_dir(d)
        finally:
            os.close(fd)

    def lock(self, key: str, *, exclusive: bool) -> Lock | None:
        try:
            lock = LocalLock(key, exclusive=exclusive, create=exclusive and self.kind(key) != "dir")
        except FileNotFoundError:
            return None
        if not lock.held or not lock.still_holds():
            lock.release()
            return None
        return lock


class Scratch:
    """A private local directory of scratch files, each mapped into memory copy-on-write (``mapped``: writable,
    the file kept as its backing), removed with everything in it when the ``with`` block ends."""

    def __init__(self, where: Loc) -> None:
        self.dir = where.key

    def __enter__(self) -> Scratch:
        os.makedirs(self.dir, exist_ok=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def create(self, name: str) -> BinaryIO:
        return open(os.path.join(self.dir, name), "wb")

    def mapped(self, name: str, nbytes: int) -> np.ndarray:
        return np.memmap(os.path.join(self.dir, name), dtype=np.uint8, mode="c", shape=(nbytes,))
