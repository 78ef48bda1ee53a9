"""This package's CPU kernels (the built extension's ops, ``kernels/native.py``) vs fbgemm_gpu-cpu's: the fused
optimizers' update and the lookup's pooled sum. The figures ``kernels/choose.py``'s rule comes from
(docs/kernels.md): run it for each dtype, on tables past the caches (the default) and inside them
(``--tables 1 --rows 20000``).

One process, one thread (``--threads`` for more). ``--tables`` tables of ``--rows`` x ``--dim`` fp32 (4 x
1,000,000 x 128 = 2 GiB by default, so the rows a step touches are not in the
cache, as in training), ``--bags`` bags of ``--bag`` ids per table (the ids one
rank of the training benchmark's table-wise layout updates: 2 ranks x 2048 bags
of 20), fresh random ids every repetition. The gradient is a column slice of
one wide matrix, as the lookups' backward hands it over. Per kind, ours and the
baseline (fbgemm's kernel; for Adam, which fbgemm-gpu-cpu has no CPU kernel
for, the package's torch-op path that runs without ours) update the same tables
from the same state, interleaved (the order alternates), after checking on a
copy that they give the same rows and state. Then the
pooled sum of a lookup (the forward) over the same tables, ours vs fbgemm's
forward kernel (checked bit-identical first).

    python scripts/bench_sparse_update.py --reps 7 --out bench/results.json
    python scripts/bench_sparse_update.py --kinds adagrad,adam --tables 2   # element-wise states: +2-4 GiB
    python scripts/bench_sparse_update.py --threads 2 --out /tmp/t.json     # both kernels on two threads
    python scripts/bench_sparse_update.py --dtype fp16 --kinds sgd,rowwise_adagrad,adagrad  # fp16 tables

fp16 tables are updated rounded to nearest (fbgemm's CPU kernels round no other way; stochastic rounding is
ours alone).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench_results import record

KINDS = ("sgd", "rowwise_adagrad", "adagrad", "adam")
LR, EPS = 0.01, 1e-8
BETAS = (0.9, 0.999)


def _fbgemm(kind: str, weight, grad, ids, offsets, state) -> None:
    import torch

    rows, dim = weight.shape
    place = torch.full((1,), 3, dtype=torch.int32)  # EmbeddingLocation.HOST
    w_off = torch.zeros(1, dtype=torch.int64)
    common = (grad, weight.view(-1), place, w_off, torch.tensor([0, dim], dtype=torch.int32), dim,
              torch.tensor([0, rows]), max(rows.bit_length(), 1), ids, offsets, 0, None, False)
    op = getattr(torch.ops.fbgemm, f"split_embedding_backward_codegen_{kind}_cpu")
    if kind == "sgd":
        op(*common, torch.tensor(LR))
    else:
        op(*common, state.view(-1), place, w_off, torch.tensor(LR), eps=EPS)


DTYPES = {"fp32": "float32", "fp16": "float16"}  # names of torch dtypes, resolved once torch is imported
TOLERANCE_16 = {"rtol": 1e-2, "atol": 1e-3}  # fp16 rows: a unit in the last place either way
BASELINES = {"adam": "torch ops (optim/update.py)"}  # fbgemm-gpu-cpu builds no CPU Adam kernel
"""Per kind, what ours is compared with when it is not fbgemm-gpu-cpu's backward-with-optimizer kernel."""


def _states(kind: str, w: Any) -> tuple:
    import torch

    if kind == "sgd":
        return ()
    if kind == "rowwise_adagrad":
        return (torch.zeros(w.shape[0]),)
    return tuple(torch.zeros_like(w, dtype=torch.float32) for _ in range(2 if kind == "adam" else 1))  # fp32 state


def _torch_adam(w, grad, ids, offsets, states) -> None:
    """The package's torch-op path for Adam (what runs without the native kernel): rows, summed gradient, update."""
    import torch

    from torchrec_dtensor_bridge.optim.update import apply_elementwise

    hyper = _hyper("adam")
    rows, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    bag = torch.repeat_interleave(torch.arange(offsets.numel() - 1), offsets[1:] - offsets[:-1], output_size=ids.numel())
    summed = torch.zeros(rows.numel(), w.shape[1]).index_add_(0, inverse, grad.index_select(0, bag))
    apply_elementwise(hyper, w, rows, summed, {"momentum1": states[0], "momentum2": states[1]}, 1)


