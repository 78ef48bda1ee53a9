"""The lookups on CUDA shards (one GPU, a one-rank group: NCCL for CUDA tensors, gloo for CPU ones); skipped
where there is no CUDA device. Not run on a GPU yet: the CPU-side checks of these call sites are
``tests/unit/test_fake_cuda.py`` (fake CUDA tensors) and ``tests/unit/test_kernel_ops.py``. fp16 tables, tables
wider than fbgemm's CUDA kernels take, and strided per-sample weights: ``test_cuda_tables.py``.

* Every layout a single rank can hold (several row blocks, several column blocks, a grid, the whole table;
  column widths fbgemm's CUDA kernels read, multiples of 4, and widths they do not, which take torch's ops)
  against ``F.embedding_bag`` on the full table on the same device: outputs and ``weight.grad``.
* Tables sharing one storage (as TorchRec's fused buffer: every shard a view of one CUDA tensor) in one call.
* The fused optimizers (sgd, rowwise_adagrad, adagrad, adam), on separate storages and on one shared storage:
  the same steps on the same tables on CPU (whose updates the distributed tests check against independent
  references) give the same weights.
* With fbgemm_gpu's CUDA build installed, its lookup functions are what runs (the profiler names them), once
  per storage (``tables.storages``; ``tests/unit/test_gpu_call_counts.py`` checks the count on CPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchrec_dtensor_bridge.layout import ShardLayout

from .tables import batch as _batch
from .tables import dtensors, storages
from .tables import table as _table

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

SHAPE = (23, 12)
WIDE = (23, 16)  # columns cut at multiples of 4: rows fbgemm's CUDA kernels read
LAYOUTS = {
    "row_blocks": ShardLayout.row_wise(SHAPE, [7, 10, 6], ranks=[0, 0, 0]),
    "column_blocks": ShardLayout.column_wise(SHAPE, [5, 7], ranks=[0, 0]),
    "grid": ShardLayout.grid(SHAPE, [11, 12], [6, 6], [0, 0, 0, 0]),
    "whole": ShardLayout.table_wise(SHAPE, 0),
    "row_blocks_wide": ShardLayout.row_wise(WIDE, [7, 10, 6], ranks=[0, 0, 0]),
    "column_blocks_wide": ShardLayout.column_wise(WIDE, [4, 12], ranks=[0, 0]),
    "grid_wide": ShardLayout.grid(WIDE, [11, 12], [8, 8], [0, 0, 0, 0]),
    "whole_wide": ShardLayout.table_wise(WIDE, 0),
}
SHARED = ["row_blocks_wide", "column_blocks_wide", "grid_wide", "whole_wide"]  # tables of one storage
KINDS = ["sgd", "rowwise_adagrad", "adagrad", "adam"]
HYPER = {"lr": 0.1, "eps": 1e-3, "beta1": 0.8, "beta2": 0.9}
CUDA = torch.device("cuda", 0)


def _weights(names: list[str], tables: list[torch.Tensor], device: torch.device, shared: bool) -> list:
    return dtensors([LAYOUTS[n].with_name(n) for n in names], tables, device, shared=shared)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("psw", [False, True])
def test_cuda_lookup_parity(groups, name, mode, psw):
    import torchrec_dtensor_bridge as tdb

    if psw and mode != "sum":
        pytest.skip("per_sample_weights: sum pooling only")
    layout = LAYOUTS[name]
    table = _table(layout.global_shape, 3).to(CUDA)
    (weight,) = _weights([name], [table.cpu()], CUDA, shared=False)
    weight.requires_grad_()
    ids, offsets = _batch(layout.global_shape[0], 4, CUDA)
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(5)).to(CUDA) if psw else None
    out = tdb.sharded_embedding_bag(ids, weight, offsets, mode=mode, per_sample_weights=weights)
    full = table.clone().requires_grad_()
    ref = F.embedding_bag(ids, full, offsets, mode=mode, per_sample_weights=weights)
    assert out.device == ref.device
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.linspace(-1, 1, ref.numel(), device=CUDA).view_as(ref)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(tdb.full_tensor(weight.grad), full.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["sum", "max"])
def test_cuda_tables_sharing_a_storage(groups, mode):
    """Several tables whose shards are views of one CUDA storage, in one call: outputs and gradients."""
    import torchrec_dtensor_bridge as tdb

    tables = [_table(LAYOUTS[n].global_shape, 10 + t) for t, n in enumerate(SHARED)]
    weights = [w.requires_grad_() for w in _weights(SHARED, tables, CUDA, shared=True)]
    batches = [_batch(LAYOUTS[n].global_shape[0], 20 + t, CUDA) for t, n in enumerate(SHARED)]
    outs = tdb.sharded_embedding_bags([b[0] for b in batches], weights, [b[1] for b in batches], mode=mode)
    fulls = [t.to(CUDA).requires_grad_() for t in tables]
    refs = [F.embedding_bag(b[0], f, b[1], mode=mode) for b, f in zip(batches, fulls)]
    for n, o, r in zip(SHARED, outs, refs):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    scales = [torch.linspace(-1, 1, r.numel(), device=CUDA).view_as(r) for r in refs]
    sum((o * s).sum() for o, s in zip(outs, scales)).backward()
    sum((r * s).sum() for r, s in zip(refs, scales)).backward()
    for n, w, f in zip(SHARED, weights, fulls):
        torch.testing.assert_close(tdb.full_tensor(w.grad), f.grad, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, n=n: f"{n}: {m}")


def _train(names: list[str], kind: str, device: torch.device, shared: bool, steps: int = 2) -> list[torch.Tensor]:
    """The full tables after ``steps`` fused-optimizer steps of one call over all ``names`` on ``device``."""
    import torchrec_dtensor_bridge as tdb

    tables = [_table(LAYOUTS[n].global_shape, 30 + t) for t, n in enumerate(names)]
    weights = [w.requires_grad_() for w in _weights(names, tables, device, shared)]
    opt = tdb.FusedOptimizer(weights, kind, **HYPER)
    for step in range(steps):
        batches = [_batch(LAYOUTS[n].global_shape[0], 100 * step + t, device) for t, n in enumerate(names)]
        outs = tdb.sharded_embedding_bags([b[0] for b in batches], weights, [b[1] for b in batches], mode="sum",
                                          optimizer=opt)
        scales = [torch.linspace(-1, 1, o.numel(), device=device).view_as(o) for o in outs]
        sum((o * s).sum() for o, s in zip(outs, scales)).backward()
    assert all(w.grad is None for w in weights), "a fused optimizer leaves no gradient"
    return [tdb.full_tensor(w).cpu() for w in weights]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shared", [False, True], ids=["own_storages", "one_storage"])
def test_cuda_fused_optimizer_equals_cpu(groups, kind, shared):
    names = SHARED if shared else sorted(LAYOUTS)
    got = _train(names, kind, CUDA, shared)
    want = _train(names, kind, torch.device("cpu"), shared)
    for n, g, w in zip(names, got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n} ({kind}): {m}")


@pytest.mark.parametrize("kind", [None, *KINDS])
def test_fbgemm_cuda_kernels_run(groups, kind):
    """With fbgemm_gpu's CUDA build, its kernels are what runs on shards they read: the lookup function's forward,
    then its backward alone (no second forward), one call of each per storage (three blocks in storages of their
    own: three)."""
    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.kernels import fbgemm

    if not fbgemm.cuda_available():
        pytest.skip("fbgemm_gpu's CUDA build is not installed")
    names = ["row_blocks_wide"]
    calls = storages([LAYOUTS[n] for n in names], shared=False)
    (weight,) = _weights(names, [_table(WIDE, 7)], CUDA, shared=False)
    weight.requires_grad_()
    opt = None if kind is None else tdb.FusedOptimizer([weight], kind, **HYPER)
    ids, offsets = _batch(WIDE[0], 8, CUDA)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = tdb.sharded_embedding_bag(ids, weight, offsets, mode="sum", optimizer=opt)
        out.sum().backward()
        torch.cuda.synchronize()
    names_seen = {e.name for e in prof.events()}
    want = ("fbgemm::split_embedding_backward_codegen_dense_unweighted_exact_cuda" if kind is None
            else f"fbgemm::split_embedding_backward_codegen_{kind}_unweighted_pt2_wrapper")
    assert want in names_seen, sorted(n for n in names_seen if "fbgemm" in n or "tdb" in n)
    backwards = [e for e in prof.events() if e.name == want]
    assert len(backwards) == calls, f"{len(backwards)} calls of {want}: one per storage ({calls})"
    forwards = [e for e in prof.events() if e.name == "fbgemm::split_embedding_codegen_lookup_sgd_function_pt2"]
    assert len(forwards) == calls, f"{len(forwards)} forwards: one per storage ({calls}), none in the backward"
