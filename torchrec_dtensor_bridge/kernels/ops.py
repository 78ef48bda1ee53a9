"""The kernel layer's torch ops (``torch.ops.tdb``), each with a fake implementation.

* ``tdb::pool_sum(weights, weights_offsets, dims, rows, ids, offsets, per_sample_weights, ids_checked=False)
  -> Tensor``: the pooled SUM of every table of one storage, ``(B, sum(dims))``.
* ``tdb::pool_sum_backward(grad, dims, rows, ids, offsets, per_sample_weights, ids_checked=False) -> Tensor``:
  the dense weight gradients of that lookup, flat, back to back.
* ``tdb::sparse_update(weights!, weights_offsets, dims, rows, grad, ids, offsets, per_sample_weights, kind,
  momentum1!, momentum1_offsets, momentum2!, momentum2_offsets, lr, eps, weight_decay, decay, beta1, beta2,
  step, ids_checked=False, stochastic_rounding=True) -> ()``: a fused optimizer's update of the touched rows of
  every table of one storage (and their state), in place; ``kind`` a registered kind's name (:mod:`...optim_kinds`),
  ``decay`` a ``WeightDecayMode`` value; fp16 / bf16 rows are written back from the fp32 update rounded
  stochastically, or to nearest with ``stochastic_rounding=False``.

The weights may be fp32, fp16 or bf16 (the kernels read rows as fp32 and pool into fp32); optimizer state is
fp32.

``ids_checked=True`` says that the caller has checked the ids and offsets (:attr:`.args.Batch.ids_checked`):
the op then skips its own id check, which on CUDA synchronises the device. :mod:`.calls` passes it (the
lookups check their batches at their API edge); a direct caller leaves it ``False``.

A custom op's schema takes flat tensors and scalars. Below it, Python passes the records of :mod:`.args`
(tables, batch, state) and the hyper-parameters (:class:`...optim_kinds.Hyper`). Steps of a call:

1. The flat arguments are grouped into those records (:func:`_pool_args`, :func:`_grad_args`,
   :func:`_update_args`).
2. They are checked, once, here, before any kernel runs: a ``ValueError`` names the argument and its values
   (never an ``assert``; the implementations trust what passes). The ids are checked in one pass, unless the
   caller checked them (``ids_checked``): on CPU in this package's C code when its extension is built
   (:meth:`.native.NativeKernel.ids_valid`; when the C kernels run, in their own pass), on CUDA on the device
   (one synchronisation).
3. The implementation is :mod:`.choose`'s rule (remembered once the ranks of a lookup settled it), then
   what the call allows: fbgemm's CUDA kernels take rows aligned for their vector loads
   (:data:`.limits.VECTOR_BYTES`), of at most 2048 columns, and batches whose ids and bag boundaries an int32 counts (:func:`.limits.misfit`), ours tables of at most
   :data:`.native.MAX_DIM` columns (:func:`.native.fits`); pooling and the dense gradient fall back to
   torch's ops (:mod:`.reference`) otherwise, an update refuses before anything runs (the lookups send such
   shards to the torch-op math: :func:`.calls.update_supported`).
4. It runs: :func:`run_pool_sum`, :func:`run_dense_grad`, :func:`run_sparse_update`.

Each op has one implementation for the CPU and CUDA dispatch keys (the devices' differences are the
branches above) and one fake, registered with ``torch.library.Library`` (``torch.library.custom_op`` adds
Python layers that cost more per call than a small lookup's kernel, BENCHMARKS.md). The fakes give the
output shapes, so FakeTensor and ``torch.compile`` trace the ops, and the profiler names them. An update
bumps the version counters of the tensors it wrote, as in-place ops do.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..optim_kinds import REGISTERED, Hyper, StateKind, WeightDecayMode, names
from . import choose, copies, fbgemm, limits, native, reference
from .args import Batch, State, Tables
from .choose import Impl

__all__ = ["check_ids_on_device", "run_dense_grad", "run_pool_sum", "run_sparse_update"]

Tensor = torch.Tensor


_DECAY_VALUES = frozenset(m.value for m in WeightDecayMode)


def _fail(op: str, name: str, got: object, want: str) -> ValueError:
    return ValueError(f"tdb::{op}: {name} must be {want}, got {got}")


# --- step 1: the flat arguments grouped ------------------------------------------------------------------------

def _pool_args(weights: Tensor, weights_offsets: list[int], dims: list[int], rows: list[int], ids: Tensor,
               offsets: Tensor, per_sample_weights: Tensor | None, ids_checked: bool = False,
               ) -> tuple[Tables, Batch]:
    return Tables(weights, weights_offsets, dims, rows), Batch(ids, offsets, per_sample_weights, ids_checked)


def _grad_args(grad: Tensor, dims: list[int], rows: list[int], ids: Tensor, offsets: Tensor,
               per_sample_weights: Tensor | None, ids_checked: bool = False,
               ) -> tuple[Tensor, list[int], list[int], Batch]:
    return grad, dims, rows, Batch(ids, offsets, per_sample_weights, ids_checked)


def _update_args(weights: Tensor, weights_offsets: list[int], dims: list[int], rows: list[int], grad: Tensor,
                 ids: Tensor, offsets: Tensor, per_sample_weights: Tensor | None, kind: str, momentum1: Tensor | None,
                 momentum1_offsets: list[int], momentum2: Tensor | None, momentum2_offsets: list[int], lr: float,
                 eps: float, weight_decay: float, decay: int, beta1: float, beta2: float, step: int,
                 ids_checked: bool = False, stochastic_rounding: bool = True,
                 ) -> tuple[Tables, Batch, Tensor, State, Hyper]:
    found = REGISTERED.get(kind)
    if found is None:
        raise _fail("sparse_update", "kind", repr(kind), f"one of {names()}")
    if decay not in _DECAY_VALUES:
        raise _fail("sparse_update", "decay", decay, f"one of {sorted(_DECAY_VALUES)}")
    return (Tables(weights, weights_offsets, dims, rows), Batch(ids, offsets, per_sample_weights, ids_checked), grad,
            State(momentum1, momentum1_offsets, momentum2, momentum2_offsets, step),
            Hyper(found, lr, eps, weight_decay, WeightDecayMode(decay), beta1, beta2, stochastic_rounding))


# --- step 2: the checks -----------------------------------------------------------------------------------------

def _check_tables(op: str, tables: Tables) -> None:
    weights, at, dims, rows = tables.storage, tables.offsets, tables.dims, tables.rows
    if len(dims) == 0 or len(rows) != len(dims) or len(at) != len(dims):
        raise _fail(op, "weights_offsets, dims, rows", (at, dims, rows), "one entry per table (>= 1)")
    if weights.dim() != 1 or weights.dtype not in native.DTYPES or weights.stride(0) != 1:
        raise _fail(op, "weights", f"{weights.dtype} of shape {tuple(weights.shape)} strides {weights.stride()}",
                    "a flat contiguous float32, float16 or bfloat16 tensor")
    for t, (o, d, r) in enumerate(zip(at, dims, rows)):
        if d < 0 or r < 0 or o < 0 or o + d * r > weights.numel():
            raise _fail(op, f"table {t}", f"offset {o}, {r} rows x {d} columns",
                        f"inside weights of {weights.numel()} elements")


def _check_batch(op: str, tables: int, batch: Batch, device: torch.device) -> int:
    """The batch size ``B`` of every table."""
    ids, offsets, psw = batch.ids, batch.offsets, batch.per_sample_weights
    for name, t in (("ids", ids), ("offsets", offsets)):
        if t.dim() != 1 or t.dtype != torch.int64 or t.device != device:
            raise _fail(op, name, f"{t.dtype} of shape {tuple(t.shape)} on {t.device}", f"1-D int64 on {device}")
    if (offsets.numel() - 1) % tables or offsets.numel() < 1:
        raise _fail(op, "offsets", f"{offsets.numel()} boundaries", f"T * B + 1 boundaries for T = {tables}")
    if psw is not None and (psw.shape != ids.shape or psw.dtype != torch.float32 or psw.device != device):
        raise _fail(op, "per_sample_weights", f"{psw.dtype} of shape {tuple(psw.shape)}",
                    f"float32 of shape {tuple(ids.shape)} (one per id)")
    return (offsets.numel() - 1) // tables


def _check_ids(op: str, ids: Tensor, offsets: Tensor, rows: Sequence[int], b: int) -> None:
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


def check_ids_on_device(op: str, ids: Tensor, offsets: Tensor, rows: Sequence[int], b: int) -> None:
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


def _check_grad(op: str, grad: Tensor, dims: Sequence[int], rows: Sequence[int], batch: Batch) -> int:
    if len(dims) == 0 or len(rows) != len(dims) or min(dims) < 0 or min(rows) < 0:
        raise _fail(op, "dims, rows", (dims, rows), "one non-negative entry per table (>= 1)")
    b = _check_batch(op, len(dims), batch, grad.device)
    width = sum(dims)
    if grad.dtype != torch.float32 or tuple(grad.shape) != (b, width) or (
            width > 0 and grad.stride(1) != 1) or (b > 1 and grad.stride(0) < width):
        raise _fail(op, "grad", f"{grad.dtype} of shape {tuple(grad.shape)} strides {grad.stride()}",
                    f"float32 ({b}, {width}) with unit column stride")
    return b


def _check_update(tables: Tables, batch: Batch, grad: Tensor, state: State, hyper: Hyper) -> int:
    op, weights, dims, rows, kind = "sparse_update", tables.storage, tables.dims, tables.rows, hyper.kind
    _check_tables(op, tables)
    b = _check_grad(op, grad, dims, rows, batch)
    if grad.device != weights.device:
        raise _fail(op, "grad", f"on {grad.device}", f"on the weights' device {weights.device}")
    if hyper.weight_decay_mode is not WeightDecayMode.NONE and hyper.weight_decay_mode not in kind.decay_modes:
        raise _fail(op, "decay", hyper.weight_decay_mode.value,
                    f"none or one of {[m.value for m in kind.decay_modes]} for {kind.name!r}")
    both = copies.overlap(tables, state) if len(dims) > 1 else None  # one table overlaps nothing
    if both is not None:
        a, c = both
        raise _fail(op, f"tables {a} and {c}", f"at element offsets {tables.offsets[a]} and {tables.offsets[c]} "
                    f"({tables.rows[a]} x {tables.dims[a]}, {tables.rows[c]} x {tables.dims[c]})",
                    "disjoint, or one table listed twice (the same offsets, rows and columns, state included)")
    specs = kind.tensor_states
    given = (state.momentum1 is not None, state.momentum2 is not None)
    wants = (len(specs) > 0, len(specs) > 1)
    if given != wants:
        raise _fail(op, "momentum1, momentum2", f"given: {given}", f"given: {wants} for {kind.name!r}")
    for spec, name, m, at in zip(specs, ("momentum1", "momentum2"), (state.momentum1, state.momentum2),
                                 (state.momentum1_offsets, state.momentum2_offsets)):
        assert m is not None, "checked above"
        if m.dim() != 1 or m.dtype != torch.float32 or m.stride(0) != 1 or m.device != weights.device:
            raise _fail(op, name, f"{m.dtype} of shape {tuple(m.shape)} on {m.device}",
                        f"a flat contiguous float32 tensor on {weights.device}")
        if len(at) != len(dims):
            raise _fail(op, f"{name}_offsets", at, "one offset per table")
        for t, (o, d, r) in enumerate(zip(at, dims, rows)):
            size = r if spec.shape is StateKind.ROW else r * d  # a per-row state: one value per row
            if o < 0 or o + size > m.numel():
                raise _fail(op, f"{name} of table {t}", f"offset {o}, {size} values",
                            f"inside {name} of {m.numel()} elements ({r} rows of table {t})")
    return b


# --- steps 3 and 4: the implementations --------------------------------------------------------------------------

def _pool_sum(tables: Tables, batch: Batch) -> Tensor:
    """The pooled SUM of every table of one storage (see the module docstring)."""
    _check_tables("pool_sum", tables)
    device = tables.storage.device
    b = _check_batch("pool_sum", len(tables.dims), batch, device)
    on_cpu, width = device.type == "cpu", sum(tables.dims)
    which = choose.pool_impl(device, tables.storage.dtype, _nbytes(tables))
    if (which is Impl.NATIVE and not native.fits(tables, batch)) or (
            which is Impl.FBGEMM and not on_cpu and _cuda_misfit(tables, batch, b) is not None):
        which = Impl.TORCH
    if not batch.ids_checked and not (which is Impl.NATIVE and width):  # ours checks the ids in its own pass
        (_check_ids if on_cpu else check_ids_on_device)("pool_sum", batch.ids, batch.offsets, tables.rows, b)
    if width == 0 or (not on_cpu and (b == 0 or batch.ids.numel() == 0)):  # nothing to add up
        return tables.storage.new_zeros(b, width)
    return run_pool_sum(which, tables, batch)


def _nbytes(tables: Tables) -> int:
    """The bytes of the tables of a call, the size :mod:`.choose`'s rule reads."""
    return sum(r * d for r, d in zip(tables.rows, tables.dims)) * tables.storage.element_size()


