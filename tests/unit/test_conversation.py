"""One connection's conversation with the intake (:class:`governor.intake.Conversation`), as
h11 is tested: driven by events on the test clock (a job asks with its key, its spec is ready,
time passes, a slot frees, the client leaves), no socket, no event loop, no door. Each outcome
on its own, then a state machine over both kinds of keeper a door brings (the TCP door's, by
job id; the front door's places, by tenant and body): whatever happens, every job turned away
is counted once and ends served, kept, or given up; the slots and the line come back empty."""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from governor import intake
from governor.core.admission import Admitted, Attempt, Ticket, Yielded
from governor.core.tenants import Tenant, TenantConfig
from governor.intake import Ask, Conversation, Credentials, KeyStep, Unauthorized, Waiting
from governor.listeners.jobs import Retries
from governor.listeners.openai_api import KeptPlaces
from governor.state import ServerState
from protocol.codes import NeedCode
from tests.clock import FakeClock

from .test_ask import HINT_S, anyone, keyed_state, make_state


class Door:
    """A door that counts the times it was told of outcomes decided between its reads."""

    def __init__(self) -> None:
        self.woke = 0

    def woken(self) -> None:
        self.woke += 1


class Kept:
    """A keeper that keeps every refused job by its key, or none (``room`` 0)."""

    def __init__(self, room: int = 1_000) -> None:
        self.room = room
        self.kept: dict[Hashable, Attempt] = {}
        self.refusals: list[str] = []

    def take(self, key: Hashable) -> Attempt | None:
        return self.kept.pop(key, None)

    def keep(self, key: Hashable, attempt: Attempt, refused: Yielded) -> bool:
        self.refusals.append(refused.need_code)
        if len(self.kept) >= self.room:
            return False
        self.kept[key] = attempt
        return True


def prepared(conversation: Conversation, key: Hashable, tenant: Tenant | None = None) -> Ask:
    ask = conversation.open(tenant or anyone(conversation.state), key)
    ask.prepare(str(key), b"hello", "text/plain")
    return ask


def unserved(state: ServerState) -> tuple[int, int]:
    """Jobs turned away, and those of them that gave up."""
    jobs, _, gave_up = state.admission.unserved.totals()
    return jobs, gave_up


def test_a_job_runs_while_a_slot_is_free(clock: FakeClock) -> None:
    state = make_state(clock)
    conversation = Conversation(state, Credentials(state, 1), Kept(), Door())
    assert conversation.asked(None) is KeyStep.GO
    ask = prepared(conversation, "J_1")
    outcome = conversation.submit(ask, None, may_wait=False)
    assert isinstance(outcome, Admitted)
    assert (state.inflight, ask.key, ask.first_refusal) == (1, "J_1", None)
    outcome.ticket.release("done")
    assert state.inflight == 0


@pytest.mark.parametrize("kind", ["busy", "draining"])
def test_a_job_retried_through_any_refusal_is_one_unserved_job(clock: FakeClock, kind: str) -> None:
    state = make_state(clock)
    keeper = Kept()
    conversation = Conversation(state, Credentials(state, 1), keeper, Door())
    running = conversation.submit(prepared(conversation, "other"), None, may_wait=False)
    assert isinstance(running, Admitted)
    if kind == "draining":
        state.ledger.draining = True
    first = None
    for retry in range(5):
        clock.now += 0.25
        ask = prepared(conversation, "J_1")
        outcome = conversation.submit(ask, None, may_wait=False)
        assert isinstance(outcome, Yielded)
        assert ask.key in keeper.kept  # (kept for the retry whatever refused it)
        first = first if first is not None else ask.first_refusal
        assert ask.first_refusal == first  # (its first try's, across the retries)
        assert ask.attempt.refusals == retry + 1
    assert set(keeper.refusals) == {NeedCode.DRAINING if kind == "draining" else "server_busy"}
    assert unserved(state) == (1, 0)


def test_a_refusal_that_cannot_be_kept_gave_up_once(clock: FakeClock) -> None:
    state = make_state(clock)
    conversation = Conversation(state, Credentials(state, 1), Kept(room=0), Door())
    running = conversation.submit(prepared(conversation, "other"), None, may_wait=False)
    assert isinstance(running, Admitted)
    for _ in range(3):
        assert isinstance(
            conversation.submit(prepared(conversation, "J"), None, may_wait=False), Yielded
        )
    assert unserved(state) == (3, 3)  # (nothing kept: each retry a new job, each given up)


