"""Embedding lookups on DTensor-sharded tables: the kernel layer (:mod:`..kernels`) locally, torch.distributed
between ranks.

One forward and backward with a :class:`..FusedOptimizer`, in reading order:

1. ``functional`` / ``tables`` - the public functions (one table / several tables in one call);
   ``dtensor_input`` for DTensor inputs;
2. ``arguments`` - the local argument checks and the batch in canonical form (:class:`.arguments.Bags`);
3. ``entry`` - the one entry path every lookup takes: resolve each weight, agree (``agree``: what every
   rank must agree on), route and exchange the ids, fix each table's plan, run;
4. ``plan`` - what a lookup is given (frozen plan parts) and the :class:`.plan.Strategy` interface;
5. ``function`` - the autograd Function: forward and backward, strategy by strategy;
6. ``strategies`` - one module per way of combining shards across ranks (``whole``, ``columns``,
   ``rows``): each owns its routing and its forward and backward exchanges;
7. ``local`` - this rank's work through the kernel layer, one kernel call per storage;
8. ``optimizer_step`` - backward with a fused optimizer (the update math is :mod:`..optim`'s).

Beside them: ``psw`` (the per-sample weights' gradient) and ``renorm`` (``max_norm``), which run only
when asked for.
"""

from .functional import sharded_embedding, sharded_embedding_bag
from .tables import refuse_lookup, sharded_embedding_bags

__all__ = ["refuse_lookup", "sharded_embedding", "sharded_embedding_bag", "sharded_embedding_bags"]
