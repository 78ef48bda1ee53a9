"""The optimizers' math on the rows one step touched (O(batch): nothing the size of a table).

Every function updates ``weight`` (a shard: rows x its columns) and its state
in place at ``rows`` (sorted, unique, local to the shard) from ``grad`` (one
summed gradient row per touched row, all ranks' batches). Rows the step did
not touch are left alone, as fbgemm's sparse (``EXACT_*``) optimizers do.
The semantics (per touched row ``r`` with gradient ``g``, full embedding dim ``D``):

* SGD: ``w -= lr * (g + wd * w)``.
* Adagrad: ``g' = g + wd * w``; ``m += g'**2``; ``w -= lr * g' / (sqrt(m) + eps)``.
* row-wise Adagrad (fbgemm EXACT_ROWWISE_ADAGRAD): ``g' = g + wd * w`` (L2 mode) or ``g``;
  ``m[r] += sum(g'**2) / D`` over the WHOLE row (every column shard of it);
  ``mult = lr / (sqrt(m[r]) + eps)``; ``w = w - mult * g'`` (L2 / none) or
  ``w = (1 - lr * wd) * w - mult * g'`` (decoupled).
* Adam (fbgemm ADAM): with the table's step ``t`` (counted once per backward):
  ``m1 = b1*m1 + (1-b1)*g``; ``m2 = b2*m2 + (1-b2)*g**2``;
  ``w -= lr * (m1 / (1 - b1**t) / (sqrt(m2 / (1 - b2**t)) + eps) + wd * w)``.
"""

from __future__ import annotations

import torch

from .kinds import Hyper, OptimKind, WeightDecayMode

__all__ = ["decayed_grad", "apply_elementwise", "apply_rowwise", "row_square_sums"]


def decayed_grad(hyper: Hyper, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with L2 weight decay folded in (the gradient the statistics and the step see)."""
    if hyper.weight_decay and hyper.weight_decay_mode is WeightDecayMode.L2:
        return grad + hyper.weight_decay * weight.index_select(0, rows)
    return grad


def row_square_sums(hyper: Hyper, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Per touched row, the sum of squares of this piece's (decayed) gradient over its columns."""
    g = decayed_grad(hyper, weight, rows, grad)
    return (g * g).sum(dim=1)


def apply_elementwise(
    hyper: Hyper, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, states: dict[str, torch.Tensor],
    step: int,
) -> None:
    """SGD, Adagrad or Adam on one shard's touched rows (element-wise state has the shard's shape)."""
    if rows.numel() == 0:
        return
    w = weight.index_select(0, rows)
    kind = hyper.kind
    if kind is OptimKind.SGD:
        new = w - hyper.lr * decayed_grad(hyper, weight, rows, grad)
    elif kind is OptimKind.ADAGRAD:
        g = decayed_grad(hyper, weight, rows, grad)
        m = states["momentum1"].index_select(0, rows) + g * g
        states["momentum1"].index_copy_(0, rows, m)
        new = w - hyper.lr * g / (m.sqrt() + hyper.eps)
    elif kind is OptimKind.ADAM:  # in place on the gathered rows: few temporaries of the batch's size
        b1, b2 = hyper.beta1, hyper.beta2
        m1 = states["momentum1"].index_select(0, rows).mul_(b1).add_(grad, alpha=1 - b1)
        m2 = states["momentum2"].index_select(0, rows).mul_(b2).addcmul_(grad, grad, value=1 - b2)
        states["momentum1"].index_copy_(0, rows, m1)
        states["momentum2"].index_copy_(0, rows, m2)
        step_size = hyper.lr / (1 - b1**step)
        denom = m2.div_(1 - b2**step).sqrt_().add_(hyper.eps)  # m2 is a copy: its state is stored already
        new = w.addcdiv_(m1, denom, value=-step_size)
        if hyper.weight_decay:
            new.sub_(weight.index_select(0, rows), alpha=hyper.lr * hyper.weight_decay)
    else:
        raise AssertionError(f"{kind} is applied by apply_rowwise")
    weight.index_copy_(0, rows, new.to(weight.dtype))


def apply_rowwise(
    hyper: Hyper, pieces: list[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor, square_sums: torch.Tensor,
    momentum: torch.Tensor, dim: int,
) -> None:
    """Row-wise Adagrad on the column pieces of the same rows held here (they share ``momentum``).

    ``pieces``: ``(shard, grad)`` per piece, all touched at ``rows``;
    ``square_sums``: per row, the sum of squared (decayed) gradients over the
    whole row (all pieces on all ranks); ``dim``: the table's embedding dim.
    """
    if rows.numel() == 0:
        return
    m = momentum.index_select(0, rows) + square_sums.to(momentum.dtype) / dim
    momentum.index_copy_(0, rows, m)
    mult = (hyper.lr / (m.sqrt() + hyper.eps)).unsqueeze(1)
    decoupled = hyper.weight_decay and hyper.weight_decay_mode is WeightDecayMode.DECOUPLED
    for weight, grad in pieces:
        g = decayed_grad(hyper, weight, rows, grad)
        w = weight.index_select(0, rows)
        if decoupled:
            w = w * (1 - hyper.lr * hyper.weight_decay)
        weight.index_copy_(0, rows, (w - mult * g).to(weight.dtype))
