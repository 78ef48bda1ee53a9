"""Multi-process gloo test harness: one process group per test module, shared by its tests.

Usage in a test module::

    pool = make_pool_fixture(world_size=2)      # module-scoped fixture

    def _check_roundtrip(rank, world_size):    # runs on every rank
        ...

    def test_roundtrip(pool):
        pool.run(_check_roundtrip)

``run`` sends a module-level function (by import name) to every rank, waits for
all of them, and raises ``AssertionError`` naming the rank and traceback of
every rank that failed. Once one rank has failed, the others get ``grace``
seconds to report: those still busy then are most likely waiting in a collective
the failed rank left, so the pool is restarted for the next test at once rather
than after the group's collective timeout. A rank that hangs with no failure
anywhere fails the test after ``timeout`` seconds, and the pool is restarted.

Ranks are forked from one fork server per test session (multiprocessing's
``forkserver``) that imported torch, DTensor, DCP and TorchRec once (:mod:`.preload`):
a pool starts in ~0.3 s where fresh interpreters importing torch took ~2 s, and ends
at once. Each rank imports this package itself, and gets the environment the fork
server started with: a variable a test sets for its ranks is set inside the rank's
function, not in the test process.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["tests.distributed.preload"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
    )
    results.put((rank, "ready", None))
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent:  # the test process died (killed run): do not linger as an orphan
                os._exit(0)
            continue
        if task is None:
            break
        module, name, args, kwargs = task
        try:
            fn = getattr(importlib.import_module(module), name)
            value = fn(rank, world_size, *args, **kwargs)
            results.put((rank, "ok", value))
        except BaseException:  # noqa: BLE001 - reported to the parent with the rank
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class ProcessGroupPool:
    """``world_size`` spawned ranks with one gloo group, reused across tests.

    Args:
        world_size: the number of ranks.
        timeout: seconds a ``run`` may take before the ranks still busy count as hung.
        grace: seconds the other ranks get to report once one rank failed (raised, or its process
            ended); those that have not reported by then are most likely waiting in a collective the
            failed rank will never join, and the pool is restarted rather than left to their group's
            timeout.
    """

    def __init__(self, world_size: int, *, timeout: float = 180.0, grace: float = 5.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.grace = grace
        self._start()

    def _start(self) -> None:
        port = _free_port()
        self._tasks = [_CTX.Queue() for _ in range(self.world_size)]
        self._results = _CTX.Queue()
        self._procs = [
            _CTX.Process(target=_worker, args=(r, self.world_size, port, self._tasks[r], self._results), daemon=True)
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect("start-up", startup=True)

    def _collect(self, what: str, *, startup: bool = False) -> list[Any]:
        """Every rank's value, in rank order.

        1. Wait for the ranks' reports, up to ``timeout`` seconds in all.
        2. Once a rank has failed (reported an error, or its process ended), wait at most ``grace``
           seconds more for the others.
        3. If some rank has not reported by then, or a rank's process ended, end every rank's process and
           (after a ``run``, not at ``startup``, which raises) start the pool again, so that the next
           ``run`` finds a fresh group.
        4. Raise ``AssertionError`` with every failed rank's traceback and the ranks that never reported.
        """
        values: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        reported: set[int] = set()
        deadline = time.monotonic() + self.timeout
        first_failure: float | None = None
        while len(reported) < self.world_size and time.monotonic() < deadline:
            try:
                rank, status, value = self._results.get(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
            except queue.Empty:
                for r, p in enumerate(self._procs):
                    if r not in reported and p.exitcode is not None:
                        reported.add(r)
                        errors[r] = f"the rank's process ended (exit code {p.exitcode}) without reporting\n"
            else:
                reported.add(rank)
                if status == "error":
                    errors[rank] = value
                else:
                    values[rank] = value
            if errors and first_failure is None:
                first_failure = time.monotonic()
                deadline = min(deadline, first_failure + self.grace)
        missing = sorted(set(range(self.world_size)) - reported)
        if missing or (startup and errors) or any(p.exitcode is not None for p in self._procs):
            self.close(force=True)
            if not startup:
                self._start()
        if not errors and not missing:
            return values
        report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        if not missing:
            raise AssertionError(f"{what} failed on ranks {sorted(errors)}:\n{report}")
        after = "the pool did not start" if startup else "the pool was restarted"
        if not errors:
            raise AssertionError(f"{what}: ranks {missing} did not finish within {self.timeout}s (hang?); {after}")
        raise AssertionError(
            f"{what} failed on ranks {sorted(errors)}; ranks {missing} had not reported {self.grace}s after "
            f"the first failure (waiting in a collective the failed ranks left?) and were ended; {after}:\n"
            f"{report}"
        )

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return each rank's value.

        Raises:
            AssertionError: naming every rank that failed, with its traceback (see :meth:`_collect`).
        """
        for q in self._tasks:
            q.put((fn.__module__, fn.__name__, args, kwargs))
        return self._collect(fn.__name__)

    def pids(self) -> list[int | None]:
        """The ranks' process ids (they change when the pool is restarted)."""
        return [p.pid for p in self._procs]

    def close(self, *, force: bool = False) -> None:
        for p, q in zip(self._procs, self._tasks):
            if not force and p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=0 if force else 30)
            if p.is_alive():
                p.kill()
                p.join()


def make_pool_fixture(world_size: int, name: str = "pool", **options: float) -> Any:
    """A module-scoped pytest fixture yielding a :class:`ProcessGroupPool` (``options``: its keywords)."""

    @pytest.fixture(scope="module", name=name)
    def _fixture():
        pool = ProcessGroupPool(world_size, **options)
        yield pool
        pool.close()

    return _fixture


ROOT = Path(__file__).resolve().parents[2]


def launch(script: Path, args: list[str], *, nproc: int | None = 4, timeout: float = 150.0,
           ) -> subprocess.CompletedProcess:
    """Run ``script`` under torchrun with ``nproc`` ranks (plain python for ``None``), as a user launches it."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    return run_python([*torchrun, str(script.relative_to(ROOT)), *args], timeout=timeout)


def run_python(argv: list[str], *, timeout: float = 150.0) -> subprocess.CompletedProcess:
    """``python *argv`` (this interpreter, the checkout's root, one thread per rank) without the launch
    variables of any enclosing torchrun; on timeout its whole session (torchrun's workers too) is killed and
    the test fails."""
    cmd = [sys.executable, *argv]
    launch_vars = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launch_vars}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout}s\n--- stdout\n{out}\n--- stderr\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
