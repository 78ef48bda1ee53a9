"""A 2-rank job whose ranks raise and recover, then exit: run under torchrun by ``test_clean_exit_w2``.

Each round: a damaged checkpoint is refused on both ranks (``CorruptCheckpointError``), then a good one
loads; then a lookup made on rank 0 only times out in its agreement step (a 3-second group) while rank 1
waits for it in a barrier. The job then destroys its group and exits; the launcher must see every rank exit
with status 0.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.checkpoint.commit import resolve
from torchrec_dtensor_bridge.convert.placements import world_mesh

ROWS = 4096


def main(root: str, rounds: int) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    short = dist.new_group(ranks=[0, 1], timeout=timedelta(seconds=3))  # where the lookup on one rank times out
    rank = dist.get_rank()
    mesh = world_mesh("cpu")
    w = distribute_tensor(torch.arange(ROWS * 8, dtype=torch.float32).view(ROWS, 8), mesh, [Shard(0)])
    for r in range(rounds):
        path = Path(root) / f"damaged{r}"
        tdb.checkpoint.save({"w": w}, path)
        dist.barrier()
        if rank == 0:
            data = sorted(Path(resolve(path)).glob("*.distcp"))[0]  # the committed generation's
            with open(data, "r+b") as f:
                f.seek(64)
                f.write(b"\xff" * 16)
        dist.barrier()
        into = {"w": distribute_tensor(torch.zeros(ROWS, 8), mesh, [Shard(0)])}
        try:
            tdb.checkpoint.load(into, path)
            raise SystemExit(f"rank {rank}: a damaged checkpoint loaded")
        except tdb.checkpoint.CorruptCheckpointError:
            pass
        tdb.checkpoint.save({"w": w}, Path(root) / f"good{r}")
        tdb.checkpoint.load(into, Path(root) / f"good{r}")
        if not torch.equal(into["w"].full_tensor(), w.full_tensor()):
            raise SystemExit(f"rank {rank}: the good load differs")
    if rank == 0:
        try:
            tdb.sharded_embedding_bag(torch.tensor([1, 2]), w, torch.tensor([0]), mode="sum", process_group=short)
            raise SystemExit("rank 0: a lookup made on one rank returned")
        except RuntimeError as e:
            if "did not make this call" not in str(e):
                raise
    dist.barrier()  # rank 1 waits here (on the default group) until rank 0's lookup has timed out
    dist.destroy_process_group()
    sys.stdout.write(f"rank {rank} clean\n")  # one write: the ranks share the launcher's stdout
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
