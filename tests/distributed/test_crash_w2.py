"""Crash matrix: a saving rank SIGKILLed at each stage, on a fresh path, over a checkpoint, and in an incremental
save (its base and the previous incremental checkpoint at the path stay loadable).

Each case runs two fresh gloo processes (a killed rank breaks its group, so the
shared pool is not used). Afterwards this process loads the path with no
process group: it must return the last committed checkpoint bit-exact or raise
IncompleteCheckpointError — never mixed values — and the surviving rank must
have raised promptly instead of hanging.
"""

import multiprocessing as mp
import json
import os
import signal
import time
import traceback
from pathlib import Path
from datetime import timedelta

import pytest
import torch

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.layout import ShardLayout

from .checks import reference_table
from .harness import _free_port
from tests.layout import committed as committed_generation, generations
from torchrec_dtensor_bridge.checkpoint import commit as protocol
from torchrec_dtensor_bridge.checkpoint.storage import locate

LAYOUT = ShardLayout.row_wise((64, 8), [40, 24], name="t")


def _worker(rank, port, path, mode, stage, victim, results):
    import torch.distributed as dist

    from torchrec_dtensor_bridge.checkpoint import api
    from torchrec_dtensor_bridge.convert import dtensor_from_local_shards

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))

    def state(seed):
        incremental = mode.startswith("incremental") and seed == 2
        table = _sparse_new() if incremental else reference_table(LAYOUT.global_shape, seed=seed)
        return {"t": dtensor_from_local_shards(LAYOUT, [table[s.slices()].clone() for s in LAYOUT.shards_on(rank)])}

    try:
        if mode in ("overwrite", "overwrite_spare"):
            tdb.checkpoint.save(state(1), path)
        if mode == "overwrite_spare":  # now a spare generation exists: the killed save rewrites it
            tdb.checkpoint.save(state(1), path)
        base = None
        if mode.startswith("incremental"):  # a full base, an incremental over it, then the killed incremental save
            base = path + "-base"
            tdb.checkpoint.save(state(1), base)
            tdb.checkpoint.save(state(1), path, base=base)

        def hook(name):
            if name == stage and rank == victim:
                os.kill(os.getpid(), signal.SIGKILL)

        api._fault_hook = hook
        t0 = time.monotonic()
        try:
            if mode == "incremental_async":  # killed on the thread that writes and commits
                tdb.checkpoint.save(state(2), path, base=base, asynchronous=True).result()
            else:
                tdb.checkpoint.save(state(2), path, base=base, storage_options=_options(path))
            results.put((rank, "saved", time.monotonic() - t0))
        except Exception as e:  # noqa: BLE001 - reported to the test
            results.put((rank, f"raised {type(e).__name__}", time.monotonic() - t0))
    except BaseException:  # noqa: BLE001
        results.put((rank, "error " + traceback.format_exc(), 0.0))


# (stage, rank killed there, whether the new checkpoint is committed). Rank 0's rename is the
# commit point: once rank 0 holds every rank's checksums ("checksummed" on rank 1), it commits
# a complete, verified checkpoint even though a peer died afterwards.
STAGES = [
    ("prepared", 1, False),
    ("dcp_saved", 1, False),
    ("checksummed", 1, True),
    ("manifest_written", 0, False),
    ("committed", 0, True),
]


# The default run kills over a checkpoint with a spare generation (the most state on disk: a previous commit, a
# spare being rewritten) at the stages before, during and after the commit, and each other mode at one stage;
# `-m slow` adds the rest (every mode at every stage).
DEFAULT_SPARE = {"prepared", "checksummed", "committed"}
DEFAULT_OTHERS = {("fresh", "committed"), ("overwrite", "dcp_saved"), ("incremental", "dcp_saved")}


def _sparse_new():
    """The incremental mode's new values: three rows of the old table changed."""
    table = reference_table(LAYOUT.global_shape, seed=1)
    table[[3, 30, 50]] = reference_table(LAYOUT.global_shape, seed=2)[[3, 30, 50]]
    return table


