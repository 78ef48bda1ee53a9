"""Embedding lookups on DTensor-sharded tables: the kernel layer (:mod:`..kernels`) locally, torch.distributed
between ranks.

One forward and backward with a :class:`..FusedOptimizer`, in reading order (five files, and the kernel
layer below them):

1. ``functional`` / ``tables`` - the public functions (one table / several tables in one call);
2. ``arguments`` - the local argument checks and the batch in canonical form (:class:`.arguments.Bags`);
   beside it ``codes``, what every rank must agree on (:class:`.codes.TableCodes`);
3. ``entry`` - the one entry path every lookup takes: resolve each weight (``resolve``), agree, route and
   exchange the ids, fix each table's plan (:mod:`.plan`: frozen parts, and the :class:`.plan.Strategy`
   interface), run;
4. ``function`` - the autograd Function: forward and backward, strategy by strategy, and backward's fused
   update where a block needs nothing from other ranks (one kernel call per storage, :mod:`..kernels`);
5. ``strategies/<one>`` - the table's way of combining shards across ranks (``whole``, ``columns``,
   ``rows``, whose routing is ``row_route``): its routing and its forward and backward exchanges.

Beside them, run only when asked for: ``dtensor_input`` (DTensor inputs), ``gradients`` (the dense
weight gradient, without a fused optimizer), ``optimizer_step`` (fused updates that need other ranks'
gradients, or the torch math), ``psw`` (the per-sample weights' gradient) and ``renorm`` (``max_norm``).
"""

from .functional import sharded_embedding, sharded_embedding_bag
from .tables import refuse_lookup, sharded_embedding_bags

__all__ = ["refuse_lookup", "sharded_embedding", "sharded_embedding_bag", "sharded_embedding_bags"]
