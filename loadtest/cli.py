"""``python -m loadtest``: one subcommand per module of :mod:`loadtest.commands` (the user's
tools), and the group ``bench``, one subcommand per module of :mod:`loadtest.bench` (the
project's own benchmarks).

A command module provides :class:`Command`'s two functions: ``add_parser`` registers its
subparser (on which it sets nothing: dispatch is by name, through :data:`COMMANDS`), and ``run``
takes the parsed arguments and returns the exit status. Adding a command is adding its module
and one entry in :data:`REGISTERED` (a tool) or :data:`BENCHMARKS` (a benchmark).

A benchmark's old top-level spelling (``python -m loadtest peer``) still runs it for one
release, left out of ``--help``, with a warning on stderr naming the new one.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Protocol

from clients.helptext import HelpParser

from .bench import (
    admission,
    ceiling,
    door_refusal,
    doors,
    fleet_bench,
    fleet_faults,
    generation,
    guidellm_bench,
    hotpath,
    lanes,
    overhead,
    peer,
    preemption,
    sdk_bench,
    sidecar,
    tls_cost,
)
from .commands import attack, baseline, burst, compare, idle, mix, rate, replay, soak
from .support.options import CommandParser

GROUP = "bench"


class Command(Protocol):
    NAME: str

    def add_parser(self, commands: Any) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


# The user's tools, in the order ``--help`` lists them. The annotation is where mypy checks each
# module against the Protocol.
REGISTERED: tuple[Command, ...] = (
    burst,
    rate,
    mix,
    replay,
    compare,
    baseline,
    idle,
    soak,
    attack,
)
# The project's benchmarks, ``bench COMMAND``, in the order ``bench --help`` lists them.
BENCHMARKS: tuple[Command, ...] = (
    admission,
    overhead,
    lanes,
    peer,
    hotpath,
    tls_cost,
    ceiling,
    generation,
    fleet_bench,
    fleet_faults,
    sdk_bench,
    sidecar,
    guidellm_bench,
    door_refusal,
    doors,
    preemption,
)
COMMANDS: dict[str, Command] = {c.NAME: c for c in (*REGISTERED, *BENCHMARKS)}


class _OldSpellings:
    """Where a benchmark registers its old top-level spelling: the same options, no entry in
    ``--help``, and a warning naming ``bench NAME`` when it is used."""

    def __init__(self, commands: Any) -> None:
        self._commands = commands

    def add_parser(self, name: str, **kwargs: Any) -> Any:
        kwargs.pop("help", None)  # an entry without help is left out of the listing
        return self._commands.add_parser(name, renamed_to=f"{GROUP} {name}", **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = HelpParser(
        prog="python -m loadtest",
        description="Load tests for the governor (and its queueing baseline), and under "
        f"'{GROUP}' the project's own benchmarks, which start the servers they measure. Every "
        "run is bounded in count and time (the traffic commands' --timeout, the benchmarks' "
        "rounds and their own limits) and connects only to --addr, --openai or the loopback "
        "servers it starts; with --json, the last line of stdout is the run's report as JSON.",
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=CommandParser
    )
    for command in REGISTERED:
        command.add_parser(commands)
    bench = commands.add_parser(
        GROUP,
        group=True,
        help="the project's benchmarks: the governor against a peer, its costs, its ceilings",
        description="The project's own benchmarks: each starts the servers it measures (the "
        "governor, a peer to compare it with, a model server) on loopback ports of its own. "
        "docs/BENCHMARKS.md has their latest figures.",
    )
    benchmarks = bench.add_subparsers(
        dest="benchmark", required=True, metavar="COMMAND", parser_class=CommandParser
    )
    old_spellings = _OldSpellings(commands)
    for command in BENCHMARKS:
        command.add_parser(benchmarks)
        command.add_parser(old_spellings)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    name = args.benchmark if args.command == GROUP else args.command
    try:
        return COMMANDS[name].run(args)
    except KeyboardInterrupt:
        print("loadtest: interrupted", file=sys.stderr)
        return 130
