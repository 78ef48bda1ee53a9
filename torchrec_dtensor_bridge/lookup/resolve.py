"""A lookup's weights resolved once, at the API edge: layout, local shards, group and strategy.

Every layer below the public functions works from a :class:`ResolvedTable`
and never asks a DTensor again; resolution is collective-free and runs on
every rank before validation and agreement, so a rank that fails a check
later still meets the others in the agreement step.

The group of a call (:func:`call_group`) is ``process_group`` when given, else
the group of the weights' meshes (:func:`..convert.groups.comm_group`: on a
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
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..agreement import Rejected
from ..convert.dtensor import layout_of, local_shards_of, needs_layout_gather
from ..convert.groups import CommGroup, comm_group, of_group
from ..layout import ShardLayout
from .plan import Strategy, strategy_for

__all__ = ["ResolvedTable", "call_group", "resolve_table"]


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
