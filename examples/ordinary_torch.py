"""Your tables in ordinary torch code: ``shard_module`` + ``torch.optim.Adam`` + ``clip_grad_norm_`` + a
``tdb.checkpoint`` resume on another layout, on 2 gloo ranks.

Run it with::

    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 examples/ordinary_torch.py

The page "Tables in ordinary torch code" (``docs/ordinary-torch.md``) quotes the region between ``# [readme:ordinary]``
and ``# [/readme:ordinary]``. The program checks itself: the table trained with a resume in the middle
equals the same training of the unsharded ``nn.EmbeddingBag`` on one process, and the exit status is 1 on any
mismatch, on every rank (2 when not launched on 2 ranks).
"""

from __future__ import annotations

import os
import shutil
import sys

# [readme:ordinary]
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import torchrec_dtensor_bridge as tdb


def train(bag: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    """Plain torch: forward, backward, clip, step. Each rank feeds its own batch."""
    for k in range(steps):
        ids = torch.randint(0, 10, (6,), generator=torch.Generator().manual_seed(seed + k))
        loss = bag(ids, torch.tensor([0, 2, 4])).square().sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(bag.parameters(), max_norm=1.0)  # the table's own total norm
        opt.step()
        opt.zero_grad()


def run(rank: int, path: str) -> torch.Tensor:
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)  # the same initial table on every rank; shard_module takes rank 0's
    rows = tdb.ShardLayout.row_wise((10, 4), [6, 4])  # uneven: a DTensor over our LocalShardsWrapper
    bag = tdb.shard_module(nn.EmbeddingBag(10, 4, mode="sum"), {"weight": rows}, mesh)
    opt = torch.optim.Adam(bag.parameters(), lr=0.05)  # its state: DTensors in the table's layout
    train(bag, opt, steps=3, seed=100 * rank)
    tdb.checkpoint.save({"model": bag, "optim": opt}, path)

    # resume under another layout: a grid of 2 x 2 blocks, two on each rank
    grid = tdb.ShardLayout.grid((10, 4), rows=[3, 7], cols=[1, 3], ranks=[0, 1, 1, 0])
    bag = tdb.shard_module(nn.EmbeddingBag(10, 4, mode="sum"), {"weight": grid}, mesh)
    opt = torch.optim.Adam(bag.parameters(), lr=0.05)
    tdb.checkpoint.load({"model": bag, "optim": opt}, path)  # weights and Adam's moments, resharded
    train(bag, opt, steps=2, seed=100 * rank + 3)
    return tdb.full_tensor(bag.weight)  # collective: the whole table on every rank
# [/readme:ordinary]


def reference() -> torch.Tensor:
    """The same five steps on the unsharded table: each step's batch is both ranks' batches."""
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(10, 4, mode="sum")
    opt = torch.optim.Adam(bag.parameters(), lr=0.05)
    for k in range(5):
        loss = 0
        for r in range(2):
            ids = torch.randint(0, 10, (6,), generator=torch.Generator().manual_seed(100 * r + k))
            loss = loss + bag(ids, torch.tensor([0, 2, 4])).square().sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(bag.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad()
    return bag.weight.detach()


def main() -> int:
    if os.environ.get("WORLD_SIZE") != "2":
        print("run me on 2 ranks: python -m torch.distributed.run --standalone --nproc_per_node=2 "
              "examples/ordinary_torch.py", file=sys.stderr)
        return 2
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    where = [tempfile.mkdtemp(prefix="tdb-ordinary-") if rank == 0 else None]
    dist.broadcast_object_list(where)
    try:
        got = run(rank, os.path.join(where[0], "ckpt"))
        ok = torch.allclose(got, reference(), rtol=1e-4, atol=1e-5)
        every = [None, None]
        dist.all_gather_object(every, ok)
        if rank == 0:
            print("ordinary torch: every check passed on 2 ranks" if all(every) else
                  "ordinary torch: the resumed table differs from the unsharded run")
        return 0 if all(every) else 1
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(where[0], ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
