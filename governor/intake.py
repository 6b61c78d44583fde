"""One intake for every door: what the TCP session and the HTTP front door do alike with a job.

A listener parses its own wire, keeps a refused job for its retry its own way (a
:class:`Keeper`: a held payload, a kept place in line) and maps what comes out of here to frames
or HTTP statuses. Each connection has one :class:`Conversation`, which owns the order of the
steps between, the same for every door:

1. **Authenticate** (:class:`Credentials`): a key a connection shows for the first time is
   checked at once while its source's budget of failures lasts, else at its turn, the request
   waiting meanwhile (:meth:`Credentials.step`: go, later, or refused for now); a job without a
   valid key or certificate is a failure, counted, and the ``max_auth_failures``-th closes the
   connection, with one log line at a bounded rate.
2. **Ask** (:class:`Ask`, one per job): the job spec is parsed once, here, and the runner
   prepares the job (:meth:`Ask.prepare` for a TCP payload, :meth:`Ask.prepare_fields` for an
   HTTP body's mapped fields; a bad spec is refused and never takes a slot); admission decides,
   timed (:meth:`Ask.decide`), and what follows is decided here too: a busy job that may wait
   (every HTTP request; a TCP job whose frame asks with ``max_wait_ms``) and whose turn comes
   within its budget waits in the one line both doors share (:class:`Wait`, in
   :attr:`ServerState.line`), decided again at its hint and whenever a slot may have freed; it
   leaves the line once, admitted, refused, or because its client left (:meth:`Ask.give_up`).
   The door maps the :data:`Outcome` to its wire; a refused job is kept for its retry by its
   keeper, or gave up (:meth:`Conversation.refused`: one rule, whatever refused it).
3. **Start** (:meth:`Ask.admitted`, :func:`governor.execution.start`): an admitted job's ticket
   takes its payload's reservation and its wait since the first refusal is measured (no IO: a
   sans-IO session hands the result out as an event); then its execution starts.
4. **Take back** (:meth:`Ask.take_back`): the fleet refused a job this replica admitted; its
   ticket is given back and the payload's reservation returned to the door.

Nothing here touches a transport or the event loop: the connection's IO is the doors'
(:mod:`governor.listeners.outbound` holds what both do alike), an admitted job's run the
execution's (:func:`governor.execution.start`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from protocol.codes import ErrorCode, NeedCode
from protocol.spec import JobSpec, SpecInvalid, is_json_content_type, parse_spec

from .core.admission import (
    BUFFERS_FULL_HINT_MS,
    Admitted,
    Attempt,
    Budget,
    Decision,
    Rejected,
    Reservation,
    Ticket,
    Yielded,
    answered,
    place_again,
)
from .core.ledger import DRAINING_HINT_MS, Refusal
from .core.policy import LANES
from .core.sources import NOW, Turn
from .core.tenants import Tenant
from .core.waitline import Candidate, Waiter, wait_budget_s, waits
from .runners import Job, Runner
from .state import ServerState
from .telemetry.logs import event

log = logging.getLogger("governor.intake")

# Authentication ------------------------------------------------------------------------------


class KeyStep(Enum):
    """What a request's key lets it do now (:meth:`Credentials.step`)."""

    GO = "go"
    LATER = "later"  # it waits for its key's turn
    FAR = "far"  # that turn is beyond ``auth_grace``: refused for now, unchecked


