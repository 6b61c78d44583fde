"""A client for several governor replicas: pick one from what its receipts say, go elsewhere
on ``yield`` or ``draining``, eject one that keeps failing.

Two layers, as everywhere in this project: :class:`Replicas` is the policy, pure code over a
clock it is given (no sockets, no ``await``), and :class:`FleetClient` is the IO, one lazily
opened :class:`~clients.client.GovernorClient` per replica, which asks the policy at each step.

What :class:`Replicas` knows of each replica comes from the replies themselves: every reply
carries ``backend.inflight`` and ``backend.cap``, a ``yield`` its ``retry_hint_ms``, a ping
``server.draining``. From that it decides:

- **pick** (a new job): the power of two random choices. Of the eligible replicas (not
  ejected, not left) that no hint says are busy, two are drawn at random and the less loaded
  wins, the load being ``(inflight + jobs sent since that receipt) / cap``; a receipt older
  than ``load_ttl_s`` counts as no load (it says little now, and a try refreshes it). When
  every eligible replica is busy, the one whose hint ends first.
- **after a yield** from replica A with hint h: another eligible replica that no hint says is
  busy, and whose receipts do not say it is full, takes the job at once; else the one whose
  hint ends first, if that is sooner than ``now + h``, after that wait; else the job stays on
  A, whose client sleeps the hint and resends only the final chunk of the payload A holds. A ``fleet_busy`` yield speaks for every
  replica (the fleet's shared cap is full), so it marks them all busy and the job stays.
- **draining** (a ``draining`` yield, or a ping with ``server.draining`` 1): the replica is
  left: never picked, until a ping ``recheck_s`` later finds it ready again (a restarted
  process on the same address), or for good.
- **outlier ejection**, as Envoy's outlier detection does it: ``Ejection.consecutive_failures``
  failures in a row (a connection that cannot be opened or breaks off, an abort with
  ``backend_error``, a ``breaker_open`` yield; a job ``done`` resets the count) eject the
  replica for ``base_ejection_s`` times the number of times it has been ejected (at most
  ``max_ejection_s``; the multiplier drops by one for each ``interval_s`` it spends back
  without an ejection). At most ``max_ejection_percent`` of the replicas are ejected at once,
  but one may always be ejected, and never the last one neither ejected nor left. Should only
  ejected ones be left, they are tried anyway (Envoy's panic mode): a job sent to a replica
  that may have recovered beats a job refused here.

:class:`FleetClient` runs a job as the policy says: a move takes the whole payload to the
other replica's connection (the held payload lives on A's, which is told to drop it), and a
job whose connection broke, or whose replica aborted it with ``backend_error`` (while the
shared :class:`~clients.client.RetryBudget` allows), goes on elsewhere, unless output was
already streamed to the caller. ``RetryPolicy.max_attempts`` bounds the tries of a job over
every replica together, a connection that could not be opened included.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import socket
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from ssl import SSLContext
from types import TracebackType
from typing import Any, Self

from protocol.addresses import parse_address
from protocol.codes import ErrorCode, NeedCode, Receipt, Status, Verb
from protocol.frames import Reply
from protocol.spec import SPEC_CONTENT_TYPE, JobSpec

from .client import (
    INLINE_MAX_BYTES,
    ClientError,
    ConnectionLost,
    GovernorClient,
    RetryBudget,
    RetryPolicy,
    UploadResult,
)

# A yield with no hint (heptamini's daemon always sends one; this is a guess for one that
# does not) marks its replica busy this long.
DEFAULT_HINT_MS = 50
# Yields that speak for the whole fleet: its shared cap, not this replica's slots (the code
# is the governor's fleet extension; as a string, so that this client also runs against a
# governor that does not know it).
FLEET_WIDE_CODES = frozenset({"fleet_busy"})
# Aborts that say the replica went away under the job, not that the job failed: the job goes
# on elsewhere. (A connection-level abort also closes the connection.)
GONE_CODES = frozenset(
    {
        NeedCode.SHUTDOWN,
        NeedCode.IDLE_TIMEOUT,
        NeedCode.TOO_MANY_CONNECTIONS,
        NeedCode.TOO_MANY_JOBS,
    }
)
DEFAULT_RETRY = RetryPolicy()  # GovernorClient's default
WITHDRAW_TIMEOUT_S = 2.0  # telling a replica to drop a held payload: one round trip
PROBE_TIMEOUT_S = 2.0  # the ping that asks a left replica whether it is ready again


class NoReplicaAvailable(ClientError):
    """No replica answered: none could be reached, or every one is draining."""


# Addresses -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Address:
    """One replica: where to connect, and the name it was found under (checked against the
    server's TLS certificate; None: ``host`` itself)."""

    host: str
    port: int
    server_hostname: str | None = None

    @property
    def name(self) -> str:
        """``HOST:PORT`` (``[v6]:PORT``): how the replica is named in results and status."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def split_addresses(addresses: str | Iterable[str]) -> list[str]:
    """``HOST:PORT`` texts from one comma-separated string or several; raises ``ValueError``
    for one that is not ``HOST:PORT``, or for none at all."""
    texts = [addresses] if isinstance(addresses, str) else list(addresses)
    out = [part.strip() for text in texts for part in text.split(",") if part.strip()]
    if not out:
        raise ValueError("no address given")
    for text in out:
        parse_address(text, allow_port_zero=False)
    return out


AddrInfo = tuple[Any, Any, Any, Any, tuple[Any, ...]]


def spread(host: str, port: int, infos: Iterable[AddrInfo]) -> list[Address]:
    """The replicas behind ``host`` from its ``getaddrinfo`` answer: one per address.

    A name with several addresses of one family (the A records of a headless service) stands
    for several replicas. A name with one address per family (``localhost``: 127.0.0.1 and
    ::1) is one host reachable two ways: it stays one replica, connected to by name as ever.
    When both families have several, the family with more wins (the first answered on a tie).
    """
    by_family: dict[Any, list[str]] = {}
    for family, _, _, _, sockaddr in infos:
        ips = by_family.setdefault(family, [])
        if sockaddr[0] not in ips:
            ips.append(str(sockaddr[0]))
    widest = max(by_family.values(), key=len, default=[])
    if len(widest) <= 1:
        return [Address(host, port)]
    return [Address(ip, port, host) for ip in widest]


Resolver = Callable[[str, int], Awaitable[Sequence[Address]]]


async def system_resolver(host: str, port: int) -> list[Address]:
    """:func:`spread` over the system's ``getaddrinfo``; a name that does not resolve stays as
    it is (connecting to it then fails, and counts against it, as for any replica down)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:  # socket.gaierror included
        return [Address(host, port)]
    return spread(host, port, infos)


def resolve_now(addresses: str | Iterable[str]) -> list[Address]:
    """:func:`resolve` with the system's resolver, blocking: for a command line deciding,
    before its event loop runs, whether it speaks to one governor or to several."""
    found: list[Address] = []
    for text in split_addresses(addresses):
        host, port = parse_address(text, allow_port_zero=False)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            found.append(Address(host, port))
            continue
        found += spread(host, port, infos)
    return _distinct(found)


async def resolve(
    addresses: str | Iterable[str], *, resolver: Resolver | None = None
) -> list[Address]:
    """Every replica that ``addresses`` (``HOST:PORT`` texts, or one comma-separated string)
    stand for, once each, in order. ``resolver`` replaces the system's (tests, service
    discovery)."""
    lookup = resolver or system_resolver
    found: list[Address] = []
    for text in split_addresses(addresses):
        found += await lookup(*parse_address(text, allow_port_zero=False))
    return _distinct(found)


def _distinct(addresses: Iterable[Address]) -> list[Address]:
    seen: dict[str, Address] = {}
    for a in addresses:
        seen.setdefault(a.name, a)
    return list(seen.values())


# The policy ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Ejection:
    """Outlier detection per replica, with Envoy's defaults (``consecutive_5xx``,
    ``base_ejection_time``, ``max_ejection_time``, ``max_ejection_percent``, ``interval``).

    Envoy's ``max_ejection_percent`` of 10 would eject nothing among fewer than ten hosts, so
    (as Envoy does) one replica may always be ejected; and never the last one that is neither
    ejected nor left. ``max_ejection_percent`` 0 turns ejection off.
    """

    consecutive_failures: int = 5
    base_ejection_s: float = 30.0
    max_ejection_s: float = 300.0
    max_ejection_percent: float = 10.0
    interval_s: float = 10.0  # the multiplier drops by one per interval spent back, not ejected

    def __post_init__(self) -> None:
        if self.consecutive_failures < 1:
            raise ValueError("consecutive_failures must be at least 1")
        if not self.base_ejection_s > 0 or not self.interval_s > 0:
            raise ValueError("base_ejection_s and interval_s must be positive")
        if not 0 <= self.max_ejection_percent <= 100:
            raise ValueError("max_ejection_percent must be within [0, 100]")

    def allowed(self, replicas: int) -> int:
        """How many of ``replicas`` may be ejected at once (before keeping one eligible)."""
        if self.max_ejection_percent == 0:
            return 0
        return max(1, math.floor(replicas * self.max_ejection_percent / 100))

    def duration_s(self, times: int) -> float:
        """How long the ``times``-th ejection (in the multiplier's count) lasts."""
        return min(self.base_ejection_s * times, max(self.max_ejection_s, self.base_ejection_s))


class ReplicaState(StrEnum):
    OK = "ok"
    BUSY = "busy"  # a yield's hint has not run out
    DRAINING = "draining"  # left: not picked until a ping says it is ready again
    EJECTED = "ejected"  # failing: not picked until its ejection ends


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """A replica as the policy sees it now (for logs, tests, ``governor-cli``)."""

    name: str
    state: ReplicaState
    load: float  # (inflight + sent since that receipt) / cap
    inflight: int | None  # the latest receipt's
    cap: int | None
    busy_for_s: float  # what is left of the latest hint (0: none)
    ejected_for_s: float  # what is left of its ejection (0: none; also while it drains)
    failures: int  # consecutive
    ejections: int  # the ejection multiplier
    sent: int  # jobs sent to it in all, retries on it included
    done: int  # jobs it finished


@dataclass(frozen=True, slots=True)
class Move:
    """After a yield: take the job to ``address``, after ``delay_s`` (0: at once)."""

    address: Address
    delay_s: float


@dataclass(slots=True)
class _Replica:
    address: Address
    inflight: int | None = None
    cap: int | None = None
    seen_at: float | None = None  # when the latest load receipt came
    in_transit: int = 0  # jobs sent since that receipt
    busy_until: float = -math.inf
    left_until: float | None = None  # left (draining); a probe is due then
    ejected_until: float | None = None
    returned_at: float | None = None  # when its latest ejection ended
    ejections: int = 0
    failures: int = 0
    sent: int = 0
    done: int = 0

    @property
    def name(self) -> str:
        return self.address.name

    @property
    def available(self) -> bool:
        return self.ejected_until is None and self.left_until is None


class Replicas:
    """What a client knows of each replica, and the choices made from it (see the module
    docstring). Pure and synchronous: every method reads the injected ``clock`` and returns at
    once, so that concurrent jobs on one event loop see one consistent state; several
    :class:`FleetClient` instances may share one (a load generator's many clients).
    """

    def __init__(
        self,
        addresses: Iterable[Address],
        *,
        ejection: Ejection = Ejection(),
        recheck_s: float = 30.0,
        load_ttl_s: float = 5.0,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ejection = ejection
        self.recheck_s = recheck_s
        self.load_ttl_s = load_ttl_s
        self._rng = rng if rng is not None else random.Random()
        self._clock = clock
        self._order: list[_Replica] = []
        self._by_name: dict[str, _Replica] = {}
        self.update(addresses)

    # The set of replicas ---------------------------------------------------------------

    @property
    def addresses(self) -> list[Address]:
        return [r.address for r in self._order]

    def __len__(self) -> int:
        return len(self._order)

    def update(self, addresses: Iterable[Address]) -> list[Address]:
        """Make ``addresses`` the replicas (a fresh resolution): those already known keep what
        is known of them. Returns the ones dropped."""
        fresh = _distinct(addresses)
        names = {a.name for a in fresh}
        dropped = [r.address for r in self._order if r.name not in names]
        self._order = [self._by_name.get(a.name) or _Replica(a) for a in fresh]
        self._by_name = {r.name: r for r in self._order}
        return dropped

    def status(self) -> list[ReplicaStatus]:
        now = self._tick()
        return [
            ReplicaStatus(
                r.name,
                self._state(r, now),
                round(self._load(r, now), 6),
                r.inflight,
                r.cap,
                max(r.busy_until - now, 0.0),
                0.0 if r.ejected_until is None else r.ejected_until - now,
                r.failures,
                r.ejections,
                r.sent,
                r.done,
            )
            for r in self._order
        ]

    def state(self, name: str) -> ReplicaState:
        now = self._tick()
        return self._state(self._by_name[name], now)

    # Choices -----------------------------------------------------------------------------

    def pick(self, exclude: Collection[str] = ()) -> Address | None:
        """The replica for a new job, by two random choices (module docstring); None when
        every replica not in ``exclude`` is left (draining)."""
        now = self._tick()
        pool = [r for r in self._order if r.left_until is None and r.name not in exclude]
        pool = [r for r in pool if r.ejected_until is None] or pool  # panic: only ejected ones
        if not pool:
            return None
        free = [r for r in pool if r.busy_until <= now]
        if free:
            return self._two_choices(free, now).address
        return min(pool, key=lambda r: (r.busy_until, self._load(r, now))).address

    def after_yield(self, name: str, exclude: Collection[str] = ()) -> Move | None:
        """Where a job that ``name`` has just refused (its yield observed) should go: another
        replica (module docstring), or None to stay and wait out the hint there."""
        now = self._tick()
        here = self._by_name[name]
        others = [r for r in self._order if r is not here and r.available and r.name not in exclude]
        if not others:
            return None
        # At once to one that no hint says is busy and whose receipt does not say it is full
        # (one that is would only answer another yield).
        free = [r for r in others if r.busy_until <= now and self._load(r, now) < 1]
        if free:
            return Move(self._two_choices(free, now).address, 0.0)
        if not here.available:  # ejected by this very yield (breaker_open): anywhere else
            best = min(others, key=lambda r: (max(r.busy_until, now), self._load(r, now)))
            return Move(best.address, max(best.busy_until - now, 0.0))
        hinted = [r for r in others if r.busy_until > now]
        if hinted:
            soonest = min(hinted, key=lambda r: (r.busy_until, self._load(r, now)))
            if soonest.busy_until < here.busy_until:
                return Move(soonest.address, soonest.busy_until - now)
        return None

    def probes_due(self, *, force: bool = False) -> list[Address]:
        """Left replicas due a ping that may bring them back (all of them with ``force``);
        each is left another ``recheck_s`` unless that ping finds it ready."""
        now = self._tick()
        due = [
            r for r in self._order if r.left_until is not None and (force or r.left_until <= now)
        ]
        for r in due:
            r.left_until = now + self.recheck_s
        return [r.address for r in due]

    # Events ------------------------------------------------------------------------------

    def sent(self, name: str) -> None:
        """A job is on its way to ``name``: it counts in that replica's load until the next
        receipt does."""
        r = self._by_name.get(name)
        if r is not None:
            r.in_transit += 1
            r.sent += 1

    def observe(self, name: str, reply: Reply) -> None:
        """A reply from ``name``: its receipts, its hint, its failure or success."""
        r = self._by_name.get(name)
        if r is None:
            return  # dropped by a fresh resolution while the reply was on its way
        now = self._tick()
        inflight = reply.receipt(Receipt.INFLIGHT)
        if inflight is not None:
            r.inflight, r.seen_at, r.in_transit = inflight, now, 0
            r.cap = reply.receipt(Receipt.CAP) or r.cap
        if reply.status == Status.YIELD:
            until = now + (reply.retry_hint_ms or DEFAULT_HINT_MS) / 1000
            r.busy_until = until
            if reply.need_code in FLEET_WIDE_CODES:
                for other in self._order:
                    other.busy_until = max(other.busy_until, until)
        elif reply.receipt(Receipt.HEALTH) == 1:
            r.busy_until = -math.inf  # it would admit a job now
        draining = reply.receipt(Receipt.DRAINING)
        if draining == 1 or reply.need_code == NeedCode.DRAINING:
            r.left_until = now + self.recheck_s
        elif reply.verb == Verb.CONFIRM and reply.status == Status.OK:  # a ping, not draining
            r.left_until = None
        if _failure_signal(reply):
            self._failure(r, now)
        elif reply.status == Status.DONE:
            r.failures = 0
            r.done += 1

    def failure(self, name: str) -> None:
        """A failure that is no reply: a connection that could not be opened or broke off."""
        r = self._by_name.get(name)
        if r is not None:
            self._failure(r, self._tick())

    def leave(self, name: str) -> None:
        """Stop picking ``name`` (it is draining) until a probe finds it ready."""
        r = self._by_name.get(name)
        if r is not None:
            r.left_until = self._tick() + self.recheck_s

    # Internals ---------------------------------------------------------------------------

    def _tick(self) -> float:
        """The time now, after returning the replicas whose ejection has run out."""
        now = self._clock()
        for r in self._order:
            if r.ejected_until is not None and r.ejected_until <= now:
                r.returned_at, r.ejected_until = r.ejected_until, None
        return now

    def _state(self, r: _Replica, now: float) -> ReplicaState:
        if r.left_until is not None:  # (first: not even panic picks a left one)
            return ReplicaState.DRAINING
        if r.ejected_until is not None:
            return ReplicaState.EJECTED
        return ReplicaState.BUSY if r.busy_until > now else ReplicaState.OK

    def _load(self, r: _Replica, now: float) -> float:
        fresh = r.seen_at is not None and now - r.seen_at <= self.load_ttl_s
        inflight = (r.inflight or 0) if fresh else 0
        return (inflight + r.in_transit) / max(r.cap or 1, 1)

    def _two_choices(self, pool: Sequence[_Replica], now: float) -> _Replica:
        if len(pool) == 1:
            return pool[0]
        a, b = self._rng.sample(pool, 2)
        return a if self._load(a, now) <= self._load(b, now) else b

    def _failure(self, r: _Replica, now: float) -> None:
        r.failures += 1
        e = self.ejection
        if r.ejected_until is not None or r.failures < e.consecutive_failures:
            return
        ejected = sum(1 for o in self._order if o.ejected_until is not None)
        others = sum(1 for o in self._order if o is not r and o.available)
        if ejected >= e.allowed(len(self._order)) or others == 0:
            return  # it stays, and its next failure asks again
        if r.returned_at is not None:  # spent some time back: the multiplier has decayed
            r.ejections = max(r.ejections - int((now - r.returned_at) // e.interval_s), 0)
        r.ejections += 1
        r.ejected_until = now + e.duration_s(r.ejections)
        r.failures = 0


def _failure_signal(reply: Reply) -> bool:
    """A reply that says the replica's backend is failing (the retry budget's signals too)."""
    if reply.status == Status.YIELD:
        return reply.need_code == NeedCode.BREAKER_OPEN
    return reply.status == Status.ABORT and reply.error_code == ErrorCode.BACKEND_ERROR


# The client ------------------------------------------------------------------------------


@dataclass(slots=True)
class FleetResult(UploadResult):
    """An :class:`~clients.client.UploadResult` over several replicas: ``attempts`` counts
    every try on every replica (connections that failed included), ``yields`` every yield.
    ``replica`` gave the last reply; ``tried`` lists the replicas in the order the job went
    to them (one entry per visit)."""

    replica: str = ""
    tried: tuple[str, ...] = ()


# One visit's send: (client, retry, on_attempt, on_yield, on_delta) -> its result.
_Send = Callable[
    [
        GovernorClient,
        RetryPolicy,
        Callable[[float, Reply], None],
        Callable[[Reply], bool],
        Callable[[str], None],
    ],
    Awaitable[UploadResult],
]


class FleetClient:
    """Jobs over several governor replicas, one lazily opened connection to each.

    :meth:`connect` resolves the addresses (no connection is opened until a job needs one);
    :meth:`upload`, :meth:`generate` and :meth:`ping` have :class:`GovernorClient`'s
    signatures and return a :class:`FleetResult`. ``replicas`` is the policy; pass one to
    several clients to make them share what they learn. The retry budget is shared by the
    connections to every replica.
    """

    def __init__(
        self,
        replicas: Replicas,
        *,
        targets: Sequence[str] = (),
        api_key: str | None = None,
        retry_budget: RetryBudget | None = None,
        ssl: SSLContext | None = None,
        server_hostname: str | None = None,
        connect_timeout: float = 10.0,
        resolver: Resolver | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """``targets``: the addresses as given, for :meth:`refresh`."""
        if ssl is None and server_hostname is not None:
            raise ValueError("server_hostname is for TLS connections only: give ssl too")
        self.replicas = replicas
        self.targets = list(targets)
        self.api_key = api_key
        self._budget = retry_budget if retry_budget is not None else RetryBudget()
        self._ssl = ssl
        self._server_hostname = server_hostname
        self._connect_timeout = connect_timeout
        self._resolver = resolver
        self._rng = rng if rng is not None else random.Random()
        self._clients: dict[str, GovernorClient] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # Per replica: connections that could not be opened, and the latest reason.
        self._connect_failures: dict[str, tuple[int, BaseException]] = {}
        self._jobs = itertools.count(1)

    @classmethod
    async def connect(
        cls,
        addresses: str | Iterable[str],
        *,
        timeout: float = 10.0,
        api_key: str | None = None,
        retry_budget: RetryBudget | None = None,
        ssl: SSLContext | None = None,
        server_hostname: str | None = None,
        ejection: Ejection = Ejection(),
        resolver: Resolver | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> Self:
        """Resolve ``addresses`` (``HOST:PORT`` texts, comma-separated or several; a name may
        stand for several replicas: :func:`spread`) into a client; connections open as jobs
        need them, each bounded by ``timeout``. Raises ``ValueError`` for a bad address."""
        targets = split_addresses(addresses)
        found = await resolve(targets, resolver=resolver)
        return cls(
            Replicas(found, ejection=ejection, rng=rng, clock=clock),
            targets=targets,
            api_key=api_key,
            retry_budget=retry_budget,
            ssl=ssl,
            server_hostname=server_hostname,
            connect_timeout=timeout,
            resolver=resolver,
            rng=rng,
        )

    @property
    def retry_budget(self) -> RetryBudget:
        return self._budget

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)

    async def refresh(self) -> None:
        """Resolve the addresses again (replicas come and go behind a name); connections to
        replicas no longer named are closed."""
        if not self.targets:
            return
        dropped = self.replicas.update(await resolve(self.targets, resolver=self._resolver))
        for address in dropped:
            await self._drop(address.name)

    async def open(self) -> list[str]:
        """Connect to every replica now (a load generator, before its starting gun): the
        names connected. A replica that cannot be reached counts a failure; raises
        :class:`NoReplicaAvailable` when none can."""
        errors: list[BaseException] = []

        async def one(address: Address) -> str | None:
            try:
                await self._connection(address)
            except (ClientError, OSError, TimeoutError) as exc:
                self.replicas.failure(address.name)
                errors.append(exc)
                return None
            return address.name

        opened = await asyncio.gather(*(one(a) for a in self.replicas.addresses))
        names = [n for n in opened if n is not None]
        if not names:
            raise NoReplicaAvailable(_why_none(errors))
        return names

    # Operations ------------------------------------------------------------------------

    async def ping(self, *, timeout: float = 10.0) -> Reply:
        """Ping one replica (picked as for a job; another if it cannot be reached)."""
        errors: list[BaseException] = []
        avoid: set[str] = set()
        async with asyncio.timeout(timeout):
            while (address := self.replicas.pick(exclude=avoid)) is not None:
                reply = await self._ping(address, timeout=timeout, errors=errors)
                if reply is not None:
                    return reply
                avoid.add(address.name)
        raise NoReplicaAvailable(_why_none(errors))

    async def ping_all(self, *, timeout: float = 10.0) -> dict[str, Reply | Exception]:
        """Ping every replica at once: its reply, or why it could not be reached."""
        addresses = self.replicas.addresses

        async def one(address: Address) -> Reply | Exception:
            errors: list[BaseException] = []
            reply = await self._ping(address, timeout=timeout, errors=errors)
            if reply is not None:
                return reply
            error = errors[-1]
            return error if isinstance(error, Exception) else ClientError(str(error))

        results = await asyncio.gather(*(one(a) for a in addresses))
        return {a.name: r for a, r in zip(addresses, results, strict=True)}

    async def upload(
        self,
        payload: bytes,
        *,
        job: str | None = None,
        chunk_bytes: int = 8192,
        content_type: str = "application/octet-stream",
        ttl_ms: int = 0,
        retry: RetryPolicy = DEFAULT_RETRY,
        timeout: float | None = None,
        on_attempt: Callable[[float, Reply], None] | None = None,
        on_delta: Callable[[str], None] | None = None,
        inline: bool = False,
    ) -> FleetResult:
        """:meth:`GovernorClient.upload` over the replicas (module docstring)."""

        def send(
            client: GovernorClient,
            policy: RetryPolicy,
            seen: Callable[[float, Reply], None],
            elsewhere: Callable[[Reply], bool],
            delta: Callable[[str], None],
        ) -> Awaitable[UploadResult]:
            return client.upload(
                payload,
                job=job_id,
                chunk_bytes=chunk_bytes,
                content_type=content_type,
                ttl_ms=ttl_ms,
                retry=policy,
                on_attempt=seen,
                on_delta=delta,
                inline=inline,
                on_yield=elsewhere,
            )

        job_id = job or self._job_id()
        run = _FleetJob(self, job_id, retry, on_attempt, on_delta, send)
        async with asyncio.timeout(timeout):
            return await run.run()

    async def generate(
        self,
        spec: JobSpec,
        *,
        job: str | None = None,
        ttl_ms: int = 0,
        retry: RetryPolicy = DEFAULT_RETRY,
        timeout: float | None = None,
        on_attempt: Callable[[float, Reply], None] | None = None,
        on_delta: Callable[[str], None] | None = None,
    ) -> FleetResult:
        """:meth:`GovernorClient.generate` over the replicas."""
        payload = spec.encode()
        return await self.upload(
            payload,
            job=job,
            content_type=SPEC_CONTENT_TYPE,
            ttl_ms=ttl_ms,
            retry=retry,
            timeout=timeout,
            on_attempt=on_attempt,
            on_delta=on_delta,
            inline=len(payload) < INLINE_MAX_BYTES,
        )

    # Plumbing --------------------------------------------------------------------------

    def _job_id(self) -> str:
        return f"J_f{next(self._jobs)}"  # (ids are per connection; the f marks the fleet's)

    async def _connection(self, address: Address) -> GovernorClient:
        """The open connection to ``address``, opening (or reopening) it if need be."""
        name = address.name
        lock = self._locks.setdefault(name, asyncio.Lock())
        failed_before, _ = self._connect_failures.get(name, (0, None))
        async with lock:  # concurrent jobs wait for one connection, not open one each
            client = self._clients.get(name)
            if client is not None and not client.closed:
                return client
            failed, why = self._connect_failures.get(name, (0, None))
            if failed != failed_before:  # it failed while this job waited: do not wait again
                raise ConnectionLost(f"cannot connect to {name}: {why!r}")
            if client is not None:  # closed by the server (idle), or lost: not a failure
                del self._clients[name]
                await client.close()
            tls_name = self._server_hostname or address.server_hostname
            try:
                client = await GovernorClient.connect(
                    address.host,
                    address.port,
                    timeout=self._connect_timeout,
                    api_key=self.api_key,
                    retry_budget=self._budget,
                    ssl=self._ssl,
                    server_hostname=tls_name if self._ssl is not None else None,
                )
            except (ClientError, OSError, TimeoutError) as exc:
                self._connect_failures[name] = (failed + 1, exc)
                raise
            self._clients[name] = client
            return client

    async def _drop(self, name: str) -> None:
        client = self._clients.pop(name, None)
        if client is not None:
            await client.close()

    async def _ping(
        self, address: Address, *, timeout: float, errors: list[BaseException]
    ) -> Reply | None:
        try:
            client = await self._connection(address)
            reply = await client.ping(timeout=timeout)
        except (ClientError, OSError, TimeoutError) as exc:
            errors.append(exc)
            self.replicas.failure(address.name)
            await self._drop(address.name)
            return None
        self.replicas.observe(address.name, reply)
        return reply

    async def _probe(self, *, force: bool = False) -> None:
        """Ping the left replicas that are due: a ready one is picked again."""
        due = self.replicas.probes_due(force=force)

        async def one(address: Address) -> None:
            with contextlib.suppress(ClientError, OSError, TimeoutError):
                client = await self._connection(address)
                self.replicas.observe(address.name, await client.ping(timeout=PROBE_TIMEOUT_S))

        if due:
            await asyncio.gather(*(one(a) for a in due))

    async def _withdraw(self, name: str, client: GovernorClient, job: str) -> None:
        try:
            await client.withdraw(job, timeout=WITHDRAW_TIMEOUT_S)
        except (ClientError, OSError, TimeoutError):
            await self._drop(name)  # its answer must not come to a connection still in use


def _why_none(errors: Sequence[BaseException]) -> str:
    if not errors:
        return "every replica is draining"
    return f"no replica could be reached (the last: {errors[-1]!r})"


class _FleetJob:
    """One job's way over the replicas: the tries, and what each one's end decides."""

    def __init__(
        self,
        fleet: FleetClient,
        job: str,
        retry: RetryPolicy,
        on_attempt: Callable[[float, Reply], None] | None,
        on_delta: Callable[[str], None] | None,
        send: _Send,
    ) -> None:
        self.fleet = fleet
        self.replicas = fleet.replicas
        self.job = job
        self.retry = retry
        self.on_attempt = on_attempt
        self.on_delta = on_delta
        self.send = send
        self.attempts = 0
        self.yields: list[Reply] = []
        self.tried: list[str] = []
        self.avoid: set[str] = set()  # replicas this job left: draining, broken, failing
        self.errors: list[BaseException] = []
        self.delivered = False  # output streamed to the caller: the job cannot start over
        self.last: UploadResult | None = None
        self.last_replica = ""  # the replica that gave self.last
        self.budget_exhausted = False
        self.started = time.monotonic()

    async def run(self) -> FleetResult:
        await self.fleet._probe()
        target = self.replicas.pick(exclude=self.avoid)
        if target is None:  # every replica is left: ask them all now, not in recheck_s
            await self.fleet._probe(force=True)
            target = self.replicas.pick(exclude=self.avoid)
        delay = 0.0
        while target is not None and self.attempts < self.retry.max_attempts:
            if delay > 0:
                await asyncio.sleep(delay)
            move = await self._visit(target)
            if move is None:
                break
            target, delay = move.address, move.delay_s
        if self.last is None:
            raise NoReplicaAvailable(_why_none(self.errors)) from (
                self.errors[-1] if self.errors else None
            )
        last = self.last
        return FleetResult(
            last.reply,
            self.attempts,
            self.yields,
            self.started,
            last.admitted_at,
            time.monotonic(),
            self.budget_exhausted or last.budget_exhausted,
            replica=self.last_replica,
            tried=tuple(self.tried),
        )

    def _elsewhere(self) -> Move | None:
        """A new pick, away from the replicas this job has left."""
        address = self.replicas.pick(exclude=self.avoid)
        return None if address is None else Move(address, 0.0)

    def _give_up_on(self, name: str) -> Move | None:
        self.replicas.failure(name)
        self.avoid.add(name)
        return self._elsewhere()

    async def _visit(self, address: Address) -> Move | None:
        """Try the job on ``address``: where to go next, or None when it has ended."""
        name = address.name
        fleet, replicas = self.fleet, self.replicas
        self.tried.append(name)
        replicas.sent(name)
        try:
            client = await fleet._connection(address)
        except (ClientError, OSError, TimeoutError) as exc:
            self.attempts += 1
            self.errors.append(exc)
            return self._give_up_on(name)

        answered = 0
        move: Move | None = None

        def seen(sent_at: float, reply: Reply) -> None:
            nonlocal answered
            answered += 1
            replicas.observe(name, reply)
            if self.on_attempt is not None:
                self.on_attempt(sent_at, reply)

        def elsewhere(reply: Reply) -> bool:
            nonlocal move
            move = replicas.after_yield(name, exclude=self.avoid)
            return move is None

        def delta(text: str) -> None:
            self.delivered = True
            if self.on_delta is not None:
                self.on_delta(text)

        left = self.retry.max_attempts - self.attempts
        try:
            result = await self.send(
                client, replace(self.retry, max_attempts=left), seen, elsewhere, delta
            )
        except ClientError as exc:  # the connection broke under the job
            self.attempts += answered + 1
            self.errors.append(exc)
            await fleet._drop(name)
            if self.delivered:
                raise  # its output went out in part: starting over would send it twice
            return self._give_up_on(name)
        self.attempts += result.attempts
        self.yields += result.yields
        self.last, self.last_replica = result, name
        reply = result.reply
        if reply.status == Status.ABORT:
            return await self._after_abort(name, result)
        if reply.status != Status.YIELD or result.budget_exhausted:
            return None
        if self.attempts >= self.retry.max_attempts:
            return None
        if reply.need_code == NeedCode.DRAINING:
            self.avoid.add(name)
            return self._elsewhere()
        if move is None:
            # The client stopped on its own: a breaker_open hint longer than it would sleep.
            self.avoid.add(name)
            move = replicas.after_yield(name, exclude=self.avoid)
            if move is None:
                return None
        if reply.receipt(Receipt.PAYLOAD_HELD) == 1:
            await fleet._withdraw(name, client, self.job)
        if move.delay_s > 0:
            hint_ms = math.ceil(move.delay_s * 1000)
            move = Move(move.address, self.retry.delay_s(hint_ms, fleet._rng))
        return move

    async def _after_abort(self, name: str, result: UploadResult) -> Move | None:
        reply = result.reply
        if self.delivered:
            return None
        if reply.need_code in GONE_CODES:  # the replica went away under the job
            await self.fleet._drop(name)
            if reply.need_code == NeedCode.SHUTDOWN:
                self.replicas.leave(name)
                self.avoid.add(name)
                return self._elsewhere()
            return self._give_up_on(name)
        if reply.error_code == ErrorCode.BACKEND_ERROR:
            # Observed as a failure already, and withdrawn from the budget by the client.
            if not self.fleet.retry_budget.allows_retry():
                self.budget_exhausted = True
                return None
            self.avoid.add(name)
            return self._elsewhere()
        return None


__all__ = [
    "Address",
    "Ejection",
    "FleetClient",
    "FleetResult",
    "Move",
    "NoReplicaAvailable",
    "ReplicaState",
    "ReplicaStatus",
    "Replicas",
    "resolve",
    "resolve_now",
    "split_addresses",
    "spread",
    "system_resolver",
]
