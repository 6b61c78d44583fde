"""``rate``: an open loop, requests arriving at a target rate for a duration, whatever the
target answers (Poisson by default); several rates make a sweep, one step each.

Every request is an inference job of one class, ``default``; ``mix`` is the same with classes.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..support import traffic
from ..support.workload import ClassSpec, parse_range

NAME = "rate"


def token_range(text: str) -> tuple[int, int]:
    try:
        return parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME,
        help="open loop: arrivals at a rate for a duration (Poisson or constant), rate sweeps",
        description=__doc__,
    )
    parser.add_argument(
        "--prompt-tokens",
        type=token_range,
        default="64",
        metavar="N|MIN..MAX",
        help="prompt length of each job, fixed or uniform in a range",
    )
    parser.add_argument(
        "--output-tokens",
        type=token_range,
        default="16",
        metavar="N|MIN..MAX",
        help="max_new_tokens of each job, fixed or uniform in a range",
    )
    traffic.add_schedule_arguments(parser, default_rate="2")
    traffic.add_arguments(parser, default_retry="hint")


def run(args: argparse.Namespace) -> int:
    classes = (ClassSpec("default", 1.0, args.prompt_tokens, args.output_tokens),)
    target = traffic.target_from(args)
    return traffic.execute(
        NAME, args, target, traffic.open_steps(args, traffic.workloads(args, classes))
    )
