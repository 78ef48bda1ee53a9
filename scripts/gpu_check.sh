#!/usr/bin/env bash
# The GPU check: under 10 minutes on one NVIDIA GPU, the quick checks that catch the most first, then one summary
# line listing each step's outcome.
#
#   1. install    the machine and the install: a CUDA device, torch's CUDA build, pytest, this package; which
#                 torch and fbgemm-gpu it runs with (the installed ones when the lock's pins cannot be installed)
#   2. schemas    every fbgemm op the kernels call exists in the installed fbgemm_gpu and its schema takes what
#                 the calls pass (tests/unit/test_fbgemm_schemas.py)
#   3. kernels    the fused optimizers' kernels on CUDA against the unsharded reference: 4 kinds, weighted or
#                 not, fp32 / fp16 / bf16 (tests/gpu/test_cuda_kernel_smoke.py)
#   4. duplicate  one weight looked up for two features in one fused update, 20 times: the same result every
#                 time, and the CPU's (tests/gpu/test_cuda_duplicate_shard.py)
#   5. tests/gpu  the rest of tests/gpu
#   6. benchmark  scripts/bench_lookup_gpu.py: ours against fbgemm's own TBE module
#
# Without fbgemm-gpu's CUDA build (a machine without network keeps what it has) steps 3-5 still run (the
# package then runs its own and torch's kernels on CUDA); what needs the missing wheel is skipped and named:
# the schema check (the ops only the CUDA build registers; all of it without any fbgemm_gpu) and the benchmark.
#
# Exit status: 0 every step ran and passed; 1 a step failed or ran out of time; 2 the machine or the install
# cannot run the check (no GPU, a CPU build of torch, no pytest, ...), saying which; 3 nothing failed, but steps
# needing a missing fbgemm wheel were skipped.
#
#   bash scripts/gpu_check.sh                  # from the checkout, with the GPU install of docs/gpu.md
#   PYTHON=/path/to/python bash scripts/gpu_check.sh
#
# Time limits (s): install 40, schemas 60, kernels 90, duplicate 60, tests/gpu 180 (120 a test), benchmark 130;
# 560 in all, each killed 3 s after its limit. Logs and JUnit reports stay in a temporary directory, named at
# the end.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

PY=${PYTHON:-python3}
PROBE_S=40
SCHEMAS_S=60
KERNELS_S=90
DUPLICATE_S=60
TESTS_S=180
BENCH_S=130
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this checkout, installed or not

say() { printf 'gpu_check: %s\n' "$*"; }

if ! command -v "$PY" >/dev/null 2>&1; then
  say "FAILED: no Python interpreter '$PY' (activate the environment of docs/gpu.md, or set PYTHON)"
  exit 2
fi
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")

# --- 1. the machine and the install: "key=value" lines, "status=OK" or "status=NO" with "why=", never a traceback
probe=$(timeout -k 3 "$PROBE_S" "$PY" - 2>"$LOGS/probe.err" <<'PY'
import importlib
import importlib.metadata as md
import re
import sys
from pathlib import Path


def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def pinned(dist):
    """The version requirements/lock.txt pins ``dist`` to, or None."""
    lock = Path("requirements/lock.txt")
    text = lock.read_text() if lock.exists() else ""
    found = re.search(rf"^{re.escape(dist)}==(\S+)", text, re.MULTILINE | re.IGNORECASE)
    return found.group(1) if found else None


def against_pin(have, pin):
    if pin is None or have is None or have.split("+")[0] == pin:
        return ""
    return f" (the lock pins {pin}: running with the installed one)"


def main():
    out = {}
    try:
        import torch
    except Exception as e:
        return {"why": f"torch cannot be imported ({type(e).__name__}: {e}); install it as docs/gpu.md says"}
    out["torch"] = f"torch {torch.__version__} with CUDA {torch.version.cuda}{against_pin(torch.__version__, pinned('torch'))}"
    if torch.version.cuda is None:
        return {"why": f"no NVIDIA GPU can be used: torch {torch.__version__} is a CPU build (the GPU install of "
                       "docs/gpu.md puts the CUDA build in its place; pip replaces it when an unpinned package asks "
                       "for another torch)"}
    if not torch.cuda.is_available():
        return {"why": f"no NVIDIA GPU: torch {torch.__version__} (CUDA {torch.version.cuda}) finds no CUDA device "
                       "(torch.cuda.is_available() is False)"}
    for module in ("pytest", "pytest_timeout"):
        try:
            importlib.import_module(module)
        except Exception as e:
            return {"why": f"{module} cannot be imported ({type(e).__name__}); pip install pytest pytest-timeout"}
    gpu, cpu = version("fbgemm-gpu"), version("fbgemm-gpu-cpu")
    if gpu is not None and cpu is not None:
        return {"why": f"fbgemm-gpu {gpu} and fbgemm-gpu-cpu {cpu} are both installed (both provide fbgemm_gpu): "
                       "uninstall fbgemm-gpu-cpu"}
    loads = ""
    try:
        import fbgemm_gpu  # noqa: F401
    except ModuleNotFoundError as e:
        loads = "not installed" if e.name == "fbgemm_gpu" else f"does not load ({e})"
    except Exception as e:  # noqa: BLE001 - a build for another torch or CUDA: say so, go on without it
        loads = f"does not load ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})"
    try:
        from torchrec_dtensor_bridge.kernels import fbgemm
    except Exception as e:
        return {"why": f"torchrec_dtensor_bridge cannot be imported ({type(e).__name__}: {e})"}
    pin = pinned("fbgemm_gpu-cpu") or pinned("fbgemm-gpu")  # the lock pins the CPU build; the CUDA build pairs it
    if fbgemm.cuda_available():
        out["fbgemm"] = f"fbgemm-gpu {gpu}, its CUDA build{against_pin(gpu, pin)}"
        out["fbgemm_cuda"] = "1"
    else:
        if cpu is not None and not loads:
            have = f"fbgemm-gpu-cpu {cpu}, a CPU build without CUDA kernels"
        elif gpu is not None:
            have = f"fbgemm-gpu {gpu}, which {loads or 'has no CUDA kernels loaded'}"
        else:
            have = f"no fbgemm_gpu: {loads or 'not installed'}"
        out["fbgemm"] = have
        out["missing"] = f"fbgemm-gpu's CUDA build{f' {pin}' if pin else ''}"
    out["fbgemm_any"] = "1" if fbgemm.available() else "0"
    free, total = torch.cuda.mem_get_info()
    out["gpu"] = (f"{torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible, "
                  f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free)")
    out["torchrec"] = f"torchrec {version('torchrec')}"
    out["status"] = "OK"
    return out


try:
    facts = main()
except BaseException as e:  # noqa: BLE001 - one line, never a traceback
    facts = {"why": f"the check of the install failed: {type(e).__name__}: {e}"}
facts.setdefault("status", "NO")
for key, value in facts.items():
    print(f"{key}={' '.join(str(value).split())}")
sys.stdout.flush()
PY
)
rc=$?
fact() { printf '%s\n' "$probe" | sed -n "s/^$1=//p" | head -1; }
if [ $rc -ne 0 ] || [ -z "$probe" ]; then
  say "FAILED: the check of the install did not finish (exit $rc); see $LOGS/probe.err"
  exit 2
