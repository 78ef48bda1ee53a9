"""Shared by the import-graph tests: the package's modules, their imports of the package (read with
``ast``, nothing imported), and the first cycle of a graph of module names."""

from __future__ import annotations

import ast
from pathlib import Path

import torchrec_dtensor_bridge

ROOT = Path(torchrec_dtensor_bridge.__file__).parent
PKG = "torchrec_dtensor_bridge"


def module_name(path: Path) -> str:
    """The dotted name of the package's module at ``path``."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [PKG, *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p) for p in ROOT.rglob("*.py")}


def package_imports(path: Path) -> list[tuple[str, bool, int]]:
    """(module of this package imported, inside a function, line) for every import in ``path``.

    ``from . import x`` counts as an import of module ``x`` when it is one, else of the package; a name
    imported from a module counts as that module.
    """
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
              for n in ast.walk(f) if n is not f}
    out = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                full = f"{target}.{a.name}"
                targets.append(full if full in MODULES else target)
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for t in targets:
            if t == PKG or t.startswith(PKG + "."):
                while t not in MODULES and "." in t:
                    t = t.rsplit(".", 1)[0]
                out.append((t, id(node) in nested, node.lineno))
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (its nodes in order, the first repeated at the end), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [node])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None