class Credentials:
    """What one connection has shown of who it is: its source, a client certificate's tenant,
    the keys found valid on it, and its failures; and the key that waits for its turn (the door
    holds the request that showed it)."""

    def __init__(self, state: ServerState, conn_id: int) -> None:
        self.state = state
        self.conn_id = conn_id
        self.source = ""  # the client's address (its /64 for IPv6), once connected
        self.cert_tenant: Tenant | None = None  # named by a verified client certificate
        self.authenticated = state.tenants.open  # a valid key or certificate was shown
        self.keys: dict[str, Tenant] = {}  # keys shown valid on this connection
        self.failures = 0  # jobs refused for want of a valid key
        self.turn = NOW  # reserved for a key that waits for it
        # A key waiting for its turn (see :meth:`step`), until ``key_at``.
        self.key_at = math.inf
        self._waiting_key = ""

    def connected(self, source: str, cert_tenant: Tenant | None) -> None:
        """The connection is open, from ``source``, its verified client certificate naming
        ``cert_tenant`` if any (its transport says: :class:`~.listeners.outbound.Outbound`)."""
        self.source = source
        self.cert_tenant = cert_tenant
        self.authenticated = self.authenticated or cert_tenant is not None

    def step(self, key: str) -> KeyStep:
        """Whether a request showing ``key`` goes on now: :attr:`KeyStep.GO` (checked, or
        needing no check), :attr:`KeyStep.LATER` (it waits for its key's turn at
        :attr:`key_at`: see :meth:`turn_came`, or :meth:`turn_unused` if its client leaves
        first) or :attr:`KeyStep.FAR` (refused for now, unchecked: ``KEY_TURN_FAR``). The one
        rule both doors follow (:meth:`turn_for`)."""
        turn = self.turn_for(key)
        if turn is None:
            return KeyStep.FAR
        if turn.wait > 0:
            self.key_at = self.state.now() + turn.wait
            self._waiting_key = key
            return KeyStep.LATER
        return KeyStep.GO

    @property
    def waiting(self) -> bool:
        """A key waits for its turn."""
        return self.key_at != math.inf

    def turn_came(self, now: float) -> bool:
        """The key that waited has had its turn, checked then (the door's request goes on);
        False: none waits, or its turn has not come."""
        if now < self.key_at:
            return False
        self._check(self._waiting_key, self.turn)
        self.turn, self.key_at = NOW, math.inf
        return True

    def turn_for(self, key: str) -> Turn | None:
        """When ``key`` may be checked. :data:`~governor.core.sources.NOW`: it has been (just
        now, while its source's budget of failures lasts; or earlier on this connection), or
        needs no check (no tenants; or it failed lately from this source: refused again,
        unchecked). A later :class:`Turn`, reserved: the request waits for it, then
        :meth:`turn_came` (or :meth:`turn_unused` if its client leaves first). None: that
        turn is more than ``auth_grace`` away; refused for now, unchecked."""
        state = self.state
        sources = state.connections.sources
        if state.tenants.open or key in self.keys or sources.failed_before(self.source, key):
            return NOW
        turn = sources.key_turn(self.source, state.config.auth_grace)
        if turn is NOW:
            self._check(key, NOW)
        elif turn is not None:
            self.turn = turn
        return turn

    def turn_unused(self) -> None:
        """The request waiting for its key's turn is gone (or none waits): the turn is given
        back."""
        self.key_at = math.inf
        if self.turn is not NOW:
            self.state.connections.sources.turn_unused(self.source, self.turn)
            self.turn = NOW

    def _check(self, key: str, turn: Turn) -> None:
        tenant = self.state.tenants.find(key)
        self.state.connections.sources.key_checked(self.source, key, tenant is not None, turn)
        if tenant is not None:
            self.keys[key] = tenant
            self.authenticated = True

    def tenant(self, key: str | None) -> Tenant | None:
        """Whom a job runs for: its key's tenant (checked: :meth:`turn_for`), else without a
        key the client certificate's. None is a failure, counted; see :attr:`spent`. (The
        refusal says nothing of which tenants exist.)"""
        tenants = self.state.tenants
        if tenants.open:
            return tenants.find(None)
        tenant = self.cert_tenant if key is None else self.keys.get(key)
        if tenant is None:
            self.failures += 1
            if self.spent:
                self._log_closing()
        return tenant

    @property
    def spent(self) -> bool:
        """The connection has failed ``max_auth_failures`` keys: its refusal closes it."""
        return self.failures >= self.state.config.max_auth_failures

    def _log_closing(self) -> None:
        line = self.state.connections.sources.line(
            f"closing connection {self.conn_id} from {self.source} after {self.failures} "
            "failed keys"
        )
        if line is not None:
            event(
                log,
                logging.WARNING,
                line,
                event="keys_failed",
                source=self.source,
                failures=self.failures,
            )


