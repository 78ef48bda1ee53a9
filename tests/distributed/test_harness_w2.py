"""The multi-process harness itself (2 gloo ranks): a failure on one rank ends the test promptly.

A rank that raises while another waits in a collective must fail the test with the raising rank's
traceback within a few seconds (the pool's ``grace``), not after the group's 120-second collective
timeout; the pool is then restarted and runs the next function. Ranks that all report are not restarted,
and a slow rank is not cut short while no rank has failed.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from .harness import make_pool_fixture

GRACE = 2.0
BOUND = 30.0  # seconds: far below the group's 120-second timeout, far above grace + a restart

pool = make_pool_fixture(2, grace=GRACE)


def give_up_while_rank_0_waits(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 gave up before the collective")
    dist.barrier()


def exit_while_rank_0_waits(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(4))


def sum_of_ranks(rank: int, world: int) -> int:
    t = torch.tensor([rank])
    dist.all_reduce(t)
    return int(t)


def both_fail_one_later(rank: int, world: int) -> None:
    time.sleep(0.5 * rank)
    raise RuntimeError(f"rank {rank} failed on purpose")


def slow_rank_0(rank: int, world: int) -> int:
    if rank == 0:
        time.sleep(GRACE + 1.0)
    return rank


def _fails_promptly(pool, fn, *args) -> str:
    """``pool.run(fn, *args)``'s AssertionError message, after checking it came within :data:`BOUND`."""
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as err:
        pool.run(fn, *args)
    elapsed = time.monotonic() - t0
    assert elapsed < BOUND, f"took {elapsed:.1f}s: waited for the collective's timeout"
    return str(err.value)


def test_one_rank_raising_while_another_waits_in_a_collective_fails_promptly(pool):
    before = pool.pids()
    message = _fails_promptly(pool, give_up_while_rank_0_waits)
    assert "failed on ranks [1]" in message and "ranks [0] had not reported" in message, message
    assert "--- rank 1 ---" in message and "ValueError: rank 1 gave up before the collective" in message, message
    assert pool.pids() != before, "the ranks left waiting are ended and the pool restarted"
    assert pool.run(sum_of_ranks) == [1, 1], "the restarted pool's group works"


def test_a_rank_whose_process_ends_fails_promptly(pool):
    message = _fails_promptly(pool, exit_while_rank_0_waits)
    assert "--- rank 1 ---" in message and "exit code 3" in message, message
    assert pool.run(sum_of_ranks) == [1, 1]


def test_every_failed_rank_reported_without_restart_when_all_report(pool):
    before = pool.pids()
    message = _fails_promptly(pool, both_fail_one_later)
    assert "failed on ranks [0, 1]" in message and "had not reported" not in message, message
    for r in (0, 1):
        assert f"RuntimeError: rank {r} failed on purpose" in message, message
    assert pool.pids() == before, "every rank reported: the same processes serve the next test"
    assert pool.run(sum_of_ranks) == [1, 1]


def test_a_slow_rank_is_not_cut_short_while_no_rank_failed(pool):
    before = pool.pids()
    assert pool.run(slow_rank_0) == [0, 1]
    assert pool.pids() == before
