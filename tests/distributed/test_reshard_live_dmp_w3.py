"""``tdb.reshard`` of a TorchRec ``DistributedModelParallel`` on 3 gloo ranks: a DLRM job changes plan mid-training.

TorchRec's ``DLRM`` in a DMP, four of its tables trained by TorchRec's fused row-wise Adagrad, its dense part
and its fifth table (``t4``, data-parallel throughout: it stays as it is) by ``torch.optim.Adam``, trains 4
steps under ``BEFORE``, is resharded in memory to ``AFTER`` (every fused table changes sharding type: row-wise -> table-wise, table-wise -> table-row-wise, column-wise -> table-column-wise
with the column blocks on other ranks, table-row-wise -> table-wise), trains 4 steps, is resharded to
``LAST`` (the table-column-wise table onto one rank: its per-block row states combined; a table-wise
table into TorchRec's grid sharding, on one host: blocks of rows) and trains 2 more.
The same job with fp16 tables (their row-wise state fp32) is resharded once, ``BEFORE`` -> ``AFTER``.
A sequence model holds a TorchRec ``EmbeddingCollection`` (alone, and beside an ``EmbeddingBagCollection``
in the same DMP), sharded by ``EmbeddingCollectionSharder`` with the same fused row-wise Adagrad, and is
resharded so that every sequence table changes sharding type among the three a sharded one is built with
(row-wise -> table-wise, table-wise -> row-wise, column-wise -> row-wise; into column-wise a row-wise
Adagrad table comes only from the same column cut, so no table goes there). With ``split_row_states=True``
the DLRM job's per-row states are split into other column blocks: a table-wise table's one value per row
into two column blocks, and a table's three column blocks of widths [4, 4, 8] into four of width 4, two on
each of two ranks (which each receive a row's old values once).
The reference is the same job whose every change of plan is a ``tdb.checkpoint.save`` and a load into a
fresh DMP under the new plan: losses and every tensor of the model, the fused optimizer and the dense
optimizer ``torch.equal``; the bytes each rank sends are those of the weights and per-row states it holds
that another rank holds under the new plan. Refused plans leave every tensor as it was, on every rank.
Tables are 16 wide: TorchRec's fused kernel takes column blocks whose widths are multiples of 4, and two
cuts of other widths need more than 8 columns.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchrec_dtensor_bridge as tdb

from .harness import make_pool_fixture
from .test_dlrm_resume_w3 import _batch as _dlrm_batch
from .test_dlrm_resume_w3 import _dense_params, _snapshot
from .test_reshard_live_w3 import _Sends, failing_third_move, peak_growth

pool = make_pool_fixture(3)

TABLES = {"t0": 11, "t1": 7, "t2": 9, "t3": 10, "t4": 6}  # name -> rows; t4 data-parallel throughout
DIM, DENSE_IN, GLOBAL_BATCH = 16, 3, 6
PATH = "sparse_arch.embedding_bag_collection"
DENSE_TRAINED = {"t4"}  # fp32 in the fp16 job too: Adam's eps (1e-8) is 0 in fp16, its first steps give NaN
BEFORE = {"t0": ("row_wise",), "t1": ("table_wise", 1), "t2": ("column_wise", [0, 2]), "t3": ("table_row_wise",),
          "t4": ("data_parallel",)}
AFTER = {"t0": ("table_wise", 2), "t1": ("table_row_wise",), "t2": ("table_column_wise", [2, 1]),
         "t3": ("table_wise", 0), "t4": ("data_parallel",)}
LAST = dict(AFTER, t2=("table_wise", 1), t3=("grid_shard",))

SPLIT_FROM = dict(BEFORE, t2=("column_sizes", [4, 4, 8]))  # t2: three column blocks, on ranks 0, 1, 2
SPLIT_TO = dict(BEFORE, t1=("column_sizes", [8, 8]), t2=("column_wise", [1, 0, 1, 0]))  # blocks of 8, and of 4
ONE_BLOCK = dict(BEFORE, t2=("table_wise", 2))  # the checkpoint reference's step between the two

SEQ = {"s0": 9, "s1": 8, "s2": 7}  # the EmbeddingCollection's tables: name -> rows
SEQ_BEFORE = {"s0": ("row_wise",), "s1": ("table_wise", 1), "s2": ("column_wise", [0, 2])}
SEQ_AFTER = {"s0": ("table_wise", 2), "s1": ("row_wise",), "s2": ("row_wise",)}
TABLES_AT = {PATH: TABLES, "ebc": TABLES, "ec": SEQ}  # module path -> its tables; "ec": an EmbeddingCollection


def _fused(gen):
    def make(*args, **kwargs):
        return dataclasses.replace(gen(*args, **kwargs), compute_kernel="fused")
    return make


def _module_plan(kinds: dict[str, tuple], world: int, *, rows: dict[str, int] = TABLES, seq: bool = False,
                 half: bool = False, dim: int = DIM):
    """The plan of an ``EmbeddingBagCollection`` (an ``EmbeddingCollection`` if ``seq``) of tables ``rows``,
    ``dim`` wide (fp16 if ``half``)."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed import sharding_plan as sp

    def table_column_wise(ranks):
        def make(*args, **kwargs):
            ps = sp.column_wise(ranks=ranks, compute_kernel="fused")(*args, **kwargs)
            return dataclasses.replace(ps, sharding_type="table_column_wise")
        return make

    make = {"row_wise": lambda: sp.row_wise(compute_kernel="fused"),
            "table_wise": lambda rank: sp.table_wise(rank=rank, compute_kernel="fused"),
            "column_wise": lambda ranks: sp.column_wise(ranks=ranks, compute_kernel="fused"),
            "column_sizes": lambda sizes: sp.column_wise(size_per_rank=sizes, compute_kernel="fused"),  # block k on k
            "table_row_wise": lambda: _fused(sp.table_row_wise(host_index=0)),
            "data_parallel": sp.data_parallel,
            "grid_shard": lambda: _fused(sp.grid_shard(host_indexes=[0])),  # one host: row blocks of column blocks  # the dense kernel, trained by the dense optimizer
            "table_column_wise": table_column_wise}
    cls, config = (EmbeddingCollection, EmbeddingConfig) if seq else (EmbeddingBagCollection, EmbeddingBagConfig)
    module = cls(tables=[config(name=n, embedding_dim=dim, num_embeddings=r, feature_names=[f"f_{n}"],
                                data_type=_data_type(half and n not in DENSE_TRAINED)) for n, r in rows.items()], device=torch.device("meta"))
    per_param = {n: make[kind](*args) for n, (kind, *args) in kinds.items()}
    return sp.construct_module_sharding_plan(module, per_param_sharding=per_param, local_size=world,
                                             world_size=world, device_type="cpu", sharder=_sharder(seq))