def _cuda_misfit(tables: Tables, batch: Batch, b: int) -> str | None:
    """The limit of fbgemm's CUDA kernels a call over ``tables`` and ``batch`` (``b`` bags per table) breaks."""
    return limits.misfit(tables.storage, tables.offsets, tables.dims, bags=b, ids=batch.ids.numel())


def run_pool_sum(which: Impl, tables: Tables, batch: Batch) -> Tensor:
    """``(B, sum(dims))``: every table's bag sums side by side, by ``which``."""
    kernel = native.kernel() if which is Impl.NATIVE else None
    if kernel is not None:  # one call for every table
        with torch.profiler.record_function("tdb::native_pool_sum"):
            return kernel.pool_tables(tables, batch)
    if which is Impl.FBGEMM:
        return fbgemm.pool_sum(tables, batch)
    return reference.pool_sum(tables, batch)


def _fake_pool_sum(tables: Tables, batch: Batch) -> Tensor:
    _check_tables("pool_sum", tables)
    b = _check_batch("pool_sum", len(tables.dims), batch, tables.storage.device)
    return tables.storage.new_empty(b, sum(tables.dims))


def _dense_grad(grad: Tensor, dims: list[int], rows: list[int], batch: Batch) -> Tensor:
    """The dense weight gradients of :func:`_pool_sum`, flat, table ``t``'s ``rows[t] x dims[t]`` after table
    ``t - 1``'s."""
    b = _check_grad("pool_sum_backward", grad, dims, rows, batch)
    on_cpu = grad.device.type == "cpu"
    if not batch.ids_checked:
        (_check_ids if on_cpu else check_ids_on_device)("pool_sum_backward", batch.ids, batch.offsets, rows, b)
    if sum(dims) == 0 or (not on_cpu and (b == 0 or batch.ids.numel() == 0)):  # nothing to add up
        return grad.new_zeros(sum(r * d for r, d in zip(rows, dims)))
    which = choose.dense_impl(grad.device)
    if which is Impl.FBGEMM and not on_cpu and limits.misfit(
            None, _packed(rows, dims), dims, bags=b, ids=batch.ids.numel()) is not None:
        which = Impl.TORCH  # fbgemm's kernels read and write a packed scratch buffer of these tables
    return run_dense_grad(which, grad, dims, rows, batch)


