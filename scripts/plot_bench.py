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
    fig.tight_layout()
    path = out / "convert.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_checkpoint(res: dict, out: Path) -> Path:
    gib = res["gib"]
    labels = ["plain dcp.save", "ours save", "plain dcp.load", "ours load"]
    keys = ["dcp_save", "ours_save", "dcp_load", "ours_load"]
    rates = [gib / res[k]["median"] for k in keys]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, rates, color=["#999", "#1f77b4", "#999", "#1f77b4"])
    ax.axhline(res["dd_write_gib_s"], color="r", linestyle="--", label=f"dd write (fdatasync) {res['dd_write_gib_s']:.2f} GiB/s")
    ax.set_ylabel("GiB/s (median)")
    ax.set_title(f"Checkpoint throughput, {gib:.1f} GiB on 2 gloo ranks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "checkpoint.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    for p in made:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