def _data_type(half: bool):
    from torchrec import DataType

    return DataType.FP16 if half else DataType.FP32


def _sharder(seq: bool = False):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    cls = EmbeddingCollectionSharder if seq else EmbeddingBagCollectionSharder
    return cls(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-3})


class _SeqModel(torch.nn.Module):
    """A sequence model: the dense features through a linear layer, each sample's sequence of each
    ``EmbeddingCollection`` feature summed (and the ``EmbeddingBagCollection``'s pooled features, when it has
    one), all into a linear layer: one logit per sample."""

    def __init__(self, ec: torch.nn.Module, ebc: torch.nn.Module | None) -> None:
        super().__init__()
        self.dense = torch.nn.Linear(DENSE_IN, DIM)
        self.ec, self.ebc = ec, ebc
        self.over = torch.nn.Linear((1 + len(SEQ) + (len(TABLES) if ebc is not None else 0)) * DIM, 1)

    def forward(self, dense: torch.Tensor, seq: Any, bags: Any = None) -> torch.Tensor:
        parts = [self.dense(dense)]
        sequences = self.ec(seq)
        for f in seq.keys():
            jt = sequences[f]
            sample = torch.repeat_interleave(torch.arange(dense.shape[0]), jt.lengths())
            parts.append(torch.zeros(dense.shape[0], DIM).index_add(0, sample, jt.values()))
        if self.ebc is not None:
            parts.append(self.ebc(bags).values())
        return self.over(torch.cat(parts, dim=1))


