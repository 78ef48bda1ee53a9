"""Every tensor of every collective of the lookups lives on the group's device (2 gloo ranks): NCCL takes CUDA
tensors only, and a CPU tensor built for a collective on a CUDA table's path fails there (or moves the data
through the host).

A dispatch mode records the devices of every tensor of every c10d op (the functions the library calls,
``dist.all_gather``, ``dist.all_to_all_single``, ..., dispatch ``c10d.allgather_``, ``c10d.alltoall_base_``,
...; backward runs on the calling thread on CPU, so the mode sees it too): the agreement step, the id and
output exchanges, the gradient exchanges of backward, and a FusedOptimizer's exchange (replicated tables,
row-wise Adagrad on column cuts). On gloo the group's device is the CPU, as the default device is: the
lookups run with ``meta`` as the default device, so that a tensor made without a ``device`` (the way a CPU
tensor reaches a CUDA group) is a meta tensor here, and the audit names the collective that received it.

A fake process group with ``cuda`` meshes under ``FakeTensorMode`` cannot run these lookups: the agreement
step reads the values every rank sent (``.tolist()``), which fake tensors do not have.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.convert import dtensor_from_local_shards

from .checks import layouts_w2
from .harness import make_pool_fixture

pool = make_pool_fixture(2)

SHAPE = (12, 8)
LAYOUTS = layouts_w2(SHAPE)
COLLECTIVES = ("c10d", "_c10d_functional")


class CollectiveDevices(TorchDispatchMode):
    """Records ``(collective, devices of its tensors)`` for every collective dispatched inside ``with``, and
    raises at the first one given a tensor off ``device`` (before the backend sees it)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device
        self.calls: list[tuple[str, list[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func.namespace in COLLECTIVES:
            devices: list[str] = []
            for a in [*args, *kwargs.values()]:
                for t in a if isinstance(a, (list, tuple)) else [a]:
                    for x in t if isinstance(t, (list, tuple)) else [t]:
                        if isinstance(x, torch.Tensor):
                            devices.append(str(x.device))
            self.calls.append((func.__name__.split(".")[0], devices))
            if any(d != self.device for d in devices):
                raise AssertionError(f"{func}: tensors on {devices}, the group's device is {self.device}")
        return func(*args, **kwargs)


def _batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + t)
    bags = 3 + rank  # ranks pass batches of different sizes
    ids = torch.randint(0, SHAPE[0], (4 * bags,), generator=g)
    return ids, torch.arange(0, ids.numel(), 4)


def check_collectives_on_the_group_device(rank: int, world: int, kind: str | None) -> dict[str, int]:
    names = list(LAYOUTS)
    full = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    weights = [dtensor_from_local_shards(LAYOUTS[n], [full[s.slices()].clone() for s in LAYOUTS[n].shards_on(rank)])
               .requires_grad_() for n in names]
    opt = None if kind is None else tdb.FusedOptimizer(weights, kind, lr=0.1)
    batches = [_batch(rank, t) for t in range(len(names))]
    grads = [torch.linspace(-1, 1, b[1].numel() * SHAPE[1]).view(-1, SHAPE[1]) for b in batches]
    group_device = "cpu"  # gloo's
    audit = CollectiveDevices(group_device)
    with torch.device("meta"), audit:
        outs = tdb.sharded_embedding_bags([b[0] for b in batches], weights, [b[1] for b in batches], mode="sum",
                                          optimizer=opt, names=names)
        sum((o * g).sum() for o, g in zip(outs, grads)).backward()
        single = tdb.sharded_embedding_bag(batches[0][0], weights[1], batches[0][1], mode="max", optimizer=opt)
        (single * grads[0]).sum().backward()
    if opt is None:
        assert all(w.grad is not None and w.grad.device.type == "cpu" for w in weights), "no gradient"
    counts: Counter[str] = Counter(op for op, _ in audit.calls)
    return dict(counts)


@pytest.mark.parametrize("kind", [None, "sgd", "rowwise_adagrad"])
def test_collectives_on_the_group_device(pool, kind):
    counts = pool.run(check_collectives_on_the_group_device, kind)
    seen = counts[0]
    # two agreements, the exchanges of ids and outputs and gradients, and a FusedOptimizer's exchange (its sizes:
    # one more all_gather)
    assert seen.get("allgather_", 0) >= (3 if kind else 2) and seen.get("alltoall_base_", 0) >= 6, seen
    assert counts[0] == counts[1], counts  # the same collectives on both ranks

