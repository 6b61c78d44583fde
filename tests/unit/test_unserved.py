"""Unserved demand (:mod:`governor.core.unserved`): each job turned away counts once, however
often its client retries, and once more if it is never served. Driven as both doors drive
admission (an :class:`~governor.intake.Ask` kept across its retries), on the test clock."""

from __future__ import annotations

import json

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from governor import intake
from governor.core.admission import Admitted, Rejected, Ticket, Yielded, asked_tokens
from governor.core.ledger import Refusal
from governor.intake import Ask, Waiting
from governor.state import ServerState
from protocol.codes import NeedCode
from tests.clock import FakeClock
from tests.unit.test_ask import asking, make_state


def spec(max_new_tokens: int) -> bytes:
    return json.dumps({"prompt": "hello there", "max_new_tokens": max_new_tokens}).encode()


def totals(state: ServerState) -> tuple[int, int, int]:
    return state.admission.unserved.totals()


def test_a_job_refused_again_and_again_counts_once_and_its_tokens_once(
    clock: FakeClock,
) -> None:
    state = make_state(clock)
    running = asking(state, "J_0", spec=spec(8)).decide()
    assert isinstance(running, Admitted)
    ask = asking(state, "J_1", spec=spec(40))
    for _ in range(5):  # the client retries, on its hint, with the same job
        assert isinstance(ask.decide(), Yielded)
        clock.now += 0.3
    asked = asked_tokens(ask.attempt.job)
    assert asked >= 40
    assert totals(state) == (1, asked, 0)
    assert sum(state.admission.refusals.values()) == 5
    running.ticket.release("done")
    assert isinstance(ask.decide(), Admitted)  # served at last: it did not give up
    intake.gave_up(state, ask.attempt)  # (a door that says so late changes nothing)
    assert totals(state) == (1, asked, 0)


def test_a_job_that_never_comes_back_gave_up_once(clock: FakeClock) -> None:
    state = make_state(clock)
    assert isinstance(asking(state, "J_0").decide(), Admitted)
    ask = asking(state, "J_1", spec=spec(10))
    assert isinstance(ask.decide(), Yielded)
    intake.gave_up(state, ask.attempt)
    intake.gave_up(state, ask.attempt)
    never_refused = asking(state, "J_2")
    intake.gave_up(state, never_refused.attempt)  # (not turned away: not unserved demand)
    jobs, _, gave_up = totals(state)
    assert (jobs, gave_up) == (1, 1)
    assert state.admission.unserved.jobs == {("-", "default"): 1}


def test_a_job_the_fleet_took_back_after_a_refusal_is_still_one_job(clock: FakeClock) -> None:
    state = make_state(clock)
    running = asking(state, "J_0").decide()
    assert isinstance(running, Admitted)
    ask = asking(state, "J_1")
    assert isinstance(ask.decide(), Yielded)
    running.ticket.release("done")
    admitted = ask.decide()
    assert isinstance(admitted, Admitted)
    ask.admitted(admitted, job="J_1", ttl_ms=0, reservation=None)
    ask.take_back(admitted.ticket, Refusal(NeedCode.FLEET_BUSY, 500), keep_payload=False)
    assert totals(state)[0] == 1
    intake.gave_up(state, ask.attempt)  # turned away again, and this time it left
    assert totals(state)[::2] == (1, 1)


class Demand(RuleBasedStateMachine):
    """Jobs ask on two slots; each is retried, waits in line or not, runs, ends, leaves (its
    client gone, or its kept place expired), or is taken back by the fleet. After every
    event: the distinct jobs ever refused are counted once each with the tokens they asked
    for, the refusals once each, and the jobs turned away and never served once each when
    they left."""

    CAP = 2

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.state = make_state(self.clock, cap=self.CAP, max_wait=2.0)
        self.asks: list[Ask] = []
        self.running: dict[int, Ticket] = {}
        self.refused: set[int] = set()  # jobs ever refused (a yield, or a wait in line)
        self.unserved: set[int] = set()  # refused, and neither admitted nor gone since
        self.gone: set[int] = set()
        self.gave_up: set[int] = set()
        self.yields = 0

    def _decided(self, i: int) -> str | None:
        ask = self.asks[i]
        outcome = ask.decide()
        if isinstance(outcome, Admitted):
            self.running[i] = outcome.ticket
            self.unserved.discard(i)
            ask.admitted(outcome, job=f"J_{i}", ttl_ms=0, reservation=None)
            return None
        if isinstance(outcome, Rejected):
            return outcome.need_code
        assert isinstance(outcome, Yielded | Waiting)  # (a wait in line is a yield unanswered)
        self.refused.add(i)
        self.unserved.add(i)
        self.yields += 1
        return outcome.need_code

    def _live(self) -> list[int]:
        return [i for i in range(len(self.asks)) if i not in self.gone and i not in self.running]

    @rule(wait_ms=st.none() | st.integers(0, 3000), tokens=st.integers(1, 64))
    def ask(self, wait_ms: int | None, tokens: int) -> None:
        i = len(self.asks)
        self.asks.append(asking(self.state, f"J_{i}", spec=spec(tokens)))
        if wait_ms is not None:
            self.asks[i].line_up(wait_ms, lambda: self._decided(i))
        self._decided(i)

    @precondition(lambda self: bool(self._live()))
    @rule(data=st.data())
    def retry(self, data: st.DataObject) -> None:
        """The same job again (a held payload sent again, a request whose place was kept)."""
        i = data.draw(st.sampled_from(self._live()))
        if not self.asks[i].in_line:
            self._decided(i)

    @precondition(lambda self: bool(self._live()))
    @rule(data=st.data())
    def leaves(self, data: st.DataObject) -> None:
        """Its client left or cancelled, or its kept place expired: the door says it gave up."""
        i = data.draw(st.sampled_from(self._live()))
        ask = self.asks[i]
        ask.give_up()
        intake.gave_up(self.state, ask.attempt)
        self.gone.add(i)
        if i in self.unserved:
            self.unserved.discard(i)
            self.gave_up.add(i)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data(), revoked=st.booleans())
    def end(self, data: st.DataObject, revoked: bool) -> None:
        """A job ends, or the fleet takes its admission back (refused again, as if here)."""
        i = data.draw(st.sampled_from(sorted(self.running)))
        ticket = self.running.pop(i)
        if revoked:
            self.asks[i].take_back(ticket, Refusal(NeedCode.FLEET_BUSY, 400), keep_payload=False)
            self.refused.add(i)
            self.unserved.add(i)
            self.yields += 1
        else:
            ticket.release("done")
            self.gone.add(i)
        self.state.offer()

    @rule(seconds=st.floats(0.0, 2.0))
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds
        for i, ask in enumerate(self.asks):
            if ask.decide_at <= self.clock.now:
                self._decided(i)

    @invariant()
    def each_job_counts_once(self) -> None:
        jobs, tokens, gave_up = totals(self.state)
        assert jobs == len(self.refused)
        assert tokens == sum(asked_tokens(self.asks[i].attempt.job) for i in self.refused)
        assert gave_up == len(self.gave_up)
        assert sum(self.state.admission.refusals.values()) == self.yields
        assert {i for i, a in enumerate(self.asks) if a.attempt.unserved} == self.unserved


TestDemand = Demand.TestCase