# Submission ----------------------------------------------------------------------------------


class Ask:
    """One job's conversation with admission, from its spec to its start, the same on both
    doors: its attempt, when it was first refused, its wait in line. A door feeds it (a spec to
    :meth:`prepare`, a decision asked of :meth:`decide` at its time) and maps what comes out
    (:data:`Outcome`) to its wire; only how a refused job is kept for its retry is the door's
    own (a held payload, a kept place)."""

    def __init__(self, state: ServerState, attempt: Attempt, key: Hashable = None) -> None:
        self.state = state
        self.attempt = attempt
        self.key = key  # the door's name for it (a job id, a place's key): see Keeper
        self.wait: Wait | None = None  # its wait for its turn, if it may wait
        self.decide_at = math.inf  # waiting in line: decided again then, at its hint

    @property
    def first_refusal(self) -> float | None:
        """When it was first refused (a retry: its first try's), if it was."""
        return self.attempt.first_refused

    def prepare(self, job_id: str, payload: bytes, content_type: str) -> None:
        """A verified TCP payload: a JSON job spec is parsed here, once; any other payload goes
        to the runner as it is (a runner that generates text takes it as its prompt)."""

        def job(runner: Runner) -> Job:
            spec = None
            if is_json_content_type(content_type):
                spec = parse_spec(
                    payload, content_type, max_new_tokens_ceiling=runner.max_new_tokens
                )
            return runner.prepare(job_id, spec, payload)

        self._prepare(job_id, job)

    def prepare_fields(self, job_id: str, spec: Callable[[int], JobSpec], body: bytes) -> None:
        """An HTTP request's job spec, as its API maps it (from the body it decoded already: no
        JSON in between), checked here against the runner's ceiling (``spec`` raises
        ``SpecInvalid``)."""

        def job(runner: Runner) -> Job:
            return runner.prepare(job_id, spec(runner.max_new_tokens), body)

        self._prepare(job_id, job)

    def _prepare(self, job_id: str, make: Callable[[Runner], Job]) -> None:
        """The primary pool's runner prepares the job for admission to decide on: a spec
        refused (by the parse or the runner) is the attempt's ``spec_error``, decided as a
        rejection before any slot is looked at."""
        attempt = self.attempt
        attempt.job, attempt.spec_error = None, None
        try:
            attempt.job = make(self.state.admission.primary.runner)
        except SpecInvalid as exc:
            attempt.spec_error = exc
        except Exception:  # a runner bug must cost this job, not the connection
            log.exception("runner failed to prepare job %r", job_id)
            attempt.spec_error = SpecInvalid(
                NeedCode.SPEC_INVALID, "the runner cannot run this job"
            )

    def line_up(self, asked_ms: int | None, decide: Callable[[], str | None]) -> None:
        """The job may wait for its turn (:class:`Wait`: ``asked_ms``, else ``max_wait``);
        ``decide`` is the door's, called when the line offers it a freed slot."""
        self.leave_line()
        self.wait = Wait(self.state, self.attempt, asked_ms, decide)

    def leave_line(self) -> None:
        """A new submission: the wait of the last one, if any, is over."""
        if self.wait is not None:
            self.wait.leave(None)
            self.wait = None

    @property
    def in_line(self) -> bool:
        return self.wait is not None and self.wait.waiter is not None

    def decide(self) -> Outcome:
        """Admission's decision, and what follows from it here: a busy refusal whose turn comes
        within the job's wait budget waits in line (:class:`Waiting`: the door decides again at
        its ``until``, or sooner when the line offers a slot); otherwise the job leaves the line
        with the decision, for the door to answer (an :class:`Admitted` one: :meth:`admitted`)."""
        state = self.state
        self.decide_at = math.inf
        decision = _decision(state, self.attempt)
        wait = self.wait
        if isinstance(decision, Yielded):
            if self.attempt.first_refused is None:
                self.attempt.first_refused = state.now()
            if wait is not None and wait.joins(decision):
                self.decide_at = state.now() + decision.retry_hint_ms / 1000
                return Waiting(self.decide_at, decision.need_code)
            answered(decision, state.now())
        if wait is not None:
            wait.leave(decision)
        return decision

    def admitted(
        self, decision: Admitted, *, job: str, ttl_ms: int, reservation: Reservation | None
    ) -> JobAdmitted:
        """The ticket takes the payload's reservation (released with it), and the job's wait
        since its first refusal is measured: the job, for the door to start
        (:func:`~governor.execution.start`)."""
        ticket = decision.ticket
        ticket.reservation = reservation
        waited = None if self.first_refusal is None else ticket.slot.started - self.first_refusal
        self.state.metrics.wait.observe(ticket.lane, waited or 0.0)
        return JobAdmitted(job, ttl_ms, ticket, self.attempt, waited)

    def give_up(self) -> None:
        """Its client left, or cancelled, while it waited: see :meth:`Wait.give_up`."""
        self.decide_at = math.inf
        if self.wait is not None:
            self.wait.give_up()

    def forget(self) -> None:
        """It will not come back (its payload was dropped): see :func:`forget`."""
        forget(self.state, self.attempt)

    def place_again(self, refused: Yielded) -> Yielded:
        """Its place, withdrawn while the fleet's store was asked, taken again at the back
        (:func:`~governor.core.admission.place_again`)."""
        return place_again(self.state.admission, self.attempt, refused)

    def take_back(
        self, ticket: Ticket, refusal: Refusal, *, keep_payload: bool
    ) -> tuple[Yielded, Reservation | None]:
        """The fleet refused the job this replica admitted: its ticket is given back and the
        yield to answer returned; with ``keep_payload``, so is its payload's reservation, for
        the door to hold for the retry (else it is released with the ticket)."""
        reservation = None
        if keep_payload:
            reservation, ticket.reservation = ticket.reservation, None
        if self.attempt.first_refused is None:
            self.attempt.first_refused = self.state.now()
        return self.state.admission.revoke(self.attempt, ticket, refusal), reservation


