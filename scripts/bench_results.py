"""The shared results file of the ``scripts/bench_*.py`` benchmarks (``bench/results.json``).

Each benchmark records its section under its own key, keeping the others'.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["record"]


def record(out: Path, key: str, result: Any) -> None:
    """Write ``result`` as section ``key`` of the JSON file ``out``, keeping its other sections."""
    results = json.loads(out.read_text()) if out.exists() else {}
    results[key] = result
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
