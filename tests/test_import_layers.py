"""Import layers, read from the source with ``ast`` (function-level imports included, nothing imported):
no cycle between the packages of agora_client (tui counts as one), none between the modules of one package,
and agora_client never imports tui.

agora_client's top-level modules (events, config, runtime, ...) belong to no package: they take part in the
module-level check among themselves only.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP_PACKAGES = ("agora_client", "tui")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def find_modules() -> dict[str, Path]:
    return {module_name(path): path for top in TOP_PACKAGES for path in sorted((ROOT / top).rglob("*.py"))}


MODULES = find_modules()


def imported_names(name: str, path: Path, known: Iterable[str]) -> set[str]:
    """Every module of ours that ``name`` imports anywhere in its body; ``from pkg import sub`` counts as pkg.sub
    alone, ``from pkg import something_else`` as pkg."""
    known = set(known)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in known else source)
    return {imported for imported in found if imported in known and imported != name}


def import_graph() -> dict[str, set[str]]:
    return {name: imported_names(name, path, MODULES) for name, path in MODULES.items()}


def package_of(module: str) -> str | None:
    """``agora_client.<package>`` or ``tui``; None for agora_client itself and its top-level modules."""
    parts = module.split(".")
    if parts[0] == "tui":
        return "tui"
    package = ".".join(parts[:2])
    return package if len(parts) > 2 or MODULES[package].name == "__init__.py" else None


def group_of(module: str) -> str:
    """The modules that must not import each other in a circle: a package's, or agora_client's top-level ones."""
    return package_of(module) or "agora_client"


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_graph_sees_function_level_and_relative_imports() -> None:
    graph = import_graph()
    assert "agora_client.discovery.validators" in graph["agora_client.discovery.dht"]  # top level, absolute
    assert "agora_client.snapshots.format" in graph["agora_client.snapshots.store"]  # relative
    assert "agora_client.snapshots.s3" in graph["agora_client.snapshots.location"]  # inside a function
    assert "agora_client.snapshots" in graph["agora_client.checkpoints.sets"]  # a name from the package's __init__


def test_find_cycle_names_the_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) is None


def test_no_cycle_between_packages() -> None:
    packages: dict[str, set[str]] = {}
    for module, imports in import_graph().items():
        if (package := package_of(module)) is None:
            continue
        packages.setdefault(package, set())
        for imported in imports:
            if (target := package_of(imported)) not in (None, package):
                packages[package].add(target)
    cycle = find_cycle(packages)
    assert cycle is None, "packages import each other: " + " -> ".join(cycle or [])


def test_no_cycle_between_the_modules_of_a_package() -> None:
    graph = import_graph()
    within = {
        module: {imported for imported in imports if group_of(imported) == group_of(module)}
        for module, imports in graph.items()
    }
    cycle = find_cycle(within)
    assert cycle is None, "modules import each other: " + " -> ".join(cycle or [])


def test_agora_client_never_imports_tui() -> None:
    offenders = sorted(
        f"{module} imports {imported}"
        for module, imports in import_graph().items()
        if module.startswith("agora_client")
        for imported in imports
        if package_of(imported) == "tui"
    )
    assert offenders == []
