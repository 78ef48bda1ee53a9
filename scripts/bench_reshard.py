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
  share on the rank (its weights and its per-row state, 4 bytes a row) + 64 MiB;
* the checkpoint round trip to the same plan: ``tdb.checkpoint.save`` of the model and optimizer under the
  old plan, then ``tdb.checkpoint.load`` into a model and optimizer under the new plan (built beforehand,
  not timed), the page cache warm (the save has just written the files);
* both results checked: every table's and state's sum over its blocks (all ranks) equals the one before.

With ``--dmp`` (on by default; ``--no-shard-module`` runs it alone) the same tables are those of a TorchRec
``DistributedModelParallel`` over an ``EmbeddingBagCollection`` (fused row-wise Adagrad, a dense layer in
the data-parallel wrapper), and each move runs ``tdb.reshard(dmp, plan)`` and TorchRec's own
``dmp.reshard(output_sharding_plans_delta(...))`` on fresh DMPs, the order alternating by repetition:
table-wise -> table-wise on the next rank, column-wise -> column-wise with the column blocks on the ranks
in reverse, and column-wise -> table-wise (ours only: TorchRec 1.8's reshard keeps a table's sharding type;
see ``TORCHREC_ABSENT``). Per move and rank: the time, the bytes sent (ours against the changing blocks'),
the peak memory above the larger of the memory before and after against the same bound as above (the
largest table's new share + 64 MiB; TorchRec's takes the rank's new share of the whole module: it allocates
the rebuilt module's tables at once, zero-filled, and frees the old ones only with the old module), the memory
after the call less before, and what a ``gc.collect()`` then frees (TorchRec's old module is kept
by reference cycles until the collector runs; ``tdb.reshard`` breaks them), and a check that every rank
holds the planned blocks with the values they held before (``torch.equal``; the per-row state of a table whose column blocks join: the mean
of theirs, to 1e-6), for each implementation apart, so that both hold the same tables. What
TorchRec's reshard needs on gloo: every rank hashing strings alike (``PYTHONHASHSEED``, set here before the
ranks start: its point-to-point tags are Python's ``hash()`` of the table name, and gloo matches tags, so
differing seeds leave every receive waiting), a data-parallel wrapper (it rebuilds the fused optimizer
from ``_dmp_wrapped_module.module``), and no block staying on its rank inside a moved table (it sends
such a block to its own rank, which gloo refuses).

    python scripts/bench_reshard.py --reps 2 --out bench/results.json
    python scripts/bench_reshard.py --rows 250000 --reps 1      # a smaller run (1 GiB)
    python scripts/bench_reshard.py --no-shard-module --reps 2  # the DMP moves alone
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
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


def _measured(fn: Any) -> dict[str, Any]:
    """``fn()`` between barriers: its time, the bytes this rank sent (counted around ``batch_isend_irecv``), its
    peak memory (``VmHWM``, reset before) above the larger of the rank's memory before and after and above the
    memory before, and its memory after less before."""
    import torch.distributed as dist

    sent, real = [0], dist.batch_isend_irecv

    def counting(p2p_op_list: list[dist.P2POp]) -> list[dist.Work]:
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in p2p_op_list if op.op is dist.isend)
        return real(p2p_op_list)

    dist.barrier()
    rss = _status("VmRSS")
    _reset_peak()
    dist.batch_isend_irecv = counting
    try:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
    finally:
        dist.batch_isend_irecv = real
    peak, after = _status("VmHWM"), _status("VmRSS")
    dist.barrier()
    return {"s": dt, "sent_bytes": sent[0], "peak_growth_bytes": peak - max(rss, after),
            "peak_above_before_bytes": peak - rss, "rss_change_bytes": after - rss}


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
                m = _measured(lambda: tdb.reshard(model, dst, optimizers=[opt]))  # ours, in memory
                assert _same(_sums(model, opt), want), "the reshard changed a value"
                share = max(sum((s.numel + s.sizes[0]) * 4 for s in lay.shards_on(rank)) for lay in dst.values())
                steps.append({
                    "rep": rep, "step": f"{CYCLE[i]} -> {CYCLE[i + 1]}", "reshard_s": m["s"],
                    "checkpoint_save_s": t1 - t0,
                    "checkpoint_load_s": t2 - t1, "sent_bytes": m["sent_bytes"],
                    "changing_bytes": _changing_bytes(src, dst, rank), "peak_growth_bytes": m["peak_growth_bytes"],
                    "bound_bytes": share + (64 << 20),
                })
        out.put({"rank": rank, "steps": steps})


# -- a TorchRec DMP: ours against TorchRec's own DistributedModelParallel.reshard ---------------------------------

