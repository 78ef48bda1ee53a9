"""The native kernel cache (kernels/build.py): a private cache directory, reuse without compiling, refusal of
directories and library files that others own or can write (or that are symlinks), a cache key that follows
the source, the compiler's identity and every argument the compiler is run with (flags, linked libraries, the
retry list), and ``rebuild=True`` replacing a library that does not load. Real
compiler, real files. The kernels' own source is built where it is the subject (a fresh cache, a one-byte
change of it); elsewhere a one-function source (``stub``), which the cache treats alike and which compiles
in a fraction of the time."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import stat
from pathlib import Path

import pytest

from torchrec_dtensor_bridge.kernels import build

REAL_CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(REAL_CC is None, reason="needs a C compiler (cc or gcc)")


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch, caplog):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("TDB_KERNEL_CACHE", raising=False)
    caplog.set_level(logging.WARNING, logger=build.__name__)
    build._compiler_version.cache_clear()


def _loads(path: Path) -> bool:
    return isinstance(ctypes.CDLL(str(path)).tdb_version(), int)


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def _warnings(caplog, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and needle in r.getMessage()]


def _plain_target(cache: Path, source: Path | tuple[Path, ...] = build.SOURCES) -> Path:
    """Where ``library(source, cache)`` puts the library with the default compiler."""
    sources = (source,) if isinstance(source, Path) else source
    return cache / f"cpu_kernels-{build.cache_key(build.sources_bytes(sources), str(REAL_CC))}.so"


@pytest.fixture
def stub(tmp_path) -> Path:
    """A one-function kernel source (what ``_loads`` calls)."""
    path = tmp_path / "stub" / "cpu_kernels.c"
    path.parent.mkdir()
    path.write_text("int tdb_version(void) { return 1; }\n")
    return path


def test_fresh_cache_dir_is_private_and_library_loads(tmp_path, monkeypatch):
    cache = tmp_path / "a" / "cache"
    monkeypatch.setenv("TDB_KERNEL_CACHE", str(cache))
    path = build.library()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert path == _plain_target(cache) and path.name.startswith("cpu_kernels-")
    assert [p.name for p in cache.iterdir()] == [path.name], "no temporary file is left"
    assert path.stat().st_mode & 0o022 == 0
    assert _loads(path)


def test_second_call_reuses_without_compiling(tmp_path, monkeypatch, stub):
    log = tmp_path / "cc.log"
    monkeypatch.setenv("CC", str(_script(tmp_path / "logcc", f'echo "$*" >> {log}\nexec {REAL_CC} "$@"')))
    first = build.library(stub, cache=tmp_path / "c")
    compiles = [line for line in log.read_text().splitlines() if "-shared" in line]
    assert len(compiles) >= 1
    before = first.stat()
    build._compiler_version.cache_clear()  # as in a new process: the compiler is asked its version again
    assert build.library(stub, cache=tmp_path / "c") == first
    assert [line for line in log.read_text().splitlines() if "-shared" in line] == compiles, "compiled again"
    after = first.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


@pytest.mark.parametrize(("spoil", "why"), [(0o770, "group-writable"), (0o777, "world-writable"),
                                            ("symlink", "a symlink")])
def test_untrusted_cache_dir_is_refused(tmp_path, caplog, spoil, why, stub):
    bad = tmp_path / "bad"
    if spoil == "symlink":
        (tmp_path / "real").mkdir(mode=0o700)
        bad.symlink_to(tmp_path / "real")
    else:
        bad.mkdir()
        bad.chmod(spoil)
    path = build.library(stub, cache=bad)
    assert path.parent != bad and bad not in path.parents and bad.resolve() not in path.parents
    assert list(bad.iterdir()) == []
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and path.parent.name.startswith("tdb-kernels-")
    assert _loads(path)
    (message,) = _warnings(caplog, str(bad))
    assert why in message
    caplog.clear()
    assert build.library(stub, cache=bad) == path, "the private directory is reused within the process"
    assert _warnings(caplog, str(bad)) == [], "warned once"


def test_cache_dir_owned_by_another_user_is_refused(tmp_path, caplog, stub):
    if os.getuid() != 0:
        pytest.skip("giving a directory to another uid (chown) needs root")
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    try:
        os.chown(other, 12345, -1)
    except PermissionError as e:
        pytest.skip(f"chown to uid 12345 is not permitted here: {e}")
    path = build.library(stub, cache=other)
    assert other not in path.parents and list(other.iterdir()) == []
    assert _loads(path)
    (message,) = _warnings(caplog, str(other))
    assert "owned by uid 12345" in message


@pytest.mark.parametrize("spoil", ["group-writable", "a symlink", "owned by uid 12345"])
def test_untrusted_library_file_is_rebuilt_not_loaded(tmp_path, caplog, spoil, stub):
    """A refused library in a good directory is replaced in place (atomically) by a fresh build."""
    cache = tmp_path / "c"
    cache.mkdir(mode=0o700)
    target, decoy = _plain_target(cache, stub), tmp_path / "decoy.so"
    decoy.write_bytes(b"not a library")
    if spoil == "a symlink":
        target.symlink_to(decoy)
    else:
        target.write_bytes(b"not a library")
        target.chmod(0o664 if spoil == "group-writable" else 0o600)
        if spoil.startswith("owned"):
            if os.getuid() != 0:
                pytest.skip("giving a file to another uid (chown) needs root")
            os.chown(target, 12345, -1)
    assert build.library(stub, cache=cache) == target
    st = target.lstat()
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o022 == 0
    assert target.read_bytes()[:4] == b"\x7fELF" and decoy.read_bytes() == b"not a library"
    assert _loads(target)
    (message,) = _warnings(caplog, str(target))
    assert spoil in message
    assert sorted(p.name for p in cache.iterdir()) == [target.name]


@pytest.mark.parametrize("changed", [pytest.param(0, marks=pytest.mark.slow), 1], ids=["fp32_source", "half_source"])
def test_source_change_builds_new_library(tmp_path, changed):
    """A change to either of the library's sources is a new library."""
    sources, cache = tuple(tmp_path / p.name for p in build.SOURCES), tmp_path / "c"
    for src, dst in zip(build.SOURCES, sources):
        shutil.copyfile(src, dst)
    first = build.library(sources, cache)
    with open(sources[changed], "a") as f:
        f.write("/* x */\n")
    second = build.library(sources, cache)
    assert second != first and first.exists() and second.exists()
    assert second.stat().st_mtime_ns >= first.stat().st_mtime_ns and _loads(second)


