"""Plots for BENCHMARKS.md from bench/results.json (written by the scripts/bench_*.py runs).

    python scripts/plot_bench.py --results bench/results.json --out bench/
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_convert(res: dict, out: Path) -> Path:
    sizes = res["sizes"]
    mb = [s["bytes"] / 2**20 for s in sizes]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (("ours", "ours: to_dtensor + to_sharded_tensor (4 uneven shards)"),
                       ("upstream_minimal", "upstream minimum: DTensor.from_local + ShardedTensor init")):
        med = [s[key]["median"] * 1e6 for s in sizes]
        lo = [m - s[key]["min"] * 1e6 for m, s in zip(med, sizes)]
        hi = [s[key]["max"] * 1e6 - m for m, s in zip(med, sizes)]
        ax.errorbar(mb, med, yerr=[lo, hi], marker="o", capsize=3, label=label)
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("table size (MiB)")
    ax.set_ylabel("microseconds per table")
    ax.set_title("Conversion cost does not grow with table bytes")
    ax.legend(fontsize=7)
    return _save(fig, out / "convert.png")


def plot_checkpoint(res: dict, out: Path) -> Path:
    gib = res["gib"]
    labels = ["plain dcp.save", "ours save", "plain dcp.load", "ours load", "ours load\n(staged)"]
    keys = ["dcp_save", "ours_save", "dcp_load", "ours_load", "ours_load_staged"]
    rates = [gib / res[k]["median"] for k in keys]
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    ax.bar(labels, rates, color=["#999", "#1f77b4", "#999", "#1f77b4", "#aec7e8"])
    ax.tick_params(axis="x", labelsize=8)
    ax.axhline(res["dd_write_gib_s"], color="r", linestyle="--", label=f"dd write (fdatasync) {res['dd_write_gib_s']:.2f} GiB/s")
    ax.set_ylabel("GiB/s (median)")
    ax.set_title(f"Checkpoint throughput, {gib:.1f} GiB on 2 gloo ranks")
    ax.legend(fontsize=8)
    return _save(fig, out / "checkpoint.png")


_LOOKUP_LABELS = {
    "ours_tw": "ours, table-wise (one call)",
    "ours_tw_per_table": "ours, table-wise (call per table)",
    "torchrec_tw": "TorchRec DMP, table-wise (fused)",
    "ours_cw": "ours, column-wise",
    "torchrec_cw": "TorchRec DMP, column-wise (fused)",
    "ours_rw": "ours, row-wise",
    "torchrec_rw": "TorchRec DMP, row-wise (fused, hand-made plan)",
    "upstream_rw": "upstream DTensor F.embedding, row-wise",
}
_LOOKUP_COLORS = {"ours_cw": "#9467bd", "torchrec_cw": "#c5b0d5", "torchrec_rw": "#98df8a",
                  "ours_tw": "#1f77b4", "ours_tw_per_table": "#aec7e8", "torchrec_tw": "#999", "ours_rw": "#2ca02c", "upstream_rw": "#bbb"}


def _err(stats: list[dict], scale: float = 1.0) -> tuple[list[float], list[list[float]]]:
    med = [s["median"] * scale for s in stats]
    return med, [[m - s["min"] * scale for m, s in zip(med, stats)], [s["max"] * scale - m for m, s in zip(med, stats)]]


def plot_lookup(res: dict, out: Path) -> list[Path]:
    """lookup.png (2-rank times and the local lookup's GB/s), lookup_batch.png, lookup_world.png."""
    cfg = res["config"]
    made = []
    w2 = res["world"]["2"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [7, 3]})
    phases = [p for p in ("forward", "forward_backward") if p in w2]
    width = 0.8 / len(_LOOKUP_LABELS)
    for i, key in enumerate(k for k in _LOOKUP_LABELS if k in w2[phases[0]]):
        med, err = _err([w2[p][key] for p in phases], 1e3)
        xs = [j + (i - (len(_LOOKUP_LABELS) - 1) / 2) * width for j in range(len(phases))]
        ax.bar(xs, med, width, yerr=err, capsize=2, color=_LOOKUP_COLORS[key], label=_LOOKUP_LABELS[key],
               hatch="//" if key.startswith("ours") else None, edgecolor="k", linewidth=0.3)
    ax.set_xticks(range(len(phases)), [p.replace("_", " + ") for p in phases])
    ax.set_yscale("log")
    ax.set_ylim(top=ax.get_ylim()[1] * 4)  # room for the legend above the bars
    ax.set_ylabel("ms per step (median, min..max)")
    ax.set_title(f"{cfg['tables']} tables x {cfg['rows']:,} x {cfg['dim']}, batch {cfg['batch']}/rank, 2 gloo ranks",
                 fontsize=9)
    ax.legend(fontsize=6, ncol=3, loc="upper left")
    loc = res["local"]
    keys = ["copy", "copy_table", "ours_pool_rows", "torch_embedding_bag"]
    labels = [f"copy {loc['copy_bytes'] // 2**20} MiB", f"copy {loc['shard_bytes'] / 2**20:.0f} MiB",
              "ours (TBE)", "F.embedding_bag"]
    gbs = [loc[k]["gb_s"] for k in keys]
    lo = [g - loc[k]["gb_s_min"] for g, k in zip(gbs, keys)]
    hi = [loc[k]["gb_s_max"] - g for g, k in zip(gbs, keys)]
    ax2.bar(labels, gbs, yerr=[lo, hi], capsize=3, color=["#999", "#ccc", "#1f77b4", "#bbb"])
    ax2.axhline(0.6 * loc["copy"]["gb_s"], color="r", linestyle="--", linewidth=1, label="60% of copy (target)")
    ax2.set_ylabel("GB/s (copied, or rows gathered)")
    ax2.set_title(f"local lookup alone, {loc['threads']} thread", fontsize=9)
    ax2.tick_params(axis="x", labelsize=7)
    ax2.legend(fontsize=7)
    made.append(_save(fig, out / "lookup.png"))

    if res.get("batch_sweep"):
        sweep = res["batch_sweep"]
        batches = [s["batch"] for s in sweep]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in ("ours_rw", "upstream_rw"):
            stats = [s[key] for s in sweep]
            rate = [2 * b * cfg["tables"] / s["median"] for b, s in zip(batches, stats)]
            lo = [r - 2 * b * cfg["tables"] / s["max"] for r, b, s in zip(rate, batches, stats)]
            hi = [2 * b * cfg["tables"] / s["min"] - r for r, b, s in zip(rate, batches, stats)]
            ax.errorbar(batches, rate, yerr=[lo, hi], marker="o", capsize=3, label=_LOOKUP_LABELS[key],
                        color=_LOOKUP_COLORS[key] if key.startswith("ours") else "#ff7f0e")
        ax.set_xscale("log")
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("batch per rank (bags)")
        ax.set_ylabel("pooled bags / s (all tables, both ranks)")
        ax.set_title("Row-wise forward vs batch size, 2 gloo ranks", fontsize=9)
        ax.legend(fontsize=7)
        made.append(_save(fig, out / "lookup_batch.png"))

    if len(res["world"]) > 1:
        worlds = sorted(res["world"], key=int)
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in (k for k in _LOOKUP_LABELS if all(k in res["world"][w]["forward"] for w in worlds)):
            stats = [res["world"][w]["forward"][key] for w in worlds]
            rate = [int(w) * cfg["batch"] * cfg["tables"] / s["median"] for w, s in zip(worlds, stats)]
            ax.plot([int(w) for w in worlds], rate, marker="o", label=_LOOKUP_LABELS[key],
                    color={"torchrec_tw": "#555", "upstream_rw": "#ff7f0e"}.get(key, _LOOKUP_COLORS[key]),
                    linestyle="-" if key.startswith("ours") else "--")
        ax.set_xticks([int(w) for w in worlds])
        ax.set_yscale("log")
        ax.set_xlabel("gloo ranks (2-core machine: 3 and 4 ranks share the 2 cores)")
        ax.set_ylabel("pooled bags / s (all tables, all ranks)")
        ax.set_title(f"Forward vs world size, batch {cfg['batch']} per rank", fontsize=9)
        ax.legend(fontsize=7)
        made.append(_save(fig, out / "lookup_world.png"))
    return made