def _dmp(plans: dict[str, dict[str, tuple]], *, ddp: bool = False, half: bool = False):
    """The job under ``plans`` (module path -> its tables' kinds): the DLRM job if it names ``PATH``, else the
    sequence model (with an ``EmbeddingBagCollection`` if it names ``"ebc"``); without a data-parallel wrapper
    unless ``ddp`` (:func:`_step` averages the dense gradients itself: DDP's buckets lay the gradients out in
    memory differently in a fresh DDP than in one that has trained, and Adam's CPU kernels round an element by
    its place in memory, so a job resumed into a fresh DDP differs from the one that kept training in the last
    bit, resharded or not)."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.models.dlrm import DLRM

    from torchrec import EmbeddingCollection, EmbeddingConfig

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=[f"f_{n}"],
                                   data_type=_data_type(half and n not in DENSE_TRAINED)) for n, r in TABLES.items()], device=torch.device("meta"))
    if PATH in plans:
        model: torch.nn.Module = DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE_IN,
                                      dense_arch_layer_sizes=[5, DIM], over_arch_layer_sizes=[4, 1])
    else:
        ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=[f"f_{n}"])
                    for n, r in SEQ.items()], device=torch.device("meta"))
        model = _SeqModel(ec, ebc if "ebc" in plans else None)
    dmp = DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
        plan=_plan_of(plans, half=half), sharders=[_sharder(), _sharder(seq=True)], init_data_parallel=ddp)
    for g in dmp.fused_optimizer.param_groups:
        g["lr"] = 0.04  # a hyper-parameter set after the DMP was built: a reshard keeps it
    return dmp, torch.optim.Adam(_dense_params(dmp).values(), lr=0.05)


def _batch(dmp, step: int, rank: int, world: int) -> tuple[tuple, torch.Tensor]:
    """The model's inputs and the labels of this rank's share of step ``step``'s batch."""
    dense, bags, labels = _dlrm_batch(step, rank, world, TABLES, seed=2000)
    if not isinstance(dmp.module, _SeqModel):
        return (dense, bags), labels
    _, seq, _ = _dlrm_batch(step, rank, world, SEQ, seed=3000)
    return ((dense, seq, bags) if dmp.module.ebc is not None else (dense, seq)), labels


def _step(dmp, adam, step: int, rank: int, world: int) -> torch.Tensor:
    inputs, labels = _batch(dmp, step, rank, world)
    dmp.fused_optimizer.zero_grad()  # where TorchRec hands its fused kernel the param groups' lr
    loss = F.binary_cross_entropy_with_logits(dmp(*inputs).squeeze(1), labels)
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


def _plan_of(plans: dict[str, dict[str, tuple]], world: int | None = None, *, half: bool = False):
    """The ``ShardingPlan`` of ``plans`` (module path -> its tables' kinds) on ``world`` ranks (this group's)."""
    from torchrec.distributed.types import ShardingPlan

    world = world or dist.get_world_size()
    return ShardingPlan({p: _module_plan(kinds, world, rows=TABLES_AT[p], seq=p == "ec", half=half)
                         for p, kinds in plans.items()})


def _owners(ps) -> torch.Tensor:
    """The rank holding each element of a table under a ``ParameterSharding`` (read from its shard metadata)."""
    shards = ps.sharding_spec.shards
    owner = torch.full([max(s.shard_offsets[d] + s.shard_sizes[d] for s in shards) for d in (0, 1)], -1)
    for s in shards:
        owner[tuple(slice(o, o + n) for o, n in zip(s.shard_offsets, s.shard_sizes))] = s.placement.rank()
    return owner


def _cut(ps) -> list[tuple[int, int]]:
    """A ``ParameterSharding``'s column blocks: (first column, width)."""
    return sorted({(s.shard_offsets[1], s.shard_sizes[1]) for s in ps.sharding_spec.shards})


def _changing_bytes(old: dict, new: dict, rank: int, weight_bytes: int = 4) -> int:
    """The bytes of the weights (``weight_bytes`` an element) and row-wise Adagrad states (float32) ``rank``
    holds under the plan ``old`` (module path -> table -> ``ParameterSharding``) that another rank holds under
    ``new``. The state keeps a
    value per row and column block; into the same cut a block's values go to the block's new holder, into
    another cut a row's values to every rank holding a block of the row (once, however many it holds)."""
    total = 0
    for path, tables in new.items():
        for t, ps in tables.items():
            if ps.sharding_type == "data_parallel":  # stays: every rank holds it
                continue
            before, after = _owners(old[path][t]), _owners(ps)
            cols = [c for c, _ in _cut(old[path][t])]
            total += weight_bytes * int(((before == rank) & (after != rank)).sum())
            if _cut(old[path][t]) == _cut(ps):
                total += 4 * int(((before[:, cols] == rank) & (after[:, cols] != rank)).sum())
                continue
            for row in range(after.shape[0]):
                takers = set(after[row].tolist()) - {rank}
                total += 4 * len(takers) * int((before[row, cols] == rank).sum())
    return total


