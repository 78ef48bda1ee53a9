"""``make demo``'s program (``examples/demo.py``) under torchrun on 4 ranks, as the README runs it.

The demo checks itself (tables, pictures, lookups against ``F.embedding_bag``,
a checkpoint reloaded into another plan on 3 ranks) and exits non-zero on any
mismatch; this test (under ``-m slow``: CI runs ``make demo`` itself, beside
``make test``) keeps the demo quiet and tidy too: no warning a user cannot act
on, no temporary directory left.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from .harness import ROOT, launch


@pytest.mark.slow  # `make demo` runs the same in CI (.ci/run), outside make test's time
@pytest.mark.timeout(300)
def test_demo_passes_on_four_ranks():
    before = set(Path(tempfile.gettempdir()).glob("tdb-demo-*"))
    done = launch(ROOT / "examples" / "demo.py", [], nproc=4, timeout=280)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "OK on all 4 ranks" in out, out[-4000:]
    assert "in ONE tdb.sharded_embedding_bags call" in out and "equal to F.embedding_bag" in out, out[-4000:]
    assert "Could not determine LOCAL_WORLD_SIZE" not in out, out[-4000:]  # the reload's group on 3 ranks
    assert set(Path(tempfile.gettempdir()).glob("tdb-demo-*")) == before, "the demo left its directory"
