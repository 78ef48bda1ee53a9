"""``full_tensor`` and ``storage_metadata`` for every layout."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from .._compat import ShardedTensor, shape_and_dtype
from .. import agreement
from ..blocks import check_covered, contributions, pack, unpack
from ..layout import LayoutKind, ShardLayout
from .dtensor import carried_name, gather_layout, layout_of, local_shards_of, needs_layout_gather
from ..groups import CommGroup, comm_group
from .metadata import layout_to_storage_metadata

__all__ = ["full_tensor", "storage_metadata"]

_Blocks = list[tuple[tuple[int, ...], tuple[int, ...]]]


@dataclass(frozen=True)
class _Plan:
    """How ``full_tensor`` builds the table on this rank; equal ``digest`` on every rank means equal moves.

    Attributes:
        kind: ``"replica"`` (this rank holds a whole replica, as every member does: no communication),
            ``"empty"`` (a table without elements: nothing to move), ``"owner"`` (one rank holds all
            the data: one broadcast) or ``"gather"`` (one ``all_gather`` of each member's packed blocks).
        layout: the group's part of the layout, in group ranks.
        digest: what every rank must agree on for the moves to match (shape, dtype and, for a
            gather, every block; for a broadcast, the owner only - the other ranks of a one-rank
            mesh need not know how the owner cuts its table).
        owner: the group rank holding all the data (``"owner"`` plans).
    """

    kind: str
    layout: ShardLayout
    digest: int
    owner: int = -1

    @property
    def local(self) -> bool:
        return self.kind in ("replica", "empty")


def _digest(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 2


def _plan(whole: ShardLayout, group: CommGroup, rank: int, locals_: list[torch.Tensor], dtype: torch.dtype) -> _Plan:
    """The moves for ``whole`` on ``group``; raises ``ValueError`` on a local inconsistency (no communication)."""
    layout = whole.on_ranks(group.members)
    mine = layout.shards_on(rank)
    me = group.members[rank]
    if len(locals_) != len(mine) or any(
        tuple(t.shape) != s.sizes and (t.numel() or s.numel) for t, s in zip(locals_, mine)
    ):
        raise ValueError(
            f"table {whole.name!r}: rank {me} holds local tensors of shapes {[list(t.shape) for t in locals_]} "
            f"but the table's layout gives it blocks {[list(s.sizes) for s in mine]}"
        )
    shape, kind = layout.global_shape, str(dtype)
    if layout.kind is LayoutKind.REPLICATED and set(layout.ranks()) >= set(range(group.size)):
        return _Plan("replica", layout, _digest("replica", shape, kind))
    if layout.numel == 0:
        return _Plan("empty", layout, _digest("empty", shape, kind))
    check_covered(layout, group.members)
    holders = sorted({s.rank for s in layout.shards if s.numel and s.rank is not None})
    if len(holders) == 1:
        return _Plan("owner", layout, _digest("owner", shape, kind, holders[0]), holders[0])
    blocks = [(s.rank, s.offsets, s.sizes) for s in layout.unique_shards() if s.numel]
    return _Plan("gather", layout, _digest("gather", shape, kind, blocks))


def _describe(plan: _Plan, group: CommGroup) -> str:
    """A rank's view of the table for an error message (global ranks)."""
    lay = plan.layout
    head = f"shape {list(lay.global_shape)}"
    if plan.kind == "owner":
        return f"{head}, all of it on rank {group.members[plan.owner]}"
    if plan.kind != "gather":
        return f"{head}, {plan.kind}"
    blocks = [f"rank {group.members[s.rank]} {list(s.offsets)}+{list(s.sizes)}" for s in lay.unique_shards()
              if s.numel and s.rank is not None]
    return f"{head}, blocks {blocks}"


def _detail() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_debug_level() == dist.DebugLevel.DETAIL


def full_tensor(
    t: DTensor | ShardedTensor, *, process_group: dist.ProcessGroup | None = None, name: str | None = None
) -> torch.Tensor:
    """The whole table on every rank of ``t``'s group; *collective* over that group.

    The group is ``process_group`` if given, else the group of the DTensor's
    mesh - its sharding axis on a 2-D mesh, whose replica axis must hold
    identical data - or the ShardedTensor's (:func:`..groups.comm_group`; a
    DTensor on a one-rank mesh, a table held by one rank, has none of its own
    and uses the default group: every rank calls it, and every rank gets the
    table, whatever its form of "nothing on this rank" - an empty plain
    tensor, an empty ``LocalShardsWrapper`` with or without a layout). Every
    rank of the group calls it, in the same order; a rank outside it raises
    ``ValueError`` without communicating.

    Steps, the same on every rank of the group, so no rank is left waiting in
    a collective the others skipped:

    1. local checks (the layout as far as this rank knows it without
       communicating, its local tensors against it, coverage) - recorded, not
       raised;
    2. ONE agreement ``all_gather`` (:func:`~torchrec_dtensor_bridge.agreement.agree`)
       of every rank's verdict, whether it needs the layout gathered, and a
       digest of the moves it plans; any problem raises on every rank, and
       ranks planning different moves raise ``ValueError`` on every rank;
    3. when any rank's wrapper carries no layout (TorchRec's own), every
       member's blocks are gathered into the layout (every rank takes part);
    4. the data: one broadcast for a table whose data one rank holds, else one
       ``all_gather`` of each member's packed blocks.

    A table every member holds a whole replica of needs no data moved: each
    rank copies its own replica and nothing is communicated (DTensor's
    contract: the replicas are equal), unless ``TORCH_DISTRIBUTED_DEBUG=DETAIL``,
    which runs the agreement step too.

    Correct for every layout (uneven cuts, several shards per rank, a table on
    one rank, grids), where ``DTensor.full_tensor`` assumes even chunks.

    Args:
        t: a DTensor or ShardedTensor.
        process_group: the group to gather on (default: the tensor's own).
        name: the table's name, for error messages (default: the name its carried layout records, which
            the package's own tables take from their state_dict key).

    Returns:
        A new tensor: the whole table.

    Raises:
        TypeError: ``t`` is not a DTensor or ShardedTensor (on this rank only: the
            group is unknown).
        ValueError: this rank is not in the group (on this rank only, without
            communicating); on every rank of the group, when any rank's local
            tensors do not match the layout, the blocks do not cover the table,
            or the ranks see different layouts.

    Example::

        >>> w = tdb.full_tensor(dt)  # torch.equal(w, unsharded_weight)
    """
    if not isinstance(t, (DTensor, ShardedTensor)):
        raise TypeError(f"full_tensor expects a DTensor or ShardedTensor, got {type(t).__name__}")
    name = name or carried_name(t) or "table"
    try:
        group = comm_group(t, process_group)
    except ValueError as e:  # a rank outside the DTensor's mesh
        raise ValueError(f"full_tensor: table {name!r}: {e}") from None
    me = dist.get_rank() if dist.is_initialized() else 0
    if me not in group.members:
        raise ValueError(
            f"full_tensor: table {name!r}: rank {me} is not in the tensor's group of ranks {list(group.members)} "
            "(a DTensor on a sub-mesh); call it on the mesh's ranks, or pass process_group"
        )
    rank = group.members.index(me)
    _, dtype = shape_and_dtype(t)
    problem: agreement.Problem | None = None
    plan: _Plan | None = None
    locals_: list[torch.Tensor] = []
    blocks: _Blocks = []
    gather = isinstance(t, DTensor) and needs_layout_gather(t)
    try:
        locals_ = local_shards_of(t)
        if gather:
            local: Any = t._local_tensor  # type: ignore[union-attr]
            blocks = [(tuple(int(v) for v in o), tuple(s.shape)) for o, s in zip(local.local_offsets(), locals_)]
        else:
            whole = layout_of(t, name=name, process_group=process_group)  # collective-free here
            plan = _plan(whole, group, rank, locals_, dtype)
            blocks = [(s.offsets, s.sizes) for s in whole.shards_on(me)]
    except (ValueError, NotImplementedError) as e:
        problem = agreement.Problem.from_exception(type(e), f"full_tensor: {e}")
    if plan is not None and plan.local and not _detail():
        return _run(plan, rank, locals_, group, dtype, _device(t, locals_))
    is_dtensor = isinstance(t, DTensor)
    rows = agreement.agree("full_tensor", problem, [int(gather), 0 if plan is None else plan.digest,
                                                    int(is_dtensor)], group)
    agreement.check_same("full_tensor", f"whether table {name!r} is a DTensor (1) or a ShardedTensor (0)",
                         [row[2] for row in rows])
    if any(row[0] for row in rows):
        assert isinstance(t, DTensor), "agreed: every rank holds a DTensor"
        whole = gather_layout(t, blocks, name=name, process_group=process_group)  # every rank alike
        plan = _plan(whole, group, rank, locals_, dtype)
    elif any(row[1] != rows[0][1] for row in rows):  # every rank sees the same rows: all raise alike
        seen = agreement.gather_objects(None if plan is None else _describe(plan, group), group)
        views = "; ".join(f"rank {group.members[r]}: {v}" for r, v in enumerate(seen))
        raise ValueError(
            f"full_tensor: ranks disagree on the layout of table {name!r} ({views}); every rank must hold the "
            "same table: the same shape, dtype and blocks (a layout= given to LocalShardsWrapper must be the "
            "same on every rank)"
        )
    assert plan is not None, "agreed: every rank has a plan"
    return _run(plan, rank, locals_, group, dtype, _device(t, locals_))


def _device(t: DTensor | ShardedTensor, locals_: list[torch.Tensor]) -> torch.device:
    if locals_:
        return locals_[0].device
    return t.device if isinstance(t, DTensor) else torch.device("cpu")


def _run(
    plan: _Plan, rank: int, locals_: list[torch.Tensor], group: CommGroup, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The agreed moves (the same collectives on every rank of ``group``)."""
    layout = plan.layout
    mine = layout.shards_on(rank)
    if plan.kind == "replica":
        return locals_[0].detach().clone()
    out = torch.empty(layout.global_shape, dtype=dtype, device=device)
    if plan.kind == "empty":
        return out
    if plan.kind == "owner":
        owner = plan.owner
        if rank == owner:
            for spec, tensor in zip(mine, locals_):
                if spec.numel:
                    out[spec.slices()].copy_(tensor)
        if group.size > 1:
            dist.broadcast(out, src=group.members[owner], group=group.group)
        return out
    per_rank, width = contributions(layout, group.size)
    send = pack(per_rank[rank], list(zip(mine, locals_)), width, dtype, device)
    recv = [torch.empty(width, dtype=dtype, device=device) for _ in range(group.size)]
    dist.all_gather(recv, send, group=group.group)
    return unpack(out, per_rank, recv)


def storage_metadata(t: DTensor | ShardedTensor, *, name: str = "table") -> TensorStorageMetadata:
    """DCP metadata of ALL shards of ``t`` on all ranks (the global picture).

    Not collective, except where :func:`~torchrec_dtensor_bridge.layout_of`
    is: a DTensor on several ranks whose local tensors are shards wrappers
    without a layout (TorchRec's own); then every rank of the DTensor's group
    calls it. A table on a one-rank mesh never communicates: every rank,
    whatever its form of "nothing on this rank", gets the owner's block.

    Args:
        t: a DTensor or ShardedTensor.
        name: the table's name, for error messages.

    Example::

        >>> [c.offsets for c in tdb.storage_metadata(dt).chunks]
    """
    layout = layout_of(t, name=name)
    return layout_to_storage_metadata(layout, requires_grad=t.requires_grad)