SCHEDULES = {
    "dlrm": [({PATH: BEFORE}, 4), ({PATH: AFTER}, 4), ({PATH: LAST}, 2)],
    "dlrm_fp16": [({PATH: BEFORE}, 3), ({PATH: AFTER}, 3)],  # the tables fp16 (their row-wise state fp32)
    "ec": [({"ec": SEQ_BEFORE}, 3), ({"ec": SEQ_AFTER}, 3)],
    "ebc_and_ec": [({"ebc": BEFORE, "ec": SEQ_BEFORE}, 3), ({"ebc": AFTER, "ec": SEQ_AFTER}, 3)],
}


def _live_and_resumed(rank: int, world: int, job: str, path: str) -> None:
    group, schedule, half = dist.group.WORLD, SCHEDULES[job], job.endswith("_fp16")
    dmp, adam = _dmp(schedule[0][0], half=half)
    live, step = [], 0
    for k, (plans, steps) in enumerate(schedule):
        if k:
            before = _snapshot(_state(dmp, adam), group)
            old, new = {p: dict(v) for p, v in dmp.plan.plan.items()}, _plan_of(plans, half=half)
            modules = {p: dmp.module.get_submodule(p) for p in plans}
            with _Sends() as sends:
                assert tdb.reshard(dmp, new) is dmp
            assert sends.bytes == _changing_bytes(old, new.plan, rank, 2 if half else 4), (sends.bytes, rank, k)
            _assert_equal(_snapshot(_state(dmp, adam), group), before, f"right after reshard {k}")
            for p, kinds in plans.items():
                assert {t: ps.sharding_type for t, ps in dmp.plan.plan[p].items()} == {
                    t: kind[0] for t, kind in kinds.items()}
                module = dmp.module.get_submodule(p)
                assert module is not modules[p] and module.module_sharding_plan is dmp.plan.plan[p]
            assert all(g["lr"] == 0.04 for g in dmp.fused_optimizer.param_groups), "the fused lr was reset"
        live += [_step(dmp, adam, step + s, rank, world) for s in range(steps)]
        step += steps
    final = _snapshot(_state(dmp, adam), group)
    held = [s.tensor.dtype for v in dmp.state_dict().values() if hasattr(v, "local_shards") for s in v.local_shards()]
    assert held and set(held) == {torch.float16 if half else torch.float32}, (job, rank, set(held))
    dmp, adam = _dmp(schedule[0][0], half=half)
    resumed, step = [], 0
    for k, (plans, steps) in enumerate(schedule):
        if k:
            tdb.checkpoint.save(_state(dmp, adam), f"{path}-{k}")
            dmp, adam = _dmp(plans, half=half)
            tdb.checkpoint.load(_state(dmp, adam), f"{path}-{k}")
        resumed += [_step(dmp, adam, step + s, rank, world) for s in range(steps)]
        step += steps
    for s, (a, b) in enumerate(zip(live, resumed, strict=True)):
        assert torch.equal(a, b), f"loss of step {s} on rank {rank}: {a} != {b}"
    _assert_equal(final, _snapshot(_state(dmp, adam), group), "at the end")


@pytest.mark.parametrize("job", ["dlrm", "dlrm_fp16"])
def test_a_dlrm_job_resharded_twice_equals_checkpoint_resumes(pool, tmp_path, job):
    pool.run(_live_and_resumed, job, str(tmp_path / job))


@pytest.mark.parametrize("job", ["ec", "ebc_and_ec"])
def test_a_sequence_model_resharded_equals_a_checkpoint_resume(pool, tmp_path, job):
    pool.run(_live_and_resumed, job, str(tmp_path / job))


