"""The policy over several replicas: what a client knows of each one, and the choices made from
it. Pure code over a clock it is given (no sockets, no ``await``); :mod:`clients.fleet.client`
does the IO and asks it at each step.

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
  A, whose client sleeps the hint and resends only the final chunk of the payload A holds.
  A yield that speaks for every replica marks them all busy and the job stays, backing off
  once for the fleet: ``fleet_busy`` (the fleet's shared cap is full), or a busy one with the
  receipt ``fleet.saturated`` (no other replica would serve it sooner, as the fleet's store
  last said). A busy yield that names a replica it knows (``elsewhere``: the store sent the
  job to the replica that would serve it first) sends the job there at once.
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
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from protocol.codes import NeedCode, Receipt, Status, Verb
from protocol.frames import Reply

from ..retry import backend_failing
from .addresses import Address, distinct

# A yield with no hint (heptamini's daemon always sends one; this is a guess for one that
# does not) marks its replica busy this long.
DEFAULT_HINT_MS = 50
# Yields that speak for the whole fleet: its shared cap, not this replica's slots (the code
# is the governor's fleet extension; as a string, so that this client also runs against a
# governor that does not know it).
FLEET_WIDE_CODES = frozenset({"fleet_busy"})


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


DEFAULT_EJECTION = Ejection()


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
    """After a yield: take the job to ``address``, after ``delay_s`` (0: at once); there it may
    wait ``wait_s`` for its turn (None: a yield at once)."""

    address: Address
    delay_s: float
    wait_s: float | None = None


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
    elsewhere: str | None = None  # the replica its latest yield sent the job to (fleet_wide)

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
        ejection: Ejection = DEFAULT_EJECTION,
        recheck_s: float = 30.0,
        load_ttl_s: float = 5.0,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        fleet_wide: bool = True,
    ) -> None:
        """``fleet_wide``: a yield that speaks for the whole fleet (``fleet_busy``, or a busy
        one that says the fleet is saturated) marks every replica busy until its hint, so the
        job waits where it is; False treats each replica on its own (for comparisons)."""
        self.fleet_wide = fleet_wide
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
        fresh = distinct(addresses)
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
        # Where the fleet's store sent it (the replica that would serve it first), if known:
        # there it waits for its turn, at most as long as it was told to wait here.
        sent = next((r for r in others if r.name == here.elsewhere), None)
        if sent is not None:
            return Move(sent.address, 0.0, max(here.busy_until - now, 0.0))
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
        r.elsewhere = None
        if reply.status == Status.YIELD:
            until = now + (reply.retry_hint_ms or DEFAULT_HINT_MS) / 1000
            r.busy_until = until
            if self.fleet_wide:
                r.elsewhere = reply.elsewhere
            if self.fleet_wide and (
                reply.need_code in FLEET_WIDE_CODES or reply.receipt(Receipt.FLEET_SATURATED)
            ):
                for other in self._order:
                    other.busy_until = max(other.busy_until, until)
        elif reply.receipt(Receipt.HEALTH) == 1:
            r.busy_until = -math.inf  # it would admit a job now
        draining = reply.receipt(Receipt.DRAINING)
        if draining == 1 or reply.need_code == NeedCode.DRAINING:
            r.left_until = now + self.recheck_s
        elif reply.verb == Verb.CONFIRM and reply.status == Status.OK:  # a ping, not draining
            r.left_until = None
        if backend_failing(reply):
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
