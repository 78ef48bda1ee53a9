"""A TorchRec DLRM job (fused row-wise Adagrad tables, Adam dense part) checkpointed as a chain: a full save, then
an incremental save after every step (the full save and the 5th link asynchronous); resumed from the chain's 1st, 5th and 10th link under another plan on 3
ranks, and under its own plan on 2 (gloo).

Every tensor of the resumed state (weights, fused optimizer state, dense optimizer state) equals what was saved
at that link (``torch.equal``); the losses then continue the uninterrupted run's: bit for bit under the same
plan, and up to the summation order under another plan and world size (the plans sum in different orders, as
in ``test_dlrm_resume_w3``). The job's helpers are that module's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torchrec_dtensor_bridge as tdb

from .harness import make_pool_fixture
from .test_dlrm_resume_w3 import AFTER, BEFORE, DENSE_LR, FUSED_LR, _dense_params, _dmp, _snapshot, _step

pool = make_pool_fixture(3)
pytestmark = pytest.mark.slow  # 25 s (three ranks, TorchRec); test_incremental_w2 covers chains by default

LINKS = 10
CHECKED = (1, 5, 10)
AFTER_LAST = 2  # steps run after the last link


def _state(dmp, dense, step):
    return {"model": dmp, "fused": dmp.fused_optimizer, "dense": dense, "step": step}


def _train_chain(rank: int, world: int, root: str):
    group = dist.new_group([0, 1])
    if rank not in (0, 1):
        return None
    dmp = _dmp(BEFORE, group)
    for g in dmp.fused_optimizer.param_groups:
        g["lr"] = FUSED_LR
    adam = torch.optim.Adam(_dense_params(dmp).values(), lr=DENSE_LR)
    losses = [_step(dmp, adam, 0, group)]
    # the full save and link 5 asynchronous: training goes on while they write (the next save waits for them)
    pending = [tdb.checkpoint.save(_state(dmp, adam, 1), f"{root}/l0", process_group=group, asynchronous=True)]
    saved = {}
    for link in range(1, LINKS + 1):
        losses.append(_step(dmp, adam, link, group))
        state = _state(dmp, adam, link + 1)
        done = tdb.checkpoint.save(state, f"{root}/l{link}", base=f"{root}/l{link - 1}", process_group=group,
                                   asynchronous=link == 5)
        if link == 5:
            pending.append(done)
        if link in CHECKED:
            saved[link] = _snapshot(state, group)
    losses += [_step(dmp, adam, s, group) for s in range(LINKS + 1, LINKS + 1 + AFTER_LAST)]
    assert all(isinstance(f.result(timeout=60), str) for f in pending)
    return (saved, losses) if rank == 0 else None


def _resume(rank: int, world: int, root: str, link: int, saved: dict, losses: list[float], same_plan: bool):
    from torchrec.optim.keyed import KeyedOptimizerWrapper

    group = dist.new_group([0, 1]) if same_plan else dist.group.WORLD
    if same_plan and rank not in (0, 1):
        return None
    dmp = _dmp(BEFORE if same_plan else AFTER, group)
    dense = (torch.optim.Adam(_dense_params(dmp).values(), lr=DENSE_LR) if same_plan else
             KeyedOptimizerWrapper(_dense_params(dmp), lambda ps: torch.optim.Adam(ps, lr=DENSE_LR)))
    state = _state(dmp, dense, 0)
    tdb.checkpoint.load(state, f"{root}/l{link}", process_group=group)
    assert state["step"] == link + 1
    got = _snapshot(state, group)
    assert sorted(got) == sorted(saved), sorted(set(got) ^ set(saved))
    for key, want in saved.items():
        assert torch.equal(got[key], want), f"{key} differs after loading link {link} on rank {rank}"
    steps = range(link + 1, min(link + 3, LINKS + 1 + AFTER_LAST))
    resumed = [_step(dmp, dense, s, group) for s in steps]
    want_losses = [losses[s] for s in steps]
    if same_plan:
        assert resumed == want_losses, (resumed, want_losses)
    else:
        torch.testing.assert_close(resumed, want_losses, rtol=1e-6, atol=1e-7)
    return None


@pytest.fixture(scope="module")
def chain(pool, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("chain"))
    saved, losses = pool.run(_train_chain, root)[0]
    return root, saved, losses


@pytest.mark.parametrize("link", CHECKED)
def test_dlrm_resumes_from_a_chain_under_another_plan_and_world_size(pool, chain, link):
    root, saved, losses = chain
    pool.run(_resume, root, link, saved[link], losses, False)


def test_dlrm_resumes_from_the_tenth_link_bit_for_bit_under_its_own_plan(pool, chain):
    root, saved, losses = chain
    pool.run(_resume, root, LINKS, saved[LINKS], losses, True)
    info = tdb.checkpoint.inspect(f"{root}/l{LINKS}")
    key = "model.sparse_arch.embedding_bag_collection.embedding_bags.t0.weight"
    links = info[key]["links"]
    assert len(links) == LINKS + 1 and links[-1]["base"] is None
    assert all(link["rows"] <= 11 for link in links[:-1])  # a link holds at most the rows a step touched
