"""``make demo``'s program (``examples/demo.py``) under torchrun on 4 ranks, as the README runs it.

The demo checks itself (tables, pictures, lookups against ``F.embedding_bag``,
a checkpoint reloaded into another plan on 3 ranks) and exits non-zero on any
mismatch; this test keeps the README's command working in CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_demo_passes_on_four_ranks():
    launch_vars = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launch_vars} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "examples/demo.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "OK on all 4 ranks" in out, out[-4000:]
    assert "in ONE tdb.sharded_embedding_bags call" in out and "equal to F.embedding_bag" in out, out[-4000:]
