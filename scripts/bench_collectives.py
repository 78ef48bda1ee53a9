"""The lookups' reduce-scatter and all-gather on gloo: torch's collectives vs one ``all_to_all_single``.

The row-cut lookups sum every rank's partial bags back to the bags' own rank
(a reduce-scatter, forward) and hand every rank all ranks' output gradients (an
all-gather, backward). Both are built on ONE ``all_to_all_single``
(``torchrec_dtensor_bridge.collectives.sum_into`` / ``share_flat``); this
benchmark measures them against gloo's own ``dist.reduce_scatter`` /
``dist.all_gather`` moving the same bytes, side by side in the same processes
(interleaved, the order alternating every repetition), on the message of the
training benchmark's row-wise step (8 tables x 128 columns x 2 x 2048 bags,
fp32: 8 MiB per rank and direction) and a smaller one.

Checked before timing: the results equal gloo's (``torch.equal``; the sums of
more than two ranks, added in another order, to ``torch.allclose``).

    python scripts/bench_collectives.py --reps 9 --out bench/results.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from bench_results import join_ranks, record, reported, spawn_ranks, time_interleaved


def _worker(rank: int, world: int, port: int, cfg: dict, out: Any) -> None:
    join_ranks(rank, world, port, timeout_s=300)
    import torch
    import torch.distributed as dist

    from torchrec_dtensor_bridge.collectives import share_flat, sum_into

    with reported(rank, out):
        result: dict[str, Any] = {"rank": rank, "sizes": {}}
        for mib in cfg["mib"]:
            n = int(mib * 2**20) // 4  # fp32 elements per rank and destination
            g = torch.Generator().manual_seed(rank)
            message = torch.rand(world * n, generator=g)  # this rank's partials for every rank, rank order
            pieces = list(message.split(n))
            others = torch.cat([p for q, p in enumerate(pieces) if q != rank])
            mine = torch.rand(n, generator=g)

            def gloo_reduce_scatter() -> torch.Tensor:
                got = torch.empty(n)
                dist.reduce_scatter(got, pieces)
                return got

            def ours_reduce_scatter() -> torch.Tensor:
                return sum_into(pieces[rank].clone(), others, [n] * world, None)

            def gloo_all_gather() -> list[torch.Tensor]:
                got = [torch.empty(n) for _ in range(world)]
                dist.all_gather(got, mine)
                return got

            def ours_all_gather() -> list[torch.Tensor]:
                return share_flat(mine, [n] * world, None)

            # two ranks: one addition, exact whatever the order; more: the same sum in another order
            same = torch.equal if world == 2 else torch.allclose
            if not same(gloo_reduce_scatter(), ours_reduce_scatter()):
                raise AssertionError(f"{mib} MiB: sum_into differs from gloo's reduce_scatter")
            if not all(torch.equal(a, b) for a, b in zip(gloo_all_gather(), ours_all_gather())):
                raise AssertionError(f"{mib} MiB: share_flat differs from gloo's all_gather")
            paths = {"reduce_scatter gloo": gloo_reduce_scatter, "reduce_scatter ours": ours_reduce_scatter,
                     "all_gather gloo": gloo_all_gather, "all_gather ours": ours_all_gather}
            result["sizes"][str(mib)] = time_interleaved(paths, warmup=cfg["warmup"], reps=cfg["reps"],
                                                         sync=dist.barrier)
        out.put(result)


def summarize(ranks: list[dict], cfg: dict) -> dict[str, Any]:
    """Per size and path, the slower rank's time per repetition; ratios gloo / ours per repetition."""
    out: dict[str, Any] = {"config": cfg, "sizes": {}}
    for mib in ranks[0]["sizes"]:
        per = {name: [max(r["sizes"][mib][name][i] for r in ranks) for i in range(cfg["reps"])]
               for name in ranks[0]["sizes"][mib]}
        entry: dict[str, Any] = {"ms": {k: statistics.median(v) for k, v in per.items()}}
        for op in ("reduce_scatter", "all_gather"):
            ratios = [a / b for a, b in zip(per[f"{op} gloo"], per[f"{op} ours"])]
            entry[f"{op} ratio"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        out["sizes"][mib] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--mib", type=float, nargs="+", default=[1.0, 8.0], help="MiB per rank and destination")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results.json"))
    args = parser.parse_args(argv)
    cfg = {"world": args.world, "mib": args.mib, "reps": args.reps, "warmup": args.warmup}
    res = summarize(spawn_ranks(_worker, args.world, (cfg,), name="bench_collectives"), cfg)
    print(f"gloo collectives vs one all_to_all_single, {args.world} ranks, median ms of {args.reps} "
          "(the slower rank); ratio = gloo / ours (> 1: ours faster)")
    for mib, e in res["sizes"].items():
        for op in ("reduce_scatter", "all_gather"):
            r = e[f"{op} ratio"]
            print(f"  {float(mib):5.1f} MiB  {op:15s} gloo {e['ms'][f'{op} gloo']:7.2f} ms   ours "
                  f"{e['ms'][f'{op} ours']:7.2f} ms   {r['median']:.2f}x [{r['min']:.2f} .. {r['max']:.2f}]")
    record(args.out, "collectives", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
