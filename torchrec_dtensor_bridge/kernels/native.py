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
:mod:`.choose` measures both on the machine at hand. The kinds it updates are
those whose record (:mod:`...optim_kinds`) has a ``native`` code: the code
``cpu_kernels.c`` knows the kind by.

Steps of a call (every table of one storage at once, in the form of :mod:`.args`):

1. :func:`kernel` loads the library :mod:`.build` compiled (rebuilt once if it does not load).
2. :meth:`NativeKernel.pool_tables` / :meth:`NativeKernel.update_tables` trust their arguments: the ops
   (:mod:`.ops`) checked them, and :func:`fits` says whether the tables are within the C code's limits.
   The C code checks the ids itself, in the pass that groups them (an update) or sums them (pooling),
   before any row is written.
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
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..optim_kinds import Hyper, WeightDecayMode
from . import build
from .args import Batch, State, Tables

__all__ = ["DTYPES", "MAX_DIM", "NativeKernel", "fits", "kernel"]

log = logging.getLogger(__name__)

_VERSION = 10
MAX_DIM = 8192
"""The widest table the C code takes (``TDB_MAX_DIM``)."""
_MAX_ROWS = 2**31  # rows and ids are grouped as 32-bit keys
_MIN_PER_THREAD = 16384  # occurrences: below this, one thread
_BAD_ARGUMENTS = -1000000  # cpu_kernels.c's TDB_BAD_ARGUMENTS
_HALF = {torch.float16: 1, torch.bfloat16: 2}  # cpu_kernels16.c's TDB_F16, TDB_BF16
DTYPES = frozenset({torch.float32, *_HALF})
"""The weights' dtypes the C code takes (fp32: ``cpu_kernels.c``; fp16, bf16: ``cpu_kernels16.c``)."""


def fits(tables: Tables, batch: Batch) -> bool:
    """Whether the C code can take ``tables`` and ``batch`` (checked by :mod:`.ops` otherwise): at most
    :data:`MAX_DIM` columns and fewer than ``2**31`` rows per table, fewer than ``2**31`` ids."""
    return max(tables.dims) <= MAX_DIM and max(tables.rows) < _MAX_ROWS and batch.ids.numel() < _MAX_ROWS


