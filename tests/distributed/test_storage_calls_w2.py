"""One kernel call per storage, on a real TorchRec fused module converted zero-copy (2 gloo ranks).

TorchRec keeps a rank's fused tables in ONE fbgemm buffer; ``state_dict_to_dtensor`` makes DTensors whose
shards are views of it. A training step of ours over those DTensors (``sharded_embedding_bags`` with a
``FusedOptimizer``) must make no more kernel calls than TorchRec's own step (one forward, one backward per
rank, counted by torch's profiler), give TorchRec's outputs, and leave TorchRec's weights.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.convert import local_shards_of
from torchrec_dtensor_bridge.convert.placements import world_mesh

from .checks import expect_raises
from .harness import make_pool_fixture
from .torchrec_models import build_ebc, random_kjt, seeded_tables, shard_fused

pool = make_pool_fixture(2)

TABLES = {f"t{i}": (40 + 7 * i, 8 * (1 + i % 3), "table_wise") for i in range(8)}
LR = 0.05
FORWARD = "fbgemm::split_embedding_codegen_forward_cpu"


def _fused_module(kind: str, world: int):
    from torchrec.distributed.sharding_plan import table_wise

    per_param = {n: table_wise(rank=i % world, compute_kernel="fused") for i, n in enumerate(TABLES)}
    module = shard_fused(build_ebc(TABLES, seed=1), per_param, kind, lr=LR, eps=1e-8)
    return module, {n: w.requires_grad_() for n, w in seeded_tables(module, TABLES).items()}


def _counts(prof) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith(("fbgemm::split_embedding", "tdb::")):
            out[e.name] = out.get(e.name, 0) + 1
    return out


def _scale(rank: int, key: str, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(hash((rank, key)) % 2**31))


def check_one_call_per_storage(rank: int, world: int, kind: str, impl: str) -> dict:
    os.environ["TDB_KERNELS"] = impl
    try:
        theirs, _ = _fused_module(kind, world)
        mine_module, weights = _fused_module(kind, world)
        homes = {s.untyped_storage().data_ptr() for w in weights.values() for s in local_shards_of(w) if s.numel()}
        assert len(homes) == 1, "TorchRec keeps a rank's fused tables in one buffer"
        opt = tdb.FusedOptimizer(weights, kind, lr=LR, eps=1e-8)
        kjt = random_kjt(TABLES, batch=6, seed=7 + rank)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof_theirs:
            a = theirs(kjt).wait().to_dict()
            sum((a[k] * _scale(rank, k, a[k].shape)).sum() for k in sorted(a)).backward()
        feats = [kjt[f"f_{n}"] for n in TABLES]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof_ours:
            outs = tdb.sharded_embedding_bags([f.values() for f in feats], list(weights.values()),
                                              [f.offsets() for f in feats], mode="sum", include_last_offset=True,
                                              optimizer=opt)
            # TorchRec divides embedding gradients by the world size (DDP's averaging): scale ours alike
            (sum((o * _scale(rank, f"f_{n}", o.shape)).sum() for n, o in zip(TABLES, outs)) / world).backward()
        for n, o in zip(TABLES, outs):
            torch.testing.assert_close(o, a[f"f_{n}"], rtol=0, atol=0, msg=lambda m, n=n: f"forward {n}: {m}")
        after = tdb.state_dict_to_dtensor(theirs.state_dict())
        for n, w in weights.items():
            torch.testing.assert_close(tdb.full_tensor(w), tdb.full_tensor(after[f"embedding_bags.{n}.weight"]),
                                       msg=lambda m, n=n: f"update {n}: {m}")
        return {"theirs": _counts(prof_theirs), "ours": _counts(prof_ours)}
    finally:
        os.environ.pop("TDB_KERNELS", None)


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad"])
def test_fbgemm_calls_no_more_than_torchrec(pool, kind):
    backward = f"fbgemm::split_embedding_backward_codegen_{kind}_cpu"
    for got in pool.run(check_one_call_per_storage, kind, "fbgemm"):
        theirs, ours = got["theirs"], got["ours"]
        assert theirs.get(FORWARD) == 1 and theirs.get(backward) == 1, theirs  # TorchRec: one per buffer
        assert ours.get(FORWARD) == 1 and ours.get(backward) == 1, ours
        assert ours.get("tdb::pool_sum") == 1 and ours.get("tdb::sparse_update") == 1, ours
        # the backward op CUDA calls too (fbgemm's CPU kernel under it), once: no second forward
        assert ours.get(f"fbgemm::split_embedding_backward_codegen_{kind}_unweighted_pt2_wrapper") == 1, ours


def check_dense_calls(rank: int, world: int) -> dict:
    """Our step without a fused optimizer over TorchRec's converted buffer (fbgemm's kernels): the profiler's
    counts, and the dense gradient of each table against autograd through ``F.embedding_bag``."""
    os.environ["TDB_KERNELS"] = "fbgemm"
    try:
        _, weights = _fused_module("sgd", world)
        kjt = random_kjt(TABLES, batch=6, seed=7 + rank)
        feats = [kjt[f"f_{n}"] for n in TABLES]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            outs = tdb.sharded_embedding_bags([f.values() for f in feats], list(weights.values()),
                                              [f.offsets() for f in feats], mode="sum", include_last_offset=True)
            sum((o * _scale(rank, f"f_{n}", o.shape)).sum() for n, o in zip(TABLES, outs)).backward()
        for i, (n, w) in enumerate(weights.items()):
            assert w.grad is not None, n
        return _counts(prof)
    finally:
        os.environ.pop("TDB_KERNELS", None)


def test_fbgemm_dense_path_one_forward_one_backward_per_storage(pool):
    """Without a fused optimizer: one fbgemm forward and one fbgemm dense backward per storage and step (its
    backward alone: no forward over a scratch)."""
    for ours in pool.run(check_dense_calls):
        assert ours.get(FORWARD) == 1, ours
        assert ours.get("fbgemm::split_embedding_backward_codegen_dense_cpu") == 1, ours
        assert ours.get("tdb::pool_sum") == 1 and ours.get("tdb::pool_sum_backward") == 1, ours


def test_native_one_op_call_per_storage(pool):
    for got in pool.run(check_one_call_per_storage, "rowwise_adagrad", "native"):
        ours = got["ours"]
        assert ours.get("tdb::pool_sum") == 1 and ours.get("tdb::sparse_update") == 1, ours
        assert not any(k.startswith("fbgemm::") for k in ours), ours


def check_output_sent_in_place(rank: int, world: int) -> list[bool]:
    """Per ``all_to_all_single`` of our forward: is its send buffer a view of the pooled result that this
    rank's own tables' outputs are column slices of? (A spy that calls the real collective.)"""
    theirs, _ = _fused_module("sgd", world)
    _, weights = _fused_module("sgd", world)
    kjt = random_kjt(TABLES, batch=6, seed=7 + rank)
    a = theirs(kjt).wait().to_dict()
    feats = [kjt[f"f_{n}"] for n in TABLES]
    sent: list[int] = []
    real = dist.all_to_all_single

    def spy(output, input, *args, **kwargs):
        sent.append(input.untyped_storage().data_ptr())
        return real(output, input, *args, **kwargs)

    dist.all_to_all_single = spy
    try:
        with torch.no_grad():
            outs = tdb.sharded_embedding_bags([f.values() for f in feats], list(weights.values()),
                                              [f.offsets() for f in feats], mode="sum", include_last_offset=True)
    finally:
        dist.all_to_all_single = real
    for n, o in zip(TABLES, outs):
        torch.testing.assert_close(o, a[f"f_{n}"], rtol=0, atol=0, msg=lambda m, n=n: f"forward {n}: {m}")
    own = {outs[i].untyped_storage().data_ptr() for i, n in enumerate(TABLES) if i % world == rank}
    assert len(own) == 1, "this rank's tables share one kernel call, so their outputs share its result"
    return [p in own for p in sent]


def test_forward_sends_the_kernel_result_in_place(pool):
    """The table-wise output exchange sends the rows other ranks need straight out of the one pooled result
    of this rank's tables (no copy into a send buffer); outputs equal TorchRec's."""
    for rank, in_place in enumerate(pool.run(check_output_sent_in_place)):
        assert in_place.count(True) == 1, f"rank {rank}: send buffers in place: {in_place}"


def check_row_wise_output_sent_in_place(rank: int, world: int, tables: dict) -> list[bool]:
    """Per ``all_to_all_single`` of our row-wise forward: is its send buffer the pooled result of this rank's
    row blocks (the kernel's output, which the message adopts)? Outputs equal TorchRec's, bit for bit (two
    partial sums per bag: their sum does not depend on the order)."""
    from torchrec.distributed.sharding_plan import row_wise

    import torchrec_dtensor_bridge.lookup.function as function

    per_param = {n: row_wise(compute_kernel="fused") for n in tables}
    theirs = shard_fused(build_ebc(tables, seed=1), per_param, "sgd", lr=LR, eps=1e-8)
    ours = shard_fused(build_ebc(tables, seed=1), per_param, "sgd", lr=LR, eps=1e-8)
    seeded_tables(theirs, tables)
    weights = {n: w.requires_grad_() for n, w in seeded_tables(ours, tables).items()}
    kjt = random_kjt(tables, batch=6, seed=7 + rank)
    a = theirs(kjt).wait().to_dict()
    feats = [kjt[f"f_{n}"] for n in tables]
    sent: list[int] = []
    pooled: list[int] = []
    real_a2a, real_pool = dist.all_to_all_single, function.pool

    def spy_a2a(output, input, *args, **kwargs):
        sent.append(input.untyped_storage().data_ptr())
        return real_a2a(output, input, *args, **kwargs)

    def spy_pool(requests):
        got = real_pool(requests)
        pooled.extend(out.untyped_storage().data_ptr() for out, _ in got)
        return got

    dist.all_to_all_single, function.pool = spy_a2a, spy_pool
    try:
        with torch.no_grad():
            outs = tdb.sharded_embedding_bags([f.values() for f in feats], list(weights.values()),
                                              [f.offsets() for f in feats], mode="sum", include_last_offset=True)
    finally:
        dist.all_to_all_single, function.pool = real_a2a, real_pool
    for n, o in zip(tables, outs):
        torch.testing.assert_close(o, a[f"f_{n}"], rtol=0, atol=0, msg=lambda m, n=n: f"forward {n}: {m}")
    return [p in set(pooled) for p in sent]


@pytest.mark.parametrize("several", [True, False], ids=["eight_tables", "one_table"])
def test_row_wise_forward_sends_the_kernel_result_in_place(pool, several):
    """Row-wise tables in one storage (TorchRec's fused buffer, eight tables of three widths): the partial sums
    of all of them travel straight out of the one pooled result, no copy into a message; one table likewise.
    Outputs equal TorchRec's."""
    tables = {n: (r, d, "row_wise") for n, (r, d, _) in TABLES.items()} if several else {"t0": (41, 8, "row_wise")}
    for rank, in_place in enumerate(pool.run(check_row_wise_output_sent_in_place, tables)):
        assert in_place.count(True) == 1, f"rank {rank}: send buffers in place: {in_place}"


def check_shared_state_round_trip(rank: int, world: int, kind: str, root: str) -> None:
    """The state of tables sharing a storage lives in one buffer per storage (one kernel call updates it),
    yet ``state_dict()`` gives one DTensor per table that checkpoints and loads into another layout."""
    _, weights = _fused_module("sgd", world)
    opt = tdb.FusedOptimizer(weights, kind, lr=LR, eps=1e-8)
    kjt = random_kjt(TABLES, batch=6, seed=3 + rank)
    feats = [kjt[f"f_{n}"] for n in TABLES]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        outs = tdb.sharded_embedding_bags([f.values() for f in feats], list(weights.values()),
                                          [f.offsets() for f in feats], mode="sum", include_last_offset=True,
                                          optimizer=opt)
        sum(o.square().sum() for o in outs).backward()
    assert _counts(prof).get("tdb::sparse_update") == 1
    sd = opt.state_dict()
    states = [v for k, v in sd.items() if k.endswith("momentum1")]
    assert len(states) == len(TABLES)
    homes = {s.untyped_storage().data_ptr() for v in states for s in local_shards_of(v) if s.numel()}
    assert len(homes) == 1, "one state buffer for the tables of one storage"
    assert any(bool((s != 0).any()) for v in states for s in local_shards_of(v)), "the step wrote state"
    tdb.checkpoint.save(sd, f"{root}/opt")
    mesh = world_mesh("cpu")
    rowwise = {n: distribute_tensor(torch.zeros(r, d), mesh, [Shard(0)]).requires_grad_()
               for n, (r, d, _) in TABLES.items()}
    other = tdb.FusedOptimizer(rowwise, kind, lr=LR, eps=1e-8)
    into = other.state_dict()
    tdb.checkpoint.load(into, f"{root}/opt")
    other.load_state_dict(into)
    for key, value in sd.items():
        torch.testing.assert_close(tdb.full_tensor(other.state_dict()[key]), tdb.full_tensor(value),
                                   rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")
    before = {k: tdb.full_tensor(v) for k, v in sd.items()}
    with torch.no_grad():
        for v in states:
            for s in local_shards_of(v):
                s.zero_()
    back = opt.state_dict()
    tdb.checkpoint.load(back, f"{root}/opt")  # in place, into the shared buffer
    opt.load_state_dict(back)
    for key, value in opt.state_dict().items():
        assert torch.equal(tdb.full_tensor(value), before[key]), key
    homes = {s.untyped_storage().data_ptr() for k, v in opt.state_dict().items() if k.endswith("momentum1")
             for s in local_shards_of(v) if s.numel()}
    assert len(homes) == 1, "still one buffer after loading"


@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adagrad"])
def test_shared_state_round_trip(pool, kind, tmp_path):
    pool.run(check_shared_state_round_trip, kind, str(tmp_path / kind))


def check_bad_inputs_raise_everywhere(rank: int, world: int) -> int:
    """What the kernels' boundary refuses (an id past its table, per-sample weights of the wrong length, an
    optimizer state that no longer fits its table) is found before the agreement: given on the last rank
    only, every rank raises, naming the table, and no rank updated anything; with either kernel kind."""
    last = rank == world - 1
    others = f"rank {world - 1} rejected"
    kjt = random_kjt(TABLES, batch=6, seed=11 + rank)
    feats = [kjt[f"f_{n}"] for n in TABLES]
    ids, offsets = [f.values() for f in feats], [f.offsets() for f in feats]
    n = 0
    for impl in ("native", "fbgemm"):
        os.environ["TDB_KERNELS"] = impl
        try:
            _, weights = _fused_module("rowwise_adagrad", world)
            opt = tdb.FusedOptimizer(weights, "rowwise_adagrad", lr=LR, eps=1e-8)
            before = {k: [s.clone() for s in local_shards_of(v)]
                      for k, v in {**weights, **opt.state_dict()}.items()}

            def step(ids=ids, psw=None) -> None:
                outs = tdb.sharded_embedding_bags(ids, list(weights.values()), offsets, mode="sum",
                                                  per_sample_weights=psw, include_last_offset=True,
                                                  optimizer=opt, names=list(TABLES))
                sum(o.square().sum() for o in outs).backward()

            past = [i.clone() for i in ids]
            if last:
                past[3][0] = TABLES["t3"][0]
            expect_raises(ValueError, "(table 't3'): input holds id" if last else others, lambda: step(past))
            psw = [torch.ones(i.numel()) for i in ids]
            if last:
                psw[2] = psw[2][:-1]
            expect_raises(ValueError, "(table 't2'): per_sample_weights" if last else others,
                          lambda: step(psw=psw))
            table = opt._tables["t5"]  # damaged on purpose: the state the kernels would write unchecked
            saved = list(table.row_states)
            if last:
                table.row_states[0] = saved[0][:-1]
            expect_raises(ValueError, "the optimizer's state 't5.momentum1' on this rank no longer fits" if last
                          else others, step)
            table.row_states = saved
            for k, v in {**weights, **opt.state_dict()}.items():
                for got, want in zip(local_shards_of(v), before[k]):
                    assert torch.equal(got, want), f"{impl}: {k} modified by a refused step"
            step()  # the group is still in step
            n += 3
        finally:
            os.environ.pop("TDB_KERNELS", None)
    return n


def test_bad_inputs_raise_on_every_rank_before_any_kernel(pool):
    assert pool.run(check_bad_inputs_raise_everywhere) == [6, 6]