def test_another_tenants_kept_attempt_gave_up_and_is_not_taken(clock: FakeClock) -> None:
    state = make_state(clock)
    keeper = Kept()
    conversation = Conversation(state, Credentials(state, 1), keeper, Door())
    running = conversation.submit(prepared(conversation, "other"), None, may_wait=False)
    assert isinstance(running, Admitted)
    assert isinstance(
        conversation.submit(prepared(conversation, "J"), None, may_wait=False), Yielded
    )
    kept = keeper.kept["J"]
    stranger = Tenant(TenantConfig(name="stranger", key_sha256="0" * 64), clock.now)
    ask = conversation.open(stranger, "J")
    assert ask.attempt is not kept
    assert ask.attempt.tenant is stranger
    assert unserved(state) == (1, 1)


def test_a_waiting_job_is_decided_when_a_slot_frees_and_waits_for_the_door(
    clock: FakeClock,
) -> None:
    state = make_state(clock, max_wait=5.0)
    door = Door()
    conversation = Conversation(state, Credentials(state, 1), Kept(), door)
    running = conversation.submit(prepared(conversation, "first"), None, may_wait=True)
    assert isinstance(running, Admitted)
    ask = prepared(conversation, "second")
    waiting = conversation.submit(ask, 5000, may_wait=True)
    assert isinstance(waiting, Waiting)
    assert waiting.until == pytest.approx(clock.now + HINT_S, abs=0.2)
    behind = prepared(conversation, "third")
    assert isinstance(conversation.submit(behind, 5000, may_wait=True), Waiting)
    assert conversation.next_event() is None
    assert door.woke == 0
    clock.now += 0.5
    running.ticket.release("done")  # (the slot frees: the line offers it)
    state.offer()
    assert door.woke == 1
    event = conversation.next_event()
    assert event is not None
    assert event[0] is ask
    assert isinstance(event[1], Admitted)
    assert not ask.in_line
    assert behind.in_line  # (refused at the offer: it waits on, no event)
    # While an admitted job waits for the door, the conversation decides no other.
    conversation.events = [event]
    assert conversation.offered(behind) is None
    assert behind.in_line
    conversation.left()  # (the client leaves before the door started it)
    assert state.inflight == 0
    assert not conversation.events
    assert conversation.offered(behind) is None


def test_a_key_waits_for_its_turn_and_a_spent_connection_closes(clock: FakeClock) -> None:
    state = keyed_state(clock, auth_grace=2.0, max_auth_failures=2)
    steps = []
    for i in range(30):
        conversation = Conversation(state, Credentials(state, i), Kept(), Door())
        conversation.credentials.source = "10.0.0.1"
        step = conversation.asked(f"wrong-{i}")
        steps.append(step)
        if step is KeyStep.LATER:
            at = conversation.credentials.key_at
            assert not conversation.turn_came(at - 0.01)
            assert conversation.turn_came(at)
        if step is not KeyStep.FAR:
            first = conversation.tenant(f"wrong-{i}")
            assert first == Unauthorized(closes=False, failures=1)
            assert conversation.tenant(f"wrong-{i}") == Unauthorized(closes=True, failures=2)
    assert steps[0] is KeyStep.GO
    assert KeyStep.LATER in steps


# Any sequence of events, over both kinds of keeper ---------------------------------------------


