"""Training benchmark: ours (``tdb.FusedOptimizer``) vs TorchRec's fused kernel, on the same tables.

Workload (issue 12): 8 tables x 1,000,000 rows x 128 fp32 (4 GiB of tables, 2
GiB per rank), 2 local gloo ranks (one torch thread each: this machine has 2
cores), 2048 bags of 20 ids per rank and table, ``mode="sum"``. Two layouts,
each in its own fresh pair of processes (so neither inherits the other's heap):

* table-wise (table ``t`` on rank ``t % 2``) with SGD: TorchRec's
  ``EXACT_SGD`` vs ours ``FusedOptimizer(weights, "sgd")``;
* row-wise (a hand-made ``row_wise()`` plan: TorchRec's planner refuses
  row-wise on CPU) with row-wise Adagrad: TorchRec's ``EXACT_ROWWISE_ADAGRAD``
  vs ours ``"rowwise_adagrad"``.

TorchRec is a ``DistributedModelParallel`` over an EmbeddingBagCollection with
``compute_kernel="fused"`` (the optimizer runs inside backward), KJT input.
Ours are DTensors made ZERO-COPY from that DMP's own ``state_dict()``
(``tdb.state_dict_to_dtensor``), looked up with ONE
``tdb.sharded_embedding_bags(..., optimizer=opt)`` call: both paths read and
update the same memory, so page size, placement and first touch are the same
for both. Only the optimizer state is separate (TorchRec's inside its kernel,
ours in ``opt``); both start at zero. The tables are filled with seeded
uniform values before anything is timed (every page written once).

Checked before any timing, per layout: the forward of both paths is equal;
one training step of TorchRec from the initial tables and one step of ours
from the same (restored) tables give the same touched rows.

Timed, interleaved (ours, TorchRec, TorchRec, ours, ... the order alternates
every repetition), after warm-up:

* training step: forward + backward (with the update) of the loss
  ``sum_t (out_t * g_t).sum()`` (fixed random ``g``, same for both);
* forward only, under ``torch.no_grad`` (each sample the mean of ``--inner``
  calls);
* peak memory growth of each sample, per rank: ``VmHWM`` after the sample
  minus ``VmRSS`` before it, the high-water mark reset (``/proc/self/clear_refs``
  ``5``) and ``malloc_trim(0)`` called before each sample;
* "dense" baseline: ours without an optimizer (``.backward()`` makes the dense
  DTensor ``weight.grad``, then an SGD step on the local shards), fewer
  repetitions: every step costs O(table).

The rank processes run with glibc malloc held steady (``STEADY_MALLOC``: fixed
thresholds, no heap trimming below 256 MiB free; ``--malloc default`` for glibc's defaults, under
which a call's page faults, and so the ratios, vary between runs).

Ratios are TorchRec / ours per repetition (> 1: ours faster) and ours /
TorchRec for memory; reported as median and min..max over all repetitions of
all runs. ``--runs N`` repeats everything in N fresh pairs of processes.

``--dtype fp16`` makes every table fp16 (TorchRec's ``DataType.FP16``; its outputs stay fp32, and ours are asked
for fp32 too, ``output_dtype=torch.float32``); ours then runs with its default stochastic rounding, and the
one-step check allows one unit in the last place of fp16.

    python scripts/bench_train.py --reps 5 --out bench/results.json
    python scripts/bench_train.py --dtype fp16 --runs 3            # fp16 tables
    python scripts/bench_train.py --rows 100000 --reps 3      # small configuration
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_lookup import Mismatch, _check, _machine, _stats
from bench_results import join_ranks, record, spawn_ranks

LR = 0.01
EPS = 1e-8
TOL = 1e-4


@dataclasses.dataclass(frozen=True)
class Layout:
    """One side-by-side comparison: a TorchRec plan and optimizer and ours."""

    key: str
    label: str
    torchrec_optimizer: str  # fbgemm EmbOptimType member
    kind: str  # tdb.FusedOptimizer kind


LAYOUTS = {
    "tw": Layout("tw", "table-wise + SGD", "EXACT_SGD", "sgd"),
    "rw": Layout("rw", "row-wise + rowwise_adagrad", "EXACT_ROWWISE_ADAGRAD", "rowwise_adagrad"),
}


# ------------------------------------------------------------------ memory
_LIBC = ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else None


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


_MAX_RSS = [0]  # the largest VmHWM seen by this process, across the resets


def _max_rss() -> int:
    _MAX_RSS[0] = max(_MAX_RSS[0], _status_kib("VmHWM") * 1024)
    return _MAX_RSS[0]


def _reset_peak() -> int:
    """Give freed heap back to the OS, reset the RSS high-water mark; the current RSS in bytes."""
    _max_rss()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def _peak_growth(rss_before: int) -> int:
    return _status_kib("VmHWM") * 1024 - rss_before


# ----------------------------------------------------------------- workload
def _ids(cfg: dict, rank: int, table: int):
    import torch

    g = torch.Generator().manual_seed(1000 * rank + 10 * table + 7)
    return torch.randint(0, cfg["rows"], (cfg["batch"], cfg["bag"]), generator=g)


def _gw(cfg: dict, rank: int):
    """This rank's per-table weights of the loss ``sum_t (out_t * gw_t).sum()``."""
    import torch

    g = torch.Generator().manual_seed(50 + rank)
    return [torch.rand(cfg["batch"], cfg["dim"], generator=g) for _ in range(cfg["tables"])]