def _packed(rows: Sequence[int], dims: Sequence[int]) -> list[int]:
    """Each table's first element when the tables lie back to back (the dense gradient's layout)."""
    return list(itertools.accumulate((r * d for r, d in zip(rows, dims)), initial=0))[:-1]


def run_dense_grad(which: Impl, grad: Tensor, dims: Sequence[int], rows: Sequence[int], batch: Batch) -> Tensor:
    """Every table's dense weight gradient, flat and back to back, by ``which``."""
    if which is Impl.FBGEMM:
        return fbgemm.dense_grad(grad, dims, rows, batch)
    return reference.dense_grad(grad, dims, rows, batch)


def _fake_dense_grad(grad: Tensor, dims: list[int], rows: list[int], batch: Batch) -> Tensor:
    _check_grad("pool_sum_backward", grad, dims, rows, batch)
    return grad.new_empty(sum(r * d for r, d in zip(rows, dims)))


def _sparse_update(tables: Tables, batch: Batch, grad: Tensor, state: State, hyper: Hyper) -> None:
    """A fused optimizer's update of every table of one storage, in place (see the module docstring)."""
    b = _check_update(tables, batch, grad, state, hyper)
    device = tables.storage.device
    which = choose.update_impl(device, hyper.kind, hyper.weight_decay, tables.storage.dtype,
                               stochastic=hyper.stochastic_rounding, nbytes=_nbytes(tables))
    if which is Impl.TORCH:
        raise ValueError(f"tdb::sparse_update: no one-pass kernel for kind {hyper.kind.name!r} with "
                         f"weight_decay={hyper.weight_decay} on {device} for {tables.storage.dtype} tables "
                         f"(stochastic_rounding={hyper.stochastic_rounding}; kernels.choose.update_impl)")
    if device.type == "cpu":
        if which is Impl.NATIVE and not native.fits(tables, batch):  # fbgemm's, where the rule has it below a size
            which = choose.update_impl(device, hyper.kind, hyper.weight_decay, tables.storage.dtype,
                                       stochastic=hyper.stochastic_rounding, nbytes=0)
        if which is Impl.NATIVE and not native.fits(tables, batch):
            raise _fail("sparse_update", "dims, rows, ids", (list(tables.dims), list(tables.rows), batch.ids.numel()),
                        f"at most {native.MAX_DIM} columns, fewer than 2**31 rows and ids (the C kernels)")
        if which is not Impl.NATIVE and not batch.ids_checked:  # ours checks the ids in its grouping pass
            _check_ids("sparse_update", batch.ids, batch.offsets, tables.rows, b)
    else:
        problem = _cuda_misfit(tables, batch, b)
        at = (state.momentum1_offsets, state.momentum2_offsets)
        for m, o in zip((state.momentum1, state.momentum2), at):
            if problem is None and m is not None and hyper.kind.per_element:  # element-wise state: read like rows
                found = limits.misfit(m, o, tables.dims)
                problem = None if found is None else f"state {found}"
        if problem is not None:
            raise ValueError(f"tdb::sparse_update: beyond fbgemm's CUDA kernels: {problem}; tables of dims "
                             f"{list(tables.dims)} at element offsets {list(tables.offsets)} (state {list(at[0])}, "
                             f"{list(at[1])}); kernels.update_supported keeps such shards from the op")
        if not batch.ids_checked:
            check_ids_on_device("sparse_update", batch.ids, batch.offsets, tables.rows, b)
        if b == 0 or batch.ids.numel() == 0:
            _bump_versions(tables.storage, state.momentum1, state.momentum2)
            return
    run_sparse_update(which, tables, batch, grad, state, hyper)
    _bump_versions(tables.storage, state.momentum1, state.momentum2)


