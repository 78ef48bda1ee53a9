"""Checkpoint regressions on 2 gloo ranks: each test fails on a bug that every other test let through, and holds
the behaviour that bug broke.

- A chain saved under one plan and loaded under another with ``staging_bytes=0`` (each rank verifies what it
  reads, then reads it again and copies it): a row changed in both links comes from the newest, on every rank.
- A tracked job whose rows were written through torch (``torch.no_grad()``, in place) before an optimizer step
  that updated other rows: the incremental save after the step holds the rows written through torch (the step's
  report of its own rows must not absorb a write made before it), and the link loads equal (``torch.equal``) to
  the live tables and optimizer state. A ``FusedOptimizer(..., track_changed_rows=True)`` job, the write made
  between steps or between a forward and the backward that applies the step; and TorchRec's fused training under
  ``tdb.track_changed_rows``, the write made between steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.layout import ShardLayout

from .checks import reference_table
from .harness import make_pool_fixture

pool = make_pool_fixture(2)


def _differ(got: torch.Tensor, want: torch.Tensor) -> list[int]:
    """The rows (dim-0 slices) where ``got`` and ``want`` differ."""
    d = got != want
    return d.reshape(d.shape[0], -1).any(1).nonzero().flatten().tolist() if d.dim() else [0] if bool(d) else []


# -- a chain loaded unstaged under another plan

SAVED = {"rw": ShardLayout.row_wise((40, 6), [25, 15]),
         "grid": ShardLayout.grid((12, 8), [5, 7], [3, 5], [0, 1, 1, 0]),
         "mom": ShardLayout.row_wise((40,), [25, 15])}
LOADED = {"rw": ShardLayout.column_wise((40, 6), [2, 4]),
          "grid": ShardLayout.row_wise((12, 8), [8, 4]),
          "mom": ShardLayout.row_wise((40,), [7, 33])}
CHANGED = [  # per link after the full one, (rows, amount): rows 4, 9 (rank 0's block) and 30 (rank 1's) of rw in both
    {"rw": ([3, 4, 5, 9, 30], 1.0), "grid": ([2, 6], 1.0), "mom": ([4, 26], 1.0)},
    {"rw": ([4, 9, 30, 31], 10.0), "grid": ([6], 10.0), "mom": ([4], 10.0)},
]


def _tables(link: int) -> dict[str, torch.Tensor]:
    tables = {k: reference_table(lay.global_shape, seed=i) for i, (k, lay) in enumerate(sorted(SAVED.items()))}
    for changes in CHANGED[:link]:
        for k, (rows, amount) in changes.items():
            tables[k][rows] += amount
    return tables


def _dtensors(layouts: dict[str, ShardLayout], tables: dict[str, torch.Tensor], rank: int) -> dict[str, object]:
    return {k: tdb.convert.dtensor_from_local_shards(lay.with_name(k), [tables[k][s.slices()].clone()
                                                                        for s in lay.shards_on(rank)])
            for k, lay in layouts.items()}


def _chain_loaded_unstaged(rank: int, world_size: int, root: str) -> None:
    for link in range(len(CHANGED) + 1):
        base = f"{root}/l{link - 1}" if link else None
        tdb.checkpoint.save(_dtensors(SAVED, _tables(link), rank), f"{root}/l{link}", base=base)
    info = tdb.checkpoint.inspect(f"{root}/l2")
    assert [link["rows"] for link in info["rw"]["links"]] == [4, 5, 40], info["rw"]["links"]
    for link in (2, 1):
        want = _tables(link)
        dest = _dtensors(LOADED, {k: torch.full_like(t, -1.0) for k, t in want.items()}, rank)
        tdb.checkpoint.load(dest, f"{root}/l{link}", staging_bytes=0)
        for k, t in want.items():
            got = tdb.full_tensor(dest[k])
            assert torch.equal(got, t), (rank, link, k, _differ(got, t))


def test_a_chain_loaded_unstaged_under_another_plan_takes_the_newest_rows(pool, tmp_path):
    pool.run(_chain_loaded_unstaged, str(tmp_path))


# -- a tracked job written through torch before an optimizer step

WHEN = ("between steps", "between a forward and its backward")  # the backward applies the fused update
TRACKED = {"rw": ShardLayout.row_wise((50, 8), [30, 20]), "other": ShardLayout.row_wise((30, 8), [10, 20])}
STEP_IDS = {"rw": torch.tensor([[10, 40], [7, 45]]), "other": torch.tensor([[1, 25], [2, 2]])}  # never row 3 of
# a shard of rw (global rows 3 and 33)


def _tracked_job(rank: int, kind: str, track: bool):
    weights = {n: tdb.convert.dtensor_from_local_shards(
        lay.with_name(n), [reference_table(lay.global_shape, seed=i)[s.slices()].clone() * 1e-2
                           for s in lay.shards_on(rank)]).requires_grad_()
               for i, (n, lay) in enumerate(TRACKED.items())}
    return weights, tdb.FusedOptimizer(weights, kind, lr=0.05, track_changed_rows=track)


def _forward(weights, opt) -> torch.Tensor:
    """A lookup of :data:`STEP_IDS` on every rank (the same rows, whichever rank holds them): its backward is the
    optimizer's step."""
    outs = tdb.sharded_embedding_bags([STEP_IDS[n] for n in weights], list(weights.values()), mode="sum",
                                      optimizer=opt)
    return sum(o.sum() for o in outs)


