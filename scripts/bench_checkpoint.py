"""Checkpoint benchmark: our save/load vs plain dcp.save/dcp.load of the same tensors, side by side.

Two local gloo ranks save and load a row-wise sharded state_dict (``--gib`` GiB in
all), alternating ours and plain DCP so both see the same page cache and disk.
Also measured: ``dd`` write bandwidth of the same disk (with fdatasync), the
time from the start of our save to each of its stages, and the bytes each rank
reads in two resharded loads - ours (default, and staged) and plain
``dcp.load`` - against the bytes the rank needs, from /proc/self/io:
``read_bytes`` (fetched from storage; the checkpoint's files are dropped from
the page cache with ``posix_fadvise`` before each load) and ``rchar`` (bytes
returned by read calls, page cache included):

* row-wise save -> uneven row-wise load (30% / 70% of the rows): the needed
  rows of each saved chunk are one contiguous byte range;
* row-wise save -> column-wise load: each rank needs half of every row, and a
  row-major file interleaves the halves at 512 bytes, less than a disk page,
  so reading whole rows (2x here) is the floor for page-granular reads.

Our load is timed as by default (a rank that reads more than ``staging_bytes``,
256 MiB, verifies first and reads again to copy: no staging memory, the second
pass served by the page cache) and staged (``staging_bytes=None``: every byte
read once into memory, verified, copied after all ranks agree).

    python scripts/bench_checkpoint.py --gib 2 --reps 5 --out bench/results.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

from bench_results import record


def _io() -> dict[str, int]:
    """This process's ``rchar`` (bytes returned by read calls, page cache included) and ``read_bytes``
    (bytes fetched from storage) from /proc/self/io."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"rchar": int(fields["rchar"]), "read_bytes": int(fields["read_bytes"])}


def _evict(directory: Path) -> None:
    """Drop the page cache of every file under ``directory`` (written and fsynced), so the next load's
    ``read_bytes`` counts what it fetches from storage."""
    for f in directory.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _worker(rank: int, world: int, port: int, args: dict, out: mp.Queue) -> None:
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.convert import dtensor_from_local_shards
    from torchrec_dtensor_bridge.layout import ShardLayout

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    tables, dim = 8, 128
    rows = int(args["gib"] * 2**30 / (tables * dim * 4))
    rows -= rows % world
    layouts = [ShardLayout.row_wise((rows, dim), world, name=f"t{i}") for i in range(tables)]
    sd = {}
    for lay in layouts:
        local = [torch.randn(s.sizes) for s in lay.shards_on(rank)]
        sd[lay.name] = dtensor_from_local_shards(lay, local)
    root = Path(args["dir"])
    times: dict[str, list[float]] = {"ours_save": [], "dcp_save": [], "ours_load": [], "dcp_load": [],
                                     "ours_load_staged": []}

    def timed(key: str, fn) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times[key].append(time.perf_counter() - t0)

    for rep in range(args["reps"] + 1):  # the first round is a warm-up, dropped below
        plain = root / "plain"
        if rank == 0 and plain.exists():
            shutil.rmtree(plain)
        dist.barrier()
        timed("dcp_save", lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(plain, sync_files=True)))
        timed("ours_save", lambda: tdb.checkpoint.save(sd, root / "ours"))
        timed("dcp_load", lambda: dcp.load(sd, checkpoint_id=plain))
        timed("ours_load", lambda: tdb.checkpoint.load(sd, root / "ours"))
        timed("ours_load_staged", lambda: tdb.checkpoint.load(sd, root / "ours", staging_bytes=None))
    result: dict = {k: v[1:] for k, v in times.items()}

    # Stage timings of our save: seconds from its start to each stage (the crash tests' hook).
    from torchrec_dtensor_bridge.checkpoint import api

    stages: dict[str, list[float]] = {}
    for _ in range(args["reps"]):
        dist.barrier()
        t0 = time.perf_counter()
        api._fault_hook = lambda name: stages.setdefault(name, []).append(time.perf_counter() - t0)
        tdb.checkpoint.save(sd, root / "ours")
        stages.setdefault("returned", []).append(time.perf_counter() - t0)
        api._fault_hook = None
    result["save_stages"] = {k: statistics.median(v) for k, v in stages.items()}

    # Resharded loads: row-wise saved, then an uneven row cut and a column cut.
    cut = rows * 3 // 10
    targets = {
        "rows": [ShardLayout.row_wise((rows, dim), [cut, rows - cut], name=lay.name) for lay in layouts],
        "columns": [ShardLayout.column_wise((rows, dim), world, name=lay.name) for lay in layouts],
    }
    reshard = {}
    for case, lays in targets.items():
        dest = {lay.name: dtensor_from_local_shards(lay, [torch.empty(s.sizes) for s in lay.shards_on(rank)])
                for lay in lays}
        needed = sum(s.numel * 4 for lay in lays for s in lay.shards_on(rank))
        loads = {
            "ours": lambda: tdb.checkpoint.load(dest, root / "ours"),
            "ours_staged": lambda: tdb.checkpoint.load(dest, root / "ours", staging_bytes=None),
            "dcp": lambda: dcp.load(dest, checkpoint_id=root / "ours"),
        }
        reshard[case] = {"needed": needed}
        for name, fn in loads.items():
            _evict(root)  # every load starts from storage, not from the page cache
            dist.barrier()
            before = _io()
            fn()
            after = _io()
            dist.barrier()
            reshard[case][name] = {k: after[k] - before[k] for k in after}
    result.update(rank=rank, bytes_total=tables * rows * dim * 4, reshard=reshard)
    out.put(result)
    dist.barrier()
    dist.destroy_process_group()


