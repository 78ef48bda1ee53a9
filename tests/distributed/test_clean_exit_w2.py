"""A job whose ranks raised and recovered exits with its own status (0), under CPU load.

Refused loads of a damaged checkpoint, good loads, and a collective that timed out on one rank leave
nothing behind (a thread, pending work) that outlives the process group and aborts the process at exit
(``terminate called without an active exception``, SIGABRT): the launcher reports every rank's exit
status, and the job runs while other processes keep every core busy.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from .harness import ROOT, _free_port, launch

JOB = ROOT / "tests" / "distributed" / "jobs" / "refuse_then_recover.py"
EXIT_JOB = ROOT / "tests" / "distributed" / "jobs" / "exit_after.py"
MODES = ("collective", "save", "refused_load")


@pytest.mark.timeout(240)
def test_ranks_that_raised_and_recovered_exit_cleanly_under_load(tmp_path):
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        res = launch(JOB, [str(tmp_path), "2"], nproc=2, timeout=200)
        assert res.returncode == 0, (res.returncode, res.stdout, res.stderr[-4000:])
        assert "terminate called" not in res.stderr and "SIGABRT" not in res.stderr, res.stderr[-4000:]
        # the ranks share one stdout pipe, and a line's text and its newline may reach it in two writes
        assert sorted(re.findall(r"rank (\d+) clean", res.stdout)) == ["0", "1"], res.stdout
    finally:
        for b in burners:
            b.kill()
            b.wait()


def _run_exit_job(mode: str, root, at_once: int) -> list[str]:
    """``at_once`` 2-rank runs of ``exit_after.py MODE`` side by side; the failures, described."""
    failures, jobs = [], []
    for k in range(at_once):
        port, where = _free_port(), root / f"{mode}{k}"
        where.mkdir()
        env = {key: v for key, v in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", OMP_NUM_THREADS="1",
                   PYTHONPATH=str(ROOT))
        jobs.append([subprocess.Popen([sys.executable, str(EXIT_JOB), mode, str(where)], cwd=ROOT,
                                      env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)
                     for r in range(2)])
    for procs in jobs:
        for r, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            if proc.returncode != 0 or "terminate called" in err or f"rank {r} {mode} done" not in out:
                failures.append(f"{mode} rank {r}: status {proc.returncode}\n{err[-1500:]}")
    return failures


def _exit_runs(tmp_path, runs: int) -> None:
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    failures = []
    try:
        for mode in MODES:
            for k in range(0, runs, 2):
                (tmp_path / f"{mode}-{k}").mkdir()
                failures += _run_exit_job(mode, tmp_path / f"{mode}-{k}", min(2, runs - k))
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert not failures, f"{len(failures)} of {2 * runs * len(MODES)} processes failed:\n" + "\n".join(failures)


@pytest.mark.slow  # the default run keeps test_ranks_that_raised_and_recovered_exit_cleanly_under_load
@pytest.mark.timeout(300)
def test_jobs_exit_cleanly_under_load(tmp_path):
    """Every rank of a job that made a collective, saved, or had a load refused exits with status 0."""
    _exit_runs(tmp_path, runs=1)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_jobs_exit_cleanly_under_load_many_times(tmp_path):
    """The same, 20 runs of each job (120 processes)."""
    _exit_runs(tmp_path, runs=20)
