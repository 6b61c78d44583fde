"""How the retry hints land, on a fake clock: one error per return at a hint, of its sign and
size, known once a slot is the client's; none for a client that never gets one."""

from __future__ import annotations

import heapq
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from governor.core.landing import EARLY_KEPT, Landings
from governor.core.ledger import Completed, Refusal, Slot, SlotLedger
from governor.core.promises import Promise
from tests.clock import FakeClock


def refused(decision: Slot | Refusal, told: float | None = None) -> Promise:
    """The refusal's promise; ``told``: when its client was told it (the door answered)."""
    assert isinstance(decision, Refusal)
    assert decision.promise is not None
    decision.promise.told = told
    return decision.promise


def errors(ledger: SlotLedger) -> tuple[int, float]:
    """How many errors were observed (lanes off), and their sum."""
    counts, total = ledger.landings.errors.get("-", ([], 0.0))
    return sum(counts), total


def test_a_return_that_lands_observes_how_long_the_slot_waited_for_the_time_told() -> None:
    clock = FakeClock()
    ledger = SlotLedger(1, expected_service_s=1.0, clock=clock)
    running = ledger.admit()
    assert isinstance(running, Slot)
    promise = refused(ledger.admit(), clock.now)
    told, at = clock.now, promise.at
    assert at == pytest.approx(clock.now + 1.0)
    freed = clock.now = told + 0.9
    running.release(done=Completed())  # a tenth of the hint early: the slot waits 0.1 s
    assert errors(ledger) == (0, 0.0)  # (nothing is known until the client is back)
    clock.now = at
    assert isinstance(ledger.admit(promise), Slot)
    assert ledger.landings.returns == {("-", "landed"): 1}
    count, total = errors(ledger)
    assert count == 1
    assert total == pytest.approx((at - freed) / (at - told))
    assert total == pytest.approx(0.1)


def test_an_early_return_is_observed_once_a_slot_is_its_with_its_own_hint() -> None:
    """Back at its hint while the job still runs: refused again (early), and re-timed; its
    error, negative, is observed when the slot it gets frees, beside the one it landed on."""
    clock = FakeClock()
    ledger = SlotLedger(1, expected_service_s=1.0, clock=clock, min_hint_ms=100)
    running = ledger.admit()
    assert isinstance(running, Slot)
    promise = refused(ledger.admit(), clock.now)
    first = (clock.now, promise.at)
    clock.now = promise.at
    assert refused(ledger.admit(promise), clock.now) is promise  # early: the job runs on
    assert ledger.landings.returns == {("-", "early"): 1}
    assert errors(ledger) == (0, 0.0)
    second = (clock.now, promise.at)
    assert second[0] == first[1]
    freed = clock.now = first[0] + 1.05
    running.release(done=Completed())
    clock.now = promise.at
    assert isinstance(ledger.admit(promise), Slot)
    assert ledger.landings.returns == {("-", "early"): 1, ("-", "landed"): 1}
    early = (first[1] - freed) / (first[1] - first[0])
    landed = (second[1] - freed) / (second[1] - second[0])
    assert early < 0 < landed
    count, total = errors(ledger)
    assert count == 2
    assert total == pytest.approx(early + landed)


def test_a_client_that_never_returns_or_comes_far_early_gives_no_error() -> None:
    clock = FakeClock()
    ledger = SlotLedger(1, expected_service_s=1.0, clock=clock)
    running = ledger.admit()
    assert isinstance(running, Slot)
    gone = refused(ledger.admit(), clock.now)
    eager = refused(ledger.admit(), clock.now)
    clock.now += 0.1  # far before its hint: not a return at it
    assert refused(ledger.admit(eager), clock.now) is eager
    assert ledger.landings.returns == {}
    clock.now += 5.0
    running.release(done=Completed())
    ledger.admit()  # (the line lapses as a decision is made)
    assert gone.queued is False  # (lapsed: its client never came)
    assert errors(ledger) == (0, 0.0)


