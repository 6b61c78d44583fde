"""The load tester's shape: one module per command in ``loadtest/commands/``, each registered in
``loadtest/cli.py``; what they share in ``loadtest/support/``, which knows no command; commands
share code only through it, never by importing each other."""

from __future__ import annotations

import pkgutil

import loadtest.commands
from loadtest.cli import REGISTERED

from .test_layout import all_imports, crossings, cycle, imports, within

COMMANDS = "loadtest.commands"
SUPPORT = "loadtest.support"


def allowed(name: str, dep: str) -> bool:
    """Whether module ``name`` of loadtest may import ``dep``."""
    if within(name, SUPPORT):
        return not within(dep, COMMANDS, "loadtest.cli")
    if within(name, COMMANDS) and name != COMMANDS:
        # A command module: no other command (``from . import x`` would name the package).
        return not within(dep, COMMANDS) or within(dep, name)
    return True


def test_the_rule_refuses_a_command_in_support_and_a_command_in_another() -> None:
    assert not allowed("loadtest.support.traffic", "loadtest.commands.rate")
    assert not allowed("loadtest.support.processes", "loadtest.cli")
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
    modules = {f"{COMMANDS}.{m.name}" for m in pkgutil.iter_modules(loadtest.commands.__path__)}
    registered = [getattr(c, "__name__", "") for c in REGISTERED]
    assert sorted(registered) == sorted(modules)
    assert len({c.NAME for c in REGISTERED}) == len(REGISTERED)
