#!/usr/bin/env bash
# The GPU check: tests/gpu and the GPU lookup benchmark on one NVIDIA GPU, then one summary (test counts, the
# benchmark's fbgemm / ours ratios). Exits 0 only when every step passed; 2 when the machine or the install
# cannot run it (no GPU, a CPU build of torch, no fbgemm-gpu CUDA build, no pytest), saying which.
#
#   bash scripts/gpu_check.sh                  # from the checkout, with the GPU install of docs/gpu.md
#   PYTHON=/path/to/python bash scripts/gpu_check.sh
#
# Time limits (under 8 minutes in all): the checks of the install 45 s, tests/gpu 250 s (each test 120 s), the
# benchmark 140 s. Logs and the benchmark's JSON stay in a temporary directory, printed at the end.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
TESTS_S=250
BENCH_S=140
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this checkout, installed or not

say() { printf 'gpu_check: %s\n' "$*"; }

if ! command -v "$PY" >/dev/null 2>&1; then
  say "FAILED: no Python interpreter '$PY' (activate the environment of docs/gpu.md, or set PYTHON)"
  exit 2
fi
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")

# 1. The machine and the install, without a traceback: one line, "OK <what>" or "NO <why>".
probe=$(timeout 45 "$PY" - 2>"$LOGS/probe.err" <<'PY'
import importlib
import importlib.metadata as md
import sys


def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def main():
    try:
        import torch
    except Exception as e:
        return f"NO torch cannot be imported ({type(e).__name__}: {e}); install it as docs/gpu.md says"
    if torch.version.cuda is None:
        return (f"NO no NVIDIA GPU can be used: torch {torch.__version__} is a CPU build (the GPU install of "
                "docs/gpu.md puts the CUDA build in its place; pip replaces it when an unpinned package asks "
                "for another torch)")
    if not torch.cuda.is_available():
        return (f"NO no NVIDIA GPU: torch {torch.__version__} (CUDA {torch.version.cuda}) finds no CUDA device "
                "(torch.cuda.is_available() is False)")
    for module in ("pytest", "pytest_timeout"):
        try:
            importlib.import_module(module)
        except Exception as e:
            return f"NO {module} cannot be imported ({type(e).__name__}); pip install pytest pytest-timeout"
    if version("fbgemm-gpu-cpu") is not None:
        return "NO fbgemm-gpu-cpu is installed: uninstall it (it and fbgemm-gpu both provide fbgemm_gpu)"
    try:
        from torchrec_dtensor_bridge.kernels import fbgemm
    except Exception as e:
        return f"NO torchrec_dtensor_bridge cannot be imported ({type(e).__name__}: {e})"
    if not fbgemm.cuda_available():
        return f"NO fbgemm-gpu's CUDA build is not loaded (fbgemm-gpu {version('fbgemm-gpu')}); see docs/gpu.md"
    name = torch.cuda.get_device_name(0)
    free, total = torch.cuda.mem_get_info()
    return (f"OK {name} ({torch.cuda.device_count()} visible, {free / 2**30:.1f} of {total / 2**30:.1f} GiB "
            f"free), torch {torch.__version__}, fbgemm-gpu {version('fbgemm-gpu')}, "
            f"torchrec {version('torchrec')}, tensordict {version('tensordict')}")


try:
    print(main())
except BaseException as e:  # noqa: BLE001 - one line, never a traceback
    print(f"NO the check of the install failed: {type(e).__name__}: {e}")
sys.stdout.flush()
PY
)
rc=$?
if [ $rc -ne 0 ] || [ -z "$probe" ]; then
  say "FAILED: the check of the install did not finish (exit $rc); see $LOGS/probe.err"
  exit 2
fi
case "$probe" in
  OK\ *) say "${probe#OK }" ;;
  *)
    say "FAILED: ${probe#NO }"
    if command -v nvidia-smi >/dev/null 2>&1; then
      say "nvidia-smi -L: $(nvidia-smi -L 2>&1 | head -3 | tr '\n' ' ')"
    else
      say "nvidia-smi: not found (no NVIDIA driver on this machine)"
    fi
    rm -rf "$LOGS"
    exit 2
    ;;
esac

# 2. tests/gpu.
say "running tests/gpu (limit ${TESTS_S} s; log $LOGS/tests.log)"
timeout "$TESTS_S" "$PY" -m pytest tests/gpu -q -p no:cacheprovider -o timeout=120 -rfE \
  --junitxml="$LOGS/tests.xml" >"$LOGS/tests.log" 2>&1
tests_rc=$?
counts=$("$PY" - "$LOGS/tests.xml" <<'PY' 2>/dev/null
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
print(n["tests"] - n["failures"] - n["errors"] - n["skipped"], n["failures"], n["errors"], n["skipped"])
PY
)
read -r passed failed errors skipped <<<"${counts:-0 0 0 0}"
if [ $tests_rc -eq 124 ]; then
  tests_note="TIMED OUT after ${TESTS_S} s"
elif [ -z "$counts" ]; then
  tests_note="FAILED: pytest exited $tests_rc without a report"
elif [ $tests_rc -ne 0 ] || [ "$failed" -ne 0 ] || [ "$errors" -ne 0 ] || [ "$passed" -eq 0 ]; then
  tests_note="FAILED (pytest exit $tests_rc)"
else
  tests_note="ok"
fi

# 3. The benchmark: ours vs fbgemm's own TBE module, sized to the free device memory.
say "running scripts/bench_lookup_gpu.py (limit ${BENCH_S} s; log $LOGS/bench.log)"
timeout "$BENCH_S" "$PY" scripts/bench_lookup_gpu.py --require-cuda --require-fbgemm --reps 10 --warmup 2 \
  --out "$LOGS/bench.json" >"$LOGS/bench.log" 2>&1
bench_rc=$?
ratios=$("$PY" - "$LOGS/bench.json" <<'PY' 2>/dev/null
import json
import sys

r = json.load(open(sys.argv[1]))["lookup_gpu"]
fwd, step = r["forward"]["fbgemm_over_ours"], r["step"]["fbgemm_over_ours"]
cfg = r["config"]
print(f"forward {fwd:.2f}x, step {step:.2f}x (target >= 0.9x; {cfg['tables']} x {cfg['rows']:,} x {cfg['dim']} "
      f"{cfg['optimizer']}, peak {r.get('peak_gib', float('nan')):.1f} GiB)")
PY
)
if [ $bench_rc -eq 124 ]; then
  bench_note="TIMED OUT after ${BENCH_S} s"
elif [ $bench_rc -ne 0 ]; then
  bench_note="FAILED (exit $bench_rc): $(grep -v '^\s*$' "$LOGS/bench.log" | tail -1)"
elif [ -z "$ratios" ]; then
  bench_note="FAILED: no fbgemm / ours ratio in $LOGS/bench.json"
else
  bench_note="ok"
fi

# 4. One summary.
echo
echo "=== gpu_check summary: ${probe#OK } ==="
echo "tests/gpu: $passed passed, $failed failed, $errors errors, $skipped skipped: $tests_note"
grep -E '^(FAILED|ERROR) ' "$LOGS/tests.log" | head -20 | sed 's/^/  /'
echo "benchmark fbgemm / ours (> 1: ours faster): ${ratios:-none}: $bench_note"
echo "logs: $LOGS"
if [ "$tests_note" = ok ] && [ "$bench_note" = ok ]; then
  echo "gpu_check: PASSED"
  exit 0
fi
echo "gpu_check: FAILED"
exit 1
