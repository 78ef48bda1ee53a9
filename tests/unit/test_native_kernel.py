"""The native CPU kernels (the built extension's ops, csrc/cpu_kernels.c, through kernels/native.py): the
optimizer updates against fbgemm's own CPU backward-with-optimizer kernels and against a plain torch reference
(duplicates within and across bags, empty bags, per-sample weights, a strided column-slice gradient, weight
decay, Adam, several threads, bad input), the pooled sum's thread split, zero-width shards. The pooled sum
against fbgemm's forward: see test_lookup_validation.py.

The kernels run through their real entry points: the ops (``torch.ops.tdb``, with ``TDB_KERNELS=native``),
which check the arguments, and :meth:`NativeKernel.pool_tables` / :meth:`NativeKernel.update_tables` over
several tables of one storage."""

from __future__ import annotations

import itertools

import pytest
import torch

from torchrec_dtensor_bridge.kernels import Batch, State, Tables, native
from torchrec_dtensor_bridge.kernels.fbgemm import available as tbe_available
from torchrec_dtensor_bridge.optim_kinds import Hyper, WeightDecayMode, lookup

from .random_bags import random_bags

KINDS = ["sgd", "rowwise_adagrad", "adagrad"]
LR, EPS = 0.05, 1e-3


@pytest.fixture(scope="module")
def kernel() -> native.NativeKernel:
    k = native.kernel()
    assert k is not None, "the extension must be built on this project's machines (make setup builds it)"
    return k


@pytest.fixture(autouse=True)
def _native_kernels(monkeypatch):
    """The ops run this package's kernels."""
    monkeypatch.setenv("TDB_KERNELS", "native")


def _update(kind: str, weight, grad, ids, offsets, psw, state, lr=LR, eps=EPS, wd=0.0,
            mode=WeightDecayMode.NONE, *, state2=None, beta1=0.9, beta2=0.999, step=1) -> None:
    """``tdb::sparse_update`` of one shard ``weight`` (a contiguous fp32 ``(rows, dim)``), ``offsets`` its
    ``bags + 1`` bag boundaries, ``state`` (and ``state2``) ``(rows,)`` (a per-row state) or like ``weight``."""
    rows, dim = weight.shape
    flat = [None if st is None else st.view(-1) for st in (state, state2)]
    torch.ops.tdb.sparse_update(weight.view(-1), [0], [dim], [rows], grad, ids, offsets, psw, kind, flat[0],
                                [0] if flat[0] is not None else [], flat[1], [0] if flat[1] is not None else [],
                                lr, eps, wd, mode.value, beta1, beta2, step)


def _pool(weight, ids, offsets, psw):
    """``tdb::pool_sum`` of one shard ``weight`` (a contiguous fp32 ``(rows, dim)``)."""
    return torch.ops.tdb.pool_sum(weight.view(-1), [0], [weight.shape[1]], [weight.shape[0]], ids, offsets, psw)


def _case(rows: int, dim: int, bags: int, seed: int, *, strided: bool, psw: bool):
    g = torch.Generator().manual_seed(seed)
    ids, offsets = random_bags(g, rows, bags, 5, empty_first=True)
    n = ids.numel()
    if n > 3:
        ids[1] = ids[0]  # a duplicate within a bag
        ids[-1] = ids[0]  # and across bags
    full = torch.randn(bags, 3 * dim if strided else dim, generator=g)
    grad = full[:, dim : 2 * dim] if strided else full
    weights = torch.rand(n, generator=g) + 0.5 if psw else None
    return torch.randn(rows, dim, generator=g), grad, ids, offsets, weights


def _state(kind: str, weight: torch.Tensor) -> torch.Tensor | None:
    if kind == "rowwise_adagrad":
        return torch.rand(weight.shape[0])
    if kind == "adagrad":
        return torch.rand_like(weight)
    return None


