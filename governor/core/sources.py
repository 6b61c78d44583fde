"""Connections by source address: the connection limits, who makes way at them, and the pace of
a source's key checks.

Pure code with an injected clock; both listeners ask :meth:`Sources.open` before they serve a
connection and call :meth:`Sources.close` when it ends.

**Limits.** ``max_connections`` connections in all, and ``max_per_source`` from one source,
except a trusted one (``trusted``: loopback by default, where a sidecar's clients and a load
test's all come from; behind a proxy or a NAT, many clients share one address). At either limit
a new connection *displaces* the oldest idle connection it would count against (of its source
at the source's limit, of any source at the global one) instead of being refused: idle is a
connection with nothing in flight (no job, no upload, no held payload, no request arriving)
that has shown no valid key; without tenants, one with nothing in flight, the longest so. A
connection with work in flight or a key shown is never displaced: only when none is idle is the
new one refused. So a flood of connections that only ping cannot keep out a client that comes
to work, and a burst of clients from one machine is served as it comes.

**Keys.** A source may fail ``guess_burst`` keys at once and then one every ``1 /
guess_rate`` seconds: once that budget is spent, each key a connection of the source shows for
the first time waits for its turn (:meth:`key_turn`) rather than be checked at once, and a key
that fails spends a turn. A valid key spends nothing (its reserved turn is given back), and a
connection that has shown a key is not asked for it again; a key that failed lately from the
source is refused again at once, unchecked, spending nothing (the last
:data:`MAX_FAILED_KEYS` are remembered, as digests). A client beside a guesser on the
same address is therefore not refused for the guesser's failures: at worst its first key
waits its turn behind the guesser's (a turn further off than ``auth_grace`` is not given: the
key is refused for now, the guessers' turns being that many). Guessing itself stays at the
rate, however many connections it uses: a key cannot be told valid before its turn comes.

An IPv4 source is its address; an IPv6 source is its /64, the block one host is usually given
(a host that can pick any address in its /64 would otherwise be 2^64 sources).

Memory is bounded: a source is tracked while it holds connections, at most :data:`MAX_PACED`
sources with spent budgets are remembered (the oldest forgotten first), and lines about refused
or displaced connections are logged at a bounded rate (:meth:`Sources.line`).
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from protocol.codes import ErrorCode, NeedCode

from .tenants import TokenBucket

MAX_PACED = 4096
MAX_FAILED_KEYS = 4096
LOG_LINES_PER_S = 1.0
LOG_BURST = 10.0
LOOPBACK = ("127.0.0.0/8", "::1/128")
KEY_TURN_FAR = (
    "too many keys from this address failed: this one's turn to be checked is more than "
    "auth_grace away; send it again later"
)

C = TypeVar("C", bound=Hashable)  # a connection, as the listener knows it


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@functools.lru_cache(maxsize=MAX_PACED)  # (parsing costs 5 µs, each new connection)
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


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(text: str) -> tuple[Network, ...]:
    """Comma-separated CIDRs (an address alone is its own network); ValueError names a bad one."""
    networks = []
    for word in (w.strip() for w in text.split(",")):
        if word:
            try:
                networks.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                raise ValueError(f"{word!r} is not an address or a CIDR") from None
    return tuple(networks)


@dataclass(frozen=True, slots=True)
class Refused:
    """Why a connection is not served: its one abort frame's codes and detail."""

    need_code: NeedCode
    error_code: ErrorCode
    detail: str


@dataclass(frozen=True, slots=True)
class Turn:
    """When a key may be checked: after ``wait`` seconds (0: now, :data:`NOW`, nothing
    reserved); ``end`` names the reservation."""

    wait: float
    end: float


NOW = Turn(0.0, 0.0)


class Displaced(Generic[C]):
    """The new connection is served in place of ``victim``, which the caller closes with a fatal
    reply saying ``detail`` (it is no longer counted: its close need not be reported).

    (Not a dataclass: mypyc compiles no generic one.)"""

    def __init__(self, victim: C, detail: str) -> None:
        self.victim = victim
        self.detail = detail


