"""``reshard``: a running model's tables and their optimizer state moved to another plan, in memory.

Modules: ``api`` (the entry point and its steps), ``tables`` (a ``shard_module`` model's tables and a plan
checked against them) and ``optimizers`` (``torch.optim`` and ``FusedOptimizer`` state moved with the
tables). The blocks that change owner travel point to point (:mod:`..convert.reshard`).
"""

from .api import reshard

__all__ = ["reshard"]
