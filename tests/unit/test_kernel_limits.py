"""The kernels' limits and the kernel calls' contracts, on CPU (their CUDA side: ``test_fake_cuda_limits.py``).

* :func:`..kernels.limits.misfit` names each limit of fbgemm's CUDA kernels at its boundary, and its bag
  limit keeps every batch within the bits fbgemm's own ``get_infos_metadata`` gives the batch size;
* what runs instead where a CUDA call breaks a limit - torch's pooling and dense gradient - equals
  ``F.embedding_bag`` on every such call that fits in memory (a table wider than 2048 columns, no columns,
  unaligned ones);
* a strided view of per-sample weights gives exactly the result of its contiguous copy, through fbgemm's CPU
  kernels and its lookup functions' CPU forms;
* ``kernels.update_supported`` keeps from the update op the shards its kernel cannot take (ours: wider than
  ``native.MAX_DIM``), which the op would refuse in the middle of a backward;
* the kernel calls of a lookup tell the ops their ids are checked (no second check); direct op calls check.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from torchrec_dtensor_bridge import kernels
from torchrec_dtensor_bridge.kernels import fbgemm, limits, native, ops
from torchrec_dtensor_bridge.optim_kinds import Hyper, OptimKind, WeightDecayMode, lookup

from .random_bags import random_bags

pytestmark = pytest.mark.skipif(not fbgemm.available(), reason="needs fbgemm_gpu")

INT32_MAX = 2**31 - 1
HYPER = (0.1, 1e-2, 0.0, 0, 0.9, 0.99, 1)  # lr, eps, weight decay, decay mode, betas, step


def test_misfit_names_each_limit_at_its_boundary():
    """fbgemm_gpu 1.8's CUDA limits, each one just inside and just past (numbers from its sources)."""
    assert limits.misfit(None, [0, 4096], [2048, 4], bags=5, ids=10) is None
    assert "max_D <= 2048" in str(limits.misfit(None, [0], [2052]))
    assert "total_D > 0" in str(limits.misfit(None, [0, 0], [0, 0]))
    assert limits.misfit(None, [0, 0], [0, 4]) is None  # an empty table beside others: total_D > 0
    for offsets, dims in (([0], [6]), ([2], [4]), ([0, 6], [4, 4])):
        assert "16-byte aligned" in str(limits.misfit(None, offsets, dims)), (offsets, dims)
    storage = torch.empty(64)
    assert limits.misfit(storage, [0], [4]) is None and "16-byte aligned" in str(limits.misfit(storage[2:], [0], [4]))
    assert limits.misfit(None, [0], [4], ids=INT32_MAX - 1) is None
    assert "ids" in str(limits.misfit(None, [0], [4], ids=INT32_MAX))
    assert limits.batch_misfit(2, (INT32_MAX - 1) // 2, 0) is None  # 2 * B + 1 boundaries = INT32_MAX
    assert "bag boundaries" in str(limits.batch_misfit(2, (INT32_MAX - 1) // 2 + 1, 0))
    assert limits.fits(storage, [0, 8], [4, 2048]) and not limits.fits(storage, [0], [2052])


@pytest.mark.parametrize("tables", [1, 2, 3, 4, 5, 7, 8, 63, 64, 65, 1000, 4096, 2**20])
def test_the_bag_limit_keeps_batches_within_fbgemms_info_bits(tables):
    """fbgemm packs each bag's table and index in 32 bits, its lookup functions refusing more bags per table
    than ``get_infos_metadata`` leaves room for: every such batch breaks the bag-boundary limit too."""
    _, mask = torch.ops.fbgemm.get_infos_metadata(torch.empty(0), 1, tables)
    assert limits.batch_misfit(tables, int(mask) + 1, 0) is not None, mask


def _storage(dims, rows, at, seed=0):
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(max(o + r * d for o, r, d in zip(at, rows, dims)) + 3, generator=g)
    parts = [random_bags(g, r, 4, 3) for r in rows]
    ids = torch.cat([p[0] for p in parts])
    bounds, base = [torch.zeros(1, dtype=torch.int64)], 0
    for p in parts:
        bounds.append(p[1][1:] + base)
        base += p[0].numel()
    return flat, ids, torch.cat(bounds), parts, torch.rand(ids.numel(), generator=g)


@pytest.mark.parametrize("dims, at", [([2052], [0]), ([0], [0]), ([6, 4], [4, 70]), ([4, 8], [2, 50])],
                         ids=["wider_than_2048", "no_columns", "dims_of_6", "offset_of_2"])
def test_what_runs_past_fbgemms_cuda_limits_equals_torch(dims, at, monkeypatch):
    """Calls past a limit of fbgemm's CUDA kernels run torch's implementation of the op instead (tables without
    columns: zeros, nothing to add up): here the ops with ``TDB_KERNELS=torch`` on CPU tensors, against
    ``F.embedding_bag`` table by table and its gradient."""
    monkeypatch.setenv("TDB_KERNELS", "torch")
    rows = [6, 8][: len(dims)]
    flat, ids, offsets, parts, psw = _storage(dims, rows, at)
    assert limits.misfit(flat, at, dims, bags=4, ids=ids.numel()) is not None
    out = torch.ops.tdb.pool_sum(flat, at, dims, rows, ids, offsets, psw)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    dense = torch.ops.tdb.pool_sum_backward(grad, dims, rows, ids, offsets, psw)
    assert out.shape == (4, sum(dims)) and dense.shape == (sum(r * d for r, d in zip(rows, dims)),)
    c0, g0, i0 = 0, 0, 0
    for (t_ids, t_offsets), d, r, o in zip(parts, dims, rows, at):
        weight = flat[o : o + r * d].view(r, d).clone().requires_grad_()
        w = psw[i0 : i0 + t_ids.numel()]
        if d:  # torch's embedding_bag refuses a table without columns
            ref = F.embedding_bag(t_ids, weight, t_offsets, mode="sum", per_sample_weights=w,
                                  include_last_offset=True)
            torch.testing.assert_close(out[:, c0 : c0 + d], ref.detach())
            ref.backward(grad[:, c0 : c0 + d])
            torch.testing.assert_close(dense[g0 : g0 + r * d].view(r, d), weight.grad)
        c0, g0, i0 = c0 + d, g0 + r * d, i0 + t_ids.numel()


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a strided view (every other element of a larger tensor)."""
    out = torch.full((2 * t.numel(),), float("nan"), dtype=t.dtype)[::2]
    out.copy_(t)
    assert not out.is_contiguous()
    return out


DIMS, ROWS, AT = [8, 4], [30, 20], [4, 300]


def test_strided_per_sample_weights_give_the_contiguous_result(monkeypatch):
    """fbgemm's CUDA kernels read the per-sample weights as a flat array: every fbgemm call gets them
    contiguous. On fbgemm's CPU path (``TDB_KERNELS=fbgemm``): the ops (whose update is the backward op CUDA
    calls too) and fbgemm's lookup function give, for a strided view, exactly the result of its contiguous copy."""
    monkeypatch.setenv("TDB_KERNELS", "fbgemm")
    flat, ids, offsets, _, psw = _storage(DIMS, ROWS, AT, seed=3)
    strided = _strided(psw)
    grad = torch.randn(4, sum(DIMS), generator=torch.Generator().manual_seed(4))
    for w in (psw, strided):
        assert torch.equal(torch.ops.tdb.pool_sum(flat, AT, DIMS, ROWS, ids, offsets, w),
                           torch.ops.tdb.pool_sum(flat, AT, DIMS, ROWS, ids, offsets, psw))
        assert torch.equal(torch.ops.tdb.pool_sum_backward(grad, DIMS, ROWS, ids, offsets, w),
                           torch.ops.tdb.pool_sum_backward(grad, DIMS, ROWS, ids, offsets, psw))
    for kind in [k.name for k in OptimKind if k.fbgemm_cpu]:
        states = {"sgd": None, "rowwise_adagrad": sum(ROWS), "adagrad": flat.numel()}
        got = []
        for w in (psw, strided):
            weights = flat.clone()
            m = None if states[kind] is None else torch.full((states[kind],), 0.5)
            m_at = [] if m is None else ([0, ROWS[0]] if kind == "rowwise_adagrad" else AT)
            torch.ops.tdb.sparse_update(weights, AT, DIMS, ROWS, grad, ids, offsets, w, kind, m, m_at, None, [],
                                        *HYPER)
            got.append((weights, m))
        assert torch.equal(got[0][0], got[1][0]) and not torch.equal(got[0][0], flat), kind
        assert got[0][1] is None or torch.equal(got[0][1], got[1][1]), kind
    args = fbgemm.table_args(tuple(AT), tuple(DIMS), tuple(ROWS), torch.device("cpu"))
    one, two = (fbgemm.lookup_forward(flat, args, kernels.Batch(ids, offsets, w)) for w in (psw, strided))
    assert torch.equal(one, two)


def test_strided_per_sample_weights_through_the_kernel_calls(monkeypatch):
    """The same through ``kernels.pool``, ``weight_grad`` and ``update`` (as the lookups call them)."""
    monkeypatch.setenv("TDB_KERNELS", "fbgemm")
    g = torch.Generator().manual_seed(5)
    shard = torch.randn(40, 8, generator=g)
    ids, offsets = random_bags(g, 40, 6, 4)
    psw = torch.rand(ids.numel(), generator=g)
    grad = torch.randn(6, 8, generator=g)
    results = []
    for w in (psw, _strided(psw)):
        (out, _), = kernels.pool([kernels.Pooling(shard, ids, offsets, w, False)])
        dense = kernels.weight_grad(grad, kernels.Pooling(shard, ids, offsets, w, False))
        updated, state = shard.clone(), torch.zeros(40)
        hyper = Hyper(lookup("rowwise_adagrad"), 0.1, 1e-2, 0.0, WeightDecayMode.NONE, 0.9, 0.99)
        kernels.update([kernels.Update(updated, ids, offsets, w, grad, hyper, (state,), 1)])
        results.append((out, dense, updated, state))
    for one, two in zip(*results):
        assert torch.equal(one, two)


def test_update_supported_keeps_shards_the_update_kernel_cannot_take(monkeypatch):
    """Our C kernels take at most ``native.MAX_DIM`` columns (the op refuses wider tables): a wider shard goes
    to the optimizer's torch-op math instead (``update_supported`` is ``False``), fbgemm's CPU kernels take it;
    int32 ids go to torch's math too."""
    hyper = Hyper(lookup("sgd"), 0.1, 1e-8, 0.0, WeightDecayMode.NONE, 0.9, 0.999)
    ids, offsets = torch.tensor([0, 2]), torch.tensor([0, 1, 2])
    if native.kernel() is not None:
        monkeypatch.setenv("TDB_KERNELS", "native")
        assert kernels.update_supported(torch.empty(3, native.MAX_DIM), hyper, ids=ids, offsets=offsets)
        wide = torch.zeros(3, native.MAX_DIM + 4)
        assert not kernels.update_supported(wide, hyper)
        with pytest.raises(ValueError, match="at most 8192 columns"):  # what it keeps the shard from
            kernels.update([kernels.Update(wide, ids, offsets, None, torch.ones(2, wide.shape[1]), hyper, (), 1)])
    monkeypatch.setenv("TDB_KERNELS", "fbgemm")
    assert kernels.update_supported(torch.empty(3, native.MAX_DIM + 4), hyper, ids=ids, offsets=offsets)
    assert not kernels.update_supported(torch.empty(3, 8), hyper, ids=ids.int(), offsets=offsets.int())


def test_the_kernel_calls_tell_the_ops_their_ids_are_checked(monkeypatch):
    """``kernels.pool`` / ``weight_grad`` / ``update`` (the lookups check their ids at their API edge) make the
    ops skip their id check; the ops called directly check theirs (here: fbgemm's CPU path, where the check is
    a pass of its own)."""
    monkeypatch.setenv("TDB_KERNELS", "fbgemm")
    checked: list[str] = []
    check = ops._check_ids
    monkeypatch.setattr(ops, "_check_ids", lambda op, *a: checked.append(op) or check(op, *a))
    g = torch.Generator().manual_seed(6)
    shard = torch.randn(40, 8, generator=g)
    ids, offsets = random_bags(g, 40, 6, 4)
    grad = torch.randn(6, 8, generator=g)
    hyper = Hyper(lookup("sgd"), 0.1, 1e-8, 0.0, WeightDecayMode.NONE, 0.9, 0.999)
    kernels.pool([kernels.Pooling(shard, ids, offsets, None, False)])
    kernels.weight_grad(grad, kernels.Pooling(shard, ids, offsets, None, False))
    kernels.update([kernels.Update(shard.clone(), ids, offsets, None, grad, hyper, (), 1)])
    assert checked == []
    torch.ops.tdb.pool_sum(shard.view(-1), [0], [8], [40], ids, offsets, None)
    torch.ops.tdb.pool_sum_backward(grad, [8], [40], ids, offsets, None)
    torch.ops.tdb.sparse_update(shard.clone().view(-1), [0], [8], [40], grad, ids, offsets, None, "sgd", None, [],
                                None, [], *HYPER)
    assert checked == ["pool_sum", "pool_sum_backward", "sparse_update"]
    bad = ids.clone()
    bad[0] = 40
    with pytest.raises(ValueError, match="ids of table 0"):
        torch.ops.tdb.pool_sum(shard.view(-1), [0], [8], [40], bad, offsets, None)