class _Model:
    """A module holding the EBC under ``ebc`` (the DMP's plan is keyed by module path)."""

    @staticmethod
    def make(ebc):
        import torch

        class Model(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.ebc = ebc

            def forward(self, kjt):
                return self.ebc(kjt)

        return Model()


class _Bench:
    """One rank's side of one layout: the DMP, our DTensors on its storage, the batch, the paths."""

    def __init__(self, cfg: dict, layout: Layout) -> None:
        import torch
        import torch.distributed as dist
        from torchrec import KeyedJaggedTensor

        import torchrec_dtensor_bridge as tdb

        self.cfg, self.layout = cfg, layout
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.names = [f"t{t}" for t in range(cfg["tables"])]
        self.dmp = self._dmp()
        sd = self.dmp.state_dict()
        keys = [f"ebc.embedding_bags.{n}.weight" for n in self.names]
        self._fill(sd, keys)
        # two sets of DTensor objects over the same storage: one for the fused optimizer,
        # one for the dense baseline (its .grad must not touch the fused set)
        dt = tdb.state_dict_to_dtensor(sd)
        self.w = [dt[k].requires_grad_() for k in keys]
        dt2 = tdb.state_dict_to_dtensor(sd)
        self.w_dense = [dt2[k].requires_grad_() for k in keys]
        self.opt = None if cfg["forward_only"] else tdb.FusedOptimizer(
            dict(zip(self.names, self.w)), layout.kind, lr=LR, **({"eps": EPS} if layout.kind != "sgd" else {}))
        self.ids = [_ids(cfg, self.rank, t) for t in range(cfg["tables"])]
        self.kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{t}" for t in range(cfg["tables"])],
            values=torch.cat([i.reshape(-1) for i in self.ids]),
            lengths=torch.full((cfg["tables"] * cfg["batch"],), cfg["bag"], dtype=torch.int64),
        )
        self.gw = _gw(cfg, self.rank)
        with torch.no_grad():
            order = list(self.dmp(self.kjt).keys())  # TorchRec's column order (tables grouped by rank)
        self.gw_torchrec = torch.cat([self.gw[int(k[1:])] for k in order], 1)

    def _dmp(self):
        import torch
        import torch.distributed as dist
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
        from torchrec.distributed.types import ShardingEnv, ShardingPlan

        from torchrec.distributed.comm_ops import set_gradient_division

        # TorchRec divides the embeddings' gradient by the world size by default (DDP's averaging);
        # ours applies the gradient summed over every rank's batch: compare the same update
        set_gradient_division(False)
        cfg = self.cfg
        from torchrec.modules.embedding_configs import DataType

        configs = [EmbeddingBagConfig(name=n, embedding_dim=cfg["dim"], num_embeddings=cfg["rows"],
                                      feature_names=[f"f{t}"], data_type=getattr(DataType, cfg["dtype"].upper()))
                   for t, n in enumerate(self.names)]
        ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        fused = {"optimizer": getattr(EmbOptimType, self.layout.torchrec_optimizer), "learning_rate": LR}
        if self.layout.kind != "sgd":
            fused["eps"] = EPS
        sharder = EmbeddingBagCollectionSharder(fused_params=fused)
        per_param = {n: (table_wise(rank=t % self.world, compute_kernel="fused") if self.layout.key == "tw"
                         else row_wise(compute_kernel="fused")) for t, n in enumerate(self.names)}
        plan = construct_module_sharding_plan(ebc, per_param_sharding=per_param, sharder=sharder,
                                              local_size=self.world, world_size=self.world, device_type="cpu")
        return DistributedModelParallel(
            _Model.make(ebc), env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
            plan=ShardingPlan({"ebc": plan}), sharders=[sharder], init_data_parallel=False)

    def _fill(self, sd: dict, keys: list[str]) -> None:
        """Seeded uniform values in every local shard (every page of the tables written once)."""
        import torch

        bound = self.cfg["rows"] ** -0.5
        for t, k in enumerate(keys):
            for s in sd[k].local_shards():
                g = torch.Generator().manual_seed(100 + 10 * t + s.metadata.shard_offsets[0])
                s.tensor.uniform_(-bound, bound, generator=g)

    # -- the paths
    def ours_forward(self):
        import torch

        import torchrec_dtensor_bridge as tdb

        with torch.no_grad():
            return tdb.sharded_embedding_bags(self.ids, self.w, mode="sum", output_dtype=torch.float32)

    def torchrec_forward(self):
        import torch

        with torch.no_grad():
            return self.dmp(self.kjt).values()

    def ours_step(self) -> None:
        import torchrec_dtensor_bridge as tdb

        import torch

        outs = tdb.sharded_embedding_bags(self.ids, self.w, mode="sum", optimizer=self.opt,
                                          output_dtype=torch.float32)  # TorchRec's outputs are fp32
        sum((o * g).sum() for o, g in zip(outs, self.gw)).backward()

    def torchrec_step(self) -> None:
        (self.dmp(self.kjt).values() * self.gw_torchrec).sum().backward()

    def dense_step(self) -> None:
        import torch

        import torchrec_dtensor_bridge as tdb
        from torchrec_dtensor_bridge.convert.dtensor import local_shards_of

        outs = tdb.sharded_embedding_bags(self.ids, self.w_dense, mode="sum", output_dtype=torch.float32)
        sum((o * g).sum() for o, g in zip(outs, self.gw)).backward()
        with torch.no_grad():
            for w in self.w_dense:
                for p, gr in zip(local_shards_of(w), local_shards_of(w.grad)):
                    p.add_(gr, alpha=-LR)
                w.grad = None

    # -- correctness, before any timing
    def verify(self) -> None:
        """Equal forwards; one step of each path from the same tables gives the reference's touched rows."""
        import torch

        from torchrec_dtensor_bridge.convert.dtensor import layout_of, local_shards_of

        with torch.no_grad():
            theirs = self.dmp(self.kjt).to_dict()
        for t, out in enumerate(self.ours_forward()):
            _check(f"{self.layout.key} forward, table {t}", out, theirs[f"f{t}"])
        if self.opt is None:
            return
        touched = []  # (where, local shard, touched local rows, values before, expected after one step)
        for t, w in enumerate(self.w):
            every, want = self._reference_step(t)
            for spec, shard in zip(layout_of(w).shards_on(self.rank), local_shards_of(w)):
                lo = spec.offsets[0]
                sel = (every >= lo) & (every < lo + spec.sizes[0])
                rows = every[sel] - lo
                before = shard[rows].clone().float()
                touched.append((f"table {t} rows {lo}+", shard, rows, before, want(before, sel)))
        for name, step in (("TorchRec", self.torchrec_step), ("ours", self.ours_step)):
            with torch.no_grad():
                for _, shard, rows, before, _ in touched:
                    shard[rows] = before.to(shard.dtype)
            step()
            for where, shard, rows, _, expected in touched:
                got = shard[rows].float()
                if shard.dtype != torch.float32:  # the fp32 update rounded: within one unit in the last place
                    tol = (expected.abs().max().item() + 1.0) * torch.finfo(shard.dtype).eps
                    _check(f"{self.layout.key} {name} training step ({self.layout.kind}), {where}", got,
                           expected.float(), tol=tol)
                else:
                    _check(f"{self.layout.key} {name} training step ({self.layout.kind}), {where}", got, expected)
        for w in self.w:
            if w.grad is not None:
                raise Mismatch(f"{self.layout.key}: the fused optimizer left a weight.grad")

    def _reference_step(self, t: int):
        """Table ``t``'s touched global rows (sorted) and a function giving one step's expected values
        from the rows' values before it: the optimizer on the gradient summed over every rank's batch,
        from zero optimizer state."""
        import torch

        cfg = self.cfg
        ids = [_ids(cfg, r, t) for r in range(self.world)]
        every = torch.cat([i.reshape(-1) for i in ids]).unique()
        grad = torch.zeros(every.numel(), cfg["dim"])
        for r, i in enumerate(ids):
            rows = _gw(cfg, r)[t].repeat_interleave(cfg["bag"], 0)  # d loss / d row, per id
            grad.index_add_(0, torch.searchsorted(every, i.reshape(-1)), rows)

        def want(before, sel):
            g = grad[sel]
            if self.layout.kind == "sgd":
                return before - LR * g
            m = (g * g).mean(1, keepdim=True)  # rowwise Adagrad's state after one step from 0
            return before - LR * g / (m.sqrt() + EPS)

        return every, want


