"""fbgemm_gpu installed but not loadable (a build for another torch or CUDA): the lookups fall back to this
package's and torch's kernels, with one warning that says why.

fbgemm_gpu's import loads its libraries with ``torch.ops.load_library``, which raises ``OSError`` (an undefined
symbol, a missing CUDA runtime) or ``RuntimeError`` for a mismatched build. One subprocess (imports of its own)
runs each case in turn: ``import fbgemm_gpu`` finds a test-only module whose loading raises that error (an
import hook first on ``sys.meta_path``), or, for "not installed", ``sys.modules["fbgemm_gpu"] = None``; the kernel
layer forgets what it knew of fbgemm_gpu, and a one-rank lookup with a fused optimizer, forward and backward, with
the kernels chosen as by default and with fbgemm's forced, must equal ``F.embedding_bag`` and the unsharded SGD
step. The warnings the package logged are counted per case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARK = "FBGEMM-LOAD-RESULTS:"
CASES = {
    "OSError": 'OSError("libfbgemm_gpu_tbe_training_backward.so: undefined symbol: _ZN3c104cuda9SetDeviceEab")',
    "RuntimeError": 'RuntimeError("fbgemm_gpu was built for CUDA 12.6, this torch for CUDA 13.0")',
    "not_installed": None,
}


def _loader_raising(error: BaseException):  # type: ignore[no-untyped-def]
    import importlib.abc
    import importlib.machinery

    class Raising(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
            return importlib.machinery.ModuleSpec(name, self) if name == "fbgemm_gpu" else None

        def create_module(self, spec):  # type: ignore[no-untyped-def]
            return None

        def exec_module(self, module):  # type: ignore[no-untyped-def]
            raise error

    return Raising()


def _lookups() -> None:
    """A one-rank lookup with SGD, by default and with fbgemm's kernels forced, against the unsharded ones."""
    import torch
    import torch.nn.functional as F

    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.layout import ShardLayout

    from ..gpu.tables import batch, dtensors, table

    shape = (20, 8)
    for forced in ("auto", "fbgemm"):
        os.environ["TDB_KERNELS"] = forced
        full = table(shape, 1)
        (w,) = dtensors([ShardLayout.row_wise(shape, [9, 11], ranks=[0, 0]).with_name("t")], [full],
                        torch.device("cpu"), shared=False)
        w.requires_grad_()
        opt = tdb.FusedOptimizer([w], "sgd", lr=0.5)
        ids, offsets = batch(shape[0], 2, torch.device("cpu"))
        out = tdb.sharded_embedding_bag(ids, w, offsets, mode="sum", optimizer=opt)
        ref_w = full.clone().requires_grad_()
        ref = F.embedding_bag(ids, ref_w, offsets, mode="sum")
        torch.testing.assert_close(out, ref)
        out.sum().backward()
        ref.sum().backward()
        torch.testing.assert_close(tdb.full_tensor(w).detach(), full - 0.5 * ref_w.grad)
    os.environ.pop("TDB_KERNELS")


def main() -> None:
    import logging

    import torch.distributed as dist

    from torchrec_dtensor_bridge.kernels import choose, fbgemm

    logged: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(record.getMessage())

    logging.getLogger("torchrec_dtensor_bridge").addHandler(Keep(logging.WARNING))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    results: dict[str, object] = {}
    for name, error in CASES.items():
        sys.modules.pop("fbgemm_gpu", None)
        hook = None
        if error is None:
            sys.modules["fbgemm_gpu"] = None  # type: ignore[assignment]
        else:
            hook = _loader_raising(eval(error))  # noqa: S307 - the test's own constant
            sys.meta_path.insert(0, hook)
        for cached in (fbgemm._module, fbgemm.available, fbgemm.cuda_available):  # what an earlier case learnt
            cached.cache_clear()
        choose._agreed.clear()
        choose._settled.clear()
        del logged[:]
        try:
            _lookups()
            results[name] = {"ok": True, "warnings": [m for m in logged if "fbgemm" in m],
                             "available": fbgemm.available() or fbgemm.cuda_available()}
        except Exception as e:  # noqa: BLE001 - reported to the test process
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        finally:
            if hook is not None:
                sys.meta_path.remove(hook)
    print(MARK + json.dumps(results))


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TDB_KERNELS"}
    proc = subprocess.run([sys.executable, "-m", "tests.unit.test_fbgemm_load_failure"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len(MARK):])


@pytest.mark.parametrize("name", ["OSError", "RuntimeError"])
def test_unloadable_fbgemm_falls_back_with_one_warning(results, name):
    got = results[name]
    assert got["ok"], got
    assert not got["available"]
    assert len(got["warnings"]) == 1, got["warnings"]
    message = CASES[name].split("(", 1)[1].rstrip(")").strip('"')
    warning = got["warnings"][0]
    assert "fbgemm_gpu is installed but cannot be loaded" in warning and f"({name}: {message})" in warning, warning
    assert "this package's and torch's run instead" in warning and "docs/gpu.md" in warning, warning


def test_fbgemm_not_installed_falls_back_silently(results):
    got = results["not_installed"]
    assert got["ok"] and not got["available"] and got["warnings"] == [], got


if __name__ == "__main__":
    main()
