"""No host synchronisation in the kernel layer's calls from the lookups on CUDA: fake ``cuda:0`` tensors, in one
subprocess (the machinery of ``test_fake_cuda.py``).

Every read of a tensor's value back to the host (``.item()``, ``.tolist()``, ``int(t)``, ``bool(t)``) dispatches
``aten._local_scalar_dense``; on a GPU each waits for the device. A dispatch mode records every such op, with the
package's frame that asked for it; a read that torch guards with the tensor's device first (``int(t)``,
``t.item()``) fails before it dispatches here (this torch has no CUDA), its traceback naming the line. The lookups check their batches at their API edge and call the kernel layer
with ``ids_checked`` (:mod:`torchrec_dtensor_bridge.kernels.calls`): its pooled sums, dense gradients and fused
updates must then read nothing, on fbgemm's kernels, on torch's (``TDB_KERNELS=torch``, and shards fbgemm's
kernels cannot read), for fp32 and fp16 tables, sums and max.

Also here: fbgemm's dense backward gets its weights argument (whose shape alone it reads, its result a
``zeros_like`` of it) without a buffer the size of the tables behind it (``dense-no-scratch``); on CPU:
``test_dense_grad_allocates_no_scratch``.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

from torchrec_dtensor_bridge.kernels import fbgemm

from .test_fake_cuda import DEV, Recorder

pytestmark = pytest.mark.skipif(not fbgemm.available(), reason="needs fbgemm_gpu")

BAGS = 4
HYPER = {"sgd": (), "rowwise_adagrad": ("row",), "adagrad": ("element",), "adam": ("element", "element")}


def _reads_mode(sites: list[str]) -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.aten._local_scalar_dense.default:
                frames = [f for f in traceback.extract_stack() if "torchrec_dtensor_bridge" in f.filename]
                at = frames[-1] if frames else None
                sites.append("?" if at is None else
                             f"{at.filename.rsplit('torchrec_dtensor_bridge/', 1)[-1]}:{at.lineno} {at.line}")
            return func(*args, **(kwargs or {}))

    return Reads()


def _shards(dims: list[int], rows: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Tables of ``dims`` columns in one storage (fake tensors share one ``data_ptr``: the kernel layer groups
    fake tensors as one storage whatever their storages), each 4 elements after the last."""
    flat = torch.empty(sum(rows * d + 4 for d in dims), dtype=dtype, device=DEV)
    out, at = [], 0
    for d in dims:
        out.append(flat.narrow(0, at, rows * d).view(rows, d))
        at += rows * d + 4
    return out


def _requests(shards: list[torch.Tensor], psw: bool, max_mode: bool) -> list[Any]:
    from torchrec_dtensor_bridge import kernels

    out = []
    for s in shards:
        ids = torch.empty(3 * BAGS, dtype=torch.int64, device=DEV)
        offsets = torch.empty(BAGS + 1, dtype=torch.int64, device=DEV)
        weights = torch.empty(ids.numel(), dtype=s.dtype, device=DEV) if psw else None
        out.append(kernels.Pooling(s, ids, offsets, weights, max_mode))
    return out


def _step(dims: list[int], dtype: torch.dtype, *, psw: bool = False, max_mode: bool = False,
          kinds: tuple[str, ...] = tuple(HYPER)) -> None:
    """What one training step of the lookups asks of the kernel layer: the pooled sums (or max), the dense
    gradients, and each kind's fused update."""
    from torchrec_dtensor_bridge import kernels
    from torchrec_dtensor_bridge.optim_kinds import Hyper, WeightDecayMode, lookup

    shards = _shards(dims, 12, dtype)
    requests = _requests(shards, psw, max_mode)
    pooled = kernels.pool(requests)
    grads = [torch.empty(BAGS, s.shape[1], dtype=out.dtype, device=DEV) for s, (out, _) in zip(shards, pooled)]
    kernels.weight_grads([(g, r, argmax) for g, r, (_, argmax) in zip(grads, requests, pooled)])
    if max_mode:
        return
    for kind in kinds:
        hyper = Hyper(lookup(kind), 0.1, 1e-8, 0.0, WeightDecayMode.NONE, 0.9, 0.999, False)
        updates = []
        for s, r, g in zip(shards, requests, grads):
            state = tuple(torch.zeros(s.shape[0] if shape == "row" else s.numel(), device=DEV).view(
                (s.shape[0],) if shape == "row" else s.shape) for shape in HYPER[kind])
            w = None if r.weights is None else r.weights.float()
            if kernels.update_supported(s, hyper, w, ids=r.ids, offsets=r.offsets):
                updates.append(kernels.Update(s, r.ids, r.offsets, w, g.float(), hyper, state, 1))
        kernels.update(updates)


