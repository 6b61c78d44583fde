"""``mix``: an open loop of interactive, heavy and background requests, each class with its share
and its own prompt and output length ranges; reported per class.

On the governor a class named after a lane asks for that lane (``--no-lanes``: the policy
alone decides). Arrivals as in ``rate`` (``--arrival burst`` sends them all at once).
"""

from __future__ import annotations

import argparse
from typing import Any

from ..support import traffic
from ..support.workload import DEFAULT_MIX, parse_class, parse_mix

NAME = "mix"
CLASSES = "; ".join(
    f"{c.name}:share={c.share:g},prompt={c.prompt[0]}..{c.prompt[1]},"
    f"output={c.output[0]}..{c.output[1]}"
    for c in DEFAULT_MIX
)


def class_spec(text: str) -> str:
    try:
        parse_class(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME,
        help="open loop of interactive, heavy and background classes, reported per class",
        description=__doc__,
    )
    parser.add_argument(
        "--class",
        dest="classes",
        action="append",
        default=[],
        type=class_spec,
        metavar="NAME:share=S,prompt=MIN..MAX,output=MIN..MAX",
        help="add a class or change one (omitted fields keep the default; share=0 drops it); "
        f"repeatable. Defaults: {CLASSES}",
    )
    traffic.add_schedule_arguments(parser, default_rate="1")
    traffic.add_arguments(parser, default_retry="hint")


def run(args: argparse.Namespace) -> int:
    try:
        classes = parse_mix(args.classes)
    except ValueError as exc:
        print(f"loadtest mix: {exc}")
        return 2
    target = traffic.target_from(args)
    return traffic.execute(
        NAME, args, target, traffic.open_steps(args, traffic.workloads(args, classes))
    )
