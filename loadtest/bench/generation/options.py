"""``bench generation``'s options: which targets and measures, how each target is started, and
what each measure sends."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from ...support.arguments import (
    add_llama_server,
    add_model,
    add_n_ctx,
    add_quiet_wait,
    add_round_timeout,
    add_threads,
)
from ...support.options import positive_float, positive_int, positive_ints
from .servers import DEFAULT_TARGETS, TARGETS


def parse_choices(allowed: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: a comma-separated list of ``allowed`` names, in the order given."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(name.strip() for name in text.split(",") if name.strip())
        unknown = [name for name in names if name not in allowed]
        if not names or unknown or len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(
                f"{text!r}: a list of distinct names among {','.join(allowed)}"
            )
        return names

    return parse


def add_target_options(parser: argparse.ArgumentParser, measures: tuple[str, ...]) -> None:
    """Which targets and measures, and how each target is started."""
    parser.add_argument(
        "--targets",
        type=parse_choices(TARGETS),
        default=DEFAULT_TARGETS,
        help=f"comma-separated, among {','.join(TARGETS)}",
    )
    parser.add_argument(
        "--measures",
        type=parse_choices(measures),
        default=measures,
        help=f"comma-separated, among {','.join(measures)}",
    )
    add_model(parser)
    parser.add_argument(
        "--streams",
        type=positive_ints,
        default=(1, 4, 8, 16),
        help="concurrent streams, a round each",
    )
    parser.add_argument(
        "--slots", type=positive_int, help="S: max_inflight, -np (default: the most --streams)"
    )
    add_threads(parser, default=2, text="governor and servers")
    add_n_ctx(parser, text="governor --n-ctx")
    parser.add_argument(
        "--server-ctx",
        type=positive_int,
        default=16384,
        help="llama-server -c (but for memory: N x --n-ctx)",
    )
    parser.add_argument(
        "--memory-slots",
        type=positive_ints,
        help="the memory measure's slot counts N, a target started for each (default: 1 and S)",
    )
    parser.add_argument("--n-gpu-layers", type=int, default=0, help="-1: all")
    add_llama_server(
        parser, text="llama-server binary (where deploy/build-llama-server.sh puts it)"
    )


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    """What each measure sends, and how its rounds are timed."""
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=128,
        help="new tokens of each throughput stream and each rewrite",
    )
    parser.add_argument("--chats", type=positive_int, default=20, help="idle chats")
    parser.add_argument("--chat-tokens", type=positive_int, default=16, help="a chat's new tokens")
    parser.add_argument(
        "--rewrite-tokens",
        type=positive_int,
        default=1400,
        help="a rewrite's prompt, in tokens at least",
    )
    parser.add_argument(
        "--burst-slots",
        type=positive_ints,
        help="the burst's slot counts S, a target started for each (default: --slots)",
    )
    parser.add_argument(
        "--burst-delay",
        type=positive_float,
        default=0.2,
        help="seconds from the rewrites to the chats",
    )
    add_round_timeout(parser)
    add_quiet_wait(parser, what="measure")