def forget(state: ServerState, attempt: Attempt) -> None:
    """A refused job will not come back (its payload was dropped, its client left, its kept
    place expired): its place in admission's line is given up."""
    state.admission.forget(attempt)


def gave_up(state: ServerState, attempt: Attempt) -> None:
    """A refused job's client will not be back, or could not be recognised if it came (no
    place was kept for it, or its kept place expired): forgotten, and counted as unserved
    demand that gave up."""
    forget(state, attempt)
    state.admission.gave_up(attempt)


def revoke(state: ServerState, attempt: Attempt, ticket: Ticket, refusal: Refusal) -> None:
    """The fleet refused a job this replica admitted whose client has gone meanwhile: its
    ticket is given back, with no one to answer (:meth:`Ask.take_back` when there is)."""
    state.admission.revoke(attempt, ticket, refusal)


def payload_bytes(state: ServerState, connection: Budget, declared: int) -> Reservation | None:
    """A payload's bytes, on either door: what it declares counted against its connection's
    ``connection`` budget (checked by the door, with its own answer), what has arrived against
    the server's buffers as it comes (:meth:`Reservation.hold`). None: the server's buffers have
    no room for what it declares now (:func:`no_room_for_payload` says what to answer)."""
    if not state.connections.buffers.fits(declared):
        return None
    return Reservation(connection, state.connections.buffers, declared)


def no_room_for_payload(state: ServerState) -> Yielded:
    """A payload the server's buffers cannot take now: sent again later; while the server
    drains, sent elsewhere (no retry here would be admitted: the answer it would get). The
    same on both doors, whatever their words."""
    if state.admission.draining:
        return Yielded(NeedCode.DRAINING, DRAINING_HINT_MS)
    return Yielded(NeedCode.BUFFERS_FULL, BUFFERS_FULL_HINT_MS)


@dataclass(frozen=True, slots=True)
class Waiting:
    """The job waits in line for its turn, unanswered: decided again at ``until`` (its hint),
    or sooner when the line offers it a freed slot. ``need_code``: the busy refusal's (a
    ``server_busy`` one ends the line's round of offers: those behind it would be refused too)."""

    until: float
    need_code: NeedCode


