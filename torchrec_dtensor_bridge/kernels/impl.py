"""The implementations behind the kernel ops (:mod:`.ops`), each over the ops' one form.

The form (fbgemm's): several tables in ONE flat fp32 storage ``weights``, table ``t``'s rows at element
``weights_offsets[t]`` (``rows[t] x dims[t]``, row-major); one batch of ``B`` bags per table, the ids of
all tables back to back with ``offsets`` of length ``T * B + 1`` (table-major, positions in ``ids``); an
output or output gradient ``(B, sum(dims))``, table ``t`` at its columns. The caller (:mod:`.ops`) has
checked every argument; which implementation runs is :mod:`.choose`'s decision.
"""

from __future__ import annotations

import enum
import itertools

import torch

from . import fbgemm, native

__all__ = ["Impl", "add_bag_grads", "dense_grad", "pool_sum", "sparse_update"]


class Impl(enum.IntEnum):
    """An implementation; the order is the fallback order (ranks that disagree fall back to the lowest)."""

    TORCH = 0
    FBGEMM = 1
    NATIVE = 2

_NATIVE_KINDS = {"sgd": native.SGD, "rowwise_adagrad": native.ROWWISE_ADAGRAD, "adagrad": native.ADAGRAD,
                 "adam": native.ADAM}


def _table(weights: torch.Tensor, at: int, rows: int, dim: int) -> torch.Tensor:
    return weights[at : at + rows * dim].view(rows, dim)


def _bags(ids: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor | None, t: int, b: int,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Table ``t``'s ids, its ``b + 1`` offsets from 0, and its per-sample weights."""
    cut = offsets[t * b : (t + 1) * b + 1]
    lo, hi = int(cut[0]), int(cut[-1])
    return ids[lo:hi], cut - lo, None if psw is None else psw[lo:hi]


def _starts(sizes: list[int]) -> list[int]:
    """Where each of ``sizes`` starts when laid back to back, and the total at the end."""
    return list(itertools.accumulate(sizes, initial=0))


def add_bag_grads(out: torch.Tensor, grad: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                  psw: torch.Tensor | None) -> torch.Tensor:
    """``out`` (a ``(rows, dim)`` gradient) plus the pooled SUM lookup's weight gradient, with torch ops (any
    dtype): each id's row gets its bag's output gradient ``grad`` (times its per-sample weight)."""
    lengths = offsets[1:] - offsets[:-1]
    bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=grad.device), lengths,
                                  output_size=ids.numel())
    per_id = grad.index_select(0, bag)
    if psw is not None:
        per_id = per_id * psw.unsqueeze(1)
    return out.index_add_(0, ids, per_id.to(out.dtype))


def pool_sum(which: Impl, weights: torch.Tensor, weights_offsets: list[int], dims: list[int], rows: list[int],
             ids: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor | None) -> torch.Tensor:
    """``(B, sum(dims))``: every table's bag sums side by side."""
    tables = len(dims)
    b = (offsets.numel() - 1) // tables
    if which is Impl.FBGEMM:
        args = fbgemm.table_args(tuple(weights_offsets), tuple(dims), tuple(rows), weights.device)
        return fbgemm.pool_sum(weights, args, ids, offsets, psw)
    kernel = native.kernel() if which is Impl.NATIVE else None
    if kernel is not None:  # one call for every table
        with torch.profiler.record_function("tdb::native_pool_sum"):
            return kernel.pool_tables(weights, weights_offsets, dims, rows, ids, offsets, psw)
    starts = _starts(dims)
    out = torch.empty(b, starts[-1], dtype=torch.float32, device=weights.device)
    for t in range(tables):
        shard = _table(weights, weights_offsets[t], rows[t], dims[t])
        into = out[:, starts[t] : starts[t + 1]]
        tid, toff, tpsw = _bags(ids, offsets, psw, t, b)
        into.copy_(torch.embedding_bag(shard, tid, toff[:-1], False, 0, False, tpsw, False)[0])
    return out


