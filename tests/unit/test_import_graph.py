"""The package's import graph: the lookup stack one way down (lookup -> optim, lookup -> kernels), no import
inside a function (to dodge a cycle or otherwise), no cycle between modules, between subpackages, nor between
the package's top-level parts (subpackages and top-level modules as nodes); read from the source with ``ast``."""

from __future__ import annotations

from pathlib import Path

from ..import_graph import PKG, ROOT, find_cycle, module_name, package_imports

LAYERS = ["lookup", "optim", "kernels"]  # each may import only those after it


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, inside a function) for every import of this package in ``path``."""
    return [(t, nested) for t, nested, _ in package_imports(path)]


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _edges() -> dict[str, set[str]]:
    modules = {module_name(p) for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        src = module_name(path)
        for target, _ in _imports(path):
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != src:
                graph.setdefault(src, set()).add(target)
    return graph


def test_no_function_level_imports():
    found = [f"{p.relative_to(ROOT)} imports {t}" for p in ROOT.rglob("*.py") for t, inner in _imports(p) if inner]
    assert not found, found


def test_no_cycle_between_modules():
    """Between plain modules (a package's ``__init__`` imports its own children, so packages are left out)."""
    packages = {module_name(p) for p in ROOT.rglob("__init__.py")}
    graph = {src: targets - packages for src, targets in _edges().items() if src not in packages}
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_layers_import_only_downwards():
    wrong = []
    for src, targets in _edges().items():
        a = _subpackage(src)
        for t in targets:
            b = _subpackage(t)
            if a in LAYERS and b in LAYERS and LAYERS.index(b) < LAYERS.index(a):
                wrong.append(f"{src} -> {t}")
    assert not wrong, wrong


def _top_level_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between the package's top-level parts: each subpackage (all its modules as one node) and
    each top-level module (``agreement``, ``layout``, ...); the root ``__init__`` left out (it imports all)."""
    graph: dict[str, set[str]] = {}
    for src, targets in edges.items():
        for t in targets:
            a, b = _subpackage(src), _subpackage(t)
            if a and b and a != b:
                graph.setdefault(a, set()).add(b)
    return graph


def test_no_cycle_between_top_level_parts():
    """Packages and top-level modules as nodes: one way down (``agreement`` imported ``convert.groups``
    while ``convert`` imported ``agreement``, a cycle the module graph could not see)."""
    cycle = find_cycle(_top_level_graph(_edges()))
    assert cycle is None, f"import cycle between parts of the package: {' -> '.join(cycle or [])}"


def test_the_top_level_graph_finds_the_old_agreement_convert_cycle():
    """The check above is able to fail: the old edge put back makes it find the cycle."""
    edges = {k: set(v) for k, v in _edges().items()}
    edges.setdefault(f"{PKG}.agreement", set()).add(f"{PKG}.convert.placements")
    cycle = find_cycle(_top_level_graph(edges))
    assert cycle is not None and "agreement" in cycle and "convert" in cycle, cycle


def test_no_cycle_between_subpackages():
    graph: dict[str, set[str]] = {}
    for src, targets in _edges().items():
        for t in targets:
            a, b = _subpackage(src), _subpackage(t)
            if a != b and a and b and (ROOT / a).is_dir() and (ROOT / b).is_dir():
                graph.setdefault(a, set()).add(b)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"
    assert graph.get("kernels", set()) <= set(), graph.get("kernels")  # the bottom imports no other subpackage