def _split_row_states(rank: int, world: int, path: str) -> None:
    """``SPLIT_FROM`` -> ``SPLIT_TO``: refused without ``split_row_states=True`` (every rank, the same message,
    nothing changed), and with it every new column block takes its row's value, the old blocks combined. The
    reference saves and loads with ``split_row_states=True`` under ``SPLIT_TO``; a load refuses per-block
    states into another column cut, so its t2 goes through ``ONE_BLOCK`` (a save and a load that combine
    the blocks), as the reshard combines them before it splits."""
    group, new = dist.group.WORLD, _plan_of({PATH: SPLIT_TO})
    dmp, adam = _dmp({PATH: SPLIT_FROM})
    live = [_step(dmp, adam, s, rank, world) for s in range(2)]
    before, module = _snapshot(_state(dmp, adam), group), dmp.module.get_submodule(PATH)
    with pytest.raises(NotImplementedError) as refused:
        tdb.reshard(dmp, new)
    messages: list[Any] = [None] * world
    dist.all_gather_object(messages, str(refused.value))
    assert len(set(messages)) == 1 and "pass split_row_states=True" in messages[0], messages
    assert f"table '{PATH}.t1'" in messages[0], messages[0]  # the first table that would split
    assert dmp.module.get_submodule(PATH) is module
    _assert_equal(_snapshot(_state(dmp, adam), group), before, "after the refusal")
    old = {p: dict(v) for p, v in dmp.plan.plan.items()}
    with _Sends() as sends:
        assert tdb.reshard(dmp, new, split_row_states=True) is dmp
    assert sends.bytes == _changing_bytes(old, new.plan, rank), (sends.bytes, rank)
    resharded = _snapshot(_state(dmp, adam), group)
    live += [_step(dmp, adam, s, rank, world) for s in range(2, 4)]
    final = _snapshot(_state(dmp, adam), group)

    dmp, adam = _dmp({PATH: SPLIT_FROM})
    resumed = [_step(dmp, adam, s, rank, world) for s in range(2)]
    for k, (plans, split) in enumerate([(ONE_BLOCK, False), (SPLIT_TO, True)]):
        tdb.checkpoint.save(_state(dmp, adam), f"{path}-{k}")
        dmp, adam = _dmp({PATH: plans})
        tdb.checkpoint.load(_state(dmp, adam), f"{path}-{k}", split_row_states=split)
    loaded = _snapshot(_state(dmp, adam), group)
    assert sorted(loaded) == sorted(resharded)
    for key, v in loaded.items():
        assert torch.equal(resharded[key], v), f"right after the reshard: {key} differs on rank {rank}"
    resumed += [_step(dmp, adam, s, rank, world) for s in range(2, 4)]
    for s, (a, b) in enumerate(zip(live, resumed, strict=True)):
        assert torch.equal(a, b), f"loss of step {s} on rank {rank}: {a} != {b}"
    _assert_equal(final, _snapshot(_state(dmp, adam), group), "at the end")


def test_per_row_states_split_into_other_column_blocks_only_when_asked(pool, tmp_path):
    pool.run(_split_row_states, str(tmp_path / "split"))


def _storages(module: torch.nn.Module) -> list[weakref.ref]:
    """Weak references to the storage of every local block of the module's tables and fused optimizer state."""
    values = list(module.state_dict().values()) + [
        v for state in module.fused_optimizer.state_dict()["state"].values() for v in state.values()]
    return [weakref.ref(s.tensor.untyped_storage()) for v in values if hasattr(v, "local_shards")
            for s in v.local_shards()]  # not the data-parallel tables: they stay


