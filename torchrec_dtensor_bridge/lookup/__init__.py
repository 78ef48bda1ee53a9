"""Embedding lookups on DTensor-sharded tables: the kernel layer (:mod:`..kernels`) locally, torch.distributed
between ranks.

Modules: ``functional`` (the public functions), ``tables`` (several tables in one call),
``resolve`` (each weight resolved once at the API edge: layout, local shards, the
call's group - the weight's mesh - and strategy), ``bags`` (a batch in canonical form),
``run`` (what every lookup shares after validation), ``validate`` (argument checks
and the lookups' agreement step, on :mod:`..agreement`), ``plan`` (per-layout strategies and what a
lookup needs), ``algorithms`` (the autograd Function), the strategies' communication
``columns`` (blocks spanning all rows), ``rows`` (row cuts) and ``replicas``, ``psw`` (the
per-sample weights' gradient), ``local`` (this rank's work through the kernel ops, one
kernel call per storage), ``optimizer_step`` (backward with a fused optimizer),
``route`` (which ids go to which rank), ``exchange`` (collectives for uneven batches)
and ``renorm`` (``max_norm``).
"""

from .functional import sharded_embedding, sharded_embedding_bag
from .tables import sharded_embedding_bags

__all__ = ["sharded_embedding", "sharded_embedding_bag", "sharded_embedding_bags"]
