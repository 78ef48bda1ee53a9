"""What the checkpoint modules share: the process group, DCP calls, the state_dict's leaves, and sizes.

Sizes: :func:`tensor_bytes` is the one count of a checkpoint's tensor bytes
(every element of every saved tensor once, from ``.metadata``; pickle framing
and non-tensor items not counted), and :func:`format_mib` the one way it is
printed (MiB = 2**20 bytes), so ``inspect`` and ``migrate`` report the same
figure for the same checkpoint.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .._compat import quiet_sharded_tensor_deprecation, root_mesh, shape_and_dtype
from ..groups import group_of_mesh
from ..wrapper import LocalShardsWrapper
from .errors import CheckpointError

__all__ = [
    "MIB",
    "dcp_failures",
    "dcp_quietly",
    "default_process_group",
    "format_bytes",
    "format_mib",
    "global_shape",
    "leaves",
    "memory_of",
    "progress_bar",
    "run_dcp",
    "tensor_bytes",
]

MIB = 1 << 20
"""Bytes in a MiB, as every size the checkpoint modules print counts them."""


def dcp_failures(e: CheckpointException) -> list[BaseException]:
    """The per-rank exceptions inside DCP's ``CheckpointException``."""
    return [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]


@contextlib.contextmanager
def dcp_quietly() -> Iterator[None]:
    """Around a DCP call: no ShardedTensor deprecation warning, and no warning that there is no process group
    (a save or load in one process is what this package's caller asked for, not a mistake)."""
    with quiet_sharded_tensor_deprecation(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def run_dcp(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a DCP entry point; its ``CheckpointException`` (a ``BaseException``) becomes a ``CheckpointError``.

    An error our own storage reader raised on every rank (a refused load) comes
    out as itself, not wrapped in DCP's per-rank report.
    """
    try:
        with dcp_quietly():
            return fn(*args, **kwargs)
    except CheckpointException as e:
        ours = dcp_failures(e)
        if ours and all(isinstance(x, CheckpointError) for x in ours):
            first = ours[0]
            raise type(first)(*first.args) from e
        raise CheckpointError(f"{fn.__module__}.{fn.__name__} failed: {e}") from e


# -------------------------------------------------------------------- process group
def default_process_group(state_dict: Mapping[str, Any] | Flat) -> dist.ProcessGroup | None:
    """The group a save or load of ``state_dict`` runs on when none is given; collective-free.

    The DTensors' *root* mesh decides (a sub-mesh, such as the shard dimension
    of a 2-D ``(replica, shard)`` mesh, counts as the mesh it was sliced from:
    every replica takes part in one save, which writes each block once). When
    every DTensor whose root mesh holds more than one rank shares one root
    mesh: that mesh's group if it is one-dimensional, the default group if it
    spans every rank; an n-dimensional root mesh of only some ranks has no
    single group (ValueError: pass ``process_group``). DTensors on a one-rank
    mesh of their own (table-wise tables) do not count; with no DTensor left,
    or DTensors on different root meshes, the default group.

    Example::

        >>> default_process_group({"t": dtensor_on_ranks_0_1})  # that mesh's group
        >>> default_process_group({"t": dtensor_on_mesh_2x2["shard"]})  # None: the 2x2 mesh is the world
    """
    roots: list[DeviceMesh] = []
    for _, v in flat(state_dict):
        if isinstance(v, DTensor):
            root = root_mesh(v.device_mesh)
            if root.size() > 1 and not any(root == m for m in roots):
                roots.append(root)
    if len(roots) != 1 or not dist.is_initialized():
        return None
    root = roots[0]
    if root.ndim > 1 and root.size() != dist.get_world_size():
        raise ValueError(f"the state_dict's DTensors live on a {root.ndim}-d mesh of ranks "
                         f"{root.mesh.flatten().tolist()}, not all {dist.get_world_size()} ranks; pass "
                         "process_group= (a group spanning that mesh)")
    return group_of_mesh(root, None).group


Flat = list[tuple[str, Any]]
"""A state_dict's leaves, ``(fqn, value)`` in order (:func:`leaves`): what a save walks the state_dict for, once."""


def flat(sd: Mapping[str, Any] | Flat) -> Flat:
    """``sd``'s leaves; ``sd`` itself when it is already a :data:`Flat` list (a save passes the one it made)."""
    return sd if isinstance(sd, list) else list(leaves(sd))


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



_SHOWN = (bool, int, float, str, type(None))
_MAX_SHOWN = 80


def object_summary(sd: Mapping[str, Any] | Flat) -> dict[str, dict[str, str]]:
    """Per non-tensor leaf of ``sd`` (keys as DCP flattens them): its type's name, and its ``repr`` when it
    is a plain scalar or string of at most 80 characters (what ``inspect`` shows without unpickling)."""
    out: dict[str, dict[str, str]] = {}
    for fqn, v in flat(sd):
        if isinstance(v, torch.Tensor):
            continue
        kind = type(v)
        rec = {"type": kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"}
        if isinstance(v, _SHOWN) and len(repr(v)) <= _MAX_SHOWN:
            rec["value"] = repr(v)
        out[fqn] = rec
    return out


def global_shape(v: torch.Tensor) -> tuple[int, ...]:
    return tuple(v.global_shape) if isinstance(v, LocalShardsWrapper) else shape_and_dtype(v)[0]


def dtype_of(v: torch.Tensor) -> torch.dtype:
    """``v.dtype``; a ShardedTensor's without its deprecation warning (:func:`.._compat.shape_and_dtype`)."""
    return shape_and_dtype(v)[1]


# -------------------------------------------------------------------- sizes
def tensor_bytes(md: Metadata, fqn: str | None = None) -> int:
    """The bytes of the saved tensor ``fqn`` (shape x dtype size), or of every saved tensor when ``None``.

    Non-tensor items count 0. Data files are larger (each chunk is a ``torch.save`` zip).

    Example::

        >>> tensor_bytes(md, "t")  # a saved float32 tensor of shape (1000, 64)
        256000
    """
    fqns = md.state_dict_metadata if fqn is None else [fqn]
    total = 0
    for key in fqns:
        m = md.state_dict_metadata[key]
        if isinstance(m, TensorStorageMetadata):
            total += m.size.numel() * m.properties.dtype.itemsize
    return total


def memory_of(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` made contiguous on the CPU, without another copy: for a contiguous CPU tensor its own
    memory, writable in place."""
    t = t.detach().cpu().contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy().data) if t.numel() else memoryview(b"")


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "B") -> Any:
    """A progress bar on stderr (``tqdm``) counting ``total`` ``unit``s; a silent one unless ``enabled``."""
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", disable=not enabled, leave=False)


def format_mib(nbytes: int) -> str:
    """``nbytes`` in MiB (2**20 bytes), two decimals, without the unit: ``format_mib(1 << 20) == "1.00"``."""
    return f"{nbytes / MIB:.2f}"


def format_bytes(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that keeps it at least 1: ``"512 bytes"``, ``"1.50 KiB"``,
    ``"3.25 MiB"`` (:func:`format_mib`'s rounding), ``"1.00 GiB"``."""
    if nbytes < 1024:
        return f"{nbytes} byte{'' if nbytes == 1 else 's'}"
    unit, scale = next((u, s) for u, s in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10))
                       if nbytes >= s)
    return f"{nbytes / scale:.2f} {unit}"