def _hyper(kind: str) -> Any:
    from torchrec_dtensor_bridge.optim_kinds import Hyper, WeightDecayMode, lookup

    # rounded to nearest: what fbgemm's CPU kernels do with fp16 tables (no effect on fp32 ones)
    return Hyper(lookup(kind), LR, EPS, 0.0, WeightDecayMode.NONE, BETAS[0], BETAS[1], stochastic_rounding=False)


def _one(w) -> Any:
    """One table ``w`` (a contiguous ``(rows, dim)``) as the kernels take tables."""
    from torchrec_dtensor_bridge.kernels import Tables

    return Tables(w.view(-1), [0], [w.shape[1]], [w.shape[0]])


def _update(path: str, kernel: Any, kind: str, w, grad, ids, offsets, states: tuple) -> None:
    from torchrec_dtensor_bridge.kernels import Batch, State

    if path == "ours":
        flat = [st.view(-1) for st in states] + [None, None]
        state = State(flat[0], [0] if flat[0] is not None else [], flat[1], [0] if flat[1] is not None else [], 1)
        kernel.update_tables(_one(w), Batch(ids, offsets), grad, state, _hyper(kind))
    elif kind == "adam":
        _torch_adam(w, grad, ids, offsets, states)
    else:
        _fbgemm(kind, w, grad.contiguous(), ids, offsets, states[0] if states else None)


