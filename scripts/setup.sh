#!/usr/bin/env bash
# Build .venv in the checkout from the pinned stack of shared/ENVIRONMENT.md.
# Two steps pip cannot express in one file: everything pinned, then torchrec --no-deps
# (its metadata asks for the CUDA fbgemm-gpu, which would replace the CPU build).
# The editable install builds the package's C++ extension in place (setup.py: torchrec_dtensor_bridge/_C*.so).
# Idempotent: a stamp holding the hash of the lock files, the build files and the C/C++ sources skips the
# work when done and the extension is there; a changed source rebuilds.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.setup-stamp"
want=$(cat requirements/lock.txt requirements/nodeps.txt pyproject.toml setup.py \
  $(find torchrec_dtensor_bridge/csrc -type f \( -name '*.c' -o -name '*.h' -o -name '*.cpp' \) | LC_ALL=C sort) \
  | sha256sum | cut -d' ' -f1)
built=$(find torchrec_dtensor_bridge -maxdepth 1 -name '_C*.so' | head -n 1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -n "$built" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install -r requirements/lock.txt
"${pip[@]}" install --no-deps -r requirements/nodeps.txt
"${pip[@]}" install --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c "import torch, torchrec, fbgemm_gpu, torchrec_dtensor_bridge
from torchrec_dtensor_bridge.kernels import native
assert native.kernel() is not None, native.missing()
print('setup ok: torch', torch.__version__, 'torchrec', torchrec.__version__, 'extension', native.VERSION)"
echo "$want" > "$stamp"
