"""``checkpoint.export`` / ``python -m torchrec_dtensor_bridge export``: a checkpoint saved by 2 gloo ranks in
uneven layouts, written in the test process (no process group) to one safetensors or torch file.

The safetensors file is read back by a parser written here from the format's definition (an 8-byte
little-endian header size, a JSON header, the raw bytes), independently of the package; every tensor must
equal the table that was saved, exactly.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge import cli
from torchrec_dtensor_bridge.convert import dtensor_from_local_shards
from torchrec_dtensor_bridge.layout import ShardLayout

from .harness import make_pool_fixture, run_python
from .jobs import export_memory
from tests.layout import committed

pool = make_pool_fixture(2)

TABLES = {
    "t.rows": (ShardLayout.row_wise((13, 6), [9, 4], dtype=torch.float32), torch.float32),
    "t.grid": (ShardLayout.grid((10, 8), [4, 6], [3, 5], [0, 1, 1, 0], dtype=torch.float16), torch.float16),
    "t.cols": (ShardLayout.column_wise((7, 10), [7, 3], dtype=torch.bfloat16), torch.bfloat16),
    "t.ids": (ShardLayout.row_wise((11, 2), [5, 6], dtype=torch.int64), torch.int64),
}
SAFE_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64}


def _table(key: str) -> torch.Tensor:
    layout, dtype = TABLES[key]
    g = torch.Generator().manual_seed(len(key) * 31 + layout.global_shape[0])
    full = torch.randn(layout.global_shape, generator=g) * 100
    return full.to(dtype)


def _save(rank: int, world: int, path: str) -> None:
    sd: dict = {"step": 7, "note": "not a tensor"}
    for key, (layout, _) in TABLES.items():
        full = _table(key)
        sd[key] = dtensor_from_local_shards(layout, [full[s.slices()].clone() for s in layout.shards_on(rank)])
    tdb.checkpoint.save(sd, path)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    header.pop("__metadata__", None)
    out = {}
    for key, rec in header.items():
        begin, end = rec["data_offsets"]
        raw = bytearray(data[8 + size + begin : 8 + size + end])
        out[key] = torch.frombuffer(raw, dtype=SAFE_DTYPES[rec["dtype"]]).reshape(rec["shape"]) if raw else \
            torch.empty(rec["shape"], dtype=SAFE_DTYPES[rec["dtype"]])
    return out


@pytest.fixture(scope="module")
def saved(pool, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("export") / "ck"
    pool.run(_save, str(path))
    return path


@pytest.mark.parametrize("buffer_bytes", [1 << 20, 40])  # whole tables at once; a few rows (one at least)
@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_writes_every_table_whole(saved, tmp_path, fmt, buffer_bytes):
    dst = tmp_path / f"out.{fmt}"
    done = tdb.checkpoint.export(saved, dst, format=fmt, progress=False, buffer_bytes=buffer_bytes)
    got = _read_safetensors(dst) if fmt == "safetensors" else torch.load(dst, weights_only=True)
    assert sorted(got) == sorted(TABLES) == done.keys
    for key in TABLES:
        assert got[key].dtype == TABLES[key][1], key
        assert torch.equal(got[key], _table(key)), key
    assert done.skipped == ["note", "step"]
    assert done.bytes == sum(t.numel() * t.element_size() for t in got.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == [dst.name], "scratch files left behind"


def test_export_keys_by_glob_and_refusals_before_writing(saved, tmp_path):
    dst = tmp_path / "some.safetensors"
    tdb.checkpoint.export(saved, dst, keys=["t.r*", "*.ids"], progress=False)
    assert sorted(_read_safetensors(dst)) == ["t.ids", "t.rows"]
    before = dst.read_bytes()
    with pytest.raises(ValueError, match=r"keys \['nothing\*'\] match no tensor"):
        tdb.checkpoint.export(saved, dst, keys=["t.rows", "nothing*"], progress=False)
    with pytest.raises(ValueError, match="format must be one of"):
        tdb.checkpoint.export(saved, dst, format="npz", progress=False)
    assert dst.read_bytes() == before


def test_export_of_a_damaged_checkpoint_refuses_and_leaves_dst(saved, tmp_path):
    damaged = tmp_path / "damaged"
    import shutil

    shutil.copytree(committed(saved), damaged)
    data = max((p for p in damaged.rglob("*.distcp")), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    dst = tmp_path / "out.safetensors"
    dst.write_bytes(b"previous")
    with pytest.raises(tdb.checkpoint.CheckpointError):
        tdb.checkpoint.export(damaged, dst, progress=False)
    assert dst.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged", "out.safetensors"]


def test_export_command_line(saved, tmp_path, capsys):
    dst = tmp_path / "cli.pt"
    # the command's main in this process (``python -m torchrec_dtensor_bridge`` runs it: test_migrate_w2 and
    # test_kernels_cli start that interpreter)
    assert cli.main(["export", str(saved), str(dst), "--format", "torch", "--keys", "t.grid", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "exported 1 tensors" in out and "left out 2 non-tensor keys" in out, out
    got = torch.load(dst, weights_only=True)
    assert list(got) == ["t.grid"] and torch.equal(got["t.grid"], _table("t.grid"))
    assert cli.main(["export", str(saved), str(dst), "--keys", "zzz"]) == 1
    assert "match no tensor" in capsys.readouterr().err


def _check_memory(tmp_path: Path, mib: int, buffer_mib: int, bound: int) -> None:
    job = "tests/distributed/jobs/export_memory.py"
    ck, dst = tmp_path / "big", tmp_path / "big.safetensors"
    big = export_memory.tables(mib)  # saved here: the export alone is measured, in an interpreter of its own
    tdb.checkpoint.save(big, ck)
    del big
    res = run_python([job, str(ck), str(dst), str(buffer_mib)], timeout=300)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["bytes"] == mib << 20
    assert got["growth"] < bound, f"peak resident memory grew by {got['growth'] >> 20} MiB exporting {mib} MiB"
    rows = (mib << 20) // 4 // (256 * 4)
    with open(dst, "rb") as f:  # spot checks: first and last rows of each table, without reading it all
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        for i in range(4):
            begin, end = header[f"t{i}"]["data_offsets"]
            for row in (0, rows - 1):
                f.seek(8 + size + begin + row * 256 * 4)
                values = torch.frombuffer(bytearray(f.read(256 * 4)), dtype=torch.float32)
                assert torch.equal(values, torch.full((256,), float(i + row))), (i, row)


def test_export_memory_stays_bounded(tmp_path):
    """128 MiB in 32 MiB tables, exported with a 4 MiB buffer: peak memory grows by less than one table."""
    _check_memory(tmp_path, 128, 4, 28 << 20)


@pytest.mark.slow
def test_export_of_two_gib_stays_under_256_mib(tmp_path):
    _check_memory(tmp_path, 2048, 64, 256 << 20)
