"""Embedding lookups on DTensor-sharded tables: the kernel layer (:mod:`..kernels`) locally, torch.distributed
between ranks.

One forward and backward with a :class:`..FusedOptimizer`, in reading order (five files, and the kernel
layer below them):

1. ``functional`` / ``tables`` - the public functions (one table / several tables in one call); ``functional``
   also resolves each weight (its layout, shards and strategy) and the call's group, for both;
2. ``arguments`` - the local argument checks, the batch in canonical form (:class:`.arguments.Bags`) and what
   every rank must agree on (:class:`.arguments.TableCodes`);
3. ``entry`` - the one entry path every lookup takes: agree, route and
   exchange the ids, fix each table's plan (:mod:`.plan`: frozen parts, and the :class:`.plan.Strategy`
   interface), run;
4. ``function`` - the autograd Function: forward and backward, strategy by strategy, and backward's fused
   update where a block needs nothing from other ranks (one kernel call per storage, :mod:`..kernels`);
5. ``strategies/<one>`` - the table's way of combining shards across ranks (``whole``, ``columns``,
   ``rows``): its routing and its forward and backward exchanges.

Beside them, run only when asked for: ``dtensor_input`` (DTensor inputs), ``gradients`` (the dense
weight gradient, without a fused optimizer), ``optimizer_step`` (fused updates that need other ranks'
gradients, or the torch math), ``psw`` (the per-sample weights' gradient), ``renorm`` (``max_norm``),
``codes`` (the message naming what ranks disagree on), and the row strategy's ``row_max`` (max pooling) and
``row_route`` (a route by masks, where the blocks' rows do not partition the table).
"""

from .functional import sharded_embedding, sharded_embedding_bag
from .tables import refuse_lookup, sharded_embedding_bags

__all__ = ["refuse_lookup", "sharded_embedding", "sharded_embedding_bag", "sharded_embedding_bags"]
