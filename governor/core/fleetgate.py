"""The fleet: limits that hold over every replica sharing one store. Pure code, an injected clock.

A replica's own admission (:mod:`governor.core.admission`) decides first, with its ``max_inflight``
authoritative: the fleet is asked only about a job this replica would run now. The store
(:mod:`governor.fleetstore`, Redis) then takes, in one atomic step, the tenant's fleet-wide
token buckets and a *lease* on the fleet's cap, and answers allowed, or refused with a code
and the milliseconds until it could be allowed:

=====================  ======================================================================
``fleet_busy``         ``fleet_max_inflight`` jobs hold leases; the hint spreads the refused
                       over the leases' expected ends, in the order they were refused
``tenant_busy``        the tenant's ``max_inflight`` jobs run over the fleet
``rate_limited``       the tenant's fleet-wide request or token bucket is empty
=====================  ======================================================================

A lease names its replica and job, lives ``lease_ttl`` unless renewed (this replica renews
all of its own leases every third of that), and goes when its job ends; a replica that dies
stops renewing, so its leases expire and free the fleet's cap within ``lease_ttl``.

When the store fails (an error, or no answer within ``fleet_timeout``) :class:`FleetGate`
counts it on a circuit breaker of its own; while that is open the store is not asked, and a
job's lane decides (``fleet_fail_open``, by default interactive work only): *fail open*, within
this replica's share of the fleet's limits (each divided by the replicas last seen alive), or
*fail closed*, yield ``fleet_unavailable`` with the breaker's remaining cooldown as the hint.
Leases taken on the share are written to the store by the next renewal that reaches it, so the
fleet counts them again once it is back; until then a late grant from the store that would make
this replica alone hold more than the fleet's (or the tenant's) cap is refused here.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from protocol.codes import NeedCode

from .breaker import BreakerSettings, BreakerState, CircuitBreaker
from .hints import HintParts
from .ledger import Refusal
from .policy import LANES, Lane
from .tenants import TenantConfig, TokenBucket

# The store's own breaker: three failures that are half of the calls in the last second open it
# (a short window: a busy replica's successes must not hide an outage for long); a trial call
# two seconds later.
STORE_BREAKER = BreakerSettings(window_s=1.0, min_failures=3, error_rate=0.5, cooldown_s=2.0)
STORE_CODES = {
    "fleet_busy": NeedCode.FLEET_BUSY,
    "tenant_busy": NeedCode.TENANT_BUSY,
    "rate_limited": NeedCode.RATE_LIMITED,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetSettings:
    replica_id: str
    max_inflight: int = 0  # the fleet's cap; 0: none
    lease_ttl_s: float = 10.0
    timeout_s: float = 0.05
    fail_open: frozenset[str] = frozenset({Lane.INTERACTIVE})
    min_hint_ms: int = 5
    max_hint_ms: int = 60_000


@dataclass(frozen=True, slots=True)
class Lease:
    """One job's claim on the fleet: its id in the store and whose it is."""

    id: str
    tenant: str
    lane: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Ask:
    """What the store is asked for one job."""

    lease: Lease
    tenant: TenantConfig
    tokens: int  # prompt + max_new_tokens: what the tenant's token bucket is charged
    expected_ms: int  # how long the job is expected to run: for the hint of those refused


@dataclass(frozen=True, slots=True)
class Answer:
    """The store's answer: allowed, or refused with ``code`` and ``wait_ms``; and what it saw."""

    allowed: bool
    code: str = ""
    wait_ms: int = 0
    replicas: int = 1  # replicas alive (their heartbeats not expired), this one included
    inflight: int = 0  # leases held over the fleet, this job's included when allowed
    # How soon (ms) another replica alive could serve a newcomer, as each last said; -1: no other.
    sooner_ms: int = -1


@dataclass(frozen=True, slots=True)
class Told:
    """What a write told the store of this replica: how soon it could serve a newcomer
    (``ms``), as of ``at`` (the gate's clock); ``seq`` numbers the writes (writes and answers
    can overtake each other: the store and the gate keep only the newer)."""

    ms: int
    at: float
    seq: int


