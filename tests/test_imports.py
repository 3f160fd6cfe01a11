"""No import circles in protocol/, server/ or loadtest/.

Every module is parsed (nothing is imported) and every ``import`` in it counts:
at module level, inside functions, under ``TYPE_CHECKING``. ``from a.b import c``
points at the module ``a.b.c`` when there is one, else at ``a.b``; a package
that its submodules live in is not counted as imported by them (Python runs
its ``__init__`` first, which is no dependency of theirs).
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "server", "loadtest")

Graph = dict[str, set[str]]


def module_files() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imports_of(module: str, path: Path, modules: Mapping[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``module`` imports, anywhere in it."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                names.append(submodule if submodule in modules else base)
    found = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]  # ``import a.b.c`` of a name inside a module
        if name and name != module and not module.startswith(name + "."):
            found.add(name)
    return found


def import_graph(modules: Mapping[str, Path]) -> Graph:
    return {module: imports_of(module, path, modules) for module, path in modules.items()}


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or None when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state:
                found = visit(target)
                if found is not None:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found is not None:
                return found
    return None


def test_the_cycle_finder_names_a_circle_and_passes_a_tree() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_every_kind_of_import_is_an_edge(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    sources = {
        "pkg/__init__.py": "from pkg.low import thing\n",
        "pkg/low.py": "thing = 1\n",
        "pkg/mid.py": "from . import low\n",
        "pkg/top.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    import pkg.mid\n"
            "def later() -> None:\n    from .low import thing\n"
        ),
    }
    modules = {}
    for name, text in sources.items():
        path = tmp_path / name
        path.write_text(text)
        dotted = name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        modules[dotted] = path
    graph = import_graph(modules)
    assert graph == {
        "pkg": {"pkg.low"},
        "pkg.low": set(),
        "pkg.mid": {"pkg.low"},
        "pkg.top": {"pkg.mid", "pkg.low"},
    }


def test_no_import_circles_in_protocol_server_or_loadtest() -> None:
    modules = module_files()
    graph = import_graph(modules)
    assert len(graph) > 100 and "server.wiring" in graph["server.app"], "the graph is not parsed"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_hub_imports_no_door_and_no_service_imports_the_hub() -> None:
    graph = import_graph(module_files())
    assert not {m for m in graph["server.node"] if m.startswith("server.ingress")}
    importers = {m for m, targets in graph.items() if "server.node" in targets}
    assert importers == {"server.app", "server.wiring"}
