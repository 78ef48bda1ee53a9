"""An unsharded sparse optimizer on one whole table, written from the textbook formulas, not from the package.

The gradient comes from torch's own ``F.embedding_bag`` over every rank's batch; the update touches only
the rows some batch referenced (fbgemm's ``EXACT_*`` semantics). Shared by the distributed tests that
compare a :class:`~torchrec_dtensor_bridge.FusedOptimizer` with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


class SparseReference:
    """One table and its optimizer state, updated as the unsharded optimizer would.

    Args:
        weight: the whole table before the first step (copied).
        kind: ``"sgd"``, ``"rowwise_adagrad"``, ``"adagrad"`` or ``"adam"``.
        lr, eps, beta1, beta2: the optimizer's hyper-parameters.
        weight_decay: L2 for sgd and adagrad, decoupled for adam (fbgemm's), either for row-wise Adagrad
            (``decoupled``).
    """

    def __init__(self, weight: torch.Tensor, kind: str, *, lr: float, eps: float, beta1: float = 0.9,
                 beta2: float = 0.999, weight_decay: float = 0.0, decoupled: bool = False) -> None:
        self.w, self.kind, self.step = weight.clone(), kind, 0
        self.lr, self.eps, self.beta1, self.beta2 = lr, eps, beta1, beta2
        self.wd, self.decoupled = weight_decay, decoupled
        rows = weight.shape[0]
        self.m1 = torch.zeros(rows) if kind == "rowwise_adagrad" else torch.zeros_like(weight)
        self.m2 = torch.zeros_like(weight)

    def train(self, batches: Sequence[dict], scales: Sequence[torch.Tensor], mode: str = "sum") -> None:
        """One step: ``batches`` (every rank's ``{"input", "offsets"}``) pooled by ``F.embedding_bag``, the loss
        ``sum(out * scale)``, the update of the rows they reference."""
        full = self.w.clone().requires_grad_()
        loss = torch.zeros(())
        for b, s in zip(batches, scales):
            loss = loss + (F.embedding_bag(b["input"], full, b["offsets"], mode=mode) * s).sum()
        (grad,) = torch.autograd.grad(loss, full)
        self.apply(grad, torch.cat([b["input"] for b in batches]).unique())

    def apply(self, grad: torch.Tensor, touched: torch.Tensor) -> None:
        """The update of rows ``touched`` by the whole table's gradient ``grad``."""
        lr, eps, b1, b2 = self.lr, self.eps, self.beta1, self.beta2
        self.step += 1
        for r in touched.tolist():
            g = grad[r]
            if self.kind == "sgd":
                self.w[r] -= lr * (g + self.wd * self.w[r])
            elif self.kind == "rowwise_adagrad":
                if not self.decoupled:
                    g = g + self.wd * self.w[r]
                self.m1[r] += (g * g).mean()
                mult = lr / (self.m1[r].sqrt() + eps)
                self.w[r] = self.w[r] * (1 - lr * self.wd if self.decoupled else 1.0) - mult * g
            elif self.kind == "adagrad":
                g = g + self.wd * self.w[r]
                self.m1[r] += g * g
                self.w[r] -= lr * g / (self.m1[r].sqrt() + eps)
            elif self.kind == "adam":
                self.m1[r] = b1 * self.m1[r] + (1 - b1) * g
                self.m2[r] = b2 * self.m2[r] + (1 - b2) * g * g
                mh, vh = self.m1[r] / (1 - b1**self.step), self.m2[r] / (1 - b2**self.step)
                self.w[r] -= lr * (mh / (vh.sqrt() + eps) + self.wd * self.w[r])
            else:
                raise ValueError(f"unknown kind {self.kind!r}")

    def state(self, name: str) -> dict[str, torch.Tensor]:
        """The state as ``FusedOptimizer.state_dict()`` names it for table ``name``."""
        if self.kind in ("rowwise_adagrad", "adagrad"):
            return {f"{name}.momentum1": self.m1}
        if self.kind == "adam":
            return {f"{name}.momentum1": self.m1, f"{name}.momentum2": self.m2,
                    f"{name}.step": torch.tensor(self.step)}
        return {}
