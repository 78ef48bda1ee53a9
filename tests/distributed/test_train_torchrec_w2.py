"""Training through TorchRec's fused kernels and through ours: the same weights and optimizer state.

Two sharded copies of one ``EmbeddingBagCollection`` (same initial weights, the
same hand-written plan): TorchRec's ``ShardedEmbeddingBagCollection`` with its
fused fbgemm kernel (optimizer applied in backward), and ours
(``tdb.shard_module`` + ``tdb.FusedOptimizer``), fed the same KeyedJaggedTensor
batches and output gradients on 2 gloo ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.convert import local_shards_of
from torchrec_dtensor_bridge.convert.placements import world_mesh
from torchrec_dtensor_bridge.layout import ShardLayout
from torchrec_dtensor_bridge.torchrec_plan import layouts_from_module_plan

from .harness import make_pool_fixture
from .torchrec_models import build_ebc, random_kjt

pool = make_pool_fixture(2)

TABLES = {"t_tw": (7, 12, "table_wise"), "t_rw": (13, 8, "row_wise"), "t_tw2": (9, 4, "table_wise")}
LR, EPS = 0.1, 1e-3


def _torchrec(kind: str, world: int):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.shard import shard
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv

    opt = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[kind]
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": opt, "learning_rate": LR, "eps": EPS})
    per_param = {"t_tw": table_wise(rank=world - 1, compute_kernel="fused"), "t_rw": row_wise(compute_kernel="fused"),
                 "t_tw2": table_wise(rank=0, compute_kernel="fused")}
    ebc = build_ebc(TABLES, seed=3)
    plan = construct_module_sharding_plan(ebc, per_param_sharding=per_param, sharder=sharder, local_size=world,
                                          world_size=world, device_type="cpu")
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    return shard(ebc, plan=plan, env=env, device=torch.device("cpu"), sharder=sharder), plan


def _scale(rank: int, step: int, key: str, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(hash((rank, step, key)) % 2**31))


def _local(st: ShardedTensor) -> dict[tuple, torch.Tensor]:
    return {tuple(s.metadata.shard_offsets): s.tensor for s in st.local_shards()}


def check_same_training(rank: int, world: int, kind: str, steps: int = 3) -> int:
    theirs, plan = _torchrec(kind, world)
    shapes = {n: (r, d) for n, (r, d, _) in TABLES.items()}
    layouts = layouts_from_module_plan(plan, shapes, world_size=world, dtype=torch.float32)
    ours = tdb.shard_module(build_ebc(TABLES, seed=3), {f"embedding_bags.{n}.weight": lay for n, lay in layouts.items()},
                            world_mesh("cpu"))
    weights = {n: ours.embedding_bags[n].weight for n in TABLES}
    start = theirs.state_dict()  # TorchRec's fused tables initialise themselves: start from their values
    with torch.no_grad():
        for n, w in weights.items():
            got = dict(zip([s.offsets for s in layouts[n].shards_on(rank)], local_shards_of(w)))
            for off, t in _local(start[f"embedding_bags.{n}.weight"]).items():
                got[off].copy_(t)
    opt = tdb.FusedOptimizer(weights, kind, lr=LR, eps=EPS)
    for step in range(steps):
        kjt = random_kjt(TABLES, batch=5, seed=100 * step + rank)  # TorchRec needs one batch size
        a = theirs(kjt).wait().to_dict()
        b = ours(kjt, optimizer=opt).to_dict()
        sum((a[k] * _scale(rank, step, k, a[k].shape)).sum() for k in sorted(a)).backward()
        # TorchRec divides embedding gradients by the world size (comm_ops' gradient division, on by
        # default, to match DDP's averaging); ours sums every rank's batch: scale our loss alike
        (sum((b[k] * _scale(rank, step, k, b[k].shape)).sum() for k in sorted(b)) / world).backward()
        for k in a:
            torch.testing.assert_close(b[k], a[k], msg=lambda m, k=k: f"step {step} output {k}: {m}")
    compared = 0
    sd = theirs.state_dict()
    osd = theirs.fused_optimizer.state_dict()["state"]
    mine = opt.state_dict()
    for n, w in weights.items():
        assert w.grad is None
        lay = layouts[n]
        got = dict(zip([s.offsets for s in lay.shards_on(rank)], local_shards_of(w)))
        for off, t in _local(sd[f"embedding_bags.{n}.weight"]).items():
            torch.testing.assert_close(got[off], t, msg=lambda m, n=n: f"{n} weight: {m}")
            compared += 1
        if kind == "rowwise_adagrad" and f"embedding_bags.{n}.weight" in osd:
            state = mine[f"{n}.momentum1"]
            got = dict(zip([s.offsets for s in layout_rows(state, rank)], local_shards_of(state)))
            for off, t in _local(osd[f"embedding_bags.{n}.weight"][f"{n}.momentum1"]).items():
                torch.testing.assert_close(got[off], t, msg=lambda m, n=n: f"{n} momentum1: {m}")
                compared += 1
    if kind == "rowwise_adagrad":
        compared += _check_state_exchange(rank, theirs, opt, weights, layouts)
    return compared


def _check_state_exchange(rank: int, theirs, opt, weights, layouts) -> int:
    """TorchRec's fused optimizer state into ours and ours into TorchRec's (live tensors)."""
    osd = theirs.fused_optimizer.state_dict()
    ours = opt.state_dict()
    want = {k: [t.clone() for t in local_shards_of(v)] for k, v in ours.items()}
    with torch.no_grad():
        for v in ours.values():
            for t in local_shards_of(v):
                t.fill_(-1.0)
    opt.load_torchrec_state_dict(osd)
    for k, v in ours.items():
        for got, exp in zip(local_shards_of(v), want[k]):
            torch.testing.assert_close(got, exp, msg=lambda m, k=k: f"import {k}: {m}")
    stamp = {k: [t.clone() for t in local_shards_of(v)] for k, v in ours.items()}
    with torch.no_grad():
        for v in ours.values():
            for t in local_shards_of(v):
                t.mul_(2.0)
    opt.copy_to_torchrec_state_dict(osd)
    live = theirs.fused_optimizer.state_dict()["state"]  # TorchRec's own tensors now hold ours
    n = 0
    for key, per in live.items():
        for sk, st in per.items():
            table = sk.rpartition(".")[0]
            mine = dict(zip([s.offsets[0] for s in layout_rows(ours[sk], rank)], stamp[sk]))
            for off, t in _local(st).items():
                torch.testing.assert_close(t, 2.0 * mine[off[0]], msg=lambda m, sk=sk: f"export {sk}: {m}")
                n += 1
            assert table in weights
    return n


def check_column_wise_refused(rank: int, world: int) -> None:
    """TorchRec's row-wise Adagrad on a column-wise table keeps per-column-shard row state: refused."""
    from .torchrec_models import shard_ebc_with_rowwise_adagrad

    model, tables = shard_ebc_with_rowwise_adagrad(world)
    osd = model.fused_optimizer.state_dict()
    rows, dim, _ = tables["t_cw"]
    w = tdb.convert.dtensor_from_local_shards(
        ShardLayout.row_wise((rows, dim), world, dtype=torch.float32),
        [torch.zeros(s.sizes) for s in ShardLayout.row_wise((rows, dim), world).shards_on(rank)],
    ).requires_grad_()
    opt = tdb.FusedOptimizer({"t_cw": w}, "rowwise_adagrad", lr=0.1)
    with pytest.raises(ValueError, match=r"t_cw.momentum1: TorchRec's has shape \[36\], ours \[9\].*column shard"):
        opt.load_torchrec_state_dict(osd)
    with pytest.raises(ValueError, match="column shard"):
        opt.copy_to_torchrec_state_dict(osd)


def test_torchrec_column_wise_state_refused(pool):
    pool.run(check_column_wise_refused)


def layout_rows(state, rank: int):
    return tdb.layout_of(state).shards_on(rank)


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad"])
def test_same_training_as_torchrec_fused(pool, kind):
    counts = pool.run(check_same_training, kind)
    assert sum(counts) >= (3 if kind == "sgd" else 6), counts
