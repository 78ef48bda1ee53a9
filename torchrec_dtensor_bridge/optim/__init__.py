"""Optimizers applied inside the lookups' backward, on the shards' own storage.

Modules: ``optimizer`` (the public :class:`FusedOptimizer`; its kinds are the registry's,
:mod:`..optim_kinds`), ``state`` (a
table's state on this rank and its layouts), ``update`` (each kind's math on touched rows) and
``torchrec_state`` (TorchRec's fused optimizer state in and out). What backward does for a table with an
optimizer (sparse gradients, one exchange, the update) is driven from the lookups' backward (``lookup/``), which
sends the updates a one-pass kernel can make to :mod:`..kernels` and applies the others with ``update``.
This package reads the kinds' registry and imports nothing of ``kernels``.
"""

from .optimizer import FusedOptimizer

__all__ = ["FusedOptimizer"]
