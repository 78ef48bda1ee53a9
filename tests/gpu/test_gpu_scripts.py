"""The GPU tooling where there is no GPU (so that CI checks it): ``scripts/gpu_check.sh`` refuses clearly (exit 2,
no traceback), ``scripts/bench_lookup_gpu.py`` shows ``--help``, refuses under ``--require-cuda``, runs its CPU
dry run, and at its default size fits a 40 GiB card (its memory arithmetic against the tables' bytes).
Skipped where a CUDA device is present: there ``gpu_check.sh`` runs everything for real."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
GIB = 2**30

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: gpu_check.sh runs it")


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHON": sys.executable, "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT)}
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
                          check=False)


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_lookup_gpu

    return bench_lookup_gpu


@no_cuda
def test_gpu_check_without_a_gpu_says_so():
    proc = _run("bash", str(SCRIPTS / "gpu_check.sh"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gpu_check: FAILED: no NVIDIA GPU" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


@no_cuda
def test_bench_help_and_refusal_without_cuda(tmp_path):
    shown = _run(sys.executable, str(SCRIPTS / "bench_lookup_gpu.py"), "--help")
    assert shown.returncode == 0 and "--rows" in shown.stdout and "mem_get_info" in shown.stdout
    out = tmp_path / "results.json"
    refused = _run(sys.executable, str(SCRIPTS / "bench_lookup_gpu.py"), "--require-cuda", "--out", str(out))
    assert refused.returncode == 2 and "FAILED: no CUDA device" in refused.stdout
    assert not out.exists(), "nothing recorded"


@no_cuda
@pytest.mark.slow  # runs the whole GPU benchmark on CPU, small
def test_bench_cpu_dry_run(tmp_path):
    proc = _run(sys.executable, str(SCRIPTS / "bench_lookup_gpu.py"), "--device", "cpu", "--tables", "2", "--rows",
                "1000", "--dim", "16", "--batch", "32", "--bag", "4", "--reps", "1", "--warmup", "0", "--inner", "1",
                "--out", str(tmp_path / "results.json"), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step    fbgemm / ours:" in proc.stdout, proc.stdout


def test_bench_default_fits_a_40_gib_card(bench):
    """An A100 40GB reports about 39.4 GiB, of which about 39 are free after the CUDA context."""
    cfg = {"tables": 8, "rows": None, "dim": 128, "optimizer": "rowwise_adagrad"}
    free = int(38.5 * GIB)
    rows = bench.rows_that_fit(cfg, free)
    assert rows == bench.DEFAULT_ROWS == 4_000_000
    tables = 8 * rows * 128 * 4
    need = bench.bytes_needed({**cfg, "rows": rows})
    assert need >= 2 * tables, "two copies of the tables: ours and fbgemm's module"
    assert need + bench.margin(free) <= free


@pytest.mark.parametrize("free_gib", [20, 10, 5])
def test_bench_rows_shrink_to_the_free_memory(bench, free_gib):
    cfg = {"tables": 8, "rows": None, "dim": 128, "optimizer": "sgd"}
    free = free_gib * GIB
    rows = bench.rows_that_fit(cfg, free)
    assert 0 < rows < bench.DEFAULT_ROWS
    assert bench.bytes_needed({**cfg, "rows": rows}) + bench.margin(free) <= free
    assert bench.bytes_needed({**cfg, "rows": rows + 1}) + bench.margin(free) > free, "the most that fits"