class Sources(Generic[C]):
    def __init__(
        self,
        *,
        max_connections: int,
        max_per_source: int,
        clock: Callable[[], float],
        trusted: Iterable[Network] = (),
        guess_rate: float = 1.0,
        guess_burst: int = 10,
    ) -> None:
        self.max_connections = max_connections
        self.max_per_source = max_per_source  # 0: no limit
        self.trusted = tuple(trusted)
        self.interval = 1.0 / guess_rate  # a failed key's cost, in seconds of the budget
        self.tolerance = guess_burst * self.interval
        self.clock = clock
        self.open_by_source: dict[str, int] = {}
        self._source: dict[C, str] = {}  # every connection counted, and its source
        self._idle: dict[C, None] = {}  # idle connections, the oldest first
        self._idle_by_source: dict[str, dict[C, None]] = {}
        self._trusted: dict[str, bool] = {}  # sources looked up in ``trusted``
        # A source whose budget is not whole: when its failures are paid off (GCRA's
        # theoretical arrival time). The dict's order is the order of last change.
        self._paid_at: dict[str, float] = {}
        self._failed: dict[tuple[str, bytes], None] = {}  # (source, key's sha256): the latest
        self._log = TokenBucket(LOG_LINES_PER_S, LOG_BURST, clock())
        self.unlogged = 0  # lines not written since the last one that was

    # Connections ---------------------------------------------------------------------------

    @property
    def connections(self) -> int:
        return len(self._source)

    def is_trusted(self, source: str) -> bool:
        """Whether ``source`` is in ``trusted`` (then no per-source limit holds it)."""
        found = self._trusted.get(source)
        if found is None:
            try:
                network = ipaddress.ip_network(source)
            except ValueError:
                found = False
            else:
                found = any(
                    network.version == t.version and network.subnet_of(t)  # type: ignore[arg-type]
                    for t in self.trusted
                )
            if len(self._trusted) >= MAX_PACED:
                self._trusted.clear()
            self._trusted[source] = found
        return found

    def open(self, conn: C, source: str, *, idle: bool) -> Refused | Displaced[C] | None:
        """Count a new connection from ``source`` (idle or not, as :meth:`idle` says), in place
        of an idle one at a limit (:class:`Displaced`), or say why it is refused."""
        held = self.open_by_source.get(source, 0)
        displaced: Displaced[C] | None = None
        if self.max_per_source and held >= self.max_per_source and not self.is_trusted(source):
            victim = next(iter(self._idle_by_source.get(source, ())), None)
            if victim is None:
                return Refused(
                    NeedCode.TOO_MANY_CONNECTIONS,
                    ErrorCode.QUOTA,
                    f"this address holds {held} connections, its limit, each with work in "
                    "flight or a key shown",
                )
            displaced = Displaced(
                victim,
                f"this address reached its limit of {self.max_per_source} connections, and "
                "this one was its oldest idle one: connect again when there is work to send",
            )
        elif len(self._source) >= self.max_connections:
            victim = next(iter(self._idle), None)
            if victim is None:
                return Refused(
                    NeedCode.TOO_MANY_CONNECTIONS,
                    ErrorCode.QUOTA,
                    f"the server is at its limit of {self.max_connections} connections, each "
                    "with work in flight or a key shown",
                )
            displaced = Displaced(
                victim,
                f"the server reached its limit of {self.max_connections} connections, and this "
                "one was the oldest idle one: connect again when there is work to send",
            )
        if displaced is not None:
            self.close(displaced.victim)
        self._source[conn] = source
        self.open_by_source[source] = self.open_by_source.get(source, 0) + 1
        self.idle(conn, idle)
        return displaced

    def idle(self, conn: C, idle: bool) -> None:
        """``conn`` has nothing in flight and no key shown (it may be displaced), or not now.
        Becoming idle again puts it last in line."""
        source = self._source.get(conn)
        if source is None:  # (closed, or displaced)
            return
        by_source = self._idle_by_source.get(source)
        if idle:
            if conn not in self._idle:
                self._idle[conn] = None
                if by_source is None:
                    by_source = self._idle_by_source[source] = {}
                by_source[conn] = None
        elif conn in self._idle:
            del self._idle[conn]
            assert by_source is not None
            del by_source[conn]
            if not by_source:
                del self._idle_by_source[source]

    def close(self, conn: C) -> None:
        """``conn`` has ended (or was displaced); a second call does nothing."""
        self.idle(conn, False)
        source = self._source.pop(conn, None)
        if source is None:
            return
        held = self.open_by_source[source] - 1
        if held:
            self.open_by_source[source] = held
        else:
            del self.open_by_source[source]

    # Keys ----------------------------------------------------------------------------------

    def key_turn(self, source: str, max_wait: float) -> Turn | None:
        """When a key shown by a connection of ``source`` may be checked: now while its budget
        lasts; else at its turn, reserved (report it to :meth:`key_checked`, or give it back
        with :meth:`turn_unused`); None, and nothing reserved, when that turn is more than
        ``max_wait`` seconds away."""
        now = self.clock()
        end = max(self._paid_at.get(source, now), now) + self.interval
        wait = end - self.tolerance - now
        if wait <= 1e-9:  # (turns given back leave float crumbs)
            return NOW
        if wait > max_wait:
            return None
        self._pay(source, end, now)
        return Turn(wait, end)

    def failed_before(self, source: str, key: str) -> bool:
        """Whether ``key`` failed from ``source`` lately: refused again without a check or a
        turn (it tells a guesser nothing new, and a misconfigured client retrying its wrong key
        spends nothing of its neighbours' budget)."""
        return (source, _digest(key)) in self._failed

    def key_checked(self, source: str, key: str, valid: bool, turn: Turn) -> None:
        """A key from ``source`` was checked, at ``turn``: a failed one spends a turn (a turn
        reserved for it already is) and is remembered; a valid one spends none."""
        if not valid:
            failed = self._failed
            failed[(source, _digest(key))] = None
            if len(failed) > MAX_FAILED_KEYS:
                del failed[next(iter(failed))]
        if turn is NOW:
            if not valid:
                now = self.clock()
                self._pay(source, max(self._paid_at.get(source, now), now) + self.interval, now)
        elif valid:
            self.turn_unused(source, turn)

    def turn_unused(self, source: str, turn: Turn) -> None:
        """A reserved turn was not spent on a failed key (the key was valid, or its connection
        left first): given back if it is the last one reserved (an earlier one is lost: giving
        it back would let two later keys share one turn)."""
        if self._paid_at.get(source) == turn.end:
            del self._paid_at[source]
            if turn.end - self.interval > self.clock():
                self._paid_at[source] = turn.end - self.interval

    def _pay(self, source: str, paid_at: float, now: float) -> None:
        paced = self._paid_at
        paced.pop(source, None)  # (re-inserted last: the dict's order is the order of change)
        if len(paced) >= MAX_PACED:
            for done in [s for s, at in paced.items() if at <= now]:
                del paced[done]
            if len(paced) >= MAX_PACED:
                del paced[next(iter(paced))]
        paced[source] = paid_at

    @property
    def waiting(self) -> int:
        """Sources whose next key would wait for its turn (their burst of failures spent)."""
        now = self.clock()
        return sum(1 for at in self._paid_at.values() if at + self.interval - now > self.tolerance)

    # Logs ----------------------------------------------------------------------------------

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
