"""Tables at the edges of what fbgemm's CUDA kernels take, on CUDA shards (one GPU, a one-rank group); skipped
where there is no CUDA device. Not run on a GPU yet. Every expectation comes from plain torch on the unsharded
table (``F.embedding_bag``, autograd, the textbook updates of ``tests/distributed/sparse_reference.py``).

* fp16 and bf16 tables (fbgemm's CUDA kernels for sums, torch's ops for mean and max): lookups and
  ``weight.grad`` against ``F.embedding_bag`` on the full table, on every single-rank layout, within the
  dtype's tolerance.
* Tables wider than 2048 columns (fbgemm's CUDA kernels refuse ``max_D > 2048``): a 4096-wide table whole, in
  row blocks, in column blocks of which one is wider than 2048 and one is not, and beside a narrow table in
  one storage (the storage's widest table sets ``max_D``): lookups and ``weight.grad`` against
  ``F.embedding_bag``, and two fused-optimizer steps against the unsharded reference optimizer.
* Strided (non-contiguous) per-sample weights: the output, ``weight.grad``, the per-sample weights' gradient
  and a fused update all equal those of the same weights made contiguous (and ``F.embedding_bag``'s).
* A table in unified memory (fbgemm's managed and host-mapped allocations, as TorchRec's ``MANAGED`` /
  ``MANAGED_CACHING`` tables): refused, naming the table.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.layout import ShardLayout

from ..distributed.sparse_reference import SparseReference
from .tables import batch, dtensors, exact_table, scale, table

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = torch.device("cuda", 0)
HYPER = {"lr": 0.1, "eps": 1e-3, "beta1": 0.8, "beta2": 0.9}
KINDS = ["sgd", "rowwise_adagrad", "adagrad", "adam"]
FP16_TOL = {"rtol": 1e-3, "atol": 1e-3}  # fp16's resolution near 1 (2**-10); sums of exact_table are exact

NARROW = (23, 16)
FP16 = {
    "row_blocks": ShardLayout.row_wise(NARROW, [7, 10, 6], ranks=[0, 0, 0]),
    "column_blocks": ShardLayout.column_wise(NARROW, [4, 12], ranks=[0, 0]),
    "grid": ShardLayout.grid(NARROW, [11, 12], [8, 8], [0, 0, 0, 0]),
    "whole": ShardLayout.table_wise(NARROW, 0),
}
WIDE = (23, 4096)
WIDE_LAYOUTS = {
    "whole": ShardLayout.table_wise(WIDE, 0),
    "row_blocks": ShardLayout.row_wise(WIDE, [7, 10, 6], ranks=[0, 0, 0]),
    "column_blocks": ShardLayout.column_wise(WIDE, [1024, 3072], ranks=[0, 0]),  # 1024 fits fbgemm, 3072 not
}
PSW_LAYOUTS = {  # fbgemm's path (widths multiples of 4) and torch's (width 12)
    "whole": ShardLayout.table_wise(NARROW, 0),
    "row_blocks": ShardLayout.row_wise(NARROW, [7, 10, 6], ranks=[0, 0, 0]),
    "column_blocks": ShardLayout.column_wise(NARROW, [4, 12], ranks=[0, 0]),
    "whole_unaligned": ShardLayout.table_wise((23, 12), 0),
}


def _lookup_and_grad(layout: ShardLayout, full: torch.Tensor, mode: str, psw: torch.Tensor | None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ours and ``F.embedding_bag`` on ``full`` (on CUDA, its dtype): outputs, then weight gradients after
    ``(out * scale(out)).sum().backward()``."""
    (weight,) = dtensors([layout.with_name("t")], [full.cpu()], CUDA, shared=False)
    weight.requires_grad_()
    ids, offsets = batch(full.shape[0], 4, CUDA)
    weights = None if psw is None else psw.to(full.dtype)
    out = tdb.sharded_embedding_bag(ids, weight, offsets, mode=mode, per_sample_weights=weights)
    ref_table = full.clone().requires_grad_()
    ref = F.embedding_bag(ids, ref_table, offsets, mode=mode, per_sample_weights=weights)
    (out * scale(out)).sum().backward()
    (ref * scale(ref)).sum().backward()
    assert ref_table.grad is not None
    return out, ref, tdb.full_tensor(weight.grad), ref_table.grad


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(FP16))
@pytest.mark.parametrize("mode", ["sum", "mean", "max", "sum_psw"])
def test_half_lookup_and_grad(groups, name, mode, dtype):
    layout = FP16[name]
    full = exact_table(NARROW, 3).to(CUDA, dtype)
    psw = (torch.arange(30, device=CUDA) % 5 - 2).float() / 4 if mode == "sum_psw" else None  # exact in fp16
    psw = None if psw is None else psw.to(dtype)
    out, ref, grad, ref_grad = _lookup_and_grad(layout, full, mode.removesuffix("_psw"), psw)
    assert out.dtype == ref.dtype == dtype and out.device == ref.device
    tol = FP16_TOL if dtype == torch.float16 else {"rtol": 1e-2, "atol": 1e-2}  # bf16: 2**-7 near 1
    torch.testing.assert_close(out, ref, **tol)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, ref_grad, **tol)