fi
if [ "$(fact status)" != OK ]; then
  say "FAILED: $(fact why)"
  if command -v nvidia-smi >/dev/null 2>&1; then
    say "nvidia-smi -L: $(nvidia-smi -L 2>&1 | head -3 | tr '\n' ' ')"
  else
    say "nvidia-smi: not found (no NVIDIA driver on this machine)"
  fi
  rm -rf "$LOGS"
  exit 2
fi
RUNS_WITH="$(fact torch); $(fact fbgemm); $(fact torchrec)"
MISSING=$(fact missing)
say "$(fact gpu)"
say "running with $RUNS_WITH"
if [ -n "$MISSING" ]; then
  say "without $MISSING: what needs it is skipped, and named"
fi

# --- the steps' outcomes --------------------------------------------------------------------------------------
OUTCOMES=()   # "name: outcome" per step, in order, for the summary line
DETAILS=()    # lines printed before it
FAILED=0
SKIPPED=0
record() {  # record NAME OUTCOME [DETAIL...]
  local name=$1 outcome=$2
  shift 2
  OUTCOMES+=("$name $outcome")
  case "$outcome" in
    FAILED* | TIMED*) FAILED=1 ;;
    skipped*) SKIPPED=1 ;;
  esac
  local arg line
  for arg in "$@"; do
    while IFS= read -r line; do
      [ -n "$line" ] && DETAILS+=("  $name: $line")
    done <<<"$arg"
  done
}
OUTCOMES+=("install ok")

# junit XML: "passed failed errors skipped" on the first line, then "FAILED <test>" and "SKIPPED <reason>" lines
junit() {
  "$PY" - "$1" <<'PY' 2>/dev/null
import collections
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
print(n["tests"] - n["failures"] - n["errors"] - n["skipped"], n["failures"], n["errors"], n["skipped"])
reasons = collections.Counter()
for case in root.iter("testcase"):
    name = f"{case.get('classname', '')}::{case.get('name', '')}"
    if case.find("failure") is not None or case.find("error") is not None:
        print(f"FAILED {name}")
    skip = case.find("skipped")
    if skip is not None:
        reasons[" ".join((skip.get("message") or "").split())] += 1
for reason, count in reasons.most_common():
    print(f"SKIPPED {reason} ({count})")
PY
}