def _old_module_freed(rank: int, world: int, job: str) -> None:
    """Right after ``tdb.reshard`` returns, the garbage collector off: the old sharded modules are gone, and
    the storage of their tables and fused optimizer state with them (TorchRec's modules hold reference cycles;
    no collection ran, none is waited for). An old module the caller still holds refuses a call, naming
    reshard, and the job trains on; the new modules' ``reset_parameters`` fills their tables again (the
    fills reshard leaves out while it builds them are back)."""
    (first, _), (second, _) = SCHEDULES[job][:2]
    dmp, adam = _dmp(first)
    _step(dmp, adam, 0, rank, world)
    modules = [weakref.ref(dmp.module.get_submodule(p)) for p in first]
    storages = [r for p in first for r in _storages(dmp.module.get_submodule(p))]
    assert storages and all(r() is not None for r in storages)
    gc.collect()
    gc.disable()
    try:
        collections = gc.get_stats()[2]["collections"]
        tdb.reshard(dmp, _plan_of(second))
        assert gc.get_stats()[2]["collections"] == collections, "reshard ran a garbage collection"
        assert [r() for r in modules] == [None] * len(modules), "an old sharded module outlived reshard"
        assert all(r() is None for r in storages), "an old table's storage outlived reshard"
    finally:
        gc.enable()
    kept = {p: dmp.module.get_submodule(p) for p in first}
    tdb.reshard(dmp, _plan_of(first), split_row_states=True)  # back: a row-wise state into two column blocks
    _, bags, _ = _dlrm_batch(1, rank, world, TABLES, seed=2000)
    _, seq, _ = _dlrm_batch(1, rank, world, SEQ, seed=3000)
    for p, old in kept.items():
        with pytest.raises(RuntimeError, match=f"replaced by torchrec_dtensor_bridge.reshard.*{p!r}"):
            old(seq if p == "ec" else bags)
    _step(dmp, adam, 1, rank, world)
    for p in first:  # the tables' init_fn, left out while reshard built the modules, initialises them again
        module = dmp.module.get_submodule(p)
        sharded = {k: v for k, v in module.state_dict().items() if hasattr(v, "local_shards")}  # not t4
        before = {k: [s.tensor.clone() for s in v.local_shards()] for k, v in sharded.items()}
        module.reset_parameters()
        after = {k: [s.tensor for s in module.state_dict()[k].local_shards()] for k in sharded}
        assert all(not torch.equal(a, b) for k in before for a, b in zip(before[k], after[k]) if a.numel()), p


@pytest.mark.parametrize("job", ["dlrm", "ebc_and_ec"])
def test_the_old_sharded_modules_are_freed_when_reshard_returns(pool, job):
    pool.run(_old_module_freed, job)


def _refused(rank: int, world: int, case: str) -> str:
    group = dist.group.WORLD
    from torchrec.distributed.types import ShardingPlan

    path = "ec" if case.startswith("ec_") else PATH
    dmp, adam = _dmp({path: SEQ_BEFORE if path == "ec" else BEFORE}, ddp=True)
    _step(dmp, adam, 0, rank, world)

    if case == "ec_table_row_wise":  # a plan an EmbeddingBagCollectionSharder builds, not the EC's sharder
        twrw = _module_plan({"s1": ("table_row_wise",)}, world, rows={"s1": SEQ["s1"]})["s1"]
        plan = ShardingPlan({"ec": dict(_plan_of({"ec": SEQ_BEFORE}).plan["ec"], s1=twrw)})
    elif case == "another_world_size":
        plan = ShardingPlan({PATH: _module_plan(dict(BEFORE, t0=("table_wise", 3)), 4)})
    elif case == "another_shape":
        plan = ShardingPlan({PATH: _module_plan(dict(BEFORE, t1=("row_wise",)), world, rows=dict(TABLES, t1=8))})
    elif case == "unknown_table":
        plan = {"t9": _module_plan({"t9": ("row_wise",)}, world, rows={"t9": 5})["t9"]}
    elif case == "into_data_parallel":  # a fused table would become the dense optimizer's
        plan = _plan_of({PATH: dict(BEFORE, t1=("data_parallel",))})
    elif case == "out_of_data_parallel":
        plan = _plan_of({PATH: dict(BEFORE, t4=("row_wise",))})
    elif case == "split_column_cut":  # two column blocks into three of other widths
        plan = _plan_of({PATH: dict(BEFORE, t2=("column_sizes", [4, 4, 8]))})
    else:  # one value per row into two column blocks
        plan = _plan_of({PATH: dict(BEFORE, t1=("column_wise", [0, 1]))})
    before = _snapshot(_state(dmp, adam), group)
    module = dmp.module.get_submodule(path)
    with pytest.raises((ValueError, NotImplementedError)) as refused:
        tdb.reshard(dmp, plan)
    assert dmp.module.get_submodule(path) is module
    _assert_equal(_snapshot(_state(dmp, adam), group), before, f"{case}: after the refusal")
    _step(dmp, adam, 1, rank, world)
    return str(refused.value)