DMP_MOVES = [("table_wise", "table_wise_moved"), ("column_wise", "column_wise_moved"), ("column_wise", "table_wise")]
TORCHREC_ABSENT = {  # why TorchRec 1.8's reshard does not make a move
    ("column_wise", "table_wise"): "TorchRec's reshard keeps a table's sharding type: update_module_sharding_plan "
    "(sharding/dynamic_sharding.py) looks the table up under its new type only, so update_shards builds that "
    "type's sharding from no table (IndexError, embeddingbag.py:978) or, where the module has tables of that "
    "type, leaves the table under its old one (RuntimeError, embeddingbag.py:1430)"}


def _ebc_and_sharder(cfg: dict) -> tuple[Any, Any]:
    """An ``EmbeddingBagCollection`` of ``cfg``'s tables ``t0``, ... on the meta device, and the sharder that
    trains them with TorchRec's fused row-wise Adagrad."""
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name=f"t{i}", embedding_dim=cfg["dim"], num_embeddings=cfg["rows"], feature_names=[f"f{i}"])
        for i in range(cfg["tables"])], device=torch.device("meta"))
    return ebc, EmbeddingBagCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01, "eps": 1e-3})


def dmp_plan(kind: str, cfg: dict) -> Any:
    """The ``ShardingPlan`` of the DMP's ``ebc``: table ``i`` table-wise on rank ``i % world`` (``_moved``: the
    next rank), or column-wise over every rank (``_moved``: the column blocks on the ranks in reverse)."""
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.types import ShardingPlan

    world, shift = cfg["world"], int(kind.endswith("_moved"))
    make = {"table_wise": lambda i: sp.table_wise(rank=(i + shift) % world, compute_kernel="fused"),
            "column_wise": lambda i: sp.column_wise(ranks=list(range(world))[::1 - 2 * shift],
                                                     compute_kernel="fused")}[kind.removesuffix("_moved")]
    ebc, sharder = _ebc_and_sharder(cfg)
    return ShardingPlan({"ebc": sp.construct_module_sharding_plan(
        ebc, per_param_sharding={f"t{i}": make(i) for i in range(cfg["tables"])}, sharder=sharder,
        local_size=world, world_size=world, device_type="cpu")})


