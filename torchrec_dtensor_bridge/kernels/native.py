"""This package's own CPU kernels: the ops of its built extension (``torch.ops.tdb_native``, from ``csrc/``),
the pooled sum of a lookup, the fused optimizers' updates and the row digests of incremental checkpoints.

Why kernels of our own: fbgemm_gpu-cpu's backward-with-optimizer kernels sum
each row's gradient element by element (SGD) or run a gradient-summing pass
with one "bag" per touched row (row-wise Adagrad), have no CPU Adam and ignore
weight decay. ``csrc/cpu_kernels.c`` sorts the occurrences by row (a radix
sort), then walks the touched rows in increasing order, prefetching the rows
ahead, reading a row's bag gradient in place when it occurs once (most rows)
and summing it first otherwise. Its pooled sum adds in fbgemm's order (the same
bits). The math is fbgemm's (``EXACT_SGD`` / ``EXACT_ROWWISE_ADAGRAD`` /
``EXACT_ADAGRAD`` / ``ADAM``; weight decay as :mod:`..optim.update`), tested
against fbgemm's own kernels and the unsharded reference optimizer; which of
the two runs is :mod:`.choose`'s fixed rule (docs/kernels.md). The kinds it
updates are those whose record (:mod:`...optim_kinds`) has a ``native`` code:
the code the C kernels know the kind by.

The extension (``torchrec_dtensor_bridge._C``) is built with the package (``setup.py``: ``pip install
--no-build-isolation .``, or ``make setup`` in a checkout) and loaded when this module is imported: nothing
is compiled, and nothing written, when a process runs. Its ops are a namespace of their own, under the
public ``torch.ops.tdb`` ops of :mod:`.ops` rather than registered as them: the public ops exist in every
install (a pure-Python one too), check their arguments once and choose between three implementations, of
which these kernels are one; ``tdb_native`` ops are the kernels alone and trust what they are given.

Steps of a call (every table of one storage at once, in the form of :mod:`.args`):

1. :func:`kernel` is the loaded extension, or ``None``: not built (a pure-Python install; :func:`missing`
   says why, and one warning names how to build it, the first time it is asked for), built from other
   sources than these (:data:`VERSION`), or disabled by ``TDB_NATIVE_KERNELS=0``.
2. :meth:`NativeKernel.pool_tables` / :meth:`NativeKernel.update_tables` trust their arguments: the ops
   (:mod:`.ops`) checked them, and :func:`fits` says whether the tables are within the C code's limits.
   The C code checks the ids itself, in the pass that groups them (an update) or sums them (pooling),
   before any row is written.
3. The extension splits the work over torch's intra-op threads: on bag (pooling) or row (update, digests)
   boundaries, so that every result is the same bits whatever the thread count.

:meth:`NativeKernel.ids_valid` is the one-pass id check the ops run before fbgemm's kernels, which read
where the ids point.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence

import torch

from ..optim_kinds import Hyper, WeightDecayMode
from .args import Batch, State, Tables

try:
    from .._C import __file__ as _C_FILE  # the import registers torch.ops.tdb_native
except ImportError as e:  # not built, or built for another torch (an undefined symbol)
    _LOAD_ERROR: str | None = f"{type(e).__name__}: {e}"
    _FILE: str | None = None
else:
    _LOAD_ERROR, _FILE = None, _C_FILE

__all__ = ["BUILD_HINT", "DTYPES", "MAX_DIM", "MIN_PER_THREAD", "VERSION", "NativeKernel", "extension_file", "fits",
           "kernel", "missing", "row_cuts"]

log = logging.getLogger(__name__)

VERSION = 2
"""The extension's ``tdb_native::version()`` these modules are written for (``csrc/ops.cpp``'s ``kVersion``)."""
MAX_DIM = 8192
"""The widest table the C code takes (``TDB_MAX_DIM``)."""
MIN_PER_THREAD = 16384
"""Ids (pooling) or occurrences (an update) below which the extension keeps the work on one thread
(``csrc/ops.cpp``'s ``kMinPerThread``)."""
BUILD_HINT = ("build it with `pip install --no-build-isolation .` (`-e .` for a checkout; `make setup` there), "
              "which needs a C and C++ compiler once, at install time")
"""How to build the extension, as the warning and ``python -m torchrec_dtensor_bridge kernels`` say it."""
_MAX_ROWS = 2**31  # rows and ids are grouped as 32-bit keys
_HALF = (torch.float16, torch.bfloat16)
DTYPES = frozenset({torch.float32, *_HALF})
"""The weights' dtypes the C code takes (fp32: ``cpu_kernels.c``; fp16, bf16: ``cpu_kernels16.c``)."""


def fits(tables: Tables, batch: Batch) -> bool:
    """Whether the C code can take ``tables`` and ``batch`` (checked by :mod:`.ops` otherwise): at most
    :data:`MAX_DIM` columns and fewer than ``2**31`` rows per table, fewer than ``2**31`` ids."""
    return max(tables.dims) <= MAX_DIM and max(tables.rows) < _MAX_ROWS and batch.ids.numel() < _MAX_ROWS


class NativeKernel:
    """The loaded extension: :meth:`pool_tables` (a lookup's forward) and :meth:`update_tables` (an optimizer
    step) over every table of one flat storage in one op call each, :meth:`row_digests` over a block's rows."""

    def __init__(self, version: int) -> None:
        self.version = version
        self._ops = torch.ops.tdb_native

    def ids_valid(self, ids: torch.Tensor, offsets: torch.Tensor, rows: Sequence[int]) -> bool:
        """Whether every table's ids lie inside its ``rows`` and the ``T * B + 1`` ``offsets`` (absolute
        positions in ``ids``, table-major) run forward inside ``ids``: one pass, no row read. ``ids``,
        ``offsets``: contiguous 1-D int64 CPU tensors (checked by the caller)."""
        return bool(self._ops.ids_valid(ids, offsets, rows))

    def pool_tables(self, tables: Tables, batch: Batch) -> torch.Tensor:
        """``(B, sum(dims))``: every table's bag sums side by side, each added in id order (as fbgemm's forward
        and ``torch.embedding_bag`` add them), in one call. The ids are checked as they are read (before any
        row is): ``ValueError`` naming the table."""
        return self._ops.pool_sum(tables.storage, tables.offsets, tables.dims, tables.rows, batch.ids,
                                  batch.offsets, batch.per_sample_weights)

    def update_tables(self, tables: Tables, batch: Batch, grad: torch.Tensor, state: State, hyper: Hyper) -> None:
        """Update every table's touched rows (and their state) in place, in one call, with ``hyper.kind`` (a kind
        with a ``native`` code); nothing is modified unless every id is valid (``ValueError`` naming the table).

        ``grad``: the bags' output gradient ``(B, sum(dims))`` fp32 with unit column stride, table ``t`` at its
        columns; ``state``: as :class:`.args.State`; weight decay as :mod:`..optim.update`; the step counts
        from 1, this one included. fp16 and bf16 weights (``cpu_kernels16.c``): fp32 math and state, each row
        written back rounded once, stochastically (``hyper.stochastic_rounding``; the seed drawn from torch's
        default generator, so that ``torch.manual_seed`` repeats a run) or to nearest even.
        """
        kind = hyper.kind
        assert kind.native is not None, f"{kind.name}: no native kernel"
        bags = (batch.offsets.numel() - 1) // len(tables.dims)
        if batch.ids.numel() == 0 or bags == 0:
            return
        decay = hyper.weight_decay_mode if hyper.weight_decay else WeightDecayMode.NONE
        stochastic = bool(hyper.stochastic_rounding) and tables.storage.dtype in _HALF
        seed = int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64).item()) if stochastic else 0
        m1, m2 = state.momentum1, state.momentum2
        self._ops.sparse_update(
            tables.storage, tables.offsets, tables.dims, tables.rows, grad, batch.ids, batch.offsets,
            batch.per_sample_weights, kind.native, decay.value, m1, state.momentum1_offsets if m1 is not None else [],
            m2, state.momentum2_offsets if m2 is not None else [], _hyper_values(hyper, state.step), kind.row_wise,
            stochastic, seed)

    def row_digests(self, rows: torch.Tensor) -> torch.Tensor:
        """``int64 [rows]``: the digest of each row of ``rows``, a ``(rows, bytes)`` uint8 CPU tensor with unit
        column stride (:mod:`...checkpoint.incremental.digests` defines the digest)."""
        return self._ops.row_digests(rows)

    @functools.cached_property
    def crc32c_hardware(self) -> bool:
        """Whether :meth:`crc32c` runs on the CPU's CRC-32C instruction (x86-64 SSE4.2, aarch64 +crc); without
        it the extension's CRC-32C takes a bit at a time, slower than ``zlib.crc32``."""
        return bool(self._ops.crc32c_hardware())

    def crc32c(self, data: torch.Tensor, prev: int = 0) -> int:
        """The CRC-32C (Castagnoli) of ``prev``'s bytes followed by ``data`` (a contiguous 1-D uint8 CPU tensor),
        where ``prev`` is the CRC-32C of the bytes before (0 for none), as ``zlib.crc32`` chains. Runs without
        the GIL."""
        return int(self._ops.crc32c(data, prev))