def _with_ddp(rank: int, world: int) -> None:
    """A DMP inside its DDP wrapper: resharded, every tensor as before, the wrapper the same object, and the
    next steps keep the dense parameters equal on every rank (DDP still averages their gradients)."""
    group = dist.group.WORLD
    dmp, adam = _dmp({PATH: BEFORE}, ddp=True)
    wrapper = dmp._dmp_wrapped_module
    assert isinstance(wrapper, torch.nn.parallel.DistributedDataParallel)
    for s in range(2):
        _step(dmp, adam, s, rank, world)
    before = _snapshot(_state(dmp, adam), group)
    tdb.reshard(dmp, _plan_of({PATH: AFTER}))
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
    "into_data_parallel": "table 'sparse_arch.embedding_bag_collection.t1': table_wise now, data_parallel in the "
                          "plan; a data-parallel table of a DMP is trained by the dense optimizer",
    "out_of_data_parallel": "table 'sparse_arch.embedding_bag_collection.t4': data_parallel now, another sharding "
                            "in the plan; a data-parallel table of a DMP is trained by the dense optimizer",
    "another_world_size": "table 'sparse_arch.embedding_bag_collection.t0'",
    "another_shape": "table 'sparse_arch.embedding_bag_collection.t1'",
    "unknown_table": "the tables ['t9'] are not all in one sharded module",
    "split_row_state": "table 'sparse_arch.embedding_bag_collection.t1': its rowwise_adagrad state keeps "
                       "a value per row and column block; column blocks of widths [16] do not convert exactly into "
                       "blocks of widths [8, 8] (only into the same blocks, or combined into one); pass "
                       "split_row_states=True",
    "split_column_cut": "table 'sparse_arch.embedding_bag_collection.t2': its rowwise_adagrad state keeps "
                        "a value per row and column block; column blocks of widths [8, 8] do not convert exactly "
                        "into blocks of widths [4, 4, 8]",
    "ec_table_row_wise": "table 'ec.s1': table_row_wise sharding in the plan; the module at 'ec' is built with "
                         "['column_wise', 'row_wise', 'table_wise'] only",
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_bad_plan_is_refused_on_every_rank_with_nothing_changed(pool, case):
    messages = pool.run(_refused, case)
    assert len(set(messages)) == 1, messages
    assert REFUSALS[case] in messages[0], messages[0]


# ------------------------------------------------------------------------------------------- memory, failures
WIDE = (2048, 1536)  # 12 MiB of float32; a third of its columns, 4 MiB, on each rank
LONG = (131072, 24)  # 12 MiB too, and a per-row state of 512 KiB a column block
COLUMNS = {f"w{i}": ("column_wise", [0, 1, 2]) for i in range(6)}
ROTATED = {f"w{i}": ("column_wise", [1, 2, 0]) for i in range(6)}  # every column block on the next rank
WHOLE = {f"w{i}": ("table_wise", i % 3) for i in range(6)}  # the per-row states' column blocks combined
MEMORY_CASES = {"rotated_columns": (WIDE, ROTATED), "columns_to_tables": (LONG, WHOLE)}


def _rows(shape: tuple[int, int]) -> dict[str, int]:
    return {f"w{i}": shape[0] for i in range(6)}


class _Bags(torch.nn.Module):
    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt: Any) -> torch.Tensor:
        return self.ebc(kjt).values()