Outcome = Admitted | Rejected | Yielded | Waiting


def place(
    state: ServerState,
    decision: Yielded,
    answer: Callable[[Yielded], None],
    *,
    withdrawn: bool = False,
) -> bool:
    """On a fleet, a busy yield of this replica's waits (within ``fleet_timeout``) for the
    store's word on whether its job is the fleet's (:class:`~governor.fleetstore.Placements`):
    ``answer`` is then called with it. False: nothing to wait for (not such a yield, or the store
    cannot say now): answer at once, with the verdict from what the store last said.
    ``withdrawn``: the job's place in line is withdrawn meanwhile (it is asked about as a
    newcomer at the back of the line then)."""
    fleet = state.fleet
    if fleet is None or decision.fleet_saturated is None:
        return False

    def verdict(elsewhere: str | None) -> None:
        if elsewhere is not None:
            decision.fleet_saturated = not elsewhere
            decision.fleet_elsewhere = elsewhere or None
        answer(decision)

    return fleet.placements.ask(decision.retry_hint_ms, verdict, withdrawn=withdrawn)


def _decision(state: ServerState, attempt: Attempt) -> Decision:
    """Admission's decision on a prepared attempt, its time measured; on a fleet, a busy yield
    says whether it speaks for the fleet (no other replica would serve the job sooner)."""
    started = time.perf_counter()
    decision = state.admission.decide(attempt)
    state.metrics.decision.observe(attempt.lane, time.perf_counter() - started)
    fleet = state.fleet
    if (
        fleet is not None
        and isinstance(decision, Yielded)
        and decision.error_code == ErrorCode.BUSY
    ):
        decision.fleet_saturated = fleet.busy(decision.retry_hint_ms)
    return decision


# Waiting for a turn ------------------------------------------------------------------------


class Wait:
    """One job's wait for its turn in the line both doors share: whether a busy refusal waits,
    its place while it does, and the wait measured when it leaves. ``decide`` decides the job
    again (the door's, as the line offers it a slot); the door decides it again at its hint
    too, on its own clock."""

    def __init__(
        self,
        state: ServerState,
        attempt: Attempt,
        asked_ms: int | None,
        decide: Callable[[], str | None],
    ) -> None:
        self.state = state
        self.attempt = attempt
        self.budget_s = wait_budget_s(state.config.max_wait, asked_ms)
        self.arrived = state.now()
        self.decide = decide
        self.waiter: Waiter[Candidate] | None = None
        self.waited_ms: int | None = None  # once it left the line (0: it never joined)

    def joins(self, decision: Yielded) -> bool:
        """Whether the job waits for the turn ``decision`` hints at: a busy refusal whose turn
        comes within the job's budget (counted from its arrival), while the line has room."""
        state, attempt = self.state, self.attempt
        if decision.error_code != ErrorCode.BUSY:
            return False
        if not waits(self.budget_s, state.now() - self.arrived, decision.retry_hint_ms):
            if self.waiter is None:
                state.metrics.not_waited["beyond_budget"] += 1
            return False
        if self.waiter is None:
            self.waiter = state.line.join(
                self,
                rank=LANES.index(attempt.lane) if attempt.lane in LANES else 0,
                tenant=attempt.tenant.name,
                since=state.now(),
                bounded=not state.tenants.open,
            )
            if self.waiter is None:
                state.metrics.not_waited["line_full"] += 1
                return False
            attempt.tenant.waiting += 1
        return True

    def leave(self, decision: Decision | None) -> None:
        """Out of the line (if in it) with the decision that ended its wait (None: its client
        left), the wait measured."""
        waiter, state, attempt = self.waiter, self.state, self.attempt
        self.decide = _left  # (its door's decision holds the ask that holds this wait)
        if waiter is None:
            self.waited_ms = 0
            return
        self.waiter = None
        state.line.leave(waiter)
        attempt.tenant.waiting -= 1
        waited_s = state.now() - waiter.since
        self.waited_ms = round(waited_s * 1000)
        state.metrics.door_wait.observe(attempt.lane, waited_s)
        state.metrics.door_waits[(attempt.lane, _wait_outcome(decision))] += 1

    def give_up(self) -> None:
        """Its client left, or cancelled, while it waited: its place in the line and in
        admission's line are given up, and a slot held for it is offered to the others."""
        if self.waiter is not None:
            self.leave(None)
            self.state.admission.forget(self.attempt)
            self.state.offer()


