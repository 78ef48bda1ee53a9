"""ShardLayout <-> ShardedTensor metadata and DCP storage metadata (no tensors, no communication)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from .._compat import (
    ShardedTensor,
    ShardedTensorMetadata,
    ShardedTensorProperties,
    ShardMetadata,
    shard_placement,
    sharded_tensor_process_group,
)
from ..layout import ShardLayout, ShardSpec

__all__ = [
    "layout_from_sharded_tensor",
    "layout_from_sharded_tensor_metadata",
    "layout_from_storage_metadata",
    "layout_to_sharded_tensor_metadata",
    "layout_to_storage_metadata",
]


def layout_from_sharded_tensor_metadata(
    md: ShardedTensorMetadata,
    *,
    process_group: dist.ProcessGroup | None = None,
    name: str = "table",
) -> ShardLayout:
    """Layout of a ShardedTensor from its global metadata.

    A ShardedTensor's placement ranks are global ranks whatever its process
    group (torch checks them against ``get_process_group_ranks``), as are a
    layout's: they are taken as they are. ``process_group`` is accepted for
    symmetry and not needed.
    """
    del process_group
    shards = []
    for sm in md.shards_metadata:
        placement = sm.placement
        rank = None if placement is None else placement.rank()
        device = None if placement is None else str(placement.device())
        shards.append(ShardSpec(rank, tuple(sm.shard_offsets), tuple(sm.shard_sizes), device))
    dtype = md.tensor_properties.dtype if md.tensor_properties is not None else None
    lay = ShardLayout(tuple(md.size), tuple(shards), dtype, name)
    lay.validate()
    return lay


def layout_from_sharded_tensor(st: ShardedTensor, *, name: str = "table") -> ShardLayout:
    """Layout of a ShardedTensor (metadata only; O(number of shards))."""
    return layout_from_sharded_tensor_metadata(
        st.metadata(), process_group=sharded_tensor_process_group(st), name=name
    )


def layout_to_sharded_tensor_metadata(
    layout: ShardLayout,
    *,
    process_group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    requires_grad: bool = False,
) -> ShardedTensorMetadata:
    """ShardedTensor metadata for ``layout``; placement ranks are the layout's global ranks (torch's
    convention for a ShardedTensor of any process group; ``process_group`` is not needed).

    A shard's device is the one recorded in the layout, else ``device`` (``cuda``
    gets the index ``rank % device_count``, as TorchRec places shards).
    """
    if len(layout.unique_shards()) != len(layout.shards):
        raise ValueError(
            f"table {layout.name!r}: a ShardedTensor cannot hold replicated blocks "
            f"(layout kind {layout.kind.value}); keep it a DTensor or a plain tensor"
        )
    if layout.dtype is None:
        raise ValueError(f"table {layout.name!r}: layout has no dtype")
    del process_group
    dev = torch.device(device or "cpu")
    shards_md = []
    for s in layout.shards:
        if s.rank is None:
            raise ValueError(f"table {layout.name!r}: shard at {list(s.offsets)} has no rank")
        if s.device is not None:
            d = s.device
        elif dev.type == "cuda":
            d = f"cuda:{s.rank % max(torch.cuda.device_count(), 1)}"
        else:
            d = dev.type
        shards_md.append(
            ShardMetadata(
                shard_offsets=list(s.offsets),
                shard_sizes=list(s.sizes),
                placement=shard_placement(f"rank:{s.rank}/{d}"),
            )
        )
    props = ShardedTensorProperties(dtype=layout.dtype, requires_grad=requires_grad)
    return ShardedTensorMetadata(
        shards_metadata=shards_md, size=torch.Size(layout.global_shape), tensor_properties=props
    )


def layout_to_storage_metadata(layout: ShardLayout, *, requires_grad: bool = False) -> TensorStorageMetadata:
    """DCP metadata describing every distinct block of ``layout`` (replicas once)."""
    props = TensorProperties(dtype=layout.dtype or torch.get_default_dtype(), requires_grad=requires_grad)
    chunks = [
        ChunkStorageMetadata(offsets=torch.Size(s.offsets), sizes=torch.Size(s.sizes))
        for s in layout.unique_shards()
        if s.numel
    ]
    return TensorStorageMetadata(properties=props, size=torch.Size(layout.global_shape), chunks=chunks)


def layout_from_storage_metadata(md: TensorStorageMetadata, *, name: str = "table") -> ShardLayout:
    """Layout of a checkpointed tensor; chunks carry no rank. Validates coverage."""
    shards = [ShardSpec(None, tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
    lay = ShardLayout(tuple(md.size), tuple(shards), md.properties.dtype, name)
    lay.validate()
    return lay
