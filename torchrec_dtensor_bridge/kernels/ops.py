"""The kernel layer's torch ops (``torch.ops.tdb``), each with a fake implementation.

* ``tdb::pool_sum(weights, weights_offsets, dims, rows, ids, offsets, per_sample_weights) -> Tensor``:
  the pooled SUM of every table of one storage, ``(B, sum(dims))``.
* ``tdb::pool_sum_backward(grad, dims, rows, ids, offsets, per_sample_weights) -> Tensor``: the dense
  weight gradients of that lookup, flat, back to back.
* ``tdb::sparse_update(weights!, ..., grad, ids, offsets, per_sample_weights, kind, momentum1!, ...,
  momentum2!, ..., lr, eps, weight_decay, decay, beta1, beta2, step) -> ()``: a fused optimizer's update of
  the touched rows of every table of one storage (and their state), in place.

The form of the arguments is :mod:`.impl`'s (fbgemm's): tables addressed by element offsets into one flat
storage. Steps of a call:

1. The arguments are checked here, before any kernel runs: a ``ValueError`` names the argument and its
   values (never an ``assert``; the kernels trust what passes).
2. The implementation for the device is :mod:`.choose`'s decision (one place per op and device).
3. It runs (:mod:`.impl`).

The ops are declared with ``torch.library.Library`` (schemas, with the in-place arguments marked) and their
CPU, CUDA and fake implementations registered under the same names: the dispatcher calls each
implementation directly (``torch.library.custom_op`` adds Python layers that cost more per call than a
small lookup's kernel, BENCHMARKS.md). An update bumps the version counters of the tensors it wrote, as
in-place ops do. On CPU the ids are checked in one pass of this package's C code when it is built
(:meth:`.native.NativeKernel.ids_valid`). On CUDA the ids are checked in
one pass on the device (one synchronisation), and fbgemm's kernels run only on tables whose rows they can
read (:func:`.fbgemm.fits`); pooling and the dense gradient fall back to torch's ops otherwise, a fused
update refuses. The fakes give the output shapes, so FakeTensor and ``torch.compile`` trace the ops, and the
profiler names them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import choose, fbgemm, impl, native

__all__ = ["dense_grad", "pool_sum", "sparse_update"]

Tensor = torch.Tensor
_KINDS = ("sgd", "rowwise_adagrad", "adagrad", "adam")


def _fail(op: str, name: str, got: object, want: str) -> ValueError:
    return ValueError(f"tdb::{op}: {name} must be {want}, got {got}")


def _check_tables(op: str, weights: Tensor, weights_offsets: list[int], dims: list[int], rows: list[int]) -> None:
    tables = len(dims)
    if tables == 0 or len(rows) != tables or (weights_offsets is not None and len(weights_offsets) != tables):
        raise _fail(op, "weights_offsets, dims, rows", (weights_offsets, dims, rows), "one entry per table (>= 1)")
    if weights.dim() != 1 or weights.dtype != torch.float32 or weights.stride(0) != 1:
        raise _fail(op, "weights", f"{weights.dtype} of shape {tuple(weights.shape)} strides {weights.stride()}",
                    "a flat contiguous float32 tensor")
    for t, (at, d, r) in enumerate(zip(weights_offsets, dims, rows)):
        if d < 0 or r < 0 or at < 0 or at + d * r > weights.numel():
            raise _fail(op, f"table {t}", f"offset {at}, {r} rows x {d} columns",
                        f"inside weights of {weights.numel()} elements")


def _check_batch(op: str, tables: int, ids: Tensor, offsets: Tensor, psw: Tensor | None, device: torch.device,
                 ) -> int:
    """The batch size ``B`` of every table."""
    for name, t in (("ids", ids), ("offsets", offsets)):
        if t.dim() != 1 or t.dtype != torch.int64 or t.device != device:
            raise _fail(op, name, f"{t.dtype} of shape {tuple(t.shape)} on {t.device}", f"1-D int64 on {device}")
    if (offsets.numel() - 1) % tables or offsets.numel() < 1:
        raise _fail(op, "offsets", f"{offsets.numel()} boundaries", f"T * B + 1 boundaries for T = {tables}")
    if psw is not None and (psw.shape != ids.shape or psw.dtype != torch.float32 or psw.device != device):
        raise _fail(op, "per_sample_weights", f"{psw.dtype} of shape {tuple(psw.shape)}",
                    f"float32 of shape {tuple(ids.shape)} (one per id)")
    return (offsets.numel() - 1) // tables


def _check_ids(op: str, ids: Tensor, offsets: Tensor, rows: list[int], b: int) -> None:
    """Offsets in order and every table's ids inside its rows (the kernels read where they point)."""
    if ids.device.type == "meta" or offsets.numel() == 0:
        return
    kernel = native.kernel() if ids.device.type == "cpu" and ids.is_contiguous() and offsets.is_contiguous() else None
    if kernel is not None and kernel.ids_valid(ids, offsets, rows):  # one pass in C; a problem is named below
        return
    if int(offsets[0]) < 0 or int(offsets[-1]) > ids.numel() or bool((offsets[1:] < offsets[:-1]).any()):
        raise _fail(op, "offsets", f"boundaries from {int(offsets[0])} to {int(offsets[-1])}",
                    f"non-decreasing within [0, {ids.numel()}]")
    bounds = offsets[:: b].tolist() if b else [0] * (len(rows) + 1)
    for t, r in enumerate(rows):
        piece = ids[bounds[t] : bounds[t + 1]]
        if piece.numel():
            lo, hi = torch.aminmax(piece)
            if int(lo) < 0 or int(hi) >= r:
                raise _fail(op, f"ids of table {t}", f"ids from {int(lo)} to {int(hi)}", f"inside [0, {r})")


