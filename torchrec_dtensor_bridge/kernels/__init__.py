"""The kernel layer: the bottom of the lookup stack (lookup -> optim -> kernels; nothing here imports up).

Modules, bottom up: ``build`` (compiles ``cpu_kernels.c`` into the per-user cache), ``native`` (this
package's C kernels through ctypes, every argument checked), ``fbgemm`` (the only ``fbgemm_gpu`` import),
``impl`` (the implementations over one argument form), ``choose`` (which implementation runs, one place per
op and device, calibrated on the machine at hand), ``ops`` (the ``torch.ops.tdb`` ops with fake kernels).

Steps of a kernel call from a lookup:

1. The caller asks :func:`accepts` whether a shard can go through the ops (fp32, contiguous, on CPU, or on
   CUDA with fbgemm's CUDA build and rows its kernels can read); MAX pooling and other shards use torch
   directly.
2. It calls ``torch.ops.tdb.pool_sum`` / ``pool_sum_backward`` / ``sparse_update`` once per storage.
3. The op checks its arguments, asks :mod:`.choose` for the implementation, and runs it.
"""

from __future__ import annotations

import torch

from . import fbgemm, ops  # noqa: F401 - ops registers torch.ops.tdb
from .choose import calibrated, choice_code, dense_impl, pool_impl, settle, update_impl
from .impl import Impl, add_bag_grads

__all__ = ["Impl", "accepts", "add_bag_grads", "calibrated", "choice_code", "dense_impl", "pool_impl", "settle", "update_impl"]


def accepts(shard: torch.Tensor) -> bool:
    """Whether ``shard`` can be looked up and updated through the ops (whatever runs underneath): on CUDA,
    only where fbgemm's CUDA kernels can read its rows (:func:`.fbgemm.fits`: 16-byte aligned)."""
    return (shard.dtype == torch.float32 and shard.dim() == 2 and shard.is_contiguous()
            and (shard.device.type == "cpu" or (shard.device.type == "cuda" and fbgemm.cuda_available()
                                                 and fbgemm.fits(shard, [0], [shard.shape[1]]))))