def _dmp_job(kind: str, cfg: dict) -> Any:
    """A DMP over the ``EmbeddingBagCollection`` under plan ``kind`` and a dense layer (TorchRec's reshard needs
    the data-parallel wrapper), every table and per-row state filled by :func:`_dmp_values`."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    model = nn.Module()
    model.dense = nn.Linear(4, 1)
    model.ebc, sharder = _ebc_and_sharder(cfg)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), sharders=[sharder],
                                   device=torch.device("cpu"), plan=dmp_plan(kind, cfg))
    _dmp_values(dmp, cfg, fill=True)
    return dmp


def _dmp_values(dmp: Any, cfg: dict, *, fill: bool, combined: bool = False) -> bool:
    """Fill (``fill``) or compare (``torch.equal``) every local block of the tables and per-row states with values
    set by their global place: weight ``[r, c]`` of table ``i`` ``((131 r + 7 c + 1009 i) % 8191) / 8192``,
    per-row state ``[g]`` (``g``: block ``k``'s row ``r`` at ``k * rows + r``) ``((37 g + 11 i) % 4093) / 4096``;
    ``combined``: a table now in one column block whose state was in ``world`` equal ones holds each row's mean
    (compared within 1e-6)."""
    import torch

    def block(o: list[int], n: list[int], i: int) -> Any:
        if len(o) == 2:
            r = torch.arange(o[0], o[0] + n[0]).unsqueeze(1) * 131
            return ((r + torch.arange(o[1], o[1] + n[1]) * 7 + 1009 * i) % 8191).float() / 8192
        g = torch.arange(o[0], o[0] + n[0])
        if combined:
            w = torch.stack([((g + k * cfg["rows"]) * 37 + 11 * i) % 4093 for k in range(cfg["world"])]).double()
            return (w.mean(0) / 4096).float()
        return ((g * 37 + 11 * i) % 4093).float() / 4096

    state = dmp.fused_optimizer.state_dict()["state"]
    for key, v in ((k, v) for k, v in dmp.state_dict().items() if k.startswith("ebc.")):
        i = int(key.split(".")[-2][1:])
        for st in [v] + ([state[key][f"t{i}.momentum1"]] if key in state else []):  # the rank's tables only
            for shard in st.local_shards():
                o, n = list(shard.metadata.shard_offsets), list(shard.metadata.shard_sizes)
                for lo in range(0, n[0], 1 << 16):  # 64 Ki rows at a time
                    want = block([o[0] + lo] + o[1:], [min(1 << 16, n[0] - lo)] + n[1:], i)
                    got = shard.tensor[lo:lo + want.shape[0]]
                    if fill:
                        got.copy_(want)
                    elif not (torch.allclose(got, want, rtol=1e-6, atol=0) if combined and st is not v
                              else torch.equal(got, want)):
                        return False
    return True


def _planned(plan: Any, rank: int) -> list[tuple[str, list[int], list[int]]]:
    """The weight blocks ``(table, offsets, sizes)`` ``plan`` gives ``rank``."""
    return sorted((t, list(s.shard_offsets), list(s.shard_sizes)) for t, ps in plan.plan["ebc"].items()
                  for s in ps.sharding_spec.shards if s.placement.rank() == rank)


def _dmp_changing_bytes(src: Any, dst: Any, rank: int, world: int) -> int:
    """The bytes ``rank`` sends: each overlap of one of its old blocks with another rank's new block, weights
    (4 bytes an element) and the old block's per-row state over the overlap's rows (4 bytes a row)."""
    from torchrec_dtensor_bridge.layout import box_intersection

    theirs = [b for q in range(world) if q != rank for b in _planned(dst, q)]
    boxes = [box_intersection(o, n, d_o, d_n) for t, o, n in _planned(src, rank) for u, d_o, d_n in theirs if u == t]
    return sum(4 * b[1][0] * (b[1][1] + 1) for b in boxes if b)


def _dmp_worker(rank: int, world: int, port: int, cfg: dict, out: Any) -> None:
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD, as in _worker
    join_ranks(rank, world, port, timeout_s=1800)
    import gc

    import torch.distributed as dist
    from torchrec.distributed.sharding.dynamic_sharding import output_sharding_plans_delta

    import torchrec_dtensor_bridge as tdb

    with reported(rank, out):
        cfg = dict(cfg, world=world)
        hashes: list[Any] = [None] * world
        dist.all_gather_object(hashes, hash("t0"))  # TorchRec's tags: hash() of the table name
        impls = {"ours": lambda dmp, dst: tdb.reshard(dmp, dmp_plan(dst, cfg)),  # fresh plans: TorchRec changes them
                 "torchrec": lambda dmp, dst: dmp.reshard(output_sharding_plans_delta(
                     dmp.plan.plan, dmp_plan(dst, cfg).plan), sharded_module_fqn="ebc")}
        steps: list[dict] = []
        for rep in range(cfg["reps"]):
            for src, dst in DMP_MOVES:
                names = ["ours"] + ["torchrec"] * (len(set(hashes)) == 1 and (src, dst) not in TORCHREC_ABSENT)
                for name in names[::1 if rep % 2 == 0 else -1]:  # interleaved: the order alternates
                    dmp = _dmp_job(src, cfg)
                    gc.collect()
                    m = _measured(lambda: impls[name](dmp, dst))
                    held = sorted((k.split(".")[-2], list(s.metadata.shard_offsets), list(s.metadata.shard_sizes))
                                  for k, v in dmp.state_dict().items() if k.startswith("ebc.")
                                  for s in v.local_shards())
                    new = _planned(dmp_plan(dst, cfg), rank)
                    per_table: dict[str, int] = {}  # each table's new share: weights and per-row state
                    for t, _, n in new:
                        per_table[t] = per_table.get(t, 0) + 4 * n[0] * (n[1] + 1)
                    steps.append(m | {
                        "rep": rep, "step": f"{src} -> {dst}", "impl": name,
                        "changing_bytes": _dmp_changing_bytes(dmp_plan(src, cfg), dmp_plan(dst, cfg), rank, world),
                        "new_share_bytes": sum(4 * n[0] * n[1] for *_, n in new),
                        "bound_bytes": max(per_table.values(), default=0) + (64 << 20),
                        "equal": held == new and _dmp_values(dmp, cfg, fill=False, combined=(
                            src.startswith("column") and dst == "table_wise"))})
                    rss = _status("VmRSS")
                    gc.collect()  # the old module's storage is freed only here (reference cycles), ours and TorchRec's
                    steps[-1]["freed_by_gc_bytes"] = rss - _status("VmRSS")
                    del dmp
                    gc.collect()
        out.put({"rank": rank, "steps": steps, "hashes": hashes})


def summarize_dmp(per_rank: list[dict], cfg: dict) -> dict:
    """Per move: each implementation's median over repetitions of the slowest rank's time (and TorchRec's over
    ours, or why it is absent), every rank's median time, bytes sent and largest peak growth, and whether every
    rank held the planned blocks with the values they should."""
    out: dict[str, Any] = {"config": cfg, "same_hash": len(set(per_rank[0]["hashes"])) == 1, "steps": {}}
    for src, dst in DMP_MOVES:
        name, entry = f"{src} -> {dst}", dict[str, Any]()
        for impl in ("ours", "torchrec"):
            rows = [[s for s in r["steps"] if s["step"] == name and s["impl"] == impl] for r in per_rank]
            if rows[0]:
                entry[impl] = {
                    "s": statistics.median(slowest := [max(r[i]["s"] for r in rows) for i in range(len(rows[0]))]),
                    "s_reps": slowest,
                    "equal": all(s["equal"] for r in rows for s in r),
                    "per_rank": [{"rank": per_rank[k]["rank"], "s": statistics.median(s["s"] for s in r)}
                                 | {m: max(s[m] for s in r) for m in ("peak_growth_bytes", "peak_above_before_bytes",
                                                                      "rss_change_bytes", "freed_by_gc_bytes")}
                                 | {m: r[0][m] for m in ("sent_bytes", "changing_bytes", "new_share_bytes",
                                                         "bound_bytes")}
                                 for k, r in enumerate(rows)]}
        if "torchrec" in entry:
            entry["speedup"] = entry["torchrec"]["s"] / entry["ours"]["s"]
        else:
            entry["torchrec_absent"] = TORCHREC_ABSENT.get((src, dst), "the ranks hash strings differently "
                                                           "(PYTHONHASHSEED unset): TorchRec's message tags differ")
        out["steps"][name] = entry
    return out


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


def run_shard_module(args: argparse.Namespace) -> list[str]:
    """The ``shard_module`` cycle, recorded as ``reshard``; the steps whose bytes sent differ from the changing
    blocks'."""
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
    return [n for n, s in result["steps"].items() if any(r["sent_bytes"] != r["changing_bytes"]
                                                         for r in s["per_rank"])]


def run_dmp(args: argparse.Namespace) -> list[str]:
    """The DMP moves, recorded as ``reshard_dmp``; the moves where a rank held other blocks or values than it
    should, or ours sent other bytes than the changing blocks'."""
    os.environ["PYTHONHASHSEED"] = "0"  # the spawned ranks hash strings alike (TorchRec's message tags)
    cfg = {"tables": args.tables, "rows": args.rows, "dim": args.dim, "reps": args.reps}
    result = summarize_dmp(spawn_ranks(_dmp_worker, 2, (cfg,), name="bench_reshard --dmp"), cfg)
    record(args.out, "reshard_dmp", result)
    bad = []
    for name, s in result["steps"].items():
        for impl, e in ((i, s[i]) for i in ("ours", "torchrec") if i in s):
            ranks = ", ".join("rank {rank}: {s:.3f} s, sent {sent_bytes:.1f} MiB (changing {changing_bytes:.1f}), "
                              "peak +{peak_growth_bytes:.1f} MiB above steady (bound {bound_bytes:.1f}; "
                              "+{peak_above_before_bytes:.1f} above before, the module's new share "
                              "{new_share_bytes:.1f}; +{rss_change_bytes:.1f} after the call, "
                              "{freed_by_gc_bytes:.1f} freed by gc)".format(
                                  **{k: v / 2**20 if k.endswith("_bytes") else v for k, v in r.items()})
                              for r in e["per_rank"])
            print(f"DMP {name:34s} {impl:8s} {e['s']:7.3f} s{'' if e['equal'] else ' WRONG'}  {ranks}")
            if not e["equal"] or impl == "ours" and any(r["sent_bytes"] != r["changing_bytes"] for r in e["per_rank"]):
                bad.append(f"{name} ({impl})")
        print(f"DMP {name:34s} " + (f"TorchRec's time / ours: {s['speedup']:.2f}x" if "speedup" in s
                                    else f"torchrec absent: {s['torchrec_absent']}"))
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--shard-module", action=argparse.BooleanOptionalAction, default=True,
                        help="the shard_module cycle against a checkpoint round trip (default: on)")
    parser.add_argument("--dmp", action=argparse.BooleanOptionalAction, default=True,
                        help="a TorchRec DMP: ours against TorchRec's DMP.reshard (default: on)")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: under ./bench)")
    parser.add_argument("--out", type=Path, default=Path("bench/results.json"))
    args = parser.parse_args(argv)
    bad = run_shard_module(args) if args.shard_module else []
    if bad:
        print(f"bench_reshard: bytes sent differ from the changing blocks' bytes in {bad}", file=sys.stderr)
    dmp_bad = run_dmp(args) if args.dmp else []
    if dmp_bad:
        print(f"bench_reshard --dmp: wrong blocks, values or bytes in {dmp_bad}", file=sys.stderr)
    return 1 if bad or dmp_bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
