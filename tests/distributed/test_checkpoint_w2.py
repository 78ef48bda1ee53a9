"""checkpoint.save / load / inspect on 2 gloo ranks: round trips, validation, corruption."""

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.layout import ShardLayout

from ..checkpoint_writers import checksum_items, write_manifest_v1
from .checks import build_sharded_tensor, reference_table
from .harness import make_pool_fixture
from tests.layout import committed, generations

pool = make_pool_fixture(2)

LAYOUTS = {
    "rw_uneven": ShardLayout.row_wise((97, 36), [60, 37]),
    "cw_two_per_rank": ShardLayout.column_wise((13, 16), [4, 4, 4, 4], ranks=[0, 1, 0, 1]),
    "tw": ShardLayout.table_wise((9, 5), 1),
    "grid": ShardLayout.grid((10, 8), [3, 7], [5, 3], [1, 0, 0, 1]),
}


def _state(rank, seed=0, dtype=torch.float32):
    sd = {}
    tables = {}
    for i, (name, lay) in enumerate(sorted(LAYOUTS.items())):
        table = reference_table(lay.global_shape, dtype, seed=seed + i)
        sd[f"emb.{name}.weight"] = tdb.to_dtensor(build_sharded_tensor(lay.with_name(name), table, rank))
        tables[f"emb.{name}.weight"] = table
    sd["step"] = torch.tensor(seed)
    return sd, tables


def _digest(sd):
    h = hashlib.sha256()
    for key in sorted(sd):
        v = sd[key]
        for t in (tdb.convert.local_shards_of(v) if isinstance(v, torch.distributed.tensor.DTensor) else [v]):
            h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _check_roundtrip(rank, world_size, path):
    sd, tables = _state(rank, seed=1)
    save_id = tdb.checkpoint.save(sd, path)
    assert Path(path).is_dir() and committed(path).name == f"gen-{save_id}"  # a directory: copies keep it whole
    dest, _ = _state(rank, seed=5)
    tdb.checkpoint.load(dest, path)
    for key, table in tables.items():
        assert torch.equal(tdb.full_tensor(dest[key]), table), key
    assert int(dest["step"]) == 1
    # overwrite with new values: the link moves, the old generation is removed
    sd2, tables2 = _state(rank, seed=2)
    save_id2 = tdb.checkpoint.save(sd2, path)
    assert save_id2 != save_id
    tdb.checkpoint.load(dest, path)
    for key, table in tables2.items():
        assert torch.equal(tdb.full_tensor(dest[key]), table), key
    dist.barrier()
    gens = generations(path)
    # the committed generation and the superseded one, kept as the next save's spare
    assert gens == sorted([f"gen-{save_id2}", f"gen-{save_id}"]), gens
    spare_inode = (Path(path) / f"gen-{save_id}").stat().st_ino
    sd3, tables3 = _state(rank, seed=3)
    save_id3 = tdb.checkpoint.save(sd3, path)
    dist.barrier()
    gen3 = Path(path) / f"gen-{save_id3}"
    assert gen3.stat().st_ino == spare_inode, "the spare generation was not reused"
    gens = generations(path)
    assert gens == sorted([f"gen-{save_id3}", f"gen-{save_id2}"]), gens
    tdb.checkpoint.load(dest, path)  # a rewritten spare loads the new values, checksums and all
    for key, table in tables3.items():
        assert torch.equal(tdb.full_tensor(dest[key]), table), key
    save_id4 = tdb.checkpoint.save(sd3, path, keep_spare=False)
    dist.barrier()
    assert generations(path) == [f"gen-{save_id4}"], generations(path)
    return tdb.checkpoint.inspect(path)


def test_save_load_overwrite_and_inspect(pool, tmp_path):
    info = pool.run(_check_roundtrip, str(tmp_path / "ck"))[0]
    for name, lay in LAYOUTS.items():
        rec = info[f"emb.{name}.weight"]
        assert rec["shape"] == list(lay.global_shape) and rec["dtype"] == "float32"
        want = sorted([list(s.offsets), list(s.sizes)] for s in lay.shards)
        assert sorted([s["offsets"], s["sizes"]] for s in rec["shards"]) == want, name
    assert info["step"]["type"] == "tensor" and info["step"]["shape"] == []


