"""A kind registered by the caller trains sharded tables (2 gloo ranks): one registry entry plus its math.

Each rank registers a toy kind for the length of one check, removed afterwards: signed momentum ("signum"),
one element-wise state ``momentum1``: ``m = b1 * m + (1 - b1) * g``; ``w -= lr * sign(m)`` on the touched
rows. No kernel lists it, so backward takes its torch-op math (no ``tdb::sparse_update`` runs). The result
is compared with an unsharded reference written here from the formula (the gradient from torch's own
``F.embedding_bag`` over every rank's batch), on layouts that need no exchange (table-wise, row-wise) and
ones that do (column-wise, replicated).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge import kernels, optim_kinds
from torchrec_dtensor_bridge.convert import dtensor_from_local_shards
from torchrec_dtensor_bridge.layout import ShardLayout
from torchrec_dtensor_bridge.optim import update
from torchrec_dtensor_bridge.optim_kinds import OptimKind, StateKind, StateSpec

from .harness import make_pool_fixture

pool = make_pool_fixture(2)

SHAPE = (10, 6)
LAYOUTS = {
    "table_wise": ShardLayout.table_wise(SHAPE, 1),
    "row_wise_uneven": ShardLayout.row_wise(SHAPE, [3, 7]),
    "column_wise": ShardLayout.column_wise(SHAPE, [2, 4]),
    "replicated": ShardLayout.replicated(SHAPE, [0, 1]),
}
LR, BETA1, STEPS = 0.05, 0.7, 3
SIGNUM = OptimKind("signum", states=(StateSpec("momentum1", StateKind.ELEMENT),), hyper=(("beta1", 0.9),),
                   decay_modes=())


def _signum(hyper, w, g, state, step):  # noqa: ANN001, ANN202 - the math's signature (optim.update.ElementMath)
    m = state["momentum1"].mul_(hyper.beta1).add_(g, alpha=1 - hyper.beta1)
    return w - hyper.lr * m.sign()


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    bags = 3 + rank
    ids = torch.randint(0, SHAPE[0], (2 * bags,), generator=g)
    return ids, torch.arange(0, 2 * bags, 2)


def _scale(rank: int, step: int, bags: int) -> torch.Tensor:
    return torch.randn(bags, SHAPE[1], generator=torch.Generator().manual_seed(7 + 100 * step + rank))


def _reference(table: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsharded signum on the whole table: the gradient of every rank's loss, the touched rows updated."""
    w, m = table.clone(), torch.zeros(SHAPE)
    for step in range(STEPS):
        full = w.clone().requires_grad_()
        loss, touched = torch.zeros(()), []
        for r in range(world):
            ids, offsets = _batch(r, step)
            out = F.embedding_bag(ids, full, offsets, mode="sum")
            loss = loss + (out * _scale(r, step, out.shape[0])).sum()
            touched.append(ids)
        (grad,) = torch.autograd.grad(loss, full)
        for row in torch.cat(touched).unique().tolist():
            m[row] = BETA1 * m[row] + (1 - BETA1) * grad[row]
            w[row] = w[row] - LR * m[row].sign()
    return w, m


def check_custom_kind_trains(rank: int, world: int, layout_name: str) -> None:
    optim_kinds.register(SIGNUM)
    update.elementwise_math(SIGNUM)(_signum)
    try:
        assert kernels.update_impl(torch.device("cpu"), "signum", 0.0) is kernels.Impl.TORCH
        layout = LAYOUTS[layout_name]
        table = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
        shards = [table[s.slices()].clone() for s in layout.shards_on(rank)]
        weight = dtensor_from_local_shards(layout, shards).requires_grad_()
        opt = tdb.FusedOptimizer({"t": weight}, "signum", lr=LR, beta1=BETA1)
        assert opt.kind == "signum" and opt.hyper.kind is SIGNUM
        for step in range(STEPS):
            ids, offsets = _batch(rank, step)
            out = tdb.sharded_embedding_bag(ids, weight, offsets, mode="sum", optimizer=opt)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                (out * _scale(rank, step, out.shape[0])).sum().backward()
            assert "tdb::sparse_update" not in {e.name for e in prof.events()}, "a kernel ran a kind none lists"
        want_w, want_m = _reference(table, world)
        assert weight.grad is None
        torch.testing.assert_close(tdb.full_tensor(weight.detach()), want_w)
        state = opt.state_dict()
        assert sorted(state) == ["t.momentum1"], sorted(state)
        torch.testing.assert_close(tdb.full_tensor(state["t.momentum1"]), want_m)
    finally:
        update.forget_math(SIGNUM)
        optim_kinds.unregister(SIGNUM)
    assert "signum" not in optim_kinds.names()
    with pytest.raises(ValueError, match="unknown optimizer kind 'signum'"):
        tdb.FusedOptimizer({"t": weight}, "signum", lr=LR)


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_a_registered_kind_trains_every_layout(pool, layout_name):
    pool.run(check_custom_kind_trains, layout_name)