def run(cfg: dict) -> dict[str, Any]:
    import fbgemm_gpu  # noqa: F401 - registers torch.ops.fbgemm
    import torch

    from torchrec_dtensor_bridge.kernels import native

    torch.set_num_threads(cfg["threads"])
    kernel = native.kernel()
    if kernel is None:
        raise SystemExit(f"bench_sparse_update: the extension is {native.missing()}; {native.BUILD_HINT}")
    rows, dim, n_tables = cfg["rows"], cfg["dim"], cfg["tables"]
    bags, bag = cfg["bags"], cfg["bag"]
    dtype = getattr(torch, DTYPES[cfg["dtype"]])
    tables = [torch.empty(rows, dim).uniform_(-0.01, 0.01).to(dtype) for _ in range(n_tables)]
    offsets = torch.arange(0, bags * bag + 1, bag)
    wide = torch.rand(bags, (n_tables + 1) * dim)
    grads = [wide[:, (t + 1) * dim : (t + 2) * dim] for t in range(n_tables)]  # strided, as in backward
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for kind in cfg["kinds"]:
        # the same rows and state from one step of each, on a small copy
        small = tables[0][:100_000].clone()
        ids = torch.randint(0, small.shape[0], (bags * bag,), generator=gen)
        got = {}
        for path in ("ours", "baseline"):
            w, st = small.clone(), _states(kind, small)
            _update(path, kernel, kind, w, grads[0], ids, offsets, st)
            got[path] = (w, *st)
        for a, b in zip(got["ours"], got["baseline"]):
            torch.testing.assert_close(a.float(), b.float(), **({} if dtype == torch.float32 else TOLERANCE_16))
        states = [_states(kind, w) for w in tables]  # one set for both paths: the timing needs no particular state
        times: dict[str, list[float]] = {"ours": [], "baseline": []}
        for rep in range(cfg["warmup"] + cfg["reps"]):
            for path in (("ours", "baseline") if rep % 2 == 0 else ("baseline", "ours")):
                ids = [torch.randint(0, rows, (bags * bag,), generator=gen) for _ in tables]
                t0 = time.perf_counter()
                for t, w in enumerate(tables):
                    _update(path, kernel, kind, w, grads[t], ids[t], offsets, states[t])
                if rep >= cfg["warmup"]:
                    times[path].append((time.perf_counter() - t0) / n_tables)
        ratios = [f / o for f, o in zip(times["baseline"], times["ours"])]
        out[kind] = {p: {"median": statistics.median(v), "min": min(v), "max": max(v)} for p, v in times.items()}
        out[kind]["ratio"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        out[kind]["baseline_label"] = BASELINES.get(kind, "fbgemm")
        del states
    if cfg["forward"]:
        out["pool_sum (forward)"] = _forward(cfg, kernel, tables, offsets, gen)
    return out


def _forward(cfg: dict, kernel: Any, tables: list, offsets: Any, gen: Any) -> dict[str, Any]:
    """The lookup's pooled sum over the same tables: ours vs fbgemm's forward kernel (checked equal first)."""
    import torch

    rows, dim = cfg["rows"], cfg["dim"]
    args = (torch.zeros(1, dtype=torch.int64), torch.tensor([0, dim], dtype=torch.int32), dim,
            torch.tensor([0, rows]))

    def fbgemm(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w_off, d_off, d, hash_cumsum = args
        return torch.ops.fbgemm.split_embedding_codegen_forward_cpu(w.view(-1), w_off, d_off, d, hash_cumsum, ids,
                                                                    offsets, 0, None, 0)

    ids = torch.randint(0, rows, (cfg["bags"] * cfg["bag"],), generator=gen)
    from torchrec_dtensor_bridge.kernels import Batch

    if not torch.equal(kernel.pool_tables(_one(tables[0]), Batch(ids, offsets)), fbgemm(tables[0], ids)):
        raise SystemExit("bench_sparse_update: the pooled sums differ from fbgemm's")
    times: dict[str, list[float]] = {"ours": [], "baseline": []}
    for rep in range(cfg["warmup"] + cfg["reps"]):
        for path in (("ours", "baseline") if rep % 2 == 0 else ("baseline", "ours")):
            batch = [torch.randint(0, rows, (cfg["bags"] * cfg["bag"],), generator=gen) for _ in tables]
            t0 = time.perf_counter()
            for w, i in zip(tables, batch):
                kernel.pool_tables(_one(w), Batch(i, offsets)) if path == "ours" else fbgemm(w, i)
            if rep >= cfg["warmup"]:
                times[path].append((time.perf_counter() - t0) / len(tables))
    ratios = [f / o for f, o in zip(times["baseline"], times["ours"])]
    res: dict[str, Any] = {p: {"median": statistics.median(v), "min": min(v), "max": max(v)} for p, v in times.items()}
    res["ratio"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    res["baseline_label"] = "fbgemm"
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--bags", type=int, default=4096, help="bags per table and update")
    parser.add_argument("--bag", type=int, default=20, help="ids per bag")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--kinds", default="sgd,rowwise_adagrad", help="comma-separated subset of " + ", ".join(KINDS))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="the tables' dtype")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for both paths (default 1, as in the training benchmark's ranks)")
    parser.add_argument("--no-forward", dest="forward", action="store_false",
                        help="skip the pooled sum (the lookup's forward) comparison")
    parser.add_argument("--out", type=Path, default=Path("bench/results.json"))
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or any(k not in KINDS for k in kinds):
        parser.error(f"--kinds: choose from {', '.join(KINDS)}, got {args.kinds!r}")
    if min(args.rows, args.dim, args.tables, args.bags, args.bag, args.reps, args.threads) < 1 or args.warmup < 0:
        parser.error("--rows, --dim, --tables, --bags, --bag, --reps and --threads must be >= 1")
    if args.dtype != "fp32" and "adam" in kinds:
        parser.error("--kinds adam: fp32 only (its baseline is the torch-op path)")
    cfg = {k: getattr(args, k) for k in ("rows", "dim", "tables", "bags", "bag", "reps", "warmup", "forward", "threads",
                                         "dtype")}
    cfg["kinds"] = kinds
    res = run(cfg)
    print(f"sparse update / pooled sum of one table ({cfg['rows']:,} x {cfg['dim']} {cfg['dtype']}, {cfg['tables']} tables, "
          f"{cfg['bags']} bags of {cfg['bag']} fresh random ids), {cfg['threads']} thread(s); ms per table, median [min .. max] "
          f"of {cfg['reps']}")
    for kind, r in res.items():
        o, f, q = r["ours"], r["baseline"], r["ratio"]
        print(f"  {kind:<18} {r['baseline_label']:<28} {f['median'] * 1e3:6.2f} [{f['min'] * 1e3:.2f} .. "
              f"{f['max'] * 1e3:.2f}]   ours {o['median'] * 1e3:6.2f} [{o['min'] * 1e3:.2f} .. {o['max'] * 1e3:.2f}]"
              f"   ratio {q['median']:.2f}x [{q['min']:.2f} .. {q['max']:.2f}]")
    record(args.out, "sparse_update" if cfg["dtype"] == "fp32" else f"sparse_update_{cfg['dtype']}",
           {"config": cfg, "kinds": res})
    return 0


if __name__ == "__main__":
    sys.exit(main())
