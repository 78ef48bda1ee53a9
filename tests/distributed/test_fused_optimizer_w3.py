"""FusedOptimizer on 3 gloo ranks: every layout, every kind, against a plain unsharded reference.

The reference (:mod:`.sparse_reference`) is written independently of the package: the gradient of
the full table comes from torch's own ``F.embedding_bag`` / ``F.embedding`` over
every rank's batch, and the update is the textbook formula applied to the rows
some batch referenced (fbgemm's sparse ``EXACT_*`` semantics).
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch
import torch.nn.functional as F

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.convert import dtensor_from_local_shards
from torchrec_dtensor_bridge.layout import ShardLayout

from .harness import make_pool_fixture
from .sparse_reference import SparseReference

pool = make_pool_fixture(3)

SHAPE = (12, 6)
LAYOUTS = {
    "row_wise_even": ShardLayout.row_wise(SHAPE, 3),
    "row_wise_uneven": ShardLayout.row_wise(SHAPE, [3, 1, 4, 2, 2], ranks=[0, 1, 2, 0, 1]),
    "table_wise": ShardLayout.table_wise(SHAPE, 2),
    "column_wise_multi": ShardLayout.column_wise(SHAPE, [1, 2, 1, 2], ranks=[0, 1, 0, 2]),
    "table_row_wise": ShardLayout.row_wise(SHAPE, [7, 5], ranks=[1, 2]),
    "grid": ShardLayout.grid(SHAPE, [6, 6], [2, 4], [0, 1, 2, 0]),
    "replicated": ShardLayout.replicated(SHAPE, [0, 1, 2]),
    "replicated_on_two": ShardLayout.replicated(SHAPE, [0, 2]),
}
KINDS = ["sgd", "rowwise_adagrad", "adagrad", "adam"]
HYPER = {"lr": 0.1, "eps": 1e-3, "beta1": 0.8, "beta2": 0.9}
MODES = ["sum", "mean", "max"]
HOT = 5  # a row every rank's batch hits, every step


# ------------------------------------------------------------------ reference
def _table(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def _batch(rank: int, step: int, table: int, psw: bool = False) -> dict:
    """Rank ``rank``'s batch at ``step`` (sizes differ per rank; a duplicate id in a bag; the hot row)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * table + rank)
    n = 2 + rank + step
    lengths = torch.randint(1, 4, (n,), generator=g)
    ids = torch.randint(0, SHAPE[0], (int(lengths.sum()),), generator=g)
    ids[0] = HOT
    ids[-1] = ids[-2] if ids.numel() > 1 and lengths[-1] > 1 else ids[-1]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    out = {"input": ids, "offsets": offsets}
    if psw:
        out["per_sample_weights"] = torch.rand(ids.shape, generator=g) + 0.5
    return out


def _scale(rank: int, step: int, table: int, rows: int) -> torch.Tensor:
    """The output gradient rank ``rank`` feeds back (differs per rank and step)."""
    g = torch.Generator().manual_seed(77 + 1000 * step + 10 * table + rank)
    return torch.randn(rows, SHAPE[1], generator=g)


class Reference(SparseReference):
    """The unsharded optimizer on the full table, with this module's hyper-parameters."""

    def __init__(self, weight: torch.Tensor, kind: str, wd: float = 0.0, decoupled: bool = False) -> None:
        super().__init__(weight, kind, **HYPER, weight_decay=wd, decoupled=decoupled)


def _reference_step(ref: Reference, world: int, step: int, table: int, mode: str, psw: bool,
                    padding_idx: int | None = None, pad_at: int | None = None) -> None:
    full = ref.w.clone().requires_grad_()
    loss = torch.zeros(())
    touched = []
    for r in range(world):
        b = _batch(r, step, table, psw)
        if pad_at is not None:
            b["input"][pad_at] = padding_idx
        if mode == "embedding":
            out = F.embedding(b["input"], full, padding_idx=padding_idx)
        else:
            out = F.embedding_bag(b["input"], full, b["offsets"], mode=mode,
                                  per_sample_weights=b.get("per_sample_weights"), padding_idx=padding_idx)
        loss = loss + (out * _scale(r, step, table, out.shape[0])).sum()
        touched.append(b["input"])
    (grad,) = torch.autograd.grad(loss, full)
    rows = torch.cat(touched).unique()
    if padding_idx is not None:
        rows = rows[rows != padding_idx]
    ref.apply(grad, rows)