S3_LEASE = 3.0  # seconds: a killed saver's lease on S3 expires this soon after its last renewal
S3_DEFAULT: set[str] = set()  # every stage on S3 under -m slow: by default, the S3 conformance suite's commit
# race and held lock (tests/unit/test_storage_conformance.py), and the kills above on disk


def _options(path):
    return {"lease_seconds": S3_LEASE} if path.startswith("s3://") else None


def _cases():
    for stage, victim, committed in STAGES:
        for mode in ("fresh", "overwrite", "overwrite_spare", "incremental", "incremental_async"):
            default = (mode == "overwrite_spare" and stage in DEFAULT_SPARE) or (mode, stage) in DEFAULT_OTHERS
            yield pytest.param(mode, stage, victim, committed, marks=() if default else (pytest.mark.slow,),
                               id=f"{stage}-{victim}-{committed}-{mode}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, stage, victim, committed", list(_cases()))
def test_killed_save(tmp_path, mode, stage, victim, committed):
    _killed_save(str(tmp_path / "ck"), tmp_path, mode, stage, victim, committed)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage, victim, committed", [
    pytest.param(*case, id=f"{case[0]}-{case[1]}-{case[2]}", marks=() if case[0] in S3_DEFAULT else (pytest.mark.slow,))
    for case in STAGES])
def test_killed_save_to_an_object_store(s3_server, s3_bucket, tmp_path, stage, victim, committed):
    """The same kills, saving over a commit on S3 (a real SeaweedFS): the previous commit loads bit-exact until
    the conditional put of the commit record; nothing of the killed save is visible."""
    _killed_save(f"s3://{s3_bucket}/run/ck", tmp_path, "overwrite", stage, victim, committed)


def _killed_save(path, tmp_path, mode, stage, victim, committed):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, path, mode, stage, victim, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
    for p in procs:
        if p.is_alive():
            p.kill()
            pytest.fail(f"rank {procs.index(p)} hung after rank {victim} was killed at {stage!r}")
    assert procs[victim].exitcode == -signal.SIGKILL
    survivor = 1 - victim
    reports = {}
    while not results.empty():
        rank, status, seconds = results.get()
        reports[rank] = (status, seconds)
    status, seconds = reports[survivor]
    assert not status.startswith("error"), status
    if not committed:
        assert status.startswith("raised"), f"survivor returned from an interrupted save: {status}"
    assert seconds < 45, f"survivor took {seconds:.1f}s to notice"

    old = reference_table(LAYOUT.global_shape, seed=1)
    new = _sparse_new() if mode.startswith("incremental") else reference_table(LAYOUT.global_shape, seed=2)
    dest = {"t": torch.full(LAYOUT.global_shape, -1.0)}
    if committed:
        tdb.checkpoint.load(dest, path)
        assert torch.equal(dest["t"], new)
    elif mode in ("overwrite", "overwrite_spare", "incremental", "incremental_async"):
        tdb.checkpoint.load(dest, path)
        assert torch.equal(dest["t"], old), "an interrupted overwrite changed what the checkpoint returns"
    else:
        with pytest.raises(tdb.checkpoint.IncompleteCheckpointError, match="no committed checkpoint"):
            tdb.checkpoint.load(dest, path)
        assert torch.equal(dest["t"], torch.full(LAYOUT.global_shape, -1.0))
    # the next save cleans up what the interrupted one left
    if path.startswith("s3://") and victim == 0:  # the killed saver's lease: taken over once it expired
        time.sleep(S3_LEASE + 1)
    tdb.checkpoint.save({"t": new.clone()}, path)
    if path.startswith("s3://"):
        loc = locate(path)
        record = json.loads((loc / protocol.COMMIT).get(1 << 20))
        left = sorted(g.name for g in protocol.generations(loc))
        superseded = {s[0] for s in record["superseded"]}  # kept for readers for the grace period
        assert set(left) <= {record["generation"]} | superseded, (left, record)
        return
    if mode.startswith("incremental"):  # the base is whole, and the killed save left nothing beside it
        base_gens = generations(tmp_path / "ck-base")
        assert len(base_gens) == 1, base_gens
    leftovers = generations(path)
    assert len(leftovers) <= 2, leftovers  # the committed generation and at most one spare
    assert committed_generation(Path(path)).name in leftovers
