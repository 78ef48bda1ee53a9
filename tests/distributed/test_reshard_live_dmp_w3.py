"""``tdb.reshard`` of a TorchRec ``DistributedModelParallel`` on 3 gloo ranks: a DLRM job changes plan mid-training.

TorchRec's ``DLRM`` in a DMP, its four tables trained by TorchRec's fused row-wise Adagrad, its dense part
by ``torch.optim.Adam``, trains 4 steps under ``BEFORE``, is resharded in memory to ``AFTER`` (every table
changes sharding type: row-wise -> table-wise, table-wise -> table-row-wise, column-wise -> table-column-wise
with the column blocks on other ranks, table-row-wise -> table-wise), trains 4 steps, is resharded to
``LAST`` (the table-column-wise table onto one rank: its per-block row states combined) and trains 2 more.
The reference is the same job whose every change of plan is a ``tdb.checkpoint.save`` and a load into a
fresh DMP under the new plan: losses and every tensor of the model, the fused optimizer and the dense
optimizer ``torch.equal``. Refused plans leave every tensor as it was, on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchrec_dtensor_bridge as tdb

from .harness import make_pool_fixture
from .test_dlrm_resume_w3 import _batch as _dlrm_batch
from .test_dlrm_resume_w3 import _dense_params, _snapshot

pool = make_pool_fixture(3)

TABLES = {"t0": 11, "t1": 7, "t2": 9, "t3": 10}  # name -> rows
DIM, DENSE_IN, GLOBAL_BATCH = 8, 3, 6
PATH = "sparse_arch.embedding_bag_collection"
BEFORE = {"t0": ("row_wise",), "t1": ("table_wise", 1), "t2": ("column_wise", [0, 2]), "t3": ("table_row_wise",)}
AFTER = {"t0": ("table_wise", 2), "t1": ("table_row_wise",), "t2": ("table_column_wise", [2, 1]),
         "t3": ("table_wise", 0)}
LAST = dict(AFTER, t2=("table_wise", 1))


def _fused(gen):
    def make(*args, **kwargs):
        return dataclasses.replace(gen(*args, **kwargs), compute_kernel="fused")
    return make


def _module_plan(kinds: dict[str, tuple], world: int, *, rows: dict[str, int] = TABLES):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import sharding_plan as sp

    def table_column_wise(ranks):
        def make(*args, **kwargs):
            ps = sp.column_wise(ranks=ranks, compute_kernel="fused")(*args, **kwargs)
            return dataclasses.replace(ps, sharding_type="table_column_wise")
        return make

    make = {"row_wise": lambda: sp.row_wise(compute_kernel="fused"),
            "table_wise": lambda rank: sp.table_wise(rank=rank, compute_kernel="fused"),
            "column_wise": lambda ranks: sp.column_wise(ranks=ranks, compute_kernel="fused"),
            "table_row_wise": lambda: _fused(sp.table_row_wise(host_index=0)),
            "table_column_wise": table_column_wise}
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=r,
                                                            feature_names=[f"f_{n}"]) for n, r in rows.items()],
                                 device=torch.device("meta"))
    per_param = {n: make[kind](*args) for n, (kind, *args) in kinds.items()}
    return sp.construct_module_sharding_plan(ebc, per_param_sharding=per_param, local_size=world,
                                             world_size=world, device_type="cpu", sharder=_sharder())


def _sharder():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-3})


def _dmp(kinds: dict[str, tuple], *, ddp: bool = False):
    """The DLRM job under ``kinds``; without a data-parallel wrapper unless ``ddp`` (:func:`_step` averages the
    dense gradients itself: DDP's buckets lay the gradients out in memory differently in a fresh DDP than in
    one that has trained, and Adam's CPU kernels round an element by its place in memory, so a job resumed
    into a fresh DDP differs from the one that kept training in the last bit, resharded or not)."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.models.dlrm import DLRM

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=[f"f_{n}"])
                for n, r in TABLES.items()], device=torch.device("meta"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE_IN, dense_arch_layer_sizes=[5, DIM],
                 over_arch_layer_sizes=[4, 1])
    world = dist.get_world_size()
    dmp = DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
        plan=ShardingPlan({PATH: _module_plan(kinds, world)}), sharders=[_sharder()], init_data_parallel=ddp)
    for g in dmp.fused_optimizer.param_groups:
        g["lr"] = 0.04  # a hyper-parameter set after the DMP was built: a reshard keeps it
    return dmp, torch.optim.Adam(_dense_params(dmp).values(), lr=0.05)


def _batch(step: int, rank: int, world: int):
    return _dlrm_batch(step, rank, world, TABLES, seed=2000)


def _step(dmp, adam, step: int, rank: int, world: int) -> torch.Tensor:
    dense, kjt, labels = _batch(step, rank, world)
    dmp.fused_optimizer.zero_grad()  # where TorchRec hands its fused kernel the param groups' lr
    loss = F.binary_cross_entropy_with_logits(dmp(dense, kjt).squeeze(1), labels)
    loss.backward()
    if not isinstance(dmp._dmp_wrapped_module, torch.nn.parallel.DistributedDataParallel):
        for p in _dense_params(dmp).values():  # DDP's average, one parameter at a time
            dist.all_reduce(p.grad)
            p.grad.div_(world)
    adam.step()
    adam.zero_grad()
    return loss.detach()


def _state(dmp, adam) -> dict[str, Any]:
    return {"model": dmp, "fused": dmp.fused_optimizer, "dense": adam}