def _reference(kind, weight, grad, ids, offsets, psw, state, wd=0.0, decoupled=False):
    """The textbook update on the touched rows, from torch ops (fp64 sums); ``wd``: L2 weight decay (folded
    into the gradient), or decoupled for row-wise Adagrad."""
    bag = torch.repeat_interleave(torch.arange(offsets.numel() - 1), offsets[1:] - offsets[:-1])
    per_id = grad.double().index_select(0, bag)
    if psw is not None:
        per_id = per_id * psw.double().unsqueeze(1)
    g = torch.zeros(weight.shape, dtype=torch.float64).index_add_(0, ids, per_id)
    rows = ids.unique()
    w, s = weight.clone(), None if state is None else state.clone()
    gr = g[rows]
    if wd and not decoupled:
        gr = gr + wd * w[rows].double()
    if kind == "sgd":
        w[rows] = (w[rows].double() - LR * gr).float()
    elif kind == "rowwise_adagrad":
        m = s[rows].double() + (gr * gr).mean(1)
        s[rows] = m.float()
        before = w[rows].double() * ((1 - LR * wd) if decoupled else 1.0)
        w[rows] = (before - (LR / (m.sqrt() + EPS)).unsqueeze(1) * gr).float()
    else:
        m = s[rows].double() + gr * gr
        s[rows] = m.float()
        w[rows] = (w[rows].double() - LR * gr / (m.sqrt() + EPS)).float()
    return w, s


def _fbgemm(kind, weight, grad, ids, offsets, psw, state):
    w, s = weight.clone(), None if state is None else state.clone()
    rows, dim = w.shape
    place = torch.full((1,), 3, dtype=torch.int32)
    w_off = torch.zeros(1, dtype=torch.int64)
    common = (grad.contiguous(), w.view(-1), place, w_off, torch.tensor([0, dim], dtype=torch.int32), dim,
              torch.tensor([0, rows]), max(rows.bit_length(), 1), ids, offsets, 0, psw, False)
    op = getattr(torch.ops.fbgemm, f"split_embedding_backward_codegen_{kind}_cpu")
    lr = torch.tensor(LR)
    if kind == "sgd":
        op(*common, lr)
    else:
        op(*common, s.view(-1), place, w_off, lr, eps=EPS)
    return w, s


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("psw", [False, True])
@pytest.mark.parametrize("dim", [20, 64, 128])  # 64 and 128: the walks with a constant width
def test_matches_reference_and_fbgemm(kernel, kind, strided, psw, dim):
    weight, grad, ids, offsets, weights = _case(300, dim, 64, seed=7, strided=strided, psw=psw)
    state = _state(kind, weight)
    w, s = weight.clone(), None if state is None else state.clone()
    _update(kind, w, grad, ids, offsets, weights, s)
    want_w, want_s = _reference(kind, weight, grad, ids, offsets, weights, state)
    torch.testing.assert_close(w, want_w)
    untouched = torch.ones(weight.shape[0], dtype=torch.bool)
    untouched[ids] = False
    assert torch.equal(w[untouched], weight[untouched]), "rows no id touched must stay bit-identical"
    if state is not None:
        torch.testing.assert_close(s, want_s)
    if tbe_available():
        fb_w, fb_s = _fbgemm(kind, weight, grad, ids, offsets, weights, state)
        torch.testing.assert_close(w, fb_w)
        if state is not None:
            torch.testing.assert_close(s, fb_s)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("psw", [False, True])
