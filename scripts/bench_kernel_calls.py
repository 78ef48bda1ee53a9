"""What one call of each ``torch.ops.tdb`` kernel op costs on small tables, where the call, not the kernel, is
the work: the op as a lookup calls it, next to the implementation behind it called directly (the difference is
the op's own cost: dispatch and argument checks).

One process, one thread. ``--tables`` tables of ``--rows`` x ``--dim`` fp32 in one flat storage (4 x 2,000 x
128 by default), ``--bags`` bags of ``--bag`` ids per table. Each path runs ``--calls`` times after a warm-up,
the paths interleaved, ``--reps`` times; the figure is the median over repetitions of the mean per call.

    python scripts/bench_kernel_calls.py --out bench/results.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from bench_results import record


def _paths(cfg: dict[str, Any]) -> dict[str, Callable[[], object]]:
    import torch

    from torchrec_dtensor_bridge.kernels import Batch, State, Tables, choose, ops
    from torchrec_dtensor_bridge.optim_kinds import SGD, Hyper, WeightDecayMode

    rows, dim, tables, bags, bag = cfg["rows"], cfg["dim"], cfg["tables"], cfg["bags"], cfg["bag"]
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(tables * rows * dim, generator=g)
    at, dims, sizes = [t * rows * dim for t in range(tables)], [dim] * tables, [rows] * tables
    ids = torch.randint(0, rows, (tables * bags * bag,), generator=g)
    offsets = torch.arange(0, tables * bags * bag + 1, bag)
    grad = torch.rand(bags, tables * dim, generator=g) * 1e-3
    hyper = (0.01, 1e-8, 0.0, 0, 0.9, 0.999, 1)
    update = (weights, at, dims, sizes, grad, ids, offsets, None, SGD.name, None, [], None, [], *hyper)
    pool_impl, update_impl = choose.pool_impl(weights.device), choose.update_impl(weights.device, SGD, 0.0)
    grouped = Tables(weights, at, dims, sizes), Batch(ids, offsets)
    sgd = Hyper(SGD, 0.01, 1e-8, 0.0, WeightDecayMode.NONE, 0.9, 0.999)
    return {
        "pool_sum op": lambda: torch.ops.tdb.pool_sum(weights, at, dims, sizes, ids, offsets, None),
        f"pool_sum {pool_impl.name.lower()} directly": lambda: ops.run_pool_sum(pool_impl, *grouped),
        "sparse_update op (sgd)": lambda: torch.ops.tdb.sparse_update(*update),
        f"sparse_update {update_impl.name.lower()} directly": lambda: ops.run_sparse_update(
            update_impl, *grouped, grad, State(step=1), sgd),
        "id check": lambda: ops._check_ids("pool_sum", ids, offsets, sizes, bags),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--bags", type=int, default=32, help="bags per table")
    parser.add_argument("--bag", type=int, default=20, help="ids per bag")
    parser.add_argument("--calls", type=int, default=500, help="calls per repetition and path")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results.json"))
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    cfg = {k: getattr(args, k) for k in ("rows", "dim", "tables", "bags", "bag")}
    paths = _paths(cfg)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for name, fn in paths.items():  # warm-up (and the native library's first build)
        for _ in range(20):
            fn()
    for rep in range(args.reps):
        for name, fn in (paths.items() if rep % 2 == 0 else reversed(list(paths.items()))):
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times[name].append((time.perf_counter() - start) / args.calls)
    result = {name: statistics.median(v) * 1e6 for name, v in times.items()}
    print(f"kernel op calls: {cfg['tables']} tables of {cfg['rows']:,} x {cfg['dim']} in one storage, "
          f"{cfg['bags']} bags of {cfg['bag']} ids per table; one thread; us per call (median of {args.reps})")
    for name, us in result.items():
        print(f"  {name:32s} {us:8.1f} us")
    record(args.out, "kernel_calls", {"config": cfg, "us_per_call": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