def _check_refusal(rank, world_size, path, case):
    sd, _ = _state(rank, seed=4 if case == "setup_other" else 3)
    if case in ("setup", "setup_other"):
        tdb.checkpoint.save(sd, path)
        return None
    dest, _ = _state(rank, seed=9)
    if case == "shape":
        lay = ShardLayout.row_wise((98, 36), [60, 38], name="x")
        dest["emb.rw_uneven.weight"] = tdb.to_dtensor(build_sharded_tensor(lay, reference_table((98, 36)), rank))
    elif case == "dtype":
        dest["step"] = torch.tensor(0.5)
    elif case == "missing":
        dest["emb.new_table.weight"] = torch.zeros(3, 3)
    elif case == "unexpected":
        del dest["emb.tw.weight"]
    # "load": corruption cases, destination as saved
    before = _digest(dest)
    try:
        tdb.checkpoint.load(dest, path, strict=case == "unexpected")
    except (ValueError, RuntimeError) as e:
        assert _digest(dest) == before, "destination modified by a refused load"
        return str(e)
    raise AssertionError(f"{case}: load did not raise")


@pytest.mark.parametrize(
    "case, needle",
    [
        ("shape", "saved shape [97, 36], destination shape [98, 36]"),
        ("dtype", "saved dtype torch.int64, destination dtype torch.float32"),
        ("missing", "key 'emb.new_table.weight' is not in the checkpoint"),
        ("unexpected", "key 'emb.tw.weight' is in the checkpoint, not in the state_dict (load(..., strict=False)"),
        ("corrupt", "is corrupt or from another save"),
        ("truncated", "is truncated"),
        ("foreign", "is corrupt or from another save"),
    ],
)
def test_load_refuses_and_writes_nothing(pool, tmp_path, case, needle):
    path = str(tmp_path / "ck")
    pool.run(_check_refusal, path, "setup")
    root = committed(Path(path))
    data = sorted(root.glob("*.distcp"))
    if case == "corrupt":
        f = data[0]
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        f.write_bytes(bytes(raw))
    elif case == "truncated":
        f = max(data, key=lambda p: p.stat().st_size)
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif case == "foreign":
        other = str(tmp_path / "other")
        pool.run(_check_refusal, other, "setup_other")  # same keys and shapes, other values
        for f in data:
            shutil.copy(committed(Path(other)) / f.name, f)
    messages = pool.run(_check_refusal, path, case if case in ("shape", "dtype", "missing", "unexpected") else "load")
    for m in messages:
        assert needle in m, m
        assert "nothing was modified" in m


def _check_no_checkpoint(rank, world_size, path):
    dest, _ = _state(rank)
    try:
        tdb.checkpoint.load(dest, path)
    except tdb.checkpoint.IncompleteCheckpointError as e:
        return str(e)
    raise AssertionError("loaded a checkpoint that was never committed")


def _save_on(rank, world_size, path, ranks, seed):
    """Save from the first ``ranks`` ranks only (a smaller world, through a subgroup)."""
    group = dist.new_group(list(range(ranks)))
    if rank < ranks:
        table = reference_table((12, 4), seed=seed)
        lay = ShardLayout.row_wise((12, 4), ranks, name="t")
        local = [table[s.slices()].clone() for s in lay.shards_on(rank)]
        dt = tdb.convert.dtensor_from_local_shards(lay, local, process_group=group)
        tdb.checkpoint.save({"t": dt}, path, process_group=group)
    dist.barrier()


def test_reused_generation_drops_files_of_a_larger_world(pool, tmp_path):
    """A spare written by 2 ranks, reused by a 1-rank save: the second rank's file must go."""
    path = tmp_path / "ck"
    pool.run(_save_on, str(path), 2, 1)
    pool.run(_save_on, str(path), 2, 2)  # the first generation becomes the spare
    pool.run(_save_on, str(path), 1, 3)  # reuses it from one rank
    files = sorted(p.name for p in committed(path).iterdir())
    assert files == [".metadata", "__0_0.distcp", "digests_0.tdb", "tdb_manifest.json"], files
    dest = {"t": torch.zeros(12, 4)}
    tdb.checkpoint.load(dest, str(path))
    assert torch.equal(dest["t"], reference_table((12, 4), seed=3))


