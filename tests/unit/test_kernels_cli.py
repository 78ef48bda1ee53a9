"""``python -m torchrec_dtensor_bridge kernels`` (kernels/report.py): the versions, and what runs each kind of work
and why, as the ops choose it; the ``TDB_KERNELS`` override; and, in a process where the extension cannot be
imported (``sys.modules["torchrec_dtensor_bridge._C"] = None``, as in a pure-Python install: the process of
``tests/unit/without_extension.py``), fbgemm's kernels and torch-op digests named with their reason, and one warning
saying how to build the extension however much runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchrec_dtensor_bridge import cli
from torchrec_dtensor_bridge.kernels import choose, fbgemm, native
from torchrec_dtensor_bridge.optim_kinds import REGISTERED

ROOT = Path(__file__).resolve().parents[2]
MARK = "WITHOUT-EXTENSION:"  # tests/unit/without_extension.py's

pytestmark = pytest.mark.skipif(native.kernel() is None or not fbgemm.available(),
                                reason="needs the built extension and fbgemm_gpu")


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch):
    """No lookup agreement of an earlier test narrows what the report says."""
    monkeypatch.setattr(choose, "_agreed", {})
    monkeypatch.setattr(choose, "_settled", {})
    monkeypatch.delenv("TDB_KERNELS", raising=False)
    monkeypatch.delenv("TDB_NATIVE_KERNELS", raising=False)


def _report(capsys, *args: str) -> dict:
    assert cli.main(["kernels", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def _runs(found: dict, work: str, dtype: str, device: str = "cpu") -> dict:
    (line,) = [k for k in found["kernels"] if (k["work"], k["dtype"], k["device"]) == (work, dtype, device)]
    return line


def test_the_report_names_versions_and_what_the_ops_run(capsys):
    found = _report(capsys)
    versions = found["versions"]
    assert versions["torch"].startswith(torch.__version__)
    assert versions["fbgemm_gpu"].startswith("1.") and "CPU kernels" in versions["fbgemm_gpu"]
    assert versions["extension"].startswith(f"tdb_native version {native.VERSION} (") and ".so" in versions["extension"]
    works = {k["work"] for k in found["kernels"]}
    assert works == {"pool", "dense gradient", "row digests", *(f"update {k}" for k in REGISTERED)}
    assert {k["device"] for k in found["kernels"]} == {"cpu", "cuda"}
    cpu = torch.device("cpu")
    for line in found["kernels"]:  # what the report says is what the ops choose for large tables
        if line["device"] != "cpu" or line["work"] in ("row digests", "dense gradient"):
            continue
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(line["dtype"], torch.float16)
        if line["work"] == "pool":
            want = choose.explain_pool(cpu, dtype)
        else:
            want = choose.explain_update(cpu, line["work"].split()[1], 0.0, dtype,
                                         stochastic=line["dtype"] in ("fp16", "bf16"))
        assert line["runs"].endswith({choose.Impl.NATIVE: "ours", choose.Impl.FBGEMM: "fbgemm",
                                      choose.Impl.TORCH: "torch"}[want.impl] + (" (large)" if "/" in line["runs"]
                                                                                else "")), line
        assert line["why"] == want.why, line
    assert _runs(found, "row digests", "any")["runs"] == "ours"
    assert _runs(found, "dense gradient", "fp32")["runs"] == "fbgemm"
    assert _runs(found, "update adam", "fp32")["runs"] == "ours"
    assert "no CPU kernel for 'adam'" in _runs(found, "update adam", "fp32")["why"]
    assert "stochastic" in _runs(found, "update sgd", "fp16")["why"]
    assert _runs(found, "pool", "fp32", "cuda")["runs"] == "torch"  # fbgemm-gpu-cpu: no CUDA kernels
    assert "CUDA build" in _runs(found, "pool", "fp32", "cuda")["why"]
    for line in found["kernels"]:
        if line["work"].startswith("update") and line["dtype"] in ("fp32", "fp16 nearest") and (
                line["work"] != "update adam" and line["device"] == "cpu"):
            assert line["why"].startswith("rule for "), line  # both C kernels can: the rule decides


def test_the_text_report_is_a_table(capsys):
    assert cli.main(["kernels"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("torchrec_dtensor_bridge") and any(ln.startswith("torch ") for ln in out)
    header = next(ln for ln in out if ln.startswith("work "))
    assert header.split() == ["work", "dtype", "device", "runs", "why"]
    assert any(ln.split()[:4] == ["pool", "fp32", "cpu", "ours"] or ln.split()[:4] == ["pool", "fp32", "cpu", "fbgemm"]
               for ln in out)


@pytest.mark.parametrize("forced", ["fbgemm", "torch", "native"])
def test_the_override_shows_with_its_reason(capsys, monkeypatch, forced):
    monkeypatch.setenv("TDB_KERNELS", forced)
    found = _report(capsys)
    assert found["versions"]["TDB_KERNELS"] == forced
    pool = _runs(found, "pool", "fp32")
    assert pool == {**pool, "runs": {"native": "ours"}.get(forced, forced), "why": f"override: TDB_KERNELS={forced}"}
    bf16 = _runs(found, "pool", "bf16")
    if forced == "fbgemm":  # fbgemm's CPU kernels take no bf16 tables: torch's, saying why
        assert bf16["runs"] == "torch" and bf16["why"] == ("override: TDB_KERNELS=fbgemm, but fbgemm: its CPU kernels "
                                                          "take no bf16 tables"), bf16
    adam = _runs(found, "update adam", "fp32")
    assert adam["runs"] == ("ours" if forced == "native" else "torch"), adam
    digests = _runs(found, "row digests", "any")  # not a lookup kernel: the override does not apply
    assert digests["runs"] == "ours"


@pytest.fixture(scope="module")
def without_extension() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TDB_KERNELS", "TDB_NATIVE_KERNELS")}
    proc = subprocess.run([sys.executable, "-m", "tests.unit.without_extension"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return {**json.loads(lines[-1][len(MARK):]), "stdout": proc.stdout, "stderr": proc.stderr}


def test_without_the_extension_fbgemm_serves_with_one_warning(without_extension):
    got = without_extension
    assert got["code"] == 0
    extension = got["report"]["versions"]["extension"]
    assert extension.startswith("not built (ModuleNotFoundError") and native.BUILD_HINT in extension, extension
    assert "extension" in got["stdout"] and "not built" in got["stdout"]
    lines = {(k["work"], k["dtype"], k["device"]): k for k in got["report"]["kernels"]}
    for work in ("pool", "update sgd", "update rowwise_adagrad", "update adagrad"):
        line = lines[(work, "fp32", "cpu")]
        assert line["runs"] == "fbgemm" and line["why"].startswith("ours: the extension is not built"), line
    assert lines[("update adam", "fp32", "cpu")]["runs"] == "torch"
    assert lines[("pool", "bf16", "cpu")]["runs"] == "torch"
    digests = lines[("row digests", "any", "cpu")]
    assert digests["runs"] == "torch" and "not built" in digests["why"], digests
    # a report, two training steps and two checkpoint saves: the one warning, naming how to build it
    assert len(got["warnings"]) == 1, got["warnings"]
    assert "pip install --no-build-isolation ." in got["warnings"][0] and "make setup" in got["warnings"][0]
    assert got["ops"] == ["fbgemm", "tdb"], got["ops"]  # fbgemm's kernels under the public ops, none of ours


def test_python_dash_m(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torchrec_dtensor_bridge", "kernels", "--json"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["versions"]["extension"].startswith("tdb_native version")
