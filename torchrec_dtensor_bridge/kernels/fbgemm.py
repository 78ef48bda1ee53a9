"""fbgemm_gpu's table-batched embedding (TBE) kernels: the package's only ``fbgemm_gpu`` import.

Why these entry points: ``SplitTableBatchedEmbeddingBagsCodegen`` (the training TBE)
owns its weights in one flat buffer of its own; a DTensor's shards live in storage
it does not own. The kernels under it take that buffer as an argument, with each
table at an element offset into it (``weights_offsets``), so they run on the
caller's storage directly: one call for every table of one storage (gaps between
tables are fine), zero-copy, as TorchRec runs one call per fbgemm buffer.

* forward: ``split_embedding_codegen_forward_cpu`` (SUM pooling);
* dense weight gradient: ``split_embedding_backward_codegen_dense_cpu``. It does not
  read the weights, so it is given a packed scratch layout and returns every table's
  gradient back to back (no gradient as large as the storage);
* fused update: ``split_embedding_backward_codegen_{sgd,rowwise_adagrad,adagrad}_cpu``
  update the rows (and momentum) in place. fbgemm_gpu-cpu 1.8 builds no CPU Adam,
  and ignores weight decay in these kernels.

:func:`table_args` builds the per-table arguments shared by every call (the same form on
every device); the caller (:mod:`.ops`) has checked shapes and dtypes.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from types import ModuleType

import torch

__all__ = ["TableArgs", "available", "dense_grad", "pool_sum", "table_args", "update", "UPDATE_KINDS"]

POOL_SUM = 0  # fbgemm_gpu PoolingMode.SUM
OUTPUT_FP32 = 0  # fbgemm_gpu SparseType.FP32.as_int()
HOST = 3  # fbgemm_gpu EmbeddingLocation.HOST
UPDATE_KINDS = ("sgd", "rowwise_adagrad", "adagrad")
"""Kinds with a CPU backward-with-optimizer kernel in fbgemm_gpu-cpu 1.8."""


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


@dataclass(frozen=True)
class TableArgs:
    """The tables of one call, in fbgemm's form (tensors on the tables' device)."""

    weights_offsets: torch.Tensor  # int64 (T,): each table's first element in the flat weights
    d_offsets: torch.Tensor  # int32 (T + 1,): each table's first output column
    total_d: int
    hash_size_cumsum: torch.Tensor  # int64 (T + 1,): rows before each table
    hash_bits: int  # bits of the total row count (fbgemm's ``total_hash_size_bits``)


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
    return TableArgs(
        torch.tensor(offsets, dtype=torch.int64, device=device),
        torch.tensor(d_offsets, dtype=torch.int32, device=device),
        d_offsets[-1],
        torch.tensor(cum, dtype=torch.int64, device=device),
        max(int(cum[-1]).bit_length(), 1),
    )


def pool_sum(weights: torch.Tensor, args: TableArgs, ids: torch.Tensor, offsets: torch.Tensor,
             per_sample_weights: torch.Tensor | None) -> torch.Tensor:
    """``(bags, total_d)``: every table's bag sums side by side (fbgemm's forward, one call)."""
    return torch.ops.fbgemm.split_embedding_codegen_forward_cpu(
        weights, args.weights_offsets, args.d_offsets, args.total_d, args.hash_size_cumsum, ids, offsets, POOL_SUM,
        per_sample_weights, OUTPUT_FP32,
    )


def dense_grad(grad: torch.Tensor, packed: TableArgs, ids: torch.Tensor, offsets: torch.Tensor,
               per_sample_weights: torch.Tensor | None, numel: int) -> torch.Tensor:
    """Every table's dense weight gradient, back to back at ``packed``'s offsets (``numel`` elements)."""
    scratch = torch.empty(numel, dtype=torch.float32, device=grad.device)  # shape and dtype only: never read
    return torch.ops.fbgemm.split_embedding_backward_codegen_dense_cpu(
        grad, scratch, packed.weights_offsets, packed.d_offsets, packed.total_d, packed.hash_size_cumsum,
        packed.hash_bits, ids, offsets, POOL_SUM, per_sample_weights,
    )


@functools.lru_cache(maxsize=64)
def _learning_rate(lr: float) -> torch.Tensor:
    return torch.tensor(lr, dtype=torch.float32)


@functools.lru_cache(maxsize=64)
def _on_host(tables: int) -> torch.Tensor:
    """Every table's placement: in host memory (read only by the kernels)."""
    return torch.full((tables,), HOST, dtype=torch.int32)


def update(kind: str, weights: torch.Tensor, args: TableArgs, grad: torch.Tensor, ids: torch.Tensor,
           offsets: torch.Tensor, per_sample_weights: torch.Tensor | None, momentum: torch.Tensor | None,
           momentum_offsets: torch.Tensor | None, lr: float, eps: float) -> None:
    """The fused update of every table of one call, in place (``kind`` in :data:`UPDATE_KINDS`).

    ``grad``: ``(bags, total_d)`` with unit column stride (rows may be strided); ``momentum``: the flat
    state buffer with each table's first element at ``momentum_offsets``.
    """
    place = _on_host(args.weights_offsets.numel())
    common = (grad, weights, place, args.weights_offsets, args.d_offsets, args.total_d, args.hash_size_cumsum,
              args.hash_bits, ids, offsets, POOL_SUM, per_sample_weights, False)
    rate = _learning_rate(lr)
    if kind == "sgd":
        torch.ops.fbgemm.split_embedding_backward_codegen_sgd_cpu(*common, rate)
        return
    op = (torch.ops.fbgemm.split_embedding_backward_codegen_adagrad_cpu if kind == "adagrad"
          else torch.ops.fbgemm.split_embedding_backward_codegen_rowwise_adagrad_cpu)
    op(*common, momentum, place, momentum_offsets, rate, eps=eps)
