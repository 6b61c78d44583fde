"""``idle``: hold many idle connections open and measure what they cost the daemon.

Opens ``--connections`` TCP (or, with ``--tls-ca``, TLS) connections that send nothing, holds them ``--hold`` seconds, then
pings through one more to show the daemon still answers. With ``--pid`` (the daemon's) it reads
the daemon's resident memory (``VmRSS`` in ``/proc/PID/status``) before and with them open.
Raise the daemon's ``--max-connections`` (and both sides' open-file limits) above the count (at
the limit, a new connection displaces the oldest idle one). Every connection comes from
loopback, which ``trusted_sources`` exempts from ``--max-connections-per-source`` by default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

from ..support.common import (
    DEFAULT_ADDR,
    add_tls_arguments,
    endpoint_from,
    parse_addr,
    positive_float,
    positive_int,
    run_loop,
)
from .peer import cpu_s

NAME = "idle"


def proc_status(pid: int, field: str) -> int | None:
    """A number from ``/proc/PID/status`` (``VmRSS`` in KiB, ``Threads``); None: not readable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_kib(pid: int) -> int | None:
    """The process's resident set in KiB (None: no such process readable)."""
    return proc_status(pid, "VmRSS")


def parse_busy_s(proc_stat: str) -> float:
    """Seconds every CPU together spent not idle since boot, from ``/proc/stat``'s ``cpu`` line
    (user, nice, system, irq, softirq and steal: time another guest took counts as busy)."""
    fields = proc_stat.split("\n", 1)[0].split()
    if fields[0] != "cpu":
        raise ValueError("no cpu line first in /proc/stat")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """:func:`parse_busy_s` of this machine now."""
    return parse_busy_s(Path("/proc/stat").read_text())


def others_share(
    start: tuple[float, float, float], end: tuple[float, float, float], cpus: int
) -> float:
    """The share of all ``cpus`` that other processes kept busy between two readings of
    (wall seconds, machine busy seconds, busy seconds of ours), 0 to 1."""
    wall, machine, ours = (b - a for a, b in zip(start, end, strict=True))
    if wall <= 0:
        return 0.0
    return round(min(max((machine - ours) / (wall * cpus), 0.0), 1.0), 3)


class CpuWindow:
    """How busy the rest of the machine was over a measure: the machine's busy time less this
    process's and that of the process tree under ``pid`` (the target), as a share of every CPU.
    On a machine shared with other work, a figure taken while this is high is suspect."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid
        self.start = self._read()

    def _read(self) -> tuple[float, float, float]:
        times = os.times()
        ours = times.user + times.system
        for one in process_tree(self.pid) if self.pid is not None else ():
            try:
                ours += cpu_s(one)
            except (OSError, IndexError, ValueError):
                continue  # ended while we looked
        return time.monotonic(), machine_busy_s(), ours

    def others(self) -> float:
        return others_share(self.start, self._read(), os.cpu_count() or 1)


QUIET_SHARE = 0.03  # others below this share of the CPUs: a quiet machine


def wait_quiet(timeout_s: float, pid: int | None = None, window_s: float = 1.0) -> float:
    """Sleep until other processes keep less than :data:`QUIET_SHARE` of the CPUs busy over a
    ``window_s`` (``pid``: the target, whose own tree is not another), or ``timeout_s`` has
    passed; the share last seen. Blocking: from a coroutine, run it in a thread."""
    deadline = time.monotonic() + timeout_s
    while True:
        window = CpuWindow(pid)
        time.sleep(window_s)
        seen = window.others()
        if seen < QUIET_SHARE or time.monotonic() >= deadline:
            return seen


def parse_rollup_kib(smaps_rollup: str) -> dict[str, int]:
    """The ``Name: N kB`` lines of a ``/proc/PID/smaps_rollup`` text, in KiB by name."""
    fields: dict[str, int] = {}
    for line in smaps_rollup.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            fields[name] = int(parts[0])
    return fields


def descendants(parents: dict[int, int], root: int) -> list[int]:
    """Every process below ``root`` in a ``{pid: parent pid}`` map, children before theirs."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found: list[int] = []
    todo = [root]
    while todo:
        below = sorted(children.get(todo.pop(), ()))
        found += below
        todo += below
    return found


def parent_pids() -> dict[int, int]:
    """``{pid: parent pid}`` of every process readable in ``/proc`` now."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:  # (the command name, in parentheses, may hold spaces: split after the last ")")
            parents[int(entry.name)] = int(
                (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            )
        except (OSError, IndexError, ValueError):
            continue  # ended while we looked
    return parents


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it, now."""
    return [pid, *descendants(parent_pids(), pid)]


def tree_rollup_kib(pid: int) -> dict[str, int] | None:
    """``smaps_rollup``'s fields summed over ``pid`` and all its descendants, in KiB; None:
    ``pid`` not readable. ``Pss`` counts a page shared among N processes as 1/N in each, so a
    page shared within the tree (a model file mapped by every worker) counts once in all; but a
    page shared with processes outside it (the same file mapped by another program) counts only
    in part: ``Pss_Anon``, without file pages, does not depend on them."""
    total: dict[str, int] | None = None
    for one in process_tree(pid):
        try:
            fields = parse_rollup_kib(Path(f"/proc/{one}/smaps_rollup").read_text())
        except OSError:
            if one == pid:
                return None
            continue  # ended while we looked
        total = total or {}
        for name, kib in fields.items():
            total[name] = total.get(name, 0) + kib
    return total


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
        "--addr", type=parse_addr, default=parse_addr(DEFAULT_ADDR), metavar="HOST:PORT"
    )
    add_tls_arguments(parser.add_argument_group("TLS to the governor (default: plain TCP)"))
    parser.add_argument("--connections", type=positive_int, default=10_000, help="(default: 10000)")
    parser.add_argument("--hold", type=positive_float, default=5.0, help="seconds (default: 5)")
    parser.add_argument("--pid", type=int, help="the daemon's PID, to read its memory")
    parser.add_argument(
        "--batch", type=positive_int, default=500, help="connections opened at once (default: 500)"
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
    print(json.dumps(report))
    return 0
