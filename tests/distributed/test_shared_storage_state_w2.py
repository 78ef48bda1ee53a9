"""Element-wise optimizer state of tables that share one storage: each table's own (2 gloo ranks).

TorchRec keeps a rank's fused tables in one fbgemm buffer, and ``tdb.state_dict_to_dtensor`` turns them into
DTensors whose shards are views of it. A ``FusedOptimizer`` over such tables keeps their state in one buffer
per storage too (so one kernel call updates them all), each table seeing its own part. Here a real TorchRec
fused ``EmbeddingBagCollection`` (three table-wise tables on each rank in one buffer, of different sizes, and
a row-wise table in another) trains several steps through ``tdb.sharded_embedding_bags`` with Adagrad and
Adam (element-wise state; row-wise Adagrad beside them), under each implementation that can run the
update; the weights and every ``state_dict()`` entry must equal an unsharded reference (torch's
``F.embedding_bag`` gradient, textbook sparse update), and no two tables' state may share memory.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.convert import local_shards_of

from .harness import make_pool_fixture
from .sparse_reference import SparseReference
from .torchrec_models import build_ebc

pool = make_pool_fixture(2)

# name: (rows, dim, plan); t0, t2, t4 on rank 0 and t1, t3, t5 on rank 1, each rank's in one buffer
TABLES = {
    "t0": (11, 8, "table_wise"), "t1": (9, 16, "table_wise"), "t2": (13, 24, "table_wise"),
    "t3": (7, 8, "table_wise"), "t4": (10, 16, "table_wise"), "t5": (6, 24, "table_wise"),
    "t_rw": (12, 8, "row_wise"),
}
HYPER = {"lr": 0.1, "eps": 1e-3, "beta1": 0.8, "beta2": 0.9}
STEPS = 3
MODES = ("sum", "mean")


def _fused_module(world: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A TorchRec fused module and its tables as DTensors (views of its buffers)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.shard import shard
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv

    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1})
    per_param = {n: row_wise(compute_kernel="fused") if plan == "row_wise" else
                 table_wise(rank=t % world, compute_kernel="fused")
                 for t, (n, (_, _, plan)) in enumerate(TABLES.items())}
    ebc = build_ebc(TABLES, seed=1)
    plan = construct_module_sharding_plan(ebc, per_param_sharding=per_param, sharder=sharder, local_size=world,
                                          world_size=world, device_type="cpu")
    module = shard(ebc, plan=plan, env=ShardingEnv.from_process_group(dist.group.WORLD),
                   device=torch.device("cpu"), sharder=sharder)
    converted = tdb.state_dict_to_dtensor(module.state_dict())
    return module, {n: converted[f"embedding_bags.{n}.weight"] for n in TABLES}


def _table(t: int) -> torch.Tensor:
    n = list(TABLES)[t]
    rows, dim, _ = TABLES[n]
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(20 + t))


def _fill(weights: dict[str, torch.Tensor], rank: int) -> None:
    with torch.no_grad():
        for t, n in enumerate(TABLES):
            full = _table(t)
            for spec, s in zip(tdb.layout_of(weights[n]).shards_on(rank), local_shards_of(weights[n])):
                s.copy_(full[spec.slices()])


def _batch(rank: int, step: int, t: int) -> dict:
    """Rank ``rank``'s bags of table ``t`` at ``step``: its last row always (each table's end of the buffer)."""
    rows = TABLES[list(TABLES)[t]][0]
    g = torch.Generator().manual_seed(1000 * step + 10 * t + rank)
    lengths = torch.randint(1, 4, (2 + rank + step,), generator=g)
    ids = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    ids[0] = rows - 1
    return {"input": ids, "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])}


def _scale(rank: int, step: int, t: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(77 + 1000 * step + 10 * t + rank))


def _span(x: torch.Tensor) -> tuple[int, int, int]:
    """``x``'s storage and the byte range of it that ``x`` can reach."""
    reach = 1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride())) if x.numel() else 0
    start = x.untyped_storage().data_ptr() + x.storage_offset() * x.element_size()
    return x.untyped_storage().data_ptr(), start, start + reach * x.element_size()