def test_key_changes_with_compiler_identity(tmp_path, monkeypatch, stub):
    src = build.SOURCE.read_bytes()
    plain = build.cache_key(src, str(REAL_CC))
    assert len(plain) >= 16 and int(plain, 16) >= 0 and build.cache_key(src, str(REAL_CC)) == plain
    assert build.cache_key(src + b" ", str(REAL_CC)) != plain
    fake = tmp_path / "fakecc"
    _script(fake, f'[ "$1" = --version ] && {{ echo "fakecc 1.0"; exit 0; }}\nexec {REAL_CC} "$@"')
    wrapped = build.cache_key(src, str(fake))
    assert wrapped != plain
    # The same path, a new version (an upgrade in place): a new key.
    _script(fake, f'[ "$1" = --version ] && {{ echo "fakecc 2.0"; exit 0; }}\nexec {REAL_CC} "$@"')
    build._compiler_version.cache_clear()
    assert build.cache_key(src, str(fake)) not in (plain, wrapped)
    monkeypatch.setenv("CC", str(fake))
    assert build.library(stub, cache=tmp_path / "c").name == (
        f"cpu_kernels-{build.cache_key(stub.read_bytes(), str(fake))}.so")


# What defines the build besides the source and the compiler: each changed alone must give a new key. A probe
# macro and ``-lc`` are harmless to add to any compile, so the end-to-end test below builds with them.
BUILD_CHANGES = {
    "flags": ("_FLAGS", lambda: (*build._FLAGS, "-DTDB_KEY_PROBE")),
    "flag order": ("_FLAGS", lambda: build._FLAGS[::-1]),
    "libraries": ("_LIBS", lambda: (*build._LIBS, "-lc")),
    "retry added": ("_ATTEMPTS", lambda: (*build._ATTEMPTS, ("-DTDB_KEY_PROBE",))),
    "retry dropped": ("_ATTEMPTS", lambda: build._ATTEMPTS[:1]),
    "retry order": ("_ATTEMPTS", lambda: build._ATTEMPTS[::-1]),
    "retry's flags": ("_ATTEMPTS", lambda: tuple((*extra, "-DTDB_KEY_PROBE") for extra in build._ATTEMPTS)),
}


