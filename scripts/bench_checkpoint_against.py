"""The local-disk checkpoint benchmark, this checkout against an earlier commit, alternated.

``scripts/bench_checkpoint.py`` run in turn from this checkout and from a worktree of ``--rev`` (made with
``git worktree add --detach`` under the scratch directory, removed after), ``--rounds`` times each,
new, old, new, old, ...; each run imports the package of its own tree (``PYTHONPATH``) with this
environment's dependencies. Prints, per quantity (our save, our default load, our staged load, and plain
DCP's save and load as the control that should not move), every run's median and the median of the
medians, new / old; records them under ``checkpoint_against`` in ``--out``.

    python scripts/bench_checkpoint_against.py --rev 033a76f --gib 2 --reps 3 --rounds 2

The machine's CPU model and 1-min load (before and after) are printed with the figures: compare runs taken
on a quiet machine only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
KEYS = ("ours_save", "ours_load", "ours_load_staged", "dcp_save", "dcp_load")


def _run(tree: Path, gib: float, reps: int, scratch: Path) -> dict[str, float]:
    out = scratch / f"{tree.name}.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, str(tree / "scripts" / "bench_checkpoint.py"), "--gib", str(gib),
                    "--reps", str(reps), "--dir", str(scratch), "--out", str(out)],
                   cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    res = json.loads(out.read_text())["checkpoint"]
    return {k: res[k]["median"] for k in KEYS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", required=True, help="the earlier commit to compare with")
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each tree, alternated")
    parser.add_argument("--out", type=Path, default=Path("bench/results.json"))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE / "scripts"))
    from bench_checkpoint_s3 import _cpu, _load1
    from bench_results import record

    load_before = _load1()
    scratch = Path(tempfile.mkdtemp(prefix="against-", dir=HERE / "bench"))
    old = scratch / "old"
    subprocess.run(["git", "worktree", "add", "--detach", str(old), args.rev], cwd=HERE, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs: dict[str, list[dict[str, float]]] = {"new": [], "old": []}
    try:
        for _ in range(args.rounds):
            for name, tree in (("new", HERE), ("old", old)):
                runs[name].append(_run(tree, args.gib, args.reps, scratch))
                print(f"{name}: " + ", ".join(f"{k} {v:.2f}s" for k, v in runs[name][-1].items()), flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=HERE, check=False)
        shutil.rmtree(scratch, ignore_errors=True)
    load_after = _load1()
    res = {"rev": args.rev, "gib": args.gib, "reps": args.reps, "cpu": _cpu(), "load1_before": load_before,
           "load1_after": load_after, "runs": runs, "new_over_old": {}}
    print(f"{args.gib} GiB on 2 ranks, medians of {args.reps} per run; CPU {res['cpu']}; 1-min load "
          f"{load_before:.2f} before, {load_after:.2f} after")
    for k in KEYS:
        new, old_ = statistics.median(r[k] for r in runs["new"]), statistics.median(r[k] for r in runs["old"])
        res["new_over_old"][k] = new / old_
        print(f"  {k:<17} new {' / '.join(f'{r[k]:.2f}' for r in runs['new'])} s, old "
              f"{' / '.join(f'{r[k]:.2f}' for r in runs['old'])} s: time new/old {new / old_:.2f}")
    record(args.out, "checkpoint_against", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
