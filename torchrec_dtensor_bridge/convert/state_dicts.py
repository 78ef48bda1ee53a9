"""Zero-copy ShardedTensor <-> DTensor for whole state_dicts: every value, nested containers included."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.tensor import DTensor

from .._compat import ShardedTensor
from ..layout import LayoutKind
from .dtensor import layout_of, sharded_from_layout, to_dtensor

__all__ = ["state_dict_to_dtensor", "state_dict_to_sharded_tensor"]


def _map_state(sd: Any, fn: Any, prefix: str = "") -> Any:
    """Apply ``fn(key, value)`` to every leaf of a (nested) state_dict; keeps containers' types."""
    if isinstance(sd, Mapping):
        out = {k: _map_state(v, fn, f"{prefix}{k}.") for k, v in sd.items()}
        if type(sd) is dict:
            return out
        container: Any = type(sd)
        res = container(out)  # OrderedDict stays OrderedDict, with a module's _metadata
        if hasattr(sd, "_metadata"):
            res._metadata = sd._metadata
        return res
    if isinstance(sd, list):
        return [_map_state(v, fn, f"{prefix}{i}.") for i, v in enumerate(sd)]
    return fn(prefix[:-1], sd)


def state_dict_to_dtensor(sd: Mapping[str, Any]) -> dict[str, Any]:
    """Every ShardedTensor in ``sd`` as a DTensor (zero-copy); other values unchanged.

    Nested dicts and lists are walked, so a TorchRec fused optimizer's
    ``state_dict()`` (per-row ``momentum1`` etc.) converts too. Not collective.
    """
    return _map_state(sd, lambda k, v: to_dtensor(v, name=k) if isinstance(v, ShardedTensor) else v)


def _dtensor_to_sharded(key: str, v: Any) -> Any:
    if not isinstance(v, DTensor):
        return v
    lay = layout_of(v, name=key)  # gathered once even for TorchRec's layout-less wrapper
    return v.to_local() if lay.kind is LayoutKind.REPLICATED else sharded_from_layout(v, lay, None)


def state_dict_to_sharded_tensor(sd: Mapping[str, Any]) -> dict[str, Any]:
    """Every sharded DTensor in ``sd`` (nested containers included) as a ShardedTensor (zero-copy).

    A replicated DTensor becomes its local tensor (TorchRec keeps data-parallel
    tables as plain tensors); other values are unchanged.
    """
    return _map_state(sd, _dtensor_to_sharded)