def test_constant_width_walk_equals_the_general_one(kernel, kind, dim, psw):
    """Widths 64 and 128 are walked with the width a constant, others with it a variable: the element-wise
    kinds update each column alone, so a table three columns wider (the general walk) must give the same
    bits in the shared columns, rows and state alike."""
    weight, grad, ids, offsets, weights = _case(300, dim + 3, 64, seed=21, strided=True, psw=psw)
    state = None if kind == "sgd" else torch.rand_like(weight)
    state2 = torch.rand_like(weight) if kind == "adam" else None
    results = []
    for width in (dim + 3, dim):
        w = weight[:, :width].clone(memory_format=torch.contiguous_format)
        s, s2 = (None if x is None else x[:, :width].clone(memory_format=torch.contiguous_format)
                 for x in (state, state2))
        _update(kind, w, grad[:, :width], ids, offsets, weights, s, state2=s2, step=3)
        results.append([x[:, :dim] for x in (w, s, s2) if x is not None])
    general, constant = results
    assert not torch.equal(constant[0], weight[:, :dim]), "the update changed nothing"
    for a, b in zip(general, constant):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_threads_split_on_row_boundaries(kernel, kind):
    """Enough ids for several threads (each a disjoint range of rows): the same result as one thread."""
    weight, grad, ids, offsets, weights = _case(2000, 8, 20000, seed=3, strided=False, psw=True)
    assert ids.numel() >= 2 * native.MIN_PER_THREAD
    state = _state(kind, weight)
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 4):
            torch.set_num_threads(threads)
            assert len(native.row_cuts(ids.sort().values.int(), threads)) - 1 == min(
                threads, ids.numel() // native.MIN_PER_THREAD)
            w, s = weight.clone(), None if state is None else state.clone()
            _update(kind, w, grad, ids, offsets, weights, s)
            results.append((w, s))
    finally:
        torch.set_num_threads(before)
    (w1, s1), (w4, s4) = results
    assert torch.equal(w1, w4), "each row is summed in the same order whatever the thread count"
    if s1 is not None:
        assert torch.equal(s1, s4)


def test_row_cuts_never_split_a_row():
    """Enough sorted occurrences for several cuts (each part at least MIN_PER_THREAD), with long runs of one
    row placed so that the even guesses fall inside them: every cut lands on a row boundary."""
    g = torch.Generator().manual_seed(7)
    n = 5 * native.MIN_PER_THREAD
    runs = torch.randint(1, 3000, (200,), generator=g)
    keys = torch.repeat_interleave(torch.arange(runs.numel(), dtype=torch.int32), runs)[:n]
    keys = torch.cat([keys, torch.full((n - keys.numel(),), int(keys[-1]) + 1, dtype=torch.int32)])
    several = 0
    for parts in range(1, 7):
        cuts = native.row_cuts(keys, parts)
        assert cuts[0] == 0 and cuts[-1] == n and cuts == sorted(set(cuts)), (parts, cuts)
        several += len(cuts) > 2
        for c in cuts[1:-1]:
            assert keys[c - 1] != keys[c], (parts, c)
    assert several >= 4, "the cuts were exercised"


def test_ids_out_of_range_raise_and_change_nothing(kernel):
    weight, grad, ids, offsets, _ = _case(50, 4, 8, seed=1, strided=False, psw=False)
    ids[-1] = 50
    w = weight.clone()
    with pytest.raises(ValueError, match=r"outside \[0, 50\)"):
        _update("sgd", w, grad, ids, offsets, None, None)
    assert torch.equal(w, weight)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("TDB_NATIVE_KERNELS", "0")
    native.kernel.cache_clear()
    try:
        assert native.kernel() is None
    finally:
        monkeypatch.delenv("TDB_NATIVE_KERNELS")
        native.kernel.cache_clear()
    assert native.kernel() is not None


def test_strided_ids_and_offsets(kernel):
    """ids and offsets that are views with a stride (as a user's ``input[::2]`` reaches backward)."""
    weight, grad, ids, offsets, _ = _case(300, 8, 16, seed=5, strided=True, psw=False)
    spread = torch.zeros(2 * ids.numel(), dtype=torch.int64)
    spread[::2] = ids
    wide = torch.zeros(2 * offsets.numel(), dtype=torch.int64)
    wide[::2] = offsets
    a, b = weight.clone(), weight.clone()
    _update("sgd", a, grad, spread[::2], wide[::2], None, None)
    _update("sgd", b, grad, ids, offsets, None, None)
    assert torch.equal(a, b)


def test_zero_width_shard(kernel):
    """A shard of no columns (an empty column block): nothing to read or write, no error."""
    weight = torch.empty(10, 0)
    ids, offsets = torch.tensor([1, 2, 2]), torch.tensor([0, 1, 3])
    assert _pool(weight, ids, offsets, None).shape == (2, 0)
    _update("sgd", weight, torch.empty(2, 0), ids, offsets, None, None)


def test_pool_sum_threads_give_the_same_bits(kernel):
    """Bags split over 4 threads: the same output as one thread, bit for bit (and fbgemm's)."""
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(5000, 16, generator=g)
    ids, offsets = random_bags(g, 5000, 8000, 11)
    psw = torch.rand(ids.numel(), generator=g)
    assert ids.numel() >= 2 * native.MIN_PER_THREAD
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 4):
            torch.set_num_threads(threads)
            outs.append(_pool(weight, ids, offsets, psw))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], torch.nn.functional.embedding_bag(
        ids, weight, offsets, mode="sum", per_sample_weights=psw, include_last_offset=True))
    bad = ids.clone()
    bad[-1] = 5000  # in the last thread's range: the error still reaches the caller
    torch.set_num_threads(4)
    try:
        with pytest.raises(ValueError, match=r"outside \[0, 5000\)"):
            _pool(weight, bad, offsets, psw)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind,mode", [("sgd", WeightDecayMode.L2), ("adagrad", WeightDecayMode.L2),
                                       ("rowwise_adagrad", WeightDecayMode.L2),
                                       ("rowwise_adagrad", WeightDecayMode.DECOUPLED)])
