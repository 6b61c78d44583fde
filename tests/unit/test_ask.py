"""One job's conversation with admission (:class:`governor.intake.Ask`), as both doors have it:
driven with events on the test clock (a job asks, a slot frees, time passes, a client leaves,
a drain begins), no socket, no event loop, no door. Each outcome is checked on its own, then a
state machine checks for any sequence of those events the rules both doors rely on."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from governor.config import Config
from governor.core.admission import (
    Admission,
    Admitted,
    Attempt,
    Budget,
    Pool,
    Rejected,
    Reservation,
    Ticket,
    Yielded,
)
from governor.core.ledger import Refusal, SlotLedger
from governor.core.tenants import Tenant, Tenants
from governor.intake import Ask, Credentials, KeyStep, Waiting
from governor.runners import Job, StubRunner
from governor.server import build_breaker
from governor.state import ServerState
from protocol.codes import ErrorCode, NeedCode
from tests.clock import FakeClock

HINT_S = 1.0  # the ledger's expected service time: a busy refusal's hint is about this


def make_state(clock: FakeClock, cap: int = 1, **settings: Any) -> ServerState:
    with pytest.raises(RuntimeError):  # (no event loop runs these tests)
        asyncio.get_running_loop()
    config = Config(max_inflight=cap, **settings)
    ledger = SlotLedger(cap, expected_service_s=HINT_S, clock=clock)
    pool = Pool("primary", StubRunner(0.0), ledger, build_breaker(config, ledger, "primary"))
    return ServerState(config, Admission(pool, Tenants((), clock)))


def keyed_state(clock: FakeClock, **settings: Any) -> ServerState:
    """One slot, and one tenant declared (every key but its own fails)."""
    from governor.core.tenants import TenantConfig

    config = Config(**settings)
    ledger = SlotLedger(1, clock=clock)
    pool = Pool("primary", StubRunner(0.0), ledger, build_breaker(config, ledger, "primary"))
    tenants = Tenants((TenantConfig(name="t", key_sha256="0" * 64),), clock)
    return ServerState(config, Admission(pool, tenants))


def anyone(state: ServerState) -> Tenant:
    """The tenant of every job when none is declared."""
    tenant = state.tenants.find(None)
    assert tenant is not None
    return tenant


def asking(state: ServerState, job: str, wait_ms: int | None = None, spec: bytes = b"") -> Ask:
    """A job's ask, prepared (a JSON spec if ``spec``, else a plain prompt); in line for its
    turn within ``wait_ms`` if given."""
    ask = Ask(state, Attempt(anyone(state), None))
    if spec:
        ask.prepare(job, spec, "application/json")
    else:
        ask.prepare(job, b"hello", "text/plain")
    if wait_ms is not None:
        ask.line_up(wait_ms, lambda: None)
    return ask


def test_a_job_is_admitted_while_a_slot_is_free_and_never_waits(clock: FakeClock) -> None:
    state = make_state(clock)
    ask = asking(state, "J_1", wait_ms=5000)
    outcome = ask.decide()
    assert isinstance(outcome, Admitted)
    assert ask.first_refusal is None
    assert not ask.in_line
    assert ask.decide_at == math.inf
    assert ask.wait is not None
    assert ask.wait.waited_ms == 0
    clock.now += 0.5
    job = ask.admitted(outcome, job="J_1", ttl_ms=0, reservation=None)
    assert (job.job, job.ticket, job.waited_s) == ("J_1", outcome.ticket, None)
    assert state.inflight == 1


def test_a_busy_job_that_may_wait_waits_then_runs_when_the_line_offers_the_freed_slot(
    clock: FakeClock,
) -> None:
    state = make_state(clock)
    first = asking(state, "J_1").decide()
    assert isinstance(first, Admitted)
    outcomes: list[object] = []
    ask = asking(state, "J_2")
    ask.line_up(5000, lambda: record(outcomes, ask.decide()))
    waiting = ask.decide()
    assert isinstance(waiting, Waiting)
    assert waiting.need_code == NeedCode.SERVER_BUSY
    assert ask.decide_at == waiting.until > clock.now
    assert ask.in_line
    assert len(state.line) == 1
    assert ask.first_refusal == clock.now
    clock.now += 0.25
    first.ticket.release("done")
    state.offer()
    (admitted,) = outcomes
    assert isinstance(admitted, Admitted)
    assert not ask.in_line
    assert len(state.line) == 0
    assert ask.decide_at == math.inf
    job = ask.admitted(admitted, job="J_2", ttl_ms=0, reservation=None)
    assert job.waited_s == pytest.approx(0.25)
    assert ask.wait is not None
    assert ask.wait.waited_ms == 250


class RefillingStub(StubRunner):
    """A stub that hears, as the batched llama runner does, whether jobs wait at the doors."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.told: list[bool] = []

    def waiting(self, jobs: bool) -> None:
        self.told.append(jobs)

    def offered(self, job: Job) -> None:
        raise AssertionError("no job ends here")


