"""Checkpoints as hostile input, in one process: every byte of ``.metadata`` and the manifest flipped,
truncation, deletion, replacement, pickle payloads, glob characters in names, a full disk."""

import json
import os
import pickle
import resource
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.checkpoint.format import manifest as mf
from torchrec_dtensor_bridge.checkpoint.format.validate import parse_metadata

from ..checkpoint_writers import rewrite_manifest
from ..distributed.checks import reference_table
from tests.layout import committed, generations


def _state(seed):
    return {
        "a": reference_table((40, 6), seed=seed),
        "b": {"c": reference_table((7,), seed=seed + 1)},
        "step": torch.tensor(seed),
        "cfg": {"lr": 0.5 * seed, "name": f"run{seed}"},
    }


def _blank():
    return {"a": torch.full((40, 6), -1.0), "b": {"c": torch.full((7,), -1.0)}, "step": torch.tensor(-1),
            "cfg": {"lr": -1.0, "name": ""}}


def _equal(got, want):
    return (torch.equal(got["a"], want["a"]) and torch.equal(got["b"]["c"], want["b"]["c"])
            and torch.equal(got["step"], want["step"]) and got["cfg"] == want["cfg"])


def _try_load(path, dest=None):
    """(exception or None, destination)."""
    dest = _blank() if dest is None else dest
    try:
        tdb.checkpoint.load(dest, path)
    except Exception as e:  # noqa: BLE001 - what the load raised is the subject of the test
        return e, dest
    return None, dest


def _flip_all(tmp_path, target, stride):
    path = tmp_path / "ck"
    want = _state(3)
    tdb.checkpoint.save(want, path)
    f = committed(path) / target
    orig = f.read_bytes()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    outcomes = {"refused": 0, "loaded": 0}
    for i in range(0, len(orig), stride):
        for mask in (0x01, 0x80):
            raw = bytearray(orig)
            raw[i] ^= mask
            f.write_bytes(bytes(raw))
            err, dest = _try_load(path)
            if err is None:
                assert _equal(dest, want), f"byte {i} ^ {mask:#x} of {target}: loaded wrong values silently"
                outcomes["loaded"] += 1
            else:
                assert isinstance(err, tdb.checkpoint.CheckpointError), (i, type(err), err)
                assert target in str(err), f"byte {i} ^ {mask:#x}: error does not name {target}: {err}"
                outcomes["refused"] += 1
    f.write_bytes(orig)
    err, dest = _try_load(path)
    assert err is None and _equal(dest, want)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert grown < 512, f"flips of {target} grew the process by {grown:.0f} MiB"
    return outcomes, time.monotonic() - t0, len(orig)


@pytest.mark.parametrize("target", [".metadata", "tdb_manifest.json"])
def test_every_byte_of_records_flipped(tmp_path, target):
    """Every byte flipped twice (lowest and highest bit), one load each, in one process."""
    outcomes, seconds, n = _flip_all(tmp_path, target, stride=1)
    assert outcomes["refused"] + outcomes["loaded"] == 2 * n and outcomes["refused"] > 0, outcomes
    assert seconds < 120, f"{2 * n} loads took {seconds:.0f}s"


@pytest.mark.parametrize("target", [".metadata", "tdb_manifest.json"])
@pytest.mark.parametrize("damage", ["truncate", "delete", "replace", "empty"])
def test_truncated_deleted_replaced_records(tmp_path, target, damage):
    path, other = tmp_path / "ck", tmp_path / "other"
    want = _state(3)
    tdb.checkpoint.save(want, path)
    tdb.checkpoint.save(_state(4), other)  # same keys and shapes, another save
    f = committed(path) / target
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "delete":
        f.unlink()
    elif damage == "empty":
        f.write_bytes(b"")
    else:
        shutil.copy(committed(other) / target, f)
    err, dest = _try_load(path)
    assert err is not None, f"{damage} {target}: loaded"
    assert isinstance(err, tdb.checkpoint.CheckpointError), (type(err), err)
    name = target if not (damage == "delete" and target == "tdb_manifest.json") else "no checksum manifest"
    assert name in str(err), err
    assert _equal(dest, _blank()), "a refused load modified the destination"