def _weight(layout: ShardLayout, table: torch.Tensor, rank: int):
    shards = [table[s.slices()].clone() for s in layout.shards_on(rank)]
    return dtensor_from_local_shards(layout, shards).requires_grad_()


def _check_state(opt, refs: dict[str, Reference]) -> None:
    sd = opt.state_dict()
    want = {k: v for name, ref in refs.items() for k, v in ref.state(name).items()}
    assert sorted(sd) == sorted(want), (sorted(sd), sorted(want))
    for k, v in sd.items():
        got = tdb.full_tensor(v) if isinstance(v, torch.distributed.tensor.DTensor) else v
        torch.testing.assert_close(got, want[k], msg=lambda m, k=k: f"{k}: {m}")


# ------------------------------------------------------------------ checks
def check_every_layout(rank: int, world: int, kind: str, names: list[str], steps: int = 3) -> None:
    """All layouts as the tables of ONE sharded_embedding_bags call per step (fused exchanges)."""
    tables = {n: _table(i) for i, n in enumerate(names)}
    weights = {n: _weight(LAYOUTS[n].with_name(n), tables[n], rank) for n in names}
    opt = tdb.FusedOptimizer(weights, kind, lr=HYPER["lr"], eps=HYPER["eps"], beta1=HYPER["beta1"],
                             beta2=HYPER["beta2"])
    refs = {n: Reference(tables[n], kind) for n in names}
    for step in range(steps):
        modes = [MODES[(t + step) % 3] for t in range(len(names))]
        psws = [m == "sum" for m in modes]
        batches = [_batch(rank, step, t, p) for t, p in enumerate(psws)]
        for b in batches:
            if "per_sample_weights" in b:
                b["per_sample_weights"].requires_grad_()
        outs = tdb.sharded_embedding_bags(
            [b["input"] for b in batches], list(weights.values()), [b["offsets"] for b in batches], mode=modes,
            per_sample_weights=[b.get("per_sample_weights") for b in batches], optimizer=opt,
        )
        loss = sum((o * _scale(rank, step, t, o.shape[0])).sum() for t, o in enumerate(outs))
        loss.backward()
        for t, n in enumerate(names):
            if psws[t]:  # computed from the rows forward saw, before the update
                want = _psw_reference(refs[n].w, batches[t], _scale(rank, step, t, outs[t].shape[0]))
                torch.testing.assert_close(batches[t]["per_sample_weights"].grad, want)
            _reference_step(refs[n], world, step, t, modes[t], psws[t])
    for n, w in weights.items():
        assert w.grad is None, f"{n}: weight.grad was set"
        torch.testing.assert_close(tdb.full_tensor(w), refs[n].w, msg=lambda m, n=n: f"{n} ({kind}): {m}")
    _check_state(opt, refs)


@pytest.mark.parametrize("kind", KINDS)
def test_parity_every_layout(pool, kind):
    pool.run(check_every_layout, kind, sorted(LAYOUTS))


def check_single_table(rank: int, world: int, kind: str, names: list[str]) -> None:
    """sharded_embedding (un-pooled, padding row never trained) and sharded_embedding_bag, one table each."""
    pad = 3
    for t, n in enumerate(names):
        table = _table(10 + t)
        w = _weight(LAYOUTS[n].with_name(n), table, rank)
        opt = tdb.FusedOptimizer([w], kind, lr=HYPER["lr"], eps=HYPER["eps"], beta1=HYPER["beta1"],
                                 beta2=HYPER["beta2"])
        ref = Reference(table, kind)
        for step in range(3):
            b = _batch(rank, step, t)
            b["input"][1] = pad
            if step == 1:
                out = tdb.sharded_embedding_bag(b["input"], w, b["offsets"], mode="mean", padding_idx=pad,
                                                optimizer=opt)
            else:
                out = tdb.sharded_embedding(b["input"], w, padding_idx=pad, optimizer=opt)
            (out * _scale(rank, step, t, out.shape[0])).sum().backward()
            _reference_step(ref, world, step, t, "mean" if step == 1 else "embedding", False, padding_idx=pad,
                            pad_at=1)
        assert w.grad is None
        torch.testing.assert_close(tdb.full_tensor(w), ref.w, msg=lambda m, n=n: f"{n} ({kind}): {m}")
        _check_state(opt, {"0": ref})