def test_a_refilling_runner_is_told_while_jobs_wait_for_a_slot(clock: FakeClock) -> None:
    """The runner hears when the first job lines up and when the last leaves the line (here,
    admitted to the slot that freed), and nothing in between."""
    runner = RefillingStub()
    ledger = SlotLedger(1, expected_service_s=HINT_S, clock=clock)
    config = Config(max_inflight=1)
    pool = Pool("primary", runner, ledger, build_breaker(config, ledger, "primary"))
    state = ServerState(config, Admission(pool, Tenants((), clock)))
    first = asking(state, "J_1").decide()
    assert isinstance(first, Admitted)
    asks = [asking(state, f"J_{i}", wait_ms=5000) for i in (2, 3)]
    for ask in asks:
        assert isinstance(ask.decide(), Waiting)
    assert runner.told == [True]
    first.ticket.release("done")
    outcome = asks[0].decide()
    assert isinstance(outcome, Admitted)
    assert runner.told == [True]  # (J_3 still waits)
    asks[1].leave_line()  # (its client left)
    assert runner.told == [True, False]


def record(outcomes: list[object], outcome: object) -> str | None:
    outcomes.append(outcome)
    return None if isinstance(outcome, Admitted) else getattr(outcome, "need_code", None)


def test_a_busy_job_yields_at_once_without_a_wait_or_past_its_budget(clock: FakeClock) -> None:
    state = make_state(clock)
    assert isinstance(asking(state, "J_1").decide(), Admitted)
    for wait_ms in (None, 0, int(HINT_S * 1000) // 2):
        ask = asking(state, "J_2", wait_ms)
        outcome = ask.decide()
        assert isinstance(outcome, Yielded), wait_ms
        assert outcome.error_code == ErrorCode.BUSY
        assert not ask.in_line
        assert ask.decide_at == math.inf
        assert ask.first_refusal == clock.now
        state.admission.forget(ask.attempt)
    assert len(state.line) == 0


def test_a_bad_spec_is_rejected_before_any_slot_is_looked_at(clock: FakeClock) -> None:
    state = make_state(clock)
    ask = asking(state, "J_1", wait_ms=5000, spec=b'{"prompt": 5}')
    outcome = ask.decide()
    assert isinstance(outcome, Rejected)
    assert outcome.error is not None
    assert outcome.error.need_code == NeedCode.SPEC_INVALID
    assert state.inflight == 0
    assert ask.first_refusal is None
    assert not ask.in_line


def test_a_drain_answers_a_waiting_job_at_its_next_decision(clock: FakeClock) -> None:
    state = make_state(clock)
    assert isinstance(asking(state, "J_1").decide(), Admitted)
    ask = asking(state, "J_2", 5000)
    assert isinstance(ask.decide(), Waiting)
    state.ledger.draining = True
    outcome = ask.decide()
    assert isinstance(outcome, Yielded)
    assert outcome.need_code == NeedCode.DRAINING
    assert not ask.in_line
    assert len(state.line) == 0
    assert state.metrics.door_waits[("-", "unavailable")] == 1


def test_a_job_taken_back_by_the_fleet_is_refused_as_if_here(clock: FakeClock) -> None:
    state = make_state(clock)
    ask = asking(state, "J_1")
    outcome = ask.decide()
    assert isinstance(outcome, Admitted)
    reservation = Reservation(Budget(100), Budget(100), 10)
    ask.admitted(outcome, job="J_1", ttl_ms=0, reservation=reservation)
    clock.now += 0.1
    refused, kept = ask.take_back(
        outcome.ticket, Refusal(NeedCode.FLEET_BUSY, 700), keep_payload=True
    )
    assert (refused.need_code, refused.retry_hint_ms) == (NeedCode.FLEET_BUSY, 700)
    assert kept is reservation
    assert outcome.ticket.reservation is None
    assert state.inflight == 0
    assert ask.first_refusal == clock.now


def test_a_key_goes_on_waits_for_its_turn_or_is_refused_for_now(clock: FakeClock) -> None:
    """With tenants declared, a source's budget of key failures spent: the next new key waits
    for its turn (:attr:`KeyStep.LATER`, at ``key_at``), and past ``auth_grace`` of turns
    it is refused, unchecked (:attr:`KeyStep.FAR`)."""
    state = keyed_state(clock, auth_grace=2.0)
    steps = []
    for i in range(40):
        credentials = Credentials(state, i)
        credentials.source = "10.0.0.1"
        step = credentials.step(f"wrong-{i}")
        steps.append(step)
        if step is KeyStep.LATER:
            assert credentials.waiting
            assert clock.now < credentials.key_at <= clock.now + 2.0
            if i % 2:  # its client leaves first: the turn is given back
                credentials.turn_unused()
                assert not credentials.waiting
            else:  # the request goes on at its turn, its key checked then (and failed)
                assert not credentials.turn_came(clock.now)
                assert credentials.turn_came(credentials.key_at)
                assert credentials.tenant(f"wrong-{i}") is None
            assert credentials.key_at == math.inf
        else:
            assert not credentials.waiting
            assert credentials.key_at == math.inf
    assert steps[0] is KeyStep.GO
    assert KeyStep.LATER in steps or KeyStep.FAR in steps  # the budget ran out
    assert steps.index(KeyStep.GO) < min(
        steps.index(s) for s in (KeyStep.LATER, KeyStep.FAR) if s in steps
    )


# Any sequence of events ----------------------------------------------------------------------


class Asks(RuleBasedStateMachine):
    """Jobs ask on two slots, may wait (or not) within budgets, run, end, leave while they
    wait, are decided again at their hints; a drain may begin. After every event: the line
    holds exactly the asks that wait, each due at its last ``Waiting``; no job waits past its
    budget; the slots hold exactly the admitted jobs not ended; a job's first refusal never
    moves; and at the end everything is given back."""

    CAP = 2

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.state = make_state(self.clock, cap=self.CAP, max_wait=4.0)
        self.asks: list[Ask] = []
        self.last: dict[int, object] = {}  # ask index -> its last outcome
        self.first: dict[int, float] = {}  # its first refusal, once refused
        self.running: dict[int, Ticket] = {}
        self.left: set[int] = set()

    def _decided(self, i: int) -> str | None:
        ask = self.asks[i]
        outcome = ask.decide()
        self.last[i] = outcome
        if isinstance(outcome, Admitted):
            self.running[i] = outcome.ticket
            ask.admitted(outcome, job=f"J_{i}", ttl_ms=0, reservation=None)
            return None
        if isinstance(outcome, Yielded):
            self.state.admission.forget(ask.attempt)  # (the door keeps or forgets its place)
        if isinstance(outcome, Waiting | Yielded | Rejected):
            first = ask.first_refusal
            assert first is not None
            assert self.first.setdefault(i, first) == first, "its first refusal moved"
            return outcome.need_code
        raise AssertionError(outcome)

    @rule(wait_ms=st.none() | st.integers(0, 6000))
    def ask(self, wait_ms: int | None) -> None:
        i = len(self.asks)
        ask = asking(self.state, f"J_{i}")
        self.asks.append(ask)
        if wait_ms is not None:
            ask.line_up(wait_ms, lambda: self._decided(i))
        self._decided(i)
        if wait_ms is None:
            assert not isinstance(self.last[i], Waiting), "it waits without having asked to"

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(sorted(self.running)))
        self.running.pop(i).release("done")
        self.state.offer()

    @rule(seconds=st.floats(0.0, 3.0))
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds
        for i, ask in enumerate(self.asks):
            if ask.decide_at <= self.clock.now:
                self._decided(i)

    @precondition(lambda self: any(a.in_line for a in self.asks))
    @rule(data=st.data())
    def leaves(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from([i for i, a in enumerate(self.asks) if a.in_line]))
        self.asks[i].give_up()
        self.left.add(i)

    @precondition(lambda self: len(self.asks) >= 4 and not self.state.ledger.draining)
    @rule()
    def drain(self) -> None:
        self.state.ledger.draining = True
        self.state.offer()

    @invariant()
    def the_line_holds_the_asks_that_wait(self) -> None:
        in_line = [i for i, a in enumerate(self.asks) if a.in_line]
        assert len(self.state.line) == len(in_line)
        assert anyone(self.state).waiting == len(in_line)
        for i, ask in enumerate(self.asks):
            last = self.last.get(i)
            waits = isinstance(last, Waiting) and i not in self.left
            assert ask.in_line == waits, (i, last)
            if waits:
                assert isinstance(last, Waiting)
                assert ask.decide_at == last.until
                wait = ask.wait
                assert wait is not None
                # Never told to wait for a turn past its budget, counted from its arrival.
                assert last.until - wait.arrived <= wait.budget_s + 1e-9
            else:
                assert ask.decide_at == math.inf

    @invariant()
    def the_slots_hold_the_jobs_running(self) -> None:
        assert self.state.inflight == len(self.running) <= self.CAP
        if self.state.ledger.draining:
            assert not any(a.in_line for a in self.asks)

    def teardown(self) -> None:
        for ask in self.asks:
            ask.give_up()
        for ticket in self.running.values():
            ticket.release("done")
        assert len(self.state.line) == 0
        assert self.state.inflight == 0
        assert anyone(self.state).waiting == 0


TestAsks = Asks.TestCase
