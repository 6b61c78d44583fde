"""``python -m loadtest``: one subcommand per module of :mod:`loadtest.commands`.

A command module provides :class:`Command`'s two functions: ``add_parser`` registers its
subparser (on which it sets nothing: dispatch is by name, through :data:`COMMANDS`), and ``run``
takes the parsed arguments and returns the exit status. Adding a command is adding its module
and one entry in :data:`REGISTERED`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Protocol

from clients.helptext import HelpParser

from .commands import (
    admission,
    attack,
    baseline,
    burst,
    ceiling,
    compare,
    door_refusal,
    doors,
    fleet_bench,
    fleet_faults,
    generation,
    guidellm_bench,
    hotpath,
    idle,
    lanes,
    mix,
    overhead,
    peer,
    preemption,
    rate,
    replay,
    sdk_bench,
    sidecar,
    soak,
    tls_cost,
)
from .support.options import CommandParser


class Command(Protocol):
    NAME: str

    def add_parser(self, commands: Any) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


# Every command, in the order ``--help`` lists them. The annotation is where mypy checks each
# module against the Protocol.
REGISTERED: tuple[Command, ...] = (
    burst,
    rate,
    mix,
    replay,
    compare,
    baseline,
    idle,
    admission,
    overhead,
    lanes,
    peer,
    hotpath,
    soak,
    attack,
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
COMMANDS: dict[str, Command] = {c.NAME: c for c in REGISTERED}


def build_parser() -> argparse.ArgumentParser:
    parser = HelpParser(
        prog="python -m loadtest",
        description="Load tests for the governor (and its queueing baseline). Every run is "
        "bounded in count and time (the traffic commands' --timeout, the benchmarks' rounds and "
        "their own limits) and connects only to --addr, --openai or the loopback servers it "
        "starts; with --json, the last line of stdout is the run's report as JSON.",
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=CommandParser
    )
    for command in REGISTERED:
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except KeyboardInterrupt:
        print("loadtest: interrupted", file=sys.stderr)
        return 130
