"""fbgemm_gpu's table-batched embedding (TBE) kernels: the package's only ``fbgemm_gpu`` import.

Why these entry points: ``SplitTableBatchedEmbeddingBagsCodegen`` (the training TBE) owns its weights in one
buffer of its own; a DTensor's shards live in storage it does not own. The kernels under it take the buffer as
an argument, each table at an element offset (``weights_offsets``), so they run on the caller's storage: one
call for every table of one storage (gaps allowed), zero-copy, as TorchRec runs one call per fbgemm buffer.

On CPU (``fbgemm-gpu-cpu``) and CUDA (``fbgemm-gpu``; not measured on a GPU yet):

* forward: on CPU the kernel itself, ``split_embedding_codegen_forward_cpu`` (SUM pooling); on CUDA
  fbgemm's lookup function ``split_embedding_codegen_lookup_sgd_function_pt2`` under ``no_grad``
  (:func:`lookup_forward`; its C++ forward unpacks the CUDA argument lists);
* fused update: fbgemm's backward alone, ``split_embedding_backward_codegen_{name}_{unweighted,weighted}
  _pt2_wrapper`` (:func:`backward_op`), the op fbgemm's own training module calls from its autograd
  backward, one schema for both devices (it runs ``..._exact_cuda`` on CUDA, ``..._cpu`` on CPU), given
  the arguments its module gives (:func:`backward_values`): no forward runs, and no per-sample-weight
  gradient is computed. The kinds whose record says ``fbgemm_cpu`` / ``fbgemm_cuda`` (:mod:`...optim_kinds`);
  fbgemm_gpu-cpu 1.8 builds no CPU Adam;
* dense weight gradient: on CPU ``split_embedding_backward_codegen_dense_cpu``, on CUDA
  ``split_embedding_backward_codegen_dense_{unweighted,weighted}_exact_cuda`` (:func:`device_dense_grad`):
  fbgemm's dense backward alone, over a packed layout it never reads (every table's gradient back to back;
  no gradient as large as the storage).

Steps of a call (:func:`pool_sum`, :func:`dense_grad`, :func:`update`: the records of :mod:`.args`):

1. :func:`table_args` builds the per-table tensors shared by every call, once per tables and device (cached),
   on the tables' device; the device decides only the placements (``HOST`` on CPU, ``DEVICE`` elsewhere).
2. :func:`backward_values` (and :func:`lookup_args` for the CUDA forward) name every argument; an op is
   called with the arguments its schema names (:func:`call_by_name`), every tensor on the tables' device but
   ``learning_rate_tensor``, a CPU scalar as fbgemm wants it.

Tensors built here are cached per device: build them outside any ``FakeTensorMode``. The caller (:mod:`.ops`)
checked shapes, dtypes, devices and fbgemm's limits (:func:`.limits.misfit`); ids, bags and weights go contiguous.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from ..optim_kinds import ADAGRAD, ADAM, ROWWISE_ADAGRAD, SGD, Hyper, OptimKind
from .args import Batch, State, Tables, contiguous
from .copies import hash_size_cumsum

__all__ = ["TableArgs", "available", "backward_op", "backward_values", "call_by_name", "constant", "cuda_available",
           "dense_grad", "device_dense_grad", "in_unified_memory", "lookup_args", "lookup_forward", "pool_sum",
           "run_backward_op", "run_forward", "table_args", "update", "weights_list"]

POOL_SUM = 0  # fbgemm_gpu PoolingMode.SUM
OUTPUT_FP32 = 0  # fbgemm_gpu SparseType.FP32.as_int()
HOST = 3  # fbgemm_gpu EmbeddingLocation.HOST
DEVICE = 0  # fbgemm_gpu EmbeddingLocation.DEVICE

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _module() -> ModuleType | None:
    """fbgemm_gpu, imported once; ``None`` when it is not installed, or installed but does not load.

    A build of fbgemm_gpu for another torch or CUDA fails inside its import: its ``torch.ops.load_library``
    raises ``OSError`` (an undefined symbol, a missing ``libcudart``) or ``RuntimeError``. The lookups then run
    ours and torch's kernels, as without fbgemm_gpu, and say why once, here."""
    try:
        import fbgemm_gpu  # noqa: F401 - registers torch.ops.fbgemm
    except Exception as e:  # noqa: BLE001 - any failure of its import: fall back, never fail a lookup
        if not (isinstance(e, ModuleNotFoundError) and e.name == "fbgemm_gpu"):  # not installed: nothing to say
            _unusable(e)
        return None
    return fbgemm_gpu


