"""The shared results file of the ``scripts/bench_*.py`` benchmarks (``bench/results.json``).

Each benchmark records its section under its own key, keeping the others'.
:func:`spawn_ranks` runs one benchmark worker per rank and collects their results; each worker starts
with :func:`join_ranks`.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import os
import socket
import time
import warnings
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["join_ranks", "record", "reported", "spawn_ranks", "time_interleaved"]


def record(out: Path, key: str, result: Any) -> None:
    """Write ``result`` as section ``key`` of the JSON file ``out``, keeping its other sections."""
    results = json.loads(out.read_text()) if out.exists() else {}
    results[key] = result
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


def spawn_ranks(target: Callable[..., None], world: int, args: tuple, *, name: str,
                timeout_s: float = 1800) -> list[dict]:
    """Run ``target(rank, world, port, *args, queue)`` in ``world`` spawned processes; their results by rank.

    Each process puts one dict on the queue: its result, or ``{"rank", "error", "traceback"}`` (plus
    ``"mismatch": True`` for a wrong result). Exits the benchmark (non-zero) when a rank fails, dies or
    stays silent past ``timeout_s``.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(r, world, port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    results: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while len(results) < world and not any("error" in r for r in results):
        try:
            results.append(q.get(timeout=5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                why = f"a rank exited with code {dead[0]}" if dead else f"no result within {timeout_s:.0f} s"
                raise SystemExit(f"{name}: FAILED (world {world}): {why}") from None
    for p in procs:
        p.join(timeout=5 if any("error" in r for r in results) else 60)
        if p.is_alive():
            p.kill()
    errors = [r for r in results if "error" in r]
    if errors:
        e = errors[0]
        kind = "WRONG RESULT" if e.get("mismatch") else "FAILED"
        raise SystemExit(f"{name}: {kind} on rank {e['rank']} (world {world}): {e['error']}\n{e['traceback']}")
    return sorted(results, key=lambda r: r["rank"])


def join_ranks(rank: int, world: int, port: int, *, timeout_s: float = 900) -> None:
    """In a worker :func:`spawn_ranks` started, first: one thread per rank (as the measured jobs run), no
    warnings, and the gloo group of the ``world`` workers."""
    os.environ["OMP_NUM_THREADS"] = "1"
    warnings.filterwarnings("ignore")
    import torch  # only now, in the worker: torch reads OMP_NUM_THREADS when it loads
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def time_interleaved(paths: dict[str, Callable[[], Any]], *, warmup: int, reps: int,
                     sync: Callable[[], Any] | None = None) -> dict[str, list[float]]:
    """Milliseconds of each of ``paths`` per repetition, run side by side: every repetition runs each path
    once, the order alternating (forwards, then backwards); ``sync()`` (a barrier) before each run;
    the first ``warmup`` repetitions are not kept."""
    times: dict[str, list[float]] = {k: [] for k in paths}
    for rep in range(warmup + reps):
        for name in (list(paths) if rep % 2 == 0 else list(reversed(paths))):
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            paths[name]()
            dt = time.perf_counter() - t0
            if rep >= warmup:
                times[name].append(dt * 1e3)
    return times


@contextmanager
def reported(rank: int, out: Any) -> Iterator[None]:
    """Around a worker's body: a failure is put on ``out`` with the rank and traceback (the parent reports
    it) and ends the worker with status 1; the process group is destroyed either way."""
    import torch.distributed as dist

    try:
        yield
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.put({"rank": rank, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
