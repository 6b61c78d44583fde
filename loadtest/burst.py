"""``burst``: N clients, each on its own connection, all released at once, R rounds each.

A closed loop: every client connects first; then one :class:`asyncio.Event` (the starting gun)
releases them together, and each uploads one payload per round, starting its next round as soon
as the last one ended. A :class:`~loadtest.monitor.Monitor` samples the daemon meanwhile.

Seed 003 is the default: ``governor serve --runner stub --max-inflight 1 --stub-ms 10000`` and
``python -m loadtest burst --clients 20`` give executed 1, yielded 19, max inflight 1.

Exit status: 0 when the run reached its end (whatever the daemon answered, timeouts included),
1 when the daemon could not be reached before the start (or ``--json-out`` could not be written).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from clients.client import ClientError, GovernorClient, RetryPolicy

from .common import (
    CONNECT_TIMEOUT_S,
    AttemptLog,
    StartError,
    add_common_arguments,
    close_all,
    connect_all,
    positive_int,
    retry_policy,
    run_loop,
)
from .monitor import Monitor, MonitorError
from .tally import Tally, report_lines

NAME = "burst"
DESCRIPTION = """\
N clients, each on its own connection, connect first, then start together; each uploads one
payload per round, R rounds, the next as soon as the last ended. A monitor on its own connection
pings every --sample-ms and prints each change of state (t in ms since the start).

Seed 003: against `governor serve --runner stub --max-inflight 1 --stub-ms 10000`, `burst --clients 20` gives
executed 1, yielded 19, max inflight 1.

Exit status: 0 when the run reached its end (whatever the daemon answered, timeouts included);
1 when the daemon could not be reached before the start, or --json-out could not be written.
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class BurstConfig:
    host: str = "127.0.0.1"
    port: int = 7777
    clients: int = 20
    rounds: int = 1
    payload_bytes: int = 256
    chunk_bytes: int = 8192
    retry: str = "none"
    max_attempts: int = 10
    fixed_ms: int = 500
    timeout_s: float = 60.0
    sample_s: float = 0.05

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BurstConfig:
        host, port = args.addr
        return cls(
            host=host,
            port=port,
            clients=args.clients,
            rounds=args.rounds,
            payload_bytes=args.payload_bytes,
            chunk_bytes=args.chunk_bytes,
            retry=args.retry,
            max_attempts=args.max_attempts,
            fixed_ms=args.fixed_ms,
            timeout_s=args.timeout,
            sample_s=args.sample_ms / 1000,
        )

    @property
    def addr(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def policy(self) -> RetryPolicy:
        return retry_policy(self.retry, self.max_attempts, self.fixed_ms)


def add_parser(commands: Any) -> None:
    """Add ``burst`` to the subparsers of ``python -m loadtest``."""
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME,
        help="N clients released at once, R rounds each (seed 003)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--clients",
        type=positive_int,
        default=20,
        help="connections, one client each (default: 20)",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="uploads per client, one after the other (default: 1)",
    )
    # none by default, so that seed 003 (no client retries) is what a plain run reproduces.
    add_common_arguments(parser, default_retry="none")


def run(args: argparse.Namespace) -> int:
    config = BurstConfig.from_args(args)
    try:
        report = run_loop(burst(config, out=sys.stdout))
    except StartError as exc:
        print(f"loadtest burst: {exc}", file=sys.stderr)
        return 1
    if args.json_out:
        try:
            Path(args.json_out).write_text(json.dumps(report) + "\n", encoding="utf-8")
        except OSError as exc:
            print(f"loadtest burst: cannot write {args.json_out}: {exc}", file=sys.stderr)
            return 1
    return 0


async def burst(config: BurstConfig, *, out: TextIO) -> dict[str, Any]:
    """Run one burst, print its transitions and summary to ``out``, and return the report.

    Raises :class:`StartError` when the daemon cannot be reached before the starting gun.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.timeout_s
    connect_timeout = min(CONNECT_TIMEOUT_S, config.timeout_s)
    opened: list[GovernorClient] = []  # every connection made, closed in finally whatever happens
    tasks: list[asyncio.Task[None]] = []
    monitor: Monitor | None = None
    try:
        try:
            async with asyncio.timeout_at(deadline):
                probe = await GovernorClient.connect(
                    config.host, config.port, timeout=connect_timeout
                )
                opened.append(probe)
                monitor = Monitor(probe, interval_s=config.sample_s, out=out)
                await monitor.baseline()
                await connect_all(
                    config.host, config.port, config.clients, opened=opened, timeout=connect_timeout
                )
        except* (ClientError, OSError, TimeoutError, MonitorError) as group:
            first = group.exceptions[0]
            raise StartError(
                f"cannot reach the governor at {config.addr}: {first or type(first).__name__}"
            ) from None
        clients = opened[1:]
        print(
            f"burst: {config.clients} client(s) x {config.rounds} round(s), "
            f"{config.payload_bytes}-byte payloads, retry {config.retry}, "
            f"against {config.addr} (cap {monitor.cap})",
            file=out,
            flush=True,
        )

        tally = Tally()
        gun = asyncio.Event()
        policy = config.policy
        for index, client in enumerate(clients):
            # Distinct bytes per client, the same every run.
            payload = random.Random(index).randbytes(config.payload_bytes)
            tasks.append(
                loop.create_task(_client(index, client, gun, payload, policy, config, tally))
            )
        t0 = time.monotonic()
        gun.set()
        monitor.start(t0)

        _, pending = await asyncio.wait(tasks, timeout=max(deadline - loop.time(), 0))
        for task in pending:
            task.cancel()  # counted as timed out by the client itself
        await asyncio.gather(*pending, return_exceptions=True)
        duration_s = time.monotonic() - t0
        await monitor.stop()
        for task in tasks:
            if not task.cancelled() and (exc := task.exception()) is not None:
                raise exc  # a bug, not a load-test outcome

        report = tally.report(
            command=NAME,
            addr=config.addr,
            clients=config.clients,
            rounds=config.rounds,
            payload_bytes=config.payload_bytes,
            retry=config.retry,
            max_attempts=policy.max_attempts,
            cap=monitor.cap,
            max_inflight_observed=monitor.max_inflight,
            inflight_peak=monitor.inflight_peak,
            monitor_error=None if monitor.error is None else str(monitor.error),
            duration_s=round(duration_s, 3),
        )
        for line in report_lines(report):
            print(line, file=out)
        if monitor.error is not None:
            print(f"monitor      stopped early: {monitor.error}", file=out)
        print(json.dumps(report), file=out, flush=True)
        return report
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if monitor is not None:
            await monitor.stop(final_sample=False)
        await close_all(opened)


async def _client(
    index: int,
    client: GovernorClient,
    gun: asyncio.Event,
    payload: bytes,
    policy: RetryPolicy,
    config: BurstConfig,
    tally: Tally,
) -> None:
    await gun.wait()
    for round_ in range(config.rounds):
        log = AttemptLog()
        tally.offered += 1
        try:
            result = await client.upload(
                payload,
                job=f"burst-c{index}-r{round_}",
                chunk_bytes=config.chunk_bytes,
                retry=policy,
                on_attempt=log.record,
            )
        except asyncio.CancelledError:
            tally.add_timed_out(log)
            raise
        except (ClientError, OSError) as exc:
            tally.add_error(exc, log)
            return  # the connection is gone: this client's remaining rounds are never offered
        tally.add_result(result, log)
