"""The limits of fbgemm's CUDA kernels, and the id checks of a lookup's kernel calls, on fake ``cuda:0`` tensors
(the machinery of ``test_fake_cuda.py``, in its subprocess).

fbgemm_gpu 1.8's CUDA forward and backward refuse tables wider than 2048 columns, rows that are not 16-byte
aligned, no columns at all, and more than int32's ids or bag boundaries; its fakes here refuse the same
(:func:`.test_fake_cuda.fbgemm_refuses`, written from fbgemm's sources). For each limit, a call just past it
and one at it:

* past it, pooling and the dense gradient choose torch's ops (and no fbgemm op is called; tables without
  columns give zeros, where fbgemm's dense gradient lays the tables out itself it runs), a fused update is
  refused by the op before anything runs, and the kernel calls a lookup makes keep such shards from the op
  (``kernels.accepts``, ``kernels.update_supported``);
* at it, fbgemm's kernels run.

Besides: the kernel calls split a group whose batches together break a limit each one meets alone; ids, bag
boundaries and per-sample weights reach fbgemm contiguous whatever their strides; the kernel calls of a
lookup (``kernels.pool``, ``weight_grad``, ``update``) make no id check in the ops and read nothing back to
the host, while a direct call of an op checks its ids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from torchrec_dtensor_bridge.kernels import fbgemm

from .test_fake_cuda import BAGS, DEV, INT32_MAX, Recorder, Tables, choices, given, one_call

pytestmark = pytest.mark.skipif(not fbgemm.available(), reason="needs fbgemm_gpu")

SGD = (None, [], None, [])  # the state arguments of an SGD update: none
HYPER = (0.1, 1e-8, 0.0, 0, 0.9, 0.999, 1)  # lr, eps, weight decay, decay mode, betas, step


@contextmanager
def _no_new_fbgemm_call(rec: Recorder) -> Iterator[None]:
    before = len(rec.calls)
    yield
    assert [c.op for c in rec.calls[before:]] == [], "fbgemm called past its limits"


def _tables(dims: list[int], rows: list[int], *, at: list[int] | None = None, start: int = 0) -> Tables:
    """Tables of one fake CUDA storage, each at an element offset a multiple of 4 (or ``at``); the storage
    ``start`` elements into its allocation."""
    if at is None:
        at, end = [], 4
        for r, d in zip(rows, dims):
            at.append(end)
            end += (r * d + 3) // 4 * 4 + 4
    size = max(o + r * d for o, r, d in zip(at, rows, dims)) + 4
    return Tables(torch.empty(size + start, device=DEV).narrow(0, start, size), at, dims, rows)


def _ids(n: int, bags: int, tables: int, dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(n, dtype=dtype, device=DEV), torch.empty(tables * bags + 1, dtype=dtype, device=DEV))


def _pool(t: Tables, ids: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.tdb.pool_sum(t.storage, t.at, t.dims, t.rows, ids, offsets, psw)


def _dense(t: Tables, grad: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
           psw: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.tdb.pool_sum_backward(grad, t.dims, t.rows, ids, offsets, psw)


def _update(t: Tables, grad: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor | None = None,
            kind: str = "sgd", state: tuple = SGD) -> None:
    torch.ops.tdb.sparse_update(t.storage, t.at, t.dims, t.rows, grad, ids, offsets, psw, kind, *state, *HYPER)


Case = tuple[Tables, torch.Tensor, torch.Tensor]


def _limits() -> dict[str, tuple[Callable[[], Case], Callable[[], Case], str]]:
    """Per limit: a call just past it, one at it (tables, ids, offsets), and what the refusal names. (Where the
    tables lie in their storage, :data:`WHERE`, does not matter to the dense gradient: fbgemm computes it in a
    buffer of its own.)"""
    def case(dims: list[int], rows: list[int], n: int = 3 * BAGS, bags: int = BAGS, **kw: Any) -> Callable[[], Case]:
        return lambda: (_tables(dims, rows, **kw), *_ids(n, bags, len(dims)))

    return {
        "width": (case([2052], [3]), case([2048], [3]), "max_D <= 2048"),
        "no_columns": (case([0], [5]), case([0, 4], [5, 5]), "total_D > 0"),
        "dims_of_4": (case([4, 6], [5, 5]), case([4, 8], [5, 5]), "16-byte aligned"),
        "offset_of_4": (case([4], [5], at=[2]), case([4], [5], at=[8]), "16-byte aligned"),
        "aligned_start": (case([4], [5], start=2), case([4], [5], start=4), "16-byte aligned"),
        "ids": (case([4], [10], n=INT32_MAX), case([4], [10], n=INT32_MAX - 1), "ids (fbgemm: fewer than"),
        # two tables: 2 * 2**30 + 1 boundaries, one past int32; 2 * (2**30 - 1) + 1, at it (and B at the
        # info bits fbgemm's lookup function checks it against: 2**30 - 1 for two tables)
        "bags": (case([4, 4], [10, 10], bags=2**30), case([4, 4], [10, 10], bags=2**30 - 1), "bag boundaries"),
    }


LIMITS = list(_limits())
WHERE = ("offset_of_4", "aligned_start")


def _check_limit(rec: Recorder, name: str) -> None:
    past, at, names = _limits()[name]
    t, ids, offsets = past()
    bags, width = (offsets.numel() - 1) // len(t.dims), sum(t.dims)
    grad = torch.empty(bags, width, device=DEV)
    with choices() as chosen:
        with _no_new_fbgemm_call(rec):
            out = _pool(t, ids, offsets)
            assert tuple(out.shape) == (bags, width) and out.device == torch.device(DEV)
            if name not in WHERE:
                _dense(t, grad, ids, offsets)
            with pytest.raises(ValueError, match="beyond fbgemm's CUDA kernels") as refused:
                _update(t, grad, ids, offsets)
            assert names in str(refused.value), refused.value
        if name in WHERE:
            one_call(rec, lambda: _dense(t, grad, ids, offsets), backward=True)
    want = [] if name == "no_columns" else ["TORCH", "FBGEMM" if name in WHERE else "TORCH"]  # no columns: zeros
    assert chosen == want, f"past the limit: {chosen}"
    t, ids, offsets = at()
    bags = (offsets.numel() - 1) // len(t.dims)
    grad = torch.empty(bags, sum(t.dims), device=DEV)
    with choices() as chosen:
        one_call(rec, lambda: _pool(t, ids, offsets))
        one_call(rec, lambda: _dense(t, grad, ids, offsets), backward=True)
        one_call(rec, lambda: _update(t, grad, ids, offsets), backward=True)
    assert chosen == ["FBGEMM", "FBGEMM"], f"at the limit: {chosen}"


def _check_state_alignment(rec: Recorder) -> None:
    """An element-wise state is read like the rows: a state table at an element offset not a multiple of 4
    is refused, one at a multiple of 4 updated."""
    t, ids, offsets = _tables([4], [5]), *_ids(3 * BAGS, BAGS, 1)
    grad = torch.empty(BAGS, 4, device=DEV)
    state = torch.empty(40, device=DEV)
    with _no_new_fbgemm_call(rec), pytest.raises(ValueError, match="state rows not 16-byte aligned"):
        _update(t, grad, ids, offsets, kind="adagrad", state=(state, [2], None, []))
    one_call(rec, lambda: _update(t, grad, ids, offsets, kind="adagrad", state=(state, [8], None, [])),
             backward=True)


def _hyper() -> Any:
    from torchrec_dtensor_bridge.optim_kinds import Hyper, WeightDecayMode, lookup

    return Hyper(lookup("sgd"), 0.1, 1e-8, 0.0, WeightDecayMode.NONE, 0.9, 0.999)


def _check_the_calls_keep_shards_from_the_ops(rec: Recorder) -> None:
    """``kernels.accepts`` / ``kernels.update_supported``: shards (and batches) past a limit go to torch before
    any op is called; ``kernels.pool`` and ``weight_grad`` run torch's ops on them, as on int32 ids."""
    from torchrec_dtensor_bridge import kernels
    from torchrec_dtensor_bridge.kernels import calls

    hyper = _hyper()
    for width, ok in ((2048, True), (2052, False), (0, False), (6, False)):
        shard = torch.empty(3, width, device=DEV)
        assert kernels.accepts(shard) is ok and kernels.update_supported(shard, hyper) is ok, width
    shard = torch.empty(10, 4, device=DEV)
    ids, offsets = _ids(3 * BAGS, BAGS, 1)
    assert kernels.update_supported(shard, hyper, ids=ids, offsets=offsets)
    assert not kernels.update_supported(shard, hyper, ids=torch.empty(INT32_MAX, dtype=torch.int64, device=DEV),
                                        offsets=offsets)
    assert not kernels.update_supported(shard, hyper, ids=ids, offsets=torch.empty(INT32_MAX + 1, dtype=torch.int64,
                                                                                    device=DEV))
    assert not kernels.update_supported(shard, hyper, ids=ids.int(), offsets=offsets.int())
    wide = torch.empty(3, 2052, device=DEV)
    torch_grads: list[torch.Tensor] = []  # torch's dense gradient: recorded (it slices, which fake CUDA cannot)
    add_bag_grads = calls.add_bag_grads
    calls.add_bag_grads = lambda out, *rest: torch_grads.append(out) or out  # type: ignore[assignment]
    try:
        for s, (i, o) in ((wide, (ids, offsets)), (shard, (ids.int(), offsets.int()))):
            with choices() as chosen, _no_new_fbgemm_call(rec):
                (out, _), = kernels.pool([kernels.Pooling(s, i, o, None, False)])
                assert tuple(out.shape) == (BAGS, s.shape[1])
                kernels.weight_grad(torch.empty(BAGS, s.shape[1], device=DEV), kernels.Pooling(s, i, o, None, False))
            assert chosen == [], f"the ops called: {chosen}"
    finally:
        calls.add_bag_grads = add_bag_grads  # type: ignore[assignment]
    assert [tuple(g.shape) for g in torch_grads] == [(3, 2052), (10, 4)], "torch's dense gradient did not run"


