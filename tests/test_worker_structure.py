"""The worker package reads top-down (issue 20): main -> runtime -> parts -> shared. No part
imports the runtime or refers back to it through an ``rt`` handle, and the package's import
graph has no cycle. Read from the source (ast), so it runs without starting anything."""

from __future__ import annotations

import ast
from pathlib import Path

WORKER = Path(__file__).resolve().parents[1] / "services" / "worker"
PACKAGE = "services.worker."


def _imports(path: Path) -> set[str]:
    """The services.worker modules ``path`` imports (anywhere in it: TYPE_CHECKING blocks
    and function bodies included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n.removeprefix(PACKAGE) for n in names if n.startswith(PACKAGE)}
    return found


def _module(path: Path) -> str:
    """``prefill.prefill_role`` for services/worker/prefill/prefill_role.py."""
    return ".".join(path.relative_to(WORKER).with_suffix("").parts)


def _sources() -> list[Path]:
    return sorted(p for p in WORKER.rglob("*.py") if p.name != "__init__.py")


def _graph() -> dict[str, set[str]]:
    return {_module(p): _imports(p) for p in _sources()}


def test_only_main_imports_the_runtime() -> None:
    importers = {mod for mod, deps in _graph().items() if "runtime" in deps}
    assert importers == {"main"}


def test_the_worker_import_graph_has_no_cycle() -> None:
    graph = _graph()
    done: set[str] = set()

    def visit(mod: str, path: tuple[str, ...]) -> None:
        assert mod not in path, f"import cycle: {' -> '.join((*path, mod))}"
        if mod in done:
            return
        for dep in graph.get(mod, set()):
            visit(dep, (*path, mod))
        done.add(mod)

    for mod in graph:
        visit(mod, ())
    assert "runtime" in done and len(done) == len(graph)


def test_no_part_holds_the_runtime() -> None:
    """Parts get what they need in their constructor: nothing below the runtime names an
    ``rt`` or takes a ``WorkerRuntime``."""
    offenders = []
    for path in _sources():
        if _module(path) in ("runtime", "main"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name) and node.id in ("rt", "WorkerRuntime"):
                offenders.append(f"{_module(path)}:{node.lineno}")
            if isinstance(node, ast.arg) and node.arg == "rt":
                offenders.append(f"{_module(path)}:{node.lineno}")
    assert offenders == []