class NativeKernel:
    """The loaded library: :meth:`pool_tables` (a lookup's forward) and :meth:`update_tables` (an optimizer
    step) over every table of one flat storage in one call each."""

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
        lib.tdb_pool_tables16.argtypes = [p, i32, i64, p, p, p, p, i64, p, p, i64, p, i64, i64, i64, p]
        lib.tdb_pool_tables16.restype = i32
        lib.tdb_bag_square_sums16.argtypes = [p, i64, i64, p, p, i64, p]
        lib.tdb_bag_square_sums16.restype = None
        lib.tdb_apply_tables16.argtypes = [i32, i32, p, i32, i32, ctypes.c_uint64, i64, p, p, p, p, p, p, p, i64, p,
                                           p, p, p, p, p, p, i64, i64, i64, p]
        lib.tdb_apply_tables16.restype = i32
        self.lib, self.path = lib, path

    def ids_valid(self, ids: torch.Tensor, offsets: torch.Tensor, rows: Sequence[int]) -> bool:
        """Whether every table's ids lie inside its ``rows`` and the ``T * B + 1`` ``offsets`` (absolute
        positions in ``ids``, table-major) run forward inside ``ids``: one pass, no row read. ``ids``,
        ``offsets``: contiguous 1-D int64 CPU tensors (checked by the caller)."""
        tables = len(rows)
        bags = (offsets.numel() - 1) // tables
        return self.lib.tdb_check_tables(tables, _i64(tuple(rows)).data_ptr(), ids.data_ptr(), ids.numel(),
                                         offsets.data_ptr(), bags) == 0

    def pool_tables(self, tables: Tables, batch: Batch) -> torch.Tensor:
        """``(B, sum(dims))``: every table's bag sums side by side, each added in id order (as fbgemm's forward
        and ``torch.embedding_bag`` add them), in one call. The ids are checked as they are read (before any
        row is): ``ValueError`` naming the table."""
        weights, dims, rows = tables.storage, tables.dims, tables.rows
        ids, offsets, psw = _contiguous(batch)
        n = len(dims)
        bags, width = (offsets.numel() - 1) // n, sum(dims)
        out = torch.empty(bags, width, dtype=torch.float32)
        half = _HALF.get(weights.dtype)  # fp16 / bf16: cpu_kernels16.c's, which also takes the type
        fn, first = (self.lib.tdb_pool_tables, (weights.data_ptr(),)) if half is None else (
            self.lib.tdb_pool_tables16, (weights.data_ptr(), half))
        head = (*first, n, _i64(tuple(tables.offsets)).data_ptr(), _i64(tuple(dims)).data_ptr(),
                _i64(tuple(rows)).data_ptr(), out.data_ptr(), out.stride(0) if bags else width,
                _i64(tuple(_starts(dims))).data_ptr(), ids.data_ptr(), ids.numel(), offsets.data_ptr(), bags)
        # all tables' bags split evenly over the torch threads (each bag's sum is the same whatever the split)
        total = n * bags
        parts = max(1, min(torch.get_num_threads(), ids.numel() // _MIN_PER_THREAD, total))
        for rc in _in_parts(fn, head, [total * k // parts for k in range(parts + 1)], (_ptr(psw),)):
            if rc != 0:
                raise ValueError(f"pooled lookup: ids of table {-1 - rc} outside [0, {rows[-1 - rc]}) or offsets "
                                 "out of order")
        return out

    def update_tables(self, tables: Tables, batch: Batch, grad: torch.Tensor, state: State, hyper: Hyper) -> None:
        """Update every table's touched rows (and their state) in place, in one call, with ``hyper.kind`` (a kind
        with a ``native`` code); nothing is modified unless every id is valid (``ValueError`` naming the table).

        ``grad``: the bags' output gradient ``(B, sum(dims))`` fp32 with unit column stride, table ``t`` at its
        columns; ``state``: as :class:`.args.State`; weight decay as :mod:`..optim.update`; the step counts
        from 1, this one included. fp16 and bf16 weights (``cpu_kernels16.c``): fp32 math and state, each row
        written back rounded once, stochastically (``hyper.stochastic_rounding``; the seed drawn from torch's
        default generator, so that ``torch.manual_seed`` repeats a run) or to nearest even.
        """
        weights, dims, rows, kind = tables.storage, tables.dims, tables.rows, hyper.kind
        assert kind.native is not None, f"{kind.name}: no native kernel"
        ids, offsets, psw = _contiguous(batch)
        n_tables = len(dims)
        bags, n = (offsets.numel() - 1) // n_tables, ids.numel()
        if n == 0 or bags == 0:
            return
        work = torch.empty(5, n, dtype=torch.int32)
        keys, occ, bag_of = work[0], work[1], work[2]
        decay = hyper.weight_decay_mode if hyper.weight_decay else WeightDecayMode.NONE
        rows_t, goff, dims_t = _i64(tuple(rows)), _i64(tuple(_starts(dims))), _i64(tuple(dims))
        m1, m2 = state.momentum1, state.momentum2
        m1_at = None if m1 is None else _i64(tuple(state.momentum1_offsets))
        m2_at = None if m2 is None else _i64(tuple(state.momentum2_offsets))
        half = _HALF.get(weights.dtype)
        values = _hyper_values(hyper, state.step, torch.float32 if half is None else torch.float64)
        tables_args = (weights.data_ptr(), n_tables, _i64(tuple(tables.offsets)).data_ptr(), dims_t.data_ptr())
        states = (_ptr(m1), _ptr(m1_at), _ptr(m2), _ptr(m2_at))
        grads = (grad.data_ptr(), grad.stride(0), goff.data_ptr(), _ptr(psw))
        # a per-row state: a row touched once takes its statistic from its bag's
        bag_sq = (torch.empty(n_tables * bags, dtype=torch.float32) if kind.row_wise and decay is not WeightDecayMode.L2
                  and (half is None or psw is None) else None)
        threads = torch.get_num_threads()
        if half is None and (threads == 1 or n < 2 * _MIN_PER_THREAD):  # each table grouped right before its walk
            rc = self.lib.tdb_update_tables(
                kind.native, decay.value, *tables_args, rows_t.data_ptr(), *states, *grads, ids.data_ptr(), n,
                offsets.data_ptr(), bags, *(w.data_ptr() for w in work), _ptr(bag_sq), values.data_ptr())
            self._raise(rc, rows, n)
            return
        # every table grouped first (nothing written unless every id is valid), then the walks, cut over all
        # tables' occurrences on row boundaries over the threads
        rc = self.lib.tdb_group_tables(n_tables, rows_t.data_ptr(), ids.data_ptr(), n, offsets.data_ptr(), bags,
                                       *(w.data_ptr() for w in work))
        self._raise(rc, rows, n)
        if bag_sq is not None:
            square_sums = self.lib.tdb_bag_square_sums_tables if half is None else self.lib.tdb_bag_square_sums16
            square_sums(grad.data_ptr(), grad.stride(0), n_tables, goff.data_ptr(), dims_t.data_ptr(), bags,
                        bag_sq.data_ptr())
        walk = (keys.data_ptr(), occ.data_ptr(), bag_of.data_ptr(), _ptr(bag_sq), offsets.data_ptr(), bags)
        head: tuple[object, ...]
        if half is None:
            fn, head = self.lib.tdb_apply_tables, (kind.native, decay.value, *tables_args, *states, *grads, *walk)
        else:  # fp16 / bf16 (cpu_kernels16.c): rounded stochastically with a seed from torch's default generator
            stochastic = bool(hyper.stochastic_rounding)
            seed = int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64).item()) if stochastic else 0
            fn, head = self.lib.tdb_apply_tables16, (kind.native, decay.value, weights.data_ptr(), half,
                                                     int(stochastic), seed, *tables_args[1:], *states, *grads, *walk)
        bounds = offsets[::bags].tolist()
        for rc in _in_parts(fn, head, _row_cuts(keys, threads, bounds), (values.data_ptr(),)):
            self._raise(rc, rows, n)

    @staticmethod
    def _raise(rc: int, rows: Sequence[int], n: int) -> None:
        """The exception for a return code of the update's C functions (none for 0)."""
        if rc == 0:
            return
        if rc == -1:
            raise ValueError(f"sparse update: offsets must be non-decreasing within [0, {n}], got boundaries out "
                             "of order")
        if rc == _BAD_ARGUMENTS:
            raise RuntimeError("sparse update kernel: bad arguments (kind, decay or width)")
        raise ValueError(f"sparse update: ids of table {-2 - rc} outside [0, {rows[-2 - rc]})")


def _hyper_values(hyper: Hyper, step: int, dtype: torch.dtype) -> torch.Tensor:
    """The update's hyper-parameters as the C code reads them (``TDB_LR`` ... ``TDB_ADAM_BC2``): Adam's bias
    corrections for ``step``; fp32 for ``cpu_kernels.c``, fp64 for ``cpu_kernels16.c``."""
    lr, b1, b2 = hyper.lr, hyper.beta1, hyper.beta2
    counts = hyper.kind.counts_steps  # bias corrections of this step
    return torch.tensor([lr, hyper.eps, hyper.weight_decay, b1, b2, lr / (1 - b1**step) if counts else 0.0,
                         1 - b2**step if counts else 1.0], dtype=dtype)


def _contiguous(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The batch as the C code reads it: contiguous ids and offsets (a strided view is copied), fp32 weights."""
    psw = batch.per_sample_weights
    return (batch.ids.contiguous(), batch.offsets.contiguous(),
            None if psw is None else psw.to(torch.float32).contiguous())


def _starts(sizes: Sequence[int]) -> list[int]:
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
