"""Step 1 of every lookup's entry path (:mod:`.entry`), collective-free: the call's group, and each weight
resolved once.

1. :func:`lookup_group` - the call's group (:func:`..groups.call_group`: the weights' meshes, or
   ``process_group``) with its collectives' tensors on the tables' device (:func:`on_device`);
2. :func:`resolve_table` - a weight's layout in the group's ranks, this rank's shards, its strategy
   (:func:`pick_strategy`, the one place that picks one); shards in CUDA unified memory refused
   (:func:`refuse_unified_memory`).

A DTensor whose local tensor is a shards wrapper without a layout (TorchRec's own) would need a collective to
learn its layout; it is refused (through the agreement step): ``tdb.to_dtensor(w)`` (collective, zero-copy)
gives the same table with its layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import kernels
from ..agreement import Rejected
from ..convert.dtensor import layout_of, local_shards_of, needs_layout_gather
from ..groups import CommGroup, call_group
from ..layout import ShardLayout
from .plan import ResolvedTable, Strategy
from .strategies import COLUMNS, ROWS, WHOLE

__all__ = ["lookup_group", "on_device", "pick_strategy", "refuse_unified_memory", "resolve_table"]


def lookup_group(fn: str, weights: Sequence[object], process_group: dist.ProcessGroup | None,
                 input_mesh_group: CommGroup | None) -> CommGroup:
    """The call's group (:func:`..groups.call_group`) with its collectives' tensors on the weights' device.

    A group of CUDA meshes names ``cuda:torch.cuda.current_device()``: in a process that never called
    ``torch.cuda.set_device``, ``cuda:0``, whatever GPU its tables live on. The lookups put their collectives'
    tensors where the tables' shards are (the first weight whose local tensor is of the group's device type),
    which is where their batches and outputs already live."""
    group = call_group(fn, weights, process_group, input_mesh_group)
    return on_device(group, [w.device for w in weights if isinstance(w, DTensor)])


def on_device(group: CommGroup, devices: Sequence[torch.device]) -> CommGroup:
    """``group`` with its collectives' device the first of ``devices`` of its device type (``group`` itself
    when none is, or it is that device already)."""
    for d in devices:
        if d.type == group.device.type:
            return group if d == group.device else dataclasses.replace(group, device=d)
    return group


def pick_strategy(layout: ShardLayout, world: int) -> Strategy:
    """The cheapest correct strategy for ``layout`` on ``world`` ranks: the one place that picks."""
    full = {s.rank for s in layout.shards if s.sizes == layout.global_shape}
    if full >= set(range(world)):
        return WHOLE
    rows = layout.global_shape[0]
    if all(s.sizes[0] == rows for s in layout.unique_shards() if s.numel):
        return COLUMNS
    return ROWS


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
    refuse_unified_memory(fn, whole, shards)
    return ResolvedTable(
        weight, whole, layout, tuple(shards), group, pick_strategy(layout, group.size), layout.digest()
    )


def refuse_unified_memory(fn: str, layout: ShardLayout, shards: Sequence[torch.Tensor]) -> None:
    """Raises :class:`..agreement.Rejected` naming the table when a shard lives in CUDA unified memory.

    TorchRec keeps a table placed in ``EmbeddingLocation.MANAGED`` or ``MANAGED_CACHING`` in unified memory
    (``MANAGED_CACHING`` with a cache of its rows in device memory that its own module reads and writes back).
    The lookups read and update the shards' storage directly, as device memory: past that cache, whose rows
    are newer than the storage's. Both are refused, since a shard alone does not tell them apart."""
    for s in shards:
        if kernels.in_unified_memory(s):
            raise Rejected(
                NotImplementedError,
                f"{fn}: table {layout.name!r} has rows in CUDA unified memory (TorchRec's EmbeddingLocation.MANAGED or "
                "MANAGED_CACHING, compute kernels fused_uvm / fused_uvm_caching); the lookups read and update "
                "device memory directly, past MANAGED_CACHING's cache: place the table in EmbeddingLocation.DEVICE "
                "(compute_kernel='fused') or HOST",
            )