@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adam"])
def test_parity_single_table_and_unpooled(pool, kind):
    pool.run(check_single_table, kind, ["grid", "replicated_on_two", "column_wise_multi", "row_wise_uneven"])


def check_weight_decay(rank: int, world: int) -> None:
    """Weight decay of every kind (row-wise Adagrad: L2 and decoupled), through the native update kernel
    (row-wise, every piece alone) and the torch path (column cuts, replicas)."""
    cases = [("rowwise_adagrad", "l2"), ("rowwise_adagrad", "decoupled"), ("sgd", "l2"), ("adagrad", "l2"),
             ("adam", "l2")]
    for kind, mode in cases:
        for t, n in enumerate(["row_wise_uneven", "column_wise_multi", "replicated"]):
            table = _table(20 + t)
            w = _weight(LAYOUTS[n].with_name(n), table, rank)
            opt = tdb.FusedOptimizer([w], kind, lr=HYPER["lr"], eps=HYPER["eps"], beta1=HYPER["beta1"],
                                     beta2=HYPER["beta2"], weight_decay=0.3, weight_decay_mode=mode)
            ref = Reference(table, kind, wd=0.3, decoupled=mode == "decoupled")
            for step in range(2):
                b = _batch(rank, step, t, psw=True)
                out = tdb.sharded_embedding_bag(b["input"], w, b["offsets"], mode="sum",
                                                per_sample_weights=b["per_sample_weights"], optimizer=opt)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    (out * _scale(rank, step, t, out.shape[0])).sum().backward()
                if n == "row_wise_uneven":  # each piece alone: the native kernel decays it (Adam too)
                    names = {e.name for e in prof.events()}
                    assert {"tdb::sparse_update", f"tdb::native_update_{kind}"} <= names, (kind, mode)
                _reference_step(ref, world, step, t, "sum", True)
            torch.testing.assert_close(tdb.full_tensor(w), ref.w, msg=lambda m, n=n: f"{n} {kind} {mode}: {m}")
            _check_state(opt, {"0": ref})


def test_weight_decay_every_kind(pool):
    pool.run(check_weight_decay)


def check_update_kernels(rank: int, world: int) -> list[str]:
    """Row-wise tables update in one pass over the touched rows (seen by torch's profiler): through this
    package's native kernel with ``TDB_KERNELS=native``, through fbgemm's backward-with-optimizer kernels with
    ``TDB_KERNELS=fbgemm``, both through the one op ``tdb::sparse_update``; both give the reference's rows (checked against each other here, and
    against the unsharded optimizer by the parity tests)."""
    seen = []
    results: dict[str, dict[str, torch.Tensor]] = {}
    for native_on in (True, False):
        os.environ["TDB_KERNELS"] = "native" if native_on else "fbgemm"
        try:
            for kind in ("sgd", "rowwise_adagrad", "adagrad"):
                w = _weight(LAYOUTS["row_wise_even"], _table(0), rank)
                opt = tdb.FusedOptimizer([w], kind, lr=0.1)
                b = _batch(rank, 0, 0, psw=True)
                out = tdb.sharded_embedding_bag(b["input"], w, b["offsets"], mode="sum", optimizer=opt,
                                                per_sample_weights=b["per_sample_weights"])
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    out.sum().backward()
                names = {e.name for e in prof.events()}
                fbgemm_op = f"fbgemm::split_embedding_backward_codegen_{kind}_cpu"
                ours = f"tdb::native_update_{kind}"
                want, not_want = (ours, fbgemm_op) if native_on else (fbgemm_op, ours)
                assert want in names and not_want not in names, sorted(n for n in names if "::" in n)
                assert "tdb::sparse_update" in names
                seen.append(want)
                results.setdefault(kind, {})[want] = tdb.full_tensor(w.detach())
        finally:
            os.environ.pop("TDB_KERNELS", None)
    for kind, got in results.items():
        a, b = got.values()
        torch.testing.assert_close(a, b, msg=lambda m: f"{kind}: native vs fbgemm kernel: {m}")
    return seen


