"""A collective call made on one rank only ends in an error that names the call and the group and says what
to do, not in the backend's bare timeout (2 gloo ranks, a group with a 3-second timeout)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.convert.placements import world_mesh

from .harness import make_pool_fixture

pool = make_pool_fixture(2)


def _short_group() -> dist.ProcessGroup:
    return dist.new_group(ranks=list(range(dist.get_world_size())), timeout=timedelta(seconds=3))


def _error_of(call) -> str:
    """The message of the RuntimeError ``call()`` raises (``"no error"`` if none)."""
    try:
        call()
    except RuntimeError as e:
        return str(e)
    return "no error"


def lookup_on_rank_0_only(rank: int, world: int) -> str:
    group = _short_group()
    weight = distribute_tensor(torch.randn(10, 4), world_mesh("cpu"), [Shard(0)])
    if rank != 0:
        return "skipped the call"
    return _error_of(lambda: tdb.sharded_embedding_bag(torch.tensor([1, 2]), weight, torch.tensor([0]),
                                                       process_group=group))


def test_a_lookup_on_one_rank_says_which_call_and_group(pool):
    msg, other = pool.run(lookup_on_rank_0_only)
    assert other == "skipped the call"
    assert msg.startswith("sharded_embedding_bag: timed out in its first collective"), msg
    assert "group of ranks [0, 1]" in msg and "every rank of the group must call it" in msg, msg


def stall_after_agreement(rank: int, world: int) -> str:
    """Both ranks pass the agreement step; the last then stalls (injected) before the id exchange."""
    import time

    from torchrec_dtensor_bridge.lookup import entry

    group = _short_group()
    weight = distribute_tensor(torch.randn(10, 4), world_mesh("cpu"), [Shard(0)])
    real = entry.gather_bags

    def stalled(*args, **kwargs):
        time.sleep(5)
        return real(*args, **kwargs)

    if rank == world - 1:
        entry.gather_bags = stalled
    try:
        return _error_of(lambda: tdb.sharded_embedding_bag(torch.tensor([1, 2]), weight, torch.tensor([0]),
                                                           process_group=group))
    finally:
        entry.gather_bags = real


def test_a_rank_stalling_after_the_agreement_is_named(pool):
    msg = pool.run(stall_after_agreement)[0]
    assert msg.startswith("sharded_embedding_bag: timed out in its exchanges on the group of ranks [0, 1]"), msg
    assert "every rank passed the agreement step" in msg and "The backend said" in msg, msg


def backward_on_rank_0_only(rank: int, world: int) -> str:
    group = _short_group()
    weight = distribute_tensor(torch.randn(10, 4), world_mesh("cpu"), [Shard(0)]).requires_grad_()
    out = tdb.sharded_embedding_bags([torch.tensor([[1, 2]])], [weight], mode="sum", process_group=group)[0]
    if rank != 0:
        return "skipped backward"
    return _error_of(lambda: out.sum().backward())


@pytest.mark.slow  # the forward's naming runs by default; the backward's takes the same path
def test_a_backward_on_one_rank_is_named(pool):
    msg, other = pool.run(backward_on_rank_0_only)
    assert other == "skipped backward"
    assert msg.startswith("sharded_embedding_bags (backward): timed out in its backward's exchanges on the group "
                          "of ranks [0, 1]"), msg
    assert "did not run this backward" in msg, msg
