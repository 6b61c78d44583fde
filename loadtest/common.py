"""What every load-test command shares: options, retry modes, timed connections, the loop.

Each command (``burst`` now; ``rate``, ``mix``, ``replay``, ``compare`` later) is a sibling
module that adds its own subparser with :func:`add_common_arguments` and drives
:class:`clients.GovernorClient` connections (timing each attempt with :class:`AttemptLog`), a :class:`loadtest.monitor.Monitor` and a
:class:`loadtest.tally.Tally`.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvloop

from clients.client import NO_RETRY, GovernorClient, RetryPolicy, parse_address
from protocol.codes import Status
from protocol.frames import Reply

DEFAULT_ADDR = "127.0.0.1:7777"
RETRY_MODES = ("none", "hint", "naive", "fixed")
CONNECT_TIMEOUT_S = 10.0  # per connection, and never more than what is left of --timeout
CLOSE_TIMEOUT_S = 5.0  # closing waits for unsent bytes to drain; a stuck peer must not hang us

T = TypeVar("T")


class StartError(Exception):
    """The daemon could not be reached before the starting gun (exit status 1)."""


# Options -------------------------------------------------------------------------------


def parse_addr(text: str) -> tuple[str, int]:
    """``HOST:PORT`` for argparse (the client library's parser)."""
    try:
        return parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def add_common_arguments(parser: argparse.ArgumentParser, *, default_retry: str) -> None:
    """The options every load-test command takes, with the same names and meanings."""
    parser.add_argument(
        "--addr",
        type=parse_addr,
        default=parse_addr(DEFAULT_ADDR),
        metavar="HOST:PORT",
        help=f"the governor to load; the only address connected to (default: {DEFAULT_ADDR})",
    )
    parser.add_argument(
        "--payload-bytes", type=non_negative_int, default=256, help="bytes per job (default: 256)"
    )
    parser.add_argument(
        "--chunk-bytes",
        type=positive_int,
        default=8192,
        help="bytes per upload chunk (default: 8192)",
    )
    parser.add_argument(
        "--retry",
        choices=RETRY_MODES,
        default=default_retry,
        help="on yield: none (one attempt), hint (sleep retry_hint_ms plus jitter, then resend), "
        "naive (resend at once), fixed (sleep --fixed-ms, ignoring the hint, as heptamini's "
        f"client does with its daemon's constant 500 ms) (default: {default_retry})",
    )
    parser.add_argument(
        "--max-attempts",
        type=positive_int,
        default=RetryPolicy().max_attempts,
        help="admission attempts per job in all, for --retry hint, naive and fixed; none makes "
        f"one (default: {RetryPolicy().max_attempts})",
    )
    parser.add_argument(
        "--fixed-ms",
        type=non_negative_int,
        default=500,
        help="the sleep between attempts of --retry fixed (default: 500)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=60.0,
        help="seconds for the whole run, connecting included; work still outstanding then is "
        "cancelled and counted as timed out (default: 60)",
    )
    parser.add_argument(
        "--sample-ms",
        type=positive_int,
        default=50,
        help="the monitor pings the daemon this often (default: 50)",
    )
    parser.add_argument(
        "--json-out",
        metavar="FILE",
        help="also write the final JSON summary to FILE",
    )


def retry_policy(mode: str, max_attempts: int, fixed_ms: int = 500) -> RetryPolicy:
    """The client library's policy for a ``--retry`` mode."""
    if mode == "none":
        return NO_RETRY
    if mode == "hint":
        return RetryPolicy(max_attempts=max_attempts)
    if mode == "naive":
        return RetryPolicy(max_attempts=max_attempts, fixed_delay_s=0.0)
    if mode == "fixed":
        return RetryPolicy(max_attempts=max_attempts, fixed_delay_s=fixed_ms / 1000)
    raise ValueError(f"unknown retry mode {mode!r}")


# Timed connections ----------------------------------------------------------------------


@dataclass(slots=True)
class AttemptLog:
    """One upload's admission attempts, as they happen (so a cancelled upload still counts).

    Pass :meth:`record` as the upload's ``on_attempt``.
    """

    attempts: int = 0
    # Per yield: ms from sending that attempt to its yield reply reaching the client.
    yield_ms: list[float] = field(default_factory=list)

    def record(self, sent_at: float, reply: Reply) -> None:
        self.attempts += 1
        if reply.status == Status.YIELD:
            self.yield_ms.append((time.monotonic() - sent_at) * 1000)

    @property
    def retries(self) -> int:
        return max(self.attempts - 1, 0)


async def connect_all(
    host: str, port: int, count: int, *, opened: list[GovernorClient], timeout: float
) -> None:
    """Open ``count`` connections concurrently, appending each to ``opened`` as it succeeds.

    The caller owns ``opened`` and closes it in ``finally``, so that connections made before a
    failure (or a cancellation) are closed too. The first failure cancels the rest and is raised.
    """

    async def one() -> None:
        opened.append(await GovernorClient.connect(host, port, timeout=timeout))

    async with asyncio.TaskGroup() as group:
        for _ in range(count):
            group.create_task(one())


async def close_all(clients: list[GovernorClient]) -> None:
    """Close every connection, bounded by :data:`CLOSE_TIMEOUT_S` in all."""
    if not clients:
        return
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
    except TimeoutError:
        pass  # transports are closed already; only the wait for their flush was cut short


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine on uvloop (what the daemon runs on too)."""
    return uvloop.run(main)
