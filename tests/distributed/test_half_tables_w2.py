"""fp16 tables, TorchRec's production default, trained through the kernel ops on a real TorchRec fused module
(2 gloo ranks): converted zero-copy, one step of ours against TorchRec's own step on the same inputs.

TorchRec's fp16 tables pool in fp32 and give fp32 outputs; fbgemm's CPU kernels round the update to nearest
(they ignore ``stochastic_rounding``). So with ``FusedOptimizer(..., stochastic_rounding=False)`` and fp32
outputs (``output_dtype=torch.float32``, as ``shard_module``'s forward asks) ours must give TorchRec's outputs
and leave TorchRec's weights and state, bit for bit, on a table-wise and a row-wise plan; with stochastic
rounding (the default), every element is TorchRec's or a neighbour of it, and the step is unbiased (tested on
the kernels in ``tests/unit/test_half_kernels.py``). The profiler shows which kernels ran.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.convert import local_shards_of

from .harness import make_pool_fixture
from .torchrec_models import random_kjt, seeded_tables, shard_fused

pool = make_pool_fixture(2)

TABLES = {f"t{i}": (60 + 9 * i, 8 * (1 + i % 3), "table_wise") for i in range(4)}
LR, EPS = 0.05, 1e-8


def _module(kind: str, world: int, plan: str):
    """A TorchRec EBC of fp16 tables with a fused optimizer, sharded by ``plan`` (table-wise or row-wise)."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.sharding_plan import row_wise, table_wise
    from torchrec.modules.embedding_configs import DataType

    torch.manual_seed(1)
    configs = [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"],
                                  data_type=DataType.FP16) for n, (r, d, _) in TABLES.items()]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    per_param = {n: (table_wise(rank=i % world, compute_kernel="fused") if plan == "table_wise"
                     else row_wise(compute_kernel="fused"))
                 for i, n in enumerate(TABLES)}
    module = shard_fused(ebc, per_param, kind, lr=LR, eps=EPS)
    return module, seeded_tables(module, TABLES, scale=0.1)


def _scale(rank: int, key: str, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(hash((rank, key)) % 2**31))


def check_step(rank: int, world: int, kind: str, plan: str, stochastic: bool) -> dict:
    theirs, _ = _module(kind, world, plan)
    mine, weights = _module(kind, world, plan)
    for n, w in weights.items():  # zero-copy: the DTensors' shards are TorchRec's fp16 rows
        assert w.dtype == torch.float16, n
        rows = mine.state_dict()[f"embedding_bags.{n}.weight"]
        ours = [s.data_ptr() for s in local_shards_of(w) if s.numel()]
        theirs_ptr = [s.tensor.data_ptr() for s in rows.local_shards()] if hasattr(rows, "local_shards") else []
        assert ours == theirs_ptr, (n, ours, theirs_ptr)
    opt = tdb.FusedOptimizer({n: w.requires_grad_() for n, w in weights.items()}, kind, lr=LR, eps=EPS,
                             stochastic_rounding=stochastic)
    kjt = random_kjt(TABLES, batch=16, seed=7 + rank)
    a = theirs(kjt).wait().to_dict()
    sum((a[k] * _scale(rank, k, a[k].shape)).sum() for k in sorted(a)).backward()
    feats = [kjt[f"f_{n}"] for n in TABLES]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        outs = tdb.sharded_embedding_bags([f.values() for f in feats], list(weights.values()),
                                          [f.offsets() for f in feats], mode="sum", include_last_offset=True,
                                          optimizer=opt, output_dtype=torch.float32)
        # TorchRec divides embedding gradients by the world size (DDP's averaging): scale ours alike (exact)
        (sum((o * _scale(rank, f"f_{n}", o.shape)).sum() for n, o in zip(TABLES, outs)) / world).backward()
    forward = all(o.dtype == torch.float32 and torch.equal(o, a[f"f_{n}"]) for n, o in zip(TABLES, outs))
    after = tdb.state_dict_to_dtensor(theirs.state_dict())
    differ, beyond, total = 0, 0, 0
    for n, w in weights.items():
        got, want = tdb.full_tensor(w), tdb.full_tensor(after[f"embedding_bags.{n}.weight"])
        ulp = torch.nextafter(want.abs(), torch.tensor(float("inf"), dtype=torch.float16)).float() - want.abs().float()
        differ += int((got != want).sum())
        beyond += int(((got.float() - want.float()).abs() > ulp).sum())
        total += got.numel()
    kernels = sorted({e.name for e in prof.events() if e.name.startswith(("tdb::native", "fbgemm::"))})
    return {"forward": forward, "differ": differ, "beyond": beyond, "total": total, "kernels": kernels}


@pytest.mark.parametrize("plan", ["table_wise", "row_wise"])
@pytest.mark.parametrize("kind", [pytest.param("sgd", marks=pytest.mark.slow), "rowwise_adagrad"])
def test_round_to_nearest_step_equals_torchrecs(pool, kind, plan):
    for got in pool.run(check_step, kind, plan, False):
        assert got["forward"], "fp32 outputs equal to TorchRec's"
        assert got["differ"] == 0, got
        assert got["kernels"], "no kernel op ran"


def test_stochastic_step_is_torchrecs_or_a_neighbour(pool):
    for got in pool.run(check_step, "rowwise_adagrad", "table_wise", True):
        assert got["forward"]
        assert got["beyond"] == 0, f"{got['beyond']} elements further than one fp16 step from TorchRec's"
        assert got["differ"] > 0, "stochastic rounding left every element at the nearest value"
        assert any(k.startswith("tdb::native_update") for k in got["kernels"]), got["kernels"]


def check_output_dtypes(rank: int, world: int, plan: str) -> list[str]:
    _, weights = _module("sgd", world, plan)
    kjt = random_kjt(TABLES, batch=4, seed=rank)
    feats = [kjt[f"f_{n}"] for n in TABLES]
    args = ([f.values() for f in feats], list(weights.values()), [f.offsets() for f in feats])
    plain = tdb.sharded_embedding_bags(*args, mode="sum", include_last_offset=True)
    asked = tdb.sharded_embedding_bags(*args, mode="sum", include_last_offset=True, output_dtype=torch.float32)
    for p, a in zip(plain, asked):
        if plan == "table_wise":  # one rank sums each bag: the fp32 sum, rounded
            assert torch.equal(p, a.half())
        else:  # the row blocks' partial sums are added in the output's dtype
            torch.testing.assert_close(p, a.half(), rtol=2e-3, atol=1e-3)
    return sorted({str(o.dtype) for o in plain} | {"asked:" + str(o.dtype) for o in asked})


@pytest.mark.parametrize("plan", ["table_wise", pytest.param("row_wise", marks=pytest.mark.slow)])
def test_half_table_output_dtype_follows_the_weight_unless_asked(pool, plan):
    for got in pool.run(check_output_dtypes, plan):
        assert got == ["asked:torch.float32", "torch.float16"], got
    assert os.environ.get("TDB_KERNELS") is None
