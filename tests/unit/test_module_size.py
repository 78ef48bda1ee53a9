"""The lookup stack's modules stay readable: none of ``kernels/`` or ``lookup/`` past 450 lines (STYLE.md: modules
~200-400 lines; two grew past 450 once a test no longer held them)."""

from __future__ import annotations

from pathlib import Path

import pytest

import torchrec_dtensor_bridge

ROOT = Path(torchrec_dtensor_bridge.__file__).parent
LIMIT = 450
MODULES = sorted(p for d in ("kernels", "lookup") for p in (ROOT / d).rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_module_within_limit(path):
    lines = len(path.read_text().splitlines())
    assert lines <= LIMIT, f"{path.relative_to(ROOT)}: {lines} lines (at most {LIMIT}: split it by meaning)"
