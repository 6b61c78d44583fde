"""Admission: may this job run now? One pure decision, and the ticket that gives back what it took.

:meth:`Admission.decide` is synchronous, with no ``await`` between checking and taking, over
the pools' slot ledgers, the tenants, the overload state and the breakers (all pure, on one
injected clock), so the cap holds by construction. Its order is written once, here:

1. draining                 yield ``draining`` (whatever else is wrong with the job)
2. what the spec and the    abort: the runner's spec codes (``spec_invalid``, ...), the lane
   tenant's key allow       policy's rejections, ``lane_not_allowed``
3. the ladder               degraded: an interactive job's ``max_new_tokens`` is lowered
4. pauses                   batch_paused: background, interactive_only: heavy too, yield
                            ``lane_paused`` while clients of a higher lane wait (beyond those
                            the interactive reserve serves); a paused lane still takes a slot
                            that would otherwise sit idle
5. the tenant's limits      yield ``tenant_busy``, ``tenant_share``, ``rate_limited``
6. breaker and fallback     an open primary breaker sends the job to the fallback pool, else
                            yield ``breaker_open``; while degraded, heavy and background work
                            goes to the fallback pool when it has a slot
7. the ledger               a slot, or yield ``server_busy``, ``lane_full``, ``kv_pressure``
8. the fleet (redis_url)    asked by the execution, after this decision, only about a job
                            admitted here (:mod:`governor.core.fleetgate`): refused, the admission is
                            taken back (:meth:`Admission.revoke`) and the client yields
                            ``fleet_busy``, ``tenant_busy``, ``rate_limited`` or
                            ``fleet_unavailable``

Nothing changes unless the answer is :class:`Admitted`: a refused job keeps its
``max_new_tokens``, the ladder counts no activation for it, the tenant's buckets are not
charged. A refusal is counted (the yield totals, the overload state's yield rate) and gives the
client a place in line (its :class:`~governor.core.ledger.Promise`), nothing more.

What admission takes (the slot, the tenant's count, the payload's buffer reservation, a breaker
trial) is held by the :class:`Ticket`. :meth:`Ticket.release` gives all of it back exactly
once, and records the job's outcome with the breaker and the overload state; the execution
that owns the ticket calls it from its task's done-callback, which runs whatever ends the task,
a cancel before its first step included.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from protocol.codes import BOUNDS, Bound, ErrorCode, NeedCode
from protocol.spec import SpecInvalid

from ..runners.base import Job, Pausing, Runner
from .breaker import CircuitBreaker
from .fleetgate import Lease
from .hints import HintParts
from .ledger import DRAINING_HINT_MS, Completed, Promise, Refusal, Slot, SlotLedger
from .overload import OverloadController, State
from .policy import LANES, NO_LANE, Demand, Lane
from .service import JobSize
from .slo import NO_OBJECTIVES, Objectives, SloPolicy
from .tenants import Tenant, Tenants
from .unserved import Key, UnservedDemand

# Outcomes that say the backend failed: the circuit breaker counts these as failures and
# "done" as a success; any other end (cancelled, out of ttl_ms, its client gone, shutdown)
# says nothing about the pool.
BACKEND_FAILURES = frozenset(
    {
        NeedCode.BACKEND_ERROR,
        NeedCode.RUNNER_CRASHED,
        NeedCode.RUNNER_TIMEOUT,
        NeedCode.RUNNER_UNAVAILABLE,
        NeedCode.UPSTREAM_ERROR,
        NeedCode.UPSTREAM_TIMEOUT,
    }
)
# Ends that say nothing of the pool's health or load: not counted by the overload state. (An
# upstream's refusal of a request, its 4xx, is the request's fault, not the backend's.)
NEUTRAL_OUTCOMES = frozenset({"cancelled", "client_gone", "revoked", NeedCode.UPSTREAM_REJECTED})
UNAVAILABLE_CODES = frozenset(
    {NeedCode.DRAINING, NeedCode.BREAKER_OPEN, NeedCode.FLEET_UNAVAILABLE}
)


@dataclass(frozen=True, slots=True)
class Pool:
    """A runner, the slots it has and its circuit breaker: the primary pool, or the fallback."""

    name: str
    runner: Runner
    ledger: SlotLedger
    breaker: CircuitBreaker


BUFFERS_FULL_HINT_MS = 500  # how soon a client refused for the server's buffers may try again


class Budget:
    """A bound on bytes held: the server's payload buffers, or one connection's."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.limit


