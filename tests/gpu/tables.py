"""Tables and batches for the CUDA tests, from plain torch: a layout's blocks on rank 0 as DTensors, each
block on its own storage or every block a view of ONE storage (as TorchRec's fused buffer)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from torchrec_dtensor_bridge.convert import dtensor_from_local_shards
from torchrec_dtensor_bridge.layout import ShardLayout


def table(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A random fp32 table (CPU)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def exact_table(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """A fp32 table (CPU) whose every column is a permutation of ``(i - rows // 2) / 64``: with at most 64 rows,
    these values and sums of up to 32 of them are exact in fp16, and no two rows of a column tie under max
    pooling."""
    assert shape[0] <= 64, "fp16 would round sums of larger values"
    rows, cols = shape
    g = torch.Generator().manual_seed(seed)
    columns = [torch.randperm(rows, generator=g) for _ in range(cols)]
    return (torch.stack(columns, dim=1) - rows // 2).float() / 64


def batch(rows: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """30 ids in 4 bags (one of them empty) with a duplicate id in a bag (fbgemm's kernels sum its gradients
    before an update)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows, (30,), generator=g)
    ids[3] = ids[4]
    return ids.to(device), torch.tensor([0, 4, 4, 11, 20], device=device)


def scale(out: torch.Tensor) -> torch.Tensor:
    """A fixed output gradient for ``(out * scale(out)).sum()``: multiples of 1/16 in [-0.5, 0.5], so that the
    gradients of :func:`exact_table` lookups are exact in fp16 too."""
    k = torch.arange(out.numel(), device=out.device) % 17 - 8
    return (k.to(out.dtype) / 16).view_as(out)


def local_blocks(layouts: list[ShardLayout], tables: list[torch.Tensor], device: torch.device, *,
                 shared: bool) -> list[list[torch.Tensor]]:
    """Each table's blocks on rank 0 on ``device``: clones, or views of ONE storage (blocks back to back, each
    starting at a multiple of 4 elements, with a gap of NaN after it)."""
    blocks = [[t[s.slices()] for s in lay.shards_on(0)] for lay, t in zip(layouts, tables)]
    if not shared:
        return [[b.clone().to(device) for b in bs] for bs in blocks]
    sizes = [b.numel() for bs in blocks for b in bs]
    starts, at = [], 4
    for n in sizes:
        starts.append(at)
        at += (n + 4 + 3) // 4 * 4
    buffer = torch.full((at,), float("nan"), dtype=tables[0].dtype, device=device)  # the gaps: never read
    views: list[list[torch.Tensor]] = []
    k = 0
    for bs in blocks:
        views.append([])
        for b in bs:
            view = buffer[starts[k] : starts[k] + b.numel()].view(b.shape)
            view.copy_(b)
            views[-1].append(view)
            k += 1
    return views


def storages(layouts: list[ShardLayout], *, shared: bool) -> int:
    """How many storages :func:`local_blocks` puts rank 0's blocks of ``layouts`` in: one, or one per block. The
    kernel layer makes one call per storage, so this is also how many pooled sums (and fused updates, and dense
    gradients) one lookup of every block makes."""
    return 1 if shared else sum(len(lay.shards_on(0)) for lay in layouts)


def dtensors(layouts: list[ShardLayout], tables: list[torch.Tensor], device: torch.device, *,
             shared: bool) -> list[DTensor]:
    """The tables as DTensors of ``layouts`` on a one-rank mesh of ``device``'s type (:func:`local_blocks`)."""
    mesh = init_device_mesh(device.type, (1,))
    return [dtensor_from_local_shards(lay, blocks, device_mesh=mesh)
            for lay, blocks in zip(layouts, local_blocks(layouts, tables, device, shared=shared))]