def _evil_pickle(marker):
    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    return pickle.dumps(Payload())


def _rewrite_manifest(root, **changes):
    body = mf.read_manifest(root)
    body.update(changes)
    rewrite_manifest(root, body)


def test_pickle_payload_in_metadata_runs_nothing(tmp_path):
    """A crafted ``.metadata`` with its checksum recomputed (an attacker controls every file)."""
    path, marker = tmp_path / "ck", tmp_path / "marker"
    tdb.checkpoint.save(_state(1), path)
    root = committed(path)
    evil = _evil_pickle(marker)
    (root / ".metadata").write_bytes(evil)
    import xxhash

    _rewrite_manifest(root, metadata={"size": len(evil), "xxh3_64": xxhash.xxh3_64(evil).hexdigest()})
    err, dest = _try_load(path)
    assert err is not None and ".metadata" in str(err) and "refers to io.open" in str(err), err
    with pytest.raises(tdb.checkpoint.CheckpointError, match="refers to io.open"):
        tdb.checkpoint.inspect(path)
    with pytest.raises(tdb.checkpoint.CheckpointError, match="refers to io.open"):
        tdb.checkpoint.migrate(path, tmp_path / "new", progress=False)
    assert not marker.exists(), "a checkpoint ran code"
    assert not (tmp_path / "new").exists()


def test_pickle_payload_in_an_object_item_runs_nothing(tmp_path):
    path, marker = tmp_path / "ck", tmp_path / "marker"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    state = _state(1)
    state["cfg"] = Payload()
    tdb.checkpoint.save(state, path)  # pickles the payload; nothing runs at save
    assert not marker.exists()
    err, dest = _try_load(path, dict(_blank(), cfg=None))
    assert isinstance(err, tdb.checkpoint.CheckpointError), err
    assert "key 'cfg'" in str(err) and "weights_only" in str(err) and "trusted_pickles" in str(err), err
    assert not marker.exists(), "an object item ran code"
    assert _equal(dict(dest, cfg=_blank()["cfg"]), _blank()) and dest["cfg"] is None


def test_metadata_with_a_gap_is_refused_before_reading(tmp_path):
    """A chunk shrunk in ``.metadata`` (checksums recomputed): the chunks no longer tile the tensor."""
    import xxhash

    path = tmp_path / "ck"
    tdb.checkpoint.save(_state(1), path)
    root = committed(path)
    md = parse_metadata((root / ".metadata").read_bytes(), "x")
    chunk = md.state_dict_metadata["a"].chunks[0]
    chunk.sizes = torch.Size([30, 6])
    raw = pickle.dumps(md)
    (root / ".metadata").write_bytes(raw)
    _rewrite_manifest(root, metadata={"size": len(raw), "xxh3_64": xxhash.xxh3_64(raw).hexdigest()})
    err, dest = _try_load(path)
    assert err is not None and "key 'a'" in str(err) and "cover 180 of 240" in str(err), err
    assert _equal(dest, _blank())


@pytest.mark.parametrize("rel", ["/etc/passwd", "../outside.distcp", "sub/x.distcp"])
def test_data_file_paths_outside_the_checkpoint_are_refused(tmp_path, rel):
    import xxhash

    path = tmp_path / "ck"
    tdb.checkpoint.save(_state(1), path)
    root = committed(path)
    md = parse_metadata((root / ".metadata").read_bytes(), "x")
    for info in md.storage_data.values():
        info.relative_path = rel
    raw = pickle.dumps(md)
    (root / ".metadata").write_bytes(raw)
    _rewrite_manifest(root, metadata={"size": len(raw), "xxh3_64": xxhash.xxh3_64(raw).hexdigest()})
    err, _ = _try_load(path)
    assert err is not None and "not a plain file name" in str(err) and ".metadata" in str(err), err
    with pytest.raises(tdb.checkpoint.CheckpointError, match="not a plain file name"):
        tdb.checkpoint.inspect(path)


