"""The kernel layer: the bottom of the lookup stack (it imports nothing of the package but the optimizer kinds'
registry, :mod:`..optim_kinds`, and the package's built extension, ``_C``).

Modules, bottom up: ``args`` (the ops' arguments grouped: tables, batch, state), ``native`` (this package's
C kernels: the ops of its built extension, ``torch.ops.tdb_native``, sources in ``csrc/``), ``fbgemm`` (the
only ``fbgemm_gpu`` import; beside it ``copies``: a table listed twice in one update, updated once),
``reference`` (torch's ops), ``choose`` (which implementation runs, one place per op and device, by a fixed
rule), ``ops`` (the ``torch.ops.tdb`` ops with fake kernels: the one check of their arguments, and the
dispatch to the implementations), ``calls`` (many shards at once: one op call per storage) and ``report``
(what runs where, and why: ``python -m torchrec_dtensor_bridge kernels``).

Steps of a kernel call from a lookup:

1. The caller asks :func:`accepts` whether a shard can go through the ops (fp32, contiguous, on CPU, or on
   CUDA with fbgemm's CUDA build and within its kernels' limits: at most 2048 columns, rows of a multiple of
   4 columns aligned for its vector loads (16 bytes fp32, 8 fp16), int32-sized batches -
   :func:`.limits.misfit`), and :func:`update_supported` whether its fused update can; MAX pooling and other shards use torch directly, before anything runs.
2. It hands its requests to :func:`pool`, :func:`weight_grad` and :func:`update`, which call
   ``torch.ops.tdb.pool_sum`` / ``pool_sum_backward`` / ``sparse_update`` once per storage.
3. The op groups and checks its arguments (ids only for direct callers: the lookups checked them at their
   API edge, ``ids_checked``), takes the implementation :mod:`.choose` decided, and runs it.
"""

from __future__ import annotations

from . import ops  # noqa: F401 - registers torch.ops.tdb
from .args import Batch, State, Tables
from .calls import Pooling, Update, accepts, pool, update, update_supported, weight_grad, weight_grads
from .choose import Impl, choice_code, dense_impl, pool_impl, settle, update_impl
from .fbgemm import in_unified_memory
from .reference import add_bag_grads

__all__ = [
    "Batch", "Impl", "Pooling", "State", "Tables", "Update", "accepts", "add_bag_grads", "choice_code", "dense_impl",
    "in_unified_memory", "pool", "pool_impl", "settle", "update", "update_impl", "update_supported", "weight_grad",
    "weight_grads",
]
