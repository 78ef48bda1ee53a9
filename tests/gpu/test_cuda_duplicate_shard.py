"""One weight looked up for two features in one fused update on CUDA, repeated: the same result every time, and the
CPU's; skipped where there is no CUDA device. The fourth step of ``scripts/gpu_check.sh``.

The kernels hand such a call's shard to fbgemm twice, in one backward-with-update call. fbgemm's CUDA backward
sorts the ids by ``hash_size_cumsum[t] + id`` and updates each run of one key once; the copies must share one
offset (``kernels/copies.py``, as fbgemm's module's ``feature_table_map`` gives it), else one row is two runs,
updated by different warps at once, and updates are lost at random. CPU kernels apply the copies one after the
other, so no CPU test can see this (``tests/unit/test_table_listed_twice.py`` checks the arguments).

A 16-row table takes two features of 96 bags of 4 ids each per step, so that every row occurs about 24 times in
each feature (two runs of fbgemm's one-warp kernel, were the copies apart) and about 48 times in all (one run of
its one-block kernel, which sums a run in a fixed order; below the 1024 ids past which fbgemm splits a run over
blocks that add atomically). For each kind, on the whole table and on two row blocks of one storage, two steps:

* 20 repetitions on CUDA from the same table give bitwise the same table and optimizer state;
* those equal the same steps on CPU (the package's CPU kernels, checked against the unsharded reference by the
  unit tests) and the unsharded reference (``tests/distributed/sparse_reference.py``: ``F.embedding_bag`` twice
  over one table, the textbook update of the touched rows);
* with fbgemm-gpu's CUDA build installed, its backward-with-update op ran once per storage: both copies in one
  call, the case under test.
"""

from __future__ import annotations

import pytest
import torch

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.kernels import fbgemm
from torchrec_dtensor_bridge.layout import ShardLayout

from ..distributed.sparse_reference import SparseReference
from .tables import dtensors, scale, storages, table

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
SHAPE = (16, 16)
BAGS, PER_BAG = 96, 4
CASES = {  # layout, every block in one storage
    "whole": (ShardLayout.table_wise(SHAPE, 0), False),
    "row_blocks_one_storage": (ShardLayout.row_wise(SHAPE, [6, 10], ranks=[0, 0]), True),
}
KINDS = ["sgd", "rowwise_adagrad", "adagrad", "adam"]
HYPER = {"lr": 0.1, "eps": 1e-3, "beta1": 0.8, "beta2": 0.9}
STEPS = 2
REPEATS = 20
TOL = {"rtol": 1e-5, "atol": 1e-6}


def features(step: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two features' ``(ids, offsets)`` for ``step``: :data:`BAGS` bags of :data:`PER_BAG` ids each."""
    g = torch.Generator().manual_seed(1000 + step)
    offsets = torch.arange(0, BAGS * PER_BAG, PER_BAG)  # bag starts, as F.embedding_bag takes them
    return [(torch.randint(0, SHAPE[0], (BAGS * PER_BAG,), generator=g).to(device), offsets.to(device))
            for _ in range(2)]


def run(case: str, kind: str, device: torch.device) -> dict[str, torch.Tensor]:
    """The table and the optimizer state (on CPU) after :data:`STEPS` steps of one call looking the weight up for
    both features, on ``device``."""
    layout, shared = CASES[case]
    (weight,) = dtensors([layout.with_name("t")], [table(SHAPE, 5)], device, shared=shared)
    weight.requires_grad_()
    opt = tdb.FusedOptimizer({"t": weight}, kind, **HYPER)
    for step in range(STEPS):
        (ids0, off0), (ids1, off1) = features(step, device)
        outs = tdb.sharded_embedding_bags([ids0, ids1], [weight, weight], [off0, off1], mode="sum", optimizer=opt)
        sum((o * scale(o)).sum() for o in outs).backward()
        assert weight.grad is None, "a fused optimizer leaves no gradient"
    got = {"table": tdb.full_tensor(weight.detach()).cpu()}
    for key, value in opt.state_dict().items():
        got[key] = (tdb.full_tensor(value) if isinstance(value, torch.distributed.tensor.DTensor) else value).cpu()
    return got


def reference(kind: str) -> dict[str, torch.Tensor]:
    """:func:`run`'s result from the unsharded reference."""
    ref = SparseReference(table(SHAPE, 5), kind, **HYPER)
    for step in range(STEPS):
        batches = [{"input": ids, "offsets": offsets} for ids, offsets in features(step, CPU)]
        ref.train(batches, [scale(torch.zeros(BAGS, SHAPE[1])) for _ in batches])
    return {"table": ref.w, **ref.state("t")}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, **tol: float) -> None:
    """``got`` equals ``want`` key by key: bitwise without ``tol``, else within it."""
    assert sorted(got) == sorted(want), f"{what}: {sorted(got)} vs {sorted(want)}"
    for key in want:
        if tol:
            torch.testing.assert_close(got[key], want[key].to(got[key].dtype), **tol,
                                       msg=lambda m, key=key: f"{what}, {key}: {m}")
        else:
            diff = (got[key].double() - want[key].double()).abs().max().item()
            assert torch.equal(got[key], want[key]), f"{what}, {key}: differs (by up to {diff:g})"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_weight_listed_twice_is_deterministic_and_equals_cpu(groups, case, kind):
    backward = f"fbgemm::split_embedding_backward_codegen_{kind}_unweighted_pt2_wrapper"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        first = run(case, kind, CUDA)
        torch.cuda.synchronize()
    if fbgemm.cuda_available():
        calls = sum(e.name == backward for e in prof.events())
        want_calls = STEPS * storages([CASES[case][0]], shared=CASES[case][1])
        assert calls == want_calls, f"{calls} calls of {backward}: one per storage and step ({want_calls})"
    for repeat in range(1, REPEATS):
        assert_same(run(case, kind, CUDA), first, f"repetition {repeat} against the first")
    assert_same(first, run(case, kind, CPU), "CUDA against CPU", **TOL)
    assert_same(first, reference(kind), "CUDA against the unsharded reference", **TOL)
