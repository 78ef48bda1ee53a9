"""The manifest's header check on its own (no process group, no DCP save), and the checkpoint package's
boundaries read from the source with ``ast``: no import inside a function, no cycle between its modules,
errors in a module of their own, and private torch imports only in ``_compat.py``."""

from __future__ import annotations

import ast
import pickle
import re
from pathlib import Path

import pytest
from torch.distributed.checkpoint.metadata import Metadata

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.checkpoint import api, errors
from torchrec_dtensor_bridge.checkpoint.errors import CheckpointError, CorruptCheckpointError
from torchrec_dtensor_bridge.checkpoint.format.manifest import (
    MANIFEST,
    BlockHasher,
    parse_manifest,
    read_manifest,
    write_manifest,
)

from ..import_graph import PKG, ROOT, find_cycle
from ..import_graph import module_name as _module
from ..import_graph import package_imports as _package_imports

CHECKPOINT = ROOT / "checkpoint"


# -------------------------------------------------------------------- the header check
def _write(root: Path) -> Path:
    """A format-3 manifest of one 300 KiB data file (two checksum blocks) in ``root``; its path."""
    hasher = BlockHasher()
    hasher.update(bytes(range(256)) * 1200)
    write_manifest(root, "save1", Metadata(state_dict_metadata={}, storage_data={}), {"__0_0.distcp": hasher.finish()},
                   {"world_size": 1, "dcp_save_id": "dcp1"}, metadata=b"metadata bytes")
    return root / MANIFEST


def _split(data: bytes) -> tuple[list[bytes], bytes]:
    head, body = data.split(b"\n", 1)
    return head.split(b" "), body


def test_a_correct_manifest_parses(tmp_path):
    path = _write(tmp_path)
    (magic, digest, length), body = _split(path.read_bytes())
    assert magic == b"TDBMANIFEST" and len(digest) == 16 and int(length) == len(body)
    m = read_manifest(tmp_path)
    assert m is not None
    assert (m["format"], m["save_id"], m["dcp_save_id"], m["world_size"]) == (3, "save1", "dcp1", 1)
    assert m["files"]["__0_0.distcp"]["size"] == 300 * 1024 and len(m["files"]["__0_0.distcp"]["blocks"]) == 32
    assert parse_manifest(path.read_bytes(), "here") == m


def test_no_manifest_is_a_plain_dcp_directory(tmp_path):
    assert read_manifest(tmp_path) is None


def test_a_wrong_checksum_of_the_right_length_is_refused_naming_the_file(tmp_path):
    path = _write(tmp_path)
    (magic, digest, length), body = _split(path.read_bytes())
    wrong = b"%016x" % (int(digest, 16) ^ 1)
    assert len(wrong) == len(digest) and wrong != digest and int(length) == len(body)
    path.write_bytes(b" ".join([magic, wrong, length]) + b"\n" + body)
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"manifest {path} is corrupt: its body's checksum")):
        read_manifest(tmp_path)


def test_a_damaged_body_under_an_intact_header_is_refused(tmp_path):
    path = _write(tmp_path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # same length, one bit of the body flipped
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"manifest {path} is corrupt: its body's checksum")):
        read_manifest(tmp_path)


@pytest.mark.parametrize("keep,why", [
    (-1, "is truncated or corrupt: its header says"),  # the body's last byte lost
    (-200, "is truncated or corrupt: its header says"),
    (20, "is corrupt: no valid header line"),  # cut inside the header line
    (0, "is corrupt: no valid header line"),  # an empty file
])
def test_a_truncated_manifest_is_refused(tmp_path, keep, why):
    path = _write(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"manifest {path} {why}")):
        read_manifest(tmp_path)


def test_a_header_that_is_not_one_is_refused():
    with pytest.raises(CorruptCheckpointError, match="manifest m.json is corrupt: no valid header line"):
        parse_manifest(b"TDBMANIFEST 0123 12\n{}", "m.json")  # a 4-digit checksum
    with pytest.raises(CorruptCheckpointError, match="manifest m.json is corrupt: no valid header line"):
        parse_manifest(b"XDBMANIFEST 0123456789abcdef 2\n{}", "m.json")


# -------------------------------------------------------------------- errors and entry points
def test_errors_live_in_their_module_and_stay_public():
    for name in ("CheckpointError", "IncompleteCheckpointError", "CorruptCheckpointError", "CheckpointBusyError",
                 "NotACheckpointError"):
        cls = getattr(tdb.checkpoint, name)
        assert cls is getattr(errors, name) and cls.__module__ == errors.__name__ and name in tdb.checkpoint.__all__
        assert issubclass(cls, CheckpointError) and issubclass(cls, RuntimeError)
        again = pickle.loads(pickle.dumps(cls("key 't': bad")))
        assert type(again) is cls and again.args == ("key 't': bad",)


def test_save_and_load_are_in_api():
    assert tdb.checkpoint.save is api.save and tdb.checkpoint.load is api.load
    assert api.save.__module__ == api.load.__module__ == api.__name__


# -------------------------------------------------------------------- the import graph
def test_no_function_level_import_of_the_package_in_checkpoint():
    found = [f"{p.relative_to(ROOT)}:{line} imports {t} inside a function"
             for p in sorted(CHECKPOINT.glob("*.py")) for t, inner, line in _package_imports(p) if inner]
    assert not found, found


def test_no_import_cycle_between_checkpoint_modules():
    graph: dict[str, set[str]] = {}
    for p in CHECKPOINT.glob("*.py"):
        src = _module(p)
        graph[src] = {t for t, _, _ in _package_imports(p) if t.startswith(f"{PKG}.checkpoint") and t != src}
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"
    assert graph[f"{PKG}.checkpoint.errors"] == set(), "errors.py imports nothing else of the package"
    assert not any(_package_imports(CHECKPOINT / "errors.py"))


def _private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(p.startswith("_") for p in parts[1:])


def _private_torch_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            module = node.module or ""
            names = [a.name for a in node.names if a.name.startswith("_")]
            if _private(module) or names:
                found.append(f"from {module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            arg = node.args[0].value
            if name in ("import_module", "__import__") and isinstance(arg, str) and _private(arg):
                found.append(f"{name}({arg!r})")
    return [f"{path.relative_to(ROOT)}:{what}" for what in found]


def test_private_torch_imports_only_in_compat():
    found = [f for p in sorted(ROOT.rglob("*.py")) if p.name != "_compat.py" or p.parent != ROOT
             for f in _private_torch_imports(p)]
    assert not found, found
    assert _private_torch_imports(ROOT / "_compat.py"), "the check finds the imports _compat.py holds"