# ------------------------------------------------------------------ timing
def _sample(fn: Callable[[], Any], inner: int) -> dict[str, float]:
    """One timed sample on every rank: wall seconds per call (between barriers), this process's CPU
    seconds per call (all its threads) and minor page faults per call."""
    import resource

    import torch.distributed as dist

    dist.barrier()
    c0, f0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    dist.barrier()
    dt = (time.perf_counter() - t0) / inner
    cpu = (time.process_time() - c0) / inner
    return {"s": dt, "cpu": cpu, "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / inner}


def interleaved(paths: dict[str, Callable[[], Any]], reps: int, warmup: int, inner: int = 1) -> dict[str, dict]:
    """Every path ``warmup + reps`` times, the order reversed every repetition: raw samples per path."""
    names = list(paths)
    out: dict[str, dict] = {n: {"s": [], "cpu": [], "faults": []} for n in names}
    for rep in range(warmup + reps):
        for n in (names if rep % 2 == 0 else names[::-1]):
            sample = _sample(paths[n], inner)
            if rep >= warmup:
                for k, v in sample.items():
                    out[n][k].append(v)
    return out


def peak_memory(paths: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[int]]:
    """Peak RSS growth (bytes) of one call of every path, ``reps`` times, interleaved.

    Apart from the timed samples: giving the heap back before each call makes that call fault its
    memory in again, which would bias the times against the path that allocates more.
    """
    import torch.distributed as dist

    names = list(paths)
    out: dict[str, list[int]] = {n: [] for n in names}
    for rep in range(reps):
        for n in (names if rep % 2 == 0 else names[::-1]):
            dist.barrier()
            rss = _reset_peak()
            paths[n]()
            out[n].append(_peak_growth(rss))
    return out


def _add_memory(samples: dict[str, dict], mem: dict[str, list[int]]) -> None:
    for path, m in mem.items():
        samples[path]["mem"] = m


def _worker(rank: int, world: int, port: int, cfg: dict, out: Any) -> None:
    join_ranks(rank, world, port)
    import gc

    import torch
    import torch.distributed as dist

    try:
        result: dict[str, Any] = {"rank": rank, "layouts": {}}
        for key in cfg["layouts"]:
            t0 = time.perf_counter()
            b = _Bench(cfg, LAYOUTS[key])
            b.verify()
            res: dict[str, Any] = {"setup_s": time.perf_counter() - t0}
            reps, warmup = cfg["reps"], cfg["warmup"]
            fwd = {"ours": b.ours_forward, "torchrec": b.torchrec_forward}
            res["forward"] = interleaved(fwd, reps, warmup, cfg["inner"])
            _add_memory(res["forward"], peak_memory(fwd, cfg["mem_reps"]))
            if not cfg["forward_only"]:
                step = {"ours": b.ours_step, "torchrec": b.torchrec_step}
                res["step"] = interleaved(step, reps, warmup)
                _add_memory(res["step"], peak_memory(step, cfg["mem_reps"]))
            if cfg["dense_reps"] and not cfg["forward_only"]:
                _reset_peak()  # the heap kept for the fused steps back to the OS before 2 GiB gradients come
                res["step"].update(interleaved({"dense": b.dense_step}, cfg["dense_reps"], 1))
                _add_memory(res["step"], peak_memory({"dense": b.dense_step}, 1))
            result["layouts"][key] = res
            del b
            gc.collect()
        result["max_rss_bytes"] = _max_rss()
        out.put(result)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.put({"rank": rank, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(),
                 "mismatch": isinstance(e, Mismatch)})
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------ results
def _ratio_stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


PHASES = {False: ("forward", "step"), True: ("forward",)}


# how the ranks' samples combine: wall time of the slower rank, CPU time and faults of both ranks
# together, memory of the rank that grew most
_MERGE = {"s": max, "cpu": sum, "faults": sum, "mem": max}


def _merge(ranks: list[dict], key: str, phase: str, path: str) -> dict[str, list[float]]:
    per = [r["layouts"][key][phase][path] for r in ranks]
    return {m: [f(p[m][i] for p in per) for i in range(len(per[0][m]))] for m, f in _MERGE.items()}


def summarize(runs: list[list[dict]], cfg: dict) -> dict[str, Any]:
    """Merge the ranks' samples of every run (see ``_MERGE``); ratios per repetition and per run."""
    summary: dict[str, Any] = {}
    for key in cfg["layouts"]:
        lay: dict[str, Any] = {"label": LAYOUTS[key].label, "runs": []}
        pooled: dict[str, dict[str, dict[str, list]]] = {}
        for ranks in runs:
            per_run: dict[str, Any] = {"setup_s": max(r["layouts"][key]["setup_s"] for r in ranks)}
            for phase in PHASES[cfg["forward_only"]]:
                per_run[phase] = {p: _merge(ranks, key, phase, p) for p in ranks[0]["layouts"][key][phase]}
                for p, merged in per_run[phase].items():
                    acc = pooled.setdefault(phase, {}).setdefault(p, {m: [] for m in _MERGE})
                    for m, xs in merged.items():
                        acc[m] += xs
                ours, theirs = per_run[phase]["ours"], per_run[phase]["torchrec"]
                per_run[phase]["speed_ratios"] = [t / o for t, o in zip(theirs["s"], ours["s"])]
                per_run[phase]["cpu_ratios"] = [t / o for t, o in zip(theirs["cpu"], ours["cpu"])]
                per_run[phase]["median_ratio"] = statistics.median(theirs["s"]) / statistics.median(ours["s"])
            lay["runs"].append(per_run)
        for phase, paths in pooled.items():
            lay[phase] = {p: {**_stats(v["s"]), **{m: _stats(v[m]) for m in _MERGE if m != "s"}}
                          for p, v in paths.items()}
            for r in ("speed_ratios", "cpu_ratios"):
                lay[phase][r[:-1]] = _stats([x for run in lay["runs"] for x in run[phase][r]])
            lay[phase]["run_median_ratios"] = [run[phase]["median_ratio"] for run in lay["runs"]]
            mo = [max(m, 1) for m in paths["ours"]["mem"]]
            mt = [max(m, 1) for m in paths["torchrec"]["mem"]]
            lay[phase]["mem_ratio"] = {  # ours / TorchRec (1 byte floor)
                "max": max(mo) / max(mt), "median": statistics.median(mo) / statistics.median(mt)}
            if "dense" in paths:
                lay[phase]["dense_vs_ours"] = statistics.median(paths["dense"]["s"]) / statistics.median(
                    paths["ours"]["s"])
        summary[key] = lay
    return summary


def _mib(b: float) -> str:
    return f"{b / 2**20:7.1f}"


def report(res: dict) -> None:
    """Print the side-by-side figures of :func:`run`'s result."""
    cfg = res["config"]
    dtype = cfg.get("dtype", "fp32")
    print(f"training: {cfg['tables']} tables x {cfg['rows']:,} rows x {cfg['dim']} {dtype} "
          f"({cfg['tables'] * cfg['rows'] * cfg['dim'] * (4 if dtype == 'fp32' else 2) / 2**30 / 2:.2f} GiB of "
          "tables per rank), "
          f"2 gloo ranks, 1 thread each, batch {cfg['batch']} per rank, bag {cfg['bag']}, sum; "
          f"{cfg['runs']} run(s) x {cfg['reps']} interleaved reps after {cfg['warmup']} warm-up "
          f"(forward samples: mean of {cfg['inner']} calls; dense: {cfg['dense_reps']} reps); "
          f"glibc malloc: {cfg['malloc']}")
    print("  wall ms: median [min .. max] per call, the slower rank; cpu ms: both ranks' processes together; "
          "faults: minor page faults per call, both ranks;\n  mem: peak RSS growth during one call, the rank "
          f"that grew most, median [min .. max] of {cfg['mem_reps']}; ratio = TorchRec / ours (> 1: ours faster)")
    for lay in res["layouts"].values():
        print(f"\n  {lay['label']}  (setup {statistics.median(r['setup_s'] for r in lay['runs']):.0f} s per run)")
        for phase in PHASES[cfg["forward_only"]][::-1]:
            ph = lay[phase]
            for path, label in (("torchrec", "TorchRec DMP (fused)"), ("ours", "ours (FusedOptimizer)"
                                if phase == "step" else "ours"), ("dense", "ours, dense grad + SGD")):
                if path not in ph:
                    continue
                s, m = ph[path], ph[path]["mem"]
                print(f"    {phase:<8}{label:<24}{s['median'] * 1e3:8.1f} ms [{s['min'] * 1e3:6.1f} .. "
                      f"{s['max'] * 1e3:6.1f}]  cpu {ph[path]['cpu']['median'] * 1e3:7.1f} ms  faults "
                      f"{ph[path]['faults']['median']:7.0f}  mem {m['median'] / 2**20:7.1f} MiB "
                      f"[{m['min'] / 2**20:.1f} .. {m['max'] / 2**20:.1f}]")
            r, c = ph["speed_ratio"], ph["cpu_ratio"]
            runs = ", ".join(f"{x:.2f}x" for x in ph["run_median_ratios"])
            print(f"    {phase:<8}TorchRec / ours: {r['median']:.2f}x [{r['min']:.2f} .. {r['max']:.2f}] over "
                  f"{r['n']} reps (per-run medians {runs}); cpu {c['median']:.2f}x [{c['min']:.2f} .. "
                  f"{c['max']:.2f}]")
            if phase == "step":
                mr = ph["mem_ratio"]
                print(f"    {phase:<8}memory ours / TorchRec: {mr['median']:.2f}x (medians), {mr['max']:.2f}x (peaks)")
                if "dense_vs_ours" in ph:
                    print(f"    {phase:<8}dense step time / fused step time: {ph['dense_vs_ours']:.1f}x")
    t = res["targets"]
    print(f"\n  targets: step TorchRec/ours >= {t['step']}x (goal {t['step_goal']}x); memory ours/TorchRec <= "
          f"{t['memory']}x; forward >= {t['forward']}x in every run's median")
    print(f"  largest resident set of a rank: {res['max_rss_bytes_per_rank'] / 2**30:.2f} GiB")
    for note in res["notes"]:
        print(f"  note: {note}")


NOTES = [
    "same storage: our DTensors are zero-copy views of the DMP's tables (tdb.state_dict_to_dtensor of its "
    "state_dict), so both paths update the same memory; only the optimizer states are separate",
    "memory = VmHWM after one call minus VmRSS before it (malloc_trim(0), then the high-water mark reset "
    "through /proc/self/clear_refs, before every call), measured apart from the timed samples",
    "times: each sample is between two barriers, the slower rank's time",
    "TorchRec runs with comm_ops.set_gradient_division(False): the update uses the gradient summed over the "
    "ranks' batches, as ours (by default TorchRec divides it by the world size); both paths are checked "
    "against a reference step before timing",
]


# glibc malloc held in a steady state in the rank processes (read by glibc at process start): a fixed
# mmap threshold (the largest glibc accepts) instead of the dynamic one, and no trimming of the heap's
# top below 256 MiB free. With glibc's defaults, whether a call's large buffers (the exchanges' 2-24
# MiB) come back from the heap or are page-faulted in again (and zeroed by the kernel) depends on the heap's history: it
# differs between runs and between samples of one run, by up to ~10,000 faults per call, which is
# what moved the forward ratio between runs (BENCHMARKS.md). Both paths run under the same setting.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(256 * 2**20),
                 "MALLOC_TOP_PAD_": str(64 * 2**20)}


