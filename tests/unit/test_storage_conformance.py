"""One conformance suite for every checkpoint storage backend: the local disk and a real S3-compatible store.

Each test calls the public API (``tdb.checkpoint.save / load / inspect``) or the commit protocol's own steps
(:mod:`torchrec_dtensor_bridge.checkpoint.commit`) the same way on each backend, and compares with the values
saved (``torch.equal``).
"""

from __future__ import annotations

import json
import uuid

import pytest
import torch

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.checkpoint import commit as protocol
from torchrec_dtensor_bridge.checkpoint.storage import locate


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path):
    """A fresh checkpoint name on each backend (``s3``: a bucket of the SeaweedFS the session started)."""
    if request.param == "local":
        return str(tmp_path / "ckpts")
    try:
        bucket = request.getfixturevalue("s3_bucket")  # tests/conftest.py: SeaweedFS, started once per session
    except pytest.FixtureLookupError:
        pytest.skip("the S3 test server fixture (s3_bucket) is not available")
    return f"s3://{bucket}/run-{uuid.uuid4().hex[:8]}"


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"t": torch.randn(37, 5, generator=g), "h": torch.randn(9, 4, generator=g).half(),
            "i": torch.randint(0, 1000, (11,), generator=g), "step": seed}


def _blank() -> dict:
    return {"t": torch.full((37, 5), -1.0), "h": torch.full((9, 4), -1.0).half(),
            "i": torch.full((11,), -1, dtype=torch.int64), "step": -1}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in ("t", "h", "i")) and a["step"] == b["step"]


def test_save_load_inspect_and_overwrite(where):
    path = f"{where}/ck"
    tdb.checkpoint.save(_state(1), path)
    dest = _blank()
    stats = tdb.checkpoint.load(dest, path)
    assert _same(dest, _state(1)) and stats.verified
    tdb.checkpoint.save(_state(2), path)  # a second commit over the first
    dest = _blank()
    tdb.checkpoint.load(dest, path)
    assert _same(dest, _state(2))
    info = tdb.checkpoint.inspect(path)
    assert info["t"]["shape"] == [37, 5] and info["h"]["dtype"] == "float16" and info["i"]["dtype"] == "int64"


def test_incremental_chain_of_three_links(where):
    s = _state(1)
    tdb.checkpoint.save(s, f"{where}/l0")
    for k in (1, 2, 3):
        s["t"][k * 5] += k
        s["i"][k] = -k
        s["step"] = k + 10
        tdb.checkpoint.save(s, f"{where}/l{k}", base=f"{where}/l{k - 1}")
    for k in (3,):
        dest = _blank()
        tdb.checkpoint.load(dest, f"{where}/l{k}")
        assert _same(dest, s)
    dest = _blank()
    tdb.checkpoint.load(dest, f"{where}/l3", staging_bytes=0)  # verified first, read again to copy
    assert _same(dest, s)
    assert [link["name"] for link in tdb.checkpoint.inspect(f"{where}/l3")["t"]["links"]] == ["l3", "l2", "l1", "l0"]


def test_a_second_saver_is_refused_and_neither_save_is_damaged(where):
    """Two savers of one name: one holds the save lock, the other is refused at once; a saver that got past
    the lock (an expired lease) loses at the commit's conditional step instead, and nothing of it is visible."""
    path = f"{where}/ck"
    tdb.checkpoint.save(_state(1), path)
    loc = locate(path)
    held = protocol.save_lock(loc)
    try:
        with pytest.raises(tdb.checkpoint.CheckpointBusyError, match="in progress"):
            tdb.checkpoint.save(_state(2), path)
    finally:
        held.release()
    # two savers that both read the same commit record: the first commits, the second is refused
    first, second = protocol.save_lock(loc), None
    try:
        first.lock.release()  # as if its lease had expired
        second = protocol.save_lock(loc)
        gen_a, gen_b = protocol.generation(loc, "a" * 32), protocol.generation(loc, "b" * 32)
        protocol.commit(loc, gen_a, first)
        with pytest.raises(tdb.checkpoint.CheckpointBusyError, match="another save to .* committed while"):
            protocol.commit(loc, gen_b, second)
        record = json.loads((loc / protocol.COMMIT).get(1 << 20))
        assert record["generation"] == gen_a.name
    finally:
        if second is not None:
            second.release()
    # put the record back the way a save would leave it, then check the first save still loads
    target = protocol.save_lock(loc)
    try:
        target.token = (loc / protocol.COMMIT).read_pointer()[1]
        previous = record["superseded"][-1][0]
        target.record = record
        protocol.commit(loc, loc / previous, target)
    finally:
        target.release()
    dest = _blank()
    tdb.checkpoint.load(dest, path)
    assert _same(dest, _state(1))


