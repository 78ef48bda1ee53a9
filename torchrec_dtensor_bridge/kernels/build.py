"""Compiling ``cpu_kernels.c`` into a shared library, and the per-user cache it is kept in.

Steps of :func:`library` (every process, on first use):

1. The compiler: ``$CC``, else ``cc``, else ``gcc`` on ``$PATH``.
2. The cache directory: ``$TDB_KERNEL_CACHE``, else ``$XDG_CACHE_HOME`` (or ``~/.cache``) /
   ``torchrec_dtensor_bridge``; created 0700 when missing. It is used only when it is a real directory
   (not a symlink) owned by the current user and writable by no one else; otherwise the library is built
   into a fresh private directory (``tempfile.mkdtemp``, removed at exit) and a warning names the refused
   directory and why, once per process.
3. The library's name: :func:`cache_key`, a hash of the source bytes, the machine (architecture, CPU model,
   operating system), the compiler's resolved path and first line of ``--version``, and the arguments of
   every compile attempt in order (:func:`_compile_args`: the flags, the retry's extra flags, the linked
   libraries), built by the same function that builds the commands run.
4. A library already there is used, unless ``rebuild``, when it is a regular file (not a symlink) owned
   by the current user and writable by no one else. Otherwise the source is compiled (with target clones,
   then without, for compilers lacking them) into a temporary file in that directory, renamed over the
   name atomically (racing processes build the same bytes): a refused file is replaced, with a warning.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

__all__ = ["SOURCE", "SOURCES", "cache_dir", "cache_key", "cpu_model", "library", "sources_bytes"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
SOURCES = (SOURCE, SOURCE.with_name("cpu_kernels16.c"))
"""The C sources of the library: fp32 tables, half-precision tables (one shared library)."""
_FLAGS = ("-O3", "-fPIC", "-shared", "-std=c11")
_ATTEMPTS = ((), ("-DTDB_NO_CLONES",))  # per-feature-level copies need GCC 12; else one plain copy
_LIBS = ("-lm",)
_TIMEOUT_S = 120

_fallback: dict[str, Path] = {}  # refused cache directory -> this process's private directory
_fallback_lock = threading.Lock()


def cache_dir() -> Path:
    """Where compiled libraries are kept (step 2), before the ownership check.

    Returns:
        ``$TDB_KERNEL_CACHE``, else ``$XDG_CACHE_HOME`` (or ``~/.cache``) / ``torchrec_dtensor_bridge``.
    """
    env = os.environ.get("TDB_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchrec_dtensor_bridge"


def _compiler() -> str:
    """The compiler to run (step 1): an absolute path when it is found on ``$PATH``."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (set $CC, or install cc)")
    return shutil.which(cc) or cc


@functools.lru_cache(maxsize=None)
def _compiler_version(cc: str) -> str:
    """The first line of ``cc --version`` (else of its stderr); empty when it cannot be run."""
    try:
        proc = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return ((proc.stdout.strip() or proc.stderr.strip()).splitlines() or [""])[0]


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's ``model name`` from ``/proc/cpuinfo``; empty where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            names = [v.strip() for k, _, v in (line.partition(":") for line in f) if k.strip() == "model name"]
    except OSError:
        return ""
    return names[0] if names else ""


def cache_key(source_bytes: bytes, cc: str) -> str:
    """The library's cache key (step 3).

    Args:
        source_bytes: The C source.
        cc: The compiler as it is run (a name on ``$PATH`` or a path).

    Returns:
        20 hex digits of a SHA-256 over the source, the machine, the compiler's identity and the arguments
        of every compile attempt, in the order they are tried.
    """
    path = shutil.which(cc) or cc
    attempts = [_compile_args(extra, out="<out>", source="<source>") for extra in _ATTEMPTS]
    parts: list[bytes | str] = [source_bytes, platform.machine(), cpu_model(), platform.system(),
                                os.path.realpath(path), _compiler_version(path), repr(attempts)]
    h = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else part.encode()
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:20]