@pytest.mark.parametrize("name", sorted(WIDE_LAYOUTS))
@pytest.mark.parametrize("mode", ["sum", "mean", "max", "sum_psw"])
def test_wide_table_lookup_and_grad(groups, name, mode):
    full = table(WIDE, 5).to(CUDA)
    psw = torch.rand(30, generator=torch.Generator().manual_seed(6)).to(CUDA) if mode == "sum_psw" else None
    out, ref, grad, ref_grad = _lookup_and_grad(WIDE_LAYOUTS[name], full, mode.removesuffix("_psw"), psw)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)


def _train_against_reference(layouts: list[ShardLayout], kind: str, *, shared: bool, steps: int = 2) -> None:
    """``steps`` fused-optimizer steps of one call over all ``layouts`` on CUDA, and the same steps of the
    unsharded reference optimizer on CPU: the same tables after each step."""
    fulls = [table(lay.global_shape, 30 + t) for t, lay in enumerate(layouts)]
    names = [f"t{t}" for t in range(len(layouts))]
    weights = [w.requires_grad_() for w in dtensors([lay.with_name(n) for lay, n in zip(layouts, names)], fulls,
                                                    CUDA, shared=shared)]
    refs = [SparseReference(f, kind, **HYPER) for f in fulls]
    opt = tdb.FusedOptimizer(weights, kind, **HYPER)
    for step in range(steps):
        batches = [batch(lay.global_shape[0], 100 * step + t, CUDA) for t, lay in enumerate(layouts)]
        outs = tdb.sharded_embedding_bags([b[0] for b in batches], weights, [b[1] for b in batches], mode="sum",
                                          optimizer=opt)
        sum((o * scale(o)).sum() for o in outs).backward()
        assert all(w.grad is None for w in weights), "a fused optimizer leaves no gradient"
        for ref, (ids, offsets), o in zip(refs, batches, outs):
            ref.train([{"input": ids.cpu(), "offsets": offsets.cpu()}], [scale(o).cpu()])
        for n, w, ref in zip(names, weights, refs):
            torch.testing.assert_close(tdb.full_tensor(w).cpu(), ref.w, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=n: f"{n} ({kind}, step {step}): {m}")


@pytest.mark.parametrize("name", sorted(WIDE_LAYOUTS))
@pytest.mark.parametrize("kind", KINDS)
def test_wide_table_fused_update(groups, name, kind):
    _train_against_reference([WIDE_LAYOUTS[name]], kind, shared=False)


@pytest.mark.parametrize("kind", KINDS)
def test_wide_and_narrow_tables_in_one_storage(groups, kind):
    """A 4096-wide table and a 16-wide one as views of one CUDA storage, looked up and updated in one call."""
    _train_against_reference([WIDE_LAYOUTS["whole"], FP16["whole"]], kind, shared=True)


