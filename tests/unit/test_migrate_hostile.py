"""``migrate`` on crafted sources: nothing outside SRC is read, nothing outside DST written, no code runs;
0-d and 1-D tensors migrate; glob characters in DST names."""

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.checkpoint.format.validate import parse_metadata

from ..distributed.checks import reference_table


def _plain_dcp(src):
    sd = {"w": reference_table((30, 4), seed=1), "bias": reference_table((4,), seed=2), "step": torch.tensor(7)}
    dcp.save(sd, checkpoint_id=str(src), no_dist=True)
    return sd


def _blank():
    return {"w": torch.zeros(30, 4), "bias": torch.zeros(4), "step": torch.tensor(0)}


def test_zero_d_and_one_d_tensors_migrate(tmp_path):
    src, dst = tmp_path / "old", tmp_path / "run[1]"
    (tmp_path / "run1").mkdir()  # a similar name, left alone
    want = _plain_dcp(src)
    summary = tdb.checkpoint.migrate(src, dst, progress=False)
    assert summary["keys"] == 3
    dest = _blank()
    tdb.checkpoint.load(dest, dst)
    for k in want:
        assert torch.equal(dest[k], want[k]), k
    assert sorted(os.listdir(tmp_path / "run1")) == []


def _rewrite_md(src, fn):
    md = parse_metadata((src / ".metadata").read_bytes(), "x")
    fn(md)
    (src / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.parametrize("where", ["absolute", "dotdot"])
def test_paths_leaving_src_are_refused(tmp_path, where):
    src, dst = tmp_path / "box" / "old", tmp_path / "box" / "new"
    _plain_dcp(src)
    victim = tmp_path / "victim.distcp"
    victim.write_bytes(b"x" * 20000)
    rel = str(victim) if where == "absolute" else "../../victim.distcp"

    def redirect(md):
        for info in md.storage_data.values():
            info.relative_path = rel

    _rewrite_md(src, redirect)
    with pytest.raises(tdb.checkpoint.CheckpointError, match="not a plain file name"):
        tdb.checkpoint.migrate(src, dst, progress=False)
    assert victim.read_bytes() == b"x" * 20000
    assert sorted(os.listdir(tmp_path / "box")) == ["old"], "migrate wrote something"


def test_symlinked_data_file_is_refused(tmp_path):
    src, dst = tmp_path / "old", tmp_path / "new"
    _plain_dcp(src)
    secret = tmp_path / "secret"
    secret.write_bytes(b"secret bytes")
    data = next(src.glob("*.distcp"))
    data.unlink()
    data.symlink_to(secret)
    with pytest.raises(tdb.checkpoint.CheckpointError, match="symlink"):
        tdb.checkpoint.migrate(src, dst, progress=False)
    assert not dst.exists() and not [p for p in tmp_path.iterdir() if ".new.tdb-" in p.name]


def test_symlinked_metadata_is_refused(tmp_path):
    src, dst = tmp_path / "old", tmp_path / "new"
    _plain_dcp(src)
    outside = tmp_path / "outside.metadata"
    (src / ".metadata").rename(outside)
    (src / ".metadata").symlink_to(outside)
    with pytest.raises(tdb.checkpoint.CheckpointError, match="not a regular file"):
        tdb.checkpoint.migrate(src, dst, progress=False)
    with pytest.raises(tdb.checkpoint.CheckpointError, match="not a regular file"):
        tdb.checkpoint.inspect(src)


def test_pickle_payload_in_a_per_rank_file_runs_nothing(tmp_path):
    src, dst, marker = tmp_path / "old", tmp_path / "new", tmp_path / "marker"
    src.mkdir()

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"w": torch.zeros(2), "evil": Payload()}, src / "model_rank0.pt")
    with pytest.raises(tdb.checkpoint.CheckpointError) as info:
        tdb.checkpoint.migrate(src, dst, progress=False)
    msg = str(info.value)
    assert "model_rank0.pt cannot be loaded with weights_only=True" in msg and "trusted_pickles" in msg, msg
    assert not marker.exists(), "a per-rank file ran code"
    assert not dst.exists()


def test_symlinked_per_rank_file_is_refused(tmp_path):
    src, dst = tmp_path / "old", tmp_path / "new"
    src.mkdir()
    torch.save({"w": torch.zeros(2)}, tmp_path / "elsewhere.pt")
    (src / "model_rank0.pt").symlink_to(tmp_path / "elsewhere.pt")
    with pytest.raises(ValueError, match="symlink"):
        tdb.checkpoint.migrate(src, dst, progress=False)
