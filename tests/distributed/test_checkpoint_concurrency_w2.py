"""Two jobs of 2 gloo ranks each on one checkpoint path: loads during a save loop, two savers;
a damaged record read by one rank only; ranks that disagree on a key's shape at save;
process groups other than WORLD; a bare LocalShardsWrapper round trip."""

import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.checkpoint.format import manifest as mf
from torchrec_dtensor_bridge.layout import ShardLayout

from ..checkpoint_writers import rewrite_manifest
from .checks import reference_table
from .harness import make_pool_fixture
from tests.layout import committed, generations

pool = make_pool_fixture(2)
pool_b = make_pool_fixture(2, name="pool_b")

RW = ShardLayout.row_wise((300, 16), [170, 130], name="rw")
CW = ShardLayout.column_wise((50, 12), [5, 7], name="cw")


def _state(rank, step, blank=False):
    sd = {}
    for i, lay in enumerate((RW, CW)):
        table = reference_table(lay.global_shape, seed=1000 * step + i)
        local = [(torch.full(s.sizes, -1.0) if blank else table[s.slices()].clone()) for s in lay.shards_on(rank)]
        sd[lay.name] = tdb.convert.dtensor_from_local_shards(lay, local)
    sd["step"] = torch.tensor(-1 if blank else step)
    return sd


def _whole(rank, sd, step):
    """Whether every local shard of ``sd`` holds exactly save ``step``'s values."""
    for i, lay in enumerate((RW, CW)):
        table = reference_table(lay.global_shape, seed=1000 * step + i)
        for spec, t in zip(lay.shards_on(rank), tdb.convert.local_shards_of(sd[lay.name])):
            if not torch.equal(t, table[spec.slices()]):
                return False
    return True


def _save_loop(rank, world_size, path, stop, first, count):
    """Save steps first, first+1, ... until ``stop`` exists (rank 0 decides for both) or ``count`` saves."""
    busy = 0
    for step in range(first, first + count):
        box = [Path(stop).exists()]
        dist.broadcast_object_list(box, src=0)
        if box[0]:
            break
        try:
            tdb.checkpoint.save(_state(rank, step), path)
        except tdb.checkpoint.CheckpointBusyError as e:
            assert "another save to" in str(e), e
            busy += 1
    return busy


def _load_loop(rank, world_size, path, stop, loads):
    seen = []
    for _ in range(loads):
        dest = _state(rank, 0, blank=True)
        tdb.checkpoint.load(dest, path)
        step = int(dest["step"])
        steps = [None] * world_size
        dist.all_gather_object(steps, step)
        assert len(set(steps)) == 1, f"ranks loaded different saves: {steps}"
        assert _whole(rank, dest, step), f"rank {rank}: tables are not those of save {step}"
        seen.append(step)
    if rank == 0:
        Path(stop).touch()
    return seen