def _hyper_values(hyper: Hyper, step: int) -> list[float]:
    """The update's hyper-parameters as the C code reads them (``TDB_LR`` ... ``TDB_ADAM_BC2``): Adam's bias
    corrections for ``step`` (fp32 for fp32 tables, fp64 for half-precision ones: the extension converts)."""
    lr, b1, b2 = hyper.lr, hyper.beta1, hyper.beta2
    counts = hyper.kind.counts_steps  # bias corrections of this step
    return [lr, hyper.eps, hyper.weight_decay, b1, b2, lr / (1 - b1**step) if counts else 0.0,
            1 - b2**step if counts else 1.0]


def row_cuts(keys: torch.Tensor, threads: int, bounds: Sequence[int] | None = None) -> list[int]:
    """Where the extension cuts an update's grouped occurrences over ``threads`` threads, never inside a row:
    ``bounds`` are the tables' first positions and the last one's end (each table's ``keys``, int32, sorted;
    by default one table over all of ``keys``). At most one range per :data:`MIN_PER_THREAD` occurrences."""
    return list(torch.ops.tdb_native.row_cuts(keys, threads, [0, keys.numel()] if bounds is None else bounds))


def missing() -> str | None:
    """Why this process runs without the extension (``None`` when it has it): not built or not loadable (the
    import's error), built from other sources, or disabled (``TDB_NATIVE_KERNELS=0``)."""
    if os.environ.get("TDB_NATIVE_KERNELS", "1") == "0":
        return "disabled (TDB_NATIVE_KERNELS=0)"
    if _LOAD_ERROR is not None:
        return f"not built ({_LOAD_ERROR})"
    found = _built_version()
    if found != VERSION:
        return f"built from other sources (tdb_native version {found}, these modules need {VERSION}): rebuild it"
    return None


def extension_file() -> str | None:
    """The loaded extension's file (``torchrec_dtensor_bridge/_C*.so``); ``None`` when it did not load."""
    return _FILE


@functools.lru_cache(maxsize=1)
def _built_version() -> int:
    return int(torch.ops.tdb_native.version())


@functools.lru_cache(maxsize=1)
def kernel() -> NativeKernel | None:
    """The extension's kernels; ``None`` when this process runs without them (:func:`missing`). The first time
    they are asked for and not there (unless disabled), one warning says so and how to build them: lookups then
    run fbgemm's kernels (torch's without fbgemm_gpu) and checkpoint digests torch ops."""
    why = missing()
    if why is None:
        return NativeKernel(_built_version())
    if not why.startswith("disabled"):
        log.warning("torchrec_dtensor_bridge: the C++ extension torchrec_dtensor_bridge._C is %s; lookups use "
                    "fbgemm's kernels (torch's without fbgemm_gpu) and checkpoint digests torch ops. To run this "
                    "package's CPU kernels, %s.", why, BUILD_HINT)
    return None
