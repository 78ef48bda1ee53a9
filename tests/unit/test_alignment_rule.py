"""The alignment rule of ``kernels/limits.py`` against its source: what fbgemm's CUDA kernels load and store of a row.

fbgemm_gpu's TBE kernels read each row into, and write it from, a ``Vec4T`` (``fbgemm_gpu/include/fbgemm_gpu/utils/
vec4.cuh``) four elements at a time, at ``weights + weights_offsets[t] + id * D``:

* ``Vec4T<float>::load(const float* p)``: ``acc = *((const float4*)p)`` - one 16-byte load (``store``: a ``float4``);
* ``load(const at::Half* p)``: ``asm("ld.global.v2.u32 ...")`` - two 32-bit words, one 8-byte load (``store``:
  ``Half4::store``, ``st.v2.u32``);
* ``load(const at::BFloat16* p)``: ``acc.x = p[0]; ... acc.w = p[3]`` - element by element (``store`` likewise).

And its training module: ``assert embedding_dim % 4 == 0`` (``split_table_batched_embeddings_ops_training.py``).
So a table can be handed to those kernels iff its columns are a multiple of 4 and its first element's address is
a multiple of the load's width (then every row's is: 4 columns are a whole number of loads). The expectation below
is written from those lines; the rule is ``limits.misfit``, over real CPU buffers whose views start at every
alignment.
"""

from __future__ import annotations

import pytest
import torch

from torchrec_dtensor_bridge.kernels import limits

SOURCE_WIDTH = {  # bytes fbgemm's Vec4T loads and stores at once (vec4.cuh, quoted in the module docstring)
    torch.float32: 16,  # float4
    torch.float16: 8,  # ld.global.v2.u32 / st.v2.u32
    torch.bfloat16: 2,  # p[0] .. p[3], one element at a time
}
DIM_MULTIPLE = 4  # assert embedding_dim % 4 == 0


def _fbgemm_takes(start_byte: int, dims: list[int], width: int) -> bool:
    return all(d % DIM_MULTIPLE == 0 for d in dims) and start_byte % width == 0


@pytest.mark.parametrize("dtype", list(SOURCE_WIDTH), ids=["fp32", "fp16", "bf16"])
def test_rule_is_the_vector_width(dtype):
    width = SOURCE_WIDTH[dtype]
    assert limits.VECTOR_BYTES[dtype] == width
    buffer = torch.empty(256, dtype=dtype)
    size = buffer.element_size()
    assert buffer.data_ptr() % 64 == 0, "torch's CPU allocations are 64-byte aligned"
    for skip in range(16 // size):  # the view starts `skip` elements into the buffer
        view = buffer[skip:]
        for offset in range(8):
            for dims in ([4], [8], [6], [4, 12], [4, 2]):
                at = [offset + 16 * k for k in range(len(dims))]  # tables 16 elements apart: a whole number of loads
                start = view.data_ptr() + offset * size
                want = _fbgemm_takes(start, dims, width)
                got = limits.misfit(view, at, dims)
                assert (got is None) == want, (dtype, skip, offset, dims, got)


def test_half_rows_eight_bytes_in_are_taken():
    """fp16 rows 8 bytes into a 16-byte aligned buffer (a shard four elements into a fused buffer): fbgemm loads 8
    bytes of them at once, so its kernels take them; 4 bytes in they do not."""
    buffer = torch.empty(64, dtype=torch.float16)
    assert limits.fits(buffer[4:], [0], [8]) and limits.fits(buffer, [4], [8])
    assert not limits.fits(buffer[2:], [0], [8]) and not limits.fits(buffer, [2], [8])
    bf16 = torch.empty(64, dtype=torch.bfloat16)
    assert limits.fits(bf16[1:], [0], [8])  # element by element
    fp32 = torch.empty(64)
    assert limits.fits(fp32[2:], [2], [8]) and not limits.fits(fp32[2:], [0], [8])  # the address, not the offset


def test_buffer_the_caller_allocates():
    """``weights=None``: an fp32 buffer of the caller's (the dense gradient's), aligned: the offsets decide."""
    assert limits.misfit(None, [0, 8], [8, 4]) is None
    assert "16-byte aligned" in str(limits.misfit(None, [0, 6], [4, 4]))
    assert "16-byte aligned" in str(limits.misfit(None, [0], [6]))