def test_uncommitted_generation_is_never_loaded(pool, tmp_path):
    path = tmp_path / "ck"
    (path / f"gen-{'d' * 32}").mkdir(parents=True)  # what an interrupted first save leaves
    for m in pool.run(_check_no_checkpoint, str(path)):
        assert "no committed checkpoint" in m and f"gen-{'d' * 32}" in m


# ----------------------------------------------------------- ranged, verified loads
# "big" is saved row-wise in two even chunks and loaded in an uneven row cut, so rank 0
# needs the first 20000 rows of chunk 0 and rank 1 the rest of chunk 0 and all of chunk 1.
BIG = (65536, 128)
SAVE_CUTS = {"big": [32768, 32768], "other": [2048, 2048]}
LOAD_CUTS = {"big": [20000, 45536], "other": [1000, 3096]}


def _rchar():
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def _rows_state(rank, cuts, keys=("big", "other"), fill=None):
    sd, tables = {}, {}
    for key in keys:
        shape = BIG if key == "big" else (4096, 128)
        table = reference_table(shape, seed=10 if key == "big" else 11)
        lay = ShardLayout.row_wise(shape, cuts[key], name=key)
        local = [(table[s.slices()] if fill is None else torch.full(s.sizes, fill)).clone() for s in lay.shards_on(rank)]
        sd[key] = tdb.convert.dtensor_from_local_shards(lay, local)
        tables[key] = table
    return sd, tables


def _save_rows(rank, world_size, path):
    sd, _ = _rows_state(rank, SAVE_CUTS)
    tdb.checkpoint.save(sd, path)


def _load_rows(rank, world_size, path, keys=("big", "other"), staging_bytes=4 << 30, verify=True):
    """Load into the uneven cut; returns (bytes read, bytes needed, error or None, destination unchanged, equal)."""
    dest, tables = _rows_state(rank, LOAD_CUTS, keys, fill=-1.0)
    needed = sum(t.numel() * t.element_size() for v in dest.values() for t in tdb.convert.local_shards_of(v))
    before = _digest(dest)
    dist.barrier()
    r0 = _rchar()
    try:
        tdb.checkpoint.load(dest, path, strict=False, staging_bytes=staging_bytes, verify=verify)
        error = None
    except (ValueError, RuntimeError) as e:
        error = str(e)
    read = _rchar() - r0
    equal = all(torch.equal(tdb.full_tensor(dest[k]), tables[k]) for k in keys)
    return read, needed, error, _digest(dest) == before, equal


