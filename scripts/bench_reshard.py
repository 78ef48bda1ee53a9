"""Live resharding benchmark: ``tdb.reshard`` against a checkpoint round trip to the same plan, side by side.

Two local gloo ranks hold ``--tables`` tables of ``--rows`` x ``--dim`` float32 (default 8 x 1M x 128:
4 GiB in all), sharded by ``tdb.shard_module`` and trained by a ``FusedOptimizer`` with row-wise Adagrad
(its per-row state moves with the tables), and go around the cycle table-wise -> row-wise (uneven:
30 % / 70 % of the rows) -> column-wise -> table-wise. Per step and rank:

* ``tdb.reshard``: its time (slowest rank), the bytes the rank sent (counted around
  ``batch_isend_irecv``) against the bytes of the blocks that change owner (computed here from the two
  plans' blocks), and its peak memory above the larger of the rank's memory before and after it
  (``VmHWM``, reset before the call; glibc told to map every allocation of 128 KiB or more on its own,
  so that resident memory follows what is allocated) against the bound of the largest table's new
  share on the rank + 64 MiB;
* the checkpoint round trip to the same plan: ``tdb.checkpoint.save`` of the model and optimizer under the
  old plan, then ``tdb.checkpoint.load`` into a model and optimizer under the new plan (built beforehand,
  not timed), the page cache warm (the save has just written the files);
* both results checked: every table's and state's sum over its blocks (all ranks) equals the one before.

    python scripts/bench_reshard.py --reps 2 --out bench/results.json
    python scripts/bench_reshard.py --rows 250000 --reps 1      # a smaller run (1 GiB)
"""

from __future__ import annotations

import argparse
import ctypes
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_results import join_ranks, record, reported, spawn_ranks

CYCLE = ["table_wise", "row_wise_uneven", "column_wise", "table_wise"]


def _status(field: str) -> int:
    """A field of /proc/self/status in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    """Reset this process's ``VmHWM`` to its current RSS (Linux: ``5`` into ``/proc/self/clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


def plan(kind: str, tables: int, rows: int, dim: int, world: int) -> dict[str, Any]:
    """``t{i}.weight`` -> layout of every table for one step of the cycle."""
    from torchrec_dtensor_bridge.layout import ShardLayout

    cut = rows * 3 // 10
    make = {
        "table_wise": lambda i: ShardLayout.table_wise((rows, dim), i % world),
        "row_wise_uneven": lambda i: ShardLayout.row_wise((rows, dim), [cut, rows - cut]),
        "column_wise": lambda i: ShardLayout.column_wise((rows, dim), world),
    }
    return {f"t{i}.weight": make[kind](i).with_name(f"t{i}.weight") for i in range(tables)}


def _changing_bytes(src: dict, dst: dict, rank: int) -> int:
    """The bytes ``rank`` sends when every table goes from ``src`` to ``dst``: each overlap of one of its old
    blocks with another rank's new block (4 bytes an element), and the per-row state (4 bytes a row) of the
    rows another rank holds after and not before, which ``rank`` sends when it is their first holder."""
    from torchrec_dtensor_bridge.layout import box_intersection

    total = 0
    for name, old in src.items():
        new = dst[name]
        for d in new.shards:
            for s in old.shards:
                box = d.rank != rank and s.rank == rank and box_intersection(s.offsets, s.sizes, d.offsets, d.sizes)
                if box:
                    total += 4 * box[1][0] * box[1][1]
        before = list(dict.fromkeys((s.rank, s.offsets[0], s.offsets[0] + s.sizes[0]) for s in old.shards))
        after = dict.fromkeys((s.rank, s.offsets[0], s.offsets[0] + s.sizes[0]) for s in new.shards)
        for q, lo, hi in after:
            if q == rank:
                continue
            cuts = sorted({lo, hi} | {x for _, a, b in before for x in (a, b) if lo < x < hi})
            for a, b in zip(cuts, cuts[1:]):
                holders = [r for r, x, y in before if x <= a and b <= y]
                if q not in holders and holders[0] == rank:
                    total += 4 * (b - a)
    return total


