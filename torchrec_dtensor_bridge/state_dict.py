"""state_dict hooks: TorchRec sharded modules speak DTensor.

``enable_dtensor_state_dict(module)`` makes ``module.state_dict()`` return
DTensors for sharded tables (zero-copy views of the module's storage) and
makes ``module.load_state_dict()`` accept, per table, a DTensor or
ShardedTensor of ANY layout (resharded in memory, point to point) or a plain
full tensor (sliced locally).

The hooks wrap the two methods of the given instance, which works for
``DistributedModelParallel`` (whose ``state_dict`` bypasses module hooks) as
well as for a bare ``ShardedEmbeddingBagCollection``. Enable it on the module
you call ``load_state_dict`` on: PyTorch does not route a parent's load through
its children's ``load_state_dict``.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ._compat import ShardedTensor
from .convert import layout_of, local_shards_of, state_dict_to_dtensor
from .convert.reshard import copy_into

__all__ = ["enable_dtensor_state_dict"]

_MARK = "_tdb_dtensor_state_dict"


def enable_dtensor_state_dict(module: nn.Module) -> nn.Module:
    """Make ``module``'s state_dict DTensor-valued and its load_state_dict resharding.

    Args:
        module: a TorchRec sharded module, a ``DistributedModelParallel``, or any
            module containing them. Enabling twice is a no-op.

    Returns:
        ``module`` itself.

    Example::

        >>> model = tdb.enable_dtensor_state_dict(DistributedModelParallel(...))
        >>> sd = model.state_dict()                      # DTensors for sharded tables
        >>> other_plan_model.load_state_dict(sd)         # reshards across plans
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"enable_dtensor_state_dict expects an nn.Module, got {type(module).__name__}")
    if getattr(module, _MARK, False):
        return module
    original_state_dict = module.state_dict
    original_load = module.load_state_dict

    def state_dict(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return state_dict_to_dtensor(original_state_dict(*args, **kwargs))

    def load_state_dict(self: nn.Module, state_dict: Mapping[str, Any], strict: bool = True, **kwargs: Any) -> Any:
        own = original_state_dict()
        incoming = dict(state_dict)
        plans = []
        # Check everything before touching any destination.
        for key, value in incoming.items():
            target = own.get(key)
            if not isinstance(target, (ShardedTensor, DTensor)) or not isinstance(value, torch.Tensor):
                continue
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"load_state_dict: {key!r} has shape {list(value.shape)}, "
                                 f"the module's table is {list(target.shape)}")
            if value.dtype != target.dtype:
                raise ValueError(f"load_state_dict: {key!r} has dtype {value.dtype}, the module's table is {target.dtype}")
            plans.append((key, target, value))
        for key, target, value in plans:
            if value is target:
                continue
            copy_into(layout_of(target, name=key), local_shards_of(target), value, name=key)
            incoming[key] = target  # already filled: the module's own load copies it onto itself
        return original_load(incoming, strict=strict, **kwargs)

    module.state_dict = types.MethodType(state_dict, module)  # type: ignore[method-assign]
    module.load_state_dict = types.MethodType(load_state_dict, module)  # type: ignore[method-assign]
    setattr(module, _MARK, True)
    return module
