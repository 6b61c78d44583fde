"""The packages' shape: the layers import only downwards, and no module inside ``governor/``
imports another that imports it back. ``TYPE_CHECKING`` imports count too (a circle or a layer
crossed there is a design smell, not only a runtime one).

The layers, from the bottom: ``protocol/`` (the wire codec, ours alone), ``clients/`` (on the
codec only), ``governor.telemetry`` (logs and measurements: nothing of the governor's),
``governor.core`` (pure decisions: no IO, no asyncio, no listener; the runners' seam
``governor.runners.base`` is the one thing outside it that it knows), the runners, the ops code
and the listeners, and the composition root (``governor.server``, ``governor.cli``). No two
parts of ``governor/`` (its packages and top-level modules) import each other, even through
others."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imports(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` and the modules of ``package`` it imports."""
    graph = all_imports(package)
    return {
        name: {d for d in deps if d in graph and d != name and d.split(".")[0] == package}
        for name, deps in graph.items()
    }


def all_imports(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` and every module it imports (a name imported from a module
    counts as that module and as ``module.name``, for the case where it is a submodule)."""
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
            deps.update(targets)
        graph[name] = deps
    return graph


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
    assert {
        "governor.core.admission",
        "governor.listeners.session",
        "governor.listeners.tcp",
    } <= set(graph)
    assert cycle(graph) is None


def parts(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph of ``governor``'s parts: a package (``governor.core``) or a top-level module
    (``governor.state``) imports another when one of its modules does."""

    def part(name: str) -> str:
        return ".".join(name.split(".")[:2])

    found: dict[str, set[str]] = {part(name): set() for name in graph}
    for name, deps in graph.items():
        found[part(name)].update(part(d) for d in deps if part(d) != part(name))
    return found


def test_no_two_parts_of_governor_import_each_other() -> None:
    graph = parts(imports("governor"))
    assert {"governor.core", "governor.runners", "governor.ops", "governor.telemetry"} <= set(graph)
    assert cycle(graph) is None
    # (the check sees a circle through two packages' modules)
    crossed = {"governor.a.x": {"governor.b.y"}, "governor.b.y": {"governor.a.z"}}
    assert cycle(parts({**crossed, "governor.a.z": set()})) is not None


OURS = ("protocol", "clients", "governor", "loadtest", "tests")
# What the pure core may not touch: IO, the event loop, and every layer above it.
NOT_IN_CORE = (
    "asyncio", "socket", "ssl", "selectors", "subprocess", "threading", "uvloop", "h11",
    "redis", "prometheus_client", "llama_cpp", "governor.listeners", "governor.ops",
    "governor.server", "governor.cli", "governor.state", "governor.execution",
    "governor.fleetstore", "governor.config", "governor.telemetry",
)  # fmt: skip


def crossings(package: str, allowed: Callable[[str, str], bool]) -> list[str]:
    """``module -> import`` for each import of ``package``'s modules that ``allowed`` refuses."""
    return sorted(
        f"{name} -> {dep}"
        for name, deps in all_imports(package).items()
        for dep in deps
        if not allowed(name, dep)
    )


def within(dep: str, *prefixes: str) -> bool:
    return any(dep == p or dep.startswith(p + ".") for p in prefixes)


def test_the_codec_imports_nothing_of_ours() -> None:
    assert crossings("protocol", lambda _, dep: not within(dep, *OURS[1:])) == []


def test_the_clients_know_only_the_codec() -> None:
    assert (
        crossings("clients", lambda _, dep: not within(dep, "governor", "loadtest", "tests")) == []
    )


def test_the_core_decides_without_io_or_listeners() -> None:
    def allowed(name: str, dep: str) -> bool:
        if not within(name, "governor.core"):
            return True
        if within(dep, "governor.runners"):
            return within(dep, "governor.runners.base")
        return not within(dep, *NOT_IN_CORE, "loadtest", "tests", "clients")

    assert crossings("governor", allowed) == []
    assert len([n for n in all_imports("governor") if within(n, "governor.core")]) >= 10


def test_the_intake_decides_without_io() -> None:
    # The conversation both doors share takes no transport and starts no task: the doors'
    # connection IO (listeners.outbound) and the execution (governor.execution) are above it.
    def allowed(name: str, dep: str) -> bool:
        return name != "governor.intake" or not within(
            dep, *NOT_IN_CORE[:8], "governor.listeners", "governor.execution", "governor.server"
        )

    assert crossings("governor", allowed) == []
    assert "governor.intake" in all_imports("governor")


# Each door's connection as h11 is, bytes in and answers out: the TCP session (its jobs, its
# wire) and the front door's session (its codec, the OpenAI mapping); the transports, timers
# and tasks are the listeners' (tcp, http, outbound).
SESSIONS = tuple(
    f"governor.listeners.{name}"
    for name in ("session", "jobs", "wire", "http_session", "shell", "openai_api")
)


def test_the_doors_sessions_are_sans_io() -> None:
    listeners = ("outbound", "tcp", "http", "base")
    io = (*NOT_IN_CORE[:7], *(f"governor.listeners.{n}" for n in listeners), "governor.server")

    def allowed(name: str, dep: str) -> bool:
        return name not in SESSIONS or not within(dep, *io)

    assert crossings("governor", allowed) == []
    assert set(SESSIONS) <= set(all_imports("governor"))


def test_telemetry_knows_nothing_of_the_governor() -> None:
    def allowed(name: str, dep: str) -> bool:
        return (
            not within(name, "governor.telemetry")
            or not within(dep, "governor", *OURS[1:])
            or within(dep, "governor.telemetry")
        )

    assert crossings("governor", allowed) == []


def test_runners_and_ops_know_no_listener() -> None:
    def allowed(name: str, dep: str) -> bool:
        below = within(name, "governor.runners", "governor.ops")
        return not (below and within(dep, "governor.listeners", "governor.server"))

    assert crossings("governor", allowed) == []


# What a door may read of admission itself: its clock, and the primary pool's runner (what
# the door serves). Every decision, and every place given up or admission taken back, goes
# through the conversation (governor.intake).
DOOR_READS_OF_ADMISSION = {"clock", "primary"}


def admission_uses(tree: ast.AST) -> set[str]:
    """The attributes of ``admission`` (``x.admission.name`` or ``admission.name``) ``tree``
    uses."""
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and (
            (isinstance(node.value, ast.Attribute) and node.value.attr == "admission")
            or (isinstance(node.value, ast.Name) and node.value.id == "admission")
        )
    }


def test_the_doors_reach_admission_only_through_the_conversation() -> None:
    used = {
        f"{path.name}: {name}"
        for path in sorted((ROOT / "governor" / "listeners").glob("*.py"))
        for name in admission_uses(ast.parse(path.read_text()))
        if name not in DOOR_READS_OF_ADMISSION
    }
    assert used == set()
    crossing = ast.parse("state.admission.forget(attempt)\nadmission.clock()")
    assert admission_uses(crossing) == {"forget", "clock"}


def test_the_layer_rules_catch_a_crossing() -> None:
    # The checks above see an import the layers forbid (else they would pass on anything).
    graph = {"governor.core.x": {"asyncio", "governor.core.y"}, "governor.core.y": set()}
    bad = [f"{n} -> {d}" for n, ds in graph.items() for d in ds if within(d, *NOT_IN_CORE)]
    assert bad == ["governor.core.x -> asyncio"]
    assert not within("governor.runners.baseline", "governor.runners.base")


MAX_CLASS_LINES, MAX_FUNCTION_LINES, MAX_TOP_MODULES = 300, 60, 12


def oversized(tree: ast.AST, where: str) -> list[str]:
    """The classes and functions in ``tree`` over their bounds, as ``where:name (lines)``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bound = MAX_CLASS_LINES
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            bound = MAX_FUNCTION_LINES
        else:
            continue
        assert node.end_lineno is not None
        lines = node.end_lineno - node.lineno + 1
        if lines > bound:
            found.append(f"{where}:{node.name} ({lines})")
    return found


def test_no_class_or_function_past_its_size() -> None:
    # A newcomer reads a class or a function whole: past these, it is split along its steps.
    found = [
        big
        for package in ("governor", "clients", "protocol")
        for path in sorted((ROOT / package).rglob("*.py"))
        for big in oversized(ast.parse(path.read_text()), str(path.relative_to(ROOT)))
    ]
    assert found == []
    long = "\n".join(["def f() -> None:", *["    pass"] * MAX_FUNCTION_LINES])
    assert oversized(ast.parse(long), "x") == [f"x:f ({MAX_FUNCTION_LINES + 1})"]


def test_governor_shows_its_layers_at_first_look() -> None:
    top = sorted(p.name for p in (ROOT / "governor").glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top
    layers = {p.name for p in (ROOT / "governor").iterdir() if (p / "__init__.py").exists()}
    assert {"core", "listeners", "ops", "runners", "telemetry"} <= layers


# What a pure test may not touch: the tiers above it start servers, processes and Redis.
NOT_IN_UNIT_TESTS = ("subprocess", "socket", "ssl", "redis", "tests.conftest", "tests.inprocess",
                     "tests.system", "loadtest.support.processes")  # fmt: skip


def test_the_pure_tests_start_nothing() -> None:
    unit = {n: d for n, d in all_imports("tests").items() if within(n, "tests.unit")}
    assert len(unit) >= 20
    crossing = sorted(f"{n} -> {d}" for n, deps in unit.items() for d in deps
                      if within(d, *NOT_IN_UNIT_TESTS))  # fmt: skip
    assert crossing == []
    tiers = {p.name for p in (ROOT / "tests").iterdir() if (p / "__init__.py").exists()}
    assert tiers == {"unit", "inprocess", "system"}
    assert not list((ROOT / "tests").glob("test_*.py"))  # every test in its tier
