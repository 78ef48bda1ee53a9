"""``full_tensor`` and ``storage_metadata`` for every layout."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from .._compat import ShardedTensor, sharded_tensor_process_group
from ..layout import LayoutKind
from .dtensor import layout_of, local_shards_of
from .metadata import _global_rank, layout_to_storage_metadata

__all__ = ["full_tensor", "storage_metadata"]


def full_tensor(t: DTensor | ShardedTensor, *, process_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The whole table on every rank; *collective* over ``process_group``.

    Correct for every layout (uneven cuts, several shards per rank, a table on
    one rank, grids), where ``DTensor.full_tensor`` assumes even chunks. One
    broadcast for a table on one rank, nothing for a full replica everywhere,
    else one ``all_gather`` of each rank's packed shards.

    Example::

        >>> w = tdb.full_tensor(dt)  # torch.equal(w, unsharded_weight)
    """
    if isinstance(t, ShardedTensor):
        group = process_group or sharded_tensor_process_group(t)
        dtype = t.dtype
    elif isinstance(t, DTensor):
        group = process_group
        dtype = t.dtype
    else:
        raise TypeError(f"full_tensor expects a DTensor or ShardedTensor, got {type(t).__name__}")
    layout = layout_of(t)
    locals_ = local_shards_of(t)
    mine = layout.shards_on(dist.get_rank())
    device = locals_[0].device if locals_ else _default_device(t)
    world = dist.get_world_size(group)
    members = [_global_rank(group, r) for r in range(world)]
    if layout.kind is LayoutKind.REPLICATED and set(layout.ranks()) >= set(members):
        return locals_[0].detach().clone()
    out = torch.empty(layout.global_shape, dtype=dtype, device=device)
    owner = layout.owner()
    if owner is not None:
        for spec, tensor in zip(mine, locals_):
            if spec.numel:
                out.copy_(tensor)
        dist.broadcast(out, src=owner, group=group)
        return out
    # One contributor per distinct block: its first replica.
    sources = layout.unique_shards()
    per_rank = {r: [s for s in sources if s.rank == r] for r in members}
    counts = {r: sum(s.numel for s in blocks) for r, blocks in per_rank.items()}
    stray = [s for s in sources if s.rank not in per_rank]
    if stray:
        raise ValueError(
            f"table {layout.name!r}: shards on ranks {sorted({s.rank for s in stray}, key=str)} are outside the process group"
        )
    width = max(counts.values(), default=0)
    send = torch.zeros(width, dtype=dtype, device=device)
    pos = 0
    for spec, tensor in zip(mine, locals_):
        if spec in per_rank[dist.get_rank()]:
            send[pos : pos + spec.numel].copy_(tensor.reshape(-1))
            pos += spec.numel
    recv = [torch.empty(width, dtype=dtype, device=device) for _ in members]
    dist.all_gather(recv, send, group=group)
    for r, buf in zip(members, recv):
        pos = 0
        for spec in per_rank[r]:
            out[spec.slices()] = buf[pos : pos + spec.numel].view(spec.sizes)
            pos += spec.numel
    return out


def _default_device(t: DTensor | ShardedTensor) -> torch.device:
    if isinstance(t, DTensor):
        return t.device
    return torch.device("cpu")


def storage_metadata(t: DTensor | ShardedTensor) -> TensorStorageMetadata:
    """DCP metadata of ALL shards of ``t`` on all ranks (the global picture).

    Not collective, except for a DTensor over a wrapper that carries no layout
    (TorchRec's own), whose shard offsets must be gathered.
    """
    layout = layout_of(t)
    return layout_to_storage_metadata(layout, requires_grad=t.requires_grad)