class Reservation:
    """One payload's bytes against the buffer budgets, given back once.

    What its manifest declared counts against its connection's budget: a bound on what one
    client may promise. What has arrived counts against the server's: the memory held. Declared
    bytes never touch the server's budget, so promises that are never kept cannot fill it.
    """

    __slots__ = ("_connection", "_server", "declared", "held")

    def __init__(self, connection: Budget, server: Budget, declared: int) -> None:
        self._connection = connection
        self._server = server
        self.declared = declared
        self.held = 0
        connection.used += declared

    def hold(self, nbytes: int) -> bool:
        """Count ``nbytes`` as held now, or refuse (False, nothing changed) if more would not
        fit the server's budget; holding less always succeeds."""
        grow = nbytes - self.held
        if grow > 0 and not self._server.fits(grow):
            return False
        self._server.used += grow
        self.held = nbytes
        return True

    def release(self) -> None:
        self._connection.used -= self.declared
        self._server.used -= self.held
        self.declared = self.held = 0


def prompt_tokens(job: Job) -> int:
    """The job's prompt in tokens: counted by the runner's tokenizer, else estimated."""
    if job.tokens:
        return len(job.tokens)
    return job.spec.estimated_prompt_tokens() if job.spec is not None else 0


def asked_tokens(job: Job | None) -> int:
    """What a job asks for: its prompt and the most it may generate (0: not a generation)."""
    if job is None or job.spec is None:
        return 0
    return prompt_tokens(job) + job.spec.output_tokens


@dataclass(slots=True, eq=False)
class Attempt:
    """One try at admission: the job as its runner prepared it (or why it could not be), its
    tenant, and what its earlier tries left: its place in line, how often it was refused."""

    tenant: Tenant
    job: Job | None
    spec_error: SpecInvalid | None = None
    promise: Promise | None = None
    refusals: int = 0
    pauses: int = 0  # the times a pause refused it (the ladder counts a pause once per job)
    lane: str = NO_LANE  # the lane it was given, once classified
    # Unserved demand: its lane and tenant when first turned away (counted then, once), and
    # whether it is turned away now (neither admitted since nor given up).
    turned_away: Key | None = None
    unserved: bool = False
    first_refused: float | None = None  # when first refused (its wait and TTFT count from then)


