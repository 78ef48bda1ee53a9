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
* fused update: ``split_embedding_backward_codegen_{sgd,rowwise_adagrad,adagrad}_cpu``
  update the rows (and momentum) in place. fbgemm_gpu-cpu 1.8 builds no CPU Adam,
  and ignores weight decay in these kernels.

On CUDA (``fbgemm-gpu``), fbgemm's own lookup functions, as its training module calls them
(not measured on a GPU yet):

* forward: ``split_embedding_codegen_lookup_sgd_function_pt2`` under ``no_grad``;
* dense weight gradient: ``dense_embedding_codegen_lookup_function`` over a packed scratch
  layout, then its backward;
* fused update: ``split_embedding_codegen_lookup_{sgd,rowwise_adagrad,adagrad,adam}_function_pt2``,
  then its backward from the output gradient: fbgemm's backward updates the rows (and
  momentum) in place (:func:`run_backward`).

Steps of a call:

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
(:mod:`.ops`) has checked shapes, dtypes, devices and alignment.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

__all__ = [
    "CUDA_UPDATE_KINDS", "TableArgs", "UPDATE_KINDS", "available", "constant", "cuda_available", "dense_grad",
    "fits", "lookup_args", "lookup_dense_grad", "lookup_forward", "lookup_update", "optimizer_args", "pool_sum",
    "run_backward", "run_forward", "state_list", "table_args", "update", "weights_list",
]

POOL_SUM = 0  # fbgemm_gpu PoolingMode.SUM
OUTPUT_FP32 = 0  # fbgemm_gpu SparseType.FP32.as_int()
HOST = 3  # fbgemm_gpu EmbeddingLocation.HOST
DEVICE = 0  # fbgemm_gpu EmbeddingLocation.DEVICE
UPDATE_KINDS = ("sgd", "rowwise_adagrad", "adagrad")
"""Kinds with a CPU backward-with-optimizer kernel in fbgemm_gpu-cpu 1.8."""
CUDA_UPDATE_KINDS = ("sgd", "rowwise_adagrad", "adagrad", "adam")
"""Kinds whose fbgemm lookup function updates in its CUDA backward."""
ALIGN = 4
"""fbgemm's CUDA kernels read fp32 rows four at a time: dims, element offsets and (in bytes) 4 x this."""


@functools.lru_cache(maxsize=1)
def _module() -> ModuleType | None:
    try:
        import fbgemm_gpu  # noqa: F401 - registers torch.ops.fbgemm
    except ImportError:
        return None
    return fbgemm_gpu


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


def fits(weights: torch.Tensor, offsets: list[int], dims: list[int]) -> bool:
    """Whether fbgemm's CUDA kernels can read the tables of ``weights`` at element ``offsets`` with ``dims``
    columns: 16-byte aligned rows (dims and offsets multiples of :data:`ALIGN`, an aligned start)."""
    return (weights.data_ptr() % (4 * ALIGN) == 0 and all(o % ALIGN == 0 for o in offsets)
            and all(d % ALIGN == 0 for d in dims))


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


# --- the CPU kernels ----------------------------------------------------------------------------------------

def pool_sum(weights: torch.Tensor, args: TableArgs, ids: torch.Tensor, offsets: torch.Tensor,
             per_sample_weights: torch.Tensor | None) -> torch.Tensor:
    """``(bags, total_d)``: every table's bag sums side by side (fbgemm's forward, one call)."""
    if not args.on_host:
        return lookup_forward(weights, args, ids, offsets, per_sample_weights)
    return torch.ops.fbgemm.split_embedding_codegen_forward_cpu(
        weights, args.weights_offsets, args.d_offsets, args.total_d, args.hash_size_cumsum, ids, offsets, POOL_SUM,
        per_sample_weights, OUTPUT_FP32,
    )


def dense_grad(grad: torch.Tensor, packed: TableArgs, ids: torch.Tensor, offsets: torch.Tensor,
               per_sample_weights: torch.Tensor | None, numel: int) -> torch.Tensor:
    """Every table's dense weight gradient, back to back at ``packed``'s offsets (``numel`` elements)."""
    if not packed.on_host:
        return lookup_dense_grad(grad, packed, ids, offsets, per_sample_weights, numel)
    scratch = torch.empty(numel, dtype=torch.float32, device=grad.device)  # shape and dtype only: never read
    return torch.ops.fbgemm.split_embedding_backward_codegen_dense_cpu(
        grad, scratch, packed.weights_offsets, packed.d_offsets, packed.total_d, packed.hash_size_cumsum,
        packed.hash_bits, ids, offsets, POOL_SUM, per_sample_weights,
    )