def _left() -> str | None:
    return None


def _wait_outcome(decision: Decision | None) -> str:
    """How a wait in line ended, for ``governor_waits_total``."""
    if decision is None:
        return "left"
    if isinstance(decision, Admitted):
        return "admitted"
    if isinstance(decision, Yielded):
        return "refused" if decision.error_code == ErrorCode.BUSY else "unavailable"
    return "rejected"


@dataclass(frozen=True, slots=True)
class JobAdmitted:
    """An admitted job, for its listener to start (:func:`~governor.execution.start`); what a
    sans-IO session hands out as an event."""

    job: str  # the client's name for it, for the logs
    ttl_ms: int  # its deadline from admission: 0, none
    ticket: Ticket
    attempt: Attempt
    waited_s: float | None  # from its first refusal to its admission; None: never refused


# The conversation --------------------------------------------------------------------------


class Keeper(Protocol):
    """A door's keeper of refused jobs for their retries, by the door's own key for a job (TCP:
    its id on the connection, its payload held or not; HTTP: its tenant and body's digest, a
    place in line): how a retry is recognised is the one part of a refusal that is the door's."""

    def take(self, key: Hashable) -> Attempt | None:
        """The attempt kept for ``key``'s retry, no longer kept; None: none is."""
        ...

    def keep(self, key: Hashable, attempt: Attempt, refused: Yielded) -> bool:
        """Keep a refused job for its retry; False: it cannot be (it gave up)."""
        ...


@dataclass(frozen=True, slots=True)
class Unauthorized:
    """A job without a valid key (or client certificate): refused, its failure counted;
    ``closes``: the connection has failed ``max_auth_failures`` keys, this is its last answer."""

    closes: bool
    failures: int


class Door(Protocol):
    """What a conversation asks of its door's connection."""

    def woken(self) -> None:
        """Outcomes were decided between its reads (:meth:`Conversation.next_event`)."""
        ...


class _Left:
    """The door of a conversation whose client has left: nothing is decided for it any more."""

    def woken(self) -> None:
        pass


LEFT = _Left()