def _assert_equal(got: dict, want: dict, what: str) -> None:
    """Every tensor equal; a row-wise state that now has one value per row where it had one per row and
    column block (of equal widths): the mean of its blocks' (what a checkpoint load makes of it)."""
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    for k, v in want.items():
        if got[k].shape != v.shape and k.endswith("momentum1") and v.numel() % got[k].numel() == 0:
            v = v.view(v.numel() // got[k].numel(), -1).double().mean(0).float()
        assert torch.equal(got[k], v), f"{what}: {k} differs on rank {dist.get_rank()}"


def _plan_of(kinds: dict[str, tuple]):
    from torchrec.distributed.types import ShardingPlan

    return ShardingPlan({PATH: _module_plan(kinds, dist.get_world_size())})


SCHEDULE = [(BEFORE, 4), (AFTER, 4), (LAST, 2)]


def _live_and_resumed(rank: int, world: int, path: str) -> None:
    group = dist.group.WORLD
    dmp, adam = _dmp(BEFORE)
    live, step = [], 0
    for k, (kinds, steps) in enumerate(SCHEDULE):
        if k:
            before = _snapshot(_state(dmp, adam), group)
            assert tdb.reshard(dmp, _plan_of(kinds)) is dmp
            _assert_equal(_snapshot(_state(dmp, adam), group), before, f"right after reshard {k}")
            module = dmp.module.sparse_arch.embedding_bag_collection
            assert {t: ps.sharding_type for t, ps in dmp.plan.plan[PATH].items()} == {
                t: kind[0] for t, (kind) in kinds.items()}
            assert module.module_sharding_plan is dmp.plan.plan[PATH]
            assert all(g["lr"] == 0.04 for g in dmp.fused_optimizer.param_groups), "the fused lr was reset"
        live += [_step(dmp, adam, step + s, rank, world) for s in range(steps)]
        step += steps
    final = _snapshot(_state(dmp, adam), group)
    dmp, adam = _dmp(BEFORE)
    resumed, step = [], 0
    for k, (kinds, steps) in enumerate(SCHEDULE):
        if k:
            tdb.checkpoint.save(_state(dmp, adam), f"{path}-{k}")
            dmp, adam = _dmp(kinds)
            tdb.checkpoint.load(_state(dmp, adam), f"{path}-{k}")
        resumed += [_step(dmp, adam, step + s, rank, world) for s in range(steps)]
        step += steps
    for s, (a, b) in enumerate(zip(live, resumed, strict=True)):
        assert torch.equal(a, b), f"loss of step {s} on rank {rank}: {a} != {b}"
    _assert_equal(final, _snapshot(_state(dmp, adam), group), "at the end")


def test_a_dlrm_job_resharded_twice_equals_checkpoint_resumes(pool, tmp_path):
    pool.run(_live_and_resumed, str(tmp_path / "dlrm"))


def _refused(rank: int, world: int, case: str) -> str:
    group = dist.group.WORLD
    from torchrec.distributed.types import ShardingPlan

    dmp, adam = _dmp(BEFORE, ddp=True)
    _step(dmp, adam, 0, rank, world)

    if case == "another_world_size":
        plan = ShardingPlan({PATH: _module_plan(dict(BEFORE, t0=("table_wise", 3)), 4)})
    elif case == "another_shape":
        plan = ShardingPlan({PATH: _module_plan(dict(BEFORE, t1=("row_wise",)), world, rows=dict(TABLES, t1=8))})
    elif case == "unknown_table":
        plan = {"t9": _module_plan({"t9": ("row_wise",)}, world, rows={"t9": 5})["t9"]}
    else:  # one value per row into two column blocks
        plan = _plan_of(dict(BEFORE, t1=("column_wise", [0, 1])))
    before = _snapshot(_state(dmp, adam), group)
    module = dmp.module.sparse_arch.embedding_bag_collection
    with pytest.raises((ValueError, NotImplementedError)) as refused:
        tdb.reshard(dmp, plan)
    assert dmp.module.sparse_arch.embedding_bag_collection is module
    _assert_equal(_snapshot(_state(dmp, adam), group), before, f"{case}: after the refusal")
    _step(dmp, adam, 1, rank, world)
    return str(refused.value)


def _with_ddp(rank: int, world: int) -> None:
    """A DMP inside its DDP wrapper: resharded, every tensor as before, the wrapper the same object, and the
    next steps keep the dense parameters equal on every rank (DDP still averages their gradients)."""
    group = dist.group.WORLD
    dmp, adam = _dmp(BEFORE, ddp=True)
    wrapper = dmp._dmp_wrapped_module
    assert isinstance(wrapper, torch.nn.parallel.DistributedDataParallel)
    for s in range(2):
        _step(dmp, adam, s, rank, world)
    before = _snapshot(_state(dmp, adam), group)
    tdb.reshard(dmp, _plan_of(AFTER))
    assert dmp._dmp_wrapped_module is wrapper
    _assert_equal(_snapshot(_state(dmp, adam), group), before, "right after the reshard")
    for s in range(2, 4):
        _step(dmp, adam, s, rank, world)
    mine = {k: p.detach().clone() for k, p in _dense_params(dmp).items()}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    for k, v in mine.items():
        assert all(torch.equal(other[k], v) for other in everyone), k


def test_a_dmp_in_its_ddp_wrapper_trains_on_after_a_reshard(pool):
    pool.run(_with_ddp)


REFUSALS = {
    "another_world_size": "table 'sparse_arch.embedding_bag_collection.t0'",
    "another_shape": "table 'sparse_arch.embedding_bag_collection.t1'",
    "unknown_table": "the tables ['t9'] are not all in one sharded module",
    "split_row_state": "column blocks of widths [8] do not convert into blocks of widths [4, 4]",
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_bad_plan_is_refused_on_every_rank_with_nothing_changed(pool, case):
    messages = pool.run(_refused, case)
    assert len(set(messages)) == 1, messages
    assert REFUSALS[case] in messages[0], messages[0]
