"""fp16 and bf16 tables with per-sample weights, on CPU (a one-rank gloo group), on every implementation of the
kernel ops: ``TDB_KERNELS=torch`` is what CUDA falls back to for tables fbgemm's CUDA kernels cannot read.

The ops take fp32 per-sample weights and pool half-precision rows in fp32; torch's implementation
(``kernels/reference.py``) once handed those fp32 weights to ``torch.embedding_bag`` over the half-precision table,
which refuses them. Expectations: the unsharded ``F.embedding_bag`` on the same table and weights (output,
``weight.grad``, the per-sample weights' gradient), within the dtype's resolution.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.kernels import fbgemm
from torchrec_dtensor_bridge.layout import ShardLayout

from ..gpu.tables import batch, dtensors, exact_table, scale

CPU = torch.device("cpu")
SHAPE = (23, 16)
LAYOUTS = {
    "row_blocks": ShardLayout.row_wise(SHAPE, [7, 10, 6], ranks=[0, 0, 0]),
    "column_blocks": ShardLayout.column_wise(SHAPE, [4, 12], ranks=[0, 0]),
    "whole": ShardLayout.table_wise(SHAPE, 0),
}
TOL = {torch.float16: {"rtol": 1e-3, "atol": 1e-3}, torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2}}


pytestmark = pytest.mark.usefixtures("own_kernel_choices")


@pytest.mark.parametrize("impl", ["torch", "native", "fbgemm"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_half_table_with_per_sample_weights(one_rank, monkeypatch, name, dtype, impl):
    if impl == "fbgemm" and not fbgemm.available():
        pytest.skip("needs fbgemm_gpu")
    monkeypatch.setenv("TDB_KERNELS", impl)
    full = exact_table(SHAPE, 4).to(dtype)
    (weight,) = dtensors([LAYOUTS[name].with_name("t")], [full], CPU, shared=False)
    weight.requires_grad_()
    ids, offsets = batch(SHAPE[0], 5, CPU)
    psw = ((torch.arange(ids.numel()) % 4 + 1) / 4).to(dtype)  # 0.25 .. 1: exact in both dtypes
    mine, theirs = psw.clone().requires_grad_(), psw.clone().requires_grad_()
    out = tdb.sharded_embedding_bag(ids, weight, offsets, mode="sum", per_sample_weights=mine)
    ref_weight = full.clone().requires_grad_()
    ref = F.embedding_bag(ids, ref_weight, offsets, mode="sum", per_sample_weights=theirs)
    assert out.dtype == ref.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])
    (out * scale(out)).sum().backward()
    (ref * scale(ref)).sum().backward()
    torch.testing.assert_close(tdb.full_tensor(weight.grad), ref_weight.grad, **TOL[dtype])
    torch.testing.assert_close(mine.grad, theirs.grad, **TOL[dtype])


def test_pool_sum_op_half_rows_fp32_weights(monkeypatch):
    """``tdb::pool_sum`` on torch's implementation: fp16 rows, fp32 per-sample weights (the ops' form), summed in
    fp32 as on the fp32 copy of the table."""
    monkeypatch.setenv("TDB_KERNELS", "torch")
    g = torch.Generator().manual_seed(2)
    rows = exact_table((20, 8), 1).half()
    ids = torch.randint(0, 20, (12,), generator=g)
    offsets = torch.tensor([0, 3, 3, 7, 12])
    psw = torch.rand(12, generator=g)
    got = torch.ops.tdb.pool_sum(rows.view(-1), [0], [8], [20], ids, offsets, psw)
    want = F.embedding_bag(ids, rows.float(), offsets[:-1], mode="sum", per_sample_weights=psw)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)
