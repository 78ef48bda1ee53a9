"""Embedding lookups on DTensor-sharded tables: the kernel layer (:mod:`..kernels`) locally, torch.distributed
between ranks.

One forward and backward with a :class:`..FusedOptimizer`, in reading order (ten files):

1. ``tables`` / ``functional`` - the public functions (several tables in one call / one table);
2. ``plan`` - what a lookup needs: a batch in canonical form, each weight resolved once at the API edge
   (layout, local shards, the call's group, strategy), the per-table plan;
3. ``validate`` - argument checks and the agreement step (on :mod:`..agreement`);
4. ``run`` - what every lookup shares once validated: the ids' exchange, ``max_norm``, the plans;
5. ``route`` and ``exchange`` - which ids go to which rank; the collectives for uneven batches;
6. ``algorithms`` - the autograd Function: forward and backward, step by step;
7. ``columns`` / ``rows`` / ``replicas`` - each layout family's communication (blocks spanning all rows,
   row cuts, replicated copies);
8. ``local`` - this rank's work through the kernel ops (:mod:`..kernels.ops`), one kernel call per storage;
9. ``optimizer_step`` - backward with a fused optimizer (the update math is :mod:`..optim`'s).

Beside them: ``psw`` (the per-sample weights' gradient) and ``renorm`` (``max_norm``).
"""

from .functional import sharded_embedding, sharded_embedding_bag
from .tables import sharded_embedding_bags

__all__ = ["sharded_embedding", "sharded_embedding_bag", "sharded_embedding_bags"]