def _in_thread(target, *args):
    out = {}

    def run():
        try:
            out["value"] = target(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_loads_during_a_save_loop_return_one_whole_save(pool, pool_b, tmp_path):
    path, stop = str(tmp_path / "ck"), str(tmp_path / "stop")
    pool.run(_save_loop, path, stop, 1, 1)
    saver, saved = _in_thread(pool.run, _save_loop, path, stop, 2, 500)
    seen = pool_b.run(_load_loop, path, stop, 30)
    saver.join(timeout=240)
    assert not saver.is_alive()
    assert "error" not in saved, saved.get("error")
    assert seen[0] == seen[1] and len(seen[0]) == 30
    assert len(set(seen[0])) > 3, f"the loads did not overlap the saves: {seen[0]}"


def _two_jobs(pool, pool_b, path, stop, saves, env):
    """Two jobs saving ``saves`` times each to ``path`` at once; what their saves and a load after them give."""
    a, out_a = _in_thread(pool.run, _in_env, env, _save_loop, path, stop, 1, saves)
    b, out_b = _in_thread(pool_b.run, _in_env, env, _save_loop, path, stop, 101, saves)
    a.join(timeout=240)
    b.join(timeout=240)
    assert "error" not in out_a and "error" not in out_b, (out_a.get("error"), out_b.get("error"))
    busy_a, busy_b = out_a["value"], out_b["value"]
    assert busy_a[0] == busy_a[1] and busy_b[0] == busy_b[1], "ranks of one job disagreed on a save's outcome"
    assert busy_a[0] + busy_b[0] > 0, "the savers never met"
    steps = pool.run(_in_env, env, _load_one, path)
    assert steps[0] == steps[1]


def test_two_jobs_saving_to_one_path(pool, pool_b, tmp_path):
    """Each save either commits or raises CheckpointBusyError on every rank of its job; the path ends as one
    whole save of one job."""
    _two_jobs(pool, pool_b, str(tmp_path / "ck"), str(tmp_path / "never"), 15, {})


def _in_env(rank, world_size, env, fn, *args):
    """``fn`` with ``env`` set (the S3 server's variables, for ranks the pools started before the server)."""
    os.environ.update(env)
    return fn(rank, world_size, *args)


@pytest.mark.slow  # by default: the lock held and the commit race, tests/unit/test_storage_conformance.py
def test_two_jobs_saving_to_one_object_store_name(pool, pool_b, s3_server, s3_bucket, tmp_path):
    """The same on S3 (a real SeaweedFS): the save lock is a lease object, the commit a conditional put."""
    _two_jobs(pool, pool_b, f"s3://{s3_bucket}/jobs/ck", str(tmp_path / "never"), 8, s3_server.env)


def _load_one(rank, world_size, path):
    dest = _state(rank, 0, blank=True)
    tdb.checkpoint.load(dest, path)
    step = int(dest["step"])
    assert _whole(rank, dest, step)
    return step


def _save_one(rank, world_size, path, step):
    tdb.checkpoint.save(_state(rank, step), path)


def _load_expecting(rank, world_size, path):
    dest = _state(rank, 0, blank=True)
    try:
        tdb.checkpoint.load(dest, path)
    except Exception as e:  # noqa: BLE001 - compared across ranks by the test
        assert all(bool((t == -1).all()) for v in ("rw", "cw") for t in tdb.convert.local_shards_of(dest[v])), \
            "a refused load modified the destination"
        return type(e).__name__, str(e)
    return None, int(dest["step"])


def test_damaged_record_read_by_one_rank_only(pool, tmp_path):
    """The manifest record of a chunk only rank 0 reads is damaged (the manifest's own checksum recomputed, as a
    faulty writer would): both ranks raise the same error, and the next load works."""
    path = str(tmp_path / "ck")
    pool.run(_save_one, path, 5)
    root = committed(Path(path))
    body = mf.read_manifest(root)
    key = "rw@0,0"  # rows 0-169: only rank 0's shard
    good = dict(body["items"][key])
    del body["items"][key]["offset"]
    rewrite_manifest(root, body)
    (n0, m0), (n1, m1) = pool.run(_load_expecting, path)
    assert n0 == n1 == "CorruptCheckpointError" and m0 == m1, (m0, m1)
    assert f"item {key!r}" in m0 and "tdb_manifest.json" in m0 and "(rank 0)" in m0 and "rank 1" not in m0, m0
    body["items"][key] = good
    rewrite_manifest(root, body)
    assert pool.run(_load_expecting, path) == [(None, 5), (None, 5)]


def _save_disagreeing(rank, world_size, path):
    sd = _state(rank, 7)
    sd["replicated"] = torch.zeros(4 if rank == 0 else 5)
    try:
        tdb.checkpoint.save(sd, path)
    except ValueError as e:
        return str(e)
    raise AssertionError("a save with disagreeing shapes committed")


def test_save_refuses_ranks_that_disagree_on_a_shape(pool, tmp_path):
    path = str(tmp_path / "ck")
    pool.run(_save_one, path, 3)
    for m in pool.run(_save_disagreeing, path):
        assert "key 'replicated': ranks disagree on its shape or dtype" in m and "[4]" in m and "[5]" in m, m
    assert pool.run(_load_one, path) == [3, 3]
    gens = generations(tmp_path / "ck")
    assert len(gens) == 1, gens


def _on_subgroup(rank, world_size, path):
    """A 1-rank mesh on each rank: every save/load runs on that mesh's group, not WORLD."""
    mesh = dist.device_mesh.init_device_mesh("cpu", (world_size,))
    sub = mesh.get_group()
    assert tdb.checkpoint.api.default_process_group({"t": torch.distributed.tensor.distribute_tensor(
        torch.zeros(4, 2), mesh)}) is sub
    table = reference_table((6, 3), seed=rank)
    groups = [dist.new_group([r]) for r in range(world_size)]
    mine = groups[rank]
    tdb.checkpoint.save({"t": table}, f"{path}{rank}", process_group=mine)
    dest = {"t": torch.zeros(6, 3)}
    tdb.checkpoint.load(dest, f"{path}{rank}", process_group=mine)
    assert torch.equal(dest["t"], table)


def test_save_and_load_on_a_group_other_than_world(pool, tmp_path):
    pool.run(_on_subgroup, str(tmp_path / "ck"))


def _bare_wrapper(rank, world_size, path):
    from torchrec_dtensor_bridge.wrapper import LocalShardsWrapper

    table = reference_table((8, 16), seed=9)
    rows = [(0, 5), (5, 8)][rank]
    w = LocalShardsWrapper([table[rows[0]:rows[1]].clone()], [(rows[0], 0)], global_shape=(8, 16))
    tdb.checkpoint.save({"w": w}, path)
    rows = [(0, 3), (3, 8)][rank]
    dest = LocalShardsWrapper([torch.zeros(rows[1] - rows[0], 16)], [(rows[0], 0)], global_shape=(8, 16))
    tdb.checkpoint.load({"w": dest}, path)
    assert torch.equal(dest.local_shards()[0], table[rows[0]:rows[1]])


def test_bare_local_shards_wrapper_round_trip(pool, tmp_path):
    pool.run(_bare_wrapper, str(tmp_path / "ck"))
