"""Speaking to the governor: where it is and how (plain TCP or TLS, with which API key), the
``--retry`` modes, connections opened and closed in bulk under a time bound, and the event loop
a command runs on."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from ssl import SSLContext
from typing import Any, TypeVar

import uvloop

from clients import apikey, tls
from clients.client import NO_RETRY, GovernorClient, RetryPolicy
from clients.fleet import FleetClient

RETRY_MODES = ("none", "hint", "naive", "fixed")
CONNECT_TIMEOUT_S = 10.0  # per connection, and never more than what is left of --timeout
CLOSE_TIMEOUT_S = 5.0  # closing waits for unsent bytes to drain; a stuck peer must not hang us

T = TypeVar("T")


class StartError(Exception):
    """The daemon could not be reached before the starting gun (exit status 1)."""


# Retries -------------------------------------------------------------------------------


HINT_CAP_S = 60.0  # the governor's longest hint (max_hint_ms)


def retry_policy(mode: str, max_attempts: int, fixed_ms: int = 500) -> RetryPolicy:
    """The client library's policy for a ``--retry`` mode."""
    if mode == "none":
        return NO_RETRY
    if mode == "hint":
        # (every hint honoured, up to the governor's longest: the client's default cap of 5 s
        # would bring a client told 20 s back every 5 s, each return a refusal)
        return RetryPolicy(max_attempts=max_attempts, max_sleep_s=HINT_CAP_S)
    if mode == "naive":
        return RetryPolicy(max_attempts=max_attempts, fixed_delay_s=0.0)
    if mode == "fixed":
        return RetryPolicy(max_attempts=max_attempts, fixed_delay_s=fixed_ms / 1000)
    raise ValueError(f"unknown retry mode {mode!r}")


# The governor's endpoint -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A governor's protocol listener: where, whether through TLS (``ssl`` set), and the API
    key its connections show (None: none; kept out of the repr)."""

    host: str
    port: int
    ssl: SSLContext | None = None
    server_hostname: str | None = None  # TLS: the name its certificate must carry; None: host
    api_key: str | None = field(default=None, repr=False)

    @property
    def addr(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    async def connect(self, *, timeout: float) -> GovernorClient:
        return await GovernorClient.connect(
            self.host,
            self.port,
            timeout=timeout,
            api_key=self.api_key,
            ssl=self.ssl,
            server_hostname=self.server_hostname,
        )


def add_tls_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """governor-cli's TLS options (:func:`clients.tls.add_arguments`), for the governor
    ``--addr`` names."""
    tls.add_arguments(parser)


def add_key_arguments(parser: argparse.ArgumentParser | Any, *, openai: bool = False) -> None:
    """governor-cli's ``--api-key`` (:func:`clients.apikey.add_arguments`; by default
    ``$GOVERNOR_API_KEY``), for the governor ``--addr`` names (with ``openai``, also the bearer
    key of ``--openai URL``)."""
    help = None
    if openai:
        help = (
            f"the tenant's API key, for a governor with [[tenants]] declared; with --openai, "
            f"sent as Authorization: Bearer KEY (default: ${apikey.ENV}, which is safer: a flag "
            "shows in ps and in the shell's history)"
        )
    apikey.add_arguments(parser, help=help)


def api_key_from(args: argparse.Namespace) -> str | None:
    """``--api-key``, else ``$GOVERNOR_API_KEY`` (:func:`clients.apikey.key_from`); a key no
    governor takes ends the command (exit status 1, the key not shown)."""
    try:
        return apikey.key_from(args)
    except apikey.APIKeyError as exc:
        raise SystemExit(f"loadtest: {exc}") from None


def endpoint_from(args: argparse.Namespace) -> Endpoint:
    """``--addr`` and the options of :func:`add_tls_arguments`; a CA or certificate that cannot
    be used ends the command (exit status 1, with the file named)."""
    return endpoints_from(args, [args.addr])[0]


def endpoints_from(
    args: argparse.Namespace, addrs: Sequence[tuple[str, int]] | None = None
) -> list[Endpoint]:
    """:func:`endpoint_from` for each of ``addrs`` (by default every ``--addr`` given, as
    :class:`AddressList` keeps them), all with the same TLS options and API key."""
    if addrs is None:
        addrs = getattr(args, "addrs", None) or [args.addr]
    try:
        context = tls.context_from(args)
    except tls.TLSSetupError as exc:
        raise SystemExit(f"loadtest: {exc}") from None
    key = api_key_from(args)
    return [Endpoint(host, port, context, args.tls_server_name, key) for host, port in addrs]


# Timed connections ----------------------------------------------------------------------


async def connect_all(
    endpoint: Endpoint, count: int, *, opened: list[GovernorClient], timeout: float
) -> None:
    """Open ``count`` connections concurrently, appending each to ``opened`` as it succeeds.

    The caller owns ``opened`` and closes it in ``finally``, so that connections made before a
    failure (or a cancellation) are closed too. The first failure cancels the rest and is raised.
    """

    async def one() -> None:
        opened.append(await endpoint.connect(timeout=timeout))

    async with asyncio.TaskGroup() as group:
        for _ in range(count):
            group.create_task(one())


async def close_all(clients: Sequence[GovernorClient | FleetClient]) -> None:
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