_TRAIN_PATHS = (("torchrec", "TorchRec DMP (fused kernel)", "#999", None),
                ("ours", "ours (FusedOptimizer)", "#1f77b4", "//"),
                ("dense", "ours, dense weight.grad + SGD", "#d62728", ".."))


def plot_train(res: dict, out: Path) -> Path:
    """train.png: training step and forward times, and peak memory growth, TorchRec vs ours, per layout."""
    cfg = res["config"]
    lays = list(res["layouts"].values())
    phases = [p for p in ("step", "forward") if p in lays[0]]
    groups = [(lay, p) for lay in lays for p in phases]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(_TRAIN_PATHS)
    for i, (key, label, color, hatch) in enumerate(_TRAIN_PATHS):
        xs = [j + (i - (len(_TRAIN_PATHS) - 1) / 2) * width for j, (lay, p) in enumerate(groups) if key in lay[p]]
        if not xs:
            continue
        med, err = _err([lay[p][key] for lay, p in groups if key in lay[p]], 1e3)
        ax.bar(xs, med, width, yerr=err, capsize=2, color=color, hatch=hatch, label=label, edgecolor="k",
               linewidth=0.3)
    for j, (lay, p) in enumerate(groups):
        r = lay[p]["speed_ratio"]
        top = max(lay[p][k]["max"] for k, *_ in _TRAIN_PATHS if k in lay[p]) * 1e3
        ax.annotate(f"TorchRec/ours\n{r['median']:.2f}x [{r['min']:.2f}..{r['max']:.2f}]", (j, top * 1.1),
                    ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(groups)), [f"{lay['label']}\n{p}" for lay, p in groups], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylim(top=ax.get_ylim()[1] * 6)  # room for the ratios and the legend
    ax.set_ylabel("ms per call (median, min..max)")
    ax.set_title(f"{cfg['tables']} tables x {cfg['rows']:,} x {cfg['dim']}, batch {cfg['batch']}/rank, "
                 f"2 gloo ranks, malloc {cfg.get('malloc', 'default')}", fontsize=8)
    ax.legend(fontsize=7, ncol=3, loc="upper center")
    step = [lay for lay in lays if "step" in lay]
    for i, (key, label, color, hatch) in enumerate(_TRAIN_PATHS):
        xs = [j + (i - (len(_TRAIN_PATHS) - 1) / 2) * width for j, lay in enumerate(step) if key in lay["step"]]
        if not xs:
            continue
        stats = [lay["step"][key]["mem"] for lay in step if key in lay["step"]]
        med, err = _err(stats, 1 / 2**20)
        ax2.bar(xs, med, width, yerr=err, capsize=2, color=color, hatch=hatch, label=label, edgecolor="k",
                linewidth=0.3)
    ax2.set_xticks(range(len(step)), [lay["label"] for lay in step], fontsize=7)
    ax2.set_yscale("log")
    ax2.set_ylabel("MiB, peak RSS growth of a step (worst rank)")
    ax2.set_title("Peak memory growth of one training step", fontsize=8)
    return _save(fig, out / "train.png")