def test_weight_decay_matches_reference(kernel, kind, mode):
    """Weight decay (which fbgemm-gpu-cpu's kernels ignore) as optim/update.py applies it."""
    weight, grad, ids, offsets, weights = _case(300, 20, 64, seed=9, strided=True, psw=True)
    state = _state(kind, weight)
    w, s = weight.clone(), None if state is None else state.clone()
    _update(kind, w, grad, ids, offsets, weights, s, LR, EPS, 0.3, mode)
    want_w, want_s = _reference(kind, weight, grad, ids, offsets, weights, state, wd=0.3,
                                decoupled=mode is WeightDecayMode.DECOUPLED)
    torch.testing.assert_close(w, want_w)
    if state is not None:
        torch.testing.assert_close(s, want_s)
    untouched = torch.ones(weight.shape[0], dtype=torch.bool)
    untouched[ids] = False
    assert torch.equal(w[untouched], weight[untouched]), "decay touches only the rows a step touched"


def test_decoupled_decay_is_rowwise_adagrads_only(kernel):
    weight, grad, ids, offsets, _ = _case(50, 4, 8, seed=1, strided=False, psw=False)
    before = weight.clone()
    with pytest.raises(ValueError, match="sparse_update: decay must be"):
        _update("sgd", weight, grad, ids, offsets, None, None, LR, EPS, 0.3, WeightDecayMode.DECOUPLED)
    assert torch.equal(weight, before)


def _adam_reference(weight, grad, ids, offsets, psw, m1, m2, step, wd, b1=0.8, b2=0.9):
    """optim/update.py's Adam (fbgemm's ADAM, decoupled decay) on the touched rows, in float64."""
    bag = torch.repeat_interleave(torch.arange(offsets.numel() - 1), offsets[1:] - offsets[:-1])
    per_id = grad.double().index_select(0, bag) * (1.0 if psw is None else psw.double().unsqueeze(1))
    g = torch.zeros(weight.shape, dtype=torch.float64).index_add_(0, ids, per_id)
    rows = ids.unique()
    w, a, b = weight.clone(), m1.clone(), m2.clone()
    gr = g[rows]
    na = b1 * a[rows].double() + (1 - b1) * gr
    nb = b2 * b[rows].double() + (1 - b2) * gr * gr
    a[rows], b[rows] = na.float(), nb.float()
    old = w[rows].double()
    w[rows] = (old - LR / (1 - b1**step) * na / ((nb / (1 - b2**step)).sqrt() + EPS) - LR * wd * old).float()
    return w, a, b


