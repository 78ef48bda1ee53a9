"""The package's import graph: the lookup stack one way down (lookup -> optim -> kernels) with no import
inside a function to dodge a cycle, and no cycle between subpackages (read from the source with ``ast``)."""

from __future__ import annotations

import ast
from pathlib import Path

import torchrec_dtensor_bridge

ROOT = Path(torchrec_dtensor_bridge.__file__).parent
PKG = "torchrec_dtensor_bridge"
LAYERS = ["lookup", "optim", "kernels"]  # each may import only those after it


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [PKG, *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, inside a function) for every import of this package in ``path``."""
    me = _module(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if n is not f}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
            for t in [target, *names]:
                if t.startswith(PKG):
                    out.append((t, id(node) in nested))
        elif isinstance(node, ast.Import):
            out += [(a.name, id(node) in nested) for a in node.names if a.name.startswith(PKG)]
    return out


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _edges() -> dict[str, set[str]]:
    modules = {_module(p) for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        src = _module(path)
        for target, _ in _imports(path):
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != src:
                graph.setdefault(src, set()).add(target)
    return graph


def test_no_function_level_imports_in_the_lookup_stack():
    found = [f"{p.relative_to(ROOT)} imports {t}" for layer in LAYERS for p in (ROOT / layer).rglob("*.py")
             for t, inner in _imports(p) if inner]
    assert not found, found


def test_layers_import_only_downwards():
    wrong = []
    for src, targets in _edges().items():
        a = _subpackage(src)
        for t in targets:
            b = _subpackage(t)
            if a in LAYERS and b in LAYERS and LAYERS.index(b) < LAYERS.index(a):
                wrong.append(f"{src} -> {t}")
    assert not wrong, wrong


def test_no_cycle_between_subpackages():
    graph: dict[str, set[str]] = {}
    for src, targets in _edges().items():
        for t in targets:
            a, b = _subpackage(src), _subpackage(t)
            if a != b and a and b and (ROOT / a).is_dir() and (ROOT / b).is_dir():
                graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join(path + [node, nxt])}"
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert graph.get("kernels", set()) <= set(), graph.get("kernels")  # the bottom imports no other subpackage
