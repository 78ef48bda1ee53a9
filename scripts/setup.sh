#!/usr/bin/env bash
# Build .venv in the checkout from the pinned stack of shared/ENVIRONMENT.md.
# Two steps pip cannot express in one file: everything pinned, then torchrec --no-deps
# (its metadata asks for the CUDA fbgemm-gpu, which would replace the CPU build).
# Idempotent: a stamp holding the hash of the lock files skips the work when done.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.setup-stamp"
want=$(cat requirements/lock.txt requirements/nodeps.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install -r requirements/lock.txt
"${pip[@]}" install --no-deps -r requirements/nodeps.txt
"${pip[@]}" install --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c "import torch, torchrec, fbgemm_gpu, torchrec_dtensor_bridge; print('setup ok: torch', torch.__version__, 'torchrec', torchrec.__version__)"
echo "$want" > "$stamp"
