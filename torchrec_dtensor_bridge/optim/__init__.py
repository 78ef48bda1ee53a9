"""Optimizers applied inside the lookups' backward, on the shards' own storage.

Modules: ``optimizer`` (the public :class:`FusedOptimizer`), ``kinds`` (kinds and
hyper-parameters), ``state`` (a table's state on this rank and its layouts),
``update`` (the math on touched rows) and ``torchrec_state`` (TorchRec's fused
optimizer state in and out). What backward does for a table with an optimizer
(sparse gradients, one exchange, the update in one pass) is driven from
``lookup/local.py``; this package imports nothing of ``kernels``.
"""

from .optimizer import FusedOptimizer

__all__ = ["FusedOptimizer"]