def plot_sparse_update(res: dict, out: Path) -> Path:
    """sparse_update.png: one table's optimizer update (per kind) and pooled sum, the baseline (fbgemm's CPU
    kernel; torch ops for Adam) vs ours."""
    cfg, kinds = res["config"], res["kinds"]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    names = list(kinds)
    styles = {"fbgemm": ("fbgemm-gpu-cpu kernel", "tab:gray")}
    for j, k in enumerate(names):
        label, color = styles.get(kinds[k]["baseline_label"], (kinds[k]["baseline_label"], "tab:olive"))
        for i, (key, lab, col) in enumerate((("baseline", label, color), ("ours", "ours (cpu_kernels.c)", "tab:blue"))):
            med, err = _err([kinds[k][key]], 1e3)
            ax.bar([j + (i - 0.5) * 0.4], med, 0.4, yerr=err, capsize=2, color=col, edgecolor="k", linewidth=0.3,
                   label=lab if lab not in ax.get_legend_handles_labels()[1] else None)
        r = kinds[k]["ratio"]
        top = max(kinds[k][key]["max"] for key in ("baseline", "ours"))
        ax.annotate(f"{r['median']:.2f}x", (j, top * 1e3 * 1.03), ha="center", fontsize=7)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.1)  # room for the ratios
    ax.set_xticks(range(len(names)), names, fontsize=7)
    ax.set_ylabel("ms per table (median, min..max)")
    ax.set_title(f"{cfg['rows']:,} x {cfg['dim']} fp32 tables, {cfg['bags']} bags of {cfg['bag']} ids, "
                 f"{cfg.get('threads', 1)} thread(s)", fontsize=8)
    ax.legend(fontsize=7)
    return _save(fig, out / "sparse_update.png")


