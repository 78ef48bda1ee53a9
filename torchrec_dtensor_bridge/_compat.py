"""The one place that touches private PyTorch APIs.

``ShardedTensor`` and its sharding specs live in ``torch.distributed._shard``
and have no public home; the mesh a sub-mesh was sliced
from has no public accessor (torch 2.13: ``DeviceMesh._get_root_mesh``); DCP's
``.metadata`` pickles refer to two private classes of
``torch.distributed.checkpoint`` (``_StorageInfo``, ``_MEM_FORMAT_ENCODING``),
which its restricted unpickler must resolve. Walking the nested arguments of an op uses ``torch.utils._pytree`` (no
public home). The functional collectives name their group by a string, which only a
private function resolves; DTensor lets a package take over an op only
through its dispatcher's ``_custom_op_handlers`` table (as torch's own
``loss_parallel`` does); reading a device mesh while torch.compile traces
needs its fake-tensor mode set aside (:func:`outside_tracing_modes`). torch.compile's caches key a DTensor by its spec alone
(``DTensor._stable_hash_for_caching``): :func:`key_compiled_dtensors_by_local_shards`
adds what a wrapper local tensor carries. ShardedTensor's own accessors
(``.shape``, ``.dtype``: its ``__torch_function__``) warn that it is deprecated,
about our internal use, on every call: :func:`shape_and_dtype` reads its
metadata instead. A DTensor keeps its local tensor and spec in private attributes, which
:func:`refill_dtensor` replaces to move a parameter to another layout in place. Everything else in the package
imports these names from here, so an upstream move breaks exactly one module.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as ShardedTensorShard
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    MEM_FORMAT_ENCODING as ShardedTensorMemFormat,
)
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
)
from torch.distributed._shard.sharded_tensor.metadata import (
    TensorProperties as ShardedTensorProperties,
)
from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec
from torch.distributed.checkpoint.filesystem import _StorageInfo as DcpStorageInfo
from torch.distributed.distributed_c10d import GroupName, _resolve_process_group
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as DcpMemFormat
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.remote_device import _remote_device as RemoteDevice
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils import _pytree as pytree

__all__ = [
    "ChunkShardingSpec",
    "DcpMemFormat",
    "DcpStorageInfo",
    "EnumerableShardingSpec",
    "RemoteDevice",
    "ShardMetadata",
    "ShardedTensor",
    "ShardedTensorMemFormat",
    "ShardedTensorMetadata",
    "ShardedTensorProperties",
    "ShardedTensorShard",
    "group_ranks",
    "key_compiled_dtensors_by_local_shards",
    "make_sharded_tensor",
    "outside_tracing_modes",
    "quiet_sharded_tensor_deprecation",
    "pytree",
    "refill_dtensor",
    "root_mesh",
    "route_dtensor_op",
    "shard_placement",
    "sharded_tensor_process_group",
    "shape_and_dtype",
]


def make_sharded_tensor(
    local: list[tuple[torch.Tensor, ShardMetadata]],
    metadata: ShardedTensorMetadata,
    process_group: dist.ProcessGroup | None,
) -> ShardedTensor:
    """Build a ShardedTensor from local tensors and global metadata; no copy, no collective."""
    shards = [ShardedTensorShard(tensor=t, metadata=m) for t, m in local]
    # TorchRec builds its ShardedTensors with an EnumerableShardingSpec; passing it also
    # skips torch's spec inference (a ChunkShardingSpec attempt first), ~8 us a table.
    spec = EnumerableShardingSpec(list(metadata.shards_metadata))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, sharded_tensor_metadata=metadata, process_group=process_group, sharding_spec=spec
    )


def sharded_tensor_process_group(st: ShardedTensor) -> dist.ProcessGroup | None:
    """The process group a ShardedTensor's placement ranks refer to."""
    return st._process_group