def test_update_kernels_native_and_fbgemm(pool):
    seen = pool.run(check_update_kernels)[0]
    assert seen[:3] == [f"tdb::native_update_{k}" for k in ("sgd", "rowwise_adagrad", "adagrad")]
    assert seen[3:] == [f"fbgemm::split_embedding_backward_codegen_{k}_cpu" for k in ("sgd", "rowwise_adagrad", "adagrad")]


def _peak_growth(fn) -> int:
    """Bytes the resident set grew to above its level before ``fn`` (free heap pages handed back and the
    peak reset first, so that memory ``fn`` allocates shows whatever earlier calls left behind; Linux)."""
    def field(name: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(name))
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = field("VmRSS:")
    fn()
    return field("VmHWM:") - before


def check_ranks_disagree_on_the_optimizer(rank: int, world: int) -> list[str]:
    """One rank's optimizer differs (its kind, its lr, or it passes none): every rank raises before any
    update, naming what differs, and the next good step runs on every rank."""
    table = _table(0)
    w = _weight(LAYOUTS["row_wise_uneven"].with_name("t"), table, rank)
    before = tdb.full_tensor(w.detach()).clone()
    b = _batch(rank, 0, 0, False)
    cases = {
        "kind": lambda: tdb.FusedOptimizer([w], "sgd" if rank == 1 else "adagrad", lr=0.1),
        "lr": lambda: tdb.FusedOptimizer([w], "sgd", lr=0.2 if rank == 2 else 0.1),
        "none": lambda: None if rank == 0 else tdb.FusedOptimizer([w], "sgd", lr=0.1),
    }
    messages = []
    for what, make in cases.items():
        opt = make()
        with pytest.raises(ValueError) as err:
            out = tdb.sharded_embedding_bags([b["input"]], [w], [b["offsets"]], optimizer=opt)[0]
            out.sum().backward()
        messages.append(f"{what}: {err.value}")
        assert torch.equal(tdb.full_tensor(w.detach()), before), f"{what}: the weight changed"
        assert w.grad is None
    opt = tdb.FusedOptimizer([w], "sgd", lr=0.1)  # the same on every rank: trains
    tdb.sharded_embedding_bags([b["input"]], [w], [b["offsets"]], optimizer=opt)[0].sum().backward()
    assert not torch.equal(tdb.full_tensor(w.detach()), before)
    return messages


def test_ranks_that_disagree_on_the_optimizer_all_raise(pool):
    for messages in pool.run(check_ranks_disagree_on_the_optimizer):
        kind, lr, none = messages
        assert "optimizer" in kind, kind
        assert "hyper-parameters differ between ranks" in lr and "lr" in lr, lr
        assert "optimizer" in none, none


ROWS_NO_BUFFER = 600_000


def check_no_table_sized_buffer(rank: int, world: int, layout: str, kind: str | None) -> list[int]:
    """Peak memory growth of training steps on a ~26 MB shard: a fraction of the shard with the optimizer (the
    column-cut row-wise Adagrad path's temporaries are O(batch), ~2.5 MB here: the shard is large enough that
    a quarter of it still separates them from any shard-sized buffer)."""
    rows, dim = ROWS_NO_BUFFER, 32
    lay = {"row_wise": ShardLayout.row_wise((rows, dim), 3),
           "column_wise": ShardLayout.column_wise((rows, dim), [10, 11, 11])}[layout]
    shards = [torch.empty(s.sizes).uniform_() for s in lay.shards_on(rank)]
    w = dtensor_from_local_shards(lay, shards).requires_grad_()
    opt = None if kind is None else tdb.FusedOptimizer([w], kind, lr=0.1)
    g = torch.Generator().manual_seed(rank)

    def step() -> None:
        ids = torch.randint(0, rows, (256 * 8,), generator=g)
        out = tdb.sharded_embedding_bag(ids, w, torch.arange(0, ids.numel(), 8), mode="sum", optimizer=opt)
        out.sum().backward()
        w.grad = None

    step()  # warm-up: lazily built caches, first collectives
    growth = [_peak_growth(step) for _ in range(2)]
    if kind is not None:
        assert w.grad is None
    return growth