class Ticket:
    """What an admitted job holds. :meth:`release` gives it all back; again, it does nothing."""

    __slots__ = (
        "_released",
        "degraded",
        "demand",
        "job",
        "lane",
        "lease",
        "objectives",
        "pool",
        "reservation",
        "slot",
        "tenant",
        "tokens",
        "trial",
    )

    def __init__(
        self,
        *,
        pool: Pool,
        slot: Slot,
        job: Job,
        tenant: Tenant,
        demand: Demand | None,
        degraded: tuple[str, ...],
        trial: bool,
        overload: OverloadController | None,
        tokens: int = 0,
        objectives: Objectives = NO_OBJECTIVES,
    ) -> None:
        self.pool = pool
        self.slot = slot
        self.job = job
        self.tenant = tenant
        self.demand = demand
        self.lane: str = demand.lane if demand is not None else NO_LANE
        self.degraded = degraded
        self.trial = trial
        self.tokens = tokens  # what the tenant's token bucket was charged
        self.objectives = objectives  # what the job is held to (see governor.core.slo)
        self.lease: Lease | None = None  # its claim on the fleet, once the fleet granted it
        self.reservation: Reservation | None = None
        self._released: OverloadController | bool | None = overload  # False once released
        tenant.inflight += slot.width
        tenant.running.append(slot)

    @property
    def released(self) -> bool:
        return self._released is False

    def release(self, outcome: str, done: Completed | None = None) -> float:
        """Free the slot, the tenant's count and the payload's buffers; record ``outcome``
        (``"done"``, a need code, ``"client_gone"``) with the breaker and the overload state.

        ``done`` is what a finished job measured, for the service-time estimates; a job that
        did not finish (failed, cancelled, timed out) passes None and teaches them nothing.
        Returns the seconds the slot was held (0.0 when already released).
        """
        overload = self._released
        if overload is False:
            return 0.0
        self._released = False
        failed = outcome in BACKEND_FAILURES
        self.pool.breaker.record(
            True if failed else False if outcome == "done" else None, trial=self.trial
        )
        if isinstance(overload, OverloadController) and outcome not in NEUTRAL_OUTCOMES:
            overload.observe_outcome(failed=outcome != "done")
        self.tenant.inflight -= self.slot.width
        self.tenant.running.remove(self.slot)
        if self.reservation is not None:
            self.reservation.release()
        return self.slot.release(done=done if outcome == "done" else None)


@dataclass(slots=True)  # (not frozen, though never changed: governor/compiled.py)
class Admitted:
    ticket: Ticket


@dataclass(slots=True)  # (not frozen, though never changed: governor/compiled.py)
class Yielded:
    """Not now: ``yield`` with this code and hint; ``promise`` is the client's place in line,
    ``parts`` what its hint is made of (when it waits on a slot), ``bound`` what refused it
    (None: the code's own, :data:`~protocol.codes.BOUNDS`)."""

    need_code: NeedCode
    retry_hint_ms: int
    promise: Promise | None = None
    parts: HintParts | None = None
    bound: Bound | None = None
    # On a fleet, a busy yield of this replica's: whether no other replica would serve it sooner
    # (the store's view); None: not such a yield. If one would, where its clients reach it (when
    # the store said so for this very job: HOST:PORT).
    fleet_saturated: bool | None = None
    fleet_elsewhere: str | None = None

    @property
    def what_bound(self) -> str:
        """What refused it: its own bound, or its code's."""
        return self.bound or BOUNDS[self.need_code]

    @property
    def error_code(self) -> ErrorCode:
        return ErrorCode.UNAVAILABLE if self.need_code in UNAVAILABLE_CODES else ErrorCode.BUSY


@dataclass(slots=True)  # (not frozen, though never changed: governor/compiled.py)
class Rejected:
    """Never: the spec is invalid (``error``: answered as the codec answers bad input), or the
    policy refuses it for good (``confirm abort`` with this code and ``error_code`` policy)."""

    need_code: str
    detail: str
    error: SpecInvalid | None = None


Decision = Admitted | Yielded | Rejected


@dataclass(slots=True)  # (not frozen, though never changed: governor/compiled.py)
class _Plan:
    """The job as it would run: its lane, KV reservation, size and the ladder's change."""

    job: Job
    demand: Demand | None
    size: JobSize | None
    tokens: int  # what it costs its tenant's token rate: prompt + max_new_tokens
    degraded: tuple[str, ...] = ()

    @property
    def width(self) -> int:
        """The slots it holds: one per sequence it runs at once."""
        return self.size.width if self.size is not None else 1


