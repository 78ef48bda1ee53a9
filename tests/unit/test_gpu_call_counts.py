"""The kernel calls ``tests/gpu/test_cuda_lookup.py::test_fbgemm_cuda_kernels_run`` expects, checked on CPU.

That GPU test counts fbgemm's calls for one lookup of a table in three row blocks, each block in a storage of its
own: the kernel layer makes one call per storage, so three forwards and three backwards, not one. Its expectation
is ``tests/gpu/tables.storages`` (from the layout and how the blocks are stored); here the same case runs on CPU
(a one-rank gloo group) and the profiler's counts of the ``tdb`` ops, and of fbgemm's backward with fbgemm's
kernels forced, must equal it.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.kernels import fbgemm

from ..gpu.tables import batch, dtensors, storages, table
from ..gpu.test_cuda_lookup import HYPER, LAYOUTS, WIDE

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("own_kernel_choices")


def _profiled(kind: str | None, shared: bool) -> Counter[str]:
    """The op counts of the GPU test's lookup (forward and backward), run on CPU."""
    names = ["row_blocks_wide"]
    (weight,) = dtensors([LAYOUTS[n].with_name(n) for n in names], [table(WIDE, 7)], CPU, shared=shared)
    weight.requires_grad_()
    opt = None if kind is None else tdb.FusedOptimizer([weight], kind, **HYPER)
    ids, offsets = batch(WIDE[0], 8, CPU)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = tdb.sharded_embedding_bag(ids, weight, offsets, mode="sum", optimizer=opt)
        out.sum().backward()
    return Counter(e.name for e in prof.events())


# the GPU test's case (blocks in storages of their own), and blocks in one storage for kinds that keep no state (a
# kind's state storages also split its updates)
CASES = [(None, False), ("sgd", False), ("rowwise_adagrad", False), (None, True), ("sgd", True)]


@pytest.mark.parametrize(("kind", "shared"), CASES, ids=[f"{k}-{'one' if s else 'own'}" for k, s in CASES])
def test_one_kernel_call_per_storage(one_rank, monkeypatch, kind, shared):
    if not fbgemm.available():
        pytest.skip("needs fbgemm_gpu")
    monkeypatch.setenv("TDB_KERNELS", "fbgemm")  # fbgemm's backward, as on CUDA
    want = storages([LAYOUTS["row_blocks_wide"]], shared=shared)
    assert want == (1 if shared else 3)
    seen = _profiled(kind, shared)
    assert seen["tdb::pool_sum"] == want, seen
    if kind is None:
        assert seen["tdb::pool_sum_backward"] == want, seen
        return
    assert seen["tdb::sparse_update"] == want, seen
    assert seen[f"fbgemm::split_embedding_backward_codegen_{kind}_unweighted_pt2_wrapper"] == want, seen
