"""Local pooled lookups on one shard: this package's CPU kernels, else fbgemm_gpu's TBE kernels (the only
fbgemm import), else torch.

This package's own kernels (:mod:`.native`, ``cpu_kernels.c``) serve a sum
over a contiguous fp32 CPU shard and the fused optimizers' updates whenever
they could be built (:func:`select_kernel`): the pooled sum adds in the same
order as fbgemm's forward (the same bits) and is 5-8% faster out of cache (it
prefetches each row's two end cache lines only); the updates are 1.8-4.4x
faster than fbgemm's (BENCHMARKS.md). fbgemm's kernels below are the
fallback, and fbgemm's dense backward serves the un-fused weight gradient.

Which fbgemm entry point, and why:

* ``SplitTableBatchedEmbeddingBagsCodegen`` (the training TBE) owns its weights:
  it allocates one flat ``weights_host``/``weights_dev`` buffer for all of its
  tables and fuses an optimizer step into backward. It cannot look up rows of
  storage it does not own without copying the shard into its buffer, and it
  hands out no weight gradient. Unusable for a DTensor's shards.
* ``torch.ops.fbgemm.dense_embedding_codegen_lookup_function`` (what
  ``DenseTableBatchedEmbeddingBagsCodegen`` calls) takes the weights as an
  argument and is differentiable, but on CPU it has no autograd kernel
  registered: torch warns that backpropagating through it "may lead to
  silently incorrect behavior" and that this will stop working.
* So the CPU kernels underneath are called directly:
  ``split_embedding_codegen_forward_cpu`` (forward) and
  ``split_embedding_backward_codegen_dense_cpu`` (the dense weight gradient),
  both over ``shard.view(-1)``: the shard's own storage, no copy (the backward
  kernel takes the weights as ``Tensor(a!)`` but does not write them; tested).
  The caller's autograd Function wires them together.
* With a fused optimizer, ``split_embedding_backward_codegen_{sgd,rowwise_adagrad,
  adagrad}_cpu`` (the kernels under the training TBE's backward) take the shard
  (``host_weights``) and its momentum as in-place arguments: backward sums each
  touched row's gradient and updates the row in one pass, with no gradient
  tensor at all (:func:`update_rows`). fbgemm_gpu-cpu 1.8 builds no CPU Adam
  backward, and its row-wise Adagrad kernel ignores ``weight_decay``.

One fused call for all of a rank's shards would need the shards to live in ONE
buffer (the kernels address tables by offset into a single weight tensor); the
shards of a DTensor are separate allocations, so each shard gets its own call.

fbgemm's pooling modes are SUM, MEAN and NONE: there is no MAX. ``mode="max"``
runs ``torch.embedding_bag`` on the shard instead (also zero-copy) and keeps
its arg-max rows for backward. Shards that are not fp32, not contiguous or not
on CPU, and hosts without fbgemm_gpu, use torch for SUM too (the CUDA TBE path
is not wired up: this project's CI has no GPU to test it). MEAN is never asked
of the kernel: a sharded mean must sum first and divide by the global bag size
after the cross-rank reduction.

Measured on this 2-core CPU (one thread; 200,000 x 64 fp32 rows, 2048 bags of
20, SUM; the machine was shared, so numbers swing by 2x between runs): forward
TBE 0.45-0.53 ms (19-23 GB/s of rows) vs ``torch.embedding_bag`` 0.50-1.8 ms
(6-21 GB/s); backward TBE 24-33 ms vs torch ``index_add_`` 30-46 ms, both
dominated by zero-filling the dense 51 MB gradient (~40 ms alone when busy).
Outputs equal to the last bit; gradients within 1.2e-7.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch

from . import native

__all__ = [
    "KERNEL_NATIVE", "KERNEL_TBE", "KERNEL_TORCH", "pool_rows", "pool_rows_backward", "select_kernel", "tbe_available",
]

KERNEL_NATIVE = "native"  # this package's cpu_kernels.c (lookup/native.py)
KERNEL_TBE = "fbgemm_tbe"
KERNEL_TORCH = "torch_embedding_bag"

_POOL_SUM = 0  # fbgemm_gpu PoolingMode.SUM
_OUTPUT_FP32 = 0  # fbgemm_gpu SparseType.FP32.as_int()


@functools.lru_cache(maxsize=1)
def _fbgemm() -> ModuleType | None:
    try:
        import fbgemm_gpu  # noqa: F401 - registers torch.ops.fbgemm
    except ImportError:
        return None
    return fbgemm_gpu


def tbe_available() -> bool:
    """True when fbgemm_gpu (CPU or CUDA build) is importable."""
    return _fbgemm() is not None and hasattr(torch.ops.fbgemm, "split_embedding_codegen_forward_cpu")


def select_kernel(weight: torch.Tensor, max_mode: bool) -> str:
    """The kernel :func:`pool_rows` uses for ``weight`` (see the module docstring): for a sum over a
    contiguous fp32 CPU shard this package's own (:mod:`.native`) when it could be built, else fbgemm's
    TBE kernel when fbgemm_gpu is installed; torch's ``embedding_bag`` otherwise."""
    if max_mode or weight.dtype != torch.float32 or weight.device.type != "cpu" or not weight.is_contiguous():
        return KERNEL_TORCH
    if native.kernel() is not None:
        return KERNEL_NATIVE
    return KERNEL_TBE if tbe_available() else KERNEL_TORCH