class Admission:
    """The decision over the pools, the tenants, the overload state and the breakers."""

    def __init__(
        self,
        primary: Pool,
        tenants: Tenants,
        *,
        fallback: Pool | None = None,
        overload: OverloadController | None = None,
        slo: SloPolicy | None = None,
    ) -> None:
        self.primary = primary
        self.fallback = fallback
        self.pools = (primary,) if fallback is None else (primary, fallback)
        self.tenants = tenants
        self.overload = overload
        self.slo = slo or SloPolicy()
        self.ledger = primary.ledger
        self.clock: Callable[[], float] = primary.ledger.clock
        self.policy = primary.ledger.policy
        self.ladder: collections.Counter[str] = collections.Counter()  # activations by step
        # Every yield, by need code, lane ('-' without lanes) and tenant.
        self.refusals: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.unserved = UnservedDemand()  # the distinct jobs those yields turned away
        # Which of the primary runner's jobs it can suspend and resume (none: it cannot).
        runner = primary.runner
        self._pausable = runner.pausable if isinstance(runner, Pausing) else None

    @property
    def draining(self) -> bool:
        return self.ledger.draining

    def decide(self, attempt: Attempt) -> Decision:
        """Admit, yield or reject ``attempt``, in the order of the module docstring."""
        ledger, now = self.ledger, self.clock()
        promise, attempt.promise = attempt.promise, None
        # 1. Draining.
        if ledger.draining:
            return self._refuse(attempt, promise, Refusal(NeedCode.DRAINING, DRAINING_HINT_MS))
        # 2. What the spec and the tenant's key allow.
        plan = self._plan(attempt)
        if isinstance(plan, Rejected):
            return self._rejected(attempt, promise, plan)
        # 3. The ladder's first step (applied only if admitted).
        plan = self._ladder(plan)
        # 4. Pauses (a paused client keeps its place in line).
        refusal = self._paused(attempt, plan, promise)
        if refusal is not None:
            return self._refuse(attempt, None, refusal)
        # 5. The tenant's limits.
        refusal = self._tenant_refusal(attempt.tenant, plan.tokens, plan.width, now)
        if refusal is not None:
            return self._refuse(attempt, promise, refusal)
        # 6. Breaker and fallback, then 7. the ledger.
        placed = self._place(plan, promise, now)
        if isinstance(placed, Refusal):
            return self._refuse(attempt, None, placed, counted=True)
        pool, slot, plan, trial = placed
        lane = plan.demand.lane if plan.demand is not None else None
        objectives = self._objectives(lane, attempt.tenant, plan.job)
        slot.tpot_s = objectives.tpot_ms / 1000  # (a chat beyond the reserve reads its slack)
        # What the runner needs of the decision: urgency, KV cache, what its steps are sized to.
        job = dataclasses.replace(
            plan.job,
            priority=LANES.index(lane) if lane is not None else 0,
            kv_cache=slot.kv_cache,
            ttft_ms=objectives.ttft_ms,
            tpot_ms=objectives.tpot_ms,
            gap_ms=self.slo.gap_ms(lane),
            ratio=pool.ledger.model.ratio,
            pause=slot.pause,
        )
        if self.overload is not None:
            self.overload.observe_admission(yielded=False)
        self.ladder.update(plan.degraded)
        attempt.tenant.charge(plan.tokens, now)
        attempt.unserved = False
        ticket = Ticket(
            pool=pool,
            slot=slot,
            job=job,
            tenant=attempt.tenant,
            demand=plan.demand,
            degraded=plan.degraded,
            trial=trial,
            overload=self.overload,
            tokens=plan.tokens,
            objectives=objectives,
        )
        return Admitted(ticket)

    def revoke(self, attempt: Attempt, ticket: Ticket, refusal: Refusal) -> Yielded:
        """Take back an admission the fleet refused (:mod:`governor.core.fleetgate`): the slot is free
        again and the tenant's charge refunded, as if the job had been refused in the first
        place (it keeps no place in line: the fleet's hint is not the ledger's)."""
        ticket.release("revoked")
        ticket.pool.ledger.revoked(ticket.slot)
        ticket.tenant.refund(ticket.tokens, self.clock())
        return self._refuse(attempt, None, refusal)

    # The steps ---------------------------------------------------------------------------

    def _objectives(self, lane: Lane | None, tenant: Tenant, job: Job) -> Objectives:
        """The job's objectives: its lane's, its tenant's, its own (see :mod:`governor.core.slo`)."""
        spec, config = job.spec, tenant.config  # (0 fields set nothing: the lane's stand)
        own = Objectives(spec.ttft_slo_ms, spec.tpot_slo_ms) if spec is not None else None
        return self.slo.objectives(lane, Objectives(config.ttft_slo_ms, config.tpot_slo_ms), own)

    def _plan(self, attempt: Attempt) -> _Plan | Rejected:
        """The job priced and given a lane under a lane policy, or why it can never run."""
        if attempt.spec_error is not None or attempt.job is None:
            error = attempt.spec_error or SpecInvalid(NeedCode.SPEC_INVALID, "no job")
            return Rejected(error.need_code, error.detail, error)
        job, policy = attempt.job, self.policy
        spec = job.spec
        if spec is None:
            return _Plan(job, None, None, 0)
        # (The n sequences of one prompt share it, each may generate max_new_tokens, and each
        # takes a slot of the cap.)
        prompt, output = prompt_tokens(job), spec.output_tokens
        size = JobSize(prompt, output, spec.n)
        tokens = prompt + output
        if policy is None:
            return self._fits(attempt, _Plan(job, None, size, tokens), None)
        requested = None
        if spec.lane is not None:
            if spec.lane not in LANES:
                return Rejected(NeedCode.SPEC_INVALID, f"no lane {spec.lane!r}")
            requested = Lane(spec.lane)
        decision = policy.classify(prompt, output, requested, spec.tool_risk)
        if not isinstance(decision, Demand):
            return Rejected(decision.need_code, decision.detail)
        # A tenant pinned to some lanes runs in the first of them at or below the job's own.
        tenant = attempt.tenant
        allowed = [lane for lane in LANES[LANES.index(decision.lane) :] if tenant.allows_lane(lane)]
        if not allowed:
            return Rejected(
                NeedCode.LANE_NOT_ALLOWED, f"the {decision.lane} lane is not open to this tenant"
            )
        attempt.lane = allowed[0]
        return self._fits(
            attempt, _Plan(job, Demand(allowed[0], decision.kv_tokens), size, tokens), allowed[0]
        )

    def _fits(self, attempt: Attempt, plan: _Plan, lane: Lane | None) -> _Plan | Rejected:
        """The plan, unless its sequences need more slots at once than it could ever hold: more
        than the pool's cap, its lane may take, or its tenant's cap."""
        width = plan.width
        if width == 1:
            return plan
        ledger, tenant_cap = self.ledger, attempt.tenant.config.max_inflight
        most = ledger.lanes.most(lane, ledger.cap)
        if tenant_cap:
            most = min(most, tenant_cap)
        if width > most:
            return Rejected(
                NeedCode.SPEC_INVALID,
                f"n={width} needs {width} slots at once (one per sequence); "
                f"a job of this {'lane and tenant' if lane else 'tenant'} may hold at most {most}",
            )
        return plan

    def _ladder(self, plan: _Plan) -> _Plan:
        """The degraded state's step: a lower max_new_tokens for interactive work."""
        overload, demand, spec = self.overload, plan.demand, plan.job.spec
        if overload is None or demand is None or spec is None:
            return plan
        cap = overload.max_new_tokens(demand.lane, spec.max_new_tokens)
        if cap is None:
            return plan
        cut = (spec.max_new_tokens - cap) * spec.n
        job = dataclasses.replace(plan.job, spec=dataclasses.replace(spec, max_new_tokens=cap))
        size = None if plan.size is None else JobSize(plan.size.prompt_tokens, cap * spec.n, spec.n)
        return _Plan(
            job,
            Demand(demand.lane, demand.kv_tokens - cut),
            size,
            plan.tokens - cut,
            ("interactive_max_new_tokens",),
        )

    def _paused(self, attempt: Attempt, plan: _Plan, promise: Promise | None) -> Refusal | None:
        """A paused lane yields to the higher lanes' waiting clients, but is not left idle: with
        none of them waiting for a slot it could take (the first interactive clients in line
        are the reserve's), its job goes on to the ledger like any other (work-conserving).

        A paused client keeps its place in line (a newcomer takes one at the back), and is
        told to come back when that place comes: when the clients ahead of it, those it was
        paused for included, are expected to have had their slots (the predicted releases,
        however often it was paused: no blind doubling).
        """
        overload, demand = self.overload, plan.demand
        if overload is None or demand is None or not overload.paused(demand.lane):
            return None
        rank = LANES.index(demand.lane)
        if not self.ledger.waiting_above(rank):
            return None
        if not attempt.pauses:
            step = "pause_background" if demand.lane == Lane.BACKGROUND else "interactive_only"
            self.ladder[step] += 1
        attempt.pauses += 1
        parts, promise = self.ledger.place(promise, rank, plan.size)
        return Refusal(NeedCode.LANE_PAUSED, parts.ms, promise, parts)

    def _tenant_refusal(
        self, tenant: Tenant, tokens: int, width: int, now: float
    ) -> Refusal | None:
        """The tenant's concurrency cap, its weighted share, then its request and token rates
        (a job takes ``width`` slots of the first two)."""
        ledger, cap = self.ledger, tenant.config.max_inflight
        share = self.tenants.fair_share(tenant, ledger.cap)
        for limit, code in ((cap, NeedCode.TENANT_BUSY), (share, NeedCode.TENANT_SHARE)):
            # (a share is contention, shared by weight: a tenant running nothing is within it)
            if limit and tenant.inflight and tenant.inflight + width > limit:
                return ledger.waits(code, now, min(ledger.slot_end(s, now) for s in tenant.running))
        wait = tenant.wait_s(tokens, now)
        if wait > 0:
            return Refusal(NeedCode.RATE_LIMITED, ledger.hint_ms(now, now + wait))
        return None

    def _place(
        self, plan: _Plan, promise: Promise | None, now: float
    ) -> tuple[Pool, Slot, _Plan, bool] | Refusal:
        """A slot in the fallback pool when the breaker or the ladder sends the job there, else
        in the primary pool; or a refusal with its hint.

        While the primary pool's breaker is open its jobs, whatever their lane, go to the
        fallback pool if there is one and it has a slot, else yield ``breaker_open`` with a
        hint set by the cooldown.
        """
        ledger, breaker = self.ledger, self.primary.breaker
        blocked = breaker.retry_after_s(ledger.service_s)
        fallback = self.fallback
        falls_back = fallback is not None and ladder_falls_back(self.overload, plan.demand)
        if blocked is not None or falls_back:
            step = "breaker_fallback" if blocked is not None else "fallback_model"
            placed = None if fallback is None else fallback_slot(fallback, plan, step)
            if placed is not None:
                self._withdraw(promise)
                return placed
            if blocked is not None:
                self._withdraw(promise)
                return Refusal(NeedCode.BREAKER_OPEN, ledger.hint_ms(now, now + blocked))
        pausable = self._pausable is not None and self._pausable(plan.job)
        decision = ledger.admit(promise, plan.demand, plan.size, pausable=pausable)
        if isinstance(decision, Refusal):
            return decision
        return self.primary, decision, plan, breaker.started()

    # Refusals ----------------------------------------------------------------------------

    def _refuse(
        self, attempt: Attempt, promise: Promise | None, refusal: Refusal, *, counted: bool = False
    ) -> Yielded:
        """Count a refusal (``counted``: the ledger has, its own); ``promise``, a place in line
        the refusal did not keep, is withdrawn."""
        self._withdraw(promise)
        if not counted:
            self.ledger.refused(refusal)
        if self.overload is not None:
            self.overload.observe_admission(yielded=True)
        self.refusals[(refusal.need_code, attempt.lane, attempt.tenant.name)] += 1
        if attempt.turned_away is None:
            attempt.turned_away = (attempt.lane, attempt.tenant.name)
            self.unserved.turned_away(attempt.turned_away, asked_tokens(attempt.job))
        attempt.unserved = True
        attempt.refusals += 1
        attempt.promise = refusal.promise
        return Yielded(
            refusal.need_code, refusal.retry_hint_ms, refusal.promise, refusal.parts, refusal.bound
        )

    def _rejected(self, attempt: Attempt, promise: Promise | None, rejected: Rejected) -> Rejected:
        """Refused for good: its place in line withdrawn; turned away before, it gave up."""
        self._withdraw(promise)
        self.gave_up(attempt)
        return rejected

    def _withdraw(self, promise: Promise | None) -> None:
        if promise is not None:
            self.ledger.withdraw(promise)

    def forget(self, attempt: Attempt) -> None:
        """The attempt will not come back (its payload was dropped): give up its place."""
        self._withdraw(attempt.promise)
        attempt.promise = None

    def gave_up(self, attempt: Attempt) -> None:
        """A job turned away will not be served (its client left or cancelled, did not come
        back in time, or it was refused for good): counted once; nothing if it is not turned
        away now (never refused, or admitted since)."""
        if attempt.unserved and attempt.turned_away is not None:
            attempt.unserved = False
            self.unserved.gave_up(attempt.turned_away)

    @property
    def inflight(self) -> int:
        """Jobs running, in the primary pool and the fallback pool."""
        return sum(pool.ledger.inflight for pool in self.pools)