@pytest.mark.parametrize("wd", [0.0, 0.3])
def test_adam_matches_reference(kernel, wd):
    """Adam, which fbgemm-gpu-cpu has no CPU kernel for: two steps (the bias corrections of steps 1 and 2)."""
    weight, grad, ids, offsets, weights = _case(300, 20, 64, seed=13, strided=True, psw=True)
    m1, m2 = torch.rand_like(weight) * 0.1, torch.rand_like(weight) * 0.1
    w, a, b = weight.clone(), m1.clone(), m2.clone()
    want = (weight, m1, m2)
    for step in (1, 2):
        _update("adam", w, grad, ids, offsets, weights, a, LR, EPS, wd, WeightDecayMode.DECOUPLED, state2=b,
                beta1=0.8, beta2=0.9, step=step)
        want = _adam_reference(*want[:1], grad, ids, offsets, weights, want[1], want[2], step, wd)
    torch.testing.assert_close(w, want[0])
    torch.testing.assert_close(a, want[1])
    torch.testing.assert_close(b, want[2])
    untouched = torch.ones(weight.shape[0], dtype=torch.bool)
    untouched[ids] = False
    assert torch.equal(w[untouched], weight[untouched]) and torch.equal(a[untouched], m1[untouched])


def _tables(seed: int, bags: int, max_len: int):
    """Three tables of different widths in one flat storage (gaps between them), their per-row state in
    another (gaps too), one batch per table back to back (table-major offsets), a gradient with strided rows."""
    g = torch.Generator().manual_seed(seed)
    dims, rows = [8, 16, 4], [300, 500, 200]
    woff = [3, 3 + 300 * 8 + 5, 3 + 300 * 8 + 5 + 500 * 16 + 2]
    soff = [1, 1 + 300 + 4, 1 + 300 + 4 + 500 + 9]
    flat = torch.randn(woff[-1] + rows[-1] * dims[-1] + 6, generator=g)
    state = torch.rand(soff[-1] + rows[-1] + 3, generator=g)
    parts = [random_bags(g, r, bags, max_len, empty_first=True) for r in rows]
    ids = torch.cat([p[0] for p in parts])
    bounds, base = [torch.zeros(1, dtype=torch.int64)], 0
    for p in parts:
        bounds.append(p[1][1:] + base)
        base += p[0].numel()
    grad = torch.randn(bags, sum(dims) + 5, generator=g)[:, 2 : 2 + sum(dims)]
    psw = torch.rand(ids.numel(), generator=g) + 0.5
    return flat, woff, dims, rows, state, soff, ids, torch.cat(bounds), parts, grad, psw


@pytest.mark.parametrize("kind", KINDS)
def test_one_call_over_tables_equals_one_call_per_table(kernel, kind):
    """update_tables / pool_tables over three tables of one storage (state in one buffer, both with gaps):
    bit for bit the calls per table, nothing outside the tables and their state touched; with 1 and 4 threads
    (cuts over all tables' occurrences, on row boundaries)."""
    flat, woff, dims, rows, state, soff, ids, offsets, parts, grad, psw = _tables(5, 6000, 8)
    assert ids.numel() >= 4 * native.MIN_PER_THREAD, "enough occurrences for cuts inside tables"
    elementwise = kind == "adagrad"
    if elementwise:  # state like the rows
        soff = woff
        state = torch.rand(flat.numel())
    ref_w, ref_s = flat.clone(), state.clone()
    cols = list(itertools.accumulate(dims, initial=0))
    for t, (tid, toff) in enumerate(parts):
        w = ref_w[woff[t] : woff[t] + rows[t] * dims[t]].view(rows[t], dims[t])
        s = ref_s[soff[t] : soff[t] + rows[t] * (dims[t] if elementwise else 1)]
        s = s.view(rows[t], dims[t]) if elementwise else s
        lo = int(offsets[t * 6000])
        st = None if kind == "sgd" else s
        _update(kind, w, grad[:, cols[t] : cols[t + 1]], tid, toff, psw[lo : lo + tid.numel()], st)
        assert torch.equal(_pool(w, tid, toff, psw[lo : lo + tid.numel()]),
                           kernel.pool_tables(Tables(ref_w, woff, dims, rows), Batch(ids, offsets, psw))[
                               :, cols[t] : cols[t + 1]])
    before = torch.get_num_threads()
    try:
        for threads in (1, 4):
            torch.set_num_threads(threads)
            w, s = flat.clone(), state.clone()
            kernel.update_tables(Tables(w, woff, dims, rows), Batch(ids, offsets, psw), grad,
                                 State() if kind == "sgd" else State(s, soff, step=1),
                                 Hyper(lookup(kind), LR, EPS, 0.0, WeightDecayMode.NONE, 0.9, 0.999))
            assert torch.equal(w, ref_w), (kind, threads)
            assert torch.equal(s, ref_s), (kind, threads)
            assert not torch.equal(w, flat)
    finally:
        torch.set_num_threads(before)


