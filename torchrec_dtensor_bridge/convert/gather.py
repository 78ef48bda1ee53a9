"""``full_tensor`` and ``storage_metadata`` for every layout."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from .._compat import ShardedTensor
from ..layout import LayoutKind, ShardLayout
from .dtensor import layout_of, local_shards_of
from .groups import comm_group
from .metadata import layout_to_storage_metadata

__all__ = ["full_tensor", "storage_metadata"]


def full_tensor(t: DTensor | ShardedTensor, *, process_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The whole table on every rank of ``t``'s group; *collective* over that group.

    The group is ``process_group`` if given, else the group of the DTensor's
    mesh - its sharding axis on a 2-D mesh, whose replica axis must hold
    identical data - or the ShardedTensor's (:func:`.groups.comm_group`; a
    DTensor on a one-rank mesh, a table held by one rank, has none of its own
    and uses the default group). Every rank of the group calls it, in the same
    order; a rank outside it raises ``ValueError`` without communicating.

    Correct for every layout (uneven cuts, several shards per rank, a table on
    one rank, grids), where ``DTensor.full_tensor`` assumes even chunks. One
    broadcast for a table on one rank, nothing for a full replica on every
    member, else one ``all_gather`` of each member's packed shards.

    Example::

        >>> w = tdb.full_tensor(dt)  # torch.equal(w, unsharded_weight)
    """
    if not isinstance(t, (DTensor, ShardedTensor)):
        raise TypeError(f"full_tensor expects a DTensor or ShardedTensor, got {type(t).__name__}")
    group = comm_group(t, process_group)
    me = dist.get_rank() if dist.is_initialized() else 0
    if me not in group.members:
        raise ValueError(
            f"full_tensor: rank {me} is not in the tensor's group of ranks {list(group.members)} "
            "(a DTensor on a sub-mesh); call it on the mesh's ranks, or pass process_group"
        )
    dtype = t.dtype
    whole = layout_of(t, process_group=process_group)
    layout = whole.on_ranks(group.members)  # group ranks from here on
    rank = group.members.index(me)
    locals_ = local_shards_of(t)
    mine = layout.shards_on(rank)
    if len(locals_) != len(mine):
        raise ValueError(
            f"full_tensor: rank {me} holds {len(locals_)} local tensors but the layout lists {len(mine)} blocks"
        )
    device = locals_[0].device if locals_ else _default_device(t)
    if layout.kind is LayoutKind.REPLICATED and set(layout.ranks()) >= set(range(group.size)):
        return locals_[0].detach().clone()
    _check_covered(layout, group.members)
    out = torch.empty(layout.global_shape, dtype=dtype, device=device)
    owner = layout.owner()
    if owner is not None:
        for spec, tensor in zip(mine, locals_):
            if spec.numel:
                out.copy_(tensor)
        if group.size > 1:
            dist.broadcast(out, src=group.members[owner], group=group.group)
        return out
    # One contributor per distinct block: its first replica.
    sources = layout.unique_shards()
    per_rank = {r: [s for s in sources if s.rank == r] for r in range(group.size)}
    counts = {r: sum(s.numel for s in blocks) for r, blocks in per_rank.items()}
    width = max(counts.values(), default=0)
    send = torch.zeros(width, dtype=dtype, device=device)
    pos = 0
    for spec, tensor in zip(mine, locals_):
        if spec in per_rank[rank]:
            send[pos : pos + spec.numel].copy_(tensor.reshape(-1))
            pos += spec.numel
    recv = [torch.empty(width, dtype=dtype, device=device) for _ in range(group.size)]
    dist.all_gather(recv, send, group=group.group)
    for r, buf in enumerate(recv):
        pos = 0
        for spec in per_rank[r]:
            out[spec.slices()] = buf[pos : pos + spec.numel].view(spec.sizes)
            pos += spec.numel
    return out


def _check_covered(layout: ShardLayout, members: tuple[int, ...]) -> None:
    """The group's blocks cover the table (every rank sees the same layout, so all raise alike)."""
    covered = sum(s.numel for s in layout.unique_shards())
    if covered != layout.numel:
        raise ValueError(
            f"table {layout.name!r}: the blocks on the group's ranks {list(members)} cover {covered} of "
            f"{layout.numel} elements; a table must be whole inside the group its collectives run on "
            "(on a 2-D mesh, the sharding axis' group)"
        )


def _default_device(t: DTensor | ShardedTensor) -> torch.device:
    if isinstance(t, DTensor):
        return t.device
    return torch.device("cpu")


def storage_metadata(t: DTensor | ShardedTensor) -> TensorStorageMetadata:
    """DCP metadata of ALL shards of ``t`` on all ranks (the global picture).

    Not collective, except for a DTensor over a shards wrapper that carries no
    layout (TorchRec's own) on several ranks: then, as :func:`layout_of`, it is
    collective over the DTensor's group and every rank of that group calls it.

    Example::

        >>> [c.offsets for c in tdb.storage_metadata(dt).chunks]
    """
    layout = layout_of(t)
    return layout_to_storage_metadata(layout, requires_grad=t.requires_grad)
