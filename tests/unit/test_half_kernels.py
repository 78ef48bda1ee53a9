"""Half-precision tables (fp16, bf16) through the kernel ops: this package's C kernels (``cpu_kernels16.c``)
against fbgemm's CPU kernels and torch, on the same inputs.

* pooling: fp32 sums of the rows read as fp32, in id order: fbgemm's forward's bits for fp16, and for both
  dtypes the bits of the fp32 kernel run on the upcast rows (the conversion is exact);
* fp16 updates with round-to-nearest: SGD, row-wise Adagrad and Adagrad give fbgemm's CPU kernels' bits,
  weights and fp32 state (the arithmetic is written as fbgemm's, down to its rounding of the step to fp16
  before subtracting it in SGD and Adagrad);
* stochastic rounding: every result is one of the two representable neighbours of the fp32 update, their
  mean is the fp32 update within its standard error (unbiased), in fp16's normal and subnormal ranges and in
  bf16, the bits are the same for the same ``torch.manual_seed`` and thread count, and differ for another seed;
* which implementation runs (``kernels.choose.for_weights``): fbgemm's CPU kernels round to nearest only
  and have no bf16, so those updates go to ours.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from torchrec_dtensor_bridge import kernels
from torchrec_dtensor_bridge.kernels import choose, fbgemm, native

from .random_bags import random_bags

pytestmark = pytest.mark.skipif(native.kernel() is None or not fbgemm.available(),
                                reason="needs the C kernels and fbgemm_gpu")
HALVES = (torch.float16, torch.bfloat16)
HYPER = dict(eps=1e-8, weight_decay=0.0, decay=0, beta1=0.9, beta2=0.999, step=1)


@pytest.fixture
def impl(monkeypatch):
    def use(name: str) -> None:
        monkeypatch.setenv("TDB_KERNELS", name)
    return use


def _storage(dtype: torch.dtype, seed: int, dims=(12, 64, 128), rows=(50, 300, 200), gap: int = 8):
    """Tables of ``dims`` x ``rows`` at element offsets of one flat storage (gaps between them)."""
    g = torch.Generator().manual_seed(seed)
    at, offs = gap, []
    for r, d in zip(rows, dims):
        offs.append(at)
        at += r * d + gap
    flat = (torch.randn(at, generator=g) * 0.1).to(dtype)
    parts = [random_bags(g, r, 40, 4) for r in rows]
    ids = torch.cat([p[0] for p in parts])
    offsets = [torch.zeros(1, dtype=torch.int64)]
    base = 0
    for p_ids, p_off in parts:
        offsets.append(p_off[1:] + base)
        base += p_ids.numel()
    return flat, offs, list(dims), list(rows), ids, torch.cat(offsets), g


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("weighted", [False, True])
def test_pooling_sums_the_rows_in_fp32(dtype, weighted, impl):
    flat, offs, dims, rows, ids, offsets, g = _storage(dtype, 1)
    psw = torch.rand(ids.numel(), generator=g) if weighted else None
    impl("native")
    ours = torch.ops.tdb.pool_sum(flat, offs, dims, rows, ids, offsets, psw)
    assert ours.dtype == torch.float32
    upcast = torch.ops.tdb.pool_sum(flat.float(), offs, dims, rows, ids, offsets, psw)
    assert torch.equal(ours, upcast), "the fp32 kernel over the exactly upcast rows: the same bits"
    if dtype == torch.float16:
        impl("fbgemm")
        assert torch.equal(ours, torch.ops.tdb.pool_sum(flat, offs, dims, rows, ids, offsets, psw))


def _update(flat, offs, dims, rows, grad, ids, offsets, psw, kind, m, m_at, *, lr=0.05, sr=False):
    torch.ops.tdb.sparse_update(flat, offs, dims, rows, grad, ids, offsets, psw, kind, m, m_at, None, [], lr,
                                **HYPER, stochastic_rounding=sr)


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adagrad"])
@pytest.mark.parametrize("weighted", [False, True])
def test_round_to_nearest_gives_fbgemms_bits(kind, weighted, impl):
    """fp16 tables rounded to nearest: weights and fp32 state bit-equal to fbgemm's CPU kernel's, every table of
    one storage at once (state at offsets of its own, with gaps, where fbgemm allows it)."""
    flat, offs, dims, rows, ids, offsets, g = _storage(torch.float16, 2)
    psw = torch.rand(ids.numel(), generator=g) if weighted else None
    grad = torch.randn((offsets.numel() - 1) // 3, sum(dims), generator=g)
    if kind == "rowwise_adagrad":
        m0, m_at = torch.rand(sum(rows) + 6, generator=g), [0, rows[0] + 3, rows[0] + rows[1] + 6]
    elif kind == "adagrad":  # fbgemm's CPU Adagrad reads its state at the weights' offsets
        m0, m_at = torch.rand(flat.numel(), generator=g), offs
    else:
        m0, m_at = None, []
    results = []
    for name in ("native", "fbgemm"):
        impl(name)
        w, m = flat.clone(), None if m0 is None else m0.clone()
        _update(w, offs, dims, rows, grad, ids, offsets, psw, kind, m, m_at)
        results.append((w, m))
    (ours, our_m), (theirs, their_m) = results
    assert not torch.equal(ours, flat)
    assert our_m is None or torch.equal(our_m, their_m), "the fp32 state"
    assert torch.equal(ours, theirs), f"{(ours != theirs).sum().item()} elements differ from fbgemm's"


def _sr_case(dtype: torch.dtype, start: float, step: float, rows: int = 40000, dim: int = 8):
    """Every row the same start value and the same gradient: the fp32 target, and the update's result."""
    w = torch.full((rows, dim), start).to(dtype)
    ids = torch.arange(rows)
    grad = torch.full((rows, dim), step)
    target = (w.float() - 1.0 * grad)[0, 0].item()
    _update(w.view(-1), [0], [dim], [rows], grad, ids, torch.arange(rows + 1), None, "sgd", None, [], lr=1.0,
            sr=True)
    return target, w.float()