def check_ids_on_device(op: str, ids: Tensor, offsets: Tensor, rows: list[int], b: int) -> None:
    """:func:`_check_ids` for tensors on an accelerator: one pass on the device and one synchronisation; on a
    problem, the CPU check on copies names it."""
    if offsets.numel() == 0:
        return
    n = ids.numel()
    bad = (offsets[0] < 0) | (offsets[-1] > n) | (offsets[1:] < offsets[:-1]).any()
    if n and b:
        bounds = offsets[::b].contiguous()  # each table's first id, and the end of the last one
        at = torch.arange(n, device=ids.device)
        table = (torch.searchsorted(bounds, at, right=True) - 1).clamp_(0, len(rows) - 1)
        read = (at >= bounds[0]) & (at < bounds[-1])  # ids outside every bag are never read
        limit = fbgemm.constant(tuple(rows), ids.device).index_select(0, table)
        bad = bad | (read & ((ids < 0) | (ids >= limit))).any()
    if bool(bad):
        _check_ids(op, ids.cpu(), offsets.cpu(), rows, b)
        raise _fail(op, "ids, offsets", "ids outside their tables or offsets out of order", "valid")


def _fbgemm_fits(which: impl.Impl, weights: Tensor, weights_offsets: list[int], dims: list[int]) -> bool:
    return which is not impl.Impl.FBGEMM or fbgemm.fits(weights, weights_offsets, dims)


_LIB = torch.library.Library("tdb", "DEF")  # held here: the ops live as long as this module
_LIB.define("pool_sum(Tensor weights, int[] weights_offsets, int[] dims, int[] rows, Tensor ids, Tensor offsets, "
            "Tensor? per_sample_weights) -> Tensor")
_LIB.define("pool_sum_backward(Tensor grad, int[] dims, int[] rows, Tensor ids, Tensor offsets, "
            "Tensor? per_sample_weights) -> Tensor")
_LIB.define("sparse_update(Tensor(a!) weights, int[] weights_offsets, int[] dims, int[] rows, Tensor grad, "
            "Tensor ids, Tensor offsets, Tensor? per_sample_weights, str kind, Tensor(b!)? momentum1, "
            "int[] momentum1_offsets, Tensor(c!)? momentum2, int[] momentum2_offsets, float lr, float eps, "
            "float weight_decay, int decay, float beta1, float beta2, int step) -> ()")


