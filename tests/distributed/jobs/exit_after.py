"""A 2-rank job that does one thing, destroys its group and returns: run by ``test_clean_exit_w2``.

``python exit_after.py MODE ROOT`` with the launch variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) set, MODE one of

- ``collective``: import the package, one ``all_reduce``;
- ``save``: save a row-wise table with ``tdb.checkpoint.save``;
- ``refused_load``: a load refused on every rank (a shape the checkpoint does not hold), then a good load.

The process must exit with status 0 and print no "terminate called": a process group destroyed by
``destroy_process_group()`` but still referenced from a reference cycle is otherwise torn down during
interpreter finalisation, which now and then aborts the process.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.convert import dtensor_from_local_shards
from torchrec_dtensor_bridge.layout import ShardLayout


def main(mode: str, root: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    t = torch.ones(4)
    dist.all_reduce(t)
    if mode != "collective":
        layout = ShardLayout.row_wise((64, 8), [40, 24])
        full = torch.arange(64 * 8, dtype=torch.float32).view(64, 8)
        w = dtensor_from_local_shards(layout, [full[s.slices()].clone() for s in layout.shards_on(rank)])
        path = Path(root) / "ckpt"
        tdb.checkpoint.save({"w": w}, path)
        if mode == "refused_load":
            wrong = ShardLayout.row_wise((60, 8), [30, 30])
            into = dtensor_from_local_shards(wrong, [torch.zeros(s.sizes) for s in wrong.shards_on(rank)])
            try:
                tdb.checkpoint.load({"w": into}, path)
                raise SystemExit(f"rank {rank}: a load of the wrong shape went through")
            except ValueError:
                pass
            into = dtensor_from_local_shards(layout, [torch.zeros(s.sizes) for s in layout.shards_on(rank)])
            tdb.checkpoint.load({"w": into}, path)
            if not torch.equal(tdb.full_tensor(into), full):
                raise SystemExit(f"rank {rank}: the good load differs")
    dist.destroy_process_group()
    sys.stdout.write(f"rank {rank} {mode} done\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