def _table_args(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, dim = weight.shape
    dev = weight.device
    return (
        torch.zeros(1, dtype=torch.int64, device=dev),  # weights_offsets: one table at 0
        torch.tensor([0, dim], dtype=torch.int32, device=dev),  # D_offsets
        torch.tensor([0, rows], dtype=torch.int64, device=dev),  # hash_size_cumsum
    )


def pool_rows(
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    *,
    max_mode: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sum (or max) of ``weight`` rows per bag; no autograd graph (see :func:`pool_rows_backward`).

    Args:
        weight: a 2-D shard (its real storage is read, never copied).
        ids: int64 row numbers inside ``weight``.
        offsets: ``num_bags + 1`` int64 bag boundaries into ``ids``.
        per_sample_weights: one factor per id (SUM only), or ``None``.
        max_mode: element-wise maximum instead of the sum; an empty bag gives 0.

    Returns:
        The ``(num_bags, dim)`` output, and for max the arg-max row of every
        (bag, column) (``None`` for a sum).
    """
    with torch.no_grad():
        kernel = select_kernel(weight, max_mode)
        if kernel == KERNEL_NATIVE:
            fast = native.kernel()
            assert fast is not None
            return fast.pool_sum(weight, ids, offsets, per_sample_weights), None
        if kernel == KERNEL_TORCH:
            out, _, _, argmax = torch.embedding_bag(
                weight, ids, offsets, False, 2 if max_mode else 0, False, per_sample_weights, True
            )
            return out, (argmax if max_mode else None)
        w_off, d_off, hash_cumsum = _table_args(weight)
        out = torch.ops.fbgemm.split_embedding_codegen_forward_cpu(
            weight.view(-1), w_off, d_off, weight.shape[1], hash_cumsum, ids, offsets, _POOL_SUM,
            per_sample_weights, _OUTPUT_FP32,
        )
        return out, None


def pool_rows_backward(
    grad: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    argmax: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dense gradient of ``weight`` for :func:`pool_rows`, given the output gradient.

    For max, ``grad`` must already be zero where this shard's row is not the
    one that wins (the caller knows the cross-rank winner).
    """
    grad = grad.contiguous()
    if argmax is not None:
        out = torch.zeros_like(weight)
        return out.scatter_add_(0, argmax.clamp(min=0), grad.to(weight.dtype))
    if select_kernel(weight, False) == KERNEL_TORCH or not tbe_available():
        lengths = offsets[1:] - offsets[:-1]
        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=ids.device), lengths, output_size=ids.numel())
        rows = grad.index_select(0, bag)
        if per_sample_weights is not None:
            rows = rows * per_sample_weights.unsqueeze(1)
        return torch.zeros_like(weight).index_add_(0, ids, rows.to(weight.dtype))
    w_off, d_off, hash_cumsum = _table_args(weight)
    flat = torch.ops.fbgemm.split_embedding_backward_codegen_dense_cpu(
        grad, weight.view(-1), w_off, d_off, weight.shape[1], hash_cumsum,
        max(int(weight.shape[0]).bit_length(), 1), ids, offsets, _POOL_SUM, per_sample_weights,
    )
    return flat.view(weight.shape)



_HOST = 3  # fbgemm_gpu EmbeddingLocation.HOST
_UPDATE_KERNELS = {"sgd": "sgd", "rowwise_adagrad": "rowwise_adagrad", "adagrad": "adagrad"}
"""Optimizer kinds (``OptimKind.value``) with a CPU backward-with-optimizer kernel in fbgemm_gpu-cpu 1.8
(Adam has none: ``split_embedding_backward_codegen_adam_cpu`` is not built for CPU); :mod:`.native` has
these and Adam (:data:`_NATIVE_KINDS`)."""
_NATIVE_KINDS = {"sgd": native.SGD, "rowwise_adagrad": native.ROWWISE_ADAGRAD, "adagrad": native.ADAGRAD,
                 "adam": native.ADAM}


