"""Converters: ShardedTensor <-> layout + local shards <-> DTensor <-> DCP metadata."""

from . import between_layouts as _between_layouts  # noqa: F401  (routes DTensor's copy_ between layouts)
from .dtensor import (
    dtensor_from_local_shards,
    layout_of,
    local_shards_of,
    to_dtensor,
    to_sharded_tensor,
)
from .gather import full_tensor, storage_metadata
from .metadata import (
    layout_from_sharded_tensor,
    layout_from_storage_metadata,
    layout_to_sharded_tensor_metadata,
    layout_to_storage_metadata,
)
from .placements import layout_from_placements, placement_for_layout
from .reshard import copy_into
from .state_dicts import state_dict_to_dtensor, state_dict_to_sharded_tensor

__all__ = [
    "copy_into",
    "dtensor_from_local_shards",
    "full_tensor",
    "layout_from_placements",
    "layout_from_sharded_tensor",
    "layout_from_storage_metadata",
    "layout_of",
    "layout_to_sharded_tensor_metadata",
    "layout_to_storage_metadata",
    "local_shards_of",
    "placement_for_layout",
    "state_dict_to_dtensor",
    "state_dict_to_sharded_tensor",
    "storage_metadata",
    "to_dtensor",
    "to_sharded_tensor",
]
