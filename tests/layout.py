"""Where a checkpoint written by ``tdb.checkpoint.save`` keeps its files on disk, for tests that damage them."""

from __future__ import annotations

import json
import os
from pathlib import Path


def committed(path: str | os.PathLike[str]) -> Path:
    """The committed generation directory of the checkpoint at ``path``, read from its commit record."""
    p = Path(path)
    return p / json.loads((p / "tdb_commit.json").read_text())["generation"]


def generations(path: str | os.PathLike[str]) -> list[str]:
    """The names of the generation directories under ``path`` (committed or not), sorted."""
    p = Path(path)
    return sorted(n.name for n in p.iterdir() if n.name.startswith("gen-") and n.is_dir()) if p.is_dir() else []
