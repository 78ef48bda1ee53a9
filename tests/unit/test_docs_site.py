"""The documentation site: it builds without a warning, and its API reference covers every public name.

The site is built as ``make docs`` builds it (``mkdocs build --strict`` with the checkout's
``mkdocs.yml``), into a temporary directory, once per module. Any warning fails the build:
a broken link or anchor, a page of ``docs/`` missing from the navigation, a docstring
mkdocstrings cannot render. Every name of ``torchrec_dtensor_bridge.__all__`` and of
``torchrec_dtensor_bridge.checkpoint.__all__`` must have its own entry (an anchor) in the
API reference pages. The pages' code blocks are checked by ``tests/distributed/test_readme.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import torchrec_dtensor_bridge as tdb

ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT = 240  # seconds; the build takes a few


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # the theme's banner about its successor, not a finding
    res = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT,
    )
    log = res.stdout + res.stderr
    warnings = [line for line in log.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert res.returncode == 0 and not warnings, f"mkdocs build --strict failed (exit {res.returncode}):\n{log}"
    return out


@pytest.mark.timeout(BUILD_TIMEOUT + 30)
def test_the_site_builds_without_a_warning(site):
    assert (site / "index.html").is_file()
    pages = {p.parent.name for p in site.glob("*/index.html")}
    for md in (ROOT / "docs").glob("*.md"):
        assert md.stem == "index" or md.stem in pages, f"docs/{md.name} was not built"


@pytest.mark.timeout(BUILD_TIMEOUT + 30)
def test_the_api_reference_covers_every_public_name(site):
    html = (site / "api" / "index.html").read_text()
    missing = [n for n in tdb.__all__ if f'id="torchrec_dtensor_bridge.{n}"' not in html]
    assert not missing, f"names of torchrec_dtensor_bridge.__all__ without an entry in docs/api.md: {missing}"


@pytest.mark.timeout(BUILD_TIMEOUT + 30)
def test_the_checkpoint_api_reference_covers_every_public_name(site):
    html = (site / "api-checkpoint" / "index.html").read_text()
    missing = []
    for n in tdb.checkpoint.__all__:
        obj = getattr(tdb.checkpoint, n)
        # a function named like its module (inspect, export, ...) is documented where it is defined
        where = {f"torchrec_dtensor_bridge.checkpoint.{n}", f"{getattr(obj, '__module__', '')}.{n}"}
        if not any(f'id="{w}"' in html for w in where):
            missing.append(n)
    assert not missing, f"names of tdb.checkpoint.__all__ without an entry in docs/api-checkpoint.md: {missing}"