def run_sparse_update(which: Impl, tables: Tables, batch: Batch, grad: Tensor, state: State, hyper: Hyper) -> None:
    """Every table's touched rows (and their state) updated in place by ``which`` (:attr:`Impl.NATIVE` or
    :attr:`Impl.FBGEMM`); a table listed twice is updated once with both listings' gradients (:mod:`.copies`:
    folded on CPU, one ``hash_size_cumsum`` offset on CUDA)."""
    if tables.storage.device.type == "cpu" and len(tables.dims) > 1:  # one table is no copy
        tables, batch, grad, state = copies.fold_copies(tables, batch, grad, state)
    kernel = native.kernel() if which is Impl.NATIVE else None
    if kernel is not None:  # one call for every table
        with torch.profiler.record_function(f"tdb::native_update_{hyper.kind.name}"):
            kernel.update_tables(tables, batch, grad, state, hyper)
    elif which is Impl.FBGEMM:
        fbgemm.update(tables, batch, grad, state, hyper)
    else:
        raise RuntimeError(f"sparse update: no one-pass kernel for {which.name.lower()} (choose.update_impl decides)")


def _fake_sparse_update(tables: Tables, batch: Batch, grad: Tensor, state: State, hyper: Hyper) -> None:
    _check_update(tables, batch, grad, state, hyper)


