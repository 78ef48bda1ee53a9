"""A TorchRec DLRM job checkpointed in one call and resumed on another plan and world size (gloo).

TorchRec's ``DLRM`` in a ``DistributedModelParallel`` whose tables train with
TorchRec's fused row-wise Adagrad (the ``fused`` kernel), its dense part with
Adam, trains on ranks 0-1 (a 2-rank group, plan ``BEFORE``) and is saved with
ONE ``tdb.checkpoint.save({"model": dmp, "fused": dmp.fused_optimizer,
"dense": adam, "step": step})``, then keeps training (the uninterrupted run).
On all 3 ranks a fresh DMP under plan ``AFTER`` (every table moves) resumes with
ONE ``tdb.checkpoint.load`` of the same dict (its dense optimizer a TorchRec
``KeyedOptimizerWrapper`` over Adam, before its first step): every tensor equals
the saved one exactly and the losses continue the uninterrupted run's; so they do with a
plain ``torch.optim.Adam`` before its first step, which takes the saved hyper-parameters
too. (Ranks 0-1 form their own group for the first run, so one pool of 3 processes
serves both.) A target
whose row-wise Adagrad table is column-wise is refused on every rank, nothing
modified. Every step sees the same global batch of 6 samples, split over the
ranks, so the runs differ only in summation order. First of all, every layout family
(uneven row-wise, table-wise, column-wise, grid, and a row-wise state of each) goes
through S3: saved on 2 ranks, full and as a chain of 3 links, loaded on 3 ranks into
other layouts and in one process. A 16-column table's row-wise Adagrad state goes between
column cuts (blocks within blocks, other widths, counts that do not divide, uneven blocks)
only with ``split_row_states=True``, by the width-weighted rule, and is refused on every
rank without it, nothing modified.
"""

from __future__ import annotations

import contextlib
import os
import uuid
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._shard.sharded_tensor import ShardedTensor

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.checkpoint.common import leaves
from torchrec_dtensor_bridge.checkpoint.stateful import expand

from .harness import make_pool_fixture

pool = make_pool_fixture(3)

TABLES = {"t0": 11, "t1": 7, "t2": 9}  # name -> rows
DIM, DENSE_IN, GLOBAL_BATCH = 8, 3, 6
SAVE_AT, STEPS = 2, 4  # train steps 0-1, save, then steps 2-3 (uninterrupted, and resumed)
DENSE_LR = 0.05
FUSED_LR = 0.04  # set after the DMP is built (its fused_params say 0.1)
BEFORE = {"t0": ("row_wise",), "t1": ("table_wise", 1), "t2": ("table_wise", 0)}  # on 2 ranks
AFTER = {"t0": ("table_wise", 2), "t1": ("row_wise",), "t2": ("table_wise", 1)}  # on 3 ranks (t1: 3+3+1 rows)
COLUMN_WISE = dict(AFTER, t2=("column_wise", [0, 1]))


def _key(table: str) -> str:
    return f"sparse_arch.embedding_bag_collection.embedding_bags.{table}.weight"


def _dmp(plan: dict[str, tuple], group: dist.ProcessGroup, optimizer: str = "EXACT_ROWWISE_ADAGRAD"):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.models.dlrm import DLRM

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=[f"f_{n}"])
                for n, r in TABLES.items()],
        device=torch.device("meta"),
    )
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE_IN, dense_arch_layer_sizes=[5, DIM],
                 over_arch_layer_sizes=[4, 1])
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": getattr(EmbOptimType, optimizer), "learning_rate": 0.1, "eps": 1e-3})
    make = {"row_wise": lambda: sp.row_wise(compute_kernel="fused"),
            "table_wise": lambda rank: sp.table_wise(rank=rank, compute_kernel="fused"),
            "column_wise": lambda ranks: sp.column_wise(ranks=ranks, compute_kernel="fused"),
            "data_parallel": sp.data_parallel}  # the dense kernel: the dense optimizer trains it
    world = group.size()
    per_param = {n: make[kind](*args) for n, (kind, *args) in plan.items()}
    module_plan = sp.construct_module_sharding_plan(ebc, per_param_sharding=per_param, sharder=sharder,
                                                    local_size=world, world_size=world, device_type="cpu")
    return DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(group), device=torch.device("cpu"),
        plan=ShardingPlan({"sparse_arch.embedding_bag_collection": module_plan}), sharders=[sharder])


def _dense_params(dmp) -> dict[str, torch.nn.Parameter]:
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    return dict(in_backward_optimizer_filter(dmp.named_parameters()))


def _batch(step: int, rank: int, world: int, tables: dict[str, int] = TABLES, seed: int = 1000):
    """This rank's share of step ``step``'s global batch of ``GLOBAL_BATCH`` samples over ``tables`` (name ->
    rows): dense features, ids, labels."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed + step)
    dense = torch.rand(GLOBAL_BATCH, DENSE_IN, generator=g)
    lengths = torch.randint(0, 3, (len(tables), GLOBAL_BATCH), generator=g)
    ids = [torch.randint(0, rows, (int(lengths[t].sum()),), generator=g) for t, rows in enumerate(tables.values())]
    labels = torch.randint(0, 2, (GLOBAL_BATCH,), generator=g).float()
    per = GLOBAL_BATCH // world
    lo, hi = rank * per, (rank + 1) * per
    values = []
    for t in range(len(tables)):
        ends = torch.cumsum(lengths[t], 0).tolist()
        start = ends[lo - 1] if lo else 0
        values.append(ids[t][start : ends[hi - 1]])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{n}" for n in tables], values=torch.cat(values),
                                              lengths=lengths[:, lo:hi].reshape(-1))
    return dense[lo:hi], kjt, labels[lo:hi]


def _step(dmp, dense_opt, step: int, group: dist.ProcessGroup) -> float:
    """One training step; the global batch's mean loss."""
    dense, kjt, labels = _batch(step, group.rank(), group.size())
    dmp.fused_optimizer.zero_grad()  # where TorchRec hands its fused kernel the param groups' lr
    loss = F.binary_cross_entropy_with_logits(dmp(dense, kjt).squeeze(1), labels)
    loss.backward()  # the fused tables are updated here
    dense_opt.step()
    dense_opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return total.item() / group.size()


