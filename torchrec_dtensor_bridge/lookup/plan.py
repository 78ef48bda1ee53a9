"""What one table's lookup needs, fixed before it runs.

1. :class:`Bags`: one rank's batch in canonical form (ids back to back, a length per bag, optional weights);
2. :class:`ResolvedTable`: each weight resolved once at the API edge - layout, local shards, the call's
   group and strategy (:func:`resolve_table`, :func:`call_group`);
3. :class:`LookupPlan`: the strategy its layout allows, this rank's shards and blocks, the batch; and
   :class:`Block`, a computed block's pooled output (see :mod:`.algorithms`).

Resolution (step 2): every layer below the public functions works from a :class:`ResolvedTable`
and never asks a DTensor again; resolution is collective-free and runs on
every rank before validation and agreement, so a rank that fails a check
later still meets the others in the agreement step.

The group of a call (:func:`call_group`) is ``process_group`` when given, else
the group of the weights' meshes (:func:`..groups.comm_group`: on a
2-D mesh the sharding axis' group, whose replica axis must hold identical
data; weights on one-rank meshes take the group of the others, or the
default group when every weight is held by one rank). Inside a lookup, rank
numbers are ranks of that group: :attr:`ResolvedTable.layout` is the group's
part of the weight's layout, renumbered (``ShardLayout.on_ranks``).

A DTensor whose local tensor is a shards wrapper without a layout (TorchRec's
own) would need a collective to learn its layout; lookups refuse it with a
clear error on every rank instead (through the agreement step):
``tdb.to_dtensor(w)`` (collective, zero-copy) gives the
same table with its layout attached.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..agreement import Rejected
from ..convert.dtensor import layout_of, local_shards_of, needs_layout_gather
from ..groups import CommGroup, comm_group, of_group
from ..layout import ShardLayout, ShardSpec

__all__ = ["Bags", "Block", "LookupPlan", "ResolvedTable", "Strategy", "call_group", "partial_output",
           "read_together", "resolve_table", "strategy_for"]


@dataclass(frozen=True)
class Bags:
    """One rank's batch in canonical form.

    Attributes:
        ids: 1-D int64 ids of every bag, back to back.
        lengths: number of ids in each bag (``int64``, one per bag).
        weights: per-sample weights aligned with ``ids``, or ``None``.
    """

    ids: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None

    @property
    def num_bags(self) -> int:
        return int(self.lengths.numel())

    def count_per_bag(self, mask: torch.Tensor) -> torch.Tensor:
        """For every bag, how many of its ids ``mask`` (one bool per id) selects: segment sums of a
        prefix sum (faster than ``bincount`` of the selected ids' bags)."""
        prefix = torch.zeros(mask.numel() + 1, dtype=torch.int64, device=mask.device)
        torch.cumsum(mask, 0, out=prefix[1:])
        bounds = torch.zeros(self.num_bags + 1, dtype=torch.int64, device=mask.device)
        torch.cumsum(self.lengths, 0, out=bounds[1:])
        return prefix[bounds[1:]] - prefix[bounds[:-1]]

    def bag_of_id(self) -> torch.Tensor:
        """For every id, the index of its bag."""
        return torch.repeat_interleave(
            torch.arange(self.num_bags, device=self.ids.device), self.lengths, output_size=self.ids.numel()
        )


def read_together(values: Sequence[torch.Tensor]) -> list[list[int]]:
    """Each of ``values`` (small 1-D int64 tensors, e.g. several tables' facts) as a list of ints, read back to
    the host in ONE read per device (one synchronisation on an accelerator, whatever their number)."""
    by_device: dict[torch.device, list[int]] = {}
    for k, v in enumerate(values):
        by_device.setdefault(v.device, []).append(k)
    out: list[list[int]] = [[] for _ in values]
    for members in by_device.values():
        flat = torch.cat([values[k] for k in members]).tolist()
        at = 0
        for k in members:
            out[k] = flat[at : at + values[k].numel()]
            at += values[k].numel()
    return out


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
        table_layout: the weight's whole layout in global ranks (its gradient carries it);
            ``layout`` is the group's part in group ranks. Default: ``layout``.
        strategy: given by the caller's resolved table, else worked out from ``layout``.
        optimizer: the table's :class:`..optim.state.Binding` when backward applies a fused
            optimizer instead of returning a gradient.
        psw_grad: backward computes the gradient of this rank's per-sample weights.
        route: where this rank's ids went (:class:`.route.Route`), ``None`` when not routed.
        received: how many of ``batch``'s ids came from each rank (routed tables).
        call: the public call, for messages (a timeout in backward names it).

    Ranks (``rank``, ``layout``'s, ``num_bags``' order) are ranks of ``group``.
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
    table_layout: ShardLayout | None = None
    strategy: Strategy | None = None
    optimizer: Any = None
    psw_grad: bool = False
    route: Any = None
    received: tuple[int, ...] = ()
    call: str = "lookup"
    rank: int = field(init=False)
    world: int = field(init=False)
    mine: tuple[ShardSpec, ...] = field(init=False)
    computes: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        if self.strategy is None:
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


def call_group(
    fn: str, weights: Sequence[object], process_group: dist.ProcessGroup | None, input_mesh_group: CommGroup | None
) -> CommGroup:
    """The group a lookup runs on (module docstring); collective-free.

    Raises ``ValueError`` directly (not through an agreement: there is no group to
    agree on) when the weights' meshes name different groups, or this rank is
    not in the group: both are structure every rank sees alike.
    """
    if process_group is not None:
        group = of_group(process_group)
    else:
        found: list[CommGroup] = []
        for w in weights:
            if isinstance(w, DTensor) and w.device_mesh.size() > 1:
                g = comm_group(w)
                if all(g.members != f.members for f in found):
                    found.append(g)
        if len(found) > 1:
            raise ValueError(
                f"{fn}: the weights live on meshes of different groups {[list(g.members) for g in found]}; "
                "a lookup runs on one group (pass process_group, or put the tables on one mesh)"
            )
        group = found[0] if found else (input_mesh_group or of_group(None))
    if input_mesh_group is not None and input_mesh_group.members != group.members:
        raise ValueError(
            f"{fn}: the DTensor input lives on ranks {list(input_mesh_group.members)} but the lookup runs on "
            f"ranks {list(group.members)} (the weight's group); put the input on the weight's mesh axis"
        )
    me = dist.get_rank() if dist.is_initialized() else 0
    if me not in group.members:
        raise ValueError(f"{fn}: rank {me} is not in the lookup's group of ranks {list(group.members)}")
    return group


def resolve_table(fn: str, weight: object, group: CommGroup) -> ResolvedTable:
    """``weight`` resolved for a lookup on ``group``; collective-free.

    Raises:
        Rejected: a weight that is not a DTensor, carries no layout (module
            docstring), is not whole inside ``group``, or whose local tensors
            do not match its layout.
    """
    if not isinstance(weight, DTensor):
        raise Rejected(TypeError, f"{fn}: weight must be a DTensor, got {type(weight).__name__}")
    if needs_layout_gather(weight):
        raise Rejected(
            NotImplementedError,
            f"{fn}: the weight's local tensor is a shards wrapper without the table's layout (TorchRec's own "
            "wrapper); a lookup does not gather layouts - attach it once with "
            "tdb.to_dtensor(weight) (collective, zero-copy)",
        )
    try:
        whole = layout_of(weight)
    except (ValueError, NotImplementedError) as e:
        raise Rejected(type(e), f"{fn}: {e}") from None
    if whole.dtype is None:
        whole = dataclasses.replace(whole, dtype=weight.dtype)
    layout = whole.on_ranks(group.members)
    covered = sum(s.numel for s in layout.unique_shards())
    if covered != layout.numel:
        raise Rejected(
            ValueError,
            f"{fn}: the weight's blocks on the lookup's ranks {list(group.members)} cover {covered} of "
            f"{layout.numel} elements; the table must be whole inside the group (a 2-D mesh: look up on its "
            "sharding axis, whose replica axis holds identical data)",
        )
    shards = local_shards_of(weight)
    rank = group.rank
    assert rank is not None, "call_group keeps only members"
    mine = layout.shards_on(rank)
    if len(shards) != len(mine) or any(tuple(t.shape) != s.sizes for t, s in zip(shards, mine)):
        raise Rejected(
            ValueError,
            f"{fn}: rank {group.members[rank]} holds local tensors of shapes {[list(t.shape) for t in shards]} "
            f"but the weight's layout gives it blocks {[list(s.sizes) for s in mine]}",
        )
    return ResolvedTable(
        weight, whole, layout, tuple(shards), group, strategy_for(layout, group.size), layout.digest()
    )
