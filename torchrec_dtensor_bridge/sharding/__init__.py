"""``shard_module``: embedding tables of a module as DTensor-sharded parameters.

Modules: ``api`` (the entry point), ``checks`` (local checks and the
cross-rank agreement), ``scatter`` (point-to-point block scatter from the
source rank), ``modules`` (sharded forwards of ``nn.Embedding`` /
``nn.EmbeddingBag``, the class swap, the output hook) and ``ebc`` (the
forward of a TorchRec ``EmbeddingBagCollection``).
"""

from .api import shard_module

__all__ = ["shard_module"]
