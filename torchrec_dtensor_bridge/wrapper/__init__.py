"""LocalShardsWrapper and its op table."""

import torch

from .. import _compat
from . import elementwise as _elementwise  # noqa: F401  (fills the op table: the element-wise families)
from . import ops as _ops  # noqa: F401  (fills the op table: the ops handled by name)
from . import reductions as _reductions  # (fills the op table: reductions, the gather)
from .local_shards_wrapper import LocalShardsWrapper

for _op in (torch.ops.aten.mean.default, torch.ops.aten.mean.dim):
    _compat.route_dtensor_op(_op, _reductions.dtensor_mean)
for _op in _reductions.REDUCTIONS_OVER_GROUPS:
    _compat.route_dtensor_op(_op, _reductions.mark_reduction_group)
_compat.key_compiled_dtensors_by_local_shards()

__all__ = ["LocalShardsWrapper"]
