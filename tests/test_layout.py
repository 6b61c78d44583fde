"""The package's shape: no module inside ``governor/`` imports another that imports it back,
``TYPE_CHECKING`` imports included (a circle there is a design smell, not only a runtime one)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imports(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` and the modules of ``package`` it imports."""
    graph: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        is_init = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_init else parts)
        here = name if is_init else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    target = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                targets = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t.split(".")[0] == package)
        graph[name] = deps
    return {name: {d for d in deps if d in graph and d != name} for name, deps in graph.items()}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports in ``graph``, or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for dep in sorted(graph[node]):
            found = visit(dep, [*path, node])
            if found:
                return found
        done.add(node)
        return None

    for node in sorted(graph):
        found = visit(node, [])
        if found:
            return found
    return None


def test_the_cycle_finder_finds_a_circle() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle_inside_governor() -> None:
    graph = imports("governor")
    assert {"governor.admission", "governor.session", "governor.connection"} <= set(graph)
    assert cycle(graph) is None