def update(kind: str, weights: torch.Tensor, args: TableArgs, grad: torch.Tensor, ids: torch.Tensor,
           offsets: torch.Tensor, per_sample_weights: torch.Tensor | None, momentum: torch.Tensor | None,
           momentum_offsets: torch.Tensor | None, lr: float, eps: float, *, momentum2: torch.Tensor | None = None,
           momentum2_offsets: torch.Tensor | None = None, weight_decay: float = 0.0, decay: int = 0,
           beta1: float = 0.9, beta2: float = 0.999, step: int = 1) -> None:
    """The fused update of every table of one call, in place (``kind`` in :data:`UPDATE_KINDS` on CPU, in
    :data:`CUDA_UPDATE_KINDS` on CUDA).

    ``grad``: ``(bags, total_d)`` with unit column stride (rows may be strided); ``momentum``: the flat
    state buffer with each table's first element at ``momentum_offsets`` (``momentum2`` likewise, Adam).
    """
    if not args.on_host:
        lookup_update(kind, weights, args, grad, ids, offsets, per_sample_weights, momentum, momentum_offsets,
                      momentum2, momentum2_offsets, lr=lr, eps=eps, weight_decay=weight_decay, decay=decay,
                      beta1=beta1, beta2=beta2, step=step)
        return
    place = args.placements
    common = (grad, weights, place, args.weights_offsets, args.d_offsets, args.total_d, args.hash_size_cumsum,
              args.hash_bits, ids, offsets, POOL_SUM, per_sample_weights, False)
    rate = _learning_rate(lr)
    if kind == "sgd":
        torch.ops.fbgemm.split_embedding_backward_codegen_sgd_cpu(*common, rate)
        return
    op = (torch.ops.fbgemm.split_embedding_backward_codegen_adagrad_cpu if kind == "adagrad"
          else torch.ops.fbgemm.split_embedding_backward_codegen_rowwise_adagrad_cpu)
    op(*common, momentum, place, momentum_offsets, rate, eps=eps)


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