def dense_grad(which: Impl, grad: torch.Tensor, dims: list[int], rows: list[int], ids: torch.Tensor,
               offsets: torch.Tensor, psw: torch.Tensor | None) -> torch.Tensor:
    """Every table's dense weight gradient, flat and back to back (table ``t``'s ``rows[t] x dims[t]``)."""
    packed = _starts([r * d for r, d in zip(rows, dims)])
    if which is Impl.FBGEMM:
        args = fbgemm.table_args(tuple(packed[:-1]), tuple(dims), tuple(rows), grad.device)
        return fbgemm.dense_grad(grad, args, ids, offsets, psw, packed[-1])
    tables, starts = len(dims), _starts(dims)
    b = (offsets.numel() - 1) // tables
    out = torch.zeros(packed[-1], dtype=torch.float32, device=grad.device)
    for t in range(tables):
        tid, toff, tpsw = _bags(ids, offsets, psw, t, b)
        add_bag_grads(_table(out, packed[t], rows[t], dims[t]), grad[:, starts[t] : starts[t + 1]], tid, toff, tpsw)
    return out


def sparse_update(which: Impl, weights: torch.Tensor, weights_offsets: list[int], dims: list[int], rows: list[int],
                  grad: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor | None, kind: str,
                  momentum1: torch.Tensor | None, momentum1_offsets: list[int], momentum2: torch.Tensor | None,
                  momentum2_offsets: list[int], lr: float, eps: float, weight_decay: float, decay: int,
                  beta1: float, beta2: float, step: int) -> None:
    """Every table's touched rows (and their state) updated in place: :attr:`Impl.NATIVE` or :attr:`Impl.FBGEMM`."""
    if which is Impl.FBGEMM and (kind != "adagrad" or list(momentum1_offsets) == list(weights_offsets)):
        args = fbgemm.table_args(tuple(weights_offsets), tuple(dims), tuple(rows), weights.device)
        m1_off = None if momentum1 is None else fbgemm.constant(tuple(momentum1_offsets), weights.device)
        m2_off = None if momentum2 is None else fbgemm.constant(tuple(momentum2_offsets), weights.device)
        fbgemm.update(kind, weights, args, grad, ids, offsets, psw, momentum1, m1_off, lr, eps, momentum2=momentum2,
                      momentum2_offsets=m2_off, weight_decay=weight_decay, decay=decay, beta1=beta1, beta2=beta2,
                      step=step)
        return
    kernel = native.kernel()
    if which is Impl.TORCH or (which is Impl.NATIVE and kernel is None):
        raise RuntimeError(f"sparse update: no one-pass kernel for {which.name.lower()} (choose.update_impl decides)")
    if which is Impl.NATIVE:  # one call for every table
        assert kernel is not None, "checked above"
        with torch.profiler.record_function(f"tdb::native_update_{kind}"):
            kernel.update_tables(_NATIVE_KINDS[kind], weights, weights_offsets, dims, rows, grad, ids, offsets, psw,
                                 momentum1, momentum1_offsets, lr, eps, weight_decay, decay, state2=momentum2,
                                 state2_offsets=momentum2_offsets, beta1=beta1, beta2=beta2, step=step)
        return
    # fbgemm's Adagrad, which addresses its momentum by the WEIGHTS' offsets (momentum1_offsets unread), for
    # state laid out otherwise: one call per table
    tables, starts = len(dims), _starts(dims)
    b = (offsets.numel() - 1) // tables
    for t in range(tables):
        tid, toff, tpsw = _bags(ids, offsets, psw, t, b)
        if tid.numel() == 0:
            continue
        state = None if momentum1 is None else _table(momentum1, momentum1_offsets[t], rows[t], dims[t]).reshape(-1)
        shard, tgrad = _table(weights, weights_offsets[t], rows[t], dims[t]), grad[:, starts[t] : starts[t + 1]]
        args = fbgemm.table_args((0,), (dims[t],), (rows[t],), weights.device)
        fbgemm.update(kind, shard.view(-1), args, tgrad, tid, toff, tpsw, state, args.weights_offsets, lr, eps,
                      weight_decay=weight_decay, decay=decay, beta1=beta1, beta2=beta2, step=step)
