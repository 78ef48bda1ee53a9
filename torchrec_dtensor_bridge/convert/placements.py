"""ShardLayout <-> DTensor device mesh and placements.

A layout DTensor can express exactly (an even ``torch.chunk`` split on one dim
in mesh order, a full replica, a table on one rank) gets a plain local tensor;
any other layout gets a :class:`LocalShardsWrapper` and the closest placement
(``Shard(0)`` for row cuts and grids, ``Shard(1)`` for column cuts), with the
true shape and stride given explicitly.
"""

from __future__ import annotations

import atexit
import gc
import itertools
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from ..groups import clear_group_cache
from ..layout import ShardLayout, ShardSpec, chunk_span

__all__ = ["DTensorPlacement", "clear_caches", "layout_from_placements", "placement_for_layout", "world_mesh"]


@dataclass(frozen=True)
class DTensorPlacement:
    """Where a layout lives as a DTensor.

    Attributes:
        mesh: the device mesh.
        placements: one placement per mesh axis.
        exact: True when mesh and placements alone describe the layout (the local
            tensor can be a plain tensor); False when a LocalShardsWrapper must carry it.
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    exact: bool


@lru_cache(maxsize=None)
def _mesh_for_group(device_type: str, group: dist.ProcessGroup) -> DeviceMesh:
    return DeviceMesh.from_group(group, device_type)


def world_mesh(device_type: str, process_group: dist.ProcessGroup | None = None) -> DeviceMesh:
    """A cached 1-D mesh over ``process_group`` (default: every rank); no new group is made."""
    return _mesh_for_group(device_type, process_group or dist.group.WORLD)


_MESH_RANKS: dict[int, tuple[DeviceMesh, torch.Tensor]] = {}


def _mesh_ranks(mesh: DeviceMesh) -> torch.Tensor:
    """``mesh.mesh`` (costly to rebuild on every call), cached per mesh object."""
    hit = _MESH_RANKS.get(id(mesh))
    if hit is None or hit[0] is not mesh:
        hit = (mesh, mesh.mesh)
        _MESH_RANKS[id(mesh)] = hit
    return hit[1]


def clear_caches() -> None:
    """Drop the cached meshes (and through them, process groups).

    Runs automatically at interpreter exit, followed by a garbage collection
    (:func:`_release_at_exit`): a gloo group kept alive by a cache or a
    reference cycle past ``destroy_process_group`` is otherwise torn down
    during interpreter finalisation, which now and then aborts the process
    ("terminate called without an active exception"). Call it yourself after
    destroying and re-creating the default process group in one process.
    """
    _mesh_for_group.cache_clear()
    clear_group_cache()
    _MESH_RANKS.clear()


def _release_at_exit() -> None:
    """Drop the caches, then collect what ``destroy_process_group()`` left in reference cycles.

    A process group referenced only from a cycle outlives ``destroy_process_group()``; without this it is
    freed during the interpreter's finalisation, where its gloo threads can no longer take the GIL and the
    process now and then aborts ("terminate called without an active exception", SIGABRT). Run at exit
    (registered once, at import), while the interpreter is still whole.
    """
    clear_caches()
    gc.collect()


atexit.register(_release_at_exit)


def layout_from_placements(
    mesh: DeviceMesh,
    placements: tuple[Placement, ...] | list[Placement],
    global_shape: tuple[int, ...] | torch.Size,
    *,
    dtype: torch.dtype | None = None,
    name: str = "table",
) -> ShardLayout:
    """The layout DTensor itself implies for ``Shard``/``Replicate`` placements
    on any mesh (computed for every mesh coordinate; no communication)."""
    shape = tuple(int(d) for d in global_shape)
    ranks = _mesh_ranks(mesh)
    shards = []
    for coord in itertools.product(*(range(n) for n in ranks.shape)):
        offsets, sizes = [0] * len(shape), list(shape)
        for axis, p in enumerate(placements):
            if isinstance(p, Replicate):
                continue
            if type(p) is not Shard:
                raise NotImplementedError(f"table {name!r}: placement {p} on mesh axis {axis} is not supported")
            d = p.dim if p.dim >= 0 else p.dim + len(shape)
            start, length = chunk_span(sizes[d], ranks.shape[axis], coord[axis])
            offsets[d] += start
            sizes[d] = length
        shards.append(ShardSpec(int(ranks[coord].item()), tuple(offsets), tuple(sizes)))
    return ShardLayout(shape, tuple(shards), dtype, name)


def _same_blocks(a: ShardLayout, b: ShardLayout) -> bool:
    return sorted((s.rank or 0, s.offsets, s.sizes) for s in a.shards) == sorted(
        (s.rank or 0, s.offsets, s.sizes) for s in b.shards
    )


def placement_for_layout(
    layout: ShardLayout,
    device_type: str,
    device_mesh: DeviceMesh | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> DTensorPlacement:
    """Mesh and placements for ``layout``: on ``device_mesh``, else the cached mesh of ``process_group``
    (default: every rank).

    Every layout lives on the mesh of the whole group, a table held by one rank included (``Shard(0)``
    over a wrapper holding the table on its owner and nothing elsewhere): the tables of one model share
    one mesh, so torch calls over all of them (``clip_grad_norm_``, ``torch.optim``'s foreach steps)
    combine them, and a reduction of such a table gives its value on every rank of the mesh.
    """
    mesh = device_mesh if device_mesh is not None else world_mesh(device_type, process_group)
    candidates: list[tuple[Placement, ...]] = []
    # A DTensor placement gives every mesh rank exactly one block: anything else is not exact.
    if len(layout.shards) == mesh.size() and len(layout.ranks()) == len(layout.shards):
        candidates.append(tuple(Replicate() for _ in range(mesh.ndim)))
        if mesh.ndim == 1:
            candidates += [(Shard(d),) for d in range(layout.ndim)]
    for placements in candidates:
        if _same_blocks(layout_from_placements(mesh, placements, layout.global_shape), layout):
            return DTensorPlacement(mesh, placements, True)
    dim = layout.nearest_shard_dim
    nearest: Placement = Replicate() if dim is None else Shard(dim)
    return DTensorPlacement(mesh, (nearest,) + tuple(Replicate() for _ in range(mesh.ndim - 1)), False)
