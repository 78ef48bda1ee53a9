"""The GPU tooling where there is no GPU (so that CI checks it): ``scripts/gpu_check.sh`` refuses clearly (exit 2,
no traceback), and, on a pretended GPU (an interpreter whose torch reports a CUDA device, and whose pytest reports
the results a test gives it), runs its steps in order, skips what needs fbgemm-gpu's CUDA build naming it, and
ends with one line listing every step's outcome; ``scripts/bench_lookup_gpu.py`` shows ``--help``, refuses under
``--require-cuda``, runs its CPU dry run, and at its default size fits a 40 GiB card (its memory arithmetic
against the tables' bytes). Skipped where a CUDA device is present: there ``gpu_check.sh`` runs everything for
real."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torchrec_dtensor_bridge.kernels import fbgemm

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
GIB = 2**30

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: gpu_check.sh runs it")


def _run(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHON": sys.executable, "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT), **env}
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


PRETEND_CUDA = """
    import builtins
    import sys

    _import, _busy = builtins.__import__, []


    def _pretend(torch):
        torch.version.cuda = "13.0"
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: 1
        torch.cuda.get_device_name = lambda *a: "Pretended GPU"
        torch.cuda.mem_get_info = lambda *a: (40 * 2**30, 80 * 2**30)


    def _hooked(name, *args, **kwargs):
        outermost = name == "torch" and not _busy and "torch" not in sys.modules
        if outermost:
            _busy.append(name)
        module = _import(name, *args, **kwargs)
        if outermost:
            builtins.__import__ = _import
            _pretend(sys.modules["torch"])
        return module


    builtins.__import__ = _hooked
"""

PRETEND_PYTEST = """
    import json
    import os
    import sys

    args = sys.argv[1:]
    target = next(a for a in args[2:] if not a.startswith("-") and a.startswith("tests"))
    report = next(a.split("=", 1)[1] for a in args if a.startswith("--junitxml="))
    r = json.loads(os.environ["PRETEND_RESULTS"])[target]
    cases = [f'<testcase classname="{target}" name="passes{i}"/>' for i in range(r["passed"])]
    cases += [f'<testcase classname="{target}" name="fails{i}"><failure message="no"/></testcase>'
              for i in range(r["failed"])]
    cases += [f'<testcase classname="{target}" name="skips{i}"><skipped message="{r["why"]}"/></testcase>'
              for i in range(r["skipped"])]
    with open(report, "w") as f:
        f.write(f'<testsuites><testsuite tests="{len(cases)}" failures="{r["failed"]}" errors="0" '
                f'skipped="{r["skipped"]}">{"".join(cases)}</testsuite></testsuites>')
    sys.exit(1 if r["failed"] else 0)
"""

STEPS = {  # what gpu_check.sh runs for each step, in order
    "schemas": "tests/unit/test_fbgemm_schemas.py",
    "kernels": "tests/gpu/test_cuda_kernel_smoke.py",
    "duplicate": "tests/gpu/test_cuda_duplicate_shard.py",
    "tests/gpu": "tests/gpu",
}


def _pretended_gpu(tmp_path: Path, results: dict[str, dict]) -> subprocess.CompletedProcess:
    """``gpu_check.sh`` with an interpreter whose torch reports a CUDA device and whose pytest reports
    ``results`` (by the test path a step gives it): passed, failed and skipped counts, a skip reason."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(PRETEND_CUDA))
    (tmp_path / "pytest_stand_in.py").write_text(textwrap.dedent(PRETEND_PYTEST))
    shim = tmp_path / "python"
    shim.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        if [ "$1" = -m ] && [ "$2" = pytest ]; then exec {sys.executable} {tmp_path / "pytest_stand_in.py"} "$@"; fi
        PYTHONPATH={site}:$PYTHONPATH exec {sys.executable} "$@"
        """))
    shim.chmod(0o755)
    full = {STEPS[k]: {"passed": 0, "failed": 0, "skipped": 0, "why": "", **v} for k, v in results.items()}
    return _run("bash", str(SCRIPTS / "gpu_check.sh"), PYTHON=str(shim), PRETEND_RESULTS=json.dumps(full))


def _summary(proc: subprocess.CompletedProcess) -> str:
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu_check: "), proc.stdout
    return last


@no_cuda
@pytest.mark.skipif(not fbgemm.available() or fbgemm.cuda_available(), reason="needs fbgemm_gpu's CPU build")
def test_gpu_check_steps_and_summary_on_a_pretended_gpu(tmp_path):
    """A failing step fails the check (exit 1) and the rest still run; a step whose tests all skip on a GPU
    failed; the benchmark, which needs fbgemm-gpu's CUDA build, is skipped, naming it."""
    proc = _pretended_gpu(tmp_path, {
        "schemas": {"passed": 30, "skipped": 5, "why": "fbgemm-gpu-cpu does not register an op"},
        "kernels": {"passed": 20, "failed": 4},
        "duplicate": {"skipped": 8, "why": "no CUDA device"},
        "tests/gpu": {"passed": 100, "skipped": 2, "why": "fbgemm_gpu's CUDA build is not installed"},
    })
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    out = proc.stdout
    assert "gpu_check: Pretended GPU (1 visible, 40.0 of 80.0 GiB free)" in out
    assert "gpu_check: running with torch " in out and "fbgemm-gpu-cpu " in out
    started = [line.split()[1] for line in out.splitlines() if " (limit " in line]
    assert started == list(STEPS), "the steps in order, the benchmark skipped"
    assert "  schemas: skipped: fbgemm-gpu-cpu does not register an op (5)" in out
    assert f"  kernels: FAILED {STEPS['kernels']}::fails0" in out
    summary = _summary(proc)
    for part in ("gpu_check: FAILED: install ok", "schemas ok (30 passed, 5 skipped)",
                 "kernels FAILED (20 passed, 4 failed, 0 errors, 0 skipped)",
                 "duplicate FAILED (nothing ran: 0 passed, 0 failed, 0 errors, 8 skipped)",
                 "tests/gpu ok (100 passed, 2 skipped)",
                 "benchmark skipped (compares with fbgemm's CUDA TBE module: needs fbgemm-gpu's CUDA build"):
        assert part in summary, f"{part!r} not in {summary!r}"


@no_cuda
@pytest.mark.slow  # a second run of the check's probe (torch and fbgemm_gpu imported)
@pytest.mark.skipif(not fbgemm.available() or fbgemm.cuda_available(), reason="needs fbgemm_gpu's CPU build")
def test_gpu_check_without_fbgemm_cuda_build_is_incomplete(tmp_path):
    """Every step that ran passed, but the benchmark needs the missing wheel: exit 3, saying so."""
    proc = _pretended_gpu(tmp_path, {k: {"passed": 3} for k in STEPS})
    assert proc.returncode == 3, proc.stdout + proc.stderr
    summary = _summary(proc)
    assert summary.startswith("gpu_check: INCOMPLETE (nothing failed; skipped what needs fbgemm-gpu's CUDA build")
    assert "tests/gpu ok (3 passed); benchmark skipped" in summary


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
