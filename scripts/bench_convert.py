"""Conversion cost benchmark: it must not grow with table bytes.

Runs in one process on a one-rank gloo group. For each table size it times
``to_dtensor`` + ``to_sharded_tensor`` (ours) side by side with the cheapest
upstream construction of the same objects (``DTensor.from_local`` of one plain
tensor plus ``ShardedTensor._init_from_local_shards_and_global_metadata``), and
the per-table cost of converting a 1,000-table state_dict both ways.

    python scripts/bench_convert.py --out bench/results.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard as DShard

import torchrec_dtensor_bridge as tdb

from bench_results import record


def timeit(fn: Callable[[], object], reps: int, inner: int = 1) -> dict[str, float]:
    """Median/min/max seconds per call over ``reps`` repetitions after one warm-up."""
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def make_st(rows: int, dim: int, cuts: list[int], device: str) -> ShardedTensor:
    """A ShardedTensor of ``rows x dim`` cut into ``cuts`` row blocks, all on rank 0."""
    starts = [sum(cuts[:i]) for i in range(len(cuts))]
    md = [ShardMetadata([s, 0], [h, dim], "rank:0/cpu") for s, h in zip(starts, cuts)]
    shards = [Shard(torch.empty(h, dim, device=device), m) for h, m in zip(cuts, md)]
    meta = ShardedTensorMetadata(md, torch.Size([rows, dim]), TensorProperties(dtype=torch.float32))
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)


def bench_sizes(reps: int) -> list[dict]:
    out = []
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for rows in (1_000, 100_000, 1_000_000, 10_000_000):
        dim = 16
        cuts = [rows // 4, rows // 4 + 1, rows // 4 - 1, rows - 3 * (rows // 4)]  # uneven: wrapper path
        st = make_st(rows, dim, cuts, "cpu")
        plain = torch.empty(rows, dim)

        def ours() -> None:
            tdb.to_sharded_tensor(tdb.to_dtensor(st))

        def upstream() -> None:
            DTensor.from_local(plain, mesh, [DShard(0)], run_check=False, shape=plain.shape, stride=plain.stride())
            make_st_meta_only(st)

        r = {"rows": rows, "dim": dim, "bytes": rows * dim * 4, "ours": timeit(ours, reps, 20),
             "upstream_minimal": timeit(upstream, reps, 20)}
        r["ratio"] = r["ours"]["median"] / r["upstream_minimal"]["median"]
        out.append(r)
        del st, plain
    return out


def make_st_meta_only(st: ShardedTensor) -> ShardedTensor:
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        list(st.local_shards()), st.metadata()
    )


def bench_state_dict(tables: int, reps: int) -> dict:
    sd = {f"t{i}.weight": make_st(1000 + i, 8, [400 + i, 600], "cpu") for i in range(tables)}

    def there() -> dict:
        return tdb.state_dict_to_dtensor(sd)

    dts = there()

    def back() -> dict:
        return tdb.state_dict_to_sharded_tensor(dts)

    t_there, t_back = timeit(there, reps), timeit(back, reps)
    return {
        "tables": tables,
        "to_dtensor_per_table_us": t_there["median"] / tables * 1e6,
        "to_sharded_tensor_per_table_us": t_back["median"] / tables * 1e6,
        "both_per_table_us": (t_there["median"] + t_back["median"]) / tables * 1e6,
        "raw": {"to_dtensor": t_there, "to_sharded_tensor": t_back},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results.json"))
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--tables", type=int, default=1000)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    sizes = bench_sizes(args.reps)
    sd = bench_state_dict(args.tables, args.reps)
    dist.destroy_process_group()

    print(f"{'rows':>10} {'table MB':>9} {'ours us':>9} {'upstream us':>12} {'ours/up':>8}")
    for r in sizes:
        print(f"{r['rows']:>10} {r['bytes'] / 2**20:>9.1f} {r['ours']['median'] * 1e6:>9.1f} "
              f"{r['upstream_minimal']['median'] * 1e6:>12.1f} {r['ratio']:>8.2f}")
    flat = sizes[-1]["ours"]["median"] / sizes[0]["ours"]["median"]
    print(f"10M-row / 1k-row conversion time: {flat:.2f}x (target <= 1.5x)")
    print(f"{sd['tables']}-table state_dict: to_dtensor {sd['to_dtensor_per_table_us']:.1f} us/table, "
          f"to_sharded_tensor {sd['to_sharded_tensor_per_table_us']:.1f} us/table, "
          f"both {sd['both_per_table_us']:.1f} us/table (target < 200)")
    record(args.out, "convert", {"sizes": sizes, "state_dict": sd, "flatness_10M_over_1k": flat,
                                 "torch": torch.__version__})
    return 0


if __name__ == "__main__":
    sys.exit(main())
