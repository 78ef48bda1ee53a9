"""One-process tests of the lookup's argument checks and of the local TBE kernel wrapper."""

import pytest
import torch
import torch.nn.functional as F

from torchrec_dtensor_bridge import kernels
from torchrec_dtensor_bridge.kernels import fbgemm, native
from torchrec_dtensor_bridge.kernels import Pooling, pool, weight_grad
from torchrec_dtensor_bridge.lookup.arguments import RejectedArguments, bags_for_embedding, bags_from_input, check_options

from .host_reads import count_host_reads
from .random_bags import random_bags


def _bags(input, offsets=None, psw=None, *, mode="sum", last=False, rows=10):
    return bags_from_input("f", input, offsets, psw, rows=rows, mode=mode, include_last_offset=last,
                           weight_dtype=torch.float32)


def _rejected(kind, match, fn):
    with pytest.raises(RejectedArguments) as info:
        fn()
    assert info.value.exception is kind and match in info.value.message, (info.value.exception, info.value.message)


@pytest.mark.parametrize("seed", range(5))
def test_count_per_bag_matches_bincount(seed):
    """Per-bag counts of selected ids (the routing's and the block filter's) equal a bincount of the
    selected ids' bags, with empty bags, empty batches and all/none selected."""
    from torchrec_dtensor_bridge.lookup.arguments import Bags

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (int(torch.randint(0, 9, (1,), generator=g)),), generator=g)
    ids = torch.randint(0, 50, (int(lengths.sum()),), generator=g)
    bags = Bags(ids, lengths, None)
    for mask in (ids < 20, ids >= 0, ids < 0):
        want = torch.bincount(bags.bag_of_id()[mask], minlength=bags.num_bags)
        assert torch.equal(bags.count_per_bag(mask), want), (lengths.tolist(), mask.tolist())


def test_canonical_forms():
    b = _bags(torch.tensor([[1, 2], [3, 4]]))
    assert b.ids.tolist() == [1, 2, 3, 4] and b.lengths.tolist() == [2, 2] and b.weights is None
    b = _bags(torch.tensor([1, 2, 3]), torch.tensor([0, 0, 2]))
    assert b.lengths.tolist() == [0, 2, 1] and b.bag_of_id().tolist() == [1, 1, 2]
    b = _bags(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3]), last=True)
    assert b.lengths.tolist() == [1, 2]
    b = _bags(torch.tensor([], dtype=torch.long), torch.tensor([0]), last=True)
    assert b.num_bags == 0
    b = bags_for_embedding("f", torch.tensor([[1, 2, 3]], dtype=torch.int32), 10)
    assert b.ids.dtype == torch.int64 and b.lengths.tolist() == [1, 1, 1]


@pytest.mark.parametrize(
    "kind, match, call",
    [
        (TypeError, "input must be a Tensor", lambda: _bags([1, 2], torch.tensor([0]))),
        (TypeError, "int32 or int64 ids", lambda: _bags(torch.tensor([1.0]), torch.tensor([0]))),
        (ValueError, "got 3 dims", lambda: _bags(torch.zeros(1, 1, 1, dtype=torch.long))),
        (ValueError, "1-D input needs offsets", lambda: _bags(torch.tensor([1]))),
        (ValueError, "offsets must be None when input is 2-D", lambda: _bags(torch.tensor([[1]]), torch.tensor([0]))),
        (ValueError, "id 10, outside [0, num_embeddings=10)", lambda: _bags(torch.tensor([10]), torch.tensor([0]))),
        (ValueError, "id -3", lambda: _bags(torch.tensor([-3]), torch.tensor([0]))),
        (ValueError, "non-decreasing", lambda: _bags(torch.tensor([1, 2]), torch.tensor([0, 2, 1]))),
        (ValueError, "offsets[0] must be 0", lambda: _bags(torch.tensor([1, 2]), torch.tensor([1]))),
        (ValueError, "include_last_offset=True needs offsets", lambda: _bags(torch.tensor([[1]]), last=True)),
        (ValueError, "must be the input length 2", lambda: _bags(torch.tensor([1, 2]), torch.tensor([0, 1]), last=True)),
        (ValueError, "per_sample_weights must have the shape", lambda: _bags(torch.tensor([1]), torch.tensor([0]), torch.ones(2))),
        (NotImplementedError, "mode='sum', got mode='max'",
         lambda: _bags(torch.tensor([1]), torch.tensor([0]), torch.ones(1), mode="max")),
        (TypeError, "per_sample_weights has dtype torch.float64",
         lambda: _bags(torch.tensor([1]), torch.tensor([0]), torch.ones(1, dtype=torch.float64))),
    ],
)
def test_bad_input(kind, match, call):
    _rejected(kind, match, call)


