"""``torch.optim.Adam`` + ``clip_grad_norm_`` on tables DTensor cannot express alone, against the same work
done on plain tensors.

Each of 2 gloo ranks holds its blocks of ``--tables`` tables of ``--rows`` x ``--dim`` fp32, cut unevenly by
rows (55% / 45%), as DTensors over this package's ``LocalShardsWrapper``. One step is ``clip_grad_norm_`` then
``Adam.step()`` (foreach, the default). It is timed side by side, interleaved, the order alternating every
repetition, against:

- ``plain``: the same rows of each rank as plain tensors, the same optimizer and clipping, the total norm
  taken with one ``all_reduce`` of the squared local norm: the work a rank must do anyway;
- ``dtensor even``: torch's own DTensors over an even row split (plain local tensors), for context (its
  ranks hold 50% / 50%, so the slower rank does less than ours).

Checked before timing: one step of ours equals one step of ``plain`` (``torch.testing.assert_close``).

    python scripts/bench_torch_optim.py --reps 7 --out bench/results.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from bench_results import join_ranks, record, reported, spawn_ranks, time_interleaved


def _worker(rank: int, world: int, port: int, cfg: dict, out: Any) -> None:
    join_ranks(rank, world, port, timeout_s=600)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.convert import dtensor_from_local_shards

    with reported(rank, out):
        torch.set_num_threads(1)
        mesh = init_device_mesh("cpu", (world,))
        rows, dim, n = cfg["rows"], cfg["dim"], cfg["tables"]
        first = int(rows * 0.55)
        layout = tdb.ShardLayout.row_wise((rows, dim), [first, rows - first])
        mine = layout.shards_on(rank)[0]
        g = torch.Generator().manual_seed(rank)
        local = [torch.randn(mine.sizes, generator=g) for _ in range(n)]
        grads = [torch.randn(mine.sizes, generator=g) for _ in range(n)]

        def ours_params() -> tuple[list[torch.nn.Parameter], list[Any]]:
            ps = [torch.nn.Parameter(dtensor_from_local_shards(layout, [t.clone()], device_mesh=mesh)) for t in local]
            gs = [dtensor_from_local_shards(layout, [t.clone()], device_mesh=mesh) for t in grads]
            return ps, gs

        def plain_params() -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
            return [torch.nn.Parameter(t.clone()) for t in local], [t.clone() for t in grads]

        def even_params() -> tuple[list[torch.nn.Parameter], list[Any]]:
            ps = [torch.nn.Parameter(distribute_tensor(torch.zeros(rows, dim), mesh, [Shard(0)])) for _ in range(n)]
            gs = [distribute_tensor(torch.ones(rows, dim), mesh, [Shard(0)]) for _ in range(n)]
            return ps, gs

        def plain_clip(ps: list[torch.Tensor], max_norm: float) -> None:
            norms = torch._foreach_norm([p.grad for p in ps])
            total = torch.linalg.vector_norm(torch.stack(norms)).square()
            dist.all_reduce(total)
            coef = torch.clamp(max_norm / (total.sqrt() + 1e-6), max=1.0)
            torch._foreach_mul_([p.grad for p in ps], coef)

        setups = {"ours": ours_params(), "plain": plain_params(), "dtensor even": even_params()}
        opts = {k: torch.optim.Adam(ps, lr=0.01) for k, (ps, _) in setups.items()}

        def step(name: str) -> None:
            ps, gs = setups[name]
            for p, gr in zip(ps, gs):
                p.grad = gr
            if name == "plain":
                plain_clip(ps, 1.0)
            else:
                torch.nn.utils.clip_grad_norm_(ps, 1.0)
            opts[name].step()

        for name in setups:
            step(name)
        for p, q in zip(setups["ours"][0], setups["plain"][0]):
            torch.testing.assert_close(p.to_local().local_shards()[0], q.detach())
        def stepped(name: str) -> Any:
            return lambda: (step(name), dist.barrier())  # timed until every rank is done

        times = time_interleaved({k: stepped(k) for k in setups}, warmup=cfg["warmup"], reps=cfg["reps"],
                                 sync=dist.barrier)
        out.put({"rank": rank, "times": times})


def summarize(ranks: list[dict], cfg: dict) -> dict[str, Any]:
    """Per path, the slower rank's ms per repetition; ``plain`` / path per repetition (> 1: the path is faster)."""
    per = {name: [max(r["times"][name][i] for r in ranks) for i in range(cfg["reps"])] for name in ranks[0]["times"]}
    out: dict[str, Any] = {"config": cfg, "ms": {k: statistics.median(v) for k, v in per.items()}, "ratio": {}}
    for name in per:
        ratios = [a / b for a, b in zip(per["plain"], per[name])]
        out["ratio"][name] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--rows", type=int, default=262_144)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results.json"))
    args = parser.parse_args(argv)
    cfg = {"tables": args.tables, "rows": args.rows, "dim": args.dim, "reps": args.reps, "warmup": args.warmup}
    res = summarize(spawn_ranks(_worker, 2, (cfg,), name="bench_torch_optim"), cfg)
    print(f"clip_grad_norm_ + Adam.step(), {args.tables} x {args.rows} x {args.dim} fp32 tables on 2 ranks, "
          f"median ms of {args.reps} (the slower rank); ratio = plain / path (> 1: the path is faster)")
    for name, ms in res["ms"].items():
        r = res["ratio"][name]
        print(f"  {name:13s} {ms:8.1f} ms   {r['median']:.2f}x [{r['min']:.2f} .. {r['max']:.2f}]")
    record(args.out, "torch_optim", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