def lookup_args(weights: torch.Tensor, args: TableArgs, ids: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: torch.Tensor | None, placeholder: torch.Tensor, *, lr: float = 0.0,
                step: int = 0) -> dict[str, Any]:
    """The keyword arguments every ``split_embedding_codegen_lookup_*_function_pt2`` takes (``step``: the
    optimizer's iteration, read by Adam's bias correction)."""
    tables = args.weights_offsets.numel()
    bits, mask = _infos(tables)
    batch = (offsets.numel() - 1) // tables
    if batch > mask:
        raise ValueError(f"fbgemm: {batch} bags per table exceed the {mask} its kernels address for {tables} tables")
    return {
        "placeholder_autograd_tensor": placeholder,
        "weights": weights_list(weights, args),
        "D_offsets": args.d_offsets,
        "total_D": args.total_d,
        "max_D": args.max_d,
        "hash_size_cumsum": args.hash_size_cumsum,
        "total_hash_size_bits": args.hash_bits,
        "indices": ids,
        "offsets": offsets,
        "pooling_mode": POOL_SUM,
        "indice_weights": per_sample_weights,
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


def optimizer_args(kind: str, args: TableArgs, momentum1: torch.Tensor | None, momentum1_offsets: torch.Tensor | None,
                   momentum2: torch.Tensor | None, momentum2_offsets: torch.Tensor | None, *, eps: float,
                   weight_decay: float, decay: int, beta1: float, beta2: float) -> dict[str, Any]:
    """The keyword arguments of ``split_embedding_codegen_lookup_{kind}_function_pt2`` beyond
    :func:`lookup_args` (``decay``: fbgemm's ``WeightDecayMode`` value)."""
    if kind == "sgd":
        return {}
    assert momentum1 is not None and momentum1_offsets is not None, f"{kind} keeps a momentum"
    out: dict[str, Any] = {"momentum1": state_list(momentum1, momentum1_offsets, args)}
    if kind == "adagrad":
        out["optim_float"] = [eps]
    elif kind == "rowwise_adagrad":
        out["optim_int"] = [decay]
        out["optim_float"] = [eps, weight_decay, 0.0]  # max_norm 0: none
    elif kind == "adam":
        assert momentum2 is not None and momentum2_offsets is not None, "adam keeps two momenta"
        out["momentum2"] = state_list(momentum2, momentum2_offsets, args)
        out["optim_tensor"] = [None] * 5  # no row counter (row-wise bias correction off)
        out["optim_float"] = [eps, beta1, beta2, weight_decay]
        out["optim_bool"] = [False]
    else:
        raise ValueError(f"fbgemm: no lookup function updates with {kind!r}; expected one of {CUDA_UPDATE_KINDS}")
    return out


def _lookup_function(kind: str) -> Callable[..., torch.Tensor]:
    return getattr(torch.ops.fbgemm, f"split_embedding_codegen_lookup_{kind}_function_pt2")


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


def lookup_forward(weights: torch.Tensor, args: TableArgs, ids: torch.Tensor, offsets: torch.Tensor,
                   per_sample_weights: torch.Tensor | None) -> torch.Tensor:
    """``(bags, total_d)`` through fbgemm's lookup function (no update: under ``no_grad``)."""
    placeholder = torch.empty(0, dtype=torch.float32, device=weights.device)
    return run_forward(_lookup_function("sgd"), lookup_args(weights, args, ids, offsets, per_sample_weights,
                                                           placeholder))


def lookup_dense_grad(grad: torch.Tensor, packed: TableArgs, ids: torch.Tensor, offsets: torch.Tensor,
                      per_sample_weights: torch.Tensor | None, numel: int) -> torch.Tensor:
    """Every table's dense weight gradient, back to back at ``packed``'s offsets, through fbgemm's dense
    lookup function and its backward (forward over a zero scratch of ``numel`` elements, then discarded)."""
    scratch = torch.zeros(numel, dtype=torch.float32, device=grad.device, requires_grad=True)
    grad = grad.contiguous()  # rows back to back, as fbgemm's module hands its output gradients
    kwargs = {
        "dev_weights": scratch, "weights_offsets": packed.weights_offsets, "D_offsets": packed.d_offsets,
        "total_D": packed.total_d, "max_D": packed.max_d, "hash_size_cumsum": packed.hash_size_cumsum,
        "total_hash_size_bits": packed.hash_bits, "indices": ids, "offsets": offsets, "pooling_mode": POOL_SUM,
        "indice_weights": per_sample_weights, "feature_requires_grad": None, "output_dtype": OUTPUT_FP32,
    }
    out = run_backward(torch.ops.fbgemm.dense_embedding_codegen_lookup_function, kwargs, grad, scratch)
    return torch.zeros_like(scratch, requires_grad=False) if out is None else out


def lookup_update(kind: str, weights: torch.Tensor, args: TableArgs, grad: torch.Tensor, ids: torch.Tensor,
                  offsets: torch.Tensor, per_sample_weights: torch.Tensor | None, momentum1: torch.Tensor | None,
                  momentum1_offsets: torch.Tensor | None, momentum2: torch.Tensor | None,
                  momentum2_offsets: torch.Tensor | None, *, lr: float, eps: float, weight_decay: float, decay: int,
                  beta1: float, beta2: float, step: int) -> None:
    """The fused update of every table of one call through fbgemm's lookup function for ``kind``: its
    forward, then its backward from ``grad``, which updates the rows and state in place."""
    placeholder = torch.zeros(0, dtype=torch.float32, device=weights.device, requires_grad=True)
    grad = grad.contiguous()  # rows back to back, as fbgemm's module hands its output gradients
    kwargs = lookup_args(weights, args, ids, offsets, per_sample_weights, placeholder, lr=lr, step=step)
    kwargs.update(optimizer_args(kind, args, momentum1, momentum1_offsets, momentum2, momentum2_offsets, eps=eps,
                                 weight_decay=weight_decay, decay=decay, beta1=beta1, beta2=beta2))
    run_backward(_lookup_function(kind), kwargs, grad, placeholder)
