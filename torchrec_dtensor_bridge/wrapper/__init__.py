"""LocalShardsWrapper and its op table."""

from . import ops as _ops  # noqa: F401  (fills the op table)
from .local_shards_wrapper import LocalShardsWrapper

__all__ = ["LocalShardsWrapper"]
