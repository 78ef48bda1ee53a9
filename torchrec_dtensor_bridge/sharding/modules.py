"""Sharded forwards for ``nn.EmbeddingBag`` and ``nn.Embedding``, installed by swapping the class.

A sharded module keeps its identity, attributes, parameter names and
``isinstance`` checks: its ``__class__`` becomes a cached subclass of its own
class (``ShardedEmbeddingBag`` for ``nn.EmbeddingBag``, and so on) whose only
change is ``forward`` - the same technique as ``torch.nn.utils.parametrize``.
A wrapper module would rename every parameter (``weight`` ->
``module.weight``) and break state_dict keys; an instance-level
``types.MethodType`` forward would leave the module's type claiming the stock
forward and put a self-reference in its ``__dict__``. Like parametrized modules, a sharded module cannot
be pickled as a whole (its class is made at run time); its state_dict can.

Outputs: by default each rank gets the output of its own batch (the local
part, a plain tensor). With ``gather_output=True`` every rank gets the
outputs of all ranks' batches in rank order (see :func:`gather_output`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..lookup import sharded_embedding, sharded_embedding_bag
from ..collectives import gather_rows, reduce_scatter_rows

__all__ = [
    "GATHER_OUTPUT_ATTR", "GROUP_ATTR", "forward_for", "gather_output", "group_of", "install_forward",
    "is_sharded_class",
]

GATHER_OUTPUT_ATTR = "_tdb_gather_output"
"""Instance attribute telling a sharded module to gather its output (see :func:`gather_output`)."""

GROUP_ATTR = "_tdb_process_group"
"""Instance attribute holding the process group of the mesh a module was sharded on: its lookups and
output gathers run there (``None``: the default group)."""

_SHARDED_CLASSES: dict[type, type] = {}


class _GatherRows(torch.autograd.Function):
    """All ranks' rows in rank order; backward sums every rank's gradient of this rank's rows."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        n = torch.tensor([local.shape[0]], dtype=torch.int64, device=local.device)
        counts_t = [torch.empty_like(n) for _ in range(dist.get_world_size(group))]
        dist.all_gather(counts_t, n, group=group)
        counts = [int(c.item()) for c in counts_t]
        ctx.counts, ctx.group = counts, group
        return gather_rows(local.contiguous(), counts, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return reduce_scatter_rows(grad.contiguous(), ctx.counts, ctx.group, dist.ReduceOp.SUM), None


def gather_output(local: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's ``local`` (first dim = that rank's batch) concatenated in rank order; *collective*
    over ``group`` (the module's mesh group; ``None``: the default group).

    The output "resharded" from per-rank batches to a full copy on every rank.
    Differentiable: the gradient of a rank's rows is the sum of the gradients
    every rank computed for them (one ``reduce_scatter``), matching the
    convention that the loss is the sum of the ranks' losses.
    """
    return _GatherRows.apply(local, group)


def group_of(module: nn.Module) -> dist.ProcessGroup | None:
    """The process group a sharded module's collectives run on."""
    return getattr(module, GROUP_ATTR, None)


def _finish(module: nn.Module, out: torch.Tensor) -> torch.Tensor:
    return gather_output(out, group_of(module)) if getattr(module, GATHER_OUTPUT_ATTR, False) else out


def _embedding_bag_forward(
    self: nn.EmbeddingBag,
    input: torch.Tensor,
    offsets: torch.Tensor | None = None,
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``nn.EmbeddingBag.forward`` on the sharded weight; *collective* (each rank passes its own batch)."""
    out = sharded_embedding_bag(
        input,
        self.weight,  # a DTensor parameter
        offsets,
        mode=self.mode,
        per_sample_weights=per_sample_weights,
        padding_idx=self.padding_idx,
        include_last_offset=self.include_last_offset,
        max_norm=self.max_norm,
        norm_type=self.norm_type,
        process_group=group_of(self),
    )
    return _finish(self, out)


def _embedding_forward(self: nn.Embedding, input: torch.Tensor) -> torch.Tensor:
    """``nn.Embedding.forward`` on the sharded weight; *collective* (each rank passes its own ids)."""
    weight = self.weight  # a DTensor parameter
    out = sharded_embedding(input, weight, self.padding_idx, self.max_norm, self.norm_type,
                            process_group=group_of(self))
    return _finish(self, out)


def is_sharded_class(cls: type) -> bool:
    return cls in _SHARDED_CLASSES.values()


def install_forward(module: nn.Module, forward: Callable[..., Any]) -> None:
    """Swap ``module``'s class for a cached subclass whose ``forward`` is ``forward``."""
    cls = type(module)
    if is_sharded_class(cls):
        return
    sub = _SHARDED_CLASSES.get(cls)
    if sub is None:
        sub = type(f"Sharded{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})
        _SHARDED_CLASSES[cls] = sub
    module.__class__ = sub


def forward_for(module: nn.Module) -> Callable[..., Any]:
    """The sharded forward of an ``nn.EmbeddingBag`` or ``nn.Embedding`` (or a subclass)."""
    return _embedding_bag_forward if isinstance(module, nn.EmbeddingBag) else _embedding_forward
