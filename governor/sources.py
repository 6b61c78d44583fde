"""Connections by source address: a limit per source, and a wait for a source whose keys failed.

Pure code with an injected clock; :class:`~governor.connection.GovernorProtocol` asks
:meth:`Sources.open` before it serves a connection and calls :meth:`Sources.close` when it
ends. One source may hold ``max_per_source`` connections: a client that opens every
connection it can holds its own share of ``max_connections``, not the others'. A connection
closed for failed keys makes its source wait ``backoff_s`` before it may connect again, so that
guessing keys costs a connection per ``max_auth_failures`` guesses and then a wait.

An IPv4 source is its address; an IPv6 source is its /64, the block one host is usually given
(a host that can pick any address in its /64 would otherwise be 2^64 sources).

Memory is bounded: a source is tracked while it holds connections, and at most
:data:`MAX_WAITING` sources are made to wait at once (the oldest wait is forgotten first).
Lines about refused sources are logged at a bounded rate (:meth:`Sources.line`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass

from protocol.codes import ErrorCode, NeedCode

from .tenants import TokenBucket

MAX_WAITING = 4096
LOG_LINES_PER_S = 1.0
LOG_BURST = 10.0


def source_of(host: str) -> str:
    """The source a peer address belongs to: an IPv4 address, an IPv6 /64."""
    try:
        address = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


@dataclass(frozen=True, slots=True)
class Refused:
    """Why a connection is not served: its one abort frame's codes and detail."""

    need_code: NeedCode
    error_code: ErrorCode
    detail: str


class Sources:
    def __init__(
        self,
        max_per_source: int,
        backoff_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.max_per_source = max_per_source  # 0: no limit
        self.backoff_s = backoff_s
        self.clock = clock
        self.open_by_source: dict[str, int] = {}
        self._waiting: dict[str, float] = {}  # source -> when it may connect again
        self._log = TokenBucket(LOG_LINES_PER_S, LOG_BURST, clock())
        self.unlogged = 0  # lines not written since the last one that was

    def open(self, source: str) -> Refused | None:
        """Count a new connection from ``source``, or say why it is refused."""
        until = self._waiting.get(source)
        if until is not None:
            wait = until - self.clock()
            if wait > 0:
                return Refused(
                    NeedCode.AUTH_BACKOFF,
                    ErrorCode.UNAUTHORIZED,
                    f"too many failed keys from this address; connect again in {wait:.1f} s",
                )
            del self._waiting[source]
        held = self.open_by_source.get(source, 0)
        if self.max_per_source and held >= self.max_per_source:
            return Refused(
                NeedCode.TOO_MANY_CONNECTIONS,
                ErrorCode.QUOTA,
                f"this address holds {held} connections, its limit",
            )
        self.open_by_source[source] = held + 1
        return None

    def close(self, source: str) -> None:
        """A connection :meth:`open` counted has ended."""
        held = self.open_by_source[source] - 1
        if held:
            self.open_by_source[source] = held
        else:
            del self.open_by_source[source]

    def keys_failed(self, source: str) -> None:
        """A connection from ``source`` was closed for failed keys: the source waits."""
        waiting = self._waiting
        waiting.pop(source, None)  # (re-inserted last: the dict's order is the waits' order)
        if len(waiting) >= MAX_WAITING:
            now = self.clock()
            for expired in [s for s, until in waiting.items() if until <= now]:
                del waiting[expired]
            if len(waiting) >= MAX_WAITING:
                del waiting[next(iter(waiting))]
        waiting[source] = self.clock() + self.backoff_s

    @property
    def waiting(self) -> int:
        """Sources made to wait now."""
        now = self.clock()
        return sum(1 for until in self._waiting.values() if until > now)

    def line(self, text: str) -> str | None:
        """``text`` as a log line about a refused source, or None when no line may be written
        now (at most :data:`LOG_LINES_PER_S` on average). A line not written is counted in
        :attr:`unlogged`; the next one written says how many, and the count starts over."""
        now = self.clock()
        if self._log.wait_s(1, now) > 0:
            self.unlogged += 1
            return None
        self._log.take(1, now)
        unlogged, self.unlogged = self.unlogged, 0
        return f"{text} ({unlogged} such lines not written)" if unlogged else text