class Conversation:
    """One connection's conversation with the intake, the same on both doors and sans-IO: the
    door feeds it what happens and answers, in its own words, what comes back. It owns the
    order of the steps and every rule both doors share:

    1. :meth:`asked`: a job's key, checked at its turn (:class:`Credentials`); a request whose
       key must wait is held by its door until :meth:`turn_came` says it goes on.
    2. :meth:`tenant`: whom the job runs for (:class:`Unauthorized` otherwise); :meth:`open`:
       its attempt, the one the door's :class:`Keeper` kept for its retry (one another tenant
       left gave up), else a new one: the :class:`Ask`, which the runner prepares from the
       spec the door's codec read (:meth:`Ask.prepare`, :meth:`Ask.prepare_fields`).
    3. :meth:`submit`: it lines up if it may wait, and admission decides (:meth:`decide`
       again at its hint): an :data:`Outcome`. Every refusal is kept
       for its retry by the keeper, or counted as given up: one rule, whatever refused it
       (docs/PROTOCOL.md, "Places in line kept for a retry").
    4. Between the door's reads the line offers a waiting job a freed slot: it is decided
       here (:meth:`offered`, the line's call, never the door's), and the outcome waits in
       :meth:`next_event`, its door told (:meth:`Door.woken`).
    5. :meth:`left`: the client left: its key's turn and its jobs in line are given up.
    """

    def __init__(
        self, state: ServerState, credentials: Credentials, keeper: Keeper, door: Door
    ) -> None:
        self.state = state
        self.credentials = credentials  # (the connection's, from its start)
        self.keeper = keeper
        self.door = door
        # Decided between reads (none until one is: an idle connection holds no list).
        self.events: list[tuple[Ask, Outcome]] | None = None
        self.closed = False

    # 1. The key

    def asked(self, key: str | None) -> KeyStep:
        """A job asked with ``key`` (None: none shown): whether it goes on now, waits for its
        key's turn (until :meth:`turn_came`) or is refused for now."""
        if key is None:
            return KeyStep.GO
        return self.credentials.step(key)

    def turn_came(self, now: float) -> bool:
        """The request that waited for its key's turn goes on: its turn has come, its key
        checked (False: none waits, or not yet)."""
        return self.credentials.turn_came(now)

    # 2. Whom for, and which attempt

    def tenant(self, key: str | None) -> Tenant | Unauthorized:
        """Whom a job with ``key`` runs for (:meth:`Credentials.tenant`)."""
        credentials = self.credentials
        tenant = credentials.tenant(key)
        if tenant is None:
            return Unauthorized(credentials.spent, credentials.failures)
        return tenant

    def open(self, tenant: Tenant, key: Hashable) -> Ask:
        """The ask of a job the door names ``key``, for ``tenant``: the attempt kept for its
        retry, if any (one of another tenant's gave up), else a new one."""
        attempt = self.keeper.take(key)
        if attempt is not None and attempt.tenant is not tenant:
            gave_up(self.state, attempt)
            attempt = None
        return Ask(self.state, Attempt(tenant, None) if attempt is None else attempt, key)

    # 3. The decision

    def submit(self, ask: Ask, asked_ms: int | None, *, may_wait: bool) -> Outcome:
        """A prepared ask decided: in line for its turn if ``may_wait`` (within ``asked_ms``,
        else ``max_wait``), else answered at once."""
        if may_wait:
            ask.line_up(asked_ms, lambda: self.offered(ask))
        else:
            ask.leave_line()
        return self.decide(ask)

    def decide(self, ask: Ask) -> Outcome:
        """Admission's decision now, a refusal kept for its retry or given up."""
        outcome = ask.decide()
        if isinstance(outcome, Yielded):
            self.refused(ask, outcome)
        return outcome

    def refused(self, ask: Ask, decision: Yielded) -> bool:
        """The one keep-or-give-up rule: a refused job is kept for its retry by the door's
        keeper, whatever refused it; one that cannot be kept gave up."""
        if self.keeper.keep(ask.key, ask.attempt, decision):
            return True
        gave_up(self.state, ask.attempt)
        return False

    # 4. Between reads

    def offered(self, ask: Ask) -> str | None:
        """The line offers a waiting ask a slot: decided now (unless the connection is gone or
        a job it admitted is not yet taken by the door: its turn comes again), its outcome left
        for the door (:meth:`next_event`) unless it waits on. The need code of a refusal
        (None: admitted, or not decided)."""
        events = self.events
        if self.closed or (events and any(isinstance(o, Admitted) for _, o in events)):
            return None
        outcome = self.decide(ask)
        if not isinstance(outcome, Waiting):
            if events is None:
                events = self.events = []
            events.append((ask, outcome))
        self.door.woken()
        return None if isinstance(outcome, Admitted) else outcome.need_code

    def next_event(self) -> tuple[Ask, Outcome] | None:
        """An outcome decided between the door's reads, for it to answer; None: none."""
        events = self.events
        return events.pop(0) if events else None

    # 5. The end

    def left(self) -> None:
        """The client left: its key's turn given back; an admitted job the door did not take
        gives its ticket back (the door gives up its asks in line, and what its keeper kept)."""
        self.closed = True
        self.credentials.turn_unused()
        for _, outcome in self.events or ():
            unclaimed(outcome)
        self.events = None
        self.door = LEFT  # (the door and its conversation no longer hold each other)


def unclaimed(outcome: Outcome) -> None:
    """An outcome decided between reads whose job its door no longer has (its client left, or
    replaced it): an admission gives its ticket back; any other needs no answer."""
    if isinstance(outcome, Admitted):
        outcome.ticket.release("client_gone")