def _snapshot(weights, opt) -> dict[str, torch.Tensor]:
    state = {f"w.{n}": w for n, w in weights.items()} | {f"opt.{k}": v for k, v in opt.state_dict().items()
                                                         if isinstance(v, torch.Tensor)}
    return {k: (v if type(v) is torch.Tensor else tdb.full_tensor(v)).detach().clone() for k, v in state.items()}


def _written_through_torch_then_stepped(rank: int, world_size: int, root: str, kind: str, when: str) -> None:
    """Steps and saves of a tracked job: l0 (full), l1 (tracked, nothing else written), l2 after row 3 of each
    rank's shard of ``rw`` was written through torch ``when``, then a step updating other rows."""
    weights, opt = _tracked_job(rank, kind, True)
    _forward(weights, opt).backward()
    tdb.checkpoint.save({"w": weights, "opt": opt}, f"{root}/l0")
    _forward(weights, opt).backward()
    tdb.checkpoint.save({"w": weights, "opt": opt}, f"{root}/l1", base=f"{root}/l0")
    before = tdb.full_tensor(weights["rw"]).detach().clone()
    loss = _forward(weights, opt) if when == WHEN[1] else None
    with torch.no_grad():  # global rows 3 and 33
        tdb.convert.local_shards_of(weights["rw"])[0][3] += 1.0
    (loss if loss is not None else _forward(weights, opt)).backward()
    tdb.checkpoint.save({"w": weights, "opt": opt}, f"{root}/l2", base=f"{root}/l1")
    live = _snapshot(weights, opt)
    assert torch.equal(live["w.rw"][[3, 33]], before[[3, 33]] + 1.0), "the step wrote rows 3 or 33"
    assert _differ(live["w.rw"], before) == [3, 7, 10, 33, 40, 45], _differ(live["w.rw"], before)
    fresh, fresh_opt = _tracked_job(rank, kind, False)
    tdb.checkpoint.load({"w": fresh, "opt": fresh_opt}, f"{root}/l2")
    got = _snapshot(fresh, fresh_opt)
    assert sorted(got) == sorted(live)
    assert torch.equal(got["w.rw"][[3, 33]], live["w.rw"][[3, 33]]), (when, got["w.rw"][[3, 33]],
                                                                        live["w.rw"][[3, 33]])
    for k, v in live.items():
        assert torch.equal(got[k], v), (when, k, _differ(got[k], v))


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adam"])
def test_rows_written_through_torch_before_a_tracked_step_are_saved(pool, tmp_path, kind, when):
    pool.run(_written_through_torch_then_stepped, str(tmp_path), kind, when)


