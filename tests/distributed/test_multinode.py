"""Two "nodes" on one machine: two torchrun launchers meeting at a c10d rendezvous on localhost.

Each launcher runs ``examples/demo.py`` with ``--nnodes=2 --nproc_per_node=2``,
exactly the README's multi-node command: 4 ranks, 2 per node. The demo checks
itself (tables, lookups, a checkpoint saved by all 4 ranks into a directory
both nodes see, then loaded into another plan on ranks 0..2, so rank 2 on
node 1 reads blocks written on node 0) and exits non-zero on any mismatch.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(node_args: list[str], rdzv_id: str, port: int) -> subprocess.Popen:
    launch_vars = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if k not in launch_vars} | {"OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
        "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={rdzv_id}",
        "examples/demo.py", *node_args,
    ]
    # A session of its own per launcher, so a timeout can end its workers too.
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT + 60)
def test_demo_and_checkpoint_across_two_nodes(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    port = _free_port()
    nodes = [_launch(["--checkpoint-dir", str(shared)], f"tdb-test-{port}", port) for _ in range(2)]
    outputs = []
    try:
        for p in nodes:
            out, _ = p.communicate(timeout=TIMEOUT)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"the two launchers did not finish in {TIMEOUT}s\n"
                    + "\n".join((p.communicate()[0] or "")[-3000:] for p in nodes))
    for i, (p, out) in enumerate(zip(nodes, outputs)):
        assert p.returncode == 0, f"launcher {i} exited {p.returncode}:\n{out[-4000:]}"
    text = "\n".join(outputs)  # rank 0 prints; which launcher holds it is up to the rendezvous
    assert "2 node(s): node 0: ranks [0, 1]; node 1: ranks [2, 3]" in text, text[-4000:]
    assert "OK on all 4 ranks" in text, text[-4000:]
    assert "loaded into plan B on 3 ranks: tables bit-exact, forward == unsharded model" in text, text[-4000:]
    # the checkpoint stays where the user asked, committed by all 4 ranks
    assert (shared / "ckpt").exists(), sorted(p.name for p in shared.iterdir())
    assert "written by 4 rank(s)" in text, text[-4000:]
