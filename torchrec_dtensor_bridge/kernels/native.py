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

Steps of a call (every table of one storage at once, in fbgemm's form: element offsets into one flat
storage, ``T * B + 1`` table-major bag boundaries):

1. :func:`kernel` loads the library :mod:`.build` compiled (rebuilt once if it does not load).
2. :meth:`NativeKernel.pool_tables` / :meth:`NativeKernel.update_tables` check every argument (a
   ``ValueError`` naming it; the C code trusts what passes), shapes, dtypes, strides and every table's
   place in the storage and in the state buffers included; an update's C grouping pass checks every
   table's ids before any row is written.
3. The work is split on bag (pooling) or row (update) boundaries over the torch threads; ctypes
   releases the GIL during each call.

:meth:`NativeKernel.ids_valid` is the one-pass id check the ops run before fbgemm's kernels, which read
where the ids point.

With ``TDB_NATIVE_KERNELS=0``, or without a working compiler, :func:`kernel` is ``None``.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import ctypes
import functools
import itertools
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
_VERSION = 8
_MAX_DIM = 8192
_MIN_PER_THREAD = 16384  # occurrences: below this, one thread
_BAD_ARGUMENTS = -1000000  # cpu_kernels.c's TDB_BAD_ARGUMENTS


class NativeKernel:
    """The loaded library: :meth:`pool_tables` (a lookup's forward) and :meth:`update_tables` (an optimizer
    step) over every table of one flat storage in one call each; :meth:`pool_sum` and :meth:`update` for one
    2-D shard."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        if lib.tdb_version() != _VERSION:
            raise OSError(f"{path}: kernel version {lib.tdb_version()}, expected {_VERSION}")
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.tdb_group_tables.argtypes = [i64, p, p, i64, p, i64, p, p, p, p, p]
        lib.tdb_group_tables.restype = i32
        lib.tdb_apply_tables.argtypes = [i32, i32, p, i64, p, p, p, p, p, p, p, i64, p, p, p, p, p, p, p, i64, i64,
                                         i64, p]
        lib.tdb_apply_tables.restype = i32
        lib.tdb_bag_square_sums_tables.argtypes = [p, i64, i64, p, p, i64, p]
        lib.tdb_bag_square_sums_tables.restype = None
        lib.tdb_pool_tables.argtypes = [p, i64, p, p, p, p, i64, p, p, i64, p, i64, i64, i64, p]
        lib.tdb_pool_tables.restype = i32
        lib.tdb_update_tables.argtypes = [i32, i32, p, i64, p, p, p, p, p, p, p, p, i64, p, p, p, i64, p, i64, p, p,
                                          p, p, p, p, p]
        lib.tdb_update_tables.restype = i32
        lib.tdb_check_tables.argtypes = [i64, p, p, i64, p, i64]
        lib.tdb_check_tables.restype = i32
        self.lib, self.path = lib, path

    def ids_valid(self, ids: torch.Tensor, offsets: torch.Tensor, rows: list[int]) -> bool:
        """Whether every table's ids lie inside its ``rows`` and the ``T * B + 1`` ``offsets`` (absolute
        positions in ``ids``, table-major) run forward inside ``ids``: one pass, no row read. ``ids``,
        ``offsets``: contiguous 1-D int64 CPU tensors (checked by the caller)."""
        tables = len(rows)
        bags = (offsets.numel() - 1) // tables
        return self.lib.tdb_check_tables(tables, _i64(tuple(rows)).data_ptr(), ids.data_ptr(), ids.numel(),
                                         offsets.data_ptr(), bags) == 0

    def pool_tables(self, weights: torch.Tensor, weights_offsets: list[int], dims: list[int], rows: list[int],
                    ids: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, sum(dims))``: every table's bag sums side by side, each added in id order (as fbgemm's forward
        and ``torch.embedding_bag`` add them), in one call.

        ``weights``: a flat contiguous fp32 CPU storage, table ``t``'s ``rows[t] x dims[t]`` rows at element
        ``weights_offsets[t]`` (read in place); ``ids``, ``offsets``: int64, ``T * B + 1`` bag boundaries
        (absolute positions in ``ids``, table-major); ``out``: where to write (``(B, sum(dims))`` fp32 with
        unit column stride), else a new tensor.
        """
        what = "pooled lookup"
        tables, ids, offsets, psw = _inputs(what, weights, weights_offsets, dims, rows, ids, offsets,
                                            per_sample_weights)
        bags, width = (offsets.numel() - 1) // tables, sum(dims)
        if out is None:
            out = torch.empty(bags, width, dtype=torch.float32)
        elif out.dtype != torch.float32 or tuple(out.shape) != (bags, width) or (width and out.stride(1) != 1) or (
                bags > 1 and out.stride(0) < width):
            raise _fail(what, "out", f"{out.dtype} {tuple(out.shape)} strides {out.stride()}",
                        f"float32 ({bags}, {width}) with unit column stride")
        head = (weights.data_ptr(), tables, _i64(tuple(weights_offsets)).data_ptr(), _i64(tuple(dims)).data_ptr(),
                _i64(tuple(rows)).data_ptr(), out.data_ptr(), out.stride(0) if bags else width,
                _i64(tuple(_starts(dims))).data_ptr(), ids.data_ptr(), ids.numel(), offsets.data_ptr(), bags)
        # all tables' bags split evenly over the torch threads (each bag's sum is the same whatever the split)
        total = tables * bags
        parts = max(1, min(torch.get_num_threads(), ids.numel() // _MIN_PER_THREAD, total))
        for rc in _in_parts(self.lib.tdb_pool_tables, head, [total * k // parts for k in range(parts + 1)],
                            (_ptr(psw),)):
            if rc != 0:
                raise ValueError(f"{what}: ids of table {-1 - rc} outside [0, {rows[-1 - rc]}) or offsets out "
                                 "of order")
        return out

    def update_tables(
        self, kind: int, weights: torch.Tensor, weights_offsets: list[int], dims: list[int], rows: list[int],
        grad: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None,
        state: torch.Tensor | None, state_offsets: list[int], lr: float, eps: float, weight_decay: float = 0.0,
        decay: int = DECAY_NONE, *, state2: torch.Tensor | None = None, state2_offsets: list[int] | None = None,
        beta1: float = 0.9, beta2: float = 0.999, step: int = 1,
    ) -> None:
        """Update every table's touched rows (and their state) in place, in one call; nothing is modified
        unless every argument (every table's ids included) is valid.

        ``weights``, ``ids``, ``offsets``: as :meth:`pool_tables`; ``grad``: the bags' output gradient
        ``(B, sum(dims))`` fp32 with unit column stride, table ``t`` at its columns; ``state``: a flat fp32
        buffer with table ``t``'s state at element ``state_offsets[t]``: per row (``rows[t]`` values,
        row-wise Adagrad) or like its rows (Adagrad; Adam's momentum1, with ``state2`` its momentum2 at
        ``state2_offsets``), else ``None``; ``weight_decay`` with ``decay`` :data:`DECAY_L2` (not Adam) or
        :data:`DECAY_DECOUPLED` (row-wise Adagrad, Adam), as :mod:`..optim.update`; Adam's ``beta1``,
        ``beta2`` and ``step`` (counted from 1, this one included) as there.
        """
        what = "sparse update"
        tables, ids, offsets, psw = _inputs(what, weights, weights_offsets, dims, rows, ids, offsets,
                                            per_sample_weights)
        bags = (offsets.numel() - 1) // tables
        _check_grad(grad, bags, sum(dims))
        if kind not in (SGD, ROWWISE_ADAGRAD, ADAGRAD, ADAM):
            raise _fail(what, "kind", kind, "one of SGD, ROWWISE_ADAGRAD, ADAGRAD, ADAM")
        want = {SGD: (False, False), ROWWISE_ADAGRAD: (True, False), ADAGRAD: (True, False), ADAM: (True, True)}[kind]
        if (state is not None, state2 is not None) != want:
            raise _fail(what, "state, state2", (state is not None, state2 is not None),
                        f"given as {want} for kind {kind}")
        per_row = kind == ROWWISE_ADAGRAD
        for name, st, at in (("state", state, state_offsets), ("state2", state2, state2_offsets)):
            if st is not None:
                _check_state(name, st, at, dims, rows, per_row)
        if decay not in (DECAY_NONE, DECAY_L2, DECAY_DECOUPLED) or (decay == DECAY_L2 and kind == ADAM) or (
                decay == DECAY_DECOUPLED and kind not in (ROWWISE_ADAGRAD, ADAM)):
            raise _fail(what, "decay", decay, "L2 (not Adam), decoupled (row-wise Adagrad, Adam) or none")
        n = ids.numel()
        if n == 0 or bags == 0:
            return
        work = torch.empty(5, n, dtype=torch.int32)
        keys, occ, bag_of = work[0], work[1], work[2]
        if not weight_decay:
            decay = DECAY_NONE
        rows_t, goff, dims_t = _i64(tuple(rows)), _i64(tuple(_starts(dims))), _i64(tuple(dims))
        woff_t = _i64(tuple(weights_offsets))
        soff_t = None if state is None else _i64(tuple(state_offsets))
        s2off_t = None if state2 is None else _i64(tuple(state2_offsets or ()))
        bag_sq = None  # row-wise Adagrad: a row touched once takes its statistic from its bag's
        if kind == ROWWISE_ADAGRAD and decay != DECAY_L2:
            bag_sq = torch.empty(tables * bags, dtype=torch.float32)
        hyper = torch.tensor([lr, eps, weight_decay, beta1, beta2, lr / (1 - beta1**step) if kind == ADAM else 0.0,
                              1 - beta2**step if kind == ADAM else 1.0], dtype=torch.float32)
        tables_args = (weights.data_ptr(), tables, woff_t.data_ptr(), dims_t.data_ptr())
        states = (_ptr(state), _ptr(soff_t), _ptr(state2), _ptr(s2off_t))
        grads = (grad.data_ptr(), grad.stride(0), goff.data_ptr(), _ptr(psw))
        threads = torch.get_num_threads()
        if threads == 1 or n < 2 * _MIN_PER_THREAD:  # each table grouped right before its walk
            rc = self.lib.tdb_update_tables(
                kind, decay, *tables_args, rows_t.data_ptr(), *states, *grads, ids.data_ptr(), n, offsets.data_ptr(),
                bags, *(w.data_ptr() for w in work), _ptr(bag_sq), hyper.data_ptr())
            self._raise(rc, rows, n)
            return
        # several threads: every table grouped first (nothing written unless every id is valid), then the
        # walks, cut over all tables' occurrences on row boundaries
        rc = self.lib.tdb_group_tables(tables, rows_t.data_ptr(), ids.data_ptr(), n, offsets.data_ptr(), bags,
                                       *(w.data_ptr() for w in work))
        self._raise(rc, rows, n)
        if bag_sq is not None:
            self.lib.tdb_bag_square_sums_tables(grad.data_ptr(), grad.stride(0), tables, goff.data_ptr(),
                                                dims_t.data_ptr(), bags, bag_sq.data_ptr())
        head = (kind, decay, *tables_args, *states, *grads, keys.data_ptr(), occ.data_ptr(), bag_of.data_ptr(),
                _ptr(bag_sq), offsets.data_ptr(), bags)
        bounds = offsets[::bags].tolist()
        for rc in _in_parts(self.lib.tdb_apply_tables, head, _row_cuts(keys, threads, bounds), (hyper.data_ptr(),)):
            self._raise(rc, rows, n)

    @staticmethod
    def _raise(rc: int, rows: list[int], n: int) -> None:
        """The exception for a return code of the update's C functions (none for 0)."""
        if rc == 0:
            return
        if rc == -1:
            raise _fail("sparse update", "offsets", "boundaries out of order", f"non-decreasing within [0, {n}]")
        if rc == _BAD_ARGUMENTS:
            raise RuntimeError("sparse update kernel: bad arguments (kind, decay or width)")
        raise ValueError(f"sparse update: ids of table {-2 - rc} outside [0, {rows[-2 - rc]})")

    def pool_sum(self, weight: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                 per_sample_weights: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`pool_tables` of one shard ``weight`` (a contiguous fp32 CPU ``(rows, dim)``), ``offsets`` its
        ``bags + 1`` bag boundaries."""
        _check_shard("pooled lookup", weight)
        return self.pool_tables(weight.view(-1), [0], [weight.shape[1]], [weight.shape[0]], ids, offsets,
                                per_sample_weights, out)

    def update(
        self, kind: int, weight: torch.Tensor, grad: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None, state: torch.Tensor | None, lr: float, eps: float,
        weight_decay: float = 0.0, decay: int = DECAY_NONE, *, state2: torch.Tensor | None = None,
        beta1: float = 0.9, beta2: float = 0.999, step: int = 1,
    ) -> None:
        """:meth:`update_tables` of one shard ``weight`` (a contiguous fp32 CPU ``(rows, dim)``), ``offsets``
        its ``bags + 1`` bag boundaries, ``state`` (and ``state2``) ``(rows,)`` (row-wise Adagrad) or like
        ``weight``."""
        _check_shard("sparse update", weight)
        rows, dim = weight.shape
        want = (rows,) if kind == ROWWISE_ADAGRAD else (rows, dim)
        flat = []
        for name, st in (("state", state), ("state2", state2)):
            if st is not None and tuple(st.shape) != want:
                raise _fail("sparse update", name, f"shape {tuple(st.shape)}", f"{want}: " + (
                    "row-wise Adagrad keeps one value per row" if kind == ROWWISE_ADAGRAD else "element-wise state"))
            if st is not None and not st.is_contiguous():
                raise _fail("sparse update", name, f"strides {st.stride()}", "contiguous")
            flat.append(None if st is None else st.view(-1))
        self.update_tables(kind, weight.view(-1), [0], [dim], [rows], grad, ids, offsets, per_sample_weights,
                           flat[0], [0], lr, eps, weight_decay, decay, state2=flat[1], state2_offsets=[0],
                           beta1=beta1, beta2=beta2, step=step)


def _fail(what: str, name: str, got: object, want: str) -> ValueError:
    return ValueError(f"{what}: {name} must be {want}, got {got}")


def _check_shard(what: str, weight: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise _fail(what, "weight", f"{weight.dtype} {tuple(weight.shape)} on {weight.device}",
                    "a 2-D float32 CPU tensor")
    if not weight.is_contiguous():
        raise _fail(what, "weight", f"strides {weight.stride()}", "contiguous")


def _inputs(what: str, weights: torch.Tensor, weights_offsets: list[int], dims: list[int], rows: list[int],
            ids: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None,
            ) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Checks a kernel's tables and batch (exceptions naming the argument: the C code trusts what passes);
    returns the table count, the ids and offsets contiguous (a strided view of the caller's is read as is)
    and the per-sample weights as contiguous fp32 (or ``None``)."""
    if weights.dim() != 1 or weights.dtype != torch.float32 or weights.device.type != "cpu" or (
            weights.numel() > 1 and weights.stride(0) != 1):
        raise _fail(what, "weights", f"{weights.dtype} {tuple(weights.shape)} strides {weights.stride()} on "
                    f"{weights.device}", "a flat contiguous float32 CPU tensor")
    tables = len(dims)
    if tables == 0 or len(rows) != tables or len(weights_offsets) != tables:
        raise _fail(what, "weights_offsets, dims, rows", (weights_offsets, dims, rows), "one entry per table (>= 1)")
    for t, (at, d, r) in enumerate(zip(weights_offsets, dims, rows)):
        if not 0 <= d <= _MAX_DIM:
            raise _fail(what, f"table {t}", f"{d} columns", f"at most {_MAX_DIM} columns wide")
        if not 0 <= r < 2**31:
            raise _fail(what, f"table {t}", f"{r} rows", "below 2**31 rows")
        if at < 0 or at + r * d > weights.numel():
            raise _fail(what, f"table {t}", f"offset {at}, {r} rows x {d} columns",
                        f"inside weights of {weights.numel()} elements")
    for name, x in (("ids", ids), ("offsets", offsets)):
        if x.dim() != 1 or x.dtype != torch.int64 or x.device.type != "cpu":
            raise _fail(what, name, f"{x.dtype} {tuple(x.shape)} on {x.device}", "a 1-D int64 CPU tensor")
    if offsets.numel() < 1 or (offsets.numel() - 1) % tables:
        raise _fail(what, "offsets", f"{offsets.numel()} boundaries", f"T * B + 1 bag boundaries for T = {tables}")
    if ids.numel() >= 2**31:
        raise _fail(what, "ids", f"{ids.numel()} ids", "fewer than 2**31")
    psw = None
    if per_sample_weights is not None:
        if per_sample_weights.shape != ids.shape or not per_sample_weights.is_floating_point():
            raise _fail(what, "per_sample_weights", f"{per_sample_weights.dtype} {tuple(per_sample_weights.shape)}",
                        f"floating point of shape {tuple(ids.shape)} (one per id)")
        psw = per_sample_weights.to(torch.float32).contiguous()
    return tables, ids.contiguous(), offsets.contiguous(), psw


def _check_grad(grad: torch.Tensor, bags: int, width: int) -> None:
    if grad.dtype != torch.float32 or grad.device.type != "cpu" or tuple(grad.shape) != (bags, width):
        raise _fail("sparse update", "grad", f"{grad.dtype} {tuple(grad.shape)} on {grad.device}",
                    f"float32 on CPU of shape ({bags}, {width})")
    if width and (grad.stride(1) != 1 or (bags > 1 and grad.stride(0) < width)):
        raise _fail("sparse update", "grad", f"strides {grad.stride()}", "rows of unit column stride")


def _check_state(name: str, st: torch.Tensor, at: list[int] | None, dims: list[int], rows: list[int],
                 per_row: bool) -> None:
    """A flat fp32 state buffer holding every table's state where ``at`` says: ``rows[t]`` values per table
    (``per_row``: row-wise Adagrad), else ``rows[t] x dims[t]``."""
    if st.dim() != 1 or st.dtype != torch.float32 or st.device.type != "cpu" or (st.numel() > 1 and st.stride(0) != 1):
        raise _fail("sparse update", name, f"{st.dtype} {tuple(st.shape)} strides {st.stride()} on {st.device}",
                    "a flat contiguous float32 CPU tensor")
    if at is None or len(at) != len(dims):
        raise _fail("sparse update", f"{name}_offsets", at, "one offset per table")
    for t, (o, d, r) in enumerate(zip(at, dims, rows)):
        size = r if per_row else r * d
        if o < 0 or o + size > st.numel():
            raise _fail("sparse update", f"{name} of table {t}", f"offset {o}, {size} values",
                        f"inside {name} of {st.numel()} elements ({r} rows" + ("" if per_row else f" x {d}") + ")")


def _starts(sizes: list[int]) -> list[int]:
    """Where each of ``sizes`` starts when laid back to back."""
    return list(itertools.accumulate(sizes[:-1], initial=0))


@functools.lru_cache(maxsize=1024)
def _i64(values: tuple[int, ...]) -> torch.Tensor:
    """``values`` as an int64 CPU tensor the C code reads (one per distinct tuple; never modified)."""
    return torch.tensor(values, dtype=torch.int64)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _in_parts(fn: Callable[..., int], head: tuple, cuts: list[int], tail: tuple) -> list[int]:
    """``fn(*head, a, b, *tail)`` for every range ``[a, b)`` of ``cuts``: on the thread pool when there are
    several (ctypes releases the GIL), else here; the return codes in order."""
    if len(cuts) == 2:
        return [fn(*head, cuts[0], cuts[1], *tail)]
    futures = [_pool(len(cuts) - 1).submit(fn, *head, a, b, *tail) for a, b in zip(cuts[:-1], cuts[1:])]
    return [f.result() for f in futures]


def _row_cuts(keys: torch.Tensor, threads: int, bounds: list[int] | None = None) -> list[int]:
    """Split points of the grouped occurrences, one range per thread, never inside a row: ``bounds`` are the
    tables' first positions and the last one's end (each table's keys sorted; by default one table over all
    of ``keys``)."""
    if bounds is None:
        bounds = [0, keys.numel()]
    first, last = bounds[0], bounds[-1]
    parts = max(1, min(threads, (last - first) // _MIN_PER_THREAD))
    if parts == 1:
        return [first, last]
    cuts = {first, last}
    for k in range(1, parts):
        guess = first + (last - first) * k // parts
        t = bisect.bisect_right(bounds, guess) - 1  # the table holding it
        lo, hi = bounds[t], bounds[t + 1]
        if lo < guess < hi:  # back to where its row starts
            guess = lo + int(torch.searchsorted(keys[lo:hi], keys[guess : guess + 1]).item())
        cuts.add(guess)
    return sorted(cuts)


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