def _check_groups_past_a_limit_split(rec: Recorder) -> None:
    """Two shards of one storage whose batches together hold more ids than fbgemm takes (2**30 each): one call
    per shard; with fewer (2**29 each), one call for both."""
    from torchrec_dtensor_bridge import kernels

    storage = torch.empty(200, device=DEV)
    shards = [storage.narrow(0, 8, 40).view(10, 4), storage.narrow(0, 64, 40).view(10, 4)]
    hyper = _hyper()
    for n, calls in ((2**30, 2), (2**29, 1)):
        batches = [_ids(n, BAGS, 1) for _ in shards]
        grads = [torch.empty(BAGS, 4, device=DEV) for _ in shards]
        before = len(rec.calls)
        kernels.pool([kernels.Pooling(s, i, o, None, False) for s, (i, o) in zip(shards, batches)])
        kernels.update([kernels.Update(s, i, o, None, g, hyper, (), 1) for s, (i, o), g in zip(shards, batches,
                                                                                              grads)])
        made = [c for c in rec.calls[before:] if c.op.endswith(("_function_pt2", "_pt2_wrapper"))]
        assert len(made) == 2 * calls, (n, [c.op for c in made])
        tables = [(c.args["weights"][3] if "weights" in c.args else c.args["weights_offsets"]).numel() for c in made]
        assert tables == [2 // calls] * len(made), f"tables per call: {tables}"


def _check_strided_batches_reach_fbgemm_contiguous(rec: Recorder) -> None:
    """A strided view of ids or per-sample weights (as a lookup can pass them) reaches fbgemm's lookup functions
    and kernels as a contiguous copy: they read them as flat arrays (the fakes refuse strided ones)."""
    t = _tables([4, 8], [10, 12])
    n = 3 * BAGS * 2
    ids = torch.empty(2 * n, dtype=torch.int64, device=DEV).as_strided((n,), (2,))
    offsets = torch.empty(2 * BAGS + 1, dtype=torch.int64, device=DEV)
    psw = torch.empty(3 * n, device=DEV).as_strided((n,), (3,), 1)
    assert not ids.is_contiguous() and not psw.is_contiguous()
    grad = torch.empty(BAGS, 12, device=DEV)
    runs = {"pool": lambda: _pool(t, ids, offsets, psw), "dense": lambda: _dense(t, grad, ids, offsets, psw),
            "update": lambda: _update(t, grad, ids, offsets, psw)}
    for name, run in runs.items():
        call = one_call(rec, run, backward=name != "pool")
        given(call.args["indices"], ids)
        given(call.args["indice_weights"], psw)
        if name == "pool":
            kernel = rec.kernel_args[-1]  # the pooling's forward kernel
            assert kernel["indice_weights"].is_contiguous() and kernel["indices"].is_contiguous()


@contextmanager
def _device_reads() -> Iterator[list[str]]:
    """Every value read back to the host of a tensor on the device (``item``, ``tolist``, ``bool``, ...)."""
    reads: list[str] = []
    names = ("tolist", "item", "__int__", "__bool__", "__index__", "__float__")
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def counted(name: str) -> Callable[..., Any]:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.device.type == "cuda":
                reads.append(name)
            return originals[name](self, *args, **kwargs)
        return read

    for name in names:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield reads
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def _check_lookup_calls_skip_the_ops_id_check(rec: Recorder) -> None:
    """The kernel calls of a lookup (its forward's pooling, its backward's dense gradient and fused update) pass
    ``ids_checked``: no id check in the ops (on a GPU, a synchronisation per op and storage) and no value read
    back to the host; a direct call of each op checks its ids once."""
    from torchrec_dtensor_bridge import kernels

    storage = torch.empty(200, device=DEV)
    shards = [storage.narrow(0, 8, 40).view(10, 4), storage.narrow(0, 64, 48).view(12, 4)]
    batches = [_ids(3 * BAGS, BAGS, 1) for _ in shards]
    grads = [torch.empty(BAGS, 4, device=DEV) for _ in shards]
    hyper = _hyper()
    before, calls = len(rec.id_checks), len(rec.calls)
    with _device_reads() as reads:
        kernels.pool([kernels.Pooling(s, i, o, None, False) for s, (i, o) in zip(shards, batches)])
        for s, (i, o), g in zip(shards, batches, grads):
            kernels.weight_grad(g, kernels.Pooling(s, i, o, None, False))
        kernels.update([kernels.Update(s, i, o, None, g, hyper, (), 1) for s, (i, o), g in zip(shards, batches,
                                                                                              grads)])
    assert len(rec.calls) > calls, "fbgemm's kernels did not run"
    assert rec.id_checks[before:] == [], f"id checks in the ops of a lookup: {rec.id_checks[before:]}"
    assert reads == [], f"values read back to the host: {reads}"
    t = _tables([4], [10])
    ids, offsets = batches[0]
    _pool(t, ids, offsets)
    _dense(t, grads[0], ids, offsets)
    _update(t, grads[0], ids, offsets)
    assert rec.id_checks[before:] == ["pool_sum", "pool_sum_backward", "sparse_update"], rec.id_checks[before:]


def _check_index_dtypes(rec: Recorder) -> None:
    """fbgemm takes int32 or int64 ids and boundaries of one dtype; the ops take int64 only and refuse others by
    name before any kernel runs (the kernel calls send int32 batches to torch's ops: see above)."""
    t = _tables([4], [10])
    ids, offsets = _ids(3 * BAGS, BAGS, 1, torch.int32)
    with _no_new_fbgemm_call(rec):
        for run in (lambda: _pool(t, ids, offsets), lambda: _pool(t, ids.long(), offsets)):
            with pytest.raises(ValueError, match="1-D int64"):
                run()


CHECKS: dict[str, Callable[[Recorder], None]] = {
    **{f"limit-{name}": (lambda rec, n=name: _check_limit(rec, n)) for name in LIMITS},
    "state_alignment": _check_state_alignment,
    "calls_keep_shards_from_the_ops": _check_the_calls_keep_shards_from_the_ops,
    "groups_past_a_limit_split": _check_groups_past_a_limit_split,
    "strided_batches": _check_strided_batches_reach_fbgemm_contiguous,
    "lookup_calls_skip_the_id_check": _check_lookup_calls_skip_the_ops_id_check,
    "index_dtypes": _check_index_dtypes,
}


def checks() -> dict[str, Callable[[Recorder], None]]:
    return CHECKS


# --- the tests -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def results(fake_cuda_results: dict[str, dict[str, str | None]]) -> dict[str, str | None]:
    return fake_cuda_results[__name__]


@pytest.mark.parametrize("name", LIMITS)
def test_past_a_limit_of_fbgemms_cuda_kernels_torch_runs(results, name):
    """Past the limit: pooling and the dense gradient on torch's ops, an update refused, no fbgemm call; at it,
    fbgemm's kernels."""
    assert results[f"limit-{name}"] is None, results[f"limit-{name}"]


@pytest.mark.parametrize("name", [n for n in CHECKS if not n.startswith("limit-")])
def test_fake_cuda_kernel_calls(results, name):
    assert results[name] is None, results[name]