def _sums(model: Any, opt: Any) -> list[float]:
    """Every table's and row-wise state's sum over all its blocks (one copy of each block); collective."""
    import torch
    import torch.distributed as dist

    from torchrec_dtensor_bridge.convert import layout_of, local_shards_of

    values = [getattr(model, n).weight for n in sorted(model._modules)]
    values += [v for _, v in sorted(opt.state_dict().items())]
    out = []
    me = dist.get_rank()
    for v in values:
        first = layout_of(v).first_copies(me, range(dist.get_world_size()))
        out.append(sum(float(t.double().sum()) for t, keep in zip(local_shards_of(v), first) if keep))
    total = torch.tensor(out, dtype=torch.float64)
    dist.all_reduce(total)
    return total.tolist()


def _same(a: list[float], b: list[float]) -> bool:
    """Sums equal but for the order their blocks were added in."""
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-6) for x, y in zip(a, b))


def _job(layouts: dict, tables: int, rows: int, dim: int, *, fill: bool) -> tuple[Any, Any]:
    """The model sharded under ``layouts`` (tables allocated lazily: ``torch.empty`` touches no page) and its
    optimizer; ``fill``: random tables and state."""
    import torch
    from torch import nn

    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.convert import local_shards_of
    from torchrec_dtensor_bridge.convert.placements import world_mesh

    model = nn.Module()
    for i in range(tables):
        model.add_module(f"t{i}", nn.EmbeddingBag(rows, dim, mode="sum", _weight=torch.empty(rows, dim)))
    tdb.shard_module(model, layouts, world_mesh("cpu"))
    opt = tdb.FusedOptimizer({f"t{i}": getattr(model, f"t{i}").weight for i in range(tables)}, "rowwise_adagrad",
                             lr=0.01)
    with torch.no_grad():
        for v in [getattr(model, f"t{i}").weight for i in range(tables)] + list(opt.state_dict().values()):
            for t in local_shards_of(v):
                t.normal_() if fill else t.zero_()
    return model, opt


def _worker(rank: int, world: int, port: int, cfg: dict, out: Any) -> None:
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD: fixed, so freed blocks are unmapped
    join_ranks(rank, world, port, timeout_s=1800)
    import torch.distributed as dist

    import torchrec_dtensor_bridge as tdb

    with reported(rank, out):
        tables, rows, dim = cfg["tables"], cfg["rows"], cfg["dim"]
        plans = [plan(k, tables, rows, dim, world) for k in CYCLE]
        model, opt = _job(plans[0], tables, rows, dim, fill=True)
        sent = [0]
        real = dist.batch_isend_irecv

        def counting(ops: list) -> list:
            sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
            return real(ops)

        steps: list[dict] = []
        for rep in range(cfg["reps"]):
            for i in range(len(CYCLE) - 1):
                src, dst = plans[i], plans[i + 1]
                want = _sums(model, opt)
                # the checkpoint round trip: save under the old plan, load into a job under the new one
                path = f"{cfg['dir']}/step{i}"
                target, target_opt = _job(dst, tables, rows, dim, fill=False)
                dist.barrier()
                t0 = time.perf_counter()
                tdb.checkpoint.save({"model": model, "opt": opt}, path)
                dist.barrier()
                t1 = time.perf_counter()
                tdb.checkpoint.load({"model": target, "opt": target_opt}, path)
                dist.barrier()
                t2 = time.perf_counter()
                assert _same(_sums(target, target_opt), want), "the checkpoint round trip changed a value"
                del target, target_opt
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
                # ours, in memory
                dist.barrier()
                rss = _status("VmRSS")
                _reset_peak()
                sent[0] = 0
                dist.batch_isend_irecv = counting
                t3 = time.perf_counter()
                tdb.reshard(model, dst, optimizers=[opt])
                dt = time.perf_counter() - t3
                dist.batch_isend_irecv = real
                growth = _status("VmHWM") - max(rss, _status("VmRSS"))
                dist.barrier()
                assert _same(_sums(model, opt), want), "the reshard changed a value"
                share = max(sum(s.numel * 4 for s in lay.shards_on(rank)) for lay in dst.values())
                steps.append({
                    "rep": rep, "step": f"{CYCLE[i]} -> {CYCLE[i + 1]}", "reshard_s": dt,
                    "checkpoint_save_s": t1 - t0,
                    "checkpoint_load_s": t2 - t1, "sent_bytes": sent[0],
                    "changing_bytes": _changing_bytes(src, dst, rank), "peak_growth_bytes": growth,
                    "bound_bytes": share + (64 << 20),
                })
        out.put({"rank": rank, "steps": steps})


