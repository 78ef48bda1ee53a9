"""Incremental checkpoint benchmark: incremental saves and chain loads against full ones, side by side.

Two local gloo ranks (spawned) hold ``--tables`` row-wise sharded fp32 tables of ``--rows`` x ``--dim``.
Training is simulated: each step adds to the rows of a batch of ids drawn from a Zipf law (exponent
``--zipf``, over a fixed random permutation of the rows, so hot rows are spread through the table as hashed
ids are). For each target share of changed rows (0.1 %, 1 %, 10 %: the number of steps that reaches it is
found first, on the ids alone), each repetition saves a full base, trains that many steps, then times an
incremental save (``base=``) and a full save of the same state, alternating their order:

* bytes written (the files of each new checkpoint generation), against the changed rows' bytes;
* durable save time (every file fsynced before the commit, as every save does) and the time the call
  blocked training (the same, for these synchronous saves; with ``--asynchronous`` the incremental save is
  also run asynchronously and the time until it returns is reported as its blocking time);
* the row digest overhead: the bytes of the digest files of a full save, against the tables' bytes.

With ``--tracked`` the tables are trained by ``FusedOptimizer(..., "sgd", track_changed_rows=True)`` (each
rank looks up its half of each step's ids, one id a bag): an incremental save then digests only the rows its
steps wrote (``torchrec_dtensor_bridge/tracking.py``). The full saves it is compared with save the same
memory through detached views, which the tracker does not follow (it counts from the last save of its
tensors, which must stay the incremental save's base).

With ``--dmp`` the same tables are those of a TorchRec ``DistributedModelParallel`` (an
``EmbeddingBagCollection`` of ``--tables`` row-wise tables, its fused kernel: fbgemm's ``EXACT_SGD`` in backward,
each rank looking up its half of each step's ids, one id a bag, through TorchRec's input dist); with ``--tracked``
too, ``tdb.track_changed_rows(dmp)`` reports the rows its steps write (``torchrec_dtensor_bridge/
torchrec_tracking.py``), without it the saves scan. Saved as ``{"model": dmp}``; the full saves go through
detached views of the DMP's shards, as above.

Then a chain of 10 incremental links at 1 % is built and loading its 1st, 5th and 10th link is timed against
loading a full checkpoint of the same state (page cache warm for both), and each chain load is checked to
give exactly the saved tables. One untimed save of each kind, and one load of each, come first.

    python scripts/bench_incremental.py --out bench/results.json            # 8 x 1M x 128 fp32
    python scripts/bench_incremental.py --small --reps 1 --out /tmp/r.json  # a quick check
    python scripts/bench_incremental.py --dmp --tracked --targets 0.01 --reps 3   # a DMP, 1 % changed
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_results import join_ranks, record, reported, spawn_ranks

TARGETS = (0.001, 0.01, 0.1)
CHAIN = (1, 5, 10)


def _ids_per_step(cfg: dict, seed: int):
    """A generator of each step's ids (global rows) for one table, Zipf-distributed over a permutation."""
    import torch

    g = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, cfg["rows"] + 1, dtype=torch.float64).pow(-cfg["zipf"])
    perm = torch.randperm(cfg["rows"], generator=g)
    while True:
        yield perm[torch.multinomial(weights, cfg["batch"], replacement=True, generator=g)]


def _steps_for(cfg: dict) -> dict[str, int]:
    """Steps of training after which each target share of rows has changed (one table's ids)."""
    import torch

    seen = torch.zeros(cfg["rows"], dtype=torch.bool)
    out, step, ids = {}, 0, _ids_per_step(cfg, 999)
    for target in TARGETS:
        while seen.float().mean().item() < target:
            seen[next(ids)] = True
            step += 1
        out[str(target)] = max(step, 1)
        seen.zero_()
        step = 0
    return out