@pytest.mark.parametrize("layout,kind", [("row_wise", "rowwise_adagrad"), ("column_wise", "rowwise_adagrad"),
                                         ("row_wise", "adam")])
def test_no_table_sized_buffer_per_step(pool, layout, kind):
    shard_bytes = ROWS_NO_BUFFER * 32 * 4 // 3
    fused = pool.run(check_no_table_sized_buffer, layout, kind)
    assert max(max(g) for g in fused) < shard_bytes // 4, (fused, shard_bytes)
    if layout == "row_wise" and kind == "adam":  # the measure sees a dense gradient: it can fail
        dense = pool.run(check_no_table_sized_buffer, layout, None)
        assert max(max(g) for g in dense) > shard_bytes // 2, (dense, shard_bytes)


def _psw_reference(table: torch.Tensor, b: dict, scale: torch.Tensor, **kw) -> torch.Tensor:
    psw = b["per_sample_weights"].detach().clone().requires_grad_()
    out = F.embedding_bag(b["input"], table, b["offsets"], mode="sum", per_sample_weights=psw, **kw)
    (out * scale).sum().backward()
    return psw.grad


def check_psw_grad(rank: int, world: int, names: list[str]) -> None:
    """per_sample_weights gradients (no optimizer: dense weight gradients too), several tables in one call,
    with padding_idx and max_norm on some."""
    tables = [_table(40 + t) for t in range(len(names))]
    weights = [_weight(LAYOUTS[n].with_name(n), tables[t], rank) for t, n in enumerate(names)]
    batches = [_batch(rank, 1, t, psw=True) for t in range(len(names))]
    psws = [b["per_sample_weights"].clone().requires_grad_() for b in batches]
    pads = [3 if t % 2 else None for t in range(len(names))]
    norms = [1.0 if t % 3 == 0 else None for t in range(len(names))]
    outs = tdb.sharded_embedding_bags([b["input"] for b in batches], weights, [b["offsets"] for b in batches],
                                      mode="sum", per_sample_weights=psws, padding_idx=pads, max_norm=norms)
    scales = [_scale(rank, 1, t, o.shape[0]) for t, o in enumerate(outs)]
    sum((o * c).sum() for o, c in zip(outs, scales)).backward()
    for t, n in enumerate(names):
        full = tables[t].clone()
        if norms[t] is not None:  # the renormalisation every rank's ids caused, as the sharded lookup did
            ids = torch.cat([_batch(r, 1, t)["input"] for r in range(world)])
            F.embedding(ids, full, max_norm=norms[t])
        want = _psw_reference(full, batches[t], scales[t], padding_idx=pads[t])
        torch.testing.assert_close(psws[t].grad, want, msg=lambda m, n=n: f"{n}: {m}")
        assert weights[t].grad is not None


def test_per_sample_weights_gradient_every_layout(pool):
    pool.run(check_psw_grad, sorted(LAYOUTS))


def check_psw_grad_dtensor_input_refused(rank: int, world: int) -> None:
    from torch.distributed.tensor import Replicate

    from torchrec_dtensor_bridge.convert.placements import world_mesh

    w = _weight(LAYOUTS["grid"], _table(0), rank)
    b = _batch(0, 0, 0, psw=True)
    mesh = world_mesh("cpu")
    ids = torch.distributed.tensor.DTensor.from_local(b["input"], mesh, [Replicate()])
    with pytest.raises(NotImplementedError, match="per_sample_weights"):
        tdb.sharded_embedding_bag(ids, w, b["offsets"], mode="sum",
                                  per_sample_weights=b["per_sample_weights"].requires_grad_())


def test_per_sample_weights_gradient_dtensor_input_refused(pool):
    pool.run(check_psw_grad_dtensor_input_refused)


