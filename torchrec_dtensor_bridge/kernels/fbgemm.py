"""fbgemm_gpu's table-batched embedding (TBE) kernels: the package's only ``fbgemm_gpu`` import.

Why these entry points: ``SplitTableBatchedEmbeddingBagsCodegen`` (the training TBE)
owns its weights in one flat buffer of its own; a DTensor's shards live in storage
it does not own. The kernels under it take that buffer as an argument, with each
table at an element offset into it (``weights_offsets``), so they run on the
caller's storage directly: one call for every table of one storage (gaps between
tables are fine), zero-copy, as TorchRec runs one call per fbgemm buffer.

On CPU (``fbgemm-gpu-cpu``), the kernels themselves:

* forward: ``split_embedding_codegen_forward_cpu`` (SUM pooling);
* dense weight gradient: ``split_embedding_backward_codegen_dense_cpu``. It does not
  read the weights, so it is given a packed scratch layout and returns every table's
  gradient back to back (no gradient as large as the storage);
* fused update: ``split_embedding_backward_codegen_{name}_cpu`` (the kinds whose record
  says ``fbgemm_cpu``, :mod:`...optim_kinds`) update the rows (and momentum) in place.
  fbgemm_gpu-cpu 1.8 builds no CPU Adam, and ignores weight decay in these kernels.

On CUDA (``fbgemm-gpu``), fbgemm's own lookup functions, as its training module calls them
(not measured on a GPU yet):

* forward: ``split_embedding_codegen_lookup_sgd_function_pt2`` under ``no_grad``;
* dense weight gradient: ``dense_embedding_codegen_lookup_function`` over a packed scratch
  layout, then its backward;
* fused update: ``split_embedding_codegen_lookup_{name}_function_pt2`` (the kinds whose record
  says ``fbgemm_cuda``; each one's extra arguments in :data:`_OPTIMIZER_ARGS`), then its backward
  from the output gradient: fbgemm's backward updates the rows (and momentum) in place
  (:func:`run_backward`).

Steps of a call (:func:`pool_sum`, :func:`dense_grad`, :func:`update`: the records of :mod:`.args`):

1. :func:`table_args` builds the per-table tensors shared by every call, once per tables and
   device (cached), on the tables' device: the same code for every device, the device decides
   only the placements (``HOST`` on CPU, ``DEVICE`` elsewhere).
2. :func:`weights_list` / :func:`state_list` give a storage in the form fbgemm's lookup
   functions read: 3 tensors on CPU, 5 (weights) or 4 (state) on CUDA.
3. :func:`lookup_args` and :func:`optimizer_args` give the lookup functions' keyword arguments
   (fbgemm's ``split_embedding_codegen_lookup_invokers`` order); every tensor on the tables'
   device but ``learning_rate_tensor``, a CPU scalar as fbgemm wants it.

Tensors built here are cached per device: build them outside any ``FakeTensorMode`` (under
one, the kernel ops' fakes stand in for the implementations and nothing here runs). The caller
(:mod:`.ops`) has checked shapes, dtypes and devices, and that the call is within the limits of fbgemm's
CUDA kernels (:func:`.limits.misfit`); the ids, bag boundaries and per-sample weights are handed over contiguous
(:func:`flat_batch`: fbgemm's CUDA kernels read them as flat arrays).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from ..optim_kinds import ADAGRAD, ADAM, ROWWISE_ADAGRAD, SGD, Hyper, OptimKind
from .args import Batch, State, Tables

__all__ = [
    "TableArgs", "available", "constant", "cuda_available", "dense_grad", "flat_batch", "lookup_args",
    "lookup_dense_grad", "lookup_forward", "lookup_update", "optimizer_args", "pool_sum", "run_backward", "run_forward", "state_list", "table_args", "update",
    "weights_list",
]

POOL_SUM = 0  # fbgemm_gpu PoolingMode.SUM
OUTPUT_FP32 = 0  # fbgemm_gpu SparseType.FP32.as_int()
HOST = 3  # fbgemm_gpu EmbeddingLocation.HOST
DEVICE = 0  # fbgemm_gpu EmbeddingLocation.DEVICE
@functools.lru_cache(maxsize=1)
def _module() -> ModuleType | None:
    try:
        import fbgemm_gpu  # noqa: F401 - registers torch.ops.fbgemm
    except ImportError:
        return None
    return fbgemm_gpu


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when fbgemm_gpu (CPU or CUDA build) is importable and has its CPU TBE kernels."""
    return _module() is not None and hasattr(torch.ops.fbgemm, "split_embedding_codegen_forward_cpu")


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    """True when fbgemm_gpu's CUDA build is installed: its lookup functions have CUDA kernels under them.

    The CPU build registers the lookup functions for CUDA too, with nothing to run below them; its
    CUDA forward kernel op is what only the CUDA build defines.
    """
    return _module() is not None and hasattr(torch.ops.fbgemm, "split_embedding_codegen_forward_unweighted_cuda")