@pytest.mark.parametrize("dtype,start,step", [
    (torch.float16, 1.0, 0.3 * 2**-10),  # normal range: between 1 and 1 + 2^-10
    (torch.float16, 0.0, -2.3e-7),  # subnormal range: spacing 2^-24
    (torch.float16, -3.0, 0.7 * 2**-9),  # a negative value
    (torch.bfloat16, 1.0, 0.9 * 2**-7),
    (torch.bfloat16, 5e-3, -1e-5),
])
def test_stochastic_rounding_is_unbiased(dtype, start, step, impl):
    impl("native")
    torch.manual_seed(0)
    target, got = _sr_case(dtype, start, step)
    lo = torch.tensor(target).to(dtype).float().item()
    neighbours = {lo, torch.nextafter(torch.tensor(lo).to(dtype), torch.tensor(math.copysign(math.inf, target - lo) if
                  target != lo else math.inf).to(dtype)).float().item()}
    values = set(got.unique().tolist())
    assert values <= neighbours and len(values) == 2, f"{values} not the two neighbours {neighbours} of {target}"
    low, high = min(values), max(values)
    p = (target - low) / (high - low)
    n = got.numel()
    se = (high - low) * math.sqrt(p * (1 - p) / n)
    assert abs(got.mean().item() - target) < 4 * se, (got.mean().item(), target, se)


def test_stochastic_rounding_repeats_with_the_seed_whatever_the_threads(impl):
    impl("native")
    runs = []
    threads = torch.get_num_threads()
    try:
        for seed, nthreads in ((1, 1), (1, 2), (2, 1)):
            torch.set_num_threads(nthreads)
            torch.manual_seed(seed)
            runs.append(_sr_case(torch.float16, 1.0, 0.3 * 2**-10, rows=60000)[1])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(runs[0], runs[1]), "the same seed: the same bits on 1 and 2 threads"
    assert not torch.equal(runs[0], runs[2]), "another seed: other bits"


