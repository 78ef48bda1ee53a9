"""One weight looked up for two features of one call with a fused optimizer, on CPU (a one-rank gloo group).

The unsharded reference (``tests/distributed/sparse_reference.py``: ``F.embedding_bag`` twice over one table,
autograd, the textbook update of the rows touched) updates each row once with the two features' gradients summed.
Every way the package updates (ours, fbgemm's CPU kernels, the torch-op math) must give the same table: the kernel
layer folds a table listed twice in one ``tdb::sparse_update`` into one (``kernels/copies.py``; on CUDA the copies
share one ``hash_size_cumsum`` offset: ``test_fake_cuda_copies.py``), and the lookups count Adam's step once per
weight. Also: tables that overlap without being one table are refused by the op.
"""

from __future__ import annotations

import pytest
import torch

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.kernels import fbgemm
from torchrec_dtensor_bridge.layout import ShardLayout

from ..distributed.sparse_reference import SparseReference
from ..gpu.tables import batch, dtensors, table

CPU = torch.device("cpu")
SHAPE = (24, 16)
LAYOUTS = {
    "row_blocks": ShardLayout.row_wise(SHAPE, [10, 14], ranks=[0, 0]),
    "column_blocks": ShardLayout.column_wise(SHAPE, [8, 8], ranks=[0, 0]),  # row-wise kinds: the exchange path
}
KINDS = ["sgd", "rowwise_adagrad", "adagrad", "adam"]
HYPER = {"lr": 0.1, "eps": 1e-3, "beta1": 0.8, "beta2": 0.9}


pytestmark = pytest.mark.usefixtures("own_kernel_choices")


CASES = [("row_blocks", False), ("row_blocks", True), ("column_blocks", False)]  # True: every block in one storage


@pytest.mark.parametrize("impl", ["native", "fbgemm", "torch"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("name", "shared"), CASES, ids=[f"{n}-{'one' if s else 'own'}_storage" for n, s in CASES])
def test_weight_listed_twice_equals_unsharded_reference(one_rank, monkeypatch, name, kind, impl, shared):
    if impl == "fbgemm" and not fbgemm.available():
        pytest.skip("needs fbgemm_gpu")
    monkeypatch.setenv("TDB_KERNELS", impl)
    full = table(SHAPE, 1)
    (weight,) = dtensors([LAYOUTS[name].with_name("t")], [full], CPU, shared=shared)
    weight.requires_grad_()
    opt = tdb.FusedOptimizer([weight], kind, **HYPER)
    ref = SparseReference(full, kind, **HYPER)
    for step in range(2):
        first, second = batch(SHAPE[0], 10 + step, CPU), batch(SHAPE[0], 20 + step, CPU)
        outs = tdb.sharded_embedding_bags([first[0], second[0]], [weight, weight], [first[1], second[1]], mode="sum",
                                          optimizer=opt)
        scales = [torch.linspace(-1, 1, o.numel()).view_as(o) for o in outs]
        sum((o * s).sum() for o, s in zip(outs, scales)).backward()
        ref.train([{"input": first[0], "offsets": first[1]}, {"input": second[0], "offsets": second[1]}], scales)
    torch.testing.assert_close(tdb.full_tensor(weight).detach(), ref.w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["native", "fbgemm"])
def test_op_folds_a_table_listed_twice(monkeypatch, impl):
    """``tdb::sparse_update`` with one table listed twice (and another between them) equals one listing of it
    with both listings' bags."""
    if impl == "fbgemm" and not fbgemm.available():
        pytest.skip("needs fbgemm_gpu")
    monkeypatch.setenv("TDB_KERNELS", impl)
    g = torch.Generator().manual_seed(3)
    rows, dim, bags = 12, 4, 3
    storage = torch.randn(2 * rows * dim, generator=g)
    state = torch.zeros(2 * rows)
    ids = torch.randint(0, rows, (18,), generator=g)
    offsets = torch.tensor([0, 2, 5, 6, 8, 10, 12, 14, 16, 18])  # three tables of three bags
    grad = torch.randn(bags, 3 * dim, generator=g)
    twice = storage.clone(), state.clone()
    torch.ops.tdb.sparse_update(twice[0], [0, rows * dim, 0], [dim] * 3, [rows] * 3, grad, ids, offsets, None,
                                "rowwise_adagrad", twice[1], [0, rows, 0], None, [], 0.1, 1e-3, 0.0, 0, 0.9, 0.999, 1)
    # the same update as two tables of six bags: the first table's two listings back to back
    once = storage.clone(), state.clone()
    folded_ids = torch.cat([ids[0:6], ids[12:18], ids[6:12]])
    lengths = offsets[1:] - offsets[:-1]
    folded_lengths = torch.cat([lengths[0:3], lengths[6:9], lengths[3:6], torch.zeros(3, dtype=torch.int64)])
    folded_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), folded_lengths.cumsum(0)])
    folded_grad = torch.zeros(2 * bags, 2 * dim)
    folded_grad[:bags, :dim], folded_grad[bags:, :dim] = grad[:, :dim], grad[:, 2 * dim :]
    folded_grad[:bags, dim:] = grad[:, dim : 2 * dim]
    torch.ops.tdb.sparse_update(once[0], [0, rows * dim], [dim] * 2, [rows] * 2, folded_grad, folded_ids,
                                folded_offsets, None, "rowwise_adagrad", once[1], [0, rows], None, [], 0.1, 1e-3, 0.0,
                                0, 0.9, 0.999, 1)
    torch.testing.assert_close(twice[0], once[0])
    torch.testing.assert_close(twice[1], once[1])


def test_overlapping_tables_refused():
    storage = torch.zeros(100)
    with pytest.raises(ValueError, match="tables 0 and 1"):
        torch.ops.tdb.sparse_update(storage, [0, 8], [4, 4], [4, 4], torch.zeros(1, 8), torch.zeros(0, dtype=torch.int64),
                                    torch.zeros(3, dtype=torch.int64), None, "sgd", None, [], None, [], 0.1, 1e-3, 0.0,
                                    0, 0.9, 0.999, 1)