class ById:
    """The TCP door's keeping of a job turned away without its payload: by its id, in its
    connection's :class:`~governor.listeners.jobs.Retries` (its place in line given up with
    the payload, the job recognised when it comes back)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.retries = Retries(state)

    def take(self, key: Hashable) -> Attempt | None:
        assert isinstance(key, str)
        return self.retries.turned_away.pop(key, None)

    def keep(self, key: Hashable, attempt: Attempt, refused: Yielded) -> bool:
        assert isinstance(key, str)
        intake.forget(self.state, attempt)  # (its payload dropped)
        self.retries.turn_away(key, attempt)
        return True

    def kept(self) -> int:
        return len(self.retries.turned_away)

    def end(self) -> None:
        self.retries.client_gone()


class ByPlace:
    """The front door's: a place in line, by tenant and body, kept until its hint and a grace
    have passed (two at most: past that, a refused request gives up)."""

    def __init__(self, state: ServerState) -> None:
        forget = functools.partial(intake.gave_up, state)
        self.places = KeptPlaces(state.now, forget, grace_s=1.0, limit=2)

    def take(self, key: Hashable) -> Attempt | None:
        return self.places.take(("anyone", str(key).encode()))

    def keep(self, key: Hashable, attempt: Attempt, refused: Yielded) -> bool:
        return self.places.keep(("anyone", str(key).encode()), attempt, refused.retry_hint_ms)

    def kept(self) -> int:
        self.places.expire(self.places.clock())
        return self.places.count

    def end(self) -> None:
        self.places.expire(math.inf)


class Talks(RuleBasedStateMachine):
    """Clients ask for six jobs (by key, again and again) on two slots, waiting or not; time
    passes; the running jobs end; waiting clients leave. After every event: the slots hold the
    admitted jobs not ended; each job asked again after a refusal is the same job (turned away
    once); at the end, with every client gone, each job turned away was served or gave up."""

    CAP = 2

    def keeper_for(self, state: ServerState) -> ById | ByPlace:
        return ById(state)

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.state = make_state(self.clock, cap=self.CAP, max_wait=3.0)
        self.keeper = self.keeper_for(self.state)
        self.conversation = Conversation(self.state, Credentials(self.state, 1), self.keeper, self)
        self.running: dict[int, Ticket] = {}
        self.waiting: dict[int, Ask] = {}
        self.refused: set[int] = set()  # asked again: the same job, until served or given up
        self.served_after_refusal = 0

    def _answered(self, job: int, ask: Ask, outcome: intake.Outcome) -> None:
        self.waiting.pop(job, None)
        if isinstance(outcome, Waiting):
            self.waiting[job] = ask
        elif isinstance(outcome, Admitted):
            self.running[job] = outcome.ticket
            self.refused.discard(job)
            if ask.attempt.turned_away is not None:  # (this job was turned away before)
                self.served_after_refusal += 1
        elif isinstance(outcome, Yielded):
            self.refused.add(job)

    def woken(self) -> None:
        while (event := self.conversation.next_event()) is not None:
            ask, outcome = event
            assert isinstance(ask.key, str)
            self._answered(int(ask.key), ask, outcome)

    @rule(job=st.integers(0, 5), wait_ms=st.none() | st.integers(0, 4000))
    def ask(self, job: int, wait_ms: int | None) -> None:
        if job in self.running or job in self.waiting:
            return
        ask = prepared(self.conversation, str(job))
        outcome = self.conversation.submit(ask, wait_ms, may_wait=wait_ms is not None)
        self._answered(job, ask, outcome)

    @rule(seconds=st.floats(0.0, 2.0))
    def tick(self, seconds: float) -> None:
        self.clock.now += seconds
        for job, ask in list(self.waiting.items()):
            if ask.decide_at <= self.clock.now and self.waiting.get(job) is ask:
                self._answered(job, ask, self.conversation.decide(ask))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        job = data.draw(st.sampled_from(sorted(self.running)))
        self.running.pop(job).release("done")

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        job = data.draw(st.sampled_from(sorted(self.waiting)))
        ask = self.waiting.pop(job)
        ask.give_up()
        intake.gave_up(self.state, ask.attempt)
        self.refused.discard(job)

    @invariant()
    def holds(self) -> None:
        assert self.state.inflight == len(self.running)
        assert len(self.state.line) == len(self.waiting)
        assert all(ask.in_line for ask in self.waiting.values())
        jobs, gave_up = unserved(self.state)
        # Every job turned away: waiting on a refusal, kept for its retry, served since, or gone.
        assert jobs >= gave_up + self.served_after_refusal

    def teardown(self) -> None:
        self.conversation.left()  # (no offer decided from now on)
        for ask in list(self.waiting.values()):
            ask.give_up()
            intake.gave_up(self.state, ask.attempt)
        for ticket in list(self.running.values()):
            ticket.release("done")
        self.keeper.end()
        jobs, gave_up = unserved(self.state)
        assert jobs == gave_up + self.served_after_refusal  # (none lost, none twice)
        assert self.state.inflight == 0
        assert len(self.state.line) == 0


class TalksByPlace(Talks):
    def keeper_for(self, state: ServerState) -> ById | ByPlace:
        return ByPlace(state)


@pytest.mark.parametrize("machine", [Talks, TalksByPlace])
def test_any_conversation_over_either_keeper(machine: type[Talks]) -> None:
    machine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
    machine.TestCase().runTest()
