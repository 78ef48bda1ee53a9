"""The kernel layer's torch ops (kernels/ops.py): opcheck for every op and implementation, several tables of
one storage in one call against per-table references, fakes under FakeTensorMode and torch.compile, and bad
arguments refused before any kernel runs (nothing modified)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from torchrec_dtensor_bridge import kernels
from torchrec_dtensor_bridge.kernels import fbgemm, native
from torchrec_dtensor_bridge.optim_kinds import Hyper, OptimKind, WeightDecayMode, lookup

from .random_bags import random_bags

pytestmark = pytest.mark.skipif(not fbgemm.available() or native.kernel() is None,
                                reason="needs fbgemm_gpu and a C compiler")

DIMS, ROWS, GAP = [8, 16, 4], [30, 50, 20], 7  # three tables in one storage, gaps between them
HYPER = dict(lr=0.1, eps=1e-2, weight_decay=0.0, decay=0, beta1=0.9, beta2=0.99, step=1)


@pytest.fixture(params=["native", "fbgemm", "torch"])
def impl(request, monkeypatch):
    monkeypatch.setenv("TDB_KERNELS", request.param)
    return request.param


def _storage(seed: int = 0):
    """One flat storage with the tables at offsets (gaps between), and one batch of 6 bags per table."""
    g = torch.Generator().manual_seed(seed)
    at, offs = 3, []
    for r, d in zip(ROWS, DIMS):
        offs.append(at)
        at += r * d + GAP
    flat = torch.randn(at, generator=g)
    parts = [random_bags(g, r, 6, 5) for r in ROWS]
    ids = torch.cat([p[0] for p in parts])
    bounds, base = [torch.zeros(1, dtype=torch.int64)], 0
    for p in parts:
        bounds.append(p[1][1:] + base)
        base += p[0].numel()
    return flat, offs, ids, torch.cat(bounds), parts


def _table(flat, offs, t):
    return flat[offs[t] : offs[t] + ROWS[t] * DIMS[t]].view(ROWS[t], DIMS[t])


@pytest.mark.parametrize("with_psw", [False, True])
def test_pool_sum_of_one_storage_equals_torch_per_table(impl, with_psw):
    flat, offs, ids, offsets, parts = _storage()
    psw = torch.rand(ids.numel()) if with_psw else None
    out = torch.ops.tdb.pool_sum(flat, offs, DIMS, ROWS, ids, offsets, psw)
    assert out.shape == (6, sum(DIMS))
    c0, at = 0, 0
    for t, (tid, toff) in enumerate(parts):
        tpsw = None if psw is None else psw[at : at + tid.numel()]
        ref = F.embedding_bag(tid, _table(flat, offs, t), toff, mode="sum", per_sample_weights=tpsw,
                              include_last_offset=True)
        got = out[:, c0 : c0 + DIMS[t]]
        assert torch.equal(got, ref) if psw is None else torch.allclose(got, ref, atol=1e-6), (impl, t)
        c0, at = c0 + DIMS[t], at + tid.numel()


def test_dense_grad_of_one_storage_is_packed_per_table(impl):
    if impl == "native":
        pytest.skip("no native dense backward: fbgemm's or torch's")
    flat, offs, ids, offsets, parts = _storage(1)
    grad = torch.randn(6, sum(DIMS))
    got = torch.ops.tdb.pool_sum_backward(grad, DIMS, ROWS, ids, offsets, None)
    at, c0 = 0, 0
    for t, (tid, toff) in enumerate(parts):
        w = _table(flat, offs, t).clone().requires_grad_()
        F.embedding_bag(tid, w, toff, mode="sum", include_last_offset=True).backward(grad[:, c0 : c0 + DIMS[t]])
        torch.testing.assert_close(got[at : at + w.numel()].view(w.shape), w.grad)
        at, c0 = at + w.numel(), c0 + DIMS[t]


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adagrad", "adam"])
@pytest.mark.parametrize("which", ["native", "fbgemm"])
def test_sparse_update_of_one_storage_equals_one_call_per_table(kind, which, monkeypatch):
    if which == "fbgemm" and kind == "adam":
        pytest.skip("fbgemm-gpu-cpu has no CPU Adam")
    monkeypatch.setenv("TDB_KERNELS", which)
    flat, offs, ids, offsets, parts = _storage(2)
    grad = torch.randn(6, sum(DIMS))[:, :]  # strided rows are fine too: checked below
    per_row = kind == "rowwise_adagrad"
    sizes = [r if per_row else r * d for r, d in zip(ROWS, DIMS)]
    m_offs = [sum(sizes[:t]) + 2 * t for t in range(3)]
    m1 = None if kind == "sgd" else torch.rand(sum(sizes) + 6)
    m2 = torch.rand(sum(sizes) + 6) if kind == "adam" else None
    one = flat.clone(), None if m1 is None else m1.clone(), None if m2 is None else m2.clone()
    torch.ops.tdb.sparse_update(one[0], offs, DIMS, ROWS, grad, ids, offsets, None, kind, one[1],
                                m_offs if m1 is not None else [], one[2], m_offs if m2 is not None else [],
                                **HYPER)
    c0 = 0
    for t, (tid, toff) in enumerate(parts):  # the same tables, one call each, on their own tensors
        w = _table(flat, offs, t).clone().view(-1)
        s1 = None if m1 is None else m1[m_offs[t] : m_offs[t] + sizes[t]].clone()
        s2 = None if m2 is None else m2[m_offs[t] : m_offs[t] + sizes[t]].clone()
        torch.ops.tdb.sparse_update(w, [0], DIMS[t : t + 1], ROWS[t : t + 1], grad[:, c0 : c0 + DIMS[t]], tid,
                                    toff, None, kind, s1, [0] if s1 is not None else [], s2,
                                    [0] if s2 is not None else [], **HYPER)
        assert torch.equal(_table(one[0], offs, t).reshape(-1), w), (kind, which, t)
        if s1 is not None:
            assert torch.equal(one[1][m_offs[t] : m_offs[t] + sizes[t]], s1), (kind, which, t)
        c0 += DIMS[t]
    gaps = [one[0][offs[t] + ROWS[t] * DIMS[t] : offs[t] + ROWS[t] * DIMS[t] + GAP] for t in range(3)]
    assert all(torch.equal(g, flat[offs[t] + ROWS[t] * DIMS[t] : offs[t] + ROWS[t] * DIMS[t] + GAP])
               for t, g in enumerate(gaps)), "the gaps between tables are not touched"


def _op_args():
    flat, offs, ids, offsets, _ = _storage(3)
    grad = torch.randn(6, sum(DIMS))
    m1 = torch.zeros(sum(ROWS))
    return {
        "pool_sum": (flat, offs, DIMS, ROWS, ids, offsets, None),
        "pool_sum_backward": (grad, DIMS, ROWS, ids, offsets, None),
        "sparse_update": (flat.clone(), offs, DIMS, ROWS, grad, ids, offsets, None, "rowwise_adagrad", m1,
                          [0, ROWS[0], ROWS[0] + ROWS[1]], None, [], 0.1, 1e-8, 0.0, 0, 0.9, 0.999, 1),
    }


@pytest.mark.parametrize("op", ["pool_sum", "pool_sum_backward", "sparse_update"])
def test_opcheck(op, impl):
    if impl == "torch" and op == "sparse_update":
        pytest.skip("the torch-op update math lives in optim/, not behind the op")
    torch.library.opcheck(getattr(torch.ops.tdb, op).default, _op_args()[op])


def test_fake_tensors_and_compile():
    args = _op_args()["pool_sum"]
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = torch.ops.tdb.pool_sum(*fake)
        assert out.shape == (6, sum(DIMS)) and out.dtype == torch.float32

    def model(flat, ids, offsets):
        return torch.relu(torch.ops.tdb.pool_sum(flat, args[1], DIMS, ROWS, ids, offsets, None)).sum(1)

    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(args[0], args[4], args[5]), model(args[0], args[4], args[5]))


def test_profiler_names_the_ops():
    args = _op_args()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for op, a in args.items():
            getattr(torch.ops.tdb, op)(*a)
    names = {e.name for e in prof.events()}
    assert {"tdb::pool_sum", "tdb::pool_sum_backward", "tdb::sparse_update"} <= names


def _bad(op: str, k: int, value, match: str) -> None:
    args = list(_op_args()[op])
    args[k] = value
    before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    with pytest.raises(ValueError, match=match):
        getattr(torch.ops.tdb, op)(*args)
    after = [a for a in args if isinstance(a, torch.Tensor)]
    assert all(torch.equal(x, y) for x, y in zip(before, after)), f"{op}: modified before refusing"


@pytest.mark.parametrize("which", ["native", "fbgemm"])
def test_bad_arguments_name_the_argument_and_change_nothing(which, monkeypatch):
    monkeypatch.setenv("TDB_KERNELS", which)
    ids = _op_args()["pool_sum"][4].clone()
    ids[-1] = ROWS[2]  # the last table's first row past its end
    _bad("pool_sum", 4, ids, r"ids")
    _bad("sparse_update", 5, ids, r"ids")
    _bad("pool_sum", 0, torch.zeros(10, dtype=torch.float64), "weights must be a flat contiguous float32")
    _bad("pool_sum", 1, [0, 10, 10**6], "table 2")
    _bad("pool_sum", 5, torch.tensor([0, 5, 3] + [40] * 16), "offsets")
    _bad("pool_sum", 5, torch.arange(5), "T \\* B \\+ 1")
    _bad("sparse_update", 4, torch.randn(6, 3), "grad must be float32")
    _bad("sparse_update", 9, torch.zeros(sum(ROWS) - 1), "momentum1 of table 2")  # one row short
    _bad("sparse_update", 9, None, "momentum1, momentum2")
    _bad("sparse_update", 8, "lamb", "kind must be one of")


def test_ranks_settle_on_what_every_rank_has_then_the_rule_decides(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("TDB_KERNELS", raising=False)
    mine = kernels.choice_code(cpu)
    assert mine == 3, "both C kernels here, and nothing else in the code (no measurement travels)"
    try:
        kernels.settle(cpu, [mine, 0])  # another rank with neither C kernel
        assert kernels.pool_impl(cpu) is kernels.Impl.TORCH
        assert kernels.update_impl(cpu, "sgd", 0.0) is kernels.Impl.TORCH
        kernels.settle(cpu, [mine, 1])  # the other rank has ours only
        assert kernels.pool_impl(cpu) is kernels.Impl.NATIVE
        assert kernels.update_impl(cpu, "adagrad", 0.0) is kernels.Impl.NATIVE
        assert kernels.dense_impl(cpu) is kernels.Impl.TORCH
        kernels.settle(cpu, [mine, 2])  # the other rank has fbgemm's only
        assert kernels.pool_impl(cpu) is kernels.Impl.FBGEMM
        assert kernels.update_impl(cpu, "sgd", 0.1) is kernels.Impl.TORCH  # fbgemm ignores weight decay
        assert kernels.update_impl(cpu, "sgd", 0.0, torch.float16, stochastic=True) is kernels.Impl.TORCH
        kernels.settle(cpu, [mine, mine])  # both: the rule, the same on every rank
        for (work, dtype), rule in kernels.choose.RULE.items():
            half = torch.float16 if dtype == "fp16" else torch.float32
            for nbytes in (0, 1 << 20, 64 << 20, 1 << 30, None):
                got = (kernels.pool_impl(cpu, half, nbytes) if work == "pool"
                       else kernels.update_impl(cpu, work.removeprefix("update_"), 0.0, half, nbytes=nbytes))
                assert got is rule.pick(nbytes), (work, dtype, nbytes)
        assert kernels.dense_impl(cpu) is kernels.Impl.FBGEMM
        assert kernels.update_impl(cpu, "adam", 0.0) is kernels.Impl.NATIVE  # fbgemm-gpu-cpu has no Adam
        assert kernels.pool_impl(cpu, torch.bfloat16) is kernels.Impl.NATIVE  # nor bf16 tables
    finally:
        kernels.choose._agreed.clear()


def test_the_rule_covers_the_work_both_kernels_do_and_says_why(monkeypatch):
    """Every kind both C kernels update, fp32 and fp16, and the pooled sum have an entry in the rule (a figure
    in docs/kernels.md); each choice carries its reason: the rule, an override, or what the others lack."""
    monkeypatch.delenv("TDB_KERNELS", raising=False)
    cpu, choose = torch.device("cpu"), kernels.choose
    both = [k.name for k in OptimKind if k.native is not None and k.fbgemm_cpu]
    assert set(choose.RULE) == {(w, d) for w in ["pool", *(f"update_{k}" for k in both)] for d in ("fp32", "fp16")}
    assert choose.explain_pool(cpu).why.startswith("rule for pool fp32: ")
    assert "fbgemm: no CPU kernel for 'adam'" in choose.explain_update(cpu, "adam", 0.0).why
    assert "stochastic" in choose.explain_update(cpu, "sgd", 0.0, torch.float16, stochastic=True).why
    assert "weight decay" in choose.explain_update(cpu, "sgd", 0.1).why
    monkeypatch.setenv("TDB_KERNELS", "fbgemm")
    assert choose.explain_pool(cpu) == choose.Choice(kernels.Impl.FBGEMM, "override: TDB_KERNELS=fbgemm")
    forced = choose.explain_pool(cpu, torch.bfloat16)
    assert forced.impl is kernels.Impl.TORCH and "override: TDB_KERNELS=fbgemm, but fbgemm" in forced.why


@contextlib.contextmanager
def fbgemm_calls() -> Iterator[list[str]]:
    """The names of the ``fbgemm`` ops run inside the block, in order (the profiler's record)."""
    names: list[str] = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield names
    names.extend(e.name.split("::")[1] for e in sorted(prof.events(), key=lambda e: e.time_range.start)
                 if e.name.startswith("fbgemm::"))


@pytest.mark.parametrize("with_psw", [False, True])
def test_fbgemm_update_is_its_backward_alone(with_psw, monkeypatch):
    """A fused update through fbgemm is one call of its backward op (the one both devices share, given the
    CUDA form's argument list: host, device, unified-memory and cache weights, each state as five tensors),
    no forward; its result equals this package's own kernel's (an independent implementation) on the same
    inputs. The CUDA forward's lookup function runs here with the CPU forms of the same arguments."""
    cpu = torch.device("cpu")
    flat, offs, ids, offsets, _ = _storage(4)
    psw = torch.rand(ids.numel()) if with_psw else None
    args = fbgemm.table_args(tuple(offs), tuple(DIMS), tuple(ROWS), cpu)
    assert len(fbgemm.weights_list(flat, args)) == 3 and args.on_host
    grad = torch.randn(6, sum(DIMS) + 3)[:, 1 : 1 + sum(DIMS)]  # strided rows, as an exchange hands them
    batch = kernels.Batch(ids, offsets, psw)
    got = fbgemm.lookup_forward(flat, args, batch)
    torch.testing.assert_close(got, torch.ops.tdb.pool_sum(flat, offs, DIMS, ROWS, ids, offsets, psw))
    which = "weighted" if with_psw else "unweighted"
    for kind in [k.name for k in OptimKind if k.fbgemm_cpu]:
        per_row = kind == "rowwise_adagrad"
        sizes = [r if per_row else r * d for r, d in zip(ROWS, DIMS)]
        # fbgemm's CPU Adagrad reads its state at the weights' offsets: one call only then
        m_offs = offs if kind == "adagrad" else [sum(sizes[:t]) + 4 * t for t in range(3)]
        state = None if kind == "sgd" else torch.rand(flat.numel() if kind == "adagrad" else sum(sizes) + 12)
        results = []
        for impl in ("native", "fbgemm"):
            monkeypatch.setenv("TDB_KERNELS", impl)
            w, m = flat.clone(), None if state is None else state.clone()
            with fbgemm_calls() as seen:
                torch.ops.tdb.sparse_update(w, offs, DIMS, ROWS, grad, ids, offsets, psw, kind, m,
                                            m_offs if state is not None else [], None, [], **HYPER)
            results.append((w, m, seen))
        (ours, our_m, none), (theirs, their_m, called) = results
        assert none == [], f"{kind}: the native kernel called fbgemm: {none}"
        # the op CUDA calls too, running fbgemm's CPU kernel under it; nothing else (no forward)
        assert called == [f"split_embedding_backward_codegen_{kind}_{which}_pt2_wrapper",
                          f"split_embedding_backward_codegen_{kind}_cpu"], (kind, called)
        assert not torch.equal(theirs, flat), kind
        torch.testing.assert_close(theirs, ours, msg=lambda m, k=kind: f"{k}: weights: {m}")
        if state is not None:
            torch.testing.assert_close(their_m, our_m, msg=lambda m, k=kind: f"{k}: state: {m}")


def test_fbgemm_backward_arguments_by_name():
    """Every argument of fbgemm's backward ops (each kind it implements here, weighted or not) is one this
    package names; an argument it does not know is refused by name, not passed positionally."""
    cpu = torch.device("cpu")
    flat, offs, ids, offsets, _ = _storage(5)
    args = fbgemm.table_args(tuple(offs), tuple(DIMS), tuple(ROWS), cpu)
    for kind in [k for k in OptimKind if k.fbgemm_cpu]:
        state = kernels.State(torch.zeros(flat.numel()), offs, None, (), 1)
        hyper = Hyper(kind, 0.1, 1e-2, 0.0, WeightDecayMode.NONE, 0.9, 0.99)
        values = fbgemm.backward_values(flat, args, kernels.Batch(ids, offsets, None), torch.zeros(6, sum(DIMS)),
                                        state, hyper)
        for weighted in (False, True):
            schema = fbgemm.backward_op(kind, weighted).default._schema
            missing = [a.name for a in schema.arguments if a.name not in values and not a.has_default_value()]
            assert missing == [], (kind.name, weighted, missing)
        del values["max_D"]
        with pytest.raises(ValueError, match="'max_D'"):
            fbgemm.run_backward_op(kind, values)


def test_cuda_tables_choose_fbgemm_where_its_cuda_build_can(monkeypatch):
    """CUDA: fbgemm's CUDA kernels where its CUDA build is installed on every rank and they can do the work
    (no weight decay in an update), torch's otherwise; ours never (CPU only)."""
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("TDB_KERNELS", raising=False)
    assert fbgemm.cuda_available() is False, "the CPU build: its CUDA registrations have no kernels under them"
    assert kernels.pool_impl(cuda) is kernels.Impl.TORCH and kernels.choice_code(cuda) == 0
    monkeypatch.setattr(fbgemm, "cuda_available", lambda: True)
    try:
        assert kernels.choice_code(cuda) == 2
        assert kernels.pool_impl(cuda) is kernels.dense_impl(cuda) is kernels.Impl.FBGEMM
        for kind in ("sgd", "rowwise_adagrad", "adagrad", "adam"):
            assert kernels.update_impl(cuda, kind, 0.0) is kernels.Impl.FBGEMM, kind
            assert kernels.update_impl(cuda, kind, 0.01) is kernels.Impl.TORCH, kind
        kernels.settle(cuda, [2, 0])  # another rank without fbgemm's CUDA build
        assert kernels.pool_impl(cuda) is kernels.Impl.TORCH
        kernels.settle(cuda, [2, 2])
        assert kernels.pool_impl(cuda) is kernels.Impl.FBGEMM
        monkeypatch.setenv("TDB_KERNELS", "torch")
        assert kernels.pool_impl(cuda) is kernels.Impl.TORCH
        monkeypatch.setenv("TDB_KERNELS", "native")
        assert kernels.pool_impl(cuda) is kernels.Impl.TORCH
        assert kernels.pool_impl(torch.device("meta")) is kernels.Impl.TORCH
    finally:
        kernels.choose._agreed.clear()


def test_the_one_pass_id_check_of_cuda_tables():
    """The CUDA implementations' id check (one pass on the device, one synchronisation), run on CPU tensors:
    every table's ids inside its own rows, offsets in order; a problem named as the CPU check names it."""
    from torchrec_dtensor_bridge.kernels import ops

    _, _, ids, offsets, _ = _storage(3)
    ops.check_ids_on_device("pool_sum", ids, offsets, ROWS, 6)
    first = int(offsets[6])  # table 1's first id
    for at, value, match in ((0, ROWS[0], "ids of table 0"), (0, -1, "ids of table 0"),
                             (first, ROWS[1], "ids of table 1"), (ids.numel() - 1, ROWS[2], "ids of table 2")):
        bad = ids.clone()
        bad[at] = value
        with pytest.raises(ValueError, match=match):
            ops.check_ids_on_device("pool_sum", bad, offsets, ROWS, 6)
    bad_offsets = offsets.clone()
    bad_offsets[3] = bad_offsets[5] + 1
    with pytest.raises(ValueError, match="offsets"):
        ops.check_ids_on_device("pool_sum", ids, bad_offsets, ROWS, 6)
    ops.check_ids_on_device("pool_sum", ids[:0], torch.zeros(19, dtype=torch.int64), ROWS, 6)  # empty bags


def test_an_update_bumps_the_version_of_what_it_writes(impl):
    """As an in-place op: the weights' and state's version counters move, so a graph that saved the weights
    refuses its backward after an update instead of using changed values."""
    if impl == "torch":
        pytest.skip("the torch-op update math lives in optim/, not behind the op")
    args = list(_op_args()["sparse_update"])
    leaf = args[0].clone().requires_grad_()
    saved = (leaf * leaf).sum()  # saves leaf for its backward
    args[0] = leaf.detach()  # shares leaf's version counter
    versions = (args[0]._version, args[9]._version)
    torch.ops.tdb.sparse_update(*args)
    assert args[0]._version > versions[0] and args[9]._version > versions[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


def test_pooling_over_a_large_storage_runs_the_rules_kernel_from_its_first_call(monkeypatch):
    """No trial and no timing: the first pooled sum over a storage past the caches runs the kernel the rule
    names, as every later one (the first run of a job is like every later run)."""
    monkeypatch.delenv("TDB_KERNELS", raising=False)
    storage = torch.zeros((300 << 20) // 4 // 128, 128)  # 300 MiB, pages unread
    g = torch.Generator().manual_seed(3)
    storage[:1000] = torch.rand(1000, 128, generator=g)
    ids = torch.randint(0, 1000, (60,), generator=g)
    offsets = torch.arange(0, 61, 6)
    want = F.embedding_bag(ids, storage[:1000], offsets[:-1], mode="sum")
    rule = kernels.choose.rule_for("pool", torch.float32).pick(storage.numel() * 4)
    assert kernels.pool_impl(storage.device, torch.float32, storage.numel() * 4) is rule
    ours, theirs = "tdb_native::pool_sum", "fbgemm::split_embedding_codegen_forward_cpu"
    if rule is kernels.Impl.FBGEMM:
        ours, theirs = theirs, ours
    for _ in range(3):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            (out,) = kernels.pool([kernels.Pooling(storage, ids, offsets, None, False, None)])
        names = {e.name for e in prof.events()}
        assert ours in names and theirs not in names, names
        assert torch.equal(out[0], want)
