"""The load tester's shape: one module per command in ``loadtest/commands/`` (the user's tools)
and ``loadtest/bench/`` (the project's benchmarks), each registered in ``loadtest/cli.py``; what
they share in ``loadtest/support/``, which knows no command; commands share code only through
it, never by importing each other."""

from __future__ import annotations

import pkgutil

import loadtest.bench
import loadtest.commands
from loadtest.cli import BENCHMARKS, REGISTERED

from .test_layout import ROOT, all_imports, crossings, cycle, imports, within

COMMANDS = "loadtest.commands"
BENCH = "loadtest.bench"
SUPPORT = "loadtest.support"


def allowed(name: str, dep: str) -> bool:
    """Whether module ``name`` of loadtest may import ``dep``."""
    if within(name, SUPPORT):
        return not within(dep, COMMANDS, BENCH, "loadtest.cli")
    if within(name, COMMANDS, BENCH) and name not in (COMMANDS, BENCH):
        # A command module, or a part of a command that is a package: no other command
        # (``from . import x`` would name the package), only its own parts.
        command = ".".join(name.split(".")[:3])
        return not within(dep, COMMANDS, BENCH) or within(dep, command)
    return True


def test_the_rule_refuses_a_command_in_support_and_a_command_in_another() -> None:
    assert not allowed("loadtest.support.traffic", "loadtest.commands.rate")
    assert not allowed("loadtest.support.processes", "loadtest.cli")
    assert not allowed("loadtest.support.processes", "loadtest.bench.peer")
    assert not allowed("loadtest.bench.peer", "loadtest.bench.hotpath")
    assert not allowed("loadtest.bench.peer", "loadtest.commands.burst")
    assert not allowed("loadtest.commands.burst", "loadtest.bench.peer")
    assert allowed("loadtest.bench.peer", "loadtest.support.heptamini")
    assert allowed("loadtest.bench.fleet_faults.kill", "loadtest.bench.fleet_faults.leases")
    assert allowed("loadtest.bench.generation", "loadtest.bench.generation.rows")
    assert not allowed("loadtest.bench.fleet_faults.kill", "loadtest.bench.generation.rows")
    assert not allowed("loadtest.bench.generation.rows", "loadtest.bench.peer")
    assert not allowed("loadtest.commands.mix", "loadtest.commands.rate.workloads")
    assert not allowed("loadtest.commands.mix", "loadtest.commands")
    assert allowed("loadtest.commands.mix", "loadtest.support.traffic")
    assert allowed("loadtest.cli", "loadtest.commands.mix")


def test_support_knows_no_command_and_no_command_another() -> None:
    graph = all_imports("loadtest")
    assert {"loadtest.support.processes", "loadtest.commands.burst", "loadtest.cli"} <= set(graph)
    assert crossings("loadtest", allowed) == []


def test_no_import_circle_inside_loadtest() -> None:
    assert cycle(imports("loadtest")) is None


def test_every_command_module_is_registered_once() -> None:
    for package, commands in ((loadtest.commands, REGISTERED), (loadtest.bench, BENCHMARKS)):
        modules = {f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)}
        registered = [getattr(c, "__name__", "") for c in commands]
        assert sorted(registered) == sorted(modules)
    every = (*REGISTERED, *BENCHMARKS)
    assert len({c.NAME for c in every}) == len(every)


MAX_LINES = 500


def test_no_command_module_is_longer_than_500_lines() -> None:
    """A longer command is split along its seams: a package, the command in its ``__init__``
    (``NAME``, ``add_parser``, ``run``), its parts in modules beside it."""
    root = ROOT / "loadtest"
    paths = sorted([*(root / "commands").rglob("*.py"), *(root / "bench").rglob("*.py")])
    assert len(paths) > 25
    long = {
        str(p.relative_to(ROOT)): n
        for p in paths
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