def _dmp(cfg: dict):
    """A DMP over ``cfg["tables"]`` row-wise tables (``t0``, ... read by features ``f_t0``, ...) trained by TorchRec's
    fused kernel with fbgemm's ``EXACT_SGD``, over every rank."""
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torch import nn
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    class Model(nn.Module):
        def __init__(self, ebc: nn.Module) -> None:
            super().__init__()
            self.ebc = ebc

        def forward(self, kjt):
            return self.ebc(kjt)

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=cfg["dim"], num_embeddings=cfg["rows"],
                                   feature_names=[f"f_t{i}"]) for i in range(cfg["tables"])],
        device=torch.device("meta"))
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.001})
    world = dist.get_world_size()
    plan = sp.construct_module_sharding_plan(
        ebc, per_param_sharding={f"t{i}": sp.row_wise(compute_kernel="fused") for i in range(cfg["tables"])},
        sharder=sharder, local_size=world, world_size=world, device_type="cpu")
    return DistributedModelParallel(Model(ebc), env=ShardingEnv.from_process_group(dist.group.WORLD),
                                    device=torch.device("cpu"), plan=ShardingPlan({"ebc": plan}), sharders=[sharder])


def _gen_bytes(path: Path) -> tuple[int, int]:
    """(all bytes, digest bytes) of the files of the generation committed at ``path``."""
    from torchrec_dtensor_bridge.checkpoint.commit import resolve

    gen = Path(resolve(path))
    files = [f for f in gen.iterdir() if f.is_file()]
    return sum(f.stat().st_size for f in files), sum(f.stat().st_size for f in files if f.name.startswith("digests_"))


