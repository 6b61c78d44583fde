"""``python -m loadtest``: one subcommand per sibling module.

A command module provides :class:`Command`'s two functions: ``add_parser`` registers its
subparser (on which it sets nothing: dispatch is by name, through :data:`COMMANDS`), and ``run``
takes the parsed arguments and returns the exit status. Adding ``rate`` is adding ``rate.py``
and one entry here.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Protocol

from .commands import (
    admission,
    attack,
    baseline,
    burst,
    ceiling,
    compare,
    fleet_bench,
    fleet_faults,
    generation,
    idle,
    lanes,
    mix,
    overhead,
    peer,
    rate,
    replay,
    sdk_bench,
    soak,
    tls_cost,
)


class Command(Protocol):
    NAME: str

    def add_parser(self, commands: Any) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


# Assigning a module to a Command-typed name is where mypy checks it against the Protocol.
_burst: Command = burst
_rate: Command = rate
_mix: Command = mix
_replay: Command = replay
_compare: Command = compare
_baseline: Command = baseline
_idle: Command = idle
_admission: Command = admission
_overhead: Command = overhead
_lanes: Command = lanes
_peer: Command = peer
_soak: Command = soak
_attack: Command = attack
_tls_cost: Command = tls_cost
_ceiling: Command = ceiling
_generation: Command = generation
COMMANDS: dict[str, Command] = {
    c.NAME: c
    for c in (
        _burst,
        _rate,
        _mix,
        _replay,
        _compare,
        _baseline,
        _idle,
        _admission,
        _overhead,
        _lanes,
        _peer,
        _soak,
        _attack,
        _tls_cost,
        _ceiling,
        _generation,
        fleet_bench,
        fleet_faults,
        sdk_bench,
    )
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest",
        description="Load tests for the governor (and its queueing baseline). Every run is "
        "bounded by --timeout and connects only to --addr (or --openai); the last line of stdout "
        "is the run's summary as JSON.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except KeyboardInterrupt:
        print("loadtest: interrupted", file=sys.stderr)
        return 130