def _register(name: str, device: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Registers the decorated function as ``tdb::name``'s kernel for ``device`` ("CPU", "CUDA") or, for
    "fake", its fake implementation; returns it unchanged."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        if device == "fake":
            torch.library.register_fake(f"tdb::{name}", fn, lib=_LIB)
        else:
            _LIB.impl(name, fn, device)
        return fn

    return register


def _bump_versions(*mutated: Tensor | None) -> None:
    """What an in-place op owes autograd: the version counters of the tensors it wrote move on, so that a
    graph that saved one of them refuses its backward instead of using changed values."""
    for t in mutated:
        if t is not None:
            torch.autograd.graph.increment_version(t)


@_register("pool_sum", "CPU")
def pool_sum(weights: Tensor, weights_offsets: list[int], dims: list[int], rows: list[int], ids: Tensor,
             offsets: Tensor, per_sample_weights: Tensor | None) -> Tensor:
    """The pooled SUM of every table of one storage (see the module docstring)."""
    _check_tables("pool_sum", weights, weights_offsets, dims, rows)
    b = _check_batch("pool_sum", len(dims), ids, offsets, per_sample_weights, weights.device)
    which = choose.pool_impl(weights.device)
    if which is not impl.Impl.NATIVE:  # ours checks in its own pass
        _check_ids("pool_sum", ids, offsets, rows, b)
    return impl.pool_sum(which, weights, weights_offsets, dims, rows, ids, offsets, per_sample_weights)


@_register("pool_sum", "fake")
def _(weights: Tensor, weights_offsets: list[int], dims: list[int], rows: list[int], ids: Tensor, offsets: Tensor,
      per_sample_weights: Tensor | None) -> Tensor:
    _check_tables("pool_sum", weights, weights_offsets, dims, rows)
    b = _check_batch("pool_sum", len(dims), ids, offsets, per_sample_weights, weights.device)
    return weights.new_empty(b, sum(dims))


@_register("pool_sum", "CUDA")
def _(weights: Tensor, weights_offsets: list[int], dims: list[int], rows: list[int], ids: Tensor, offsets: Tensor,
      per_sample_weights: Tensor | None) -> Tensor:
    _check_tables("pool_sum", weights, weights_offsets, dims, rows)
    b = _check_batch("pool_sum", len(dims), ids, offsets, per_sample_weights, weights.device)
    check_ids_on_device("pool_sum", ids, offsets, rows, b)
    if b == 0 or ids.numel() == 0:
        return weights.new_zeros(b, sum(dims))
    which = choose.pool_impl(weights.device)
    if not _fbgemm_fits(which, weights, weights_offsets, dims):
        which = impl.Impl.TORCH
    return impl.pool_sum(which, weights, weights_offsets, dims, rows, ids, offsets, per_sample_weights)


@_register("pool_sum_backward", "CPU")
def dense_grad(grad: Tensor, dims: list[int], rows: list[int], ids: Tensor, offsets: Tensor,
               per_sample_weights: Tensor | None) -> Tensor:
    """The dense weight gradients of :func:`pool_sum`, flat, table ``t``'s ``rows[t] x dims[t]`` after table
    ``t - 1``'s."""
    b = _check_grad("pool_sum_backward", grad, dims, rows, ids, offsets, per_sample_weights)
    _check_ids("pool_sum_backward", ids, offsets, rows, b)
    return impl.dense_grad(choose.dense_impl(grad.device), grad, dims, rows, ids, offsets, per_sample_weights)


@_register("pool_sum_backward", "fake")
def _(grad: Tensor, dims: list[int], rows: list[int], ids: Tensor, offsets: Tensor,
      per_sample_weights: Tensor | None) -> Tensor:
    _check_grad("pool_sum_backward", grad, dims, rows, ids, offsets, per_sample_weights)
    return grad.new_empty(sum(r * d for r, d in zip(rows, dims)))


@_register("pool_sum_backward", "CUDA")
def _(grad: Tensor, dims: list[int], rows: list[int], ids: Tensor, offsets: Tensor,
      per_sample_weights: Tensor | None) -> Tensor:
    b = _check_grad("pool_sum_backward", grad, dims, rows, ids, offsets, per_sample_weights)
    check_ids_on_device("pool_sum_backward", ids, offsets, rows, b)
    if b == 0 or ids.numel() == 0:
        return grad.new_zeros(sum(r * d for r, d in zip(rows, dims)))
    which = choose.dense_impl(grad.device)
    if which is impl.Impl.FBGEMM and any(d % fbgemm.ALIGN for d in dims):  # the packed gradient's rows
        which = impl.Impl.TORCH
    return impl.dense_grad(which, grad, dims, rows, ids, offsets, per_sample_weights)


def _check_grad(op: str, grad: Tensor, dims: list[int], rows: list[int], ids: Tensor, offsets: Tensor,
                psw: Tensor | None) -> int:
    if len(dims) == 0 or len(rows) != len(dims) or min(dims) < 0 or min(rows) < 0:
        raise _fail(op, "dims, rows", (dims, rows), "one non-negative entry per table (>= 1)")
    b = _check_batch(op, len(dims), ids, offsets, psw, grad.device)
    width = sum(dims)
    if grad.dtype != torch.float32 or tuple(grad.shape) != (b, width) or (
            width > 0 and grad.stride(1) != 1) or (b > 1 and grad.stride(0) < width):
        raise _fail(op, "grad", f"{grad.dtype} of shape {tuple(grad.shape)} strides {grad.stride()}",
                    f"float32 ({b}, {width}) with unit column stride")
    return b


@_register("sparse_update", "CPU")
def sparse_update(weights: Tensor, weights_offsets: list[int], dims: list[int], rows: list[int], grad: Tensor,
                  ids: Tensor, offsets: Tensor, per_sample_weights: Tensor | None, kind: str,
                  momentum1: Tensor | None, momentum1_offsets: list[int], momentum2: Tensor | None,
                  momentum2_offsets: list[int], lr: float, eps: float, weight_decay: float, decay: int,
                  beta1: float, beta2: float, step: int) -> None:
    """A fused optimizer's update of every table of one storage, in place (see the module docstring)."""
    b = _check_update(weights, weights_offsets, dims, rows, grad, ids, offsets, per_sample_weights, kind,
                      momentum1, momentum1_offsets, momentum2, momentum2_offsets)
    which = choose.update_impl(weights.device, kind, weight_decay)
    if which is impl.Impl.TORCH:
        raise ValueError(f"tdb::sparse_update: no one-pass kernel for kind {kind!r} with weight_decay={weight_decay} "
                         "on this host (kernels.choose.update_impl)")
    if which is not impl.Impl.NATIVE:  # ours checks every table's in its grouping pass, before any update
        _check_ids("sparse_update", ids, offsets, rows, b)  # every table's, before the first one is updated
    impl.sparse_update(which, weights, weights_offsets, dims, rows, grad, ids, offsets, per_sample_weights, kind,
                       momentum1, momentum1_offsets, momentum2, momentum2_offsets, lr, eps, weight_decay, decay,
                       beta1, beta2, step)
    _bump_versions(weights, momentum1, momentum2)


@_register("sparse_update", "fake")
def _(weights: Tensor, weights_offsets: list[int], dims: list[int], rows: list[int], grad: Tensor, ids: Tensor,
      offsets: Tensor, per_sample_weights: Tensor | None, kind: str, momentum1: Tensor | None,
      momentum1_offsets: list[int], momentum2: Tensor | None, momentum2_offsets: list[int], lr: float, eps: float,
      weight_decay: float, decay: int, beta1: float, beta2: float, step: int) -> None:
    _check_update(weights, weights_offsets, dims, rows, grad, ids, offsets, per_sample_weights, kind, momentum1,
                  momentum1_offsets, momentum2, momentum2_offsets)


@_register("sparse_update", "CUDA")
def _(weights: Tensor, weights_offsets: list[int], dims: list[int], rows: list[int], grad: Tensor, ids: Tensor,
      offsets: Tensor, per_sample_weights: Tensor | None, kind: str, momentum1: Tensor | None,
      momentum1_offsets: list[int], momentum2: Tensor | None, momentum2_offsets: list[int], lr: float, eps: float,
      weight_decay: float, decay: int, beta1: float, beta2: float, step: int) -> None:
    b = _check_update(weights, weights_offsets, dims, rows, grad, ids, offsets, per_sample_weights, kind,
                      momentum1, momentum1_offsets, momentum2, momentum2_offsets)
    which = choose.update_impl(weights.device, kind, weight_decay)
    if which is impl.Impl.TORCH:
        raise ValueError(f"tdb::sparse_update: no one-pass kernel for kind {kind!r} with weight_decay={weight_decay} "
                         f"on {weights.device} (kernels.choose.update_impl)")
    per_element = kind in ("adagrad", "adam")  # element-wise state is read like the rows
    states_fit = not per_element or all(fbgemm.fits(m, at, dims) for m, at in (
        (momentum1, momentum1_offsets), (momentum2, momentum2_offsets)) if m is not None)
    if not fbgemm.fits(weights, weights_offsets, dims) or not states_fit:
        raise ValueError(f"tdb::sparse_update: fbgemm's CUDA kernels read 16-byte aligned rows: dims {dims}, "
                         f"element offsets {weights_offsets} (state {momentum1_offsets}, {momentum2_offsets}) must "
                         f"be multiples of {fbgemm.ALIGN} and the storage aligned")
    check_ids_on_device("sparse_update", ids, offsets, rows, b)
    if b == 0 or ids.numel() == 0:
        _bump_versions(weights, momentum1, momentum2)
        return
    impl.sparse_update(which, weights, weights_offsets, dims, rows, grad, ids, offsets, per_sample_weights, kind,
                       momentum1, momentum1_offsets, momentum2, momentum2_offsets, lr, eps, weight_decay, decay,
                       beta1, beta2, step)
    _bump_versions(weights, momentum1, momentum2)


def _check_update(weights: Tensor, weights_offsets: list[int], dims: list[int], rows: list[int], grad: Tensor,
                  ids: Tensor, offsets: Tensor, psw: Tensor | None, kind: str, momentum1: Tensor | None,
                  momentum1_offsets: list[int], momentum2: Tensor | None, momentum2_offsets: list[int]) -> int:
    _check_tables("sparse_update", weights, weights_offsets, dims, rows)
    b = _check_grad("sparse_update", grad, dims, rows, ids, offsets, psw)
    if grad.device != weights.device:
        raise _fail("sparse_update", "grad", f"on {grad.device}", f"on the weights' device {weights.device}")
    if kind not in _KINDS:
        raise _fail("sparse_update", "kind", repr(kind), f"one of {list(_KINDS)}")
    wants = {"sgd": (False, False), "rowwise_adagrad": (True, False), "adagrad": (True, False), "adam": (True, True)}
    given = (momentum1 is not None, momentum2 is not None)
    if given != wants[kind]:
        raise _fail("sparse_update", "momentum1, momentum2", f"given: {given}", f"given: {wants[kind]} for {kind!r}")
    for name, m, at in (("momentum1", momentum1, momentum1_offsets), ("momentum2", momentum2, momentum2_offsets)):
        if m is None:
            continue
        if m.dim() != 1 or m.dtype != torch.float32 or m.stride(0) != 1 or m.device != weights.device:
            raise _fail("sparse_update", name, f"{m.dtype} of shape {tuple(m.shape)} on {m.device}",
                        f"a flat contiguous float32 tensor on {weights.device}")
        if len(at) != len(dims):
            raise _fail("sparse_update", f"{name}_offsets", at, "one offset per table")
        for t, (o, d, r) in enumerate(zip(at, dims, rows)):
            size = r if kind == "rowwise_adagrad" else r * d  # per-row state: one value per row
            if o < 0 or o + size > m.numel():
                raise _fail("sparse_update", f"{name} of table {t}", f"offset {o}, {size} values",
                            f"inside {name} of {m.numel()} elements ({r} rows of table {t})")
    return b