def _opts(**kw):
    base = dict(mode="sum", padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False)
    base.update(kw)
    return check_options("f", (10, 4), **base)


def test_options():
    assert _opts(padding_idx=-1) == 9 and _opts(padding_idx=3) == 3 and _opts() is None
    _rejected(ValueError, "mode must be one of", lambda: _opts(mode="avg"))
    _rejected(ValueError, "max_norm must be > 0, got max_norm=-1", lambda: _opts(max_norm=-1))
    _rejected(ValueError, "padding_idx must be within num_embeddings=10", lambda: _opts(padding_idx=10))
    _rejected(NotImplementedError, "scale_grad_by_freq", lambda: _opts(scale_grad_by_freq=True))
    _rejected(NotImplementedError, "sparse", lambda: _opts(sparse=True))
    _rejected(ValueError, "weight must be 2-D", lambda: check_options(
        "f", (10,), mode="sum", padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False))


@pytest.fixture(params=[kernels.Impl.NATIVE, kernels.Impl.FBGEMM, kernels.Impl.TORCH])
def sum_kernel(request, monkeypatch):
    """Each implementation of ``tdb::pool_sum`` in turn, forced by ``TDB_KERNELS``."""
    monkeypatch.setenv("TDB_KERNELS", request.param.name.lower())
    yield request.param


def _pool(shard, ids, offsets, psw=None, max_mode=False):
    return pool([Pooling(shard, ids, offsets, psw, max_mode)])[0]


def _grad(grad, shard, ids, offsets, psw=None, argmax=None):
    return weight_grad(grad, Pooling(shard, ids, offsets, psw, argmax is not None), argmax)


@pytest.mark.skipif(not fbgemm.available(), reason="fbgemm_gpu not installed")
@pytest.mark.parametrize("with_psw", [False, True])
def test_sum_kernels_match_torch_and_use_the_shard(with_psw, sum_kernel):
    g = torch.Generator().manual_seed(0)
    shard = torch.randn(50, 8, generator=g)
    ids = torch.randint(0, 50, (40,), generator=g)
    offsets = torch.tensor([0, 0, 7, 20, 40])  # an empty bag first
    psw = torch.rand(40, generator=g) if with_psw else None
    assert kernels.pool_impl(shard.device) == sum_kernel
    before = shard.clone()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out, argmax = _pool(shard, ids, offsets, psw)
    assert "tdb::pool_sum" in {e.name for e in prof.events()}
    assert argmax is None
    ref_w = shard.clone().requires_grad_()
    ref = F.embedding_bag(ids, ref_w, offsets, mode="sum", per_sample_weights=psw, include_last_offset=True)
    torch.testing.assert_close(out, ref.detach())
    grad = torch.randn(out.shape, generator=g)
    ref.backward(grad)
    torch.testing.assert_close(_grad(grad, shard, ids, offsets, psw), ref_w.grad)
    assert torch.equal(shard, before)


def test_max_uses_torch_fallback():
    shard = torch.randn(5, 3)
    ids, offsets = torch.tensor([1, 4]), torch.tensor([0, 2, 2])
    out, argmax = _pool(shard, ids, offsets, max_mode=True)
    torch.testing.assert_close(out, torch.stack([shard[[1, 4]].amax(0), torch.zeros(3)]))
    ref_w = shard.clone().requires_grad_()
    F.embedding_bag(ids, ref_w, offsets, mode="max", include_last_offset=True).sum().backward()
    won = torch.tensor([[1.0] * 3, [0.0] * 3])  # the empty bag wins nothing
    torch.testing.assert_close(_grad(won, shard, ids, offsets, argmax=argmax), ref_w.grad)