def _flip(path, key, chunk_row, at):
    """Flip one byte of the saved chunk of ``key`` starting at row ``chunk_row``: ``at`` bytes into its item."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex

    root = committed(Path(path))
    info = dcp.FileSystemReader(root).read_metadata().storage_data[MetadataIndex(key, [chunk_row, 0])]
    f = root / info.relative_path
    raw = bytearray(f.read_bytes())
    raw[info.offset + at] ^= 0x5A
    f.write_bytes(bytes(raw))
    return info.relative_path


@pytest.mark.parametrize("staging_bytes", [4 << 30, 0])
def test_resharded_load_reads_only_needed_rows(pool, tmp_path, staging_bytes):
    path = str(tmp_path / "ck")
    pool.run(_save_rows, path)
    for rank, (read, needed, error, _, equal) in enumerate(pool.run(_load_rows, path, staging_bytes=staging_bytes)):
        assert error is None and equal, (rank, error)
        if staging_bytes:
            assert read <= 1.1 * needed, f"rank {rank} read {read / needed:.3f}x the bytes it needs"
        else:  # verified first, read again to copy
            assert 1.9 * needed <= read <= 2.2 * needed, f"rank {rank} read {read / needed:.3f}x"


@pytest.mark.parametrize("staging_bytes", [4 << 30, 0])
@pytest.mark.parametrize("where", ["rows", "zip_head"])
def test_flipped_byte_in_read_block_refuses_on_every_rank(pool, tmp_path, where, staging_bytes):
    path = str(tmp_path / "ck")
    pool.run(_save_rows, path)
    # rows 10000.. of chunk 0 are read by rank 0 only; the zip head (data.pkl) by both ranks
    at = 100 if where == "zip_head" else 10000 * 128 * 4 + 4096
    rel = _flip(path, "big", 0, at)
    for rank, (_, _, error, unchanged, _) in enumerate(pool.run(_load_rows, path, staging_bytes=staging_bytes)):
        assert error is not None, f"rank {rank} loaded a corrupt checkpoint"
        assert "nothing was modified" in error and "is corrupt or from another save" in error, error
        assert f"data file {rel}" in error and "key 'big'" in error, error
        assert unchanged, f"rank {rank}'s destination was modified by a refused load"


def test_flipped_byte_in_unread_block_does_not_stop_a_load(pool, tmp_path):
    """Verification covers exactly the bytes read: corruption in rows no rank loads goes unnoticed."""
    path = str(tmp_path / "ck")
    pool.run(_save_rows, path)
    _flip(path, "big", 32768, 8 << 20)  # middle of chunk 1 of "big", which this load does not ask for
    for rank, (_, _, error, _, equal) in enumerate(pool.run(_load_rows, path, keys=("other",))):
        assert error is None and equal, (rank, error)
    results = pool.run(_load_rows, path)  # loading "big" too reads that block and refuses
    assert all(r[2] is not None and "is corrupt" in r[2] and r[3] for r in results), results


def test_format1_manifest_still_loads(pool, tmp_path):
    """A checkpoint with a format-1 manifest (one checksum per item) loads, whole items verified."""
    import torch.distributed.checkpoint as dcp

    from torchrec_dtensor_bridge.checkpoint.format import manifest

    path = str(tmp_path / "ck")
    pool.run(_save_rows, path)
    root = committed(Path(path))
    md = dcp.FileSystemReader(root).read_metadata()
    body = manifest.read_manifest(root)
    assert body["format"] == 3
    write_manifest_v1(root, body["save_id"], checksum_items(root, md, list(md.storage_data)),
                      {"world_size": 2, "dcp_save_id": body["dcp_save_id"]})
    assert manifest.read_manifest(root)["format"] == 1
    for rank, (read, needed, error, _, equal) in enumerate(pool.run(_load_rows, path)):
        assert error is None and equal, (rank, error)
    _flip(path, "big", 32768, 8 << 20)
    for rank, (_, _, error, unchanged, _) in enumerate(pool.run(_load_rows, path)):
        assert error is not None and "is corrupt or from another save" in error and unchanged, (rank, error)


def test_plain_dcp_directory_loads_ranged_without_verification(pool, tmp_path):
    path = str(tmp_path / "ck")
    pool.run(_save_rows, path)
    root = committed(Path(path))
    (root / "tdb_manifest.json").unlink()
    for rank, (_, _, error, unchanged, _) in enumerate(pool.run(_load_rows, str(root))):
        assert error is not None and "no checksum manifest" in error and unchanged, (rank, error)
    for rank, (read, needed, error, _, equal) in enumerate(pool.run(_load_rows, str(root), verify=False)):
        assert error is None and equal, (rank, error)
        assert read <= 1.1 * needed, f"rank {rank} read {read / needed:.3f}x the bytes it needs"


def _bad_staging(rank, world_size, path):
    dest, _ = _rows_state(rank, LOAD_CUTS, fill=-1.0)
    try:
        tdb.checkpoint.load(dest, path, staging_bytes=-1 if rank == 1 else None)
    except ValueError as e:
        return str(e)
    raise AssertionError("load accepted staging_bytes=-1")


def test_bad_staging_bytes_refused_on_every_rank(pool, tmp_path):
    path = str(tmp_path / "ck")
    pool.run(_save_rows, path)
    for m in pool.run(_bad_staging, path):
        assert "staging_bytes must be a non-negative int or None, got -1 (rank 1)" in m, m


def test_spare_rewritten_in_place_is_cut_to_the_new_size(tmp_path):
    """A spare generation's files are overwritten in place; a smaller save must not leave stale bytes counted."""
    from torchrec_dtensor_bridge.checkpoint.format.manifest import read_manifest

    path = tmp_path / "ck"
    big, small = reference_table((4096, 64), seed=1), reference_table((100, 64), seed=2)
    tdb.checkpoint.save({"t": big}, path)
    tdb.checkpoint.save({"t": big}, path)  # the first generation is now the spare
    (spare,) = [path / n for n in generations(path) if path / n != committed(path)]
    inode, old_size = spare.stat().st_ino, (spare / "__0_0.distcp").stat().st_size
    tdb.checkpoint.save({"t": small}, path)  # rewrites the spare, smaller
    root = committed(path)
    assert root.stat().st_ino == inode, "the spare generation was not reused"
    assert (root / "__0_0.distcp").stat().st_size < old_size
    body = read_manifest(root)
    for rel, rec in body["files"].items():
        assert (root / rel).stat().st_size == rec["size"], rel
    dest = {"t": torch.zeros(100, 64)}
    tdb.checkpoint.load(dest, path)
    assert torch.equal(dest["t"], small)


