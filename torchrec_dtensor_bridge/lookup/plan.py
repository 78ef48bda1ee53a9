"""What one table's lookup needs, fixed before it runs: the strategy its layout allows, this rank's
shards and blocks, the batch; and a computed block's pooled output (see :mod:`.algorithms`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..layout import ShardLayout, ShardSpec
from .validate import Bags

__all__ = ["Block", "LookupPlan", "Strategy", "partial_output", "strategy_for"]


class Strategy(enum.Enum):
    """How partial results are combined across ranks (see the module docstring)."""

    LOCAL = "local"
    COLUMNS = "columns"
    REDUCE = "reduce"


def strategy_for(layout: ShardLayout, world: int) -> Strategy:
    """The cheapest correct strategy for ``layout`` on ``world`` ranks."""
    full = {s.rank for s in layout.shards if s.sizes == layout.global_shape}
    if full >= set(range(world)):
        return Strategy.LOCAL
    rows = layout.global_shape[0]
    if all(s.sizes[0] == rows for s in layout.unique_shards() if s.numel):
        return Strategy.COLUMNS
    return Strategy.REDUCE


@dataclass
class LookupPlan:
    """Everything one lookup needs, fixed before the autograd Function runs.

    Attributes:
        layout: the weight's layout.
        shards: this rank's shard tensors, in ``layout.shards_on(rank)`` order.
        batch: the bags to compute: this rank's own (``LOCAL``) or all ranks' in rank order.
        num_bags: every rank's number of bags, in rank order.
        max_mode: element-wise max instead of sum.
        padding_idx: the padding row (non-negative), or ``None``.
        skip_padding: True for bags (padding ids contribute nothing); False for an
            un-pooled lookup (the padding row is returned but gets no gradient).
        track: record what backward needs (the weight requires grad and grad mode is on).
        group: the process group.
        local_only: the batch is REPLICATED (the same on every rank, from a
            ``Replicate`` DTensor input): no exchange at all. ``LOCAL`` returns the
            rank's lookup and backward does not all-reduce (every rank already has
            the gradient of the whole batch); ``COLUMNS`` returns this rank's blocks
            side by side (``(num_bags, width of its blocks)``, to be carried as a
            ``Shard(1)`` output); ``REDUCE`` returns this rank's un-reduced partial
            ``(num_bags, dim)`` (a ``Partial()`` output). Backward uses the output
            gradient as is. Only replicated blocks (several copies of one box)
            still all-reduce their gradient.
        routed: ``batch`` holds only the ids inside this rank's computing blocks' rows
            (:mod:`.route`): a rank that computes one block pools them unfiltered.
        optimizer: the table's :class:`..optim.state.Binding` when backward applies a fused
            optimizer instead of returning a gradient.
        psw_grad: backward computes the gradient of this rank's per-sample weights.
        route: where this rank's ids went (:class:`.route.Route`), ``None`` when not routed.
        received: how many of ``batch``'s ids came from each rank (routed tables).
    """

    layout: ShardLayout
    shards: list[torch.Tensor]
    batch: Bags
    num_bags: list[int]
    max_mode: bool
    padding_idx: int | None
    skip_padding: bool
    track: bool = False
    group: dist.ProcessGroup | None = None
    local_only: bool = False
    routed: bool = False
    optimizer: Any = None
    psw_grad: bool = False
    route: Any = None
    received: tuple[int, ...] = ()
    rank: int = field(init=False)
    world: int = field(init=False)
    strategy: Strategy = field(init=False)
    mine: tuple[ShardSpec, ...] = field(init=False)
    computes: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.strategy = strategy_for(self.layout, self.world)
        self.mine = self.layout.shards_on(self.rank)
        if self.strategy is Strategy.LOCAL:
            whole = [s.sizes == self.layout.global_shape for s in self.mine]
            self.computes = [w and i == whole.index(True) for i, w in enumerate(whole)]
        else:
            first = set(self.layout.unique_shards())
            self.computes = [s in first and s.numel > 0 for s in self.mine]

    def columns_of(self, rank: int) -> list[tuple[int, int]]:
        """(first column, width) of each block ``rank`` computes, in its order (COLUMNS)."""
        first = self.layout.unique_shards()
        return [(s.offsets[1], s.sizes[1]) for s in first if s.rank == rank and s.numel]


@dataclass
class Block:
    """One computed shard: its pooled output and what its backward needs."""

    index: int
    out: torch.Tensor
    counts: torch.Tensor
    cols: tuple[int, int]
    ids: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None
    argmax: torch.Tensor | None
    positions: torch.Tensor | None = None
    """Where the block's ids sit in the plan's batch (``None``: all of them, in order)."""


def partial_output(plan: LookupPlan, blocks: list[Block], fill: float) -> torch.Tensor:
    """All bags' partial output at full width: this rank's blocks placed at their columns (``fill`` elsewhere)."""
    total, dim = plan.batch.num_bags, plan.layout.global_shape[1]
    if len(blocks) == 1 and blocks[0].cols == (0, dim) and not plan.max_mode:
        return blocks[0].out
    partial = torch.full((total, dim), fill, dtype=plan.layout.dtype, device=plan.batch.ids.device)
    for b in blocks:
        c0, w = b.cols
        if plan.max_mode:
            val = b.out.masked_fill(b.counts.unsqueeze(1) == 0, fill)
            partial[:, c0 : c0 + w] = torch.maximum(partial[:, c0 : c0 + w], val)
        else:
            partial[:, c0 : c0 + w] += b.out
    return partial