def flat_batch(batch: Batch) -> Batch:
    """``batch`` with its ids, bag boundaries and per-sample weights contiguous (``batch`` itself when they are):
    fbgemm's CUDA kernels read them through ``data_ptr``, as flat arrays, whatever their strides (its weighted
    backward sorts ``indice_weights.data_ptr()`` by row; its forward for tables wider than 1024 columns reads
    the ids, boundaries and weights so)."""
    psw = batch.per_sample_weights
    if batch.ids.is_contiguous() and batch.offsets.is_contiguous() and (psw is None or psw.is_contiguous()):
        return batch
    return Batch(_contiguous(batch.ids), _contiguous(batch.offsets), None if psw is None else _contiguous(psw),
                 batch.ids_checked)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()``, as a ``clone``: the same copy, and one FakeTensor also traces for a device this build
    of torch has no runtime for."""
    return t if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class TableArgs:
    """The tables of one call, in fbgemm's form (tensors on the tables' device)."""

    weights_offsets: torch.Tensor  # int64 (T,): each table's first element in the flat weights
    d_offsets: torch.Tensor  # int32 (T + 1,): each table's first output column
    total_d: int
    hash_size_cumsum: torch.Tensor  # int64 (T + 1,): rows before each table
    hash_bits: int  # bits of the total row count (fbgemm's ``total_hash_size_bits``)
    max_d: int
    placements: torch.Tensor  # int32 (T,): every table's placement, HOST on CPU, DEVICE elsewhere
    on_host: bool  # the tables are in host memory: fbgemm's CPU kernels and argument forms


def table_args(offsets: tuple[int, ...], dims: tuple[int, ...], rows: tuple[int, ...],
               device: torch.device) -> TableArgs:
    """:class:`TableArgs` of tables at element ``offsets`` with ``dims`` columns and ``rows`` rows (and
    fbgemm_gpu's ops registered)."""
    if _module() is None:
        raise RuntimeError("fbgemm_gpu is not installed (pip install fbgemm-gpu-cpu, or fbgemm-gpu for CUDA)")
    return _table_args(tuple(offsets), tuple(dims), tuple(rows), str(device))


@functools.lru_cache(maxsize=256)
def _table_args(offsets: tuple[int, ...], dims: tuple[int, ...], rows: tuple[int, ...], device: str) -> TableArgs:
    d_offsets = list(itertools.accumulate(dims, initial=0))
    cum = list(itertools.accumulate(rows, initial=0))
    on_host = torch.device(device).type == "cpu"
    return TableArgs(
        torch.tensor(offsets, dtype=torch.int64, device=device),
        torch.tensor(d_offsets, dtype=torch.int32, device=device),
        d_offsets[-1],
        torch.tensor(cum, dtype=torch.int64, device=device),
        max(int(cum[-1]).bit_length(), 1),
        max(dims),
        torch.full((len(dims),), HOST if on_host else DEVICE, dtype=torch.int32, device=device),
        on_host,
    )


@functools.lru_cache(maxsize=256)
def _constant(values: tuple[int, ...], device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def constant(values: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """int64 ``(T,)`` on ``device`` holding ``values``, one tensor per distinct layout constant (each table's
    first element in an optimizer state buffer, each table's row count); callers must not modify it."""
    return _constant(tuple(values), str(device))


@dataclass(frozen=True)
class _Unused:
    """What fbgemm's CUDA argument lists hold for the memory kinds a caller's storage does not use."""

    uvm: torch.Tensor  # fp32 (0,): no unified-memory part
    cache_weights: torch.Tensor  # fp32 (0, 0): no cache
    cache_locations: torch.Tensor  # int32 (0,): no cache


@functools.lru_cache(maxsize=8)
def _unused(device: str) -> _Unused:
    return _Unused(torch.empty(0, dtype=torch.float32, device=device),
                   torch.empty(0, 0, dtype=torch.float32, device=device),
                   torch.empty(0, dtype=torch.int32, device=device))


@functools.lru_cache(maxsize=64)
def _learning_rate(lr: float) -> torch.Tensor:
    return torch.tensor(lr, dtype=torch.float32, device="cpu")


@functools.lru_cache(maxsize=64)
def _infos(tables: int) -> tuple[int, int]:
    """fbgemm's ``(info_B_num_bits, info_B_mask)`` for ``tables`` tables (as its training module gets them)."""
    bits, mask = torch.ops.fbgemm.get_infos_metadata(torch.empty(0, device="cpu"), 1, tables)
    return int(bits), int(mask)


# --- the entry points -------------------------------------------------------------------------------------

def pool_sum(tables: Tables, batch: Batch) -> torch.Tensor:
    """``(bags, total_d)``: every table's bag sums side by side (fbgemm's forward, one call)."""
    batch = flat_batch(batch)
    args = table_args(tuple(tables.offsets), tuple(tables.dims), tuple(tables.rows), tables.storage.device)
    if not args.on_host:
        return lookup_forward(tables.storage, args, batch)
    return torch.ops.fbgemm.split_embedding_codegen_forward_cpu(
        tables.storage, args.weights_offsets, args.d_offsets, args.total_d, args.hash_size_cumsum, batch.ids,
        batch.offsets, POOL_SUM, batch.per_sample_weights, OUTPUT_FP32,
    )


def dense_grad(grad: torch.Tensor, dims: Sequence[int], rows: Sequence[int], batch: Batch) -> torch.Tensor:
    """Every table's dense weight gradient, back to back (table ``t``'s ``rows[t] x dims[t]``)."""
    batch = flat_batch(batch)
    packed = list(itertools.accumulate([r * d for r, d in zip(rows, dims)], initial=0))
    args = table_args(tuple(packed[:-1]), tuple(dims), tuple(rows), grad.device)
    if not args.on_host:
        return lookup_dense_grad(grad, args, batch, packed[-1])
    scratch = torch.empty(packed[-1], dtype=torch.float32, device=grad.device)  # shape and dtype only: never read
    return torch.ops.fbgemm.split_embedding_backward_codegen_dense_cpu(
        grad, scratch, args.weights_offsets, args.d_offsets, args.total_d, args.hash_size_cumsum, args.hash_bits,
        batch.ids, batch.offsets, POOL_SUM, batch.per_sample_weights,
    )


def update(tables: Tables, batch: Batch, grad: torch.Tensor, state: State, hyper: Hyper) -> None:
    """The fused update of every table, in place, with ``hyper.kind`` (whose record says ``fbgemm_cpu`` on CPU,
    ``fbgemm_cuda`` on CUDA). ``grad``: ``(bags, total_d)`` with unit column stride (rows may be strided)."""
    batch = flat_batch(batch)
    device = tables.storage.device
    args = table_args(tuple(tables.offsets), tuple(tables.dims), tuple(tables.rows), device)
    if not args.on_host:
        lookup_update(tables.storage, args, batch, grad, state, hyper)
        return
    m1 = state.momentum1
    if m1 is None or not hyper.kind.per_element or list(state.momentum1_offsets) == list(tables.offsets):
        at = None if m1 is None else constant(tuple(state.momentum1_offsets), device)
        _update_on_host(tables.storage, args, batch, grad, m1, at, hyper)
        return
    # fbgemm's CPU kernels address element-wise state by the WEIGHTS' offsets (the state's are unread): for
    # state laid out otherwise, one call per table
    dims, rows = tables.dims, tables.rows
    starts = list(itertools.accumulate(dims, initial=0))
    bags = (batch.offsets.numel() - 1) // len(dims)
    for t in range(len(dims)):
        mine = batch.table(t, bags)
        if mine.ids.numel() == 0:
            continue
        one = table_args((0,), (dims[t],), (rows[t],), device)
        first = state.momentum1_offsets[t]
        _update_on_host(tables.view(t).view(-1), one, mine, grad[:, starts[t] : starts[t + 1]],
                        m1[first : first + rows[t] * dims[t]], one.weights_offsets, hyper)


def _update_on_host(weights: torch.Tensor, args: TableArgs, batch: Batch, grad: torch.Tensor,
                    momentum: torch.Tensor | None, momentum_offsets: torch.Tensor | None, hyper: Hyper) -> None:
    """fbgemm_gpu-cpu's backward-with-optimizer kernel for ``hyper.kind``: one call."""
    place = args.placements
    common = (grad, weights, place, args.weights_offsets, args.d_offsets, args.total_d, args.hash_size_cumsum,
              args.hash_bits, batch.ids, batch.offsets, POOL_SUM, batch.per_sample_weights, False)
    op = getattr(torch.ops.fbgemm, f"split_embedding_backward_codegen_{hyper.kind.fbgemm}_cpu")
    if momentum is None:
        op(*common, _learning_rate(hyper.lr))
    else:
        op(*common, momentum, place, momentum_offsets, _learning_rate(hyper.lr), eps=hyper.eps)


# --- fbgemm's lookup functions (CUDA; the same calls run on CPU with the CPU forms) ---------------------------

def weights_list(weights: torch.Tensor, args: TableArgs) -> list[torch.Tensor]:
    """The weights as fbgemm's lookup functions take them: ``[flat, placements, offsets]`` in host memory,
    ``[dev, uvm, placements, offsets, lxu_cache]`` on a device (the tables in ``dev``)."""
    if args.on_host:
        return [weights, args.placements, args.weights_offsets]
    unused = _unused(str(weights.device))
    return [weights, unused.uvm, args.placements, args.weights_offsets, unused.cache_weights]


def state_list(state: torch.Tensor, at: torch.Tensor, args: TableArgs) -> list[torch.Tensor]:
    """An optimizer state buffer as fbgemm's lookup functions take it: ``[flat, placements, offsets]`` in host
    memory, ``[dev, uvm, placements, offsets]`` on a device."""
    if args.on_host:
        return [state, args.placements, at]
    return [state, _unused(str(state.device)).uvm, args.placements, at]


def lookup_args(weights: torch.Tensor, args: TableArgs, batch: Batch, placeholder: torch.Tensor, *,
                lr: float = 0.0, step: int = 0) -> dict[str, Any]:
    """The keyword arguments every ``split_embedding_codegen_lookup_*_function_pt2`` takes (``step``: the
    optimizer's iteration, read by Adam's bias correction)."""
    batch = flat_batch(batch)
    tables = args.weights_offsets.numel()
    bits, mask = _infos(tables)
    bags = (batch.offsets.numel() - 1) // tables
    if bags > mask:
        raise ValueError(f"fbgemm: {bags} bags per table exceed the {mask} its kernels address for {tables} tables")
    return {
        "placeholder_autograd_tensor": placeholder,
        "weights": weights_list(weights, args),
        "D_offsets": args.d_offsets,
        "total_D": args.total_d,
        "max_D": args.max_d,
        "hash_size_cumsum": args.hash_size_cumsum,
        "total_hash_size_bits": args.hash_bits,
        "indices": batch.ids,
        "offsets": batch.offsets,
        "pooling_mode": POOL_SUM,
        "indice_weights": batch.per_sample_weights,
        "feature_requires_grad": None,
        "output_dtype": OUTPUT_FP32,
        # B_offsets, vbe_output_offsets_feature_rank, vbe_B_offsets_rank_per_feature, lxu_cache_locations,
        # uvm_cache_stats, prev_iter_dev, vbe_output_offsets
        "aux_tensor": [None, None, None, _unused(str(weights.device)).cache_locations, None, None, None],
        "aux_int": [step, bits, mask],  # iter, info_B_num_bits, info_B_mask
        "aux_float": [0.0, 1.0],  # gwd_lower_bound, max_gradient
        # is_experimental_tbe, use_uniq_cache_locations_bwd, use_homogeneous_placements,
        # apply_global_weight_decay, gradient_clipping, stochastic_rounding, mixed_D (the general kernels)
        "aux_bool": [False, False, True, False, False, False, True],
        "learning_rate_tensor": _learning_rate(lr),
    }


_OPTIMIZER_ARGS: dict[OptimKind, Callable[[Hyper], dict[str, list[Any]]]] = {
    SGD: lambda h: {},
    ADAGRAD: lambda h: {"optim_float": [h.eps]},
    ROWWISE_ADAGRAD: lambda h: {"optim_int": [h.weight_decay_mode.value],  # weight_decay_mode
                                "optim_float": [h.eps, h.weight_decay, 0.0]},  # max_norm 0: none
    ADAM: lambda h: {"optim_tensor": [None] * 5,  # no row counter (row-wise bias correction off)
                     "optim_float": [h.eps, h.beta1, h.beta2, h.weight_decay], "optim_bool": [False]},
}
"""Per kind, the arguments of its lookup function beyond its states (its ``optim_*`` lists, fbgemm's order)."""


def optimizer_args(args: TableArgs, state: State, hyper: Hyper) -> dict[str, Any]:
    """The keyword arguments of ``hyper.kind``'s ``split_embedding_codegen_lookup_{name}_function_pt2`` beyond
    :func:`lookup_args`: its states (``momentum1``, ``momentum2``) and its ``optim_*`` lists."""
    extra = _OPTIMIZER_ARGS.get(hyper.kind)
    if extra is None:
        raise ValueError(f"fbgemm: no lookup function updates with {hyper.kind.name!r}; kinds "
                         f"{[k.name for k in _OPTIMIZER_ARGS]}")
    out = extra(hyper)
    device = args.weights_offsets.device
    for name, m, at in (("momentum1", state.momentum1, state.momentum1_offsets),
                        ("momentum2", state.momentum2, state.momentum2_offsets)):
        if m is not None:
            out[name] = state_list(m, constant(tuple(at), device), args)
    return out


def _lookup_function(kind: OptimKind) -> Callable[..., torch.Tensor]:
    return getattr(torch.ops.fbgemm, f"split_embedding_codegen_lookup_{kind.fbgemm}_function_pt2")


def run_forward(op: Callable[..., torch.Tensor], kwargs: dict[str, Any]) -> torch.Tensor:
    """``op(**kwargs)`` (an fbgemm autograd function) under ``no_grad``: its forward alone."""
    with torch.no_grad():
        return op(**kwargs)


def run_backward(op: Callable[..., torch.Tensor], kwargs: dict[str, Any], grad: torch.Tensor,
                 wrt: torch.Tensor) -> torch.Tensor | None:
    """``op(**kwargs)`` (an fbgemm autograd function), then its backward from ``grad``; the gradient of
    ``wrt``. fbgemm's lookup functions update their weights (and state) in place in that backward."""
    with torch.enable_grad():
        out = op(**kwargs)
        return torch.autograd.grad(out, wrt, grad, allow_unused=True)[0]


def lookup_forward(weights: torch.Tensor, args: TableArgs, batch: Batch) -> torch.Tensor:
    """``(bags, total_d)`` through fbgemm's lookup function (no update: under ``no_grad``)."""
    batch = flat_batch(batch)
    placeholder = torch.empty(0, dtype=torch.float32, device=weights.device)
    return run_forward(_lookup_function(SGD), lookup_args(weights, args, batch, placeholder))


def lookup_dense_grad(grad: torch.Tensor, packed: TableArgs, batch: Batch, numel: int) -> torch.Tensor:
    """Every table's dense weight gradient, back to back at ``packed``'s offsets, through fbgemm's dense
    lookup function and its backward (forward over a zero scratch of ``numel`` elements, then discarded)."""
    batch = flat_batch(batch)
    scratch = torch.zeros(numel, dtype=torch.float32, device=grad.device, requires_grad=True)
    grad = grad.contiguous()  # rows back to back, as fbgemm's module hands its output gradients
    kwargs = {
        "dev_weights": scratch, "weights_offsets": packed.weights_offsets, "D_offsets": packed.d_offsets,
        "total_D": packed.total_d, "max_D": packed.max_d, "hash_size_cumsum": packed.hash_size_cumsum,
        "total_hash_size_bits": packed.hash_bits, "indices": batch.ids, "offsets": batch.offsets,
        "pooling_mode": POOL_SUM, "indice_weights": batch.per_sample_weights, "feature_requires_grad": None,
        "output_dtype": OUTPUT_FP32,
    }
    out = run_backward(torch.ops.fbgemm.dense_embedding_codegen_lookup_function, kwargs, grad, scratch)
    return torch.zeros_like(scratch, requires_grad=False) if out is None else out


def lookup_update(weights: torch.Tensor, args: TableArgs, batch: Batch, grad: torch.Tensor, state: State,
                  hyper: Hyper) -> None:
    """The fused update of every table of one call through fbgemm's lookup function for ``hyper.kind``: its
    forward, then its backward from ``grad``, which updates the rows and state in place."""
    batch = flat_batch(batch)
    placeholder = torch.zeros(0, dtype=torch.float32, device=weights.device, requires_grad=True)
    grad = grad.contiguous()  # rows back to back, as fbgemm's module hands its output gradients
    kwargs = lookup_args(weights, args, batch, placeholder, lr=hyper.lr, step=state.step)
    kwargs.update(optimizer_args(args, state, hyper))
    run_backward(_lookup_function(hyper.kind), kwargs, grad, placeholder)