# run_pytest NAME LIMIT PER_TEST MUST_PASS ARGS...: one pytest step, recorded; MUST_PASS=1: a step that skips
# everything failed (its tests skip only without a CUDA device, which step 1 found)
run_pytest() {
  local name=$1 limit=$2 per_test=$3 must_pass=$4
  shift 4
  local stem=${name//\//_}
  say "$name (limit ${limit} s; log $LOGS/$stem.log)"
  timeout -k 3 "$limit" "$PY" -m pytest "$@" -q -p no:cacheprovider -o timeout="$per_test" -rfEs \
    --junitxml="$LOGS/$stem.xml" >"$LOGS/$stem.log" 2>&1
  local rc=$? report counts passed failed errors skipped
  report=$([ -s "$LOGS/$stem.xml" ] && junit "$LOGS/$stem.xml")
  counts=$(printf '%s\n' "$report" | head -1)
  read -r passed failed errors skipped <<<"${counts:-0 0 0 0}"
  local failures skips tally="$passed passed, $failed failed, $errors errors, $skipped skipped"
  failures=$(printf '%s\n' "$report" | grep '^FAILED ' | head -10)
  skips=$(printf '%s\n' "$report" | sed -n 's/^SKIPPED /skipped: /p' | head -10)
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    record "$name" "TIMED OUT after ${limit} s ($tally so far)" "$failures" "see $LOGS/$stem.log"
  elif [ -z "$counts" ]; then
    record "$name" "FAILED: pytest exited $rc without a report" "$(grep -v '^\s*$' "$LOGS/$stem.log" | tail -3)"
  elif [ $rc -ne 0 ] || [ "$failed" -ne 0 ] || [ "$errors" -ne 0 ]; then
    record "$name" "FAILED ($tally)" "$failures" "$skips"
  elif [ "$passed" -eq 0 ] && [ "$must_pass" -eq 1 ]; then
    record "$name" "FAILED (nothing ran: $tally)" "$skips"
  elif [ "$passed" -eq 0 ]; then
    record "$name" "skipped ($tally)" "$skips"
  else
    local also=""
    [ "$skipped" -gt 0 ] && also=", $skipped skipped"
    record "$name" "ok ($passed passed$also)" "$skips"
  fi
}

# --- 2. the schemas of the fbgemm ops the kernels call
if [ "$(fact fbgemm_any)" = 1 ]; then
  run_pytest schemas "$SCHEMAS_S" 50 0 tests/unit/test_fbgemm_schemas.py
else
  record schemas "skipped (needs fbgemm_gpu: $(fact fbgemm))"
fi

# --- 3. the fused kernels against the reference; 4. a weight listed twice, 20 times
run_pytest kernels "$KERNELS_S" 60 1 tests/gpu/test_cuda_kernel_smoke.py
run_pytest duplicate "$DUPLICATE_S" 50 1 tests/gpu/test_cuda_duplicate_shard.py

# --- 5. the rest of tests/gpu
run_pytest tests/gpu "$TESTS_S" 120 1 tests/gpu --ignore=tests/gpu/test_cuda_kernel_smoke.py \
  --ignore=tests/gpu/test_cuda_duplicate_shard.py

# --- 6. the benchmark: ours vs fbgemm's own TBE module, sized to the free device memory
if [ -n "$MISSING" ]; then
  record benchmark "skipped (compares with fbgemm's CUDA TBE module: needs $MISSING)"
else
  say "benchmark (limit ${BENCH_S} s; log $LOGS/bench.log)"
  timeout -k 3 "$BENCH_S" "$PY" scripts/bench_lookup_gpu.py --require-cuda --require-fbgemm --reps 10 --warmup 2 \
    --out "$LOGS/bench.json" >"$LOGS/bench.log" 2>&1
  bench_rc=$?
  ratios=$("$PY" - "$LOGS/bench.json" <<'PY' 2>/dev/null
import json
import sys

r = json.load(open(sys.argv[1]))["lookup_gpu"]
fwd, step = r["forward"]["fbgemm_over_ours"], r["step"]["fbgemm_over_ours"]
cfg = r["config"]
print(f"fbgemm / ours: forward {fwd:.2f}x, step {step:.2f}x (> 1: ours faster; target >= 0.9x; {cfg['tables']} x "
      f"{cfg['rows']:,} x {cfg['dim']} {cfg['optimizer']}, peak {r.get('peak_gib', float('nan')):.1f} GiB)")
PY
)
  if [ $bench_rc -eq 124 ] || [ $bench_rc -eq 137 ]; then
    record benchmark "TIMED OUT after ${BENCH_S} s" "see $LOGS/bench.log"
  elif [ $bench_rc -ne 0 ]; then
    record benchmark "FAILED (exit $bench_rc)" "$(grep -v '^\s*$' "$LOGS/bench.log" | tail -1)"
  elif [ -z "$ratios" ]; then
    record benchmark "FAILED: no fbgemm / ours ratio in $LOGS/bench.json"
  else
    record benchmark "ok ($ratios)"
  fi
fi

# --- the summary: details, then one line
echo
for line in "${DETAILS[@]}"; do
  printf '%s\n' "$line"
done
echo "  logs: $LOGS"
if [ $FAILED -ne 0 ]; then
  verdict=FAILED
  status=1
elif [ $SKIPPED -ne 0 ]; then
  verdict="INCOMPLETE (nothing failed; skipped what needs $MISSING)"
  status=3
else
  verdict=PASSED
  status=0
fi
summary=$(printf '%s; ' "${OUTCOMES[@]}")
say "$verdict: ${summary%; } | $RUNS_WITH | $(fact gpu) | $((SECONDS / 60))m$((SECONDS % 60))s"
exit $status