def test_a_flipped_byte_in_a_data_object_is_refused_naming_it(where):
    path = f"{where}/ck"
    tdb.checkpoint.save(_state(1), path)
    root = protocol.resolve(locate(path))
    data = root / "__0_0.distcp"
    raw = bytearray(data.get(1 << 30))
    raw[len(raw) // 2] ^= 0x10
    data.put(bytes(raw))
    dest = _blank()
    with pytest.raises(tdb.checkpoint.CorruptCheckpointError, match="__0_0.distcp"):
        tdb.checkpoint.load(dest, path)
    assert _same(dest, _blank())


def test_a_deleted_data_object_is_refused_naming_it(where):
    path = f"{where}/ck"
    tdb.checkpoint.save(_state(1), path)
    (protocol.resolve(locate(path)) / "__0_0.distcp").delete()
    dest = _blank()
    with pytest.raises(tdb.checkpoint.CorruptCheckpointError, match="__0_0.distcp"):
        tdb.checkpoint.load(dest, path)
    assert _same(dest, _blank())


def test_a_damaged_commit_record_is_refused_naming_it(where):
    path = f"{where}/ck"
    tdb.checkpoint.save(_state(1), path)
    record = locate(path) / protocol.COMMIT
    record.put(record.get(1 << 20)[:-3])
    with pytest.raises(tdb.checkpoint.CorruptCheckpointError, match="tdb_commit.json"):
        tdb.checkpoint.load(_blank(), path)


def test_an_interrupted_generation_is_collected_and_never_loaded(where):
    path = f"{where}/ck"
    tdb.checkpoint.save(_state(1), path)
    loc = locate(path)
    stray = protocol.generation(loc, "c" * 32)
    stray.make_dir()
    (stray / "__0_0.distcp").put(b"half a save")
    dest = _blank()
    tdb.checkpoint.load(dest, path)
    assert _same(dest, _state(1))
    assert protocol.collect(loc, dry_run=True) == [stray.name]
    assert protocol.collect(loc) == [stray.name]
    assert stray.name not in loc.list()
    dest = _blank()
    tdb.checkpoint.load(dest, path)
    assert _same(dest, _state(1))


def test_hostile_names_are_refused(where):
    """A link record naming a base outside the checkpoint's directory is refused before anything is read."""
    from torchrec_dtensor_bridge.checkpoint.format.manifest import encode_manifest, read_manifest

    s = _state(1)
    tdb.checkpoint.save(s, f"{where}/l0")
    s["t"][0] += 1
    tdb.checkpoint.save(s, f"{where}/l1", base=f"{where}/l0")
    root = protocol.resolve(locate(f"{where}/l1"))
    for bad in ("../../etc", "/abs", "a/../../b"):
        body = read_manifest(root)
        body["link"]["base"]["generation"] = bad
        (root / "tdb_manifest.json").put(encode_manifest(body))
        with pytest.raises(tdb.checkpoint.CorruptCheckpointError):
            tdb.checkpoint.load(_blank(), f"{where}/l1")


def _as_earlier_release(path):
    """Turn a checkpoint into the layout earlier releases wrote: ``path`` a symbolic link to its generation
    ``.<name>.tdb-<save id>`` beside it, and each link record naming its base's generation that way."""
    import os
    from pathlib import Path

    from torchrec_dtensor_bridge.checkpoint.format.manifest import encode_manifest, read_manifest

    path = Path(path)
    gen = json.loads((path / "tdb_commit.json").read_text())["generation"]
    old = path.parent / f".{path.name}.tdb-{gen[len('gen-'):]}"
    os.rename(path / gen, old)
    body = read_manifest(old)
    if "link" in body:
        base = body["link"]["base"]
        base["generation"] = f".{base['name']}.tdb-{base['save_id']}"
        (old / "tdb_manifest.json").write_bytes(encode_manifest(body))
    for p in path.iterdir():
        p.unlink() if p.is_file() else None
    (path / ".metadata").unlink(missing_ok=True)
    os.rmdir(path)
    os.symlink(old.name, path)


def test_checkpoints_of_earlier_releases_still_load_and_copies_of_them_serve_as_bases(tmp_path):
    """Today's format as earlier releases laid it out (a link to a generation beside it): a chain loads, and a
    copy with links dereferenced (``cp -rL``) loads and is a base for a new incremental save at its new place."""
    import subprocess

    s = _state(1)
    tdb.checkpoint.save(s, tmp_path / "old" / "l0")
    s["t"][3] += 1
    tdb.checkpoint.save(s, tmp_path / "old" / "l1", base=tmp_path / "old" / "l0")
    for name in ("l0", "l1"):
        _as_earlier_release(tmp_path / "old" / name)
    assert (tmp_path / "old" / "l1").is_symlink()
    dest = _blank()
    tdb.checkpoint.load(dest, tmp_path / "old" / "l1")
    assert _same(dest, s)
    subprocess.run(["cp", "-rL", str(tmp_path / "old"), str(tmp_path / "copy")], check=True)
    assert not (tmp_path / "copy" / "l1").is_symlink()
    dest = _blank()
    tdb.checkpoint.load(dest, tmp_path / "copy" / "l1")
    assert _same(dest, s)
    s["t"][5] -= 1
    tdb.checkpoint.save(s, tmp_path / "copy" / "l2", base=tmp_path / "copy" / "l1")
    dest = _blank()
    tdb.checkpoint.load(dest, tmp_path / "copy" / "l2")
    assert _same(dest, s)
    with pytest.raises(tdb.checkpoint.CheckpointError, match="layout of earlier releases"):
        tdb.checkpoint.save(s, tmp_path / "old" / "l1")


@pytest.mark.parametrize("how", [["cp", "-r"], ["cp", "-rL"], ["rsync", "-a"], ["rsync", "-aL"]])
def test_copies_of_a_checkpoint_are_complete_checkpoints_and_bases(tmp_path, how):
    import shutil
    import subprocess

    if shutil.which(how[0]) is None:
        pytest.skip(f"{how[0]} is not installed")
    s = _state(1)
    tdb.checkpoint.save(s, tmp_path / "a" / "full")
    s["t"][2] += 1
    tdb.checkpoint.save(s, tmp_path / "a" / "inc", base=tmp_path / "a" / "full")
    src = str(tmp_path / "a") + ("/" if how[0] == "rsync" else "")
    subprocess.run([*how, src, str(tmp_path / "b")], check=True)
    shutil.rmtree(tmp_path / "a")  # the copy depends on nothing of the original
    dest = _blank()
    tdb.checkpoint.load(dest, tmp_path / "b" / "inc")
    assert _same(dest, s)
    s["t"][4] += 1
    tdb.checkpoint.save(s, tmp_path / "b" / "inc2", base=tmp_path / "b" / "inc")
    dest = _blank()
    tdb.checkpoint.load(dest, tmp_path / "b" / "inc2")
    assert _same(dest, s)


def test_a_link_at_one_percent_changed_holds_little_more_than_the_changed_rows(where):
    """An incremental link writes the changed rows, their ids and their digests, not every row's digest (the
    chain holds the others'): its bytes <= 1.1 x (changed rows + their optimizer state + their digests) + 1 MiB;
    and the next link, found against the chain's digests, is as small."""
    g = torch.Generator().manual_seed(0)
    rows, dim = 200_000, 32
    s = {"w": torch.randn(rows, dim, generator=g), "state": torch.rand(rows, generator=g)}
    tdb.checkpoint.save(s, f"{where}/l0")
    want = s["w"].clone(), s["state"].clone()
    for k in (1, 2):
        changed = torch.randperm(rows, generator=g)[: rows // 100]
        s["w"][changed] += 1
        s["state"][changed] += 1
        tdb.checkpoint.save(s, f"{where}/l{k}", base=f"{where}/l{k - 1}")
        root = protocol.resolve(locate(f"{where}/l{k}"))
        size = sum(root.storage.size(root.storage.join(root.key, n)) or 0 for n in root.list())
        payload = changed.numel() * (dim * 4 + 4 + 2 * 8)  # rows, their state, a digest of each
        assert size <= 1.1 * payload + (1 << 20), (k, size, payload)
        dest = {"w": torch.zeros(rows, dim), "state": torch.zeros(rows)}
        tdb.checkpoint.load(dest, f"{where}/l{k}")
        assert torch.equal(dest["w"], s["w"]) and torch.equal(dest["state"], s["state"])
    assert not torch.equal(want[0], s["w"])


def test_export_and_compact_of_a_chain(where):
    """``compact`` of a chain into one checkpoint and ``export`` to one safetensors object, on the same backend;
    the export's bytes parsed by the format's layout (header, then each tensor's data, nothing after)."""
    import struct

    s = _state(1)
    tdb.checkpoint.save(s, f"{where}/l0")
    s["t"][7] -= 2
    s["h"][1] += 1
    tdb.checkpoint.save(s, f"{where}/l1", base=f"{where}/l0")
    tdb.checkpoint.compact(f"{where}/l1", f"{where}/full")
    dest = _blank()
    tdb.checkpoint.load(dest, f"{where}/full")
    assert _same(dest, s)
    assert "links" not in tdb.checkpoint.inspect(f"{where}/full")["t"]
    tdb.checkpoint.export(f"{where}/l1", f"{where}/tables.safetensors", progress=False)
    raw = locate(f"{where}/tables.safetensors").get(1 << 30)
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    assert max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__") == len(data)
    dtypes = {"F32": torch.float32, "F16": torch.float16, "I64": torch.int64}
    for key in ("t", "h", "i"):
        rec = header[key]
        a, b = rec["data_offsets"]
        got = torch.frombuffer(bytearray(data[a:b]), dtype=dtypes[rec["dtype"]]).reshape(rec["shape"])
        assert torch.equal(got, s[key]), key


def test_the_command_line_on_every_backend(where, capsys):
    """``inspect``, ``gc``, ``compact`` and ``export`` take an ``s3://`` URL wherever they take a path (the store
    configured by the standard AWS variables)."""
    from torchrec_dtensor_bridge.cli import main

    tdb.checkpoint.save(_state(1), f"{where}/ck")
    stray = protocol.generation(locate(f"{where}/ck"), "d" * 32)
    stray.make_dir()
    (stray / "__0_0.distcp").put(b"left by a killed save")
    capsys.readouterr()
    assert main(["inspect", f"{where}/ck"]) == 0
    assert "37x5" in capsys.readouterr().out
    assert main(["gc", f"{where}/ck", "--dry-run"]) == 0
    assert f"would remove {stray.name}" in capsys.readouterr().out
    assert main(["gc", f"{where}/ck"]) == 0
    assert f"removed {stray.name}" in capsys.readouterr().out and stray.name not in locate(f"{where}/ck").list()
    assert main(["compact", f"{where}/ck", f"{where}/copy"]) == 0
    assert main(["export", f"{where}/copy", f"{where}/t.safetensors", "--no-progress"]) == 0
    assert locate(f"{where}/t.safetensors").size() > 37 * 5 * 4
    assert main(["gc", f"{where}/nothing-here"]) == 1


def test_an_asynchronous_save_writes_what_it_was_given(where):
    s = _state(1)
    want = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
    future = tdb.checkpoint.save(s, f"{where}/ck", asynchronous=True)
    s["t"].add_(1)  # training goes on at once
    future.result(timeout=120)
    base = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
    s["t"][0] += 1
    tdb.checkpoint.save(s, f"{where}/inc", base=f"{where}/ck", asynchronous=True).result(timeout=120)
    dest = _blank()
    tdb.checkpoint.load(dest, f"{where}/ck")
    assert _same(dest, want)
    dest = _blank()
    tdb.checkpoint.load(dest, f"{where}/inc")
    assert _same(dest, s) and not _same(dest, base)


def test_large_objects_cross_part_and_range_boundaries_byte_exact(where):
    """``create`` fed writes of odd sizes (S3: 5 MiB parts, uploaded 2 at a time from reused buffers) and
    ``open_read`` ranges that cross parts (S3: split into 16 MiB pieces fetched in parallel) give back the
    bytes written; a stream left by an exception leaves no object behind on S3."""
    loc = locate(where, {"part_bytes": 5 << 20, "max_concurrency": 2} if where.startswith("s3://") else None)
    loc.make_dir()
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, (37 << 20,), dtype=torch.uint8, generator=g).numpy().tobytes()
    cuts = [0, 1, (5 << 20) - 1, (5 << 20) + 3, 12 << 20, (29 << 20) + 17, len(data)]
    for name in ("a", "b"):  # the second upload reuses the first's part buffers
        with (loc / name).create() as f:
            for lo, hi in zip(cuts, cuts[1:]):
                f.write(memoryview(data)[lo:hi])
    for name in ("a", "b"):
        assert (loc / name).size() == len(data)
        h = (loc / name).open_read()
        try:
            for lo, hi in ((0, len(data)), (3, (17 << 20) + 5), ((5 << 20) - 2, (5 << 20) + 2), (len(data) - 9, len(data))):
                buf = bytearray(hi - lo)
                assert h.readinto(memoryview(buf), lo) == hi - lo
                assert buf == data[lo:hi], (name, lo, hi)
        finally:
            h.close()
    if where.startswith("s3://"):
        with pytest.raises(RuntimeError, match="stop"):
            with (loc / "c").create() as f:
                f.write(data[: 12 << 20])  # two parts uploaded
                raise RuntimeError("stop")
        assert (loc / "c").size() is None and "c" not in loc.list()


def test_s3_parts_grow_so_that_an_upload_stays_within_its_10000_parts(s3_bucket, monkeypatch):
    """S3 takes at most 10,000 parts in one upload: parts double in size every ``parts_per_size`` parts (here 2,
    of 5 MiB first), and the object reads back byte for byte; past the last part allowed the write raises,
    naming the object, and leaves no object behind."""
    from torchrec_dtensor_bridge.checkpoint.storage import s3_streams

    loc = locate(f"s3://{s3_bucket}/parts", {"part_bytes": 5 << 20, "max_concurrency": 2})
    transfers = loc.storage.transfers
    transfers.parts_per_size = 2
    sizes: list[int] = []
    real = transfers.client.upload_part

    def recorded(**kwargs):
        sizes.append(len(kwargs["Body"]))
        return real(**kwargs)

    monkeypatch.setattr(transfers.client, "upload_part", recorded)
    data = torch.randint(0, 256, (37 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    data = data.numpy().tobytes()
    with (loc / "a").create() as f:
        for lo in range(0, len(data), 3 << 20):
            f.write(memoryview(data)[lo:lo + (3 << 20)])
    assert sizes == [5 << 20, 5 << 20, 10 << 20, 10 << 20, 7 << 20], sizes
    h = (loc / "a").open_read()
    try:
        buf = bytearray(len(data))
        assert h.readinto(memoryview(buf), 0) == len(data) and buf == data
    finally:
        h.close()
    monkeypatch.setattr(s3_streams, "MAX_PARTS", 3)
    with pytest.raises(ValueError, match=r"s3://.*/parts/b: more than \d+ bytes need more than S3's 3 parts"):
        with (loc / "b").create() as f:
            f.write(data)
    assert (loc / "b").size() is None


def test_s3_readers_keep_a_superseded_generation_for_the_grace_period_and_past_it_fail_cleanly(s3_bucket):
    """S3 has no reader locks: a generation superseded by a newer commit stays for ``grace_seconds`` (the
    next save and ``gc`` leave it), so a reader that opened it goes on reading the same bytes; a reader that
    outlasts the grace period finds its objects gone and its read fails (ranged GETs carry If-Match on the ETag
    seen at open), never returning other bytes."""
    path = f"s3://{s3_bucket}/grace/ck"
    tdb.checkpoint.save(_state(1), path)
    kept = locate(path)  # the default grace period, 600 s
    gen = protocol.resolve(kept)
    data = next(n for n in gen.list() if n.endswith(".distcp"))
    reader = (gen / data).open_read()
    try:
        want = bytearray(reader.size)
        assert reader.readinto(memoryview(want), 0) == reader.size
        tdb.checkpoint.save(_state(2), path)  # supersedes the generation being read
        tdb.checkpoint.save(_state(3), path)  # and this save's sweep keeps it: within its grace period
        assert protocol.collect(kept) == [] and gen.name in kept.list()
        again = bytearray(reader.size)
        assert reader.readinto(memoryview(again), 0) == reader.size and again == want
        expired = locate(path, {"grace_seconds": 0})  # past the grace period
        assert gen.name in protocol.collect(expired)
        with pytest.raises(Exception, match="NoSuchKey|Not Found|404|PreconditionFailed|412"):
            reader.readinto(memoryview(again), 0)
    finally:
        reader.close()
    dest = _blank()
    tdb.checkpoint.load(dest, path)
    assert _same(dest, _state(3))


def test_s3_transfers_in_flight_default_to_the_ranks_share_of_the_cpus(monkeypatch):
    from torchrec_dtensor_bridge.checkpoint.storage.s3 import S3Storage, default_concurrency

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the client is made, never used
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(32)))
    for ranks, expected in (("1", 8), ("4", 8), ("8", 4), ("16", 2), ("64", 2), ("", 8), ("x", 8)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        assert default_concurrency() == expected, (ranks, default_concurrency())
        assert S3Storage("b").max_concurrency == expected
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert S3Storage("b").max_concurrency == 2
    assert S3Storage("b", {"max_concurrency": 5}).max_concurrency == 5  # asked for: kept
    with pytest.raises(ValueError, match="max_concurrency=0"):
        S3Storage("b", {"max_concurrency": 0})