def _strided(values: torch.Tensor) -> torch.Tensor:
    """``values`` as a non-contiguous view (every third element of a larger CUDA buffer)."""
    buffer = torch.full((values.numel(), 3), float("nan"), device=CUDA)
    buffer[:, 1] = values.to(CUDA)
    view = buffer[:, 1]
    assert not view.is_contiguous() and view.stride() == (3,)
    return view


def _psw_run(layout: ShardLayout, psw: torch.Tensor, kind: str | None) -> dict[str, torch.Tensor]:
    """One lookup (and backward, with ``kind``'s fused update when given) with per-sample weights ``psw``."""
    (weight,) = dtensors([layout.with_name("t")], [table(layout.global_shape, 7)], CUDA, shared=False)
    weight.requires_grad_()
    opt = None if kind is None else tdb.FusedOptimizer([weight], kind, **HYPER)
    psw.requires_grad_(kind is None)
    ids, offsets = batch(layout.global_shape[0], 8, CUDA)
    out = tdb.sharded_embedding_bag(ids, weight, offsets, mode="sum", per_sample_weights=psw, optimizer=opt)
    (out * scale(out)).sum().backward()
    got = {"out": out.detach(), "weight": tdb.full_tensor(weight.detach())}
    if kind is None:
        assert weight.grad is not None and psw.grad is not None
        got |= {"weight.grad": tdb.full_tensor(weight.grad), "psw.grad": psw.grad}
    return got


@pytest.mark.parametrize("name", sorted(PSW_LAYOUTS))
@pytest.mark.parametrize("kind", [None, "sgd", "rowwise_adagrad"])
def test_strided_per_sample_weights_equal_contiguous(groups, name, kind):
    layout = PSW_LAYOUTS[name]
    values = torch.rand(30, generator=torch.Generator().manual_seed(9))
    strided = _strided(values)
    contiguous = values.to(CUDA)
    got, want = _psw_run(layout, strided, kind), _psw_run(layout, contiguous, kind)
    assert got.keys() == want.keys()
    for key in got:
        torch.testing.assert_close(got[key], want[key], msg=lambda m, key=key: f"{key}: {m}")
    ids, offsets = batch(layout.global_shape[0], 8, CUDA)
    ref = F.embedding_bag(ids, table(layout.global_shape, 7).to(CUDA), offsets, mode="sum",
                          per_sample_weights=contiguous.detach())
    torch.testing.assert_close(got["out"], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("memory", ["managed", "host_mapped"])
def test_table_in_unified_memory_refused(groups, memory):
    """A table whose rows fbgemm allocated in unified memory (TorchRec's ``EmbeddingLocation.MANAGED`` /
    ``MANAGED_CACHING``): fbgemm's ``is_uvm_tensor`` finds it, and the lookup refuses it, naming the table."""
    from torchrec_dtensor_bridge import kernels
    from torchrec_dtensor_bridge.convert import dtensor_from_local_shards
    from torchrec_dtensor_bridge.kernels import fbgemm

    if not fbgemm.cuda_available():
        pytest.skip("fbgemm_gpu's CUDA build is not installed")
    shape = (20, 8)
    prototype = torch.empty(0, device=CUDA)
    rows = (torch.ops.fbgemm.new_managed_tensor(prototype, list(shape)) if memory == "managed"
            else torch.ops.fbgemm.new_unified_tensor(prototype, list(shape), True))
    rows.copy_(table(shape, 3).to(CUDA))
    assert kernels.in_unified_memory(rows) and not kernels.in_unified_memory(rows.clone())
    weight = dtensor_from_local_shards(ShardLayout.table_wise(shape, 0).with_name("uvm_table"), [rows])
    ids, offsets = batch(shape[0], 2, CUDA)
    with pytest.raises(NotImplementedError, match="table 'uvm_table' has rows in CUDA unified memory"):
        tdb.sharded_embedding_bag(ids, weight, offsets, mode="sum")