# -- the same on TorchRec's fused training, tracked by tdb.track_changed_rows

EBC_IDS = torch.tensor([10, 30, 7, 27])  # one table of 40 rows, row-wise on 2 ranks: never row 3 of a shard (global
# rows 3 and 23)


def _sharded_ebc(seed: int):
    """A TorchRec ``EmbeddingBagCollection`` of one table, sharded row-wise (``torchrec.distributed.shard``) with
    the fused kernel (fbgemm's row-wise Adagrad in backward)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.shard import shard
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv

    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=40,
                                                            feature_names=["f"])], device=torch.device("cpu"))
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                          "learning_rate": 0.1, "eps": 1e-3})
    world = dist.get_world_size()
    plan = construct_module_sharding_plan(ebc, per_param_sharding={"t": row_wise(compute_kernel="fused")},
                                          sharder=sharder, local_size=world, world_size=world, device_type="cpu")
    return shard(ebc, plan=plan, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                 sharder=sharder)


def _ebc_forward(model) -> torch.Tensor:
    from torchrec import KeyedJaggedTensor

    out = model(KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=EBC_IDS, lengths=torch.tensor([2, 2])))
    return (out.wait() if hasattr(out, "wait") else out).values().sum()


def _whole(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` (a nested dict of ShardedTensors, DTensors and tensors) whole; collective."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in _whole(v).items()})
        elif isinstance(v, torch.Tensor):
            out[k] = (v if type(v) is torch.Tensor else tdb.full_tensor(v)).detach().clone()
    return out


def _ebc_state(model) -> dict:
    return {"model": model, "fused": model.fused_optimizer}


def _ebc_snapshot(model) -> dict[str, torch.Tensor]:
    return _whole({"model": model.state_dict(), "fused": model.fused_optimizer.state_dict()["state"]})


def _torchrec_written_through_torch_then_stepped(rank: int, world_size: int, root: str) -> None:
    """As :func:`_written_through_torch_then_stepped`, the write between steps (TorchRec's kernel keeps the weights
    for its backward: autograd refuses a write between a forward and its backward)."""
    model = _sharded_ebc(0)
    report = tdb.track_changed_rows(model)
    try:
        assert "embedding_bags.t.weight" in report.tracked, report
        _ebc_forward(model).backward()
        tdb.checkpoint.save(_ebc_state(model), f"{root}/l0")
        _ebc_forward(model).backward()
        tdb.checkpoint.save(_ebc_state(model), f"{root}/l1", base=f"{root}/l0")
        before = _ebc_snapshot(model)["model.embedding_bags.t.weight"]
        with torch.no_grad():  # global rows 3 and 23
            model.embedding_bags["t"].weight[3] += 1.0
        _ebc_forward(model).backward()
        tdb.checkpoint.save(_ebc_state(model), f"{root}/l2", base=f"{root}/l1")
        live = _ebc_snapshot(model)
    finally:
        report.remove()
    weight = live["model.embedding_bags.t.weight"]
    assert torch.equal(weight[[3, 23]], before[[3, 23]] + 1.0), "the step wrote rows 3 or 23"
    assert _differ(weight, before) == [3, 7, 10, 23, 27, 30], _differ(weight, before)
    fresh = _sharded_ebc(1)
    assert not torch.equal(_ebc_snapshot(fresh)["model.embedding_bags.t.weight"], weight)
    tdb.checkpoint.load(_ebc_state(fresh), f"{root}/l2")
    got = _ebc_snapshot(fresh)
    assert sorted(got) == sorted(live) and len(live) == 2, sorted(live)
    for k, v in live.items():
        assert torch.equal(got[k], v), (k, _differ(got[k], v))


def test_rows_written_through_torch_before_a_torchrec_tracked_step_are_saved(pool, tmp_path):
    pool.run(_torchrec_written_through_torch_then_stepped, str(tmp_path))