CASES: dict[str, Callable[[], None]] = {
    "fbgemm-fp32": lambda: _step([4, 8], torch.float32),
    "fbgemm-fp32-psw": lambda: _step([8], torch.float32, psw=True),
    "fbgemm-fp16": lambda: _step([8], torch.float16, kinds=("sgd", "rowwise_adagrad")),
    "max": lambda: _step([4, 8], torch.float32, max_mode=True),
    "unaligned": lambda: _step([6], torch.float32),  # shards fbgemm's kernels cannot read
    "wide": lambda: _step([4096], torch.float32, kinds=()),
    "torch-fp32": lambda: _step([4, 8], torch.float32),  # TDB_KERNELS=torch
    "torch-fp16-psw": lambda: _step([8], torch.float16, psw=True, kinds=()),
}


def _check_dense_scratch(rec: Recorder) -> None:
    """fbgemm's CUDA dense backward: its ``dev_weights`` has the tables' shape and an element's storage."""
    from torchrec_dtensor_bridge import kernels

    shards = _shards([4, 8], 50, torch.float32)
    requests = _requests(shards, False, False)
    before = len(rec.calls)
    kernels.weight_grads([(torch.empty(BAGS, s.shape[1], device=DEV), r, None) for s, r in zip(shards, requests)])
    (dense,) = [c for c in rec.calls[before:] if "_dense_" in c.op]
    weights = dense.args["dev_weights"]
    assert weights.numel() == sum(s.numel() for s in shards), weights.shape
    assert weights.untyped_storage().nbytes() <= weights.element_size(), weights.untyped_storage().nbytes()


def _case(name: str) -> Callable[[Recorder], None]:
    def check(rec: Recorder) -> None:
        sites: list[str] = []
        os.environ["TDB_KERNELS"] = "torch" if name.startswith("torch-") else "auto"
        before = len(rec.calls)
        try:
            with _reads_mode(sites):
                CASES[name]()
            called = [c.op for c in rec.calls[before:] if c.op != "get_infos_metadata"]
            assert bool(called) == name.startswith("fbgemm-"), f"fbgemm's kernels called: {called}"
        except Exception as e:  # a read of a fake tensor's value also fails: the recorded site says where
            if not sites:
                raise
            assert not sites, f"{sites} ({type(e).__name__})"
        finally:
            os.environ.pop("TDB_KERNELS", None)
        assert not sites, sites
    return check


def checks() -> dict[str, Callable[[Recorder], None]]:
    return {**{name: _case(name) for name in CASES}, "dense-no-scratch": _check_dense_scratch}


@pytest.fixture(scope="module")
def results(fake_cuda_results: dict[str, dict[str, str | None]]) -> dict[str, str | None]:
    return fake_cuda_results[__name__]


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_calls_read_nothing_back(results, name):
    assert results[name] is None, results[name]


def test_cuda_dense_grad_allocates_no_scratch(results):
    assert results["dense-no-scratch"] is None, results["dense-no-scratch"]


def test_dense_grad_allocates_no_scratch(monkeypatch):
    """On CPU, fbgemm's dense backward (forced): the weights it is handed own one element; the gradient equals
    torch's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from torchrec_dtensor_bridge.kernels import choose

    monkeypatch.setenv("TDB_KERNELS", "fbgemm")
    monkeypatch.setattr(choose, "_agreed", {})  # no lookup's agreement (an earlier test's) decides for the op
    monkeypatch.setattr(choose, "_settled", {})
    seen: list[torch.Tensor] = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.namespace == "tdb":  # its implementation, with this mode seeing the ops it calls
                with self:
                    return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **(kwargs or {}))
            if func.__name__.startswith("split_embedding_backward_codegen_dense_cpu"):
                seen.append(args[1])
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    dims, rows = [4, 8], [30, 50]
    ids = torch.cat([torch.randint(0, r, (12,), generator=g) for r in rows])
    offsets = torch.arange(0, 25, 3)
    grad = torch.randn(4, 12, generator=g)
    with Seen():
        got = torch.ops.tdb.pool_sum_backward(grad, dims, rows, ids, offsets, None, ids_checked=True)
    assert len(seen) == 1 and seen[0].numel() == 30 * 4 + 50 * 8, seen
    assert seen[0].untyped_storage().nbytes() <= seen[0].element_size(), seen[0].untyped_storage().nbytes()
    monkeypatch.setenv("TDB_KERNELS", "torch")
    torch.testing.assert_close(got, torch.ops.tdb.pool_sum_backward(grad, dims, rows, ids, offsets, None))