@pytest.mark.parametrize("dtype,kinds", [(torch.bfloat16, ("sgd", "rowwise_adagrad", "adagrad", "adam")),
                                         (torch.float16, ("adam",))])
def test_updates_round_the_fp32_update_once(dtype, kinds, impl):
    """Where fbgemm's CPU kernels give no bits to match (bf16; Adam, which it has no CPU kernel of), an update
    rounded to nearest is the kind's fp32 update on the upcast rows, rounded once: within half a unit in the last
    place of the result, up to the fp32 arithmetic's own rounding; the fp32 state is the fp32 update's."""
    impl("native")
    flat, offs, dims, rows, ids, offsets, g = _storage(dtype, 4)
    grad = torch.randn((offsets.numel() - 1) // 3, sum(dims), generator=g)
    for kind in kinds:
        per_row = kind == "rowwise_adagrad"
        size = sum(rows) if per_row else flat.numel()
        states = [torch.rand(size, generator=g) for _ in range({"sgd": 0, "adam": 2}.get(kind, 1))]
        at = [0, rows[0], rows[0] + rows[1]] if per_row else offs
        half, full = flat.clone(), flat.float()
        s_half, s_full = [s.clone() for s in states], [s.clone() for s in states]
        for w, st in ((half, s_half), (full, s_full)):
            m1, m2 = (st + [None, None])[:2]
            torch.ops.tdb.sparse_update(w, offs, dims, rows, grad, ids, offsets, None, kind, m1,
                                        at if m1 is not None else [], m2, at if m2 is not None else [], 0.05,
                                        **HYPER, stochastic_rounding=False)
        assert not torch.equal(half, flat), kind
        want = full.to(dtype)
        inf = torch.tensor(math.inf).to(dtype)
        ulp = torch.maximum(torch.nextafter(want, inf).float() - want.float(),
                            want.float() - torch.nextafter(want, -inf).float())
        off = (half.float() - want.float()).abs()
        assert bool((off <= ulp).all()), f"{kind} {dtype}: {int((off > ulp).sum())} elements past one unit"
        assert (half != want).float().mean().item() < 1e-3, f"{kind} {dtype}: not the once-rounded fp32 update"
        for a, b in zip(s_half, s_full):
            torch.testing.assert_close(a, b, msg=lambda m, k=kind: f"{k} state: {m}")


def test_which_implementation_serves_half_tables(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.delenv("TDB_KERNELS", raising=False)
    for_w = choose.for_weights
    assert for_w(choose.Impl.FBGEMM, cpu, torch.float16) is choose.Impl.FBGEMM
    assert for_w(choose.Impl.FBGEMM, cpu, torch.float16, stochastic=True) is choose.Impl.NATIVE
    assert for_w(choose.Impl.FBGEMM, cpu, torch.bfloat16) is choose.Impl.NATIVE
    assert for_w(choose.Impl.NATIVE, cpu, torch.bfloat16, stochastic=True) is choose.Impl.NATIVE
    assert for_w(choose.Impl.FBGEMM, cpu, torch.float64) is choose.Impl.TORCH
    assert for_w(choose.Impl.FBGEMM, cuda, torch.float16, stochastic=True) is choose.Impl.FBGEMM
    assert for_w(choose.Impl.FBGEMM, cuda, torch.bfloat16) is choose.Impl.FBGEMM
    monkeypatch.setenv("TDB_KERNELS", "fbgemm")  # forced: ours may not run
    assert for_w(choose.Impl.FBGEMM, cpu, torch.bfloat16) is choose.Impl.TORCH
    shard = torch.zeros(10, 8, dtype=torch.bfloat16)
    assert kernels.accepts(shard)
    assert not kernels.accepts(torch.zeros(10, 8, dtype=torch.float64))
    assert "TDB_KERNELS" in os.environ