def _problem(path: Path, *, directory: bool) -> str | None:
    """Why ``path`` must not be trusted (``None`` when it may): a symlink, the wrong kind, another owner,
    or writable by group or others. Raises ``FileNotFoundError`` when it does not exist."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "a symlink"
    if not (stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)):
        return "not a directory" if directory else "not a regular file"
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not {os.getuid()}"
    writable = [who for who, bit in (("group", stat.S_IWGRP), ("world", stat.S_IWOTH)) if st.st_mode & bit]
    return " and ".join(writable) + "-writable" if writable else None


def _trusted_dir(cache: Path) -> Path:
    """``cache`` (created 0700 when missing) if it passes :func:`_problem`, else a private directory."""
    try:
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        why = _problem(cache, directory=True)
    except OSError as e:
        why = f"cannot create it: {e.strerror or e}"
    if why is None:
        return cache
    with _fallback_lock:
        private = _fallback.get(str(cache))
        if private is None:
            private = Path(tempfile.mkdtemp(prefix="tdb-kernels-"))
            atexit.register(shutil.rmtree, private, ignore_errors=True)
            _fallback[str(cache)] = private
            log.warning("torchrec_dtensor_bridge: not using kernel cache %s (%s); building into %s",
                        cache, why, private)
    if (again := _problem(private, directory=True)) is not None:
        raise RuntimeError(f"private kernel directory {private} is {again}")
    return private


def _compile_args(extra: tuple[str, ...], *, out: str, source: str | Sequence[str]) -> list[str]:
    """The compiler's arguments for one attempt of :data:`_ATTEMPTS`: what :func:`_compile` runs and what
    :func:`cache_key` hashes, so that no flag, retry or library can change without a new key."""
    sources = [source] if isinstance(source, str) else list(source)
    return [*_FLAGS, *extra, "-o", out, *sources, *_LIBS]


def sources_bytes(sources: Sequence[Path]) -> bytes:
    """What :func:`cache_key` hashes of the sources: one file's bytes, or each file's bytes after its length."""
    if len(sources) == 1:
        return sources[0].read_bytes()
    return b"".join(len(data).to_bytes(8, "little") + data for data in (p.read_bytes() for p in sources))


def _compile(cc: str, source: Sequence[Path], target: Path) -> None:
    """Compile ``source`` into a temporary file beside ``target``, then rename it over ``target``."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".cpu_kernels-", suffix=".so")
    os.close(fd)
    try:
        for extra in _ATTEMPTS:
            try:
                proc = subprocess.run([cc, *_compile_args(extra, out=tmp, source=[str(p) for p in source])],
                                      capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise RuntimeError(f"C compiler {cc} could not compile {source} (limit {_TIMEOUT_S} s): {e}") from e
            if proc.returncode == 0:
                break
        else:
            raise RuntimeError(f"{cc} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o700)  # whatever the umask, writable by this user only
        os.replace(tmp, target)  # atomic: a racing process builds the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library(source: Path | Sequence[Path] = SOURCES, cache: Path | None = None, *, rebuild: bool = False) -> Path:
    """The compiled library for ``source``, built unless a trusted one is already cached.

    Args:
        source: The C source file, or files compiled into one library.
        cache: The cache directory; :func:`cache_dir` when ``None``.
        rebuild: Compile even when a library is cached, replacing it atomically (for a library that
            failed to load).

    Returns:
        The path of the shared library, to load with :mod:`ctypes`.

    Raises:
        RuntimeError: No C compiler, or it failed (with the tail of its stderr) or timed out.
    """
    sources = (source,) if isinstance(source, Path) else tuple(source)
    cc = _compiler()
    directory = _trusted_dir(cache_dir() if cache is None else cache)
    target = directory / f"cpu_kernels-{cache_key(sources_bytes(sources), cc)}.so"
    if not rebuild:
        try:
            why = _problem(target, directory=False)
        except FileNotFoundError:
            why = "missing"
        except OSError as e:
            why = f"cannot stat it: {e.strerror or e}"
        if why is None:
            return target
        if why != "missing":
            log.warning("torchrec_dtensor_bridge: not loading cached kernel library %s (%s); rebuilding it",
                        target, why)
    _compile(cc, sources, target)
    return target