def update_rows_supported(bind: Any, plan: Any, block: Any) -> bool:
    """Whether a one-pass update kernel (:func:`update_rows`) can update ``block``'s shard.

    It can when the shard's update needs nothing from other ranks (the caller
    checks that), the lookup is a sum (no arg-max), the shard is a contiguous
    fp32 CPU tensor, the kind has a kernel (SGD, the Adagrads; Adam in this
    package's only), and an un-pooled lookup's padding row is not in the shard
    (the kernel would train it).

    Weight decay: this package's kernel applies it (:mod:`..optim.update`'s
    semantics, fbgemm's GPU ones). The CPU row-wise Adagrad kernel of
    fbgemm_gpu-cpu 1.8 takes ``weight_decay`` / ``weight_decay_mode`` but
    ignores them (measured: L2 and decoupled give the same rows and momentum as
    no decay), and its SGD / Adagrad kernels take none; so without our kernel a
    decaying optimizer runs :mod:`..optim.update` on the touched rows.
    """
    hyper = bind.hyper
    shard = plan.shards[block.index]
    if block.argmax is not None or select_kernel(shard, False) == KERNEL_TORCH:
        return False
    if native.kernel() is None:  # fbgemm's kernels: three kinds, no weight decay
        if hyper.kind.value not in _UPDATE_KERNELS or hyper.weight_decay:
            return False
    elif hyper.kind.value not in _NATIVE_KINDS:
        return False
    if not plan.skip_padding and plan.padding_idx is not None:
        spec = plan.mine[block.index]
        if spec.offsets[0] <= plan.padding_idx < spec.offsets[0] + spec.sizes[0]:
            return False
    return block.weights is None or block.weights.dtype == torch.float32


@functools.lru_cache(maxsize=64)
def _learning_rate(lr: float) -> torch.Tensor:
    return torch.tensor(lr, dtype=torch.float32)


def update_rows(bind: Any, plan: Any, block: Any, grad: torch.Tensor) -> None:
    """Apply ``bind``'s optimizer to ``block``'s shard, in place, touched rows only.

    ``grad`` is the block's output gradient (``num_bags x shard width``): each
    touched row's gradient is summed from it and the row (and its momentum)
    updated in place: the shard's own storage, no dense gradient. Only for
    blocks :func:`update_rows_supported` accepts. Runs this package's own kernel
    (:mod:`.native`: the same math, 1.8-4.4x faster than fbgemm_gpu-cpu's on large
    tables) when it could be built, else fbgemm's backward-with-optimizer kernel.
    """
    hyper, state = bind.hyper, bind.table
    shard = plan.shards[block.index].detach()
    kind = hyper.kind.value
    # a column slice of the exchanged gradients is read in place: both kernels go through the row
    # stride (tested: the same rows and momentum as from a contiguous copy)
    grad = grad if grad.stride(-1) == 1 else grad.contiguous()
    momentum = momentum2 = None
    if kind in ("adagrad", "adam"):
        momentum = state.elements[block.index]["momentum1"]
        momentum2 = state.elements[block.index].get("momentum2")
    elif kind == "rowwise_adagrad":
        momentum = state.row_states[state.local_row_index(block.index)]
    fast = native.kernel()
    if fast is not None:
        with torch.profiler.record_function(f"tdb::sparse_update_{kind}"):
            fast.update(_NATIVE_KINDS[kind], shard, grad, block.ids, block.offsets, block.weights, momentum,
                        hyper.lr, hyper.eps, hyper.weight_decay, hyper.weight_decay_mode.value, state2=momentum2,
                        beta1=hyper.beta1, beta2=hyper.beta2, step=int(state.step))
        return
    assert not hyper.weight_decay, "fbgemm-gpu-cpu's kernels ignore weight decay (update_rows_supported)"
    w_off, d_off, hash_cumsum = _table_args(shard)
    place = torch.full((1,), _HOST, dtype=torch.int32)
    common = (
        grad, shard.view(-1), place, w_off, d_off, shard.shape[1], hash_cumsum,
        max(int(shard.shape[0]).bit_length(), 1), block.ids, block.offsets, _POOL_SUM, block.weights, False,
    )
    lr = _learning_rate(hyper.lr)
    if kind == "sgd":
        torch.ops.fbgemm.split_embedding_backward_codegen_sgd_cpu(*common, lr)
    elif kind == "adagrad":
        assert momentum is not None
        torch.ops.fbgemm.split_embedding_backward_codegen_adagrad_cpu(
            *common, momentum.view(-1), place, w_off, lr, eps=hyper.eps,
        )
    else:
        torch.ops.fbgemm.split_embedding_backward_codegen_rowwise_adagrad_cpu(
            *common, momentum, place, w_off, lr, eps=hyper.eps,
        )
