"""This package's own CPU kernels (``cpu_kernels.c``) through ctypes: the pooled sum of a lookup, the fused
optimizers' updates.

Why kernels of our own: fbgemm_gpu-cpu's backward-with-optimizer kernels sum
each row's gradient element by element (SGD) or run a gradient-summing pass
with one "bag" per touched row (row-wise Adagrad), have no CPU Adam and ignore
weight decay. ``cpu_kernels.c`` sorts the occurrences by row (a radix sort),
then walks the touched rows in increasing order, prefetching the rows ahead,
reading a row's bag gradient in place when it occurs once (most rows) and
summing it first otherwise. Its pooled sum adds in fbgemm's order (the same
bits). The math is fbgemm's (``EXACT_SGD`` / ``EXACT_ROWWISE_ADAGRAD`` /
``EXACT_ADAGRAD`` / ``ADAM``; weight decay as :mod:`..optim.update`), tested
against fbgemm's own kernels and the unsharded reference optimizer; whether it
is faster than fbgemm's depends on the CPU (BENCHMARKS.md), which is why
:mod:`.choose` measures both on the machine at hand.

Steps of a call:

1. :func:`kernel` loads the library :mod:`.build` compiled (rebuilt once if it does not load).
2. :meth:`NativeKernel.pool_sum` / :meth:`NativeKernel.update` check every argument (a ``ValueError``
   naming it; the C code trusts what passes), shapes, dtypes, strides and the state's rows included.
3. The work is split on bag (pooling) or row (update) boundaries over the torch threads; ctypes
   releases the GIL during each call.

With ``TDB_NATIVE_KERNELS=0``, or without a working compiler, :func:`kernel` is ``None``.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from . import build

__all__ = ["ADAGRAD", "ADAM", "DECAY_DECOUPLED", "DECAY_L2", "DECAY_NONE", "ROWWISE_ADAGRAD", "SGD", "NativeKernel", "kernel"]

log = logging.getLogger(__name__)

SGD, ROWWISE_ADAGRAD, ADAGRAD, ADAM = 0, 1, 2, 3
DECAY_NONE, DECAY_L2, DECAY_DECOUPLED = 0, 1, 2  # as optim.kinds.WeightDecayMode
_VERSION = 6
_MAX_DIM = 8192
_MIN_PER_THREAD = 16384  # occurrences: below this, one thread


class NativeKernel:
    """The loaded library: :meth:`pool_sum` (a lookup's forward) and :meth:`update` (an optimizer step)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        if lib.tdb_version() != _VERSION:
            raise OSError(f"{path}: kernel version {lib.tdb_version()}, expected {_VERSION}")
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.tdb_group.argtypes = [p, i64, p, i64, i64, p, p, p, p, p]
        lib.tdb_group.restype = ctypes.c_int
        lib.tdb_apply.argtypes = [ctypes.c_int, ctypes.c_int, p, i64, i64, p, p, i64, p, i64, p, p, p, p, p, i64, i64, p]
        lib.tdb_bag_square_sums.argtypes = [p, i64, i64, i64, p]
        lib.tdb_bag_square_sums.restype = None
        lib.tdb_pool_sum.argtypes = [p, i64, i64, i64, p, i64, p, i64, p, i64, i64, p]
        lib.tdb_pool_sum.restype = ctypes.c_int
        lib.tdb_apply.restype = ctypes.c_int
        self.lib, self.path = lib, path

    def pool_sum(self, weight: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                 per_sample_weights: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """``(bags, dim)``: per bag, the sum of ``weight``'s rows at its ``ids`` (times the per-sample weights),
        added in id order, as fbgemm's forward and ``torch.embedding_bag`` add them.

        ``weight``: a contiguous fp32 CPU shard (read in place); ``ids``, ``offsets``: int64 local rows and
        ``bags + 1`` bag boundaries (positions in ``ids``); ``out``: where to write (``(bags, dim)`` fp32 with
        unit column stride, e.g. a column slice of a wider output), else a new tensor.
        """
        ids, offsets, psw = _inputs("pooled lookup", weight, ids, offsets, per_sample_weights)
        rows, dim = weight.shape
        bags = offsets.numel() - 1
        if out is None:
            out = torch.empty(bags, dim, dtype=torch.float32)
        elif out.dtype != torch.float32 or tuple(out.shape) != (bags, dim) or (dim and out.stride(1) != 1) or (
                bags > 1 and out.stride(0) < dim):
            raise _fail("pooled lookup", "out", f"{out.dtype} {tuple(out.shape)} strides {out.stride()}",
                        f"float32 ({bags}, {dim}) with unit column stride")
        head = (weight.data_ptr(), dim, dim, rows, out.data_ptr(), out.stride(0) if bags else dim, ids.data_ptr(),
                ids.numel(), offsets.data_ptr())
        # bags split evenly over the torch threads (each bag's sum is the same whatever the split)
        parts = max(1, min(torch.get_num_threads(), ids.numel() // _MIN_PER_THREAD, bags))
        cuts = [bags * k // parts for k in range(parts + 1)]
        if any(_in_parts(self.lib.tdb_pool_sum, head, cuts, (_ptr(psw),))):
            raise ValueError(f"pooled lookup: ids outside [0, {rows}) or offsets out of order")
        return out

    def update(
        self, kind: int, weight: torch.Tensor, grad: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None, state: torch.Tensor | None, lr: float, eps: float,
        weight_decay: float = 0.0, decay: int = DECAY_NONE, *, state2: torch.Tensor | None = None,
        beta1: float = 0.9, beta2: float = 0.999, step: int = 1,
    ) -> None:
        """Update ``weight`` (and ``state``) in place at the rows ``ids`` touches.

        ``weight``: a contiguous fp32 CPU shard ``(rows, dim)``; ``grad``: the bags' output gradient
        ``(bags, dim)`` fp32 with unit column stride (a column slice is read in place); ``ids``,
        ``offsets``: int64 local rows and ``bags + 1`` bag boundaries; ``state``: per-row fp32
        momentum ``(rows,)`` (row-wise Adagrad) or one like ``weight`` (Adagrad; Adam's momentum1, with
        ``state2`` its momentum2), else ``None``; ``weight_decay`` with ``decay`` :data:`DECAY_L2` (not
        Adam) or :data:`DECAY_DECOUPLED` (row-wise Adagrad, Adam), as :mod:`..optim.update`; Adam's
        ``beta1``, ``beta2`` and ``step`` (counted from 1, this one included) as there.
        """
        ids, offsets, psw = _inputs("sparse update", weight, ids, offsets, per_sample_weights)
        rows, dim = weight.shape
        n, bags = ids.numel(), offsets.numel() - 1
        _check_grad(grad, bags, dim)
        if kind not in (SGD, ROWWISE_ADAGRAD, ADAGRAD, ADAM):
            raise _fail("sparse update", "kind", kind, "one of SGD, ROWWISE_ADAGRAD, ADAGRAD, ADAM")
        want = {SGD: (False, False), ROWWISE_ADAGRAD: (True, False), ADAGRAD: (True, False), ADAM: (True, True)}[kind]
        if (state is not None, state2 is not None) != want:
            raise _fail("sparse update", "state, state2", (state is not None, state2 is not None),
                        f"given as {want} for kind {kind}")
        lds = 0
        for name, st in (("state", state), ("state2", state2)):
            if st is not None:
                lds = _check_state(name, st, rows, dim)
        if kind == ROWWISE_ADAGRAD and lds != 1:
            raise _fail("sparse update", "state", "element-wise state", f"({rows},): row-wise Adagrad keeps one "
                        "value per row")
        if kind in (ADAGRAD, ADAM) and lds != dim and rows:
            raise _fail("sparse update", "state", "per-row state", f"({rows}, {dim}): element-wise state")
        if decay not in (DECAY_NONE, DECAY_L2, DECAY_DECOUPLED) or (decay == DECAY_L2 and kind == ADAM) or (
                decay == DECAY_DECOUPLED and kind not in (ROWWISE_ADAGRAD, ADAM)):
            raise _fail("sparse update", "decay", decay, "L2 (not Adam), decoupled (row-wise Adagrad, Adam) or none")
        if n == 0:
            return
        work = torch.empty(5, n, dtype=torch.int32)
        keys, occ, bag_of = work[0], work[1], work[2]
        rc = self.lib.tdb_group(ids.data_ptr(), n, offsets.data_ptr(), bags, rows, keys.data_ptr(),
                                occ.data_ptr(), bag_of.data_ptr(), work[3].data_ptr(), work[4].data_ptr())
        if rc != 0:
            raise ValueError(f"sparse update: ids outside [0, {rows}) or offsets out of order")
        if not weight_decay:
            decay = DECAY_NONE
        bag_sq = None
        if kind == ROWWISE_ADAGRAD and decay != DECAY_L2:  # a row touched once takes its statistic from here
            bag_sq = torch.empty(bags, dtype=torch.float32)
            self.lib.tdb_bag_square_sums(grad.data_ptr(), grad.stride(0), dim, bags, bag_sq.data_ptr())
        hyper = torch.tensor([lr, eps, weight_decay, beta1, beta2, lr / (1 - beta1**step) if kind == ADAM else 0.0,
                              1 - beta2**step if kind == ADAM else 1.0], dtype=torch.float32)
        head = (kind, decay, weight.data_ptr(), dim, dim, _ptr(state), _ptr(state2), lds, grad.data_ptr(),
                grad.stride(0), _ptr(psw),
                keys.data_ptr(), occ.data_ptr(), bag_of.data_ptr(), _ptr(bag_sq))
        for rc in _in_parts(self.lib.tdb_apply, head, _row_cuts(keys, torch.get_num_threads()), (hyper.data_ptr(),)):
            if rc != 0:
                raise RuntimeError(f"sparse update kernel: bad arguments ({rc})")


def _fail(what: str, name: str, got: object, want: str) -> ValueError:
    return ValueError(f"{what}: {name} must be {want}, got {got}")


def _inputs(what: str, weight: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
            per_sample_weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Checks a kernel's shard and batch (exceptions naming the argument: the C code trusts what passes);
    returns the ids and offsets contiguous (a strided view of the caller's is read as is) and the per-sample
    weights as contiguous fp32 (or ``None``)."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise _fail(what, "weight", f"{weight.dtype} {tuple(weight.shape)} on {weight.device}",
                    "a 2-D float32 CPU tensor")
    if not weight.is_contiguous():
        raise _fail(what, "weight", f"strides {weight.stride()}", "contiguous")
    if weight.shape[1] > _MAX_DIM:
        raise _fail(what, "weight", f"{weight.shape[1]} columns", f"at most {_MAX_DIM} columns wide")
    if weight.shape[0] >= 2**31:
        raise _fail(what, "weight", f"{weight.shape[0]} rows", "below 2**31 rows")
    for name, t in (("ids", ids), ("offsets", offsets)):
        if t.dim() != 1 or t.dtype != torch.int64 or t.device.type != "cpu":
            raise _fail(what, name, f"{t.dtype} {tuple(t.shape)} on {t.device}", "a 1-D int64 CPU tensor")
    if offsets.numel() < 1:
        raise _fail(what, "offsets", "an empty tensor", "bags + 1 bag boundaries")
    if ids.numel() >= 2**31:
        raise _fail(what, "ids", f"{ids.numel()} ids", "fewer than 2**31")
    psw = None
    if per_sample_weights is not None:
        if per_sample_weights.shape != ids.shape or not per_sample_weights.is_floating_point():
            raise _fail(what, "per_sample_weights", f"{per_sample_weights.dtype} {tuple(per_sample_weights.shape)}",
                        f"floating point of shape {tuple(ids.shape)} (one per id)")
        psw = per_sample_weights.to(torch.float32).contiguous()
    return ids.contiguous(), offsets.contiguous(), psw


def _check_grad(grad: torch.Tensor, bags: int, dim: int) -> None:
    if grad.dtype != torch.float32 or grad.device.type != "cpu" or tuple(grad.shape) != (bags, dim):
        raise _fail("sparse update", "grad", f"{grad.dtype} {tuple(grad.shape)} on {grad.device}",
                    f"float32 on CPU of shape ({bags}, {dim})")
    if dim and (grad.stride(1) != 1 or (bags > 1 and grad.stride(0) < dim)):
        raise _fail("sparse update", "grad", f"strides {grad.stride()}", "rows of unit column stride")


def _check_state(name: str, st: torch.Tensor, rows: int, dim: int) -> int:
    """The state's row stride (1: per-row state ``(rows,)``; ``dim``: element-wise ``(rows, dim)``)."""
    if st.dtype != torch.float32 or st.device.type != "cpu" or not st.is_contiguous():
        raise _fail("sparse update", name, f"{st.dtype} on {st.device}, strides {st.stride()}",
                    "a contiguous float32 CPU tensor")
    if tuple(st.shape) == (rows,):
        return 1
    if tuple(st.shape) == (rows, dim):
        return dim
    raise _fail("sparse update", name, f"shape {tuple(st.shape)}", f"({rows},) or ({rows}, {dim}), one per row")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _in_parts(fn: Callable[..., int], head: tuple, cuts: list[int], tail: tuple) -> list[int]:
    """``fn(*head, a, b, *tail)`` for every range ``[a, b)`` of ``cuts``: on the thread pool when there are
    several (ctypes releases the GIL), else here; the return codes in order."""
    if len(cuts) == 2:
        return [fn(*head, cuts[0], cuts[1], *tail)]
    futures = [_pool(len(cuts) - 1).submit(fn, *head, a, b, *tail) for a, b in zip(cuts[:-1], cuts[1:])]
    return [f.result() for f in futures]


def _row_cuts(keys: torch.Tensor, threads: int) -> list[int]:
    """``[0, ..., n]``: split points of the row-sorted occurrences on row boundaries, one range per thread."""
    n = keys.numel()
    parts = max(1, min(threads, n // _MIN_PER_THREAD))
    if parts == 1:
        return [0, n]
    guesses = [keys[n * k // parts].item() for k in range(1, parts)]
    starts = torch.searchsorted(keys, torch.tensor(guesses, dtype=keys.dtype)).tolist()
    return sorted({0, n, *starts})


@functools.lru_cache(maxsize=None)
def _pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tdb-cpu-kernels")


@functools.lru_cache(maxsize=1)
def kernel() -> NativeKernel | None:
    """The native kernels, built on first use; ``None`` when disabled (``TDB_NATIVE_KERNELS=0``) or they
    cannot be built (then logged once, and fbgemm's kernels serve).

    A cached library that does not load, or is of another version, is rebuilt once, not skipped: a process
    that quietly ran other kernels than its peers would be hard to find."""
    if os.environ.get("TDB_NATIVE_KERNELS", "1") == "0":
        return None
    try:
        try:
            return NativeKernel(build.library())
        except OSError as e:  # ctypes could not load it, or another version: build it again
            log.warning("torchrec_dtensor_bridge: cached native kernels unusable (%s); rebuilding", e)
            return NativeKernel(build.library(rebuild=True))
    except Exception as e:  # noqa: BLE001 - any build or load failure falls back to fbgemm's kernels
        log.warning("torchrec_dtensor_bridge: native CPU kernels unavailable, using fbgemm's: %s", e)
        return None
