"""``burst``: N clients, each on its own connection, all released at once, R rounds each.

A closed loop: every client connects first; then one starting gun releases them together, and
each sends one request per round, starting its next round as soon as the last one ended. A
monitor on its own connection pings the governor meanwhile and prints each change of state.

The reference case runs on the defaults: ``governor serve --runner stub --max-inflight 1
--stub-ms 10000`` and ``python -m loadtest burst --clients 20`` give executed 1, yielded 19, max
inflight 1.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from clients.helptext import RawDescriptionDefaultsHelpFormatter

from ..support import traffic
from ..support.driver import closed_loop
from ..support.options import positive_int
from ..support.report import Slo, step
from ..support.targets import Target
from ..support.workload import Request

NAME = "burst"
DESCRIPTION = """\
N clients, each on its own connection, connect first, then start together; each sends one
request per round, R rounds, the next as soon as the last ended. By default a request is an
opaque --payload-bytes upload; with --prompt-tokens it is an inference job (streamed). A monitor
on its own connection pings every --sample-ms and prints each change of state (t in ms since
the start).

The reference case: against `governor serve --runner stub --max-inflight 1 --stub-ms 10000`,
`burst --clients 20` gives executed 1, yielded 19, max inflight 1.
"""


def add_parser(commands: Any) -> None:
    """Add ``burst`` to the subparsers of ``python -m loadtest``."""
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME,
        help="N clients released at once, R rounds each",
        description=DESCRIPTION,
        formatter_class=RawDescriptionDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--clients",
        type=positive_int,
        default=20,
        help="connections, one client each",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="requests per client, one after the other",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=positive_int,
        help="send inference jobs of this many prompt tokens instead of payload uploads",
    )
    parser.add_argument(
        "--output-tokens",
        type=positive_int,
        default=16,
        help="with --prompt-tokens: max_new_tokens of each job",
    )
    parser.add_argument(
        "--ping", action="store_true", help="send pings instead (the ping rate: no job at all)"
    )
    parser.add_argument(
        "--reconnect",
        action="store_true",
        help="open a new connection for each request and close it after (default: one "
        "connection per client, reused)",
    )
    traffic.add_payload_arguments(parser)
    # none by default: a plain run sends each request once, so that the reference case above
    # (19 of 20 yielded) is what it reproduces.
    traffic.add_arguments(parser, default_retry="none", default_max_wait=0.0)


def run(args: argparse.Namespace) -> int:
    payload = None if args.prompt_tokens else args.payload_bytes
    target = traffic.target_from(
        args, payload_bytes=payload, ping=args.ping, reconnect=args.reconnect
    )
    request = Request(0.0, "default", args.prompt_tokens or 0, args.output_tokens)
    label = f"burst {args.clients} x {args.rounds}"

    def make(_client: int, round_: int) -> Request | None:
        return request if round_ < args.rounds else None

    async def steps(target: Target, slo: Slo) -> list[dict[str, Any]]:
        what = (
            "pings"
            if args.ping
            else f"{payload}-byte payloads"
            if payload is not None
            else (f"{args.prompt_tokens}+{args.output_tokens}-token jobs")
        )
        print(
            f"burst: {args.clients} client(s) x {args.rounds} round(s), {what}, "
            f"retry {args.retry}, against {target.addr}",
            flush=True,
        )
        result = await closed_loop(
            target,
            args.clients,
            make,
            timeout_s=args.timeout,
            sample_s=args.sample_ms / 1000,
            label=label,
            total=args.clients * args.rounds,
            out=sys.stdout,
            progress_out=traffic.progress_stream(args),
        )
        return [
            traffic.with_replicas(
                target, step(result, slo, label=label, reserve=args.interactive_reserve)
            )
        ]

    return traffic.execute(NAME, args, target, steps)