@pytest.mark.parametrize("name", ["run[1]", "run?", "run*"])
def test_glob_characters_in_names_leave_similar_names_alone(tmp_path, name):
    one, other = tmp_path / "run1", tmp_path / name
    tdb.checkpoint.save(_state(1), one)
    tdb.checkpoint.save(_state(1), one)  # a spare exists
    for seed in (2, 3, 4):  # reuses spares and sweeps
        tdb.checkpoint.save(_state(seed), other)
    for p, seed in ((one, 1), (other, 4)):
        err, dest = _try_load(p)
        assert err is None and _equal(dest, _state(seed)), (p, err)
    gens = generations(one)
    assert len(gens) == 2 and committed(one).name in gens, gens


def test_two_holders_of_the_save_lock(tmp_path):
    """A save while another process holds the path's save lock fails at once; the lock dies with its holder."""
    path = tmp_path / "ck"
    tdb.checkpoint.save(_state(1), path)
    holder = subprocess.Popen(
        ["python3", "-c", "import fcntl,sys,time; f=open(sys.argv[1],'a'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); time.sleep(60)", str(tmp_path / "ck" / ".tdb_lock")], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"held"
        t0 = time.monotonic()
        with pytest.raises(tdb.checkpoint.CheckpointBusyError, match="another save to .* is in progress"):
            tdb.checkpoint.save(_state(2), path)
        assert time.monotonic() - t0 < 5
    finally:
        holder.kill()
        holder.wait()
    tdb.checkpoint.save(_state(2), path)  # the killed holder's lock is gone
    err, dest = _try_load(path)
    assert err is None and _equal(dest, _state(2))


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if run.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {run.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_disk_full_keeps_errno_and_the_previous_checkpoint(small_disk):
    path = small_disk / "ck"
    want = _state(1)
    tdb.checkpoint.save(want, path)
    before = sorted(p.name for p in small_disk.iterdir())
    big = dict(_state(2), a=reference_table((1024, 256), seed=5))  # 1 MiB: does not fit
    with pytest.raises(tdb.checkpoint.CheckpointError) as info:
        tdb.checkpoint.save(big, path)
    msg = str(info.value)
    assert "ENOSPC" in msg and "No space left on device" in msg, msg
    assert sorted(p.name for p in small_disk.iterdir()) == before, "the failed generation was left on disk"
    err, dest = _try_load(path)
    assert err is None and _equal(dest, want)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["directory", "symlink", "fifo"])
def test_a_manifest_that_is_not_a_regular_file_is_corrupt_for_load_inspect_and_migrate(tmp_path, kind):
    """Not ``NotACheckpointError`` (the directory is a checkpoint) nor its base class alone: exactly
    ``CorruptCheckpointError``, from every reader, without opening it (a FIFO would block an ``open``)."""
    path = tmp_path / "ck"
    tdb.checkpoint.save(_state(3), path)
    f = committed(path) / "tdb_manifest.json"
    body = f.read_bytes()
    f.unlink()
    if kind == "directory":
        f.mkdir()
    elif kind == "symlink":
        (tmp_path / "elsewhere.json").write_bytes(body)
        f.symlink_to(tmp_path / "elsewhere.json")
    else:
        os.mkfifo(f)
    calls = {
        "load": lambda: tdb.checkpoint.load(_blank(), path),
        "inspect": lambda: tdb.checkpoint.inspect(path),
        "migrate": lambda: tdb.checkpoint.migrate(path, tmp_path / "migrated", progress=False),
    }
    for what, call in calls.items():
        with pytest.raises(tdb.checkpoint.CheckpointError) as info:
            call()
        assert type(info.value) is tdb.checkpoint.CorruptCheckpointError, (what, type(info.value), info.value)
        assert "tdb_manifest.json" in str(info.value) and "not a regular file" in str(info.value), (what, info.value)