def _wide_dmp(kinds: dict[str, tuple], shape: tuple[int, int] = WIDE):
    """A DMP of an ``EmbeddingBagCollection`` (at ``"ebc"``) of six tables of ``shape`` (fused row-wise
    Adagrad), trained one step."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, embedding_dim=shape[1], num_embeddings=r,
                                                            feature_names=[f"f_{n}"]) for n, r in _rows(shape).items()],
                                 device=torch.device("meta"))
    dmp = DistributedModelParallel(_Bags(ebc), env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=_plan_of_wide(kinds, shape),
                                   sharders=[_sharder()], init_data_parallel=False)
    _wide_step(dmp, 0, shape)
    return dmp


def _wide_step(dmp, step: int, shape: tuple[int, int] = WIDE) -> None:
    _, bags, _ = _dlrm_batch(step, dist.get_rank(), dist.get_world_size(), _rows(shape), seed=4000)
    dmp(bags).sum().backward()  # the fused kernel updates the tables and their state in the backward


def _plan_of_wide(kinds: dict[str, tuple], shape: tuple[int, int] = WIDE):
    from torchrec.distributed.types import ShardingPlan

    return ShardingPlan({"ebc": _module_plan(kinds, dist.get_world_size(), rows=_rows(shape), dim=shape[1])})


def _wide_peak(rank: int, world: int, staging: int, case: str) -> tuple[int, int, int]:
    """This rank's peak memory above the larger of its memory before and after the reshard of ``case``
    (:data:`MEMORY_CASES`), its bound (its largest new share of a table: weights and per-row state, + the
    staging bytes), and the rank's whole new share of the module (what rebuilding it at once takes). glibc
    is told to map every allocation of 128 KiB or more on its own, so that resident memory follows what is
    allocated."""
    import ctypes

    from torchrec_dtensor_bridge.resharding import dmp as dmp_module

    ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD: fixed, freed blocks unmapped
    group = dist.group.WORLD
    shape, kinds = MEMORY_CASES[case]
    dmp = _wide_dmp(COLUMNS, shape)
    before = _snapshot({"model": dmp, "fused": dmp.fused_optimizer}, group)
    new = _plan_of_wide(kinds, shape)
    peak = peak_growth(dmp_module, staging, lambda: tdb.reshard(dmp, new))
    _assert_equal(_snapshot({"model": dmp, "fused": dmp.fused_optimizer}, group), before, "after the reshard")
    shares = [sum(s.shard_sizes[0] * (s.shard_sizes[1] + 1) * 4 for s in ps.sharding_spec.shards
                  if s.placement.rank() == rank) for ps in new.plan["ebc"].values()]
    return peak, max(shares) + staging, sum(shares)


@pytest.mark.parametrize("case", sorted(MEMORY_CASES))
def test_a_dmps_peak_memory_grows_by_one_tables_new_share_and_the_staging_bytes(pool, case):
    """The module rebuilt at once would take each rank's whole new share (24 MiB here) above its steady state;
    table by table (the new module's buffers taken as they are written, each old table's memory released
    once its new blocks are in) it is one table's new share (4 MiB of column blocks; a whole table, 12.5
    MiB, into table-wise), plus the transfer buffers, plus 2 MiB of slack. Into table-wise the old per-row
    states, combined, are kept until every table is in (up to 3 MiB a rank here), and the buffers take what
    is left of the 4 MiB of staging."""
    for rank, (peak, bound, whole) in enumerate(pool.run(_wide_peak, 4 << 20, case)):
        assert whole > bound + (4 << 20), (whole, bound)  # the case tells the two apart
        assert peak <= bound + (2 << 20), f"rank {rank}: {peak / 2**20:.1f} MiB above the steady state, bound " \
                                          f"{bound / 2**20:.1f} MiB + 2 MiB (the whole new share: {whole / 2**20:.1f})"


def _wide_transfer_fails(rank: int, world: int) -> None:
    """Rank 1 fails while the third table moves: every rank raises, naming it; the two tables moved before
    (their old blocks' memory released: read as zeros) are moved back one by one from the new module; every
    table and state is as it was, the module the same object; the job trains on and the next reshard works."""
    from torchrec_dtensor_bridge.resharding import dmp as dmp_module

    group = dist.group.WORLD
    dmp = _wide_dmp(COLUMNS)
    module = dmp.module.ebc
    before = _snapshot({"model": dmp, "fused": dmp.fused_optimizer}, group)
    def tables(moves: list[Any]) -> list[str]:
        return sorted({m.dst_layout.name.rpartition(".")[2] for m in moves})

    with failing_third_move(dmp_module, rank, tables) as calls:
        with pytest.raises(RuntimeError, match="injected") as caught:
            tdb.reshard(dmp, _plan_of_wide(ROTATED))
    moved, failed, back = calls[:2], calls[2], calls[3:]
    assert len(calls) == 5 and all(len(c) == 1 for c in calls), calls  # one table at a time
    assert f"ebc.{failed[0]}" in str(caught.value), (failed, str(caught.value))
    assert back == moved[::-1], ("moved back one by one, the last first", calls)
    assert dmp.module.ebc is module
    _assert_equal(_snapshot({"model": dmp, "fused": dmp.fused_optimizer}, group), before, "after the failed move")
    _wide_step(dmp, 1)
    trained = _snapshot({"model": dmp, "fused": dmp.fused_optimizer}, group)
    tdb.reshard(dmp, _plan_of_wide(ROTATED))
    _assert_equal(_snapshot({"model": dmp, "fused": dmp.fused_optimizer}, group), trained, "after the next reshard")
    _wide_step(dmp, 2)


def test_a_failed_move_raises_on_every_rank_and_moves_the_tables_back(pool):
    pool.run(_wide_transfer_fails)
