"""``idle``: hold many idle connections open and measure what they cost the daemon.

Opens ``--connections`` TCP (or, with ``--tls-ca``, TLS) connections that send nothing, holds them ``--hold`` seconds, then
pings through one more to show the daemon still answers (its pings carry the API key, if
given: to a daemon with tenants, the idle connections show none and are closed after its
``auth_grace``). With ``--pid`` (the daemon's) it reads
the daemon's resident memory (``VmRSS`` in ``/proc/PID/status``) before and with them open.
Raise the daemon's ``--max-connections`` (and both sides' open-file limits) above the count (at
the limit, a new connection displaces the oldest idle one). Every connection comes from
loopback, which ``trusted_sources`` exempts from ``--max-connections-per-source`` by default.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time
from typing import Any

from ..support.connections import add_key_arguments, add_tls_arguments, endpoint_from, run_loop
from ..support.options import DEFAULT_ADDR, parse_addr, positive_float, positive_int, print_json
from ..support.processes import rss_kib

NAME = "idle"


class _Idle(asyncio.Protocol):
    """A connection that sends nothing and notes when the server closes it."""

    def __init__(self, closed: list[int]) -> None:
        self.closed = closed

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed[0] += 1


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME, help="many idle connections: the daemon's memory for them", description=__doc__
    )
    parser.add_argument(
        "--addr", type=parse_addr, default=DEFAULT_ADDR, metavar="HOST:PORT", help="the daemon"
    )
    add_key_arguments(parser)
    add_tls_arguments(parser.add_argument_group("TLS to the governor (default: plain TCP)"))
    parser.add_argument(
        "--connections", type=positive_int, default=10_000, help="idle connections held open"
    )
    parser.add_argument("--hold", type=positive_float, default=5.0, help="seconds they are held")
    parser.add_argument("--pid", type=int, help="the daemon's PID, to read its memory")
    parser.add_argument(
        "--batch", type=positive_int, default=500, help="connections opened at once"
    )


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    endpoint = endpoint_from(args)
    loop = asyncio.get_running_loop()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = args.connections + 64  # and a few for the probe and the interpreter
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard < 0 else min(want, hard), hard))
    async with await endpoint.connect(timeout=10.0) as probe:
        await probe.ping()
        before = rss_kib(args.pid) if args.pid else None
        closed = [0]
        transports: list[asyncio.BaseTransport] = []
        started = time.monotonic()
        try:
            for first in range(0, args.connections, args.batch):
                count = min(args.batch, args.connections - first)
                made = await asyncio.gather(
                    *(
                        loop.create_connection(
                            lambda: _Idle(closed),
                            endpoint.host,
                            endpoint.port,
                            ssl=endpoint.ssl,
                            server_hostname=endpoint.server_hostname,
                        )
                        for _ in range(count)
                    )
                )
                transports.extend(t for t, _ in made)
            opened_s = time.monotonic() - started
            await asyncio.sleep(args.hold)
            ping_start = time.monotonic()
            reply = await probe.ping()
            ping_ms = (time.monotonic() - ping_start) * 1000
            during = rss_kib(args.pid) if args.pid else None
            closed_by_server = closed[0]
        finally:
            for transport in transports:
                transport.close()
    per_conn = None
    if before is not None and during is not None:
        per_conn = round((during - before) * 1024 / args.connections)
    return {
        "command": NAME,
        "connections": len(transports),
        "opened_in_s": round(opened_s, 3),
        "closed_by_server": closed_by_server,
        "ping_status": str(reply.status),
        "ping_ms": round(ping_ms, 3),
        "rss_before_kib": before,
        "rss_with_connections_kib": during,
        "bytes_per_connection": per_conn,
    }


def run(args: argparse.Namespace) -> int:
    try:
        report = run_loop(measure(args))
    except OSError as exc:
        print(f"loadtest idle: {exc}")
        return 1
    print(
        f"{report['connections']} idle connections opened in {report['opened_in_s']} s, "
        f"{report['closed_by_server']} closed by the server during {args.hold:g} s; "
        f"a ping through one more: {report['ping_status']} in {report['ping_ms']} ms"
    )
    if report["rss_before_kib"] is not None:
        print(
            f"daemon RSS {report['rss_before_kib'] / 1024:.1f} MiB before, "
            f"{report['rss_with_connections_kib'] / 1024:.1f} MiB with them: "
            f"{report['bytes_per_connection']} bytes per connection"
        )
    print_json(args, report)
    return 0