def _one_run(cfg: dict) -> list[dict]:
    """One run: each layout in its own fresh pair of processes (no heap history from another layout or its
    dense baseline), the ranks' results merged."""
    ranks: list[dict] = []
    for key in cfg["layouts"]:
        got = spawn_ranks(_worker, 2, ({**cfg, "layouts": [key]},), name="bench_train")
        if not ranks:
            ranks = got
            continue
        for mine, more in zip(ranks, got):
            mine["layouts"].update(more["layouts"])
            mine["max_rss_bytes"] = max(mine["max_rss_bytes"], more["max_rss_bytes"])
    return ranks


def run(cfg: dict) -> dict:
    """Run the benchmark ``cfg["runs"]`` times (fresh processes each) and summarize."""
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    saved = {k: os.environ.get(k) for k in STEADY_MALLOC}
    if cfg["malloc"] == "steady":
        os.environ.update(STEADY_MALLOC)
    try:
        runs = [_one_run(cfg) for _ in range(cfg["runs"])]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    res = {
        "config": cfg,
        "machine": _machine(load_before),
        "layouts": summarize(runs, cfg),
        "max_rss_bytes_per_rank": max(r["max_rss_bytes"] for ranks in runs for r in ranks),
        "targets": {"step": 1.2, "step_goal": 1.5, "memory": 1.2, "forward": 1.0},
        "notes": NOTES + ([f"machine busy while measured (1-min load average {load_before[0]:.1f} on "
                           f"{os.cpu_count()} cores): figures are noisy"] if load_before[0] > 0.5 else []),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "THP_", "OMP_", "GLIBC_"))}
        | (STEADY_MALLOC if cfg["malloc"] == "steady" else {}),
        "seconds": time.perf_counter() - t_start,
    }
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows per table")
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2048, help="bags per rank and table")
    parser.add_argument("--bag", type=int, default=20, help="ids per bag")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per path and run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--inner", type=int, default=3, help="forward calls per forward sample")
    parser.add_argument("--mem-reps", type=int, default=3, help="single calls per path measuring peak memory")
    parser.add_argument("--dense-reps", type=int, default=2, help="repetitions of the dense baseline (0: skip)")
    parser.add_argument("--runs", type=int, default=1, help="fresh pairs of processes, each a full run")
    parser.add_argument("--layouts", default="tw,rw", help="comma-separated subset of: " + ", ".join(LAYOUTS))
    parser.add_argument("--forward-only", action="store_true",
                        help="time the forward only (no optimizer needed; for studying the forward)")
    parser.add_argument("--malloc", choices=("steady", "default"), default="steady",
                        help="glibc malloc in the rank processes: steady (fixed thresholds, little heap trimming; "
                        "see STEADY_MALLOC) or glibc's default (page faults per call vary between runs)")
    parser.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32",
                        help="the tables' dtype (TorchRec's DataType); bf16 has no TorchRec CPU kernel to compare "
                             "with (fbgemm-gpu-cpu 1.8 has none)")
    parser.add_argument("--out", type=Path, default=Path("bench/results.json"))
    args = parser.parse_args(argv)
    layouts = [k for k in args.layouts.split(",") if k]
    if not layouts or any(k not in LAYOUTS for k in layouts):
        parser.error(f"--layouts: choose from {', '.join(LAYOUTS)}, got {args.layouts!r}")
    if min(args.reps, args.runs, args.inner, args.mem_reps) < 1 or args.warmup < 0 or args.dense_reps < 0:
        parser.error("--reps, --runs, --inner and --mem-reps must be >= 1; --warmup and --dense-reps >= 0")
    if args.dim % 4:
        parser.error(f"--dim must be a multiple of 4 (TorchRec's kernels), got {args.dim}")
    names = ("rows", "tables", "dim", "batch", "bag", "reps", "warmup", "inner", "dense_reps", "mem_reps", "runs",
             "forward_only", "malloc", "dtype")
    cfg = {k: getattr(args, k) for k in names} | {"layouts": layouts}
    import torchrec_dtensor_bridge as tdb

    if not args.forward_only and not hasattr(tdb, "FusedOptimizer"):
        raise SystemExit("bench_train: this torchrec_dtensor_bridge has no FusedOptimizer (use --forward-only)")
    res = run(cfg)
    report(res)
    m = res["machine"]
    print(f"\n  total {res['seconds']:.0f} s on {m['cpus']} x {m['cpu']}; 1-min load average "
          f"{m['loadavg_1m_before']:.1f} before, {m['loadavg_1m_after']:.1f} after (above ~0.5 means other jobs ran)")
    record(args.out, "train" if args.dtype == "fp32" else f"train_{args.dtype}", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