def check_replicated_input(rank: int, world: int, kind: str, names: list[str]) -> None:
    """A Replicate() DTensor batch (the same on every rank, no exchange in forward): the update of that batch."""
    from torch.distributed.tensor import DTensor, Replicate

    from torchrec_dtensor_bridge.convert.placements import world_mesh

    mesh = world_mesh("cpu")
    for t, n in enumerate(names):
        table = _table(50 + t)
        w = _weight(LAYOUTS[n].with_name(n), table, rank)
        opt = tdb.FusedOptimizer([w], kind, lr=HYPER["lr"], eps=HYPER["eps"], beta1=HYPER["beta1"],
                                 beta2=HYPER["beta2"])
        ref = Reference(table, kind)
        for step in range(2):
            b = _batch(0, step, t)  # rank 0's batch, on every rank
            ids, offsets = (DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                            for x in (b["input"], b["offsets"]))
            out = tdb.sharded_embedding_bag(ids, w, offsets, mode="mean", optimizer=opt)
            g = _scale(0, step, t, out.shape[0])
            (out.full_tensor() * g).sum().backward()
            full = ref.w.clone().requires_grad_()
            (F.embedding_bag(b["input"], full, b["offsets"], mode="mean") * g).sum().backward()
            ref.apply(full.grad, b["input"].unique())
        assert w.grad is None
        torch.testing.assert_close(tdb.full_tensor(w), ref.w, msg=lambda m, n=n: f"{n} ({kind}): {m}")
        _check_state(opt, {"0": ref})


@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adam"])
def test_parity_replicated_dtensor_input(pool, kind):
    pool.run(check_replicated_input, kind, ["grid", "replicated", "replicated_on_two", "column_wise_multi",
                                            "row_wise_even"])


RESUME = {  # table -> (kind, layout on 2 ranks before, layout on 3 ranks after)
    "t0": ("rowwise_adagrad", ShardLayout.row_wise(SHAPE, 2), LAYOUTS["grid"]),
    "t1": ("adam", ShardLayout.column_wise(SHAPE, [2, 4]), LAYOUTS["row_wise_uneven"]),
}


def _resume_setup(rank: int, after: bool) -> tuple[dict, dict]:
    weights = {n: _weight((lay2 if after else lay1).with_name(n), _table(30 + t), rank)
               for t, (n, (_, lay1, lay2)) in enumerate(RESUME.items())}
    opts = {n: tdb.FusedOptimizer({n: weights[n]}, kind, lr=HYPER["lr"], eps=HYPER["eps"], beta1=HYPER["beta1"],
                                  beta2=HYPER["beta2"]) for n, (kind, _, _) in RESUME.items()}
    return weights, opts


def _resume_step(rank: int, step: int, weights: dict, opts: dict) -> None:
    for t, n in enumerate(RESUME):
        b = _batch(rank, step, t)
        out = tdb.sharded_embedding_bag(b["input"], weights[n], b["offsets"], mode="sum", optimizer=opts[n])
        (out * _scale(rank, step, t, out.shape[0])).sum().backward()


def check_resume_save(rank: int, world: int, path: str) -> None:
    weights, opts = _resume_setup(rank, after=False)
    for step in range(2):
        _resume_step(rank, step, weights, opts)
    sd = dict(weights)
    for o in opts.values():
        sd.update(o.state_dict())
    tdb.checkpoint.save(sd, path)


def check_resume_load(rank: int, world: int, path: str) -> None:
    weights, opts = _resume_setup(rank, after=True)
    with torch.no_grad():
        for w in weights.values():
            for s in tdb.convert.local_shards_of(w):
                s.fill_(-9.0)
    sd = dict(weights)
    for o in opts.values():
        sd.update(o.state_dict())
    tdb.checkpoint.load(sd, path)
    for o in opts.values():
        o.load_state_dict({k: sd[k] for k in o.state_dict()})
    _resume_step(rank, 2, weights, opts)
    for t, (n, (kind, _, _)) in enumerate(RESUME.items()):
        ref = Reference(_table(30 + t), kind)
        for step, ranks in ((0, 2), (1, 2), (2, 3)):  # 2 steps on 2 ranks, then 1 on 3 ranks
            _reference_step(ref, ranks, step, t, "sum", False)
        torch.testing.assert_close(tdb.full_tensor(weights[n]), ref.w, msg=lambda m, n=n: f"{n}: {m}")
        _check_state(opts[n], {n: ref})


def test_resume_under_another_layout_and_world_size(pool, tmp_path):
    from .harness import ProcessGroupPool

    two = ProcessGroupPool(2)
    try:
        two.run(check_resume_save, str(tmp_path / "ckpt"))
    finally:
        two.close()
    pool.run(check_resume_load, str(tmp_path / "ckpt"))