def test_row_cuts_over_several_tables_never_split_a_row():
    """Three tables' sorted occurrences back to back (each table's keys sorted, not the whole), long runs of one
    row: every cut is a table boundary or a row boundary inside its table, and the cuts exercise both."""
    g = torch.Generator().manual_seed(3)
    parts = []
    for n in (3 * native.MIN_PER_THREAD, native.MIN_PER_THREAD // 2, 2 * native.MIN_PER_THREAD + 77):
        runs = torch.randint(1, 4000, (n // 500 + 2,), generator=g)
        parts.append(torch.repeat_interleave(torch.arange(runs.numel(), dtype=torch.int32), runs)[:n])
        assert parts[-1].numel() == n
    keys = torch.cat(parts)
    bounds = list(itertools.accumulate([p.numel() for p in parts], initial=0))
    inside = 0
    for threads in range(2, 9):
        cuts = native.row_cuts(keys, threads, bounds)
        assert cuts[0] == 0 and cuts[-1] == keys.numel() and cuts == sorted(set(cuts)), cuts
        for c in cuts[1:-1]:
            if c not in bounds:
                inside += 1
                assert keys[c - 1] != keys[c], (threads, c)
    assert inside >= 5, "cuts inside tables were exercised"


def _update_tables(kind: str, w, woff, dims, rows, grad, ids, offsets, psw, state, soff) -> None:
    """``tdb::sparse_update`` of several tables of one storage, their state in one buffer."""
    torch.ops.tdb.sparse_update(w, woff, dims, rows, grad, ids, offsets, psw, kind, state,
                                soff if state is not None else [], None, [], LR, EPS, 0.0, 0, 0.9, 0.999, 1)


def test_a_bad_id_of_a_later_table_refuses_before_any_update(kernel):
    flat, woff, dims, rows, state, soff, ids, offsets, _, grad, psw = _tables(6, 40, 5)
    ids[-1] = rows[2]  # the last table's last id, one past its rows
    w, s = flat.clone(), state.clone()
    with pytest.raises(ValueError, match=r"ids of table 2 outside \[0, 200\)"):
        _update_tables("rowwise_adagrad", w, woff, dims, rows, grad, ids, offsets, psw, s, soff)
    assert torch.equal(w, flat) and torch.equal(s, state), "modified before refusing"
    assert not kernel.ids_valid(ids, offsets, rows)
    ids[-1] = rows[2] - 1
    assert kernel.ids_valid(ids, offsets, rows)
    bad = offsets.clone()
    bad[5] = bad[7] + 1  # backwards
    assert not kernel.ids_valid(ids, bad, rows)
    with pytest.raises(ValueError, match="offsets must be non-decreasing"):
        _update_tables("sgd", w, woff, dims, rows, grad, ids, bad, None, None, [])
    with pytest.raises(ValueError, match="momentum1 of table 1"):
        _update_tables("rowwise_adagrad", w, woff, dims, rows, grad, ids, offsets, None, s[:soff[1] + 10], soff)
    assert torch.equal(w, flat)


def test_ids_outside_every_bag_are_not_read(kernel):
    """Offsets that end before the last ids (as a caller's view of a longer batch): those ids are neither
    checked nor used, by the pooled sum and by the update alike."""
    weight, grad, ids, offsets, _ = _case(40, 4, 5, seed=2, strided=False, psw=False)
    tail = torch.tensor([7, 8, 9, 40])  # the last one outside the table: never read
    longer = torch.cat([ids, tail])
    w = weight.clone()
    _update("sgd", w, grad, longer, offsets, None, None)
    want, _ = _reference("sgd", weight, grad, ids, offsets, None, None)
    torch.testing.assert_close(w, want)
    assert torch.equal(_pool(weight, longer, offsets, None), _pool(weight, ids, offsets, None))
