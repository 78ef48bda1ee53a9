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

from .checks import build_sharded_tensor, reference_table
from .harness import make_pool_fixture

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
    assert Path(path).is_symlink()
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
    name = Path(path).name
    gens = sorted(p.name for p in Path(path).parent.iterdir() if ".tdb-" in p.name)
    # the committed generation and the superseded one, kept as the next save's spare
    assert gens == sorted([f".{name}.tdb-{save_id2}", f".{name}.tdb-{save_id}"]), gens
    spare_inode = (Path(path).parent / f".{name}.tdb-{save_id}").stat().st_ino
    sd3, tables3 = _state(rank, seed=3)
    save_id3 = tdb.checkpoint.save(sd3, path)
    dist.barrier()
    gen3 = Path(path).parent / f".{name}.tdb-{save_id3}"
    assert gen3.stat().st_ino == spare_inode, "the spare generation was not reused"
    gens = sorted(p.name for p in Path(path).parent.iterdir() if ".tdb-" in p.name)
    assert gens == sorted([f".{name}.tdb-{save_id3}", f".{name}.tdb-{save_id2}"]), gens
    tdb.checkpoint.load(dest, path)  # a rewritten spare loads the new values, checksums and all
    for key, table in tables3.items():
        assert torch.equal(tdb.full_tensor(dest[key]), table), key
    save_id4 = tdb.checkpoint.save(sd3, path, keep_spare=False)
    dist.barrier()
    gens = sorted(p.name for p in Path(path).parent.iterdir() if ".tdb-" in p.name)
    assert gens == [f".{name}.tdb-{save_id4}"], gens
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
        tdb.checkpoint.load(dest, path)
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
        ("unexpected", "unexpected keys in the checkpoint ['emb.tw.weight']"),
        ("corrupt", "is corrupt or from another save"),
        ("truncated", "is truncated"),
        ("foreign", "is corrupt or from another save"),
    ],
)
def test_load_refuses_and_writes_nothing(pool, tmp_path, case, needle):
    path = str(tmp_path / "ck")
    pool.run(_check_refusal, path, "setup")
    root = Path(path).resolve()
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
            shutil.copy(Path(other).resolve() / f.name, f)
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
    files = sorted(p.name for p in path.resolve().iterdir())
    assert files == [".metadata", "__0_0.distcp", "tdb_manifest.json"], files
    dest = {"t": torch.zeros(12, 4)}
    tdb.checkpoint.load(dest, str(path))
    assert torch.equal(dest["t"], reference_table((12, 4), seed=3))


def test_uncommitted_generation_is_never_loaded(pool, tmp_path):
    path = tmp_path / "ck"
    (tmp_path / ".ck.tdb-deadbeef").mkdir()  # what an interrupted first save leaves
    for m in pool.run(_check_no_checkpoint, str(path)):
        assert "no committed checkpoint" in m and ".ck.tdb-deadbeef" in m
