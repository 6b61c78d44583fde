"""``rate``: an open loop, requests arriving at a target rate for a duration, whatever the
target answers (Poisson by default); several rates make a sweep, one step each.

Every request is an inference job of one class, ``default``; ``mix`` is the same with classes.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from ..support import traffic
from ..support.common import positive_float, positive_int
from ..support.workload import ARRIVALS, ClassSpec, Request, arrivals, mixed, parse_range

NAME = "rate"


def rates(text: str) -> list[float]:
    """``R[,R...]`` requests per second."""
    try:
        values = [positive_float(v) for v in text.split(",")]
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of positive rates") from None
    return values


def token_range(text: str) -> tuple[int, int]:
    try:
        return parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_schedule_arguments(parser: argparse.ArgumentParser, *, default_rate: str) -> None:
    parser.add_argument(
        "--rate",
        type=rates,
        default=rates(default_rate),
        metavar="R[,R...]",
        help=f"requests per second; a list runs one step per rate (default: {default_rate})",
    )
    parser.add_argument(
        "--duration",
        type=positive_float,
        default=10.0,
        help="seconds of arrivals per step; --timeout bounds the step, its tail included "
        "(default: 10)",
    )
    parser.add_argument(
        "--arrival",
        choices=ARRIVALS,
        default="poisson",
        help="poisson (exponential gaps), constant (even gaps) or burst (all at once) "
        "(default: poisson)",
    )
    parser.add_argument(
        "--max-requests",
        type=positive_int,
        default=10_000,
        help="at most this many requests per step: rate x duration, capped (default: 10000)",
    )
    traffic.add_open_loop_arguments(parser)


def workloads(
    args: argparse.Namespace, classes: tuple[ClassSpec, ...]
) -> list[tuple[str, list[Request], float | None]]:
    """One workload per --rate: its label, its requests and its offered rate."""
    out: list[tuple[str, list[Request], float | None]] = []
    for rate in args.rate:
        rng = random.Random(args.seed)
        count = min(max(round(rate * args.duration), 1), args.max_requests)
        times = arrivals(args.arrival, rate, count, rng)
        label = f"{args.arrival} {rate:g}/s" if args.arrival != "burst" else f"burst of {count}"
        out.append((label, mixed(times, classes, rng), rate if args.arrival != "burst" else None))
    return out


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME,
        help="open loop: arrivals at a rate for a duration (Poisson or constant), rate sweeps",
        description=__doc__,
    )
    parser.add_argument(
        "--prompt-tokens",
        type=token_range,
        default=(64, 64),
        metavar="N|MIN..MAX",
        help="prompt length of each job, fixed or uniform in a range (default: 64)",
    )
    parser.add_argument(
        "--output-tokens",
        type=token_range,
        default=(16, 16),
        metavar="N|MIN..MAX",
        help="max_new_tokens of each job, fixed or uniform in a range (default: 16)",
    )
    add_schedule_arguments(parser, default_rate="2")
    traffic.add_arguments(parser, default_retry="hint")


def run(args: argparse.Namespace) -> int:
    classes = (ClassSpec("default", 1.0, args.prompt_tokens, args.output_tokens),)
    target = traffic.target_from(args)
    return traffic.execute(NAME, args, target, traffic.open_steps(args, workloads(args, classes)))