def _bump_versions(*mutated: Tensor | None) -> None:
    """What an in-place op owes autograd: the version counters of the tensors it wrote move on, so that a
    graph that saved one of them refuses its backward instead of using changed values."""
    for t in mutated:
        if t is not None:
            torch.autograd.graph.increment_version(t)


# --- the registrations --------------------------------------------------------------------------------------------

_LIB = torch.library.Library("tdb", "DEF")  # held here: the ops live as long as this module
_LIB.define("pool_sum(Tensor weights, int[] weights_offsets, int[] dims, int[] rows, Tensor ids, Tensor offsets, "
            "Tensor? per_sample_weights, bool ids_checked=False) -> Tensor")
_LIB.define("pool_sum_backward(Tensor grad, int[] dims, int[] rows, Tensor ids, Tensor offsets, "
            "Tensor? per_sample_weights, bool ids_checked=False) -> Tensor")
_LIB.define("sparse_update(Tensor(a!) weights, int[] weights_offsets, int[] dims, int[] rows, Tensor grad, "
            "Tensor ids, Tensor offsets, Tensor? per_sample_weights, str kind, Tensor(b!)? momentum1, "
            "int[] momentum1_offsets, Tensor(c!)? momentum2, int[] momentum2_offsets, float lr, float eps, "
            "float weight_decay, int decay, float beta1, float beta2, int step, bool ids_checked=False, "
            "bool stochastic_rounding=True) -> ()")


def _register(name: str, grouped: Callable[..., tuple[Any, ...]], run: Callable[..., Any],
              fake: Callable[..., Any]) -> None:
    """``tdb::name``: its flat arguments grouped by ``grouped``, then ``run`` for the CPU and CUDA keys and
    ``fake`` for fake tensors."""
    _LIB.impl(name, lambda *flat: run(*grouped(*flat)), "CPU")
    _LIB.impl(name, lambda *flat: run(*grouped(*flat)), "CUDA")
    torch.library.register_fake(f"tdb::{name}", lambda *flat: fake(*grouped(*flat)), lib=_LIB)


_register("pool_sum", _pool_args, _pool_sum, _fake_pool_sum)
_register("pool_sum_backward", _grad_args, _dense_grad, _fake_dense_grad)
_register("sparse_update", _update_args, _sparse_update, _fake_sparse_update)
