"""torchrec_dtensor_bridge: TorchRec sharded embedding tables as DTensors, zero-copy.

Public API (the README's API tour)::

    import torchrec_dtensor_bridge as tdb
    dt = tdb.to_dtensor(sharded_tensor)      # zero-copy, every TorchRec layout
    st = tdb.to_sharded_tensor(dt)           # the inverse, same storage
    w = tdb.full_tensor(dt)                  # collective; the whole table
    tdb.visualize_sharding(dt, print=True)   # which rank holds which rows/cols
    tdb.reshard(model, plan, optimizers=[opt])  # collective; a running job to another plan
"""

from . import checkpoint
from .convert import (
    full_tensor,
    layout_of,
    state_dict_to_dtensor,
    state_dict_to_sharded_tensor,
    storage_metadata,
    to_dtensor,
    to_sharded_tensor,
)
from .layout import LayoutKind, ShardLayout, ShardSpec
from .lookup import sharded_embedding, sharded_embedding_bag, sharded_embedding_bags
from .optim import FusedOptimizer
from .resharding import reshard
from .sharding import shard_module
from .state_dict import enable_dtensor_state_dict
from .torchrec_plan import check_plan_ranks
from .torchrec_tracking import track_changed_rows
from .visualize import visualize_sharding
from .wrapper import LocalShardsWrapper

__all__ = [
    "FusedOptimizer",
    "LayoutKind",
    "LocalShardsWrapper",
    "ShardLayout",
    "ShardSpec",
    "check_plan_ranks",
    "checkpoint",
    "enable_dtensor_state_dict",
    "full_tensor",
    "sharded_embedding",
    "sharded_embedding_bag",
    "sharded_embedding_bags",
    "layout_of",
    "reshard",
    "shard_module",
    "state_dict_to_dtensor",
    "state_dict_to_sharded_tensor",
    "storage_metadata",
    "to_dtensor",
    "to_sharded_tensor",
    "track_changed_rows",
    "visualize_sharding",
]
