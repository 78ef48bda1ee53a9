"""What one table's lookup is given, fixed before it runs, and the interface of a strategy.

Types only (frozen dataclasses and one abstract class), so that reading a plan runs no code here:

1. :class:`ResolvedTable` - a weight resolved once at the API edge (:func:`.resolve.resolve_table`): its
   layout in the call group's ranks, this rank's shards, the group, its :class:`Strategy`;
2. :class:`Route` - where this rank's ids of a table go (each strategy routes its own: :meth:`Strategy.route`);
3. :class:`BatchPlan` and :class:`PoolOptions` - the bags this rank computes and how they are pooled;
4. :class:`LookupPlan` - the three above with this rank's blocks: the whole plan of one table;
5. :class:`Block` - one computed block's pooled output and what its backward needs;
6. :class:`Strategy` - how the partial results of a layout family's blocks combine across ranks. One
   module per strategy (:mod:`.strategies`); :func:`.functional.pick_strategy` is the one place that picks one.

Ranks inside a plan (``rank``, the layout's, ``num_bags``' order) are ranks of the call's group.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from ..groups import CommGroup
from ..layout import ShardLayout, ShardSpec
from ..optim.state import Binding
from .arguments import Bags

__all__ = ["Block", "BatchPlan", "LookupPlan", "PendingRoute", "PoolOptions", "ResolvedTable", "Route", "Strategy"]


@dataclass(frozen=True)
class ResolvedTable:
    """One weight of a lookup, as every layer below the API sees it.

    Attributes:
        weight: the DTensor (its gradient is built on its own mesh and placements).
        table_layout: the weight's whole layout, global ranks, with its dtype.
        layout: the call group's part of it, in group ranks (the lookup's coordinates).
        shards: this rank's shard tensors, in ``layout.shards_on(group rank)`` order.
        group: the call's group.
        strategy: how partial results combine (from ``layout`` and the group's size).
        digest: ``layout.digest()``, compared across ranks in the agreement step.
    """

    weight: DTensor
    table_layout: ShardLayout
    layout: ShardLayout
    shards: tuple[torch.Tensor, ...]
    group: CommGroup
    strategy: Strategy
    digest: int


ALL, NONE = True, False
"""A :attr:`Route.masks` entry: the destination takes every id / none."""


@dataclass(frozen=True)
class Route:
    """Where this rank's ids of one table go.

    Attributes:
        masks: per destination rank, :data:`ALL` (every id), :data:`NONE` (nothing: it computes nothing of the
            table), a boolean mask of the ids it takes, or ``None`` (some ids, given by ``positions`` and
            ``per_bag`` alone: the partition fast path, which builds no masks).
        counts: how many ids each rank receives from this one.
        positions: where a mask destination's ids are in the batch (its mask's ``nonzero``, found once).
        partition: the mask destinations take every id exactly once (their row ranges cover the table and
            no id is counted twice), so the last one's per-bag counts are the bag lengths minus the others'.
        per_bag: (when given) how many of each bag's ids go to each destination.
    """

    masks: tuple[bool | torch.Tensor | None, ...]
    counts: tuple[int, ...]
    positions: tuple[torch.Tensor | None, ...] = ()
    partition: bool = False
    per_bag: tuple[torch.Tensor | None, ...] = ()


@dataclass(frozen=True)
class PendingRoute:
    """A route that waits for its per-destination id counts: ``counts`` (int64, on the batch's device) is read
    with other tables' (:func:`.entry.resolve_routes`), then ``finish`` builds the route from the values."""

    counts: torch.Tensor
    finish: Callable[[list[int]], Route]


@dataclass(frozen=True)
class PoolOptions:
    """How one table's bags are pooled.

    Attributes:
        max_mode: element-wise max instead of sum.
        padding_idx: the padding row (non-negative), or ``None``.
        skip_padding: True for bags (padding ids contribute nothing); False for an un-pooled lookup (the
            padding row is returned but gets no gradient).
        out_dtype: the pooled output's dtype (``None``: the weight's, as ``F.embedding_bag``'s); half-precision
            tables pool in fp32 in the kernels, so ``torch.float32`` keeps that precision, as TorchRec's
            fp16 tables give fp32 outputs.
    """

    max_mode: bool
    padding_idx: int | None
    skip_padding: bool
    out_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class BatchPlan:
    """The bags one table's lookup computes on this rank.

    Attributes:
        bags: this rank's own bags (:attr:`Strategy.own_batch`, or a ``Replicate()`` batch) or every rank's
            routed to this one, in rank order.
        num_bags: every rank's number of bags, in rank order.
        replicated: the batch is the same on every rank (a ``Replicate()`` DTensor input): nothing is
            exchanged; each strategy returns this rank's part of the output (see its ``forward``), and
            backward uses the output gradient as it is (only replicated blocks still combine theirs).
        routed: ``bags`` holds only the ids inside this rank's computing blocks' rows (:mod:`.route`): a
            rank that computes one block pools them unfiltered.
        route: where this rank's ids went (:class:`.route.Route`), ``None`` when not routed.
        received: how many of ``bags``' ids came from each rank (routed tables).
    """

    bags: Bags
    num_bags: tuple[int, ...]
    replicated: bool = False
    routed: bool = False
    route: Route | None = None
    received: tuple[int, ...] = ()


@dataclass(frozen=True)
class LookupPlan:
    """Everything one table's lookup needs, fixed before the autograd Function runs.

    Attributes:
        table: the resolved weight (its layouts, shards, group, strategy).
        batch: the bags to compute.
        pooling: how they are pooled.
        rank, world: this rank and the size of the call's group.
        group: the call's torch process group (``table.group.group``).
        mine: this rank's blocks, ``table.layout.shards_on(rank)``.
        computes: per block of ``mine``, whether this rank pools it (:meth:`Strategy.computes`).
        track: record what backward needs (the weight requires grad and grad mode is on).
        optimizer: the table's optimizer binding when backward applies a fused optimizer instead of
            returning a gradient.
        psw_grad: backward computes the gradient of this rank's per-sample weights.
        call: the public call, for messages (a timeout in backward names it).
        out_dtype: the dtype of the pooled output, its exchanges and its gradient (:attr:`PoolOptions.out_dtype`,
            resolved).
    """

    table: ResolvedTable
    batch: BatchPlan
    pooling: PoolOptions
    rank: int
    world: int
    group: dist.ProcessGroup | None
    mine: tuple[ShardSpec, ...]
    computes: tuple[bool, ...]
    track: bool = False
    optimizer: Binding | None = None
    psw_grad: bool = False
    call: str = "lookup"
    out_dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class Block:
    """One computed block: its pooled output and what its backward needs.

    Attributes:
        index: the block's index in :attr:`LookupPlan.mine`.
        out: its pooled output, ``(bags, width)``.
        counts: per bag, how many of its ids the block holds.
        cols: (first column, width) of the block in the table.
        ids, offsets, weights: what it pooled (local rows, ``bags + 1`` offsets, per-sample weights).
        argmax: for max pooling, the arg-max row of every (bag, column), else ``None``.
        positions: where its ids are in the batch (``None``: all of it, in order).
    """

    index: int
    out: torch.Tensor
    counts: torch.Tensor
    cols: tuple[int, int]
    ids: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None
    argmax: torch.Tensor | None
    positions: torch.Tensor | None = None


class Strategy(abc.ABC):
    """How the partial results of one family of layouts combine across ranks.

    A lookup calls a strategy in this order, on every rank, for all tables it combines together (each
    ``plans`` / ``blocks`` argument lists the call's tables this strategy combines, in call order):

    1. :meth:`route` - before the agreement step: which of this rank's ids each rank computes with;
    2. :meth:`computes` - which of this rank's blocks it pools (the others are copies);
    3. :meth:`forward` - this rank's output of every table from the blocks every rank pooled (the forward
       exchange: the collectives of all tables fused);
    4. :meth:`backward` - each pooled block's output gradient from the tables' output gradients (the
       backward exchange);
    5. then either the fused optimizer's update, whose exchange :attr:`sums_every_rank` and the blocks'
       copies decide, or the dense gradient, whose copies :meth:`sync_grads` makes agree; and, where asked,
       the per-sample weights' gradient, sent back to the ranks the ids came from unless
       :attr:`own_batch`.

    :meth:`for_replicated_batch` answers a ``Replicate()`` batch, looked up without any exchange.
    """

    name: str = ""
    own_batch: bool = False
    """Every rank looks up its own batch on its own copy: no id travels (``max_norm`` aside)."""

    @abc.abstractmethod
    def route(self, layout: ShardLayout, bags: Bags, world: int) -> Route | PendingRoute | None:
        """Where this rank's ids go; ``None`` when none travel."""

    @abc.abstractmethod
    def computes(self, layout: ShardLayout, rank: int) -> tuple[bool, ...]:
        """Per block ``rank`` holds, whether it pools it."""

    @abc.abstractmethod
    def forward(self, plans: Sequence[LookupPlan], blocks: Sequence[list[Block]]
                ) -> tuple[list[torch.Tensor], list[list[Block]], list[list[torch.Tensor] | None]]:
        """*Collective*: per table, this rank's output; the blocks backward keeps (outputs it no longer needs
        released); for max, where each block wins (``None`` for a sum)."""

    @abc.abstractmethod
    def backward(self, plans: Sequence[LookupPlan], blocks: Sequence[list[Block]],
                 grad_outs: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """*Collective*: per table, per pooled block, the output gradient of the bags it pooled."""

    @abc.abstractmethod
    def sums_every_rank(self, plan: LookupPlan) -> bool:
        """The table's fused update sums every rank's gradient (each rank holds it whole)."""

    @abc.abstractmethod
    def sync_grads(self, plan: LookupPlan, grads: list[torch.Tensor]) -> None:
        """*Collective*: give every copy of a block the dense gradient its computing copy got."""

    @abc.abstractmethod
    def for_replicated_batch(self, layout: ShardLayout, world: int, max_mode: bool
                             ) -> tuple[Strategy, Placement] | None:
        """For a ``Replicate()`` batch: the strategy that answers it with no exchange and its output's
        placement (``Shard(1)`` stands for the output's last dim), or ``None`` when only splitting the bags
        evenly can answer it (max on a layout that would need a ``Partial("max")``)."""

    def __repr__(self) -> str:
        return f"<strategy {self.name}>"

