"""FusedOptimizer on 3 gloo ranks: every layout, every kind, against a plain unsharded reference.

The reference below is written independently of the package: the gradient of
the full table comes from torch's own ``F.embedding_bag`` / ``F.embedding`` over
every rank's batch, and the update is the textbook formula applied to the rows
some batch referenced (fbgemm's sparse ``EXACT_*`` semantics).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.convert import dtensor_from_local_shards
from torchrec_dtensor_bridge.layout import ShardLayout

from .harness import make_pool_fixture

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


class Reference:
    """The unsharded optimizer on the full table."""

    def __init__(self, weight: torch.Tensor, kind: str) -> None:
        self.w, self.kind, self.step = weight.clone(), kind, 0
        self.m1 = torch.zeros(SHAPE[0]) if kind == "rowwise_adagrad" else torch.zeros(SHAPE)
        self.m2 = torch.zeros(SHAPE)

    def apply(self, grad: torch.Tensor, touched: torch.Tensor) -> None:
        lr, eps, b1, b2 = HYPER["lr"], HYPER["eps"], HYPER["beta1"], HYPER["beta2"]
        self.step += 1
        for r in touched.tolist():
            g = grad[r]
            if self.kind == "sgd":
                self.w[r] -= lr * g
            elif self.kind == "rowwise_adagrad":
                self.m1[r] += (g * g).mean()
                self.w[r] -= lr * g / (self.m1[r].sqrt() + eps)
            elif self.kind == "adagrad":
                self.m1[r] += g * g
                self.w[r] -= lr * g / (self.m1[r].sqrt() + eps)
            else:
                self.m1[r] = b1 * self.m1[r] + (1 - b1) * g
                self.m2[r] = b2 * self.m2[r] + (1 - b2) * g * g
                mh, vh = self.m1[r] / (1 - b1**self.step), self.m2[r] / (1 - b2**self.step)
                self.w[r] -= lr * mh / (vh.sqrt() + eps)

    def state(self, name: str) -> dict[str, torch.Tensor]:
        if self.kind in ("rowwise_adagrad", "adagrad"):
            return {f"{name}.momentum1": self.m1}
        if self.kind == "adam":
            return {f"{name}.momentum1": self.m1, f"{name}.momentum2": self.m2,
                    f"{name}.step": torch.tensor(self.step)}
        return {}


def _reference_step(ref: Reference, world: int, step: int, table: int, mode: str, psw: bool,
                    padding_idx: int | None = None) -> None:
    full = ref.w.clone().requires_grad_()
    loss = torch.zeros(())
    touched = []
    for r in range(world):
        b = _batch(r, step, table, psw)
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
        outs = tdb.sharded_embedding_bags(
            [b["input"] for b in batches], list(weights.values()), [b["offsets"] for b in batches], mode=modes,
            per_sample_weights=[b.get("per_sample_weights") for b in batches], optimizer=opt,
        )
        loss = sum((o * _scale(rank, step, t, o.shape[0])).sum() for t, o in enumerate(outs))
        loss.backward()
        for t, n in enumerate(names):
            _reference_step(refs[n], world, step, t, modes[t], psws[t])
    for n, w in weights.items():
        assert w.grad is None, f"{n}: weight.grad was set"
        torch.testing.assert_close(tdb.full_tensor(w), refs[n].w, msg=lambda m, n=n: f"{n} ({kind}): {m}")
    _check_state(opt, refs)


@pytest.mark.parametrize("kind", KINDS)
def test_parity_every_layout(pool, kind):
    pool.run(check_every_layout, kind, sorted(LAYOUTS))
