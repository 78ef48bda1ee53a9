"""A job whose ranks raised and recovered exits with its own status (0), under CPU load.

Refused loads of a damaged checkpoint, good loads, and a collective that timed out on one rank leave
nothing behind (a thread, pending work) that outlives the process group and aborts the process at exit
(``terminate called without an active exception``, SIGABRT): the launcher reports every rank's exit
status, and the job runs while other processes keep every core busy.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from .harness import ROOT, launch

JOB = ROOT / "tests" / "distributed" / "jobs" / "refuse_then_recover.py"


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