def _worker(rank: int, world: int, port: int, cfg: dict, out) -> None:
    join_ranks(rank, world, port)
    import torch
    import torch.distributed as dist

    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.layout import ShardLayout

    if cfg["dmp"]:
        from torchrec import KeyedJaggedTensor

    with reported(rank, out):
        root = Path(cfg["dir"])
        rows, dim = cfg["rows"], cfg["dim"]
        streams = [_ids_per_step(cfg, i) for i in range(cfg["tables"])]
        if cfg["dmp"]:  # the tables of a TorchRec DMP: its own shards (TorchRec's row-wise cut), as DTensors
            dmp = _dmp(cfg)
            if cfg["tracked"]:
                tdb.track_changed_rows(dmp)
            tables = tdb.state_dict_to_dtensor(dmp.state_dict())
            names = [f"ebc.embedding_bags.t{i}.weight" for i in range(cfg["tables"])]
            local = [tdb.convert.local_shards_of(tables[k])[0] for k in names]
            n = local[0].shape[0]
            state = {"model": dmp}
        else:
            lay = ShardLayout.row_wise((rows, dim), [rows // 2, rows - rows // 2])
            (spec,) = lay.shards_on(rank)
            lo, n = spec.offsets[0], spec.sizes[0]
            g = torch.Generator().manual_seed(rank)
            local = [torch.randn(n, dim, generator=g) for _ in range(cfg["tables"])]
            state = {f"t{i}": tdb.convert.dtensor_from_local_shards(lay.with_name(f"t{i}"), [local[i]])
                     for i in range(cfg["tables"])}
            if cfg["tracked"]:  # trained by a FusedOptimizer that reports the rows it writes
                weights = [state[f"t{i}"].requires_grad_() for i in range(cfg["tables"])]
                opt = tdb.FusedOptimizer(weights, "sgd", lr=0.001, track_changed_rows=True)

        def train(steps: int) -> None:
            for _ in range(steps):
                if cfg["dmp"]:  # each rank looks up its half of the step's ids, one id a bag, through the DMP
                    ids = [next(s)[rank::world] for s in streams]
                    kjt = KeyedJaggedTensor.from_lengths_sync(
                        keys=[f"f_t{i}" for i in range(cfg["tables"])], values=torch.cat(ids),
                        lengths=torch.ones(sum(len(i) for i in ids), dtype=torch.int64))
                    pooled = dmp(kjt)
                    (pooled.wait() if hasattr(pooled, "wait") else pooled).values().sum().backward()
                    continue
                if cfg["tracked"]:  # each rank looks up its half of the step's ids, one id a bag
                    ids = [next(s)[rank::world].view(-1, 1) for s in streams]
                    outs = tdb.sharded_embedding_bags(ids, weights, mode="sum", optimizer=opt)
                    sum(o.sum() for o in outs).backward()
                    continue
                for t, ids in zip(local, streams):
                    mine = next(ids)
                    mine = mine[(mine >= lo) & (mine < lo + n)] - lo
                    t[mine] += 0.001

        # the full saves compared with incremental ones: the same memory and work, not marked for the tracker
        # (it counts the rows written since the LAST save of its tensors; a full save in between would reset it)
        if cfg["dmp"]:
            aside = {"model": {k: v.detach() for k, v in tables.items()}}
        else:
            aside = {k: v.detach() for k, v in state.items()} if cfg["tracked"] else state

        def timed(fn) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            return (time.perf_counter() - t0) * 1e3

        table_bytes = cfg["tables"] * rows * dim * 4
        result: dict = {"rank": rank, "saves": {}, "loads": {}}
        tdb.checkpoint.save(state, root / "base")  # warm-up, not timed: the digest kernel's build, first files
        train(1)
        tdb.checkpoint.save(state, root / "inc", base=root / "base")
        tdb.checkpoint.save(aside, root / "full")
        for target, steps in cfg["steps"].items():
            if target not in cfg["targets"]:
                continue
            rec: dict[str, list] = {"incremental_ms": [], "full_ms": [], "incremental_bytes": [], "full_bytes": [],
                                    "changed_rows": [], "blocking_ms": []}
            for rep in range(cfg["reps"]):
                tdb.checkpoint.save(state, root / "base")
                train(steps)
                order = ["inc", "full"] if rep % 2 == 0 else ["full", "inc"]
                for which in order:
                    if which == "inc":
                        rec["incremental_ms"].append(timed(lambda: tdb.checkpoint.save(state, root / "inc",
                                                                                       base=root / "base")))
                    else:
                        rec["full_ms"].append(timed(lambda: tdb.checkpoint.save(aside, root / "full")))
                if cfg["asynchronous"]:
                    if cfg["tracked"]:  # the tracker counts from the last save (inc): a base and steps again
                        tdb.checkpoint.save(state, root / "base")
                        train(steps)
                    t0 = time.perf_counter()
                    handle = tdb.checkpoint.save(state, root / "inc-async", base=root / "base", asynchronous=True)
                    rec["blocking_ms"].append((time.perf_counter() - t0) * 1e3)
                    handle.result()
                else:
                    rec["blocking_ms"] = rec["incremental_ms"]
                if rank == 0:
                    info = tdb.checkpoint.inspect(root / "inc")
                    rec["changed_rows"].append(sum(info[k]["links"][0]["rows"] for k in info))
                    rec["incremental_bytes"].append(_gen_bytes(root / "inc")[0])
                    full, digests = _gen_bytes(root / "full")
                    rec["full_bytes"].append(full)
                    result["digest_bytes"] = digests
            result["saves"][target] = rec
        # chain loads: 10 links at 1 %, each against a full load of the same state
        tdb.checkpoint.save(state, root / "l0")
        want = {}
        for link in range(1, max(CHAIN) + 1):
            train(cfg["steps"]["0.01"])
            tdb.checkpoint.save(state, root / f"l{link}", base=root / f"l{link - 1}")
            if link in CHAIN:
                tdb.checkpoint.save(aside, root / f"f{link}")
                want[link] = [t.clone() for t in local]
        for link in CHAIN:
            dest_local = [torch.empty(n, dim) for _ in range(cfg["tables"])]
            if cfg["dmp"]:  # plain DTensors in the DMP's layouts, under its keys
                dest = {"model": {k: tdb.convert.dtensor_from_local_shards(tdb.layout_of(tables[k]), [dest_local[i]])
                                  for i, k in enumerate(names)}}
            else:
                dest = {f"t{i}": tdb.convert.dtensor_from_local_shards(lay.with_name(f"t{i}"), [dest_local[i]])
                        for i in range(cfg["tables"])}
            times: dict[str, list[float]] = {"chain_ms": [], "full_ms": []}
            tdb.checkpoint.load(dest, root / f"l{link}")  # warm-up, not timed
            tdb.checkpoint.load(dest, root / f"f{link}")
            for rep in range(cfg["reps"]):
                for which in (("chain", "full") if rep % 2 == 0 else ("full", "chain")):
                    path = root / (f"l{link}" if which == "chain" else f"f{link}")
                    times[f"{which}_ms"].append(timed(lambda: tdb.checkpoint.load(dest, path)))
                    if not all(torch.equal(a, b) for a, b in zip(dest_local, want[link])):
                        out.put({"rank": rank, "error": f"{which} load of link {link} differs", "traceback": "",
                                 "mismatch": True})
                        raise SystemExit(1)
            result["loads"][str(link)] = times
        result["table_bytes"] = table_bytes
        out.put(result)


def _med(xs: list[float]) -> float:
    return round(statistics.median(xs), 1) if xs else float("nan")


def summarize(results: list[dict], cfg: dict) -> dict:
    r0 = results[0]
    row_bytes = cfg["dim"] * 4
    saves = {}
    for target, rec in r0["saves"].items():
        changed = statistics.median(rec["changed_rows"])
        inc, full = _med(rec["incremental_ms"]), _med(rec["full_ms"])
        inc_b, full_b = statistics.median(rec["incremental_bytes"]), statistics.median(rec["full_bytes"])
        saves[target] = {
            "steps": cfg["steps"][target], "changed_rows": int(changed),
            "changed_share": round(changed / (cfg["tables"] * cfg["rows"]), 5),
            "incremental_bytes": int(inc_b), "full_bytes": int(full_b),
            "changed_rows_bytes": int(changed * row_bytes),
            "bytes_vs_bound": round(inc_b / (1.1 * changed * row_bytes + 0.02 * r0["table_bytes"]), 3),
            "incremental_ms": inc, "full_ms": full, "speedup": round(full / inc, 2),
            "blocking_ms": _med(rec["blocking_ms"]), "raw": rec,
        }
    loads = {link: {"chain_ms": _med(t["chain_ms"]), "full_ms": _med(t["full_ms"]),
                    "ratio": round(_med(t["chain_ms"]) / _med(t["full_ms"]), 2), "raw": t}
             for link, t in r0["loads"].items()}
    return {"config": {k: v for k, v in cfg.items() if k != "dir"}, "table_bytes": r0["table_bytes"],
            "digest_bytes": r0["digest_bytes"], "digest_share": round(r0["digest_bytes"] / r0["table_bytes"], 4),
            "saves": saves, "chain_loads": loads,
            "note": "rank 0's timings (every timed call ends in a barrier); loads with a warm page cache"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=None, help="ids per step and table (default rows / 2048)")
    parser.add_argument("--zipf", type=float, default=1.05)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="4 tables x 50k x 128: a quick check")
    parser.add_argument("--asynchronous", action="store_true", help="also time asynchronous incremental saves")
    parser.add_argument("--tracked", action="store_true",
                        help="train with FusedOptimizer(..., track_changed_rows=True): saves digest only the rows "
                             "its steps wrote (default: rows written directly, found by the full digest scan)")
    parser.add_argument("--dmp", action="store_true",
                        help="the tables of a TorchRec DistributedModelParallel trained by its fused kernel (EXACT_SGD); "
                             "with --tracked, tdb.track_changed_rows(dmp) reports the rows its steps write")
    parser.add_argument("--targets", type=float, nargs="+", default=list(TARGETS), choices=TARGETS,
                        help="the shares of changed rows to measure (default: all)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=Path("bench/results.json"))
    args = parser.parse_args(argv)
    if args.small:
        args.tables, args.rows = 4, 50_000
    cfg = {"tables": args.tables, "rows": args.rows, "dim": args.dim, "zipf": args.zipf, "reps": args.reps,
           "batch": args.batch or max(16, args.rows // 2048), "asynchronous": args.asynchronous,
           "tracked": args.tracked, "dmp": args.dmp, "targets": [str(t) for t in args.targets]}
    cfg["steps"] = _steps_for(cfg)
    work = Path(tempfile.mkdtemp(prefix="bench_incremental-", dir=args.dir))
    cfg["dir"] = str(work)
    try:
        result = summarize(spawn_ranks(_worker, 2, (cfg,), name="bench_incremental"), cfg)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record(args.out, "incremental" + ("_dmp" if args.dmp else "") + ("_tracked" if args.tracked else ""), result)
    brief = {t: {k: s[k] for k in ("changed_share", "incremental_bytes", "changed_rows_bytes", "bytes_vs_bound",
                                  "incremental_ms", "full_ms", "speedup", "blocking_ms")}
             for t, s in result["saves"].items()}
    print({"saves": brief, "chain_loads": {k: {x: v[x] for x in ("chain_ms", "full_ms", "ratio")}
                                           for k, v in result["chain_loads"].items()},
           "digest_share": result["digest_share"]}, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
