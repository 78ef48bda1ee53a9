"""The checkpoint package's shape: one storage boundary, few top-level modules."""

from __future__ import annotations

import re
from pathlib import Path

import torchrec_dtensor_bridge.checkpoint as checkpoint

ROOT = Path(checkpoint.__file__).parent
FILE_ACCESS = re.compile(
    r"\bopen\(|\bos\.(rename|replace|remove|unlink|symlink|makedirs|mkdir|listdir|scandir|readlink|open|fsync|rmdir|"
    r"ftruncate|preadv?|pwritev?)\b|\bshutil\.|\bfcntl\.|\.unlink\(|\.rmdir\(|\.mkdir\(|\.rename\(\w*\s*,|np\.memmap|"
    r"\.write_bytes\(|\.read_bytes\(|\.write_text\(|\.read_text\(|\.iterdir\(\)|\.symlink_to\(")


def test_only_the_storage_modules_touch_files():
    found = []
    for p in sorted(ROOT.rglob("*.py")):
        if p.parent.name == "storage":
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if FILE_ACCESS.search(code) and not code.lstrip().startswith(('"', "'", ">>>")):
                found.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_storage_modules_do_touch_files():
    """The pattern above finds what it looks for (so that the test above can fail)."""
    local = (ROOT / "storage" / "local.py").read_text()
    assert len(FILE_ACCESS.findall(local)) >= 10


def test_at_most_twelve_top_level_modules():
    modules = [p.name for p in ROOT.glob("*.py") if p.name != "__init__.py"]
    packages = [p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()]
    assert len(modules) <= 12, (modules, packages)
