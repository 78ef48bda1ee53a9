"""What ``save`` and ``load`` share: the process group they run on, DCP calls, the state_dict's leaves."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from ..wrapper import LocalShardsWrapper
from .commit import CheckpointError

__all__ = ["dcp_failures", "default_process_group", "global_shape", "leaves", "run_dcp"]


def dcp_failures(e: CheckpointException) -> list[BaseException]:
    """The per-rank exceptions inside DCP's ``CheckpointException``."""
    return [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]


def run_dcp(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a DCP entry point; its ``CheckpointException`` (a ``BaseException``) becomes a ``CheckpointError``.

    An error our own storage reader raised on every rank (a refused load) comes
    out as itself, not wrapped in DCP's per-rank report.
    """
    try:
        return fn(*args, **kwargs)
    except CheckpointException as e:
        ours = dcp_failures(e)
        if ours and all(isinstance(x, CheckpointError) for x in ours):
            first = ours[0]
            raise type(first)(*first.args) from e
        raise CheckpointError(f"{fn.__module__}.{fn.__name__} failed: {e}") from e


# -------------------------------------------------------------------- process group
def default_process_group(state_dict: Mapping[str, Any]) -> dist.ProcessGroup | None:
    """The group a save or load of ``state_dict`` runs on when none is given.

    The group of the DTensors' device mesh when every DTensor on more than one
    rank shares one one-dimensional mesh (DTensors on a one-rank mesh, such as
    table-wise tables, do not count); for one n-dimensional mesh spanning every
    rank, or no such DTensor, or DTensors on different meshes, the default
    group. DTensors on a submesh of a larger mesh: pass ``process_group``.

    Example::

        >>> default_process_group({"t": dtensor_on_ranks_0_1})  # that mesh's group
    """
    meshes: list[Any] = []
    for _, v in leaves(state_dict):
        if isinstance(v, DTensor) and v.device_mesh.size() > 1 and not any(v.device_mesh == m for m in meshes):
            meshes.append(v.device_mesh)
    if len(meshes) != 1 or not dist.is_initialized():
        return None
    mesh = meshes[0]
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() != dist.get_world_size():
        raise ValueError(f"the state_dict's DTensors live on a {mesh.ndim}-d mesh of {mesh.size()} of the "
                         f"{dist.get_world_size()} ranks; pass process_group= (the group spanning that mesh)")
    return None


def leaves(sd: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(fqn, value) of every leaf, with keys flattened as DCP flattens them."""
    if isinstance(sd, Mapping):
        for k, v in sd.items():
            yield from leaves(v, f"{prefix}{k}.")
    elif isinstance(sd, (list, tuple)) and any(isinstance(v, (torch.Tensor, Mapping)) for v in sd):
        for i, v in enumerate(sd):
            yield from leaves(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], sd



def global_shape(v: torch.Tensor) -> tuple[int, ...]:
    return tuple(v.global_shape) if isinstance(v, LocalShardsWrapper) else tuple(v.shape)