def plot_reshard(res: dict, dmp: dict | None, out: Path) -> Path:
    """reshard.png: each move of the reshard cycle in memory against a checkpoint round trip to the same plan,
    with each rank's peak memory growth against its bound; and, where recorded, a DMP's moves, ours against
    TorchRec's own reshard."""
    steps = res["steps"]
    panels = 3 if dmp else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.6))
    names = list(steps)
    for j, k in enumerate(names):
        st = steps[k]
        for i, (key, lab, col) in enumerate((("checkpoint_roundtrip_s", "checkpoint save + load", "tab:gray"),
                                             ("reshard_s", "tdb.reshard", "tab:blue"))):
            axes[0].bar([j + (i - 0.5) * 0.4], st[key], 0.4, color=col, edgecolor="k", linewidth=0.3,
                        label=lab if j == 0 else None)
        axes[0].annotate(f"{st['speedup']:.1f}x", (j, st["checkpoint_roundtrip_s"] * 1.02), ha="center", fontsize=7)
        for r in st["per_rank"]:
            x = j + (r["rank"] - 0.5) * 0.4
            axes[1].bar([x], r["peak_growth_bytes"] / 2**20, 0.4, color="tab:blue", edgecolor="k", linewidth=0.3,
                        label="peak growth" if j == 0 and r["rank"] == 0 else None)
            axes[1].plot([x - 0.2, x + 0.2], [r["bound_bytes"] / 2**20] * 2, color="tab:red",
                         label=("bound (largest new share of a table, weights + row state, + 64 MiB)"
                                if j == 0 and r["rank"] == 0 else None))
    short = [n.replace("_", " ").replace(" -> ", "\n-> ") for n in names]
    axes[0].set_xticks(range(len(names)), short, fontsize=7)
    axes[0].set_ylabel("seconds (median)")
    axes[0].set_ylim(top=axes[0].get_ylim()[1] * 1.15)  # room for the ratios
    axes[0].legend(fontsize=7)
    axes[1].set_xticks(range(len(names)), short, fontsize=7)
    axes[1].set_ylabel("MiB per rank (rank 0, rank 1)")
    axes[1].legend(fontsize=6)
    if dmp:
        ax = axes[2]
        moves = [k for k, v in dmp["steps"].items() if "torchrec" in v and isinstance(v["torchrec"], dict)]
        for j, k in enumerate(moves):
            v = dmp["steps"][k]
            for i, (key, lab, col) in enumerate((("torchrec", "TorchRec DMP.reshard", "tab:gray"),
                                                 ("ours", "tdb.reshard", "tab:blue"))):
                ax.bar([j + (i - 0.5) * 0.4], v[key]["s"], 0.4, color=col, edgecolor="k", linewidth=0.3,
                       label=lab if j == 0 else None)
            ax.annotate(f"{v['speedup']:.2f}x", (j, max(v["ours"]["s"], v["torchrec"]["s"]) * 1.02), ha="center",
                        fontsize=7)
        ax.set_xticks(range(len(moves)), [m.replace("_", " ").replace(" -> ", "\n-> ") for m in moves], fontsize=7)
        ax.set_ylabel("seconds (median)")
        ax.set_ylim(top=ax.get_ylim()[1] * 1.25)
        ax.set_title("a DMP's fused tables", fontsize=8)
        ax.legend(fontsize=7)
    cfg = res["config"]
    fig.suptitle(f"{cfg['tables']} tables x {cfg['rows']:,} x {cfg['dim']} fp32, row-wise Adagrad state, 2 ranks",
                 fontsize=8)
    return _save(fig, out / "reshard.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path("bench/results.json"))
    parser.add_argument("--out", type=Path, default=Path("bench"))
    args = parser.parse_args(argv)
    res = json.loads(args.results.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    made = []
    if "convert" in res:
        made.append(plot_convert(res["convert"], args.out))
    if "checkpoint" in res:
        made.append(plot_checkpoint(res["checkpoint"], args.out))
    if "lookup" in res:
        made.extend(plot_lookup(res["lookup"], args.out))
    if "sparse_update" in res:
        made.append(plot_sparse_update(res["sparse_update"], args.out))
    if "train" in res:
        made.append(plot_train(res["train"], args.out))
    if "reshard" in res:
        made.append(plot_reshard(res["reshard"], res.get("reshard_dmp"), args.out))
    for p in made:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