def test_a_job_that_waits_in_line_on_the_server_is_no_return() -> None:
    """A refusal that is not answered (its job waits in line on the server) tells no client
    anything: its turn, early or not, counts no return and gives no error; told later (its wait
    ends in a yield), its client's return counts."""
    clock = FakeClock()
    ledger = SlotLedger(1, expected_service_s=1.0, clock=clock, min_hint_ms=100)
    running = ledger.admit()
    assert isinstance(running, Slot)
    waiting = refused(ledger.admit())  # (told nothing)
    for _ in range(2):  # its turns on the server, re-timed each time: early, unseen
        clock.now = waiting.at
        again = ledger.admit(waiting)
        assert isinstance(again, Refusal)
        assert again.promise is waiting
    assert ledger.landings.returns == {}
    clock.now = waiting.at
    answered = refused(ledger.admit(waiting), clock.now)  # this time the door answers
    assert ledger.landings.returns == {}
    clock.now = answered.at
    running.release(done=Completed())
    assert isinstance(ledger.admit(answered), Slot)
    assert ledger.landings.returns == {("-", "landed"): 1}
    assert errors(ledger)[0] == 1


@given(returns=st.lists(st.tuples(st.floats(0.0, 10.0), st.floats(0.01, 10.0)), max_size=40))
def test_a_promise_keeps_its_latest_early_returns_only(returns: list[tuple[float, float]]) -> None:
    """However often a client is refused at its hint, its promise keeps a bounded list, and
    every early return is counted; the errors observed at its admission are those kept."""
    landings, promise = Landings(), Promise(0.0, 1.0)
    for told, length in returns:
        landings.early(promise, "heavy", (told, told + length))
        assert len(promise.early or ()) <= EARLY_KEPT
    assert landings.returns["heavy", "early"] == len(returns)
    landings.landed(promise, "heavy", None, freed=30.0)
    counts, total = landings.errors.get("heavy", ([], 0.0))
    assert sum(counts) == min(len(returns), EARLY_KEPT)
    assert total < 0 or not counts  # (every slot freed after every time told)
    assert promise.early is None


def closed_loop(ledger: SlotLedger, clock: FakeClock, clients: int, rounds: int) -> Counter[int]:
    """``clients`` clients, each sending ``rounds`` jobs of the ledger's expected service time
    one after the other, each back exactly at its hint: the refusals of each client."""
    job_s = ledger.service_s
    events: list[tuple[float, int, Slot | None]] = []
    promise: dict[int, Promise | None] = {}
    refusals: Counter[int] = Counter()
    left = dict.fromkeys(range(clients), rounds)
    for c in range(clients):
        heapq.heappush(events, (clock.now, c, None))
    while events:
        clock.now, c, running = heapq.heappop(events)
        if running is not None:  # its job ends
            running.release(done=Completed())
            left[c] -= 1
            if left[c]:
                heapq.heappush(events, (clock.now, c, None))
            continue
        decision = ledger.admit(promise.get(c))
        if isinstance(decision, Slot):
            promise[c] = None
            heapq.heappush(events, (clock.now + job_s, c, decision))
        else:
            refusals[c] += 1
            promise[c] = decision.promise
            if decision.promise is not None:
                decision.promise.told = clock.now  # (the door answers it)
            heapq.heappush(events, (clock.now + decision.retry_hint_ms / 1000, c, None))
    return refusals


@settings(max_examples=20, deadline=None)
@given(clients=st.integers(2, 24), slots=st.integers(1, 4), rounds=st.integers(1, 3))
def test_every_return_at_a_hint_is_counted_once_and_its_error_known_once_admitted(
    clients: int, slots: int, rounds: int
) -> None:
    """Closed-loop clients back just at their hints, jobs that take their predicted time:
    every refusal but a client's first is a return at a hint, counted once (landed or early),
    and once every client has been served, every one of those hints' errors is known."""
    clock = FakeClock()
    ledger = SlotLedger(slots, expected_service_s=0.5, clock=clock, hint_margin=0.02)
    refusals = closed_loop(ledger, clock, clients, rounds)
    returns = ledger.landings.returns
    landed, early = returns["-", "landed"], returns["-", "early"]
    assert landed + early == sum(refusals.values())  # (each refused job came back)
    counts, _ = ledger.landings.errors.get("-", ([], 0.0))
    assert sum(counts) == landed + early
    assert (ledger.taken, len(ledger.line)) == (0, 0)