def _dd(directory: Path, mib: int = 1024) -> float:
    f = directory / "dd.bin"
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=16M", f"count={mib // 16}", "conv=fdatasync"],
                   check=True, capture_output=True)
    dt = time.perf_counter() - t0
    f.unlink()
    return mib / 1024 / dt


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: under ./bench)")
    parser.add_argument("--out", type=Path, default=Path("bench/results.json"))
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(dir=args.dir or Path("bench").absolute()))
    try:
        dd = _dd(scratch)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cfg = {"gib": args.gib, "reps": args.reps, "dir": str(scratch)}
        procs = [ctx.Process(target=_worker, args=(r, 2, port, cfg, q)) for r in range(2)]
        for p in procs:
            p.start()
        per_rank = sorted((q.get(timeout=1800) for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    r0 = per_rank[0]
    gib = r0["bytes_total"] / 2**30
    res = {
        "gib": gib,
        "dd_write_gib_s": dd,
        **{k: _stats(r0[k]) for k in ("ours_save", "dcp_save", "ours_load", "dcp_load", "ours_load_staged")},
        "save_stages": r0["save_stages"],
        "reshard_read": {case: [{"rank": r["rank"], **r["reshard"][case]} for r in per_rank]
                         for case in r0["reshard"]},
    }
    res["save_ratio_throughput"] = res["dcp_save"]["median"] / res["ours_save"]["median"]
    res["load_ratio_throughput"] = res["dcp_load"]["median"] / res["ours_load"]["median"]
    res["load_staged_ratio_throughput"] = res["dcp_load"]["median"] / res["ours_load_staged"]["median"]
    print(f"state_dict {gib:.2f} GiB on 2 ranks; dd write {dd:.2f} GiB/s")
    for k in ("dcp_save", "ours_save", "dcp_load", "ours_load", "ours_load_staged"):
        s = res[k]
        print(f"  {k:<10} median {s['median']:.2f}s ({gib / s['median']:.2f} GiB/s), min {s['min']:.2f}, max {s['max']:.2f}")
    print(f"  ours/plain throughput: save {res['save_ratio_throughput']:.2f}x, load {res['load_ratio_throughput']:.2f}x, "
          f"staged load (staging_bytes=None) {res['load_staged_ratio_throughput']:.2f}x (target >= 0.8x)")
    print("  our save, median seconds from its start: "
          + ", ".join(f"{k} {v:.2f}" for k, v in res["save_stages"].items()))
    names = ("ours", "ours_staged", "dcp")
    for case, ranks in res["reshard_read"].items():
        for r in ranks:
            print(f"  resharded load (row-wise -> {case}), rank {r['rank']}: needs {r['needed'] / 2**20:.0f} MiB; "
                  "reads (rchar) " + ", ".join(f"{n} {r[n]['rchar'] / r['needed']:.3f}x" for n in names))
        need = sum(r["needed"] for r in ranks)
        storage = {n: sum(r[n]["read_bytes"] for r in ranks) / need for n in names}
        res["reshard_storage"] = {**res.get("reshard_storage", {}), case: storage}
        print(f"    from storage, all ranks together (files evicted from the page cache first; ranks share the "
              "cache): " + ", ".join(f"{n} {v:.3f}x" for n, v in storage.items()))
    record(args.out, "checkpoint", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