def _snapshot(state: dict[str, Any], group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` (Statefuls expanded, as the checkpoint sees them) as a whole tensor; collective."""
    mine: dict[str, tuple[tuple[int, ...], list[tuple[list[int], torch.Tensor]]]] = {}
    for key, v in leaves(expand(state, for_load=False).view):
        if isinstance(v, ShardedTensor):
            mine[key] = (tuple(v.size()), [(list(s.metadata.shard_offsets), s.tensor.clone())
                                            for s in v.local_shards()])
        elif isinstance(v, torch.Tensor):
            mine[key] = (tuple(v.shape), [([0] * v.dim(), v.detach().clone())])
    everyone: list[Any] = [None] * group.size()
    dist.all_gather_object(everyone, mine, group=group)
    out: dict[str, torch.Tensor] = {}
    for part in everyone:
        for key, (shape, pieces) in part.items():
            full = out.setdefault(key, torch.zeros(shape, dtype=pieces[0][1].dtype if pieces else torch.float32))
            for offsets, t in pieces:
                full[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))] = t
    return out


# ------------------------------------------------- every layout family on S3: 2 ranks save, 3 ranks load
_SHAPES = {"rw": (10, 4), "tw": (6, 3), "cw": (5, 8), "grid": (8, 6)}


def _layouts(world: int) -> dict[str, Any]:
    """Each table's layout on ``world`` ranks (2: as saved, 3: as loaded), and its row-wise Adagrad state's
    (one value per row, cut as the table's rows)."""
    from torchrec_dtensor_bridge.layout import ShardLayout as L

    if world == 2:
        out = {"rw": L.row_wise(_SHAPES["rw"], [7, 3]), "tw": L.table_wise(_SHAPES["tw"], 1),
               "cw": L.column_wise(_SHAPES["cw"], [3, 5]), "grid": L.grid(_SHAPES["grid"], [3, 5], [2, 4], [0, 1, 1, 0])}
        rows = {"rw": ([7, 3], [0, 1]), "tw": ([6], [1]), "cw": ([5], [0]), "grid": ([3, 5], [0, 1])}
    else:
        out = {"rw": L.row_wise(_SHAPES["rw"], [4, 3, 3]), "tw": L.table_wise(_SHAPES["tw"], 2),
               "cw": L.column_wise(_SHAPES["cw"], [2, 3, 3]), "grid": L.grid(_SHAPES["grid"], [4, 4], [3, 3], [2, 0, 1, 2])}
        rows = {"rw": ([1, 2, 7], [2, 0, 1]), "tw": ([6], [0]), "cw": ([2, 3], [1, 2]), "grid": ([8], [1])}
    for name, (heights, ranks) in rows.items():
        out[f"{name}.momentum1"] = L.row_wise((_SHAPES[name][0],), heights, ranks=ranks)
    return out


def _full_values(link: int) -> dict[str, torch.Tensor]:
    """The full value of every tensor after ``link`` incremental changes (0: the full save's)."""
    g = torch.Generator().manual_seed(11)
    vals = {}
    for name, shape in _SHAPES.items():
        vals[name] = torch.randn(shape, generator=g)
        vals[f"{name}.momentum1"] = torch.rand(shape[0], generator=g)
    for k in range(1, link + 1):
        for name, shape in _SHAPES.items():
            row = (3 * k + len(name)) % shape[0]
            vals[name][row] += k
            vals[f"{name}.momentum1"][(row + 1) % shape[0]] += k
    return vals


def _sharded(vals: dict[str, torch.Tensor], layouts: dict[str, Any], mesh, fill: float | None = None) -> dict:
    from torchrec_dtensor_bridge.convert import dtensor_from_local_shards

    rank = dist.get_rank()
    return {k: dtensor_from_local_shards(lay, [vals[k][s.slices()].clone() if fill is None else
                                               torch.full(s.sizes, fill) for s in lay.shards_on(rank)],
                                         device_mesh=mesh) for k, lay in layouts.items()}


def _layouts_through_s3(rank: int, world: int, url: str) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    # every rank builds both meshes and the group (this test runs first in the module: a later one builds
    # groups on some ranks only, after which groups built on every rank no longer pair up across ranks)
    mesh2, mesh3 = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [0, 1, 2])
    g01 = dist.new_group([0, 1])
    if rank < 2:  # ranks 0-1 save a full checkpoint and a chain of 3 incremental links to S3
        for link in range(4):
            sd = _sharded(_full_values(link), _layouts(2), mesh2)
            base = f"{url}/l{link - 1}" if link else None
            tdb.checkpoint.save(sd, f"{url}/l{link}", base=base, process_group=g01)
    dist.barrier()
    lays3 = _layouts(3)
    for link in (0, 3):  # all 3 ranks load the full save and the chain's newest link into other layouts
        dest = _sharded({}, lays3, mesh3, fill=float("nan"))
        tdb.checkpoint.load(dest, f"{url}/l{link}")
        want = _full_values(link)
        for k, lay in lays3.items():
            local = dest[k].to_local()
            shards = local.local_shards() if isinstance(local, tdb.LocalShardsWrapper) else (
                [local] if lay.shards_on(rank) else [])
            for spec, t in zip(lay.shards_on(rank), shards):
                assert torch.equal(t, want[k][spec.slices()]), (link, k, rank, spec)


def test_every_layout_family_saved_to_s3_on_two_ranks_loads_on_three_ranks_and_in_one_process(pool, s3_server):
    """Uneven row-wise, table-wise, column-wise and grid tables with their row-wise Adagrad state (one value
    a row), saved on 2 ranks to S3 (a real SeaweedFS), full and as a chain of 3 incremental links: loaded on
    3 ranks into other layouts, and in this one process into plain tensors, every value torch.equal."""
    bucket = f"tdb-layouts-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/runs/job"
    pool.run(_in_env, s3_server.env, _layouts_through_s3, url)
    for link in (0, 3):
        plain = {k: torch.full(v.shape, float("nan")) for k, v in _full_values(link).items()}
        tdb.checkpoint.load(plain, f"{url}/l{link}")
        assert all(torch.equal(plain[k], v) for k, v in _full_values(link).items()), link
    assert [x["name"] for x in tdb.checkpoint.inspect(f"{url}/l3")["rw"]["links"]] == ["l3", "l2", "l1", "l0"]


@contextlib.contextmanager
def _no_sharded_tensor_deprecation():
    """The package's save and load of a DMP's ShardedTensors print none of ShardedTensor's deprecation
    warnings (not the user's to act on: the package is what moves them to DTensor)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield
    said = [f"{w.filename}:{w.lineno}: {w.message}" for w in seen if "ShardedTensor" in str(w.message)]
    assert not said, said


def _train_and_save(rank: int, world: int, path: str) -> tuple[dict[str, torch.Tensor], list[float]] | None:
    group = dist.new_group([0, 1])
    if rank not in (0, 1):
        return None
    dmp = _dmp(BEFORE, group)
    for g in dmp.fused_optimizer.param_groups:  # not the 0.1 every DMP here is built with: the resume must
        g["lr"] = FUSED_LR                      # take it from the checkpoint
    adam = torch.optim.Adam(_dense_params(dmp).values(), lr=DENSE_LR)
    for step in range(SAVE_AT):
        _step(dmp, adam, step, group)
    state = {"model": dmp, "fused": dmp.fused_optimizer, "dense": adam, "step": SAVE_AT}
    with _no_sharded_tensor_deprecation():
        tdb.checkpoint.save(state, path, process_group=group)  # one call: model, both optimizers, the step
    saved = _snapshot(state, group)
    losses = [_step(dmp, adam, step, group) for step in range(SAVE_AT, STEPS)]
    return (saved, losses) if rank == 0 else None


def _resume(rank: int, world: int, path: str, saved: dict[str, torch.Tensor], losses: list[float]) -> None:
    from torchrec.optim.keyed import KeyedOptimizerWrapper

    group = dist.group.WORLD
    dmp = _dmp(AFTER, group)
    dense = KeyedOptimizerWrapper(_dense_params(dmp), lambda params: torch.optim.Adam(params, lr=DENSE_LR))
    state = {"model": dmp, "fused": dmp.fused_optimizer, "dense": dense, "step": 0}
    with _no_sharded_tensor_deprecation():
        tdb.checkpoint.load(state, path)  # one call: resharded to 3 ranks and another plan
    assert state["step"] == SAVE_AT
    assert [g["lr"] for g in dmp.fused_optimizer.param_groups] == [FUSED_LR] * len(dmp.fused_optimizer.param_groups)
    got = _snapshot(state, group)
    assert sorted(got) == sorted(saved), sorted(set(got) ^ set(saved))
    assert any(".t1.momentum1" in k for k in got) and any(".exp_avg_sq" in k for k in got), sorted(got)
    for key, want in saved.items():
        assert torch.equal(got[key], want), f"{key} differs after the load on rank {rank}"
    # TorchRec's state converts into a FusedOptimizer over the DMP's own tables (which require no grad)
    tables = tdb.state_dict_to_dtensor(dmp.state_dict())
    opt = tdb.FusedOptimizer.for_conversion({n: tables[_key(n)] for n in TABLES}, "rowwise_adagrad")
    opt.load_torchrec_state_dict(dmp.fused_optimizer.state_dict())
    for n in TABLES:
        want = saved[f"fused.state.{_key(n)}.{n}.momentum1"]
        assert torch.equal(tdb.full_tensor(opt.state_dict()[f"{n}.momentum1"]), want), n
    with pytest.raises(ValueError, match="converts state and applies no update"):
        tdb.sharded_embedding_bag(torch.tensor([0, 1]), tables[_key("t1")], torch.tensor([0]), optimizer=opt)
    tdb.checkpoint.save({"fused": opt}, f"{path}-ours")  # a FusedOptimizer is a Stateful too
    with torch.no_grad():
        for v in opt.state_dict().values():
            for t in tdb.convert.local_shards_of(v):
                t.fill_(-1.0)
    tdb.checkpoint.load({"fused": opt}, f"{path}-ours")
    for n in TABLES:
        want = saved[f"fused.state.{_key(n)}.{n}.momentum1"]
        assert torch.equal(tdb.full_tensor(opt.state_dict()[f"{n}.momentum1"]), want), n
    resumed = [_step(dmp, dense, step, group) for step in range(SAVE_AT, STEPS)]
    torch.testing.assert_close(resumed, losses, rtol=1e-6, atol=1e-7)  # the plans sum in different orders
    # TorchRec's fused optimizer state passed as it is, into a dense optimizer that has state: back to the
    # checkpoint, and the same steps again give the same losses bit for bit
    state = {"model": dmp, "fused": dmp.fused_optimizer.state_dict(), "dense": dense, "step": 0}
    tdb.checkpoint.load(state, path)
    assert state["step"] == SAVE_AT
    assert [_step(dmp, dense, step, group) for step in range(SAVE_AT, STEPS)] == resumed


def _resume_plain_adam(rank: int, world: int, path: str, saved: dict[str, torch.Tensor], losses: list[float]) -> None:
    """The dense part resumed by a plain ``torch.optim.Adam`` before its first step (its state empty), built
    with other hyper-parameters: it takes the saved state and the saved optimizer's hyper-parameters exactly."""
    group = dist.group.WORLD
    dmp = _dmp(AFTER, group)
    params = _dense_params(dmp)
    adam = torch.optim.Adam(params.values(), lr=0.5, betas=(0.5, 0.6), eps=1e-3, weight_decay=0.1)
    assert not adam.state
    state = {"model": dmp, "fused": dmp.fused_optimizer, "dense": adam, "step": 0}
    tdb.checkpoint.load(state, path)
    assert state["step"] == SAVE_AT
    saved_adam = torch.optim.Adam([torch.zeros(1)], lr=DENSE_LR)  # as _train_and_save built it
    want = {k: v for k, v in saved_adam.param_groups[0].items() if k != "params"}
    assert [{k: v for k, v in g.items() if k != "params"} for g in adam.param_groups] == [want], adam.param_groups
    assert set(adam.state) == set(params.values())
    for name, p in params.items():
        for what in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(adam.state[p][what], saved[f"dense.state.{name}.{what}"]), (name, what)
    resumed = [_step(dmp, adam, step, group) for step in range(SAVE_AT, STEPS)]
    torch.testing.assert_close(resumed, losses, rtol=1e-6, atol=1e-7)  # the plans sum in different orders


def _values_without_tensors(rank: int, world: int, path: str) -> None:
    """Values that hold no tensor - a plain Adam saved before its first step (only its hyper-parameters), a
    dict of plain values - load on 3 ranks, where a rank holds no shard of some tables (DCP then tries the
    flattening of checkpoints older than torch 2.4, which keeps each such value whole)."""
    dmp = _dmp(AFTER, dist.group.WORLD)
    adam = torch.optim.Adam(_dense_params(dmp).values(), lr=DENSE_LR)
    tdb.checkpoint.save({"model": dmp, "dense": adam, "meta": {"step": SAVE_AT, "tag": "a"}}, path)
    fresh = torch.optim.Adam(_dense_params(dmp).values(), lr=0.5)
    state = {"model": dmp, "dense": fresh, "meta": {"step": 0, "tag": ""}}
    tdb.checkpoint.load(state, path)
    assert state["meta"] == {"step": SAVE_AT, "tag": "a"}, state["meta"]
    assert fresh.param_groups[0]["lr"] == DENSE_LR and not fresh.state


def _column_wise_target(rank: int, world: int, path: str) -> list[str]:
    group = dist.group.WORLD
    dmp = _dmp(COLUMN_WISE, group)
    adam = torch.optim.Adam(_dense_params(dmp).values(), lr=DENSE_LR)
    state = {"model": dmp, "fused": dmp.fused_optimizer, "dense": adam, "step": 0}
    before = _snapshot(state, group)
    with pytest.raises(ValueError) as refused:
        tdb.checkpoint.load(state, path)
    assert not adam.state and state["step"] == 0, "a refused load left optimizer state or the step behind"
    after = _snapshot(state, group)
    assert sorted(after) == sorted(before)
    for key, was in before.items():
        assert torch.equal(after[key], was), f"{key} modified by a refused load on rank {rank}"
    # converting TorchRec's state of that table is refused alike, before anything is copied
    tables = tdb.state_dict_to_dtensor(dmp.state_dict())
    opt = tdb.FusedOptimizer.for_conversion({n: tables[_key(n)] for n in TABLES}, "rowwise_adagrad")
    with pytest.raises(ValueError, match=r"t2.momentum1: TorchRec's has shape \[18\], ours \[9\].*column shard"):
        opt.load_torchrec_state_dict(dmp.fused_optimizer.state_dict())
    return [str(refused.value)]


@pytest.fixture(scope="module")
def saved(pool, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dlrm") / "latest")
    saved, losses = pool.run(_train_and_save, path)[0]
    return path, saved, losses


def test_dlrm_resumes_on_three_ranks_under_another_plan_in_one_call(pool, saved):
    path, tensors, losses = saved
    pool.run(_resume, path, tensors, losses)


def _in_env(rank: int, world: int, env: dict[str, str], fn: Any, *args: Any) -> Any:
    """``fn`` run with ``env`` set (the S3 server's variables, for ranks the pool started before the server)."""
    os.environ.update(env)
    return fn(rank, world, *args)


@pytest.fixture(scope="module")
def saved_on_s3(pool, s3_server):
    bucket = f"tdb-dlrm-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=bucket)
    path = f"s3://{bucket}/jobs/latest"
    saved, losses = pool.run(_in_env, s3_server.env, _train_and_save, path)[0]
    return path, saved, losses, s3_server.env


@pytest.mark.slow  # a second training job; the S3 paths it takes run by default in tests/unit/test_storage_conformance.py
def test_dlrm_saved_to_an_object_store_resumes_on_three_ranks_and_loads_in_one_process(pool, saved_on_s3):
    """The same job saved on 2 ranks to S3 (a real SeaweedFS): resumed on 3 ranks under another plan, and loaded
    in this one process into plain tensors, every value equal to the saved one."""
    path, tensors, losses, env = saved_on_s3
    pool.run(_in_env, env, _resume, path, tensors, losses)
    info = tdb.checkpoint.inspect(path)
    plain = {k: torch.zeros(rec["shape"], dtype=getattr(torch, rec["dtype"])) for k, rec in info.items()
             if rec["type"] == "tensor"}
    tdb.checkpoint.load(plain, path)
    shared = sorted(set(plain) & set(tensors))
    assert len(shared) >= len(TABLES), sorted(plain)
    for key in shared:
        assert torch.equal(plain[key], tensors[key]), key


def test_a_plain_torch_adam_before_its_first_step_resumes_on_three_ranks_under_another_plan(pool, saved):
    path, tensors, losses = saved
    pool.run(_resume_plain_adam, path, tensors, losses)


def test_values_holding_no_tensor_resume_on_ranks_that_hold_no_shard_of_some_tables(pool, tmp_path):
    pool.run(_values_without_tensors, str(tmp_path / "plain"))


def test_a_column_wise_rowwise_adagrad_target_is_refused_on_every_rank_with_nothing_modified(pool, saved):
    messages = pool.run(_column_wise_target, saved[0])
    assert messages[0] == messages[1] == messages[2], messages
    message = messages[0][0]
    key = f"fused.state.{_key('t2')}.t2.momentum1"
    assert f"key {key!r}: saved shape [9], destination shape [18]" in message, message
    assert "one value per row for each of 2 column shards" in message, message
    assert "split_row_states=True" in message, "the refusal says what to do"


def _split_into_column_blocks(rank: int, world: int, path: str) -> None:
    """Asked for (``split_row_states=True``), the whole-row state of t2 loads into a column-wise plan's
    per-block states: every block takes its row's saved value; everything else as saved."""
    group = dist.group.WORLD
    dmp = _dmp(COLUMN_WISE, group)
    state = {"model": dmp, "fused": dmp.fused_optimizer}
    tdb.checkpoint.load(state, path, split_row_states=True)
    got = _snapshot(state, group)
    key = f"fused.state.{_key('t2')}.t2.momentum1"
    reference = _dmp(AFTER, group)  # the saved values, loaded where they need no conversion
    ref_state = {"model": reference, "fused": reference.fused_optimizer}
    tdb.checkpoint.load(ref_state, path, strict=False)
    want = _snapshot(ref_state, group)
    assert got[key].shape == (2 * TABLES["t2"],) and torch.equal(got[key], want[key].repeat(2)), (got[key], want[key])
    for k, v in want.items():
        if k != key and k in got:
            assert torch.equal(got[k], v), k


def test_a_whole_row_state_splits_into_column_blocks_when_asked(pool, saved):
    pool.run(_split_into_column_blocks, saved[0])


def _other_kind_target(rank: int, world: int, path: str) -> str:
    """Tables trained with element-wise Adagrad, saved, loaded into the same model under row-wise Adagrad."""
    group = dist.group.WORLD
    elementwise = _dmp(AFTER, group, "EXACT_ADAGRAD")
    tdb.checkpoint.save({"model": elementwise, "fused": elementwise.fused_optimizer}, path)
    rowwise = _dmp(AFTER, group)
    with pytest.raises(ValueError) as refused:
        tdb.checkpoint.load({"model": rowwise, "fused": rowwise.fused_optimizer}, path)
    return str(refused.value)


def test_state_of_another_optimizer_kind_is_refused_saying_the_optimizer_changed(pool, tmp_path):
    messages = pool.run(_other_kind_target, str(tmp_path / "adagrad"))
    assert messages[0] == messages[1] == messages[2], messages
    key = f"fused.state.{_key('t0')}.t0.momentum1"
    assert f"key {key!r}: saved shape [11, 8], destination shape [11]" in messages[0], messages[0]
    assert "the optimizer changed between the save and the load" in messages[0], messages[0]
    assert "one value per element ([11, 8])" in messages[0] and "column" not in messages[0], messages[0]


def _without_hyperparameters(rank: int, world: int, path: str) -> list[float]:
    """A checkpoint that holds no hyper-parameters (TorchRec's state_dict() saved as it is, as before they were
    recorded) loads into the fused optimizer as a Stateful; its groups keep their own lr."""
    group = dist.group.WORLD
    dmp = _dmp(AFTER, group)
    for g in dmp.fused_optimizer.param_groups:
        g["lr"] = FUSED_LR
    tdb.checkpoint.save({"model": dmp, "fused": dmp.fused_optimizer.state_dict()}, path)
    assert not any("hyperparameters" in k for k in tdb.checkpoint.inspect(path))
    fresh = _dmp(AFTER, group)
    tdb.checkpoint.load({"model": fresh, "fused": fresh.fused_optimizer}, path)
    return [g["lr"] for g in fresh.fused_optimizer.param_groups]


def test_a_checkpoint_without_hyperparameters_loads_and_keeps_the_groups_lr(pool, tmp_path):
    for lrs in pool.run(_without_hyperparameters, str(tmp_path / "old")):
        assert lrs and all(abs(lr - 0.1) < 1e-6 for lr in lrs), lrs


CW_BEFORE = {"t0": ("table_wise", 2), "t1": ("row_wise",), "t2": ("column_wise", [0, 1])}  # t2: 2 blocks of 4


def _column_wise_into_whole_rows(rank: int, world: int, path: str) -> None:
    """t2 trained column-wise with row-wise Adagrad (one per-row state per column block), saved, resumed
    table-wise: its state is the blocks' states weighted by their widths (each block's is the mean of g^2
    over its own columns, so this is the mean over all of them), exactly; every other key as saved."""
    group = dist.group.WORLD
    before = _dmp(CW_BEFORE, group)
    adam = torch.optim.Adam(_dense_params(before).values(), lr=DENSE_LR)
    for step in range(SAVE_AT):
        _step(before, adam, step, group)
    state = {"model": before, "fused": before.fused_optimizer}
    saved = _snapshot(state, group)
    tdb.checkpoint.save(state, path)
    key = f"fused.state.{_key('t2')}.t2.momentum1"
    assert tdb.checkpoint.inspect(path)[key]["shape"] == [2 * TABLES["t2"]]
    after = _dmp(AFTER, group)  # t2 table-wise on rank 1: one value per row
    resumed = {"model": after, "fused": after.fused_optimizer}
    tdb.checkpoint.load(resumed, path)
    got = _snapshot(resumed, group)
    rows = TABLES["t2"]
    per_block = saved[key].view(2, rows).double()
    want = ((per_block[0] * 4 + per_block[1] * 4) / 8).float()  # widths 4 and 4 (DIM 8 in two blocks)
    assert got[key].shape == (rows,) and torch.equal(got[key], want), (got[key], want)
    for k, v in saved.items():
        if k != key:
            assert torch.equal(got[k], v), k


def test_a_column_wise_rowwise_adagrad_state_resumes_whole_rows_exactly(pool, tmp_path):
    pool.run(_column_wise_into_whole_rows, str(tmp_path / "cw"))


EBC_TABLES = {"a": (13, 8), "b": (10, 8)}  # b: column-wise on 2 ranks (two blocks of 4), then table-wise on 1


def _fused_ebc(plan: dict[str, Any], group: dist.ProcessGroup):
    """A TorchRec EBC of EBC_TABLES with fused row-wise Adagrad (lr FUSED_LR, eps 1e-3) under ``plan``."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.shard import shard
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingEnv

    torch.manual_seed(3)
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r,
                                                            feature_names=[f"f_{n}"]) for n, (r, d) in EBC_TABLES.items()],
                                 device=torch.device("cpu"))
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                          "learning_rate": FUSED_LR, "eps": 1e-3})
    world = group.size()
    module_plan = construct_module_sharding_plan(ebc, per_param_sharding=plan, sharder=sharder, local_size=world,
                                                 world_size=world, device_type="cpu")
    return shard(ebc, plan=module_plan, env=ShardingEnv.from_process_group(group), device=torch.device("cpu"),
                 sharder=sharder)


def _ebc_batch(step: int, rank: int):
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(500 + 10 * step + rank)
    lengths = torch.randint(0, 4, (len(EBC_TABLES), 6), generator=g)
    values = [torch.randint(0, r, (int(lengths[t].sum()),), generator=g) for t, (r, _) in enumerate(EBC_TABLES.values())]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{n}" for n in EBC_TABLES], values=torch.cat(values),
                                              lengths=lengths.reshape(-1))
    scale = {f"f_{n}": torch.randn(6, d, generator=g) for n, (_, d) in EBC_TABLES.items()}
    return kjt, scale


def _ebc_step(ebc, step: int, rank: int, world: int) -> None:
    kjt, scale = _ebc_batch(step, rank)
    out = ebc(kjt).wait().to_dict()
    # TorchRec divides the embeddings' gradient by the world size: undo it, so every plan steps alike
    (sum((out[k] * scale[k]).sum() for k in sorted(out)) * world).backward()


def _column_wise_to_one_rank_next_step(rank: int, world: int, path: str) -> None:
    """Table b trained column-wise with TorchRec's fused row-wise Adagrad on 2 ranks (one per-row state per
    column block), saved, resumed table-wise on 1 rank: the state is combined exactly, and the next step of
    TorchRec's kernel equals the unsharded row-wise Adagrad step from that state (the gradient of a sum
    pooling: each row, the sum of its bags' output gradients)."""
    from torchrec.distributed.sharding_plan import column_wise, table_wise

    two, one = dist.new_group([0, 1]), dist.new_group([0])
    if rank in (0, 1):
        before = _fused_ebc({"a": table_wise(rank=0, compute_kernel="fused"),
                             "b": column_wise(ranks=[0, 1], compute_kernel="fused")}, two)
        for step in range(3):
            _ebc_step(before, step, rank, 2)
        tdb.checkpoint.save({"model": before, "fused": before.fused_optimizer}, path, process_group=two)
    dist.barrier()
    if rank != 0:
        return
    after = _fused_ebc({n: table_wise(rank=0, compute_kernel="fused") for n in EBC_TABLES}, one)
    state = {"model": after, "fused": after.fused_optimizer}
    tdb.checkpoint.load(state, path, process_group=one)
    loaded = _snapshot(state, one)
    weight, key = "model.embedding_bags.b.weight", "fused.state.embedding_bags.b.weight.b.momentum1"
    assert loaded[key].shape == (EBC_TABLES["b"][0],), sorted(loaded)
    kjt, scale = _ebc_batch(3, 0)
    _ebc_step(after, 3, 0, 1)
    got = _snapshot(state, one)
    rows, dim = EBC_TABLES["b"]
    grad = torch.zeros(rows, dim, dtype=torch.float64)
    feature = kjt["f_b"]
    for b, (lo, hi) in enumerate(zip(feature.offsets()[:-1].tolist(), feature.offsets()[1:].tolist())):
        for r in feature.values()[lo:hi].tolist():
            grad[r] += scale["f_b"][b].double()
    touched = torch.zeros(rows, dtype=torch.bool)
    touched[feature.values()] = True
    m1 = loaded[key].double() + (grad ** 2).mean(1) * touched
    want = loaded[weight].double() - FUSED_LR * grad / (m1.sqrt() + 1e-3).unsqueeze(1)
    torch.testing.assert_close(got[key].double(), m1, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[weight].double(), want, rtol=1e-5, atol=1e-6)
    assert not torch.equal(got[weight], loaded[weight]), "the step changed nothing"


def test_a_column_wise_table_resumes_on_one_rank_and_steps_as_the_unsharded_rowwise_adagrad(pool, tmp_path):
    pool.run(_column_wise_to_one_rank_next_step, str(tmp_path / "cw2"))



# ------------------------------------------- row-wise Adagrad state between column cuts, split_row_states=True
WIDE = (9, 16)  # table w: rows, columns (TorchRec's fused kernel takes column blocks whose widths are multiples of 4)
CUTS = {"16": ("table_wise", 0), "8+8": ("column_wise", [1, 2]), "4+12": ("column_sizes", [4, 12]),
        "4+4+8": ("column_sizes", [4, 4, 8]), "4x4": ("column_wise", [0, 1, 2, 0])}  # name -> TorchRec's plan
WIDTHS = {"16": [16], "8+8": [8, 8], "4+12": [4, 12], "4+4+8": [4, 4, 8], "4x4": [4, 4, 4, 4]}
SPLITS = [("8+8", "4x4"),  # blocks within blocks: new block 1 (columns 4-8) lies in saved block 0
          ("4+12", "8+8"),  # as many blocks, other widths
          ("8+8", "4+4+8"), ("4+4+8", "8+8"),  # block counts that do not divide each other
          ("8+8", "4+12"), ("16", "4+12")]  # into uneven blocks, from two blocks and from one value per row
WIDE_MOMENTUM, WIDE_WEIGHT = "fused.state.embedding_bags.w.weight.w.momentum1", "model.embedding_bags.w.weight"


def _wide_ebc(cut: str, group: dist.ProcessGroup):
    """A TorchRec EBC of table w (``WIDE``) with fused row-wise Adagrad, cut as ``CUTS[cut]`` (``column_sizes``:
    block k on rank k), its per-row state filled with distinct values (one per row and column block)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.shard import shard
    from torchrec.distributed.types import ShardingEnv

    torch.manual_seed(5)
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="w", embedding_dim=WIDE[1], num_embeddings=WIDE[0],
                                                            feature_names=["f_w"])], device=torch.device("cpu"))
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                          "learning_rate": FUSED_LR, "eps": 1e-3})
    kind, arg = CUTS[cut]
    make = {"table_wise": lambda: sp.table_wise(rank=arg, compute_kernel="fused"),
            "column_wise": lambda: sp.column_wise(ranks=arg, compute_kernel="fused"),
            "column_sizes": lambda: sp.column_wise(size_per_rank=arg, compute_kernel="fused")}[kind]
    world = group.size()
    plan = sp.construct_module_sharding_plan(ebc, per_param_sharding={"w": make()}, sharder=sharder, local_size=world,
                                             world_size=world, device_type="cpu")
    sharded = shard(ebc, plan=plan, env=ShardingEnv.from_process_group(group), device=torch.device("cpu"),
                    sharder=sharder)
    held = sharded.fused_optimizer.state_dict()["state"].get("embedding_bags.w.weight")  # a rank holding a block
    if held is not None:
        state = held["w.momentum1"]
        values = torch.rand(WIDE[0] * len(WIDTHS[cut]), generator=torch.Generator().manual_seed(len(cut))) + 0.1
        for s in state.local_shards():  # views of the kernel's state
            first = s.metadata.shard_offsets[0]
            s.tensor.copy_(values[first : first + s.tensor.numel()])
    return sharded


def _by_the_rule(saved: torch.Tensor, widths: list[int], blocks: int) -> torch.Tensor:
    """A per-row state saved under blocks of ``widths``, as ``blocks`` column blocks take it: each row's saved values
    weighted by their blocks' widths (in float64, as ``tdb.reshard`` combines them), every new block that value."""
    w = torch.tensor(widths, dtype=torch.float64)
    rows = ((saved.view(len(widths), -1).to(torch.float64) * w[:, None]).sum(0) / w.sum()).to(saved.dtype)
    return rows.repeat(blocks)


def _split_into_other_cuts(rank: int, world: int, path: str) -> dict[str, str]:
    """Every pair of ``SPLITS``: refused without ``split_row_states=True`` on every rank, nothing modified and no
    collective left waiting; with it, the state is the saved one by the rule (:func:`_by_the_rule`) and the
    weights are the saved ones. TorchRec's module does not take weights cut into uneven column blocks (its
    load_state_dict reshapes every rank's blocks to the first block's width): that is refused as well, even with
    the flag, and only the optimizer loads there. A checkpoint loads into its own cut block for block."""
    group = dist.group.WORLD
    ebcs = {cut: _wide_ebc(cut, group) for cut in CUTS}
    saved = {}
    for cut in sorted({src for src, _ in SPLITS}):
        state = {"model": ebcs[cut], "fused": ebcs[cut].fused_optimizer}
        saved[cut] = _snapshot(state, group)
        assert saved[cut][WIDE_MOMENTUM].shape == (WIDE[0] * len(WIDTHS[cut]),)
        assert len(set(saved[cut][WIDE_MOMENTUM].tolist())) == saved[cut][WIDE_MOMENTUM].numel(), "distinct values"
        tdb.checkpoint.save(state, f"{path}/{cut}")
    messages = {}
    for src, dst in SPLITS:
        even = len(set(WIDTHS[dst])) == 1
        state = {"model": ebcs[dst], "fused": ebcs[dst].fused_optimizer}
        before = _snapshot(state, group)
        for split in (False,) if even else (False, True):
            with pytest.raises(ValueError) as refused:
                tdb.checkpoint.load(state, f"{path}/{src}", split_row_states=split)
            after = _snapshot(state, group)
            assert sorted(after) == sorted(before)
            for key, was in before.items():
                assert torch.equal(after[key], was), f"{src} -> {dst}: {key} modified by a refused load on rank {rank}"
            messages[f"{src} -> {dst}{' split' if split else ''}"] = str(refused.value)
            dist.barrier()  # the refusal left no collective waiting
        if not even:
            state = {"fused": ebcs[dst].fused_optimizer}
        tdb.checkpoint.load(state, f"{path}/{src}", split_row_states=True)
        got = _snapshot({"model": ebcs[dst], "fused": ebcs[dst].fused_optimizer}, group)
        want = _by_the_rule(saved[src][WIDE_MOMENTUM], WIDTHS[src], len(WIDTHS[dst]))
        assert torch.equal(got[WIDE_MOMENTUM], want), (src, dst, got[WIDE_MOMENTUM], want)
        assert torch.equal(got[WIDE_WEIGHT], saved[src][WIDE_WEIGHT] if even else before[WIDE_WEIGHT]), (src, dst)
    state = {"model": ebcs["8+8"], "fused": ebcs["8+8"].fused_optimizer}
    tdb.checkpoint.load(state, f"{path}/8+8")  # the same blocks: block for block, no flag
    got = _snapshot(state, group)
    assert all(torch.equal(got[k], v) for k, v in saved["8+8"].items()), "the same cut loads as saved"
    return messages


@pytest.mark.timeout(120)
def test_a_rowwise_adagrad_state_goes_into_other_column_cuts_only_when_asked_by_the_width_weighted_rule(pool, tmp_path):
    """Per-block row states between column cuts that are neither the same blocks nor one block (blocks within
    blocks, other widths, block counts that do not divide each other, uneven blocks): refused without
    ``split_row_states=True`` on every rank with the same message naming the key, the table and both cuts'
    widths; with it, every new block takes its row's saved values combined, weighted by their widths."""
    outcomes = pool.run(_split_into_other_cuts, str(tmp_path / "cuts"))
    assert outcomes[0] == outcomes[1] == outcomes[2], outcomes
    for src, dst in SPLITS:
        message = outcomes[0][f"{src} -> {dst}"]
        assert f"key {WIDE_MOMENTUM!r}: saved shape [{WIDE[0] * len(WIDTHS[src])}], destination shape " \
               f"[{WIDE[0] * len(WIDTHS[dst])}] (row-wise optimizer state of table 'embedding_bags.w.weight'" \
               in message, message
        def holds(cut: str) -> str:
            n = len(WIDTHS[cut])
            return "one value per row" + (f" for each of {n} column shards (widths {WIDTHS[cut]})" if n > 1 else "")

        assert f"the checkpoint holds {holds(src)}, the destination {holds(dst)};" in message, message
        assert "split_row_states=True" in message, message
        if len(set(WIDTHS[dst])) > 1:  # refused with the flag too: TorchRec's module takes no uneven blocks
            message = outcomes[0][f"{src} -> {dst} split"]
            assert f"key {WIDE_WEIGHT!r}: a table cut into column blocks of widths {WIDTHS[dst]} does not load into " \
                   "TorchRec's module" in message and "momentum1" not in message, message


def _dense_state_of_a_data_parallel_table(rank: int, world: int, path: str) -> None:
    """A DMP whose table ``t2`` is data-parallel (TorchRec hands it to the dense optimizer as a
    ``TableBatchedEmbeddingSlice``, a subclass of ``nn.Parameter``) trains 2 steps with ``torch.optim.Adam``
    over its dense parameters, is saved, and loads into a fresh job under another plan of its other tables:
    every dense parameter's Adam state (step count and moments), the data-parallel table's included, equals
    the saved one, and both jobs' next losses are equal (the load created no state for any parameter when
    one of them was such a slice, and loaded nothing)."""
    group = dist.group.WORLD
    plan = dict(BEFORE, t2=("data_parallel",))
    dmp = _dmp(plan, group)
    adam = torch.optim.Adam(_dense_params(dmp).values(), lr=DENSE_LR)
    assert any(type(p) is not torch.nn.Parameter for p in _dense_params(dmp).values())
    for s in range(2):
        _step(dmp, adam, s, group)
    want = {n: {k: v.clone() for k, v in adam.state[p].items()} for n, p in _dense_params(dmp).items()}
    tdb.checkpoint.save({"model": dmp, "fused": dmp.fused_optimizer, "dense": adam}, path)
    fresh = _dmp(dict(AFTER, t2=("data_parallel",)), group)
    fresh_adam = torch.optim.Adam(_dense_params(fresh).values(), lr=DENSE_LR)
    tdb.checkpoint.load({"model": fresh, "fused": fresh.fused_optimizer, "dense": fresh_adam}, path)
    got = {n: fresh_adam.state.get(p, {}) for n, p in _dense_params(fresh).items()}
    assert sorted(got) == sorted(want) and _key("t2") in got
    for n, state in want.items():
        assert sorted(got[n]) == sorted(state), (n, sorted(got[n]))
        for k, v in state.items():
            assert torch.equal(got[n][k], v), f"{n}.{k} differs on rank {rank}"
    assert _step(dmp, adam, 2, group) == _step(fresh, fresh_adam, 2, group)


def test_the_dense_optimizers_state_of_a_data_parallel_table_resumes(pool, tmp_path):
    pool.run(_dense_state_of_a_data_parallel_table, str(tmp_path / "dp"))