def _plain_dcp_reads_ours(rank, world_size, path):
    """A checkpoint written by checkpoint.save is an ordinary DCP directory: plain ``dcp.load`` reads it,
    into other layouts too (every layout swapped for another one of the same table)."""
    import torch.distributed.checkpoint as dcp

    sd, tables = _state(rank, seed=3)
    tdb.checkpoint.save(sd, path)
    others = {"rw_uneven": ShardLayout.column_wise((97, 36), [20, 16]), "cw_two_per_rank": ShardLayout.row_wise(
        (13, 16), [7, 6]), "tw": ShardLayout.table_wise((9, 5), 0), "grid": ShardLayout.row_wise((10, 8), [1, 9])}
    dest = {"step": torch.tensor(0)}
    for name, lay in others.items():
        blank = torch.zeros(lay.global_shape)
        dest[f"emb.{name}.weight"] = tdb.to_dtensor(build_sharded_tensor(lay.with_name(name), blank, rank))
    dcp.load(dest, checkpoint_id=path)
    for key, table in tables.items():
        assert torch.equal(tdb.full_tensor(dest[key]), table), key
    assert int(dest["step"]) == 3


def test_plain_dcp_load_reads_our_checkpoints(pool, tmp_path):
    pool.run(_plain_dcp_reads_ours, str(tmp_path / "ck"))


_OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list")


def _count_object_collectives(rank, world_size, path, incremental):
    """Object collectives of a save, by who called them: this package (the save's own) or DCP."""
    import inspect

    import torch.distributed.distributed_c10d as c10d

    counts = {"ours": 0, "dcp": 0}
    originals = {name: getattr(c10d, name) for name in _OBJECT_COLLECTIVES}

    def counting(name):
        def call(*args, **kwargs):
            callers = [f.filename for f in inspect.stack()[1:8]]
            who = next((c for c in callers if "torchrec_dtensor_bridge" in c or "checkpoint/utils.py" in c), "")
            counts["ours" if "torchrec_dtensor_bridge" in who else "dcp"] += 1
            return originals[name](*args, **kwargs)
        return call

    sd, _ = _state(rank, seed=1)
    if incremental:
        tdb.checkpoint.save(sd, path + "-base")
    for name in _OBJECT_COLLECTIVES:
        setattr(c10d, name, counting(name))
        setattr(dist, name, getattr(c10d, name))
    try:
        tdb.checkpoint.save(sd, path, base=path + "-base" if incremental else None)
    finally:
        for name, fn in originals.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)
    return counts


@pytest.mark.parametrize("incremental", [False, True])
def test_a_save_runs_one_object_collective_of_its_own(pool, tmp_path, incremental):
    """Everything a save agrees on is agreed once, before anything is written; checksums, records and the
    commit's outcome travel with DCP's own collectives."""
    for counts in pool.run(_count_object_collectives, str(tmp_path / "ck"), incremental):
        assert counts["ours"] <= 1, counts
        assert counts["dcp"] >= 2, counts  # the count sees DCP's too: it can fail