@pytest.mark.parametrize("change", sorted(BUILD_CHANGES))
def test_key_changes_with_each_part_of_the_build(monkeypatch, change):
    """A key without the flags, the linked libraries or the retry list would load a library built another way."""
    src = build.SOURCE.read_bytes()
    plain = build.cache_key(src, str(REAL_CC))
    name, changed = BUILD_CHANGES[change]
    assert len(build._ATTEMPTS) >= 2 and build._LIBS, "the cases above assume a retry and a linked library"
    with monkeypatch.context() as m:
        m.setattr(build, name, changed())
        assert build.cache_key(src, str(REAL_CC)) != plain, f"{change}: same key"
    assert build.cache_key(src, str(REAL_CC)) == plain, f"{change}: undone, the key differs"


def test_key_stays_when_nothing_changes(monkeypatch):
    """Equal values (new objects, as in a new process) and a second call give the same key."""
    src = build.SOURCE.read_bytes()
    plain = build.cache_key(src, str(REAL_CC))
    assert build.cache_key(bytes(src), str(REAL_CC)) == plain
    monkeypatch.setattr(build, "_FLAGS", tuple(list(build._FLAGS)))
    monkeypatch.setattr(build, "_LIBS", tuple(list(build._LIBS)))
    monkeypatch.setattr(build, "_ATTEMPTS", tuple(tuple(list(a)) for a in build._ATTEMPTS))
    build._compiler_version.cache_clear()
    assert build.cache_key(src, str(REAL_CC)) == plain
    keys = {build.cache_key(src, str(REAL_CC)) for _ in range(3)}
    assert keys == {plain}


@pytest.mark.parametrize("change", ["flags", "libraries", "retry added", "retry order"])
def test_library_name_follows_the_compiler_command(tmp_path, monkeypatch, stub, change):
    """End to end: when what the compiler is run with changes, the cached library is not reused but built anew
    under another name (the compiler's log shows the new command)."""
    log = tmp_path / "cc.log"
    monkeypatch.setenv("CC", str(_script(tmp_path / "logcc", f'echo "$*" >> {log}\nexec {REAL_CC} "$@"')))
    cache = tmp_path / "c"

    def compiles() -> list[str]:
        return [line for line in log.read_text().splitlines() if "-shared" in line] if log.exists() else []

    first = build.library(stub, cache=cache)
    before = compiles()
    assert build.library(stub, cache=cache) == first and compiles() == before, "nothing changed: reused"
    name, changed = BUILD_CHANGES[change]
    monkeypatch.setattr(build, name, changed())
    second = build.library(stub, cache=cache)
    new = compiles()[len(before):]
    assert new and new[0] != before[0], "the compiler ran with the changed arguments"
    assert second != first and first.exists() and _loads(second)
    assert build.library(stub, cache=cache) == second and compiles()[len(before):] == new, "then reused"


def test_rebuild_replaces_a_library_that_does_not_load(tmp_path, stub):
    cache = tmp_path / "c"
    path = build.library(stub, cache=cache)
    path.write_bytes(path.read_bytes()[:100])  # truncated
    with pytest.raises(OSError):
        ctypes.CDLL(str(path))
    assert build.library(stub, cache=cache) == path and path.stat().st_size == 100, "a trusted file is used as is"
    assert build.library(stub, cache=cache, rebuild=True) == path
    assert path.stat().st_size > 100 and _loads(path)
    assert [p.name for p in cache.iterdir()] == [path.name]


def test_compiler_failure_is_a_clear_error(tmp_path, monkeypatch):
    cache = tmp_path / "c"
    monkeypatch.setenv("CC", str(_script(tmp_path / "badcc", 'echo "boom: no such luck" >&2\nexit 3')))
    with pytest.raises(RuntimeError, match="boom: no such luck"):
        build.library(cache=cache)
    assert list(cache.iterdir()) == [], "nothing half-written is left"
    monkeypatch.setenv("CC", str(tmp_path / "missing-cc"))
    with pytest.raises(RuntimeError, match="missing-cc"):
        build.library(cache=cache)