def test_torch_fallback_backward_matches():
    shard = torch.randn(6, 2, dtype=torch.float64)  # not fp32: the torch path
    ids, offsets, psw = torch.tensor([0, 5, 5, 2]), torch.tensor([0, 3, 4]), torch.rand(4, dtype=torch.float64)
    assert not kernels.accepts(shard)
    ref_w = shard.clone().requires_grad_()
    ref = F.embedding_bag(ids, ref_w, offsets, mode="sum", per_sample_weights=psw, include_last_offset=True)
    torch.testing.assert_close(_pool(shard, ids, offsets, psw)[0], ref.detach())
    grad = torch.randn(ref.shape, dtype=torch.float64)
    ref.backward(grad)
    torch.testing.assert_close(_grad(grad, shard, ids, offsets, psw), ref_w.grad)


def _native_pool(kernel: native.NativeKernel, shard: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                 psw: torch.Tensor | None) -> torch.Tensor:
    """The native kernel's pooled sum of one shard (its ids checked as it reads them)."""
    tables = kernels.Tables(shard.view(-1), [0], [shard.shape[1]], [shard.shape[0]])
    return kernel.pool_tables(tables, kernels.Batch(ids, offsets, psw))


@pytest.mark.skipif(not fbgemm.available(), reason="fbgemm_gpu not installed")
@pytest.mark.parametrize("with_psw", [False, True])
@pytest.mark.parametrize("dim", [64, 192, 40])  # register blocks of 64 columns (one, three), and the plain loop
def test_native_sum_is_fbgemms_to_the_bit(with_psw, dim):
    """The native pooled sum adds in fbgemm's order: the same bits, on a table with duplicates and empty bags."""
    g = torch.Generator().manual_seed(3)
    shard = torch.randn(1000, dim, generator=g)
    ids, offsets = random_bags(g, 1000, 200, 29)
    psw = torch.rand(ids.numel(), generator=g) if with_psw else None
    fast = native.kernel()
    assert fast is not None
    ours = _native_pool(fast, shard, ids, offsets, psw)
    theirs = torch.ops.fbgemm.split_embedding_codegen_forward_cpu(
        shard.view(-1), torch.zeros(1, dtype=torch.int64), torch.tensor([0, dim], dtype=torch.int32), dim,
        torch.tensor([0, 1000]), ids, offsets, 0, psw, 0)
    assert torch.equal(ours, theirs)


def test_native_sum_refuses_out_of_range_ids_and_bad_offsets():
    fast = native.kernel()
    assert fast is not None
    shard = torch.randn(10, 4)
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        _native_pool(fast, shard, torch.tensor([3, 10]), torch.tensor([0, 2]), None)
    with pytest.raises(ValueError, match="offsets"):
        _native_pool(fast, shard, torch.tensor([3, 4]), torch.tensor([0, 2, 1]), None)
    with pytest.raises(ValueError, match="offsets"):
        _native_pool(fast, shard, torch.tensor([3, 4]), torch.tensor([0, 3]), None)


def test_value_checks_read_the_device_once_per_call(monkeypatch):
    """The checks that read values (ids inside the table, offsets in order) of several tables' batches read
    the tensors once in all (on an accelerator, one host synchronisation per call, not a few per table):
    ``bags_from_input`` with a pending list reads nothing, ``check_values`` reads every table's facts at once
    and names the first bad table; alone, a batch is read once."""
    from torchrec_dtensor_bridge.lookup.arguments import check_values

    g = torch.Generator().manual_seed(4)
    batches = [random_bags(g, 10, 6, 4) for _ in range(8)]
    batches[5] = (torch.tensor([1, 2, 10, 3]), torch.tensor([0, 2, 2, 4]))  # id 10 of 10 rows
    batches[6] = (torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1, 3]))  # offsets backwards
    reads = count_host_reads(monkeypatch)

    def bags(t: int, pending):
        ids, offsets = batches[t]
        return bags_from_input(f"f (table {t})", ids, offsets[:-1], None, rows=10, mode="sum",
                               include_last_offset=False, weight_dtype=torch.float32, pending=pending)

    pending: list = []
    for t in range(8):
        bags(t, pending)
    assert reads == [], f"read while validating: {reads}"
    _rejected(ValueError, "f (table 5): input holds id 10", lambda: check_values(pending))
    assert reads.count("tolist") == 1 and len(reads) == 1, reads
    good = [c for t, c in enumerate(pending) if t not in (5, 6)]
    reads.clear()
    check_values(good)
    assert reads == ["tolist"], reads
    reads.clear()
    bags(0, None)
    assert reads == ["tolist"], reads
    _rejected(ValueError, "offsets must be non-decreasing", lambda: bags(6, None))