def summarize(per_rank: list[dict], cfg: dict) -> dict:
    """Per step of the cycle: medians over repetitions, of the slowest rank's times; every rank's bytes."""
    out: dict[str, Any] = {"config": cfg, "steps": {}}
    names = list(dict.fromkeys(s["step"] for s in per_rank[0]["steps"]))
    for name in names:
        rows = [[s for s in r["steps"] if s["step"] == name] for r in per_rank]
        slowest = {k: [max(r[i][k] for r in rows) for i in range(len(rows[0]))]
                   for k in ("reshard_s", "checkpoint_save_s", "checkpoint_load_s")}
        reshard = statistics.median(slowest["reshard_s"])
        roundtrip = statistics.median([a + b for a, b in zip(slowest["checkpoint_save_s"],
                                                              slowest["checkpoint_load_s"])])
        out["steps"][name] = {
            "reshard_s": reshard, "checkpoint_roundtrip_s": roundtrip,
            "checkpoint_save_s": statistics.median(slowest["checkpoint_save_s"]),
            "checkpoint_load_s": statistics.median(slowest["checkpoint_load_s"]),
            "speedup": roundtrip / reshard,
            "per_rank": [{"rank": per_rank[k]["rank"], "sent_bytes": r[0]["sent_bytes"],
                          "changing_bytes": r[0]["changing_bytes"],
                          "peak_growth_bytes": max(s["peak_growth_bytes"] for s in r),
                          "bound_bytes": r[0]["bound_bytes"]} for k, r in enumerate(rows)],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: under ./bench)")
    parser.add_argument("--out", type=Path, default=Path("bench/results.json"))
    args = parser.parse_args(argv)
    base = (args.dir or Path("bench")).absolute()
    base.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=base))
    cfg = {"tables": args.tables, "rows": args.rows, "dim": args.dim, "reps": args.reps, "dir": str(scratch)}
    try:
        result = summarize(spawn_ranks(_worker, 2, (cfg,), name="bench_reshard"), cfg)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    del result["config"]["dir"]
    record(args.out, "reshard", result)
    for name, s in result["steps"].items():
        sent = ", ".join(f"rank {r['rank']}: sent {r['sent_bytes'] / 2**20:.1f} MiB (changing "
                         f"{r['changing_bytes'] / 2**20:.1f}), peak +{r['peak_growth_bytes'] / 2**20:.0f} MiB "
                         f"above steady (bound {r['bound_bytes'] / 2**20:.0f})" for r in s["per_rank"])
        print(f"{name:34s} reshard {s['reshard_s']:7.3f} s  checkpoint {s['checkpoint_roundtrip_s']:7.3f} s "
              f"({s['speedup']:.1f}x)  {sent}")
    bad = [n for n, s in result["steps"].items() if any(r["sent_bytes"] != r["changing_bytes"]
                                                        for r in s["per_rank"])]
    if bad:
        print(f"bench_reshard: bytes sent differ from the changing blocks' bytes in {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
