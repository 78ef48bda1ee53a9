"""The limits of fbgemm's split-table-batched CUDA kernels: what a call the ops accept can still break there.

Read from fbgemm_gpu 1.8's sources (``codegen/training/forward/embedding_forward_split_template.cu``,
``codegen/training/backward/embedding_backward_split_template.cu``); :mod:`.ops` and :mod:`.calls` send work
that breaks one to torch's implementation before anything runs. Nothing here imports ``fbgemm_gpu``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ALIGN", "MAX_D", "MAX_NUMEL", "VECTOR_BYTES", "batch_misfit", "fits", "misfit"]

ALIGN = 4
"""fbgemm's CUDA kernels read and write rows four elements at a time (its ``Vec4T``): every table's columns a
multiple of this (its training module: ``assert embedding_dim % 4 == 0``; its forward: ``TORCH_CHECK(total_D % 4
== 0)``)."""
VECTOR_BYTES = {torch.float32: 16, torch.float16: 8, torch.bfloat16: 2}
"""How many bytes of a row of each weights' dtype fbgemm's CUDA kernels load or store at once, the alignment
each table's first element needs (rows then keep it: ``ALIGN`` columns are a whole number of loads). From
``fbgemm_gpu/include/fbgemm_gpu/utils/vec4.cuh``, the ``Vec4T`` its kernels' rows are read into and written from:
fp32 as one ``float4`` (``*((const float4*)p)``, 16 bytes); fp16 as two 32-bit words (``ld.global.v2.u32``, and
``Half4::store``'s ``st.v2.u32``: 8 bytes); bf16 element by element (``acc.x = p[0]; ... p[3]``: 2 bytes, its
own size)."""
MAX_D = 2048
"""The widest table fbgemm's CUDA kernels take (``max_embedding_dim`` of its code generator)."""
MAX_NUMEL = 2**31 - 1
"""int32's largest value: fbgemm's CUDA kernels read the ids and the bag boundaries through 32-bit accessors,
and sort and scan them with CUB, which counts its items in an ``int``."""


def misfit(weights: torch.Tensor | None, offsets: Sequence[int], dims: Sequence[int], *, bags: int | None = None,
           ids: int | None = None) -> str | None:
    """The first limit of fbgemm's CUDA kernels that a call over tables at element ``offsets`` of ``weights``
    with ``dims`` columns breaks, named (``None`` when it breaks none); with ``bags`` (per table) and ``ids``
    (in all), the limits of its batch too. ``weights=None``: a buffer the caller allocates (aligned).

    These are the checks of fbgemm_gpu 1.8's split-table-batched forward and backward
    (``codegen/training/forward/embedding_forward_split_template.cu``,
    ``codegen/training/backward/embedding_backward_split_template.cu``) that a call the ops accept can still
    fail; the ops send such work to torch's implementation (pooling, the dense gradient) before anything runs,
    or refuse it (an update: :func:`.calls.update_supported` keeps such shards from it). What fbgemm checks
    besides (int32/int64 ids and boundaries of one dtype, fp32 weights, every tensor on one GPU, the learning
    rate on the CPU, at least one table) the ops' own argument checks already require.

    Example::

        >>> misfit(None, [0], [4096])
        'a table of 4096 columns (fbgemm: max_D <= 2048)'
        >>> misfit(torch.empty(12, dtype=torch.float16)[4:], [0], [8])  # 8 bytes in: fp16 rows read 8 at once
    """
    total = sum(dims)
    if total <= 0:  # forward: TORCH_CHECK_GT(total_D, 0)
        return f"no columns (fbgemm: total_D > 0, got {total})"
    if max(dims) > MAX_D:  # forward and backward: TORCH_CHECK_LE(max_D, {{ max_embedding_dim }}), 2048
        return f"a table of {max(dims)} columns (fbgemm: max_D <= {MAX_D})"
    # every kernel loads and stores rows as Vec4T from weights + weights_offsets[t] + idx * D: the columns a
    # multiple of 4, and each table's first element at a multiple of the dtype's vector width (VECTOR_BYTES)
    if weights is None:  # a buffer the caller allocates (fp32, aligned): the offsets alone
        width, starts, where = VECTOR_BYTES[torch.float32], [o * 4 for o in offsets], "an aligned fp32 buffer"
    else:
        width = VECTOR_BYTES.get(weights.dtype, VECTOR_BYTES[torch.float32])
        starts = [weights.data_ptr() + o * weights.element_size() for o in offsets]
        where = f"a {weights.dtype} buffer at byte {weights.data_ptr() % 64} mod 64"
    if any(d % ALIGN for d in dims) or any(a % width for a in starts):
        return (f"rows not {width}-byte aligned (fbgemm reads {width} bytes of a row at once: dims {list(dims)} "
                f"must be multiples of {ALIGN} and each table's first element {width}-byte aligned, got element "
                f"offsets {list(offsets)} of {where})")
    return batch_misfit(len(dims), 0 if bags is None else bags, 0 if ids is None else ids)


def batch_misfit(tables: int, bags: int, ids: int) -> str | None:
    """The first limit of fbgemm's CUDA kernels that a batch of ``bags`` bags for each of ``tables`` tables
    and ``ids`` ids in all breaks, named; ``None`` when it breaks none (part of :func:`misfit`)."""
    if ids >= MAX_NUMEL:
        # PTA_B(indices, index_t, 1, 32): "numel needs to be smaller than int32_t max"; transpose_embedding_input:
        # TORCH_CHECK_LT(t_in.numel(), std::numeric_limits<int32_t>::max())
        return f"{ids} ids (fbgemm: fewer than {MAX_NUMEL})"
    if tables * bags + 1 > MAX_NUMEL:
        # PTA_B(offsets, index_t, 1, 32). It also keeps B within the bits fbgemm packs it in beside the table
        # (TORCH_SYM_CHECK(max_B_.sym_le(info_B_mask)), get_info_B_num_bits_from_T; adjust_info_B_num_bits for
        # the dense gradient): with T of n bits, T >= 2**(n - 1), so T * B < 2**31 gives B < 2**(32 - n)
        return f"{tables} x {bags} bags (fbgemm: at most {MAX_NUMEL} bag boundaries in all)"
    return None


def fits(weights: torch.Tensor, offsets: Sequence[int], dims: Sequence[int]) -> bool:
    """Whether fbgemm's CUDA kernels can take the tables of ``weights`` at element ``offsets`` with ``dims``
    columns, whatever the batch (:func:`misfit`: rows aligned for its vector loads, at most :data:`MAX_D` columns)."""
    return misfit(weights, offsets, dims) is None