def ladder_falls_back(overload: OverloadController | None, demand: Demand | None) -> bool:
    """The ladder's step: heavy and background work to the fallback pool while degraded."""
    return (
        overload is not None
        and demand is not None
        and overload.state >= State.DEGRADED
        and demand.lane != Lane.INTERACTIVE
    )


def fallback_slot(pool: Pool, plan: _Plan, step: str) -> tuple[Pool, Slot, _Plan, bool] | None:
    """The fallback pool's smaller model, if it has a slot and will take the job."""
    if pool.ledger.saturated:  # (no need to prepare a job for a full pool)
        return None
    if pool.breaker.retry_after_s(pool.ledger.service_s) is not None:
        return None
    job = plan.job
    try:  # the pool's own check: its context may be smaller
        fallback_job = pool.runner.prepare(job.id, job.spec, job.payload)
    except SpecInvalid:
        return None
    slot = pool.ledger.admit(size=plan.size)
    if not isinstance(slot, Slot):
        return None
    plan = dataclasses.replace(plan, job=fallback_job, degraded=(*plan.degraded, step))
    return pool, slot, plan, pool.breaker.started()


def place_again(admission: Admission, attempt: Attempt, refused: Yielded) -> Yielded:
    """``refused`` (a busy yield) with a place in line again, at the back as the line is now,
    for a job whose place was withdrawn while the fleet's store was asked where it should go
    and that stays: its hint and parts re-timed, its refusal not counted again."""
    plan = admission._plan(attempt)
    if isinstance(plan, Rejected):
        return refused
    ledger = admission.ledger
    parts, promise = ledger.place(None, ledger.lanes.rank(plan.demand), plan.size)
    attempt.promise = promise
    refused.retry_hint_ms, refused.promise, refused.parts = parts.ms, promise, parts
    return answered(refused, admission.clock())


def answered(refused: Yielded, now: float) -> Yielded:
    """``refused`` is answered ``now``: its client is told its time (its return counts in
    :class:`~governor.core.landing.Landings`; a job waiting in line on the server is told
    nothing)."""
    if refused.promise is not None:
        refused.promise.told = now
    return refused