class FleetGate:
    """This replica's side of the fleet: its leases, the store's health, the local share."""

    def __init__(self, settings: FleetSettings, clock: Callable[[], float]) -> None:
        self.settings = settings
        self.clock = clock
        self.breaker = CircuitBreaker(STORE_BREAKER, clock)
        self.replicas = 1  # alive, as the store last said (the share divides by it)
        self.fleet_inflight = 0  # leases over the fleet, as the store last said
        # When (clock) another replica could serve a newcomer, as the store last said (None:
        # it has not yet; inf: there is no other), and this one as it told the store then.
        self.elsewhere_at: float | None = None
        self.ready_at = 0.0
        self._writes = itertools.count(1)
        self._heard_seq = 0  # the newest write answered (an older one's answer says nothing newer)
        self.leases: dict[str, Lease] = {}  # this replica's, for running jobs
        self.answers: collections.Counter[str] = collections.Counter()  # by answer
        self._ids = itertools.count(1)
        # The tenants' buckets for the share: (the replicas they were made for, requests, tokens).
        self._shares: dict[str, tuple[int, TokenBucket, TokenBucket]] = {}

    @property
    def store_state(self) -> BreakerState:
        """closed: the store answers; open: unreachable, not asked; half_open: being tried."""
        return self.breaker.state

    def lease(self, tenant: str, lane: str) -> Lease:
        return Lease(f"{self.settings.replica_id}:{next(self._ids)}", tenant, lane)

    def ask(self) -> bool | None:
        """Whether to ask the store now: None, no (its breaker is open: decide on the share);
        else whether this call is the breaker's trial (pass it to :meth:`answered` or
        :meth:`failed`)."""
        if self.breaker.retry_after_s(self.settings.timeout_s) is not None:
            return None
        return self.breaker.started()

    def question(self, lease: Lease, tenant: TenantConfig, tokens: int, expected_s: float) -> Ask:
        return Ask(lease=lease, tenant=tenant, tokens=tokens, expected_ms=round(expected_s * 1000))

    def answered(
        self,
        lease: Lease,
        answer: Answer,
        *,
        trial: bool,
        tenant: TenantConfig,
        next_end_ms: Callable[[], int],
        told: Told | None = None,
    ) -> Refusal | None:
        """The store answered (``told``: what the admission told it): the lease is this
        replica's, or the refusal to send. A grant is
        refused here too (the caller gives the store's lease back) when this replica already
        holds the fleet's or the tenant's cap: leases granted on its share while the store was
        slow, which the store has not counted."""
        self.breaker.record(False, trial=trial)
        self.replicas = max(1, answer.replicas)
        self.fleet_inflight = answer.inflight
        if told is not None:
            self._heard(answer.sooner_ms, told)
        if answer.allowed:
            held = self._held_refusal(tenant, 1, next_end_ms)
            if held is not None:
                return held
            self.answers["allowed"] += 1
            self.leases[lease.id] = lease
            return None
        self.answers[answer.code] += 1
        return self._refusal(STORE_CODES.get(answer.code, NeedCode.FLEET_BUSY), answer.wait_ms)

    def failed(self, *, trial: bool | None) -> None:
        """The store failed to answer (``trial`` None: it was not asked)."""
        if trial is not None:
            self.answers["store_error"] += 1
            self.breaker.record(True, trial=trial)

    def reached(
        self, *, trial: bool, sooner_ms: int, told: Told, replicas: int | None = None
    ) -> None:
        """The store took a release, a heartbeat or a renewal (``told``: what it told of this
        replica): it says how soon another could serve a newcomer (``sooner_ms``), and a
        renewal the ``replicas`` alive."""
        self.breaker.record(False, trial=trial)
        self._heard(sooner_ms, told)
        if replicas is not None:
            self.replicas = max(1, replicas)

    def told(self, ready_ms: int) -> Told:
        """What a write about to go tells the store: this replica could serve a newcomer in
        ``ready_ms``."""
        return Told(ready_ms, self.clock(), next(self._writes))

    def _heard(self, sooner_ms: int, told: Told) -> None:
        if told.seq < self._heard_seq:  # (its answer overtaken by a newer write's)
            return
        self._heard_seq = told.seq
        self.elsewhere_at = math.inf if sooner_ms < 0 else self.clock() + sooner_ms / 1000
        self.ready_at = told.at + told.ms / 1000

    def saturated(self, hint_ms: int, turn_s: float = 0.0) -> bool:
        """Whether a busy yield with ``hint_ms`` speaks for the fleet: no other replica could
        serve the job half a turn (``turn_s``, this replica's) sooner than this one will (less
        is within the estimates' error, and a move costs the client its place here), so its
        client gains nothing by trying them and backs off once for the fleet.

        The store's word ages: the others' lines are taken to have grown as this one's has
        since (a burst comes to every replica alike, and each refusal here comes before the
        store hears of it). So a newcomer, at the back of this line, is the fleet's if the
        others were not half a turn ahead of this replica when the store last said; a client
        with an earlier place here, if none could serve it before that place comes. A job sent
        elsewhere makes the line there a turn longer, until the store says again.
        """
        if self.elsewhere_at is None or self.store_state != BreakerState.CLOSED:
            return False
        here = min(self.ready_at, self.clock() + hint_ms / 1000)
        if self.elsewhere_at + turn_s / 2 >= here:
            return True
        self.elsewhere_at += turn_s  # the job goes there: that line is a turn longer
        return False

    def on_share(
        self, lease: Lease, tenant: TenantConfig, tokens: int, next_end_ms: Callable[[], int]
    ) -> Refusal | None:
        """The store cannot answer: admit ``lease`` within this replica's share of the fleet's
        limits if its lane fails open, else refuse. ``next_end_ms()``: when one of this
        replica's jobs is expected to end, the hint at a share's cap."""
        s, now = self.settings, self.clock()
        lane = lease.lane if lease.lane in LANES else Lane.INTERACTIVE
        if lane not in s.fail_open:
            self.answers["fail_closed"] += 1
            left = self.breaker.retry_after_s(s.timeout_s) or s.timeout_s
            return Refusal(NeedCode.FLEET_UNAVAILABLE, self._hint(left * 1000))
        held = self._held_refusal(tenant, self.replicas, next_end_ms)
        if held is not None:
            return held
        requests, token_bucket = self._share_buckets(tenant, now)
        wait = 0.0
        if tenant.requests_per_s:
            wait = requests.wait_s(1, now)
        if tenant.tokens_per_s:
            wait = max(wait, token_bucket.wait_s(tokens, now))
        if wait > 0:
            return self._share_refusal(NeedCode.RATE_LIMITED, wait * 1000)
        if tenant.requests_per_s:
            requests.take(1, now)
        if tenant.tokens_per_s:
            token_bucket.take(tokens, now)
        self.answers["on_share"] += 1
        self.leases[lease.id] = lease
        return None

    def _held_refusal(
        self, tenant: TenantConfig, n: int, next_end_ms: Callable[[], int]
    ) -> Refusal | None:
        """The refusal when this replica holds ``1/n`` of the fleet's cap or of the tenant's."""
        cap = self.settings.max_inflight
        if cap and len(self.leases) >= math.ceil(cap / n):
            return self._share_refusal(NeedCode.FLEET_BUSY, next_end_ms())
        if tenant.max_inflight:
            mine = sum(1 for held in self.leases.values() if held.tenant == tenant.name)
            if mine >= math.ceil(tenant.max_inflight / n):
                return self._share_refusal(NeedCode.TENANT_BUSY, next_end_ms())
        return None

    def released(self, lease: Lease) -> None:
        """The lease's job ended (the store is told by the caller, in its next batch)."""
        self.leases.pop(lease.id, None)

    def _share_buckets(self, tenant: TenantConfig, now: float) -> tuple[TokenBucket, TokenBucket]:
        n = self.replicas
        share = self._shares.get(tenant.name)
        if share is None or share[0] != n:  # (made afresh, full, when the replicas change)
            share = (
                n,
                TokenBucket(tenant.requests_per_s / n, tenant.request_burst / n, now),
                TokenBucket(tenant.tokens_per_s / n, tenant.token_burst / n, now),
            )
            self._shares[tenant.name] = share
        return share[1], share[2]

    def _share_refusal(self, code: NeedCode, wait_ms: float) -> Refusal:
        self.answers[f"share_{code}"] += 1
        return self._refusal(code, wait_ms)

    def _refusal(self, code: NeedCode, wait_ms: float) -> Refusal:
        """A refusal by the fleet's limits: a cap's hint waits for one lease's predicted end
        (its parts: all release), a rate's for its bucket (no slot: no parts)."""
        hint_ms = self._hint(wait_ms)
        parts = None if code == NeedCode.RATE_LIMITED else HintParts(hint_ms)
        return Refusal(code, hint_ms, None, parts)

    def _hint(self, wait_ms: float) -> int:
        s = self.settings
        return max(s.min_hint_ms, min(s.max_hint_ms, math.ceil(wait_ms)))
