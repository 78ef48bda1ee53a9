"""The kernels come installed: a process with no C or C++ compiler on ``PATH``, ``CC`` and ``CXX`` unset and an empty
``HOME`` runs this package's own kernels (the extension ``make setup`` built) for a lookup, its fused update and an
incremental checkpoint's row digests, compiles nothing and writes nothing under ``HOME``.

One subprocess (``python -m tests.unit.test_kernels_installed``) reads the ``kernels`` report, then runs two
training steps of a one-rank lookup with a fused row-wise Adagrad, as the rule chooses (for these small tables:
fbgemm's pooled sum, our update) and with ours forced (``TDB_KERNELS=native``), and two checkpoint saves (the
second incremental: its rows' digests are compared with the base's) under torch's profiler, checks the results
against the unsharded reference and the torch-op digests, and prints what it found."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARK = "KERNELS-INSTALLED:"
COMPILERS = ("cc", "gcc", "c++", "g++", "clang", "clang++", "x86_64-linux-gnu-gcc", "x86_64-linux-gnu-g++", "ld")


def main() -> None:
    import tempfile

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.checkpoint.incremental import digests
    from torchrec_dtensor_bridge.kernels import report

    from ..gpu.tables import dtensors

    found = report.report()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    shape, lr = (40, 16), 0.1
    ops: dict[str, list[str]] = {}
    for mode in ("auto", "native"):
        os.environ["TDB_KERNELS"] = mode
        w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        (weight,) = dtensors([tdb.ShardLayout.row_wise(shape, [15, 25], ranks=[0, 0]).with_name("t")], [w],
                             torch.device("cpu"), shared=True)
        weight.requires_grad_()
        opt = tdb.FusedOptimizer([weight], "rowwise_adagrad", lr=lr, eps=1e-8)
        ids, offsets = torch.tensor([1, 5, 5, 39, 0, 17]), torch.tensor([0, 2, 6])
        ref, state = w.clone(), torch.zeros(shape[0])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                out = tdb.sharded_embedding_bag(ids, weight, offsets, mode="sum", optimizer=opt)
                ref_w = ref.clone().requires_grad_()
                want = F.embedding_bag(ids, ref_w, offsets, mode="sum")
                torch.testing.assert_close(out, want)
                out.sum().backward()
                want.sum().backward()
                g = ref_w.grad
                state += (g * g).mean(1)
                ref -= lr * g / (state.sqrt() + 1e-8).unsqueeze(1)
            torch.testing.assert_close(tdb.full_tensor(weight).detach(), ref)
            table = tdb.full_tensor(weight).detach().clone()
            with tempfile.TemporaryDirectory() as d:
                tdb.checkpoint.save({"t": table}, Path(d) / "base")
                table[7] += 1
                tdb.checkpoint.save({"t": table}, Path(d) / "next", base=Path(d) / "base")
                changed = tdb.checkpoint.inspect(Path(d) / "next")["t"]["links"][0]["rows"]
                loaded = {"t": torch.zeros_like(table)}
                tdb.checkpoint.load(loaded, Path(d) / "next")
        assert torch.equal(loaded["t"], table) and changed == 1, changed
        ops[mode] = sorted({e.name for e in prof.events() if e.name.startswith(("tdb_native::", "fbgemm::"))})
    os.environ.pop("TDB_KERNELS")
    rows = digests._as_rows(table)
    assert torch.equal(digests.row_digests(table), digests._torch_digests(rows))  # the extension's, bit for bit
    dist.destroy_process_group()
    print(MARK + json.dumps({"report": found, "ops": ops,
                             "compilers": [c for c in COMPILERS if shutil.which(c)],
                             "env": {k: os.environ.get(k) for k in ("CC", "CXX", "HOME")}}))


def _without_compilers(path: str) -> str:
    """``path`` without its directories that hold a C or C++ compiler (or a linker)."""
    return os.pathsep.join(d for d in path.split(os.pathsep)
                           if d and not any(os.access(os.path.join(d, c), os.X_OK) for c in COMPILERS))


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    home = tmp_path_factory.mktemp("home")
    env = {k: v for k, v in os.environ.items()
           if k not in ("CC", "CXX", "TDB_KERNELS", "TDB_NATIVE_KERNELS", "XDG_CACHE_HOME", "TORCH_EXTENSIONS_DIR")}
    env.update(HOME=str(home), PATH=_without_compilers(env.get("PATH", "")))
    proc = subprocess.run([sys.executable, "-m", "tests.unit.test_kernels_installed"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return {**json.loads(lines[-1][len(MARK):]), "home": home, "stderr": proc.stderr}


def test_no_compiler_and_an_empty_home_run_our_kernels(installed):
    assert installed["compilers"] == [] and installed["env"]["CC"] is None and installed["env"]["CXX"] is None
    assert installed["env"]["HOME"] == str(installed["home"])
    assert installed["report"]["versions"]["extension"].startswith("tdb_native version")
    lines = {(k["work"], k["dtype"], k["device"]): k["runs"] for k in installed["report"]["kernels"]}
    assert lines[("update rowwise_adagrad", "fp32", "cpu")] == "ours"
    assert lines[("row digests", "any", "cpu")] == "ours"
    by_rule, forced = set(installed["ops"]["auto"]), set(installed["ops"]["native"])
    # as the rule chooses: our fused update and the checkpoint's digests; the pooled sum where the report says
    assert {"tdb_native::sparse_update", "tdb_native::row_digests"} <= by_rule, by_rule
    pool = "tdb_native::pool_sum" if lines[("pool", "fp32", "cpu")].startswith("ours") else (
        "fbgemm::split_embedding_codegen_forward_cpu")
    assert pool in by_rule, by_rule
    # ours forced: the lookup's pooled sums, its fused updates and the digests all ours, none of fbgemm's
    assert {"tdb_native::pool_sum", "tdb_native::sparse_update", "tdb_native::row_digests"} <= forced, forced
    assert not any(op.startswith("fbgemm::split_embedding") for op in forced), forced
    assert "compil" not in installed["stderr"].lower(), installed["stderr"][-2000:]


def test_nothing_is_written_under_home(installed):
    assert sorted(p.relative_to(installed["home"]).as_posix() for p in installed["home"].rglob("*")) == []


if __name__ == "__main__":
    main()
