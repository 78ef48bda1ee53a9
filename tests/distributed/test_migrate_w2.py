"""Migration of ShardedTensor-era checkpoints and the CLI, against real TorchRec models on 2 ranks."""

import contextlib
import io
import json
import pickle
import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge import cli

from .checks import reference_table
from .harness import make_pool_fixture, run_python
from .torchrec_models import TABLES, build_ebc, shard_ebc

pool = make_pool_fixture(2)
PLAN_B = {"t_rw": "column_wise", "t_tw": "row_wise", "t_cw": "table_wise", "t_trw": "column_wise",
          "t_twc": "row_wise", "t_dp": "data_parallel"}


def _reference(key, value, i):
    return reference_table(tuple(value.size()), value.dtype, seed=i)


def _old_state(world_size):
    sharded, _ = shard_ebc(build_ebc(), world_size)
    sd = sharded.state_dict()
    for i, (key, value) in enumerate(sorted(sd.items())):
        table = _reference(key, value, i)
        if isinstance(value, ShardedTensor):
            for s in value.local_shards():
                idx = tuple(slice(o, o + z) for o, z in zip(s.metadata.shard_offsets, s.metadata.shard_sizes))
                s.tensor.copy_(table[idx])
        else:
            value.copy_(table)
    return sd


def _write_old(rank, world_size, path, kind):
    sd = _old_state(world_size)
    if kind == "dcp":
        dcp.save(sd, checkpoint_id=path)
    else:
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save(sd, Path(path) / f"model_rank{rank}.pt")
    dist.barrier()


def _load_new(rank, world_size, path):
    sharded, _ = shard_ebc(build_ebc(seed=7), world_size, plan_kinds=PLAN_B)
    sd = tdb.state_dict_to_dtensor(sharded.state_dict())
    tdb.checkpoint.load(sd, path)
    for i, (key, value) in enumerate(sorted(sd.items())):
        want = reference_table(tuple(value.shape), value.dtype, seed=i)
        got = tdb.full_tensor(value) if isinstance(value, torch.distributed.tensor.DTensor) else value
        assert torch.equal(got, want), key


def _cli(*args):
    """The command line as a user runs it (a new interpreter: its exit status)."""
    return run_python(["-m", "torchrec_dtensor_bridge", *args], timeout=240)


def _main(*args) -> subprocess.CompletedProcess:
    """The same command line's ``main`` in this process (no interpreter start-up): its status and output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as e:  # argparse: usage errors and --help
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["tdb", *args], code, out.getvalue(), err.getvalue())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["dcp", pytest.param("rank_files", marks=pytest.mark.slow)])
def test_migrate_then_load_into_another_plan(pool, tmp_path, kind):
    src, dst = str(tmp_path / "old"), str(tmp_path / "new")
    pool.run(_write_old, src, kind)
    run = _cli("migrate", src, dst, "--no-progress")
    assert run.returncode == 0, run.stderr
    assert f"migrated {len(TABLES)} keys" in run.stdout, run.stdout
    pool.run(_load_new, dst)
    report = _main("inspect", dst)
    assert report.returncode == 0, report.stderr
    migrated_mib = re.search(r"\(([0-9.]+) MiB of tensors\)", run.stdout)
    assert migrated_mib and f"{len(TABLES)} keys, {migrated_mib[1]} MiB of tensors" in report.stdout, (
        run.stdout, report.stdout)  # migrate and inspect count and round the same bytes
    assert "None" not in report.stdout, report.stdout
    for name, (rows, dim, _) in TABLES.items():
        line = next(l for l in report.stdout.splitlines() if l.startswith(f"embedding_bags.{name}.weight"))
        assert f"{rows}x{dim}" in line and "float32" in line, line
    info = json.loads(_main("inspect", dst, "--json").stdout)
    assert info["embedding_bags.t_rw.weight"]["shape"] == list(TABLES["t_rw"][:2])


def test_migrate_refuses_a_checkpoint_with_missing_rows(pool, tmp_path):
    src = tmp_path / "old"
    pool.run(_write_old, str(src), "dcp")
    md_path = src / ".metadata"
    md = pickle.loads(md_path.read_bytes())
    md.state_dict_metadata["embedding_bags.t_rw.weight"].chunks.pop()
    md_path.write_bytes(pickle.dumps(md))
    run = _main("migrate", str(src), str(tmp_path / "new"), "--no-progress")
    assert run.returncode != 0
    assert "embedding_bags.t_rw.weight" in run.stderr and "cover" in run.stderr, run.stderr
    assert not (tmp_path / "new").exists()


def test_cli_errors_exit_non_zero(tmp_path):
    run = _cli("migrate", str(tmp_path / "nope"), str(tmp_path / "new"))
    assert run.returncode != 0 and "does not exist" in run.stderr
    run = _main("inspect", str(tmp_path / "nope"))
    assert run.returncode != 0 and "no committed checkpoint" in run.stderr
    run = _main("frobnicate")
    assert run.returncode != 0
    run = _main("migrate", "--help")
    assert run.returncode == 0 and "per-rank torch.save" in run.stdout
