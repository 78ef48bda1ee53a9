"""The process group a table's collectives run on: the group of the DTensor's own mesh.

Every collective of the package runs on a :class:`CommGroup`, never on the
default group by default. :func:`comm_group` picks it, collective-free and the
same way on every rank:

1. an explicit ``process_group`` argument, when given;
2. a ShardedTensor: its own process group;
3. a DTensor on a mesh of several ranks: the group of its *sharding axis* -
   the one mesh axis whose placement is not ``Replicate()`` (a 1-D mesh: its
   only axis; all ``Replicate()``: the last axis). On a 2-D mesh
   ``(replica, shard)`` with ``[Replicate(), Shard(0)]`` that is the shard
   axis: each replica group holds one whole copy, and the replica axis must
   hold identical data (as DMPCollection keeps it). Several sharded axes: the
   whole mesh, which must then be the whole world (else NotImplementedError);
4. a DTensor on a one-rank mesh (a table held by one rank: torch's table-wise
   example and this package's convention) names no group of its own: its
   collectives run on the default group, so every rank calls them (pass
   ``process_group`` to keep them inside a sub-mesh).

A rank outside a mesh of several ranks has no part in its group: asking for
it raises ``ValueError`` on that rank, without communicating.

Ranks: a :class:`~torchrec_dtensor_bridge.layout.ShardLayout` always speaks
*global* ranks (as ``DeviceMesh.mesh`` does); :attr:`CommGroup.members` lists
the group's global ranks in group-rank order, and
``layout.on_ranks(group.members)`` is the group's part of a layout in group
ranks, which is what the lookups' exchanges index by.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from ._compat import ShardedTensor, sharded_tensor_process_group

__all__ = ["CommGroup", "call_group", "comm_group", "group_of_mesh", "sharding_axis"]


@dataclass(frozen=True)
class CommGroup:
    """A process group with what its collectives need to know, resolved once.

    Attributes:
        group: the process group (``None`` for the default group).
        members: its global ranks, in group-rank order.
        device: where tensors of its collectives live (CUDA for NCCL).
        mesh: the device mesh it was taken from, when any.
    """

    group: dist.ProcessGroup | None
    members: tuple[int, ...]
    device: torch.device
    mesh: DeviceMesh | None = None

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def rank(self) -> int | None:
        """This process' rank in the group, ``None`` when it is not a member."""
        me = _global_rank()
        return self.members.index(me) if me in self.members else None

    def __repr__(self) -> str:
        return f"CommGroup(ranks={list(self.members)}, device={self.device})"


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _device_for(group: dist.ProcessGroup | None, device_type: str | None) -> torch.device:
    if device_type is None:
        backend = dist.get_backend(group) if dist.is_initialized() else "gloo"
        device_type = "cuda" if "nccl" in str(backend) else "cpu"
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


@lru_cache(maxsize=256)
def _members(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    if not dist.is_initialized():
        return (0,)
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def of_group(group: dist.ProcessGroup | None, device_type: str | None = None) -> CommGroup:
    """The :class:`CommGroup` of an explicit process group (``None``: the default group)."""
    if group is dist.GroupMember.WORLD:
        group = None
    return CommGroup(group, _members(group), _device_for(group, device_type))


def sharding_axis(mesh: DeviceMesh, placements: tuple | list) -> int | None:
    """The mesh axis the table is cut along; ``None`` when several are (see the module docstring)."""
    cut = [a for a, p in enumerate(placements) if not isinstance(p, Replicate)]
    if not cut:
        return mesh.ndim - 1
    return cut[0] if len(cut) == 1 else None


def group_of_mesh(mesh: DeviceMesh, axis: int | None) -> CommGroup:
    """The group of ``mesh``'s ``axis`` (``None``: the whole mesh, which must be the world).

    Raises:
        ValueError: this rank is outside a mesh of several ranks (it has no
            part in the mesh's group; raised without communicating).
        NotImplementedError: ``axis`` is ``None`` on an n-D mesh that is not the world.
    """
    if mesh.size() == 1:
        return of_group(None, mesh.device_type)
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    if dist.is_initialized() and mesh.get_coordinate() is None:
        raise ValueError(
            f"rank {_global_rank()} is outside the device mesh of ranks {ranks}: the collectives of a DTensor "
            "on that mesh run on the mesh's group, so only the mesh's ranks call them (pass process_group to "
            "name another group)"
        )
    if axis is None or mesh.ndim == 1:
        if mesh.ndim == 1:
            return CommGroup(mesh.get_group(), tuple(ranks), _device_for(None, mesh.device_type), mesh)
        if dist.is_initialized() and sorted(ranks) == list(range(dist.get_world_size())):
            return CommGroup(None, tuple(range(len(ranks))), _device_for(None, mesh.device_type), mesh)
        raise NotImplementedError(
            f"a DTensor cut along several axes of a {mesh.ndim}-D mesh over ranks {ranks} (not the whole "
            "world) has no single process group; pass process_group"
        )
    group = mesh.get_group(axis)
    me = _global_rank()
    coord = mesh.get_coordinate()
    assert coord is not None, "a member of the mesh (checked above)"
    index = [slice(None) if a == axis else c for a, c in enumerate(coord)]
    line = mesh.mesh[tuple(index)]
    members = tuple(int(r) for r in line.tolist())
    assert me in members, "this rank is on its own line of the mesh"
    return CommGroup(group, members, _device_for(None, mesh.device_type), mesh)


def comm_group(t: object, process_group: dist.ProcessGroup | None = None) -> CommGroup:
    """The group ``t``'s collectives run on (rules in the module docstring); collective-free.

    Example::

        >>> g = comm_group(dt)       # the group of dt's mesh (its sharding axis)
        >>> g.members                # global ranks, in group-rank order
        (0, 1)
    """
    device_type = None
    if isinstance(t, DTensor):
        device_type = t.device_mesh.device_type
    if process_group is not None:
        return of_group(process_group, device_type)
    if isinstance(t, ShardedTensor):
        return of_group(sharded_tensor_process_group(t))
    if isinstance(t, DTensor):
        return group_of_mesh(t.device_mesh, sharding_axis(t.device_mesh, t.placements))
    return of_group(None)


def call_group(
    fn: str, weights: Sequence[object], process_group: dist.ProcessGroup | None, input_mesh_group: CommGroup | None
) -> CommGroup:
    """The group a call on ``weights`` runs on: ``process_group`` when given, else the one group of the
    weights' meshes (weights on one-rank meshes take the group of the others, or ``input_mesh_group``, or
    the default group); collective-free.

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


def clear_group_cache() -> None:
    """Forget cached group members (after re-creating the default process group)."""
    _members.cache_clear()