@lru_cache(maxsize=4096)
def shard_placement(placement: str) -> RemoteDevice:
    """The parsed ``"rank:N/device"`` placement of a ShardMetadata, parsed once per string."""
    return RemoteDevice(placement)


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (``mesh`` itself when it was not sliced); non-collective.

    ``mesh["shard"]`` of a 2-D ``(replica, shard)`` mesh has the 2-D mesh as its
    root; a mesh built directly is its own root.

    Example::

        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "shard"))
        >>> root_mesh(mesh["shard"]) is mesh
        True
    """
    return mesh._get_root_mesh()


def shape_and_dtype(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """``t``'s global shape and dtype; a ShardedTensor's from its metadata, without the deprecation warning
    its accessors give (our own use of a user's ShardedTensor is not the user's to act on)."""
    if isinstance(t, ShardedTensor):
        md = t.metadata()
        return tuple(md.size), md.tensor_properties.dtype
    return tuple(t.shape), t.dtype


def group_ranks(group_name: str) -> list[int]:
    """The global ranks of the process group a functional collective names (``group_name``), in group order."""
    return dist.get_process_group_ranks(_resolve_process_group(GroupName(group_name)))


def route_dtensor_op(op: torch._ops.OpOverload, handler: Callable[[Any, tuple, dict], Any]) -> None:
    """Let ``handler(op, args, kwargs)`` run ``op`` on DTensors before DTensor's own rules; where it returns
    ``NotImplemented``, the handler that was there before (or DTensor's own path) runs. Idempotent per
    handler."""
    table = DTensor._op_dispatcher._custom_op_handlers
    previous = table.get(op)
    if getattr(previous, "_tdb_handler", None) is handler:
        return

    def run(op_call: Any, args: tuple, kwargs: dict) -> Any:
        out = handler(op_call, args, kwargs)
        if out is not NotImplemented:
            return out
        if previous is not None:
            return previous(op_call, args, kwargs)
        table.pop(op_call, None)  # DTensor's own path: dispatch again without this entry
        try:
            return op_call(*args, **kwargs)
        finally:
            table[op_call] = run

    run._tdb_handler = handler  # type: ignore[attr-defined]
    table[op] = run


def key_compiled_dtensors_by_local_shards() -> None:
    """Make torch.compile's cache key of a DTensor include its local tensor's own key where the local tensor
    has one (a ``LocalShardsWrapper``: its blocks and rank); other DTensors keep DTensor's key. Idempotent.

    DTensor keys its compiled graphs by mesh, placements and global shape only (torch 2.13,
    ``DTensor._stable_hash_for_caching``), which fixes the local tensor of a plain DTensor but not the
    blocks a wrapper holds: without this, AOTAutograd's cache serves a graph traced for one rank's or one
    layout's shards to another (``expected size 25==15``, a missing ``_shard_0``).
    """
    original = DTensor._stable_hash_for_caching
    if getattr(original, "_tdb_keyed", False):
        return

    def stable_hash(self: DTensor) -> str:
        base = original(self)
        local_key = getattr(type(self._local_tensor), "_stable_hash_for_caching", None)
        if local_key is None:
            return base
        return hashlib.blake2b((base + local_key(self._local_tensor)).encode(), digest_size=16).hexdigest()

    stable_hash._tdb_keyed = True  # type: ignore[attr-defined]
    DTensor._stable_hash_for_caching = stable_hash  # type: ignore[method-assign]


@contextmanager
def outside_tracing_modes() -> Iterator[None]:
    """Run real tensor ops (a device mesh's rank tensor) while torch.compile traces with fake tensors: its
    dispatch modes are set aside for the block (``torch.utils._python_dispatch``: no public home)."""
    with _disable_current_modes():
        yield


@contextmanager
def quiet_sharded_tensor_deprecation() -> Iterator[None]:
    """Silence ShardedTensor's deprecation warning ("Please use DTensor instead") inside a call of ours:
    DCP touches the ShardedTensors a TorchRec module's ``state_dict()`` holds, and the warning is not the
    user's to act on (this package is what moves them to DTensor). Other warnings pass."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


def refill_dtensor(dst: DTensor, src: DTensor) -> None:
    """Make ``dst`` hold ``src``'s local tensor, mesh and placements, keeping its identity: a parameter
    moved to another layout stays the object its module, optimizers and hooks refer to. The two must
    have one global shape, stride and dtype (what the outer tensor records)."""
    if (dst.shape, dst.stride(), dst.dtype) != (src.shape, src.stride(), src.dtype):
        raise ValueError(f"refill_dtensor: {list(src.shape)} {src.dtype} into {list(dst.shape)} {dst.dtype}")
    dst._local_tensor = src._local_tensor
    dst._spec = src._spec
