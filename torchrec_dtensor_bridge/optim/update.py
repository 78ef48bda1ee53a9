"""The optimizers' math on the rows one step touched (O(batch): nothing the size of a table).

Every function updates ``weight`` (a shard: rows x its columns) and its state
in place at ``rows`` (sorted, unique, local to the shard) from ``grad`` (one
summed gradient row per touched row, all ranks' batches). Rows the step did
not touch are left alone, as fbgemm's sparse (``EXACT_*``) optimizers do.
Each kind's math is registered here under its record (:mod:`...optim_kinds`),
by :func:`elementwise_math` or, for a kind with a per-row state, :func:`rowwise_math`.
The semantics of the built-in kinds (per touched row ``r`` with gradient ``g``, full embedding dim ``D``):

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

from collections.abc import Callable

import torch

from ..optim_kinds import ADAGRAD, ADAM, ROWWISE_ADAGRAD, SGD, Hyper, OptimKind, StateKind, WeightDecayMode

__all__ = [
    "ElementMath", "RowMath", "apply_elementwise", "apply_rowwise", "check_math", "decayed_grad",
    "elementwise_math", "forget_math", "row_square_sums", "rowwise_math",
]

ElementMath = Callable[[Hyper, torch.Tensor, torch.Tensor, dict[str, torch.Tensor], int], torch.Tensor]
"""``math(hyper, w, g, state, step) -> new rows``: ``w`` the touched rows (a copy), ``g`` their summed
gradient, ``state`` the kind's element-wise states at those rows (copies, by name: the math updates them in
place and the caller stores them), ``step`` the table's step count."""

RowMath = Callable[[Hyper, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor, torch.Tensor, int],
                   None]
"""``math(hyper, pieces, rows, square_sums, state, dim)``: see :func:`apply_rowwise`."""

_ELEMENTWISE: dict[OptimKind, ElementMath] = {}
_ROWWISE: dict[OptimKind, RowMath] = {}


def elementwise_math(kind: OptimKind) -> Callable[[ElementMath], ElementMath]:
    """Registers the decorated function as ``kind``'s math (a kind without a per-row state); refuses a second."""

    def register(fn: ElementMath) -> ElementMath:
        if kind.row_wise or kind in _ELEMENTWISE:
            raise ValueError(f"optimizer kind {kind.name!r}: " + (
                "keeps a per-row state: register its math with rowwise_math" if kind.row_wise else
                "has its element-wise math already"))
        _ELEMENTWISE[kind] = fn
        return fn

    return register


def rowwise_math(kind: OptimKind) -> Callable[[RowMath], RowMath]:
    """Registers the decorated function as the math of ``kind`` (a kind with a per-row state); refuses a second."""

    def register(fn: RowMath) -> RowMath:
        if not kind.row_wise or kind in _ROWWISE:
            raise ValueError(f"optimizer kind {kind.name!r}: " + (
                "has its row-wise math already" if kind.row_wise else "keeps no per-row state"))
        _ROWWISE[kind] = fn
        return fn

    return register


def forget_math(kind: OptimKind) -> None:
    """Removes ``kind``'s math (for a kind registered for a while, as a test's)."""
    _ELEMENTWISE.pop(kind, None)
    _ROWWISE.pop(kind, None)


def check_math(kind: OptimKind) -> None:
    """Raises ``NotImplementedError`` when ``kind`` has no math registered here."""
    if kind not in (_ROWWISE if kind.row_wise else _ELEMENTWISE):
        raise NotImplementedError(f"optimizer kind {kind.name!r} has no update math (register it with "
                                  f"optim.update.{'rowwise_math' if kind.row_wise else 'elementwise_math'})")


def decayed_grad(hyper: Hyper, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with L2 weight decay folded in (the gradient the statistics and the step see)."""
    if hyper.weight_decay and hyper.weight_decay_mode is WeightDecayMode.L2:
        return grad + hyper.weight_decay * weight.index_select(0, rows)
    return grad


def _decayed(hyper: Hyper, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """:func:`decayed_grad` of rows already gathered."""
    if hyper.weight_decay and hyper.weight_decay_mode is WeightDecayMode.L2:
        return g + hyper.weight_decay * w
    return g


def row_square_sums(hyper: Hyper, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Per touched row, the sum of squares of this piece's (decayed) gradient over its columns."""
    g = decayed_grad(hyper, weight, rows, grad)
    return (g * g).sum(dim=1)


def apply_elementwise(
    hyper: Hyper, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, states: dict[str, torch.Tensor],
    step: int,
) -> None:
    """The math of ``hyper.kind`` (a kind without a per-row state) on one shard's touched rows; its element-wise
    states (``states``, by name) have the shard's shape."""
    if rows.numel() == 0:
        return
    math = _ELEMENTWISE.get(hyper.kind)
    if math is None:
        check_math(hyper.kind)
    assert math is not None, "check_math raised"
    held = {s.name: states[s.name].index_select(0, rows) for s in hyper.kind.states if s.shape is StateKind.ELEMENT}
    new = math(hyper, weight.index_select(0, rows), grad, held, step)
    for name, values in held.items():
        states[name].index_copy_(0, rows, values)
    weight.index_copy_(0, rows, new.to(weight.dtype))


def apply_rowwise(
    hyper: Hyper, pieces: list[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor, square_sums: torch.Tensor,
    momentum: torch.Tensor, dim: int,
) -> None:
    """The math of ``hyper.kind`` (a kind with a per-row state) on the column pieces of the same rows held
    here (they share its per-row state ``momentum``).

    ``pieces``: ``(shard, grad)`` per piece, all touched at ``rows``;
    ``square_sums``: per row, the sum of squared (decayed) gradients over the
    whole row (all pieces on all ranks); ``dim``: the table's embedding dim.
    """
    if rows.numel() == 0:
        return
    math = _ROWWISE.get(hyper.kind)
    if math is None:
        check_math(hyper.kind)
    assert math is not None, "check_math raised"
    math(hyper, pieces, rows, square_sums, momentum, dim)


# --- the built-in kinds -----------------------------------------------------------------------------------

@elementwise_math(SGD)
def _sgd(hyper: Hyper, w: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], step: int) -> torch.Tensor:
    return w - hyper.lr * _decayed(hyper, w, g)


@elementwise_math(ADAGRAD)
def _adagrad(hyper: Hyper, w: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], step: int,
             ) -> torch.Tensor:
    g = _decayed(hyper, w, g)
    m = state["momentum1"].add_(g * g)
    return w - hyper.lr * g / (m.sqrt() + hyper.eps)


@elementwise_math(ADAM)
def _adam(hyper: Hyper, w: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], step: int) -> torch.Tensor:
    b1, b2 = hyper.beta1, hyper.beta2  # in place on the gathered rows: few temporaries of the batch's size
    m1 = state["momentum1"].mul_(b1).add_(g, alpha=1 - b1)
    m2 = state["momentum2"].mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = m2.div(1 - b2**step).sqrt_().add_(hyper.eps)
    new = w.addcdiv(m1, denom, value=-hyper.lr / (1 - b1**step))
    if hyper.weight_decay:  # decoupled, as fbgemm's Adam
        new.sub_(w, alpha=hyper.lr * hyper.weight_decay)
    return new


@rowwise_math(ROWWISE_ADAGRAD)
def _rowwise_adagrad(hyper: Hyper, pieces: list[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor,
                     square_sums: torch.Tensor, momentum: torch.Tensor, dim: int) -> None:
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