def _unusable(e: Exception) -> None:
    log.warning("torchrec_dtensor_bridge: fbgemm_gpu is installed but cannot be loaded (%s: %s); its kernels "
                "are not used, this package's and torch's run instead. Install the fbgemm-gpu build made for "
                "torch %s (CUDA %s): docs/gpu.md", type(e).__name__, str(e).strip().splitlines()[0] if str(e) else "",
                torch.__version__, torch.version.cuda or "none")


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


def in_unified_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in CUDA unified memory (fbgemm's managed or host-mapped allocations: the rows of a
    TorchRec table placed in ``EmbeddingLocation.MANAGED`` or ``MANAGED_CACHING``, compute kernels
    ``fused_uvm`` and ``fused_uvm_caching``), by fbgemm's own ``is_uvm_tensor``; ``False`` off CUDA and without
    fbgemm_gpu (which every such allocation comes from)."""
    if t.device.type != "cuda" or _module() is None or not hasattr(torch.ops.fbgemm, "is_uvm_tensor"):
        return False
    return bool(torch.ops.fbgemm.is_uvm_tensor(t))


@dataclass(frozen=True)
class TableArgs:
    """The tables of one call, in fbgemm's form (tensors on the tables' device)."""

    weights_offsets: torch.Tensor  # int64 (T,): each table's first element in the flat weights
    d_offsets: torch.Tensor  # int32 (T + 1,): each table's first output column
    total_d: int
    hash_size_cumsum: torch.Tensor  # int64 (T + 1,): rows before each table (its physical table's), then all rows
    hash_bits: int  # bits of the total row count (fbgemm's ``total_hash_size_bits``)
    max_d: int
    placements: torch.Tensor  # int32 (T,): every table's placement, HOST on CPU, DEVICE elsewhere
    on_host: bool  # the tables are in host memory: fbgemm's CPU kernels and argument forms


def table_args(offsets: tuple[int, ...], dims: tuple[int, ...], rows: tuple[int, ...],
               device: torch.device) -> TableArgs:
    """:class:`TableArgs` of tables at element ``offsets`` with ``dims`` columns and ``rows`` rows (and
    fbgemm_gpu's ops registered)."""
    if _module() is None:
        raise RuntimeError("fbgemm_gpu is not installed or cannot be loaded (pip install fbgemm-gpu-cpu, or fbgemm-gpu "
                           "for CUDA: docs/gpu.md)")
    return _table_args(tuple(offsets), tuple(dims), tuple(rows), str(device))


@functools.lru_cache(maxsize=256)
def _table_args(offsets: tuple[int, ...], dims: tuple[int, ...], rows: tuple[int, ...], device: str) -> TableArgs:
    d_offsets = list(itertools.accumulate(dims, initial=0))
    on_host = torch.device(device).type == "cpu"
    cum = hash_size_cumsum(offsets, dims, rows, copies=not on_host)
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

    uvm: torch.Tensor  # (0,) in the weights' dtype: no unified-memory part (fbgemm reads it as the weights' type)
    cache_weights: torch.Tensor  # (0, 0) in the cache's dtype (the weights', fp32 for bf16): no cache
    cache_locations: torch.Tensor  # int32 (0,): no cache
    placements: torch.Tensor  # int32 (0,): a state with no tables (Adam's row counters)
    offsets: torch.Tensor  # int64 (0,): a state with no tables


@functools.lru_cache(maxsize=16)
def _unused(device: str, dtype: torch.dtype = torch.float32) -> _Unused:
    # fbgemm's cache holds fp32 or fp16 rows (its module refuses a bf16 cache): bf16 tables' placeholder is fp32
    cache = torch.float32 if dtype == torch.bfloat16 else dtype
    return _Unused(torch.empty(0, dtype=dtype, device=device),
                   torch.empty(0, 0, dtype=cache, device=device),
                   torch.empty(0, dtype=torch.int32, device=device),
                   torch.empty(0, dtype=torch.int32, device=device),
                   torch.empty(0, dtype=torch.int64, device=device))


@functools.lru_cache(maxsize=64)
def _learning_rate(lr: float) -> torch.Tensor:
    return torch.tensor(lr, dtype=torch.float32, device="cpu")


@functools.lru_cache(maxsize=64)
def _infos(tables: int) -> tuple[int, int]:
    """fbgemm's ``(info_B_num_bits, info_B_mask)`` for ``tables`` tables (as its training module gets them)."""
    bits, mask = torch.ops.fbgemm.get_infos_metadata(torch.empty(0, device="cpu"), 1, tables)
    return int(bits), int(mask)


def _bag_bits(args: TableArgs, batch: Batch) -> tuple[int, int]:
    """:func:`_infos` for the call's tables, after checking that its bags per table fit them."""
    tables = args.weights_offsets.numel()
    bits, mask = _infos(tables)
    bags = (batch.offsets.numel() - 1) // tables
    if bags > mask:
        raise ValueError(f"fbgemm: {bags} bags per table exceed the {mask} its kernels address for {tables} tables")
    return bits, mask


def _flat(batch: Batch) -> Batch:
    """``batch`` with contiguous ids, boundaries, weights: fbgemm's CUDA kernels read them as flat arrays."""
    psw = batch.per_sample_weights
    if batch.ids.is_contiguous() and batch.offsets.is_contiguous() and (psw is None or psw.is_contiguous()):
        return batch
    return Batch(contiguous(batch.ids), contiguous(batch.offsets), None if psw is None else contiguous(psw),
                 batch.ids_checked)


# --- the entry points -------------------------------------------------------------------------------------

def pool_sum(tables: Tables, batch: Batch) -> torch.Tensor:
    """``(bags, total_d)``: every table's bag sums side by side (fbgemm's forward, one call)."""
    batch = _flat(batch)
    args = table_args(tuple(tables.offsets), tuple(tables.dims), tuple(tables.rows), tables.storage.device)
    if not args.on_host:
        return lookup_forward(tables.storage, args, batch)
    return torch.ops.fbgemm.split_embedding_codegen_forward_cpu(
        tables.storage, args.weights_offsets, args.d_offsets, args.total_d, args.hash_size_cumsum, batch.ids,
        batch.offsets, POOL_SUM, batch.per_sample_weights, OUTPUT_FP32,
    )


def dense_grad(grad: torch.Tensor, dims: Sequence[int], rows: Sequence[int], batch: Batch) -> torch.Tensor:
    """Every table's dense weight gradient, back to back (table ``t``'s ``rows[t] x dims[t]``)."""
    batch = _flat(batch)
    packed = list(itertools.accumulate([r * d for r, d in zip(rows, dims)], initial=0))
    args = table_args(tuple(packed[:-1]), tuple(dims), tuple(rows), grad.device)
    if not args.on_host:
        return device_dense_grad(grad, args, batch, packed[-1])
    return torch.ops.fbgemm.split_embedding_backward_codegen_dense_cpu(
        grad, _shape_only(packed[-1], grad.device), args.weights_offsets, args.d_offsets, args.total_d, args.hash_size_cumsum, args.hash_bits,
        batch.ids, batch.offsets, POOL_SUM, batch.per_sample_weights,
    )


def update(tables: Tables, batch: Batch, grad: torch.Tensor, state: State, hyper: Hyper) -> None:
    """The fused update of every table, in place, with ``hyper.kind`` (whose record says ``fbgemm_cpu`` on CPU,
    ``fbgemm_cuda`` on CUDA): fbgemm's backward alone (:func:`backward_values`), no forward.
    ``grad``: ``(bags, total_d)`` with unit column stride (rows may be strided on CPU)."""
    batch = _flat(batch)
    device = tables.storage.device
    args = table_args(tuple(tables.offsets), tuple(tables.dims), tuple(tables.rows), device)
    m1 = state.momentum1
    if (not args.on_host or m1 is None or not hyper.kind.per_element
            or list(state.momentum1_offsets) == list(tables.offsets)):
        run_backward_op(hyper.kind, backward_values(tables.storage, args, batch, grad, state, hyper))
        return
    # fbgemm's CPU kernels address element-wise state by the WEIGHTS' offsets (the state's are unread): for
    # state laid out otherwise, one call per table (its CUDA kernels read the state's offsets: one call there)
    dims, rows = tables.dims, tables.rows
    starts = list(itertools.accumulate(dims, initial=0))
    bags = (batch.offsets.numel() - 1) // len(dims)
    for t in range(len(dims)):
        mine = batch.table(t, bags)
        if mine.ids.numel() == 0:
            continue
        one = table_args((0,), (dims[t],), (rows[t],), device)
        first = state.momentum1_offsets[t]
        alone = State(m1[first : first + rows[t] * dims[t]], (0,), None, (), state.step)
        run_backward_op(hyper.kind, backward_values(tables.view(t).view(-1), one, mine,
                                                    grad[:, starts[t] : starts[t + 1]], alone, hyper))


def backward_op(kind: OptimKind, weighted: bool) -> Any:
    """fbgemm's backward-with-update op for ``kind``: the op its own training module's autograd calls, with one
    schema for CPU and CUDA (``..._pt2_wrapper``; on CUDA it runs ``..._exact_cuda``, on CPU ``..._cpu``)."""
    which = "weighted" if weighted else "unweighted"
    return getattr(torch.ops.fbgemm, f"split_embedding_backward_codegen_{kind.fbgemm}_{which}_pt2_wrapper")


def run_backward_op(kind: OptimKind, values: dict[str, Any]) -> None:
    """Calls :func:`backward_op` with the arguments its schema names, taken from ``values`` by name (an
    argument ``values`` lacks: its default, ``None`` where optional, else a ``ValueError`` naming it)."""
    op = backward_op(kind, values["indice_weights"].numel() > 0)
    call_by_name(op, values)


def call_by_name(op: Any, values: dict[str, Any]) -> Any:
    """``op(**kwargs)`` with each argument of ``op``'s schema taken from ``values`` by name."""
    kwargs: dict[str, Any] = {}
    for a in op.default._schema.arguments:
        if a.name in values:
            kwargs[a.name] = values[a.name]
        elif a.has_default_value():
            continue
        elif isinstance(a.type, torch.OptionalType):
            kwargs[a.name] = None
        else:
            raise ValueError(f"fbgemm: {op.default._schema.name} takes {a.name!r}, which this package does not "
                             f"give (it gives {sorted(values)})")
    return op(**kwargs)


def backward_values(weights: torch.Tensor, args: TableArgs, batch: Batch, grad: torch.Tensor, state: State,
                    hyper: Hyper) -> dict[str, Any]:
    """The arguments of :func:`backward_op`, by name, as fbgemm's training module hands them (its pt2
    autograd's backward): the tables in ``host_weights`` on CPU, in ``dev_weights`` on a device; each state
    as five tensors (``{name}_host``, ``_dev``, ``_uvm``, ``_placements``, ``_offsets``); the launch constants
    of its NVIDIA build (``BT_block_size`` 32, ``max_segment_length_per_warp`` 32); the optimizer's
    hyper-parameters under fbgemm's names (Adam's ``iter`` is the step being taken)."""
    device = weights.device
    unused, fp32 = _unused(str(device), weights.dtype), _unused(str(device))
    bits, mask = _bag_bits(args, batch)
    if not args.on_host:
        grad = grad.contiguous()  # rows back to back, as fbgemm's module hands its output gradients
    psw = batch.per_sample_weights
    values: dict[str, Any] = {
        "grad_output": grad,
        "host_weights": weights if args.on_host else unused.uvm,
        "dev_weights": unused.uvm if args.on_host else weights,
        "uvm_weights": unused.uvm,
        "lxu_cache_weights": unused.cache_weights,
        "weights_placements": args.placements,
        "weights_offsets": args.weights_offsets,
        "D_offsets": args.d_offsets,
        "max_D": args.max_d,
        # row-wise Adagrad's kernels for tables of one width are faster; fbgemm's module asks for them so
        "mixed_D": hyper.kind is not ROWWISE_ADAGRAD or args.max_d * len(args.placements) != args.total_d,
        "hash_size_cumsum": args.hash_size_cumsum,
        "total_hash_size_bits": args.hash_bits,
        "indices": batch.ids,
        "offsets": batch.offsets,
        "pooling_mode": POOL_SUM,
        "indice_weights": fp32.uvm if psw is None else psw,
        "lxu_cache_locations": unused.cache_locations,
        "BT_block_size": 32,
        "max_segment_length_per_warp": 32,
        "stochastic_rounding": hyper.stochastic_rounding,
        "info_B_num_bits": bits,
        "info_B_mask_int64": mask,
        "use_uniq_cache_locations": False,
        "use_homogeneous_placements": True,
        "learning_rate_tensor": _learning_rate(hyper.lr),
        "eps": hyper.eps,
        "weight_decay": hyper.weight_decay,
        "weight_decay_mode": hyper.weight_decay_mode.value,
        "max_norm": 0.0,
        "beta1": hyper.beta1,
        "beta2": hyper.beta2,
        "iter": state.step,
        "use_rowwise_bias_correction": False,
        # Adam's per-row step counters, unused without rowwise bias correction: its CUDA backward takes them as
        # (non-optional) Tensors, empty, as fbgemm's training module's autograd hands them
        "row_counter_host": unused.uvm,
        "row_counter_dev": unused.uvm,
        "row_counter_uvm": unused.uvm,
        "row_counter_placements": unused.placements,
        "row_counter_offsets": unused.offsets,
        "output_dtype": OUTPUT_FP32,
    }
    for name, m, at in (("momentum1", state.momentum1, state.momentum1_offsets),
                        ("momentum2", state.momentum2, state.momentum2_offsets)):
        if m is not None:
            values.update({f"{name}_host": m if args.on_host else fp32.uvm,
                           f"{name}_dev": fp32.uvm if args.on_host else m, f"{name}_uvm": fp32.uvm,
                           f"{name}_placements": args.placements, f"{name}_offsets": constant(tuple(at), device)})
    return values


# --- fbgemm's lookup functions (CUDA; the same calls run on CPU with the CPU forms) ---------------------------

def weights_list(weights: torch.Tensor, args: TableArgs) -> list[torch.Tensor]:
    """The weights as fbgemm's lookup functions take them: ``[flat, placements, offsets]`` in host memory,
    ``[dev, uvm, placements, offsets, lxu_cache]`` on a device (the tables in ``dev``)."""
    if args.on_host:
        return [weights, args.placements, args.weights_offsets]
    unused = _unused(str(weights.device), weights.dtype)
    return [weights, unused.uvm, args.placements, args.weights_offsets, unused.cache_weights]


def lookup_args(weights: torch.Tensor, args: TableArgs, batch: Batch, placeholder: torch.Tensor, *,
                lr: float = 0.0, step: int = 0) -> dict[str, Any]:
    """The keyword arguments every ``split_embedding_codegen_lookup_*_function_pt2`` takes (``step``: the
    optimizer's iteration, read by Adam's bias correction)."""
    batch = _flat(batch)
    bits, mask = _bag_bits(args, batch)
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


def run_forward(op: Callable[..., torch.Tensor], kwargs: dict[str, Any]) -> torch.Tensor:
    """``op(**kwargs)`` (an fbgemm autograd function) under ``no_grad``: its forward alone."""
    with torch.no_grad():
        return op(**kwargs)


def lookup_forward(weights: torch.Tensor, args: TableArgs, batch: Batch) -> torch.Tensor:
    """``(bags, total_d)`` through fbgemm's lookup function (no update: under ``no_grad``)."""
    batch = _flat(batch)
    placeholder = torch.empty(0, dtype=torch.float32, device=weights.device)
    return run_forward(torch.ops.fbgemm.split_embedding_codegen_lookup_sgd_function_pt2,
                       lookup_args(weights, args, batch, placeholder))


def _shape_only(numel: int, device: torch.device) -> torch.Tensor:
    """A 1-D fp32 tensor of ``numel`` elements that owns one: what fbgemm's dense backward takes as the weights,
    of which it reads the shape, dtype and device alone (its result is ``zeros_like`` of it, a tensor of its
    own: an expanded tensor's ``zeros_like`` is contiguous). No second buffer the size of the tables."""
    return torch.zeros((), dtype=torch.float32, device=device).expand(numel)


def device_dense_grad(grad: torch.Tensor, packed: TableArgs, batch: Batch, numel: int) -> torch.Tensor:
    """Every table's dense weight gradient, back to back at ``packed``'s offsets, through fbgemm's CUDA dense
    backward (``split_embedding_backward_codegen_dense_{unweighted,weighted}_exact_cuda``, the op its dense
    module's autograd calls): no forward. ``dev_weights`` gives it the result's shape (:func:`_shape_only`:
    no buffer of that size)."""
    batch = _flat(batch)
    psw = batch.per_sample_weights
    which = "unweighted" if psw is None else "weighted"
    op = getattr(torch.ops.fbgemm, f"split_embedding_backward_codegen_dense_{which}_exact_cuda")
    values = {
        "grad_output": grad.contiguous(),  # rows back to back, as fbgemm's module hands its output gradients
        "dev_weights": _shape_only(numel, grad.device),
        "weights_offsets": packed.weights_offsets, "D_offsets": packed.d_offsets, "max_D": packed.max_d,
        "mixed_D": True, "hash_size_cumsum": packed.hash_size_cumsum, "total_hash_size_bits": packed.hash_bits,
        "indices": batch.ids, "offsets": batch.offsets, "pooling_mode": POOL_SUM, "indice_weights": psw,
        "unused_": 32, "max_segment_length_per_warp": 32, "unused": 0.0,  # BT_block_size: unused there
    }
    return call_by_name(op, values)