def _overlaps(tensors: dict[str, list[torch.Tensor]]) -> list[tuple[str, str]]:
    """The pairs of ``tensors``' entries (name -> local tensors) whose memory overlaps."""
    spans = [(name, _span(x)) for name, xs in tensors.items() for x in xs if x.numel()]
    found = []
    for i, (a, (sa, lo_a, hi_a)) in enumerate(spans):
        for b, (sb, lo_b, hi_b) in spans[i + 1 :]:
            if a != b and sa == sb and lo_a < hi_b and lo_b < hi_a:
                found.append((a, b))
    return found


def check_shared_storage_training(rank: int, world: int, kind: str, impl: str) -> None:
    """``STEPS`` steps of every table in one ``sharded_embedding_bags`` call, ``TDB_KERNELS=impl``; then the
    weights and state against the reference, and the memory each state tensor can reach."""
    _module, tables = _fused_module(world)  # the module owns the buffers the weights view
    for w in tables.values():
        w.requires_grad_()
    mine = [n for t, n in enumerate(TABLES) if TABLES[n][2] == "table_wise" and t % world == rank]
    homes = {s.untyped_storage().data_ptr() for n in mine for s in local_shards_of(tables[n])}
    assert len(homes) == 1 and len(mine) == 3, "TorchRec keeps a rank's fused table-wise tables in one buffer"
    _fill(tables, rank)
    os.environ["TDB_KERNELS"] = impl
    try:
        opt = tdb.FusedOptimizer(tables, kind, **HYPER)
        refs = {n: SparseReference(_table(t), kind, **HYPER) for t, n in enumerate(TABLES)}
        for step in range(STEPS):
            modes = [MODES[(t + step) % 2] for t in range(len(TABLES))]
            batches = [_batch(rank, step, t) for t in range(len(TABLES))]
            outs = tdb.sharded_embedding_bags([b["input"] for b in batches], list(tables.values()),
                                              [b["offsets"] for b in batches], mode=modes, optimizer=opt)
            sum((o * _scale(rank, step, t, o.shape)).sum() for t, o in enumerate(outs)).backward()
            for t, n in enumerate(TABLES):
                every = [_batch(r, step, t) for r in range(world)]
                scales = [_scale(r, step, t, (len(b["offsets"]), TABLES[n][1])) for r, b in enumerate(every)]
                refs[n].train(every, scales, mode=modes[t])
    finally:
        os.environ.pop("TDB_KERNELS", None)
    for n, w in tables.items():
        assert w.grad is None, f"{n}: weight.grad was set"
        torch.testing.assert_close(tdb.full_tensor(w), refs[n].w, msg=lambda m, n=n: f"{kind}/{impl}: {n}: {m}")
    sd = opt.state_dict()
    want = {k: v for n, ref in refs.items() for k, v in ref.state(n).items()}
    assert sorted(sd) == sorted(want), (sorted(sd), sorted(want))
    for key, value in sd.items():
        got = tdb.full_tensor(value) if isinstance(value, DTensor) else value
        torch.testing.assert_close(got, want[key], msg=lambda m, k=key: f"{kind}/{impl}: {k}: {m}")
    states = {k: local_shards_of(v) for k, v in sd.items() if isinstance(v, DTensor)}
    clash = _overlaps({**states, **{f"{n}.weight": local_shards_of(w) for n, w in tables.items()}})
    assert not clash, f"{kind}/{impl}: tensors that share memory on rank {rank}: {clash}"


@pytest.mark.parametrize("kind,impl", [("adagrad", "native"), pytest.param("adagrad", "fbgemm", marks=pytest.mark.slow),
                                       ("adam", "native"), pytest.param("adam", "torch", marks=pytest.mark.slow),
                                       ("rowwise_adagrad", "fbgemm")])
def test_state_of_tables_sharing_a_storage_is_each_tables_own(pool, kind, impl):
    pool.run(check_shared_storage_training, kind, impl)
