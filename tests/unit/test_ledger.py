"""The admission ledger, with an injected clock: no sockets, no event loop."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from governor.core.estimates import EWMA_ALPHA
from governor.core.ledger import (
    DRAINING_HINT_MS,
    Completed,
    Promise,
    Refusal,
    Slot,
    SlotLedger,
)
from governor.core.policy import LANES, Demand, LanePolicy
from governor.core.promises import SLACK
from governor.core.service import JobSize
from governor.runners.base import Rates
from protocol.codes import NeedCode
from tests.clock import FakeClock


def test_cap_holds_and_counts(clock: FakeClock) -> None:
    ledger = SlotLedger(3, clock=clock)
    slots = [ledger.admit() for _ in range(3)]
    assert all(isinstance(s, Slot) for s in slots)
    assert ledger.inflight == 3
    assert ledger.saturated
    assert not ledger.ready
    refused = ledger.admit()
    assert isinstance(refused, Refusal)
    assert refused.need_code == NeedCode.SERVER_BUSY
    assert refused.retry_hint_ms >= ledger.min_hint_ms
    assert (ledger.executed_total, ledger.yielded_total, ledger.peak_inflight) == (3, 1, 3)


def test_release_is_idempotent(clock: FakeClock) -> None:
    ledger = SlotLedger(1, clock=clock)
    slot = ledger.admit()
    assert isinstance(slot, Slot)
    clock.now += 2.0
    assert slot.release() == pytest.approx(2.0)
    assert slot.release() == 0.0
    assert ledger.inflight == 0
    assert slot.released
    assert isinstance(ledger.admit(), Slot)


def test_random_admit_release_never_exceeds_cap(clock: FakeClock) -> None:
    rng = random.Random(7)
    ledger = SlotLedger(4, clock=clock)
    held: list[Slot] = []
    waiting: list[Promise] = []
    admitted = refused = 0
    for _ in range(5000):
        clock.now += rng.random() / 10
        if held and rng.random() < 0.45:
            held.pop(rng.randrange(len(held))).release(
                done=Completed() if rng.random() < 0.5 else None
            )
            continue
        if waiting and rng.random() < 0.05:  # a client that gives up
            ledger.withdraw(waiting.pop(rng.randrange(len(waiting))))
        returning = (
            waiting.pop(rng.randrange(len(waiting))) if waiting and rng.random() < 0.5 else None
        )
        decision = ledger.admit(returning)
        if isinstance(decision, Slot):
            held.append(decision)
            admitted += 1
        else:
            assert decision.retry_hint_ms >= ledger.min_hint_ms
            assert decision.promise is not None
            waiting.append(decision.promise)
            refused += 1
        assert ledger.inflight == len(held) <= 4
        # The count a newcomer's place is read from is the line's length.
        assert len(ledger.line) == sum(1 for _ in ledger.line)
        assert ledger.line.stored <= 2 * len(ledger.line) + SLACK
    assert ledger.peak_inflight == 4
    assert (ledger.executed_total, ledger.yielded_total) == (admitted, refused)
    assert refused > 0


def test_service_time_follows_completed_jobs_only(clock: FakeClock) -> None:
    ledger = SlotLedger(1, expected_service_s=1.0, clock=clock)
    slot = ledger.admit()
    assert isinstance(slot, Slot)
    clock.now += 3.0
    slot.release(done=Completed())
    assert ledger.service_s == pytest.approx(1.0 + EWMA_ALPHA * 2.0)
    before = ledger.service_s
    slot = ledger.admit()
    assert isinstance(slot, Slot)
    clock.now += 100.0
    slot.release()  # cancelled: says nothing about service time
    assert ledger.service_s == before


def test_hint_is_time_until_the_earliest_expected_release(clock: FakeClock) -> None:
    ledger = SlotLedger(2, expected_service_s=1.0, clock=clock)
    ledger.admit()
    clock.now += 0.3
    ledger.admit()
    clock.now += 0.1  # running for 0.4 s and 0.1 s; releases expected in 0.6 s and 0.9 s
    first = ledger.admit()
    assert isinstance(first, Refusal)
    assert first.retry_hint_ms == 600


def test_hints_spread_refused_clients_over_coming_releases(clock: FakeClock) -> None:
    ledger = SlotLedger(2, expected_service_s=1.0, clock=clock)
    ledger.admit()
    clock.now += 0.5
    ledger.admit()  # releases expected at +0.5 s and +1.0 s, then every S + T per slot
    t_ms = ledger.turnaround_s * 1000
    assert t_ms == 5  # the prior: min_hint_ms
    hints = []
    for _ in range(6):
        refusal = ledger.admit()
        assert isinstance(refusal, Refusal)
        hints.append(refusal.retry_hint_ms)
    assert hints == [500, 1000, 1505, 2005, 2510, 3010]


def test_a_slot_that_frees_early_turns_over_before_a_long_job_ends(clock: FakeClock) -> None:
    ledger = SlotLedger(2, expected_service_s=1.0, clock=clock)
    ledger.admit()
    clock.now += 16.0  # past its estimate: expected to end in 4 s
    ledger.admit()  # expected to end in 1 s, then every 1.005 s
    hints = []
    for _ in range(4):
        refusal = ledger.admit()
        assert isinstance(refusal, Refusal)
        hints.append(refusal.retry_hint_ms)
    # Not 1000, 4000, 2005, ...: the second slot turns over twice before the long job ends.
    assert hints == [1000, 2005, 3010, 4000]


def brute_force_release(ends: list[float], period: float, k: int) -> float:
    """The k-th release, one at a time: the earliest slot frees and is retaken."""
    times = sorted(ends)
    for _ in range(k):
        times[0] += period
        times.sort()
    return times[0]


def test_release_times_match_taking_the_slots_one_by_one(clock: FakeClock) -> None:
    rng = random.Random(3)
    for _ in range(300):
        cap = rng.randint(1, 6)
        ledger = SlotLedger(cap, expected_service_s=rng.choice([0.05, 0.5, 3.0]), clock=clock)
        for _ in range(rng.randint(0, cap)):
            ledger.admit()
            clock.now += rng.random() * 10
        now = clock.now
        ends = [ledger.estimates.expected_end(slot.started, now) for slot in ledger._running]
        ends += [now + ledger.min_hint_ms / 1000] * (cap - len(ends))
        period = ledger.service_s + ledger.turnaround_s
        for k in range(0, 40, 3):
            expected = brute_force_release(ends, period, k)
            end, turns, each = ledger.hints.release_parts(now, k)
            assert end + turns * each == pytest.approx(expected, abs=1e-9)


def test_hint_never_constant_across_load(clock: FakeClock) -> None:
    """Heptamini always says 500 ms; here the hint follows the service time."""
    short = SlotLedger(1, expected_service_s=0.05, clock=clock)
    long = SlotLedger(1, expected_service_s=8.0, clock=clock)
    short.admit()
    long.admit()
    a, b = short.admit(), long.admit()
    assert isinstance(a, Refusal)
    assert isinstance(b, Refusal)
    assert a.retry_hint_ms == 50
    assert b.retry_hint_ms == 8000


def test_a_job_a_little_late_is_given_its_overrun_again(clock: FakeClock) -> None:
    """Late by less than a quarter of its time, a job is most likely about to end: its waiter
    is told as much more as it has overrun (at least the pool's typical error), not a quarter
    of what it has run, which would leave the slot idle long after it freed."""
    ledger = SlotLedger(1, expected_service_s=1.0, min_hint_ms=5, clock=clock)
    start, promise = clock.now, None
    assert isinstance(ledger.admit(), Slot)
    # (no typical error is known until a job completes; a quarter of 1.5 s is 375 ms)
    for late, hint in ((0.01, 10), (0.2, 200), (0.3, 300), (0.5, 375)):
        clock.now = start + 1.0 + late
        refusal = ledger.admit(promise)  # the same client, first in line
        assert isinstance(refusal, Refusal)
        assert refusal.retry_hint_ms == hint, late
        promise = refusal.promise


def test_the_first_in_line_comes_as_the_likely_window_opens_and_polls_in_it(
    clock: FakeClock,
) -> None:
    """With predictions typically 20 % off, a 1 s job is likely to end from 0.8 s: its waiter
    is told 0.8 s, then polls every tenth of a second (half the window's half-width) until
    the job is late by more than that."""
    ledger = SlotLedger(1, expected_service_s=1.0, min_hint_ms=5, clock=clock)
    ledger.estimates.error = 0.2
    start = clock.now
    assert isinstance(ledger.admit(), Slot)
    promise = None
    for ran, hint in ((0.0, 800), (0.8, 100), (0.9, 100), (1.05, 100), (1.2, 200)):
        clock.now = start + ran
        refusal = ledger.admit(promise)
        assert isinstance(refusal, Refusal)
        assert refusal.retry_hint_ms == hint, ran
        promise = refusal.promise


def test_the_typical_error_is_learnt_from_completed_jobs(clock: FakeClock) -> None:
    ledger = SlotLedger(1, expected_service_s=1.0, clock=clock)
    for held in (1.0, 1.0, 1.0, 1.0):
        slot = ledger.admit()
        assert isinstance(slot, Slot)
        clock.now += held
        slot.release(done=Completed())
    assert ledger.error == 0.0  # each job held its slot just as long as predicted
    slot = ledger.admit()
    assert isinstance(slot, Slot)
    clock.now += 3.0
    slot.release()  # a failure teaches nothing
    assert ledger.error == 0.0
    slot = ledger.admit()
    assert isinstance(slot, Slot)
    clock.now += 1.5
    slot.release(done=Completed())  # half as long again as predicted
    assert ledger.error == pytest.approx(0.2 * 0.5)


def test_an_overrunning_job_is_given_a_quarter_more_of_what_it_has_run(clock: FakeClock) -> None:
    """Not "any moment now": that would have its waiters retry in a busy loop."""
    ledger = SlotLedger(1, expected_service_s=1.0, min_hint_ms=5, clock=clock)
    ledger.admit()
    clock.now += 10.0  # long past its expected end of 1 s
    refusal = ledger.admit()
    assert isinstance(refusal, Refusal)
    assert refusal.retry_hint_ms == 2500
    clock.now += 0.999  # ... but a job just short of the estimate ends at the estimate
    fresh = SlotLedger(1, expected_service_s=1.0, clock=clock)
    fresh.admit()
    clock.now += 0.999
    refusal = fresh.admit()
    assert isinstance(refusal, Refusal)
    assert refusal.retry_hint_ms == 5  # 1 ms away: the floor


def test_hint_clamped_to_max(clock: FakeClock) -> None:
    ledger = SlotLedger(1, expected_service_s=600.0, max_hint_ms=60_000, clock=clock)
    ledger.admit()
    refusal = ledger.admit()
    assert isinstance(refusal, Refusal)
    assert refusal.retry_hint_ms == 60_000


def test_returning_client_keeps_its_place(clock: FakeClock) -> None:
    ledger = SlotLedger(1, expected_service_s=1.0, clock=clock)
    ledger.admit()
    first = ledger.admit()
    second = ledger.admit()
    assert isinstance(first, Refusal)
    assert isinstance(second, Refusal)
    assert (first.retry_hint_ms, second.retry_hint_ms) == (1000, 2005)
    clock.now += 0.99  # both come back a little early: still refused ...
    again = ledger.admit(first.promise)
    assert isinstance(again, Refusal)
    assert again.retry_hint_ms == 10  # ... the first is sent to the imminent release,
    assert again.promise is first.promise
    behind = ledger.admit(second.promise)
    assert isinstance(behind, Refusal)
    assert behind.retry_hint_ms == 1015  # ... the second to the one after, not the back


def test_a_freed_slot_is_held_for_the_client_it_was_promised_to(clock: FakeClock) -> None:
    ledger = SlotLedger(1, expected_service_s=1.0, clock=clock)
    running = ledger.admit()
    waiting = ledger.admit()
    assert isinstance(running, Slot)
    assert isinstance(waiting, Refusal)
    clock.now += 1.0
    running.release(done=Completed())
    newcomer = ledger.admit()
    assert isinstance(newcomer, Refusal)  # the slot is the waiting client's
    assert ledger.inflight == 0
    clock.now += 0.010
    taken = ledger.admit(waiting.promise)
    assert isinstance(taken, Slot)
    assert ledger.turnaround_s == pytest.approx(0.005 + EWMA_ALPHA * (0.010 - 0.005))


def test_a_late_client_keeps_its_place_but_not_the_slot(clock: FakeClock) -> None:
    ledger = SlotLedger(1, expected_service_s=1.0, clock=clock)
    running = ledger.admit()
    late = ledger.admit()
    assert isinstance(running, Slot)
    assert isinstance(late, Refusal)
    clock.now += 1.0
    running.release(done=Completed())
    hold = 2 * ledger.turnaround_s
    clock.now += hold + 0.001  # the promised client is later than the hold window
    taken = ledger.admit()  # so a newcomer gets the slot
    assert isinstance(taken, Slot)
    clock.now += 0.01
    again = ledger.admit(late.promise)  # still within its grace: first in line for the next
    assert isinstance(again, Refusal)
    assert again.retry_hint_ms == 1000 - 10


def test_turnaround_learns_only_from_clients_that_came_on_time(clock: FakeClock) -> None:
    ledger = SlotLedger(1, expected_service_s=1.0, clock=clock)
    running = ledger.admit()
    early = ledger.admit()  # told to come back in 1 s
    assert isinstance(running, Slot)
    assert isinstance(early, Refusal)
    clock.now += 0.4
    running.release(done=Completed())
    clock.now += 0.1  # comes back half a second early (it ignored its hint) and finds a slot
    assert isinstance(ledger.admit(early.promise), Slot)
    assert ledger.turnaround_s == 0.005  # its wait says nothing about clients that listen


def test_a_promise_that_lapses_frees_its_slot_for_others(clock: FakeClock) -> None:
    ledger = SlotLedger(1, expected_service_s=1.0, clock=clock)
    running = ledger.admit()
    assert isinstance(running, Slot)
    assert isinstance(ledger.admit(), Refusal)  # promised +1 s; never comes back
    clock.now += 1.0
    running.release(done=Completed())
    behind = ledger.admit()  # (the slot is held for the client promised now)
    assert isinstance(behind, Refusal)
    clock.now += 0.3  # past the promise's grace (S/4): the slot is the next one's
    assert isinstance(ledger.admit(behind.promise), Slot)


def test_promises_lapse_and_are_withdrawn(clock: FakeClock) -> None:
    ledger = SlotLedger(1, expected_service_s=1.0, clock=clock)
    slot = ledger.admit()
    assert isinstance(slot, Slot)
    refusals = [ledger.admit() for _ in range(3)]
    assert [r.retry_hint_ms for r in refusals if isinstance(r, Refusal)] == [1000, 2005, 3010]
    clock.now += 1.0
    slot.release(done=Completed())
    first = refusals[0]
    assert isinstance(first, Refusal)
    assert isinstance(ledger.admit(first.promise), Slot)  # comes back: its promise is done
    refusal = ledger.admit()
    assert isinstance(refusal, Refusal)
    # Behind the two promises still outstanding: two more turns of the only slot.
    assert refusal.retry_hint_ms == round(1000 + 2 * (1000 + ledger.turnaround_s * 1000))
    clock.now += 60.0  # every promise has lapsed; the running job is long overdue
    refusal = ledger.admit()
    assert isinstance(refusal, Refusal)
    assert refusal.retry_hint_ms == 15_000  # first in line: a quarter of the 60 s it has run


def test_withdrawn_promises_no_longer_push_hints_out(clock: FakeClock) -> None:
    """Clients that left (their held payload dropped) must not delay the ones still waiting."""
    ledger = SlotLedger(1, expected_service_s=1.0, clock=clock)
    ledger.admit()
    gone = [ledger.admit() for _ in range(10)]
    for refusal in gone:
        assert isinstance(refusal, Refusal)
        assert refusal.promise is not None
        ledger.withdraw(refusal.promise)
        ledger.withdraw(refusal.promise)  # twice is harmless
    fresh = ledger.admit()
    assert isinstance(fresh, Refusal)
    assert fresh.retry_hint_ms == 1000


def test_draining_refuses_with_its_own_code(clock: FakeClock) -> None:
    ledger = SlotLedger(2, clock=clock)
    ledger.draining = True
    refusal = ledger.admit()
    assert isinstance(refusal, Refusal)
    assert refusal.need_code == NeedCode.DRAINING
    # Not when to come back (never): how soon to go to another replica. Not the longest hint.
    assert refusal.retry_hint_ms == DRAINING_HINT_MS < ledger.max_hint_ms
    assert refusal.promise is None  # (no place in a line that will never move)
    assert ledger.inflight == 0
    assert not ledger.ready


def test_cap_must_be_positive() -> None:
    with pytest.raises(ValueError, match="cap"):
        SlotLedger(0)


# Properties -------------------------------------------------------------------------------

SIZES = st.one_of(
    st.none(),
    st.builds(JobSize, st.integers(0, 4000), st.integers(1, 1000), st.integers(1, 3)),
)
# admit (with a size), release (done or not, of the i-th slot held), withdraw, or time passing
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), SIZES, st.integers(0, len(LANES) - 1)),
        st.tuples(st.just("release"), st.integers(0, 20), st.booleans()),
        st.tuples(st.just("again"), st.integers(0, 20), st.booleans()),
        st.tuples(st.just("withdraw"), st.integers(0, 50), st.booleans()),
        st.tuples(st.just("wait"), st.floats(0.0, 3.0), st.booleans()),
    ),
    max_size=80,
)


def run_ops(ops: list[tuple[str, object, object]], *, lanes: bool) -> None:
    clock = FakeClock()
    policy = LanePolicy(interactive_reserve=0) if lanes else None
    ledger = SlotLedger(3, expected_service_s=0.5, clock=clock, policy=policy)
    held: list[Slot] = []
    released: list[Slot] = []
    promises: list[tuple[Promise, int]] = []  # (promise, rank) as given, withdrawn or not
    withdrawn: set[int] = set()
    taught = 0
    for op, a, b in ops:
        if op == "admit":
            assert isinstance(b, int)
            size = a if isinstance(a, JobSize) else None
            returning = next(
                (p for p, rank in reversed(promises) if rank == b and id(p) not in withdrawn),
                None,
            )
            demand = Demand(LANES[b], 10) if lanes else None
            decision = ledger.admit(returning, demand, size)
            if returning is not None and not (
                isinstance(decision, Refusal) and decision.promise is returning
            ):
                withdrawn.add(id(returning))  # admitted, lapsed, or refused for good
            if isinstance(decision, Slot):
                held.append(decision)
            elif decision.promise is not None and decision.promise is not returning:
                promises.append((decision.promise, b if lanes else 0))
        elif op in ("release", "again"):
            assert isinstance(a, int)
            pool = held if op == "release" else released
            if not pool:
                continue
            slot = pool[a % len(pool)]
            clock.now += 0.01
            done = Completed(None, 5, 0.001) if b else None
            seconds = slot.release(done=done)
            if op == "again":
                assert seconds == 0.0  # exactly once: a second release does nothing
                continue
            assert seconds == pytest.approx(clock.now - slot.started)
            taught += b is True
            held.remove(slot)
            released.append(slot)
        elif op == "withdraw":
            assert isinstance(a, int)
            if promises:
                promise, _ = promises[a % len(promises)]
                ledger.withdraw(promise)
                withdrawn.add(id(promise))
        else:
            assert isinstance(a, float)
            clock.now += a
        assert ledger.inflight == len(held) <= ledger.cap
        assert ledger.taken == sum(slot.width for slot in held) <= ledger.cap
        assert ledger.model.observed == taught
        # waiting(rank): every promise given, less those withdrawn, taken up or lapsed.
        for rank in range(-1, len(LANES)):
            brute = sum(
                1
                for p, r in promises
                if r <= rank and id(p) not in withdrawn and p.lapses >= clock.now
            )
            assert ledger.waiting(rank) == brute
        seconds = sum(ledger.line.totals()[1])
        assert seconds == pytest.approx(sum(p.service_s for p in ledger.line), abs=1e-9)


@settings(max_examples=200)
@given(ops=OPS, lanes=st.booleans())
def test_release_is_exactly_once_and_waiting_counts_the_line(
    ops: list[tuple[str, object, object]], lanes: bool
) -> None:
    run_ops(ops, lanes=lanes)


def test_a_promise_lapses_at_its_own_time_not_the_lines(clock: FakeClock) -> None:
    """An interactive client behind background ones is promised an earlier time; once that
    has passed it no longer waits, whoever is ahead of it."""
    ledger = SlotLedger(1, clock=clock, policy=LanePolicy(interactive_reserve=0))
    background, interactive = Demand(LANES[2], 10), Demand(LANES[0], 10)
    assert isinstance(ledger.admit(demand=background), Slot)
    for _ in range(5):
        assert isinstance(ledger.admit(demand=background), Refusal)
    chat = ledger.admit(demand=interactive)
    assert isinstance(chat, Refusal)
    assert chat.retry_hint_ms == 1000  # first in its lane's line, behind five background jobs
    assert (ledger.waiting(0), ledger.waiting(2)) == (1, 6)
    clock.now += 1.5  # past the chat's grace; the first background promise lapsed too
    assert (ledger.waiting(0), ledger.waiting(2)) == (0, 4)
    again = ledger.admit(chat.promise, interactive)  # too late: to the back of its line
    assert isinstance(again, Refusal)
    assert again.promise is not chat.promise


def test_a_running_jobs_end_and_a_newcomers_pace_follow_the_jobs_progress(
    clock: FakeClock,
) -> None:
    """A chat learnt alone at 20 ms a token runs at 100 ms beside long prompts: once it reports
    its progress, a refused client is told when it will really end (not polled from its
    overrun), and a newcomer is predicted at that pace."""
    ledger = SlotLedger(1, clock=clock)
    alone = ledger.admit(size=JobSize(10, 16))
    assert isinstance(alone, Slot)
    clock.now += 0.4
    alone.release(done=Completed(10, 16, 0.1))  # ttft 0.1 s, then 15 tokens in 0.3 s
    learnt = ledger.estimates.predict_s(JobSize(10, 16))
    assert learnt == pytest.approx(0.4)
    chat = ledger.admit(size=JobSize(10, 16))
    assert isinstance(chat, Slot)
    clock.now += 0.1
    first_token = clock.now
    clock.now += 0.5
    chat.begin(first_token)
    chat.progress(6, clock.now)  # 5 tokens in 0.5 s: 100 ms a token
    refused = ledger.admit(size=JobSize(10, 16))
    assert isinstance(refused, Refusal)
    # 10 tokens to go at 100 ms: 1 s (without its progress: a poll, 150 ms: a quarter of the
    # 0.6 s it has run, past its predicted 0.4 s).
    assert refused.retry_hint_ms == 1000
    # Back a little early (the jitter), it is told what is left: no window opens again.
    clock.now += 0.9
    chat.progress(15, clock.now)  # (still at 100 ms a token)
    again = ledger.admit(promise=refused.promise, size=JobSize(10, 16))
    assert isinstance(again, Refusal)
    assert again.retry_hint_ms == 100
    assert ledger.estimates.predict_s(JobSize(10, 16)) == pytest.approx(0.1 + 15 * 0.1)
    # Past its expected length, its end is unknown again: predicted from its admission.
    chat.progress(16, clock.now)
    assert ledger.slot_end(chat, clock.now) == ledger.estimates.expected_end(
        chat.started, clock.now, chat.expected_s
    )
    chat.release(done=Completed(10, 16, 0.1))
    assert ledger.estimates.predict_s(JobSize(10, 16)) != pytest.approx(
        0.1 + 15 * 0.1
    )  # (no pace now)
    chat.progress(3, clock.now)  # (a late report after the release: ignored)
    assert ledger.estimates.paced == 0


def test_every_running_jobs_end_waits_for_the_prompts_still_to_feed(clock: FakeClock) -> None:
    """Two rewrites admitted together on a batched runner: each ends after both prompts are
    in (the runner holds every stream's next token for a prompt), so a waiter is told the
    prompts left at a prompt token's cost (the runner's, then as measured), then the tokens left
    at the decodes' pace; the tokens that came out while a prompt went in teach no pace."""
    ledger = SlotLedger(2, clock=clock)
    rates = Rates(prompt_s=0.005, decode_s=0.1)
    ledger.estimates.model.assumed = lambda: rates
    first, second = (ledger.admit(size=JobSize(1000, 10)) for _ in range(2))
    assert isinstance(first, Slot)
    assert isinstance(second, Slot)
    refused = ledger.admit(size=JobSize(10, 16))
    assert isinstance(refused, Refusal)
    assert refused.retry_hint_ms == round(1000 * (2000 * 0.005 + 9 * 0.1))
    clock.now += 5.0
    first.begin(clock.now)  # 1,000 prompt tokens in 5 s
    clock.now += 1.0
    second.feeding(200, clock.now)  # 200 in the next second: 5 ms a prompt token, measured
    first.progress(3, clock.now)  # (beside the second's prompt: no pace)
    assert first.pace_s is None
    assert ledger.slot_end(first, clock.now) == pytest.approx(clock.now + 800 * 0.005 + 7 * 0.1)
    clock.now += 2.0
    second.begin(clock.now)  # its prompt's last step, reported first
    first.progress(4, clock.now)  # (the same step: no pace)
    assert first.pace_s is None
    clock.now += 0.6
    first.progress(7, clock.now)  # 200 ms a token now that only decodes run
    second.progress(4, clock.now)
    assert first.pace_s == pytest.approx(0.2)
    assert second.pace_s == pytest.approx(0.2)
    assert ledger.slot_end(first, clock.now) == pytest.approx(clock.now + 3 * 0.2)
    assert ledger.slot_end(second, clock.now) == pytest.approx(clock.now + 6 * 0.2)


def test_a_job_of_n_sequences_waits_for_n_releases(clock: FakeClock) -> None:
    """A job of width 2 takes two slots; refused, it is told to come back when the second of
    the slots it needs frees, not the first."""
    ledger = SlotLedger(2, expected_service_s=1.0, clock=clock, min_hint_ms=1)
    first = ledger.admit()
    clock.now += 0.5
    second = ledger.admit()
    assert isinstance(first, Slot)
    assert isinstance(second, Slot)
    one = ledger.admit(size=JobSize(10, 10, 1))
    assert isinstance(one, Refusal)
    assert one.promise is not None
    ledger.withdraw(one.promise)  # (not ahead of the next one in line)
    two = ledger.admit(size=JobSize(10, 10, 2))
    assert isinstance(two, Refusal)
    assert two.promise is not None
    # (the first slot frees in 0.5 s, the second 0.5 s later)
    assert one.retry_hint_ms == pytest.approx(500, abs=2)
    assert two.retry_hint_ms == pytest.approx(1000, abs=2)
    ledger.withdraw(two.promise)
    first.release()
    again = ledger.admit(size=JobSize(10, 10, 2))
    assert isinstance(again, Refusal)  # one slot free
    second.release()
    pair = ledger.admit(again.promise, size=JobSize(10, 10, 2))
    assert isinstance(pair, Slot)
    assert (ledger.taken, ledger.inflight) == (2, 1)
    assert ledger.saturated
    pair.release()
    assert ledger.taken == 0
    assert not ledger.saturated


def test_a_slot_handed_to_a_client_back_on_its_hint_counts_its_empty_time(
    clock: FakeClock,
) -> None:
    ledger = SlotLedger(2, expected_service_s=1.0, clock=clock)
    first, second = ledger.admit(), ledger.admit()
    refused = ledger.admit()
    assert isinstance(first, Slot)
    assert isinstance(second, Slot)
    assert isinstance(refused, Refusal)
    clock.now += 1.0
    first.release(done=Completed())
    clock.now += 0.03  # the client told to come back takes the slot 30 ms after it freed
    assert isinstance(ledger.admit(refused.promise), Slot)
    assert (ledger.handoffs, round(ledger.handoff_idle_s, 6)) == (1, 0.03)
    clock.now += 0.5
    second.release(done=Completed())
    clock.now += 0.2
    assert isinstance(ledger.admit(), Slot)  # a newcomer, on no hint: not a handoff
    assert ledger.handoffs == 1


def test_ready_in_is_a_newcomers_hint_and_keeps_no_place(clock: FakeClock) -> None:
    """What a replica tells the fleet's store: 0 while a slot is free, else the hint a newcomer
    would get now; asking it changes nothing."""
    ledger = SlotLedger(2, clock=clock)
    assert ledger.ready_in_ms() == 0
    assert isinstance(ledger.admit(), Slot)
    assert ledger.ready_in_ms() == 0  # one slot still free
    assert isinstance(ledger.admit(), Slot)
    ready = ledger.ready_in_ms()
    assert ready > 0
    assert ledger.waiting(0) == 0
    refused = ledger.admit()
    assert isinstance(refused, Refusal)
    assert refused.retry_hint_ms == ready
    assert isinstance(ledger.admit(), Refusal)  # (both slots' releases now promised)
    assert ledger.ready_in_ms() > ready  # a newcomer now waits a turn behind them


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "release", "wait"]), st.floats(0, 0.5))))
def test_ready_in_says_when_a_newcomer_is_admitted_or_what_it_is_told(
    steps: list[tuple[str, float]],
) -> None:
    """For any history: ready_in 0 means a newcomer is admitted now; a refused newcomer is told
    exactly ready_in."""
    clock = FakeClock()
    ledger = SlotLedger(3, clock=clock)
    held: list[Slot] = []
    for op, dt in steps:
        clock.now += dt
        if op == "release" and held:
            held.pop(0).release()
            continue
        ready = ledger.ready_in_ms()
        decision = ledger.admit()
        if isinstance(decision, Refusal):
            assert ready > 0
            assert decision.retry_hint_ms == ready
            if op != "wait" and decision.promise is not None:
                ledger.withdraw(decision.promise)  # (it went elsewhere)
        else:
            assert isinstance(decision, Slot)
            held.append(decision)


def test_a_free_slot_goes_past_the_line_only_to_a_job_that_ends_before_it_is_needed(
    clock: FakeClock,
) -> None:
    """Two rewrites on two slots, two clients told to come back when they end; one rewrite
    fails early. A newcomer as long would still hold the free slot when the second client is
    due (the first gets the other rewrite's slot): refused. A short one ends first: admitted."""
    ledger = SlotLedger(2, clock=clock)
    ledger.estimates.model.assumed = lambda: Rates(prompt_s=0.001, decode_s=0.01)
    rewrite = JobSize(100, 100)
    first, second = (ledger.admit(size=rewrite) for _ in range(2))
    assert isinstance(first, Slot)
    assert isinstance(second, Slot)
    waiting = [ledger.admit(size=rewrite) for _ in range(2)]
    assert all(isinstance(w, Refusal) for w in waiting)
    clock.now += 0.3
    second.release()  # (failed: a slot free long before either client is due)
    assert isinstance(ledger.admit(size=rewrite), Refusal)
    short = ledger.admit(size=JobSize(10, 5))  # 10 ms of prompt, 4 tokens: ends in 50 ms
    assert isinstance(short, Slot)


def test_a_newcomer_takes_no_free_slot_that_a_client_due_soon_would_lack(
    clock: FakeClock,
) -> None:
    """Four slots turning together, four clients told to come back as they free: three free a
    moment before the clients are due, the fourth's job ends by then. A newcomer as long as a
    turn would leave one of the four without a slot (free slots to spare do not change that):
    refused; the four, back at their time, are all admitted."""
    ledger = SlotLedger(4, expected_service_s=1.0, clock=clock)
    running = [ledger.admit() for _ in range(4)]
    assert all(isinstance(slot, Slot) for slot in running)
    waiting = [ledger.admit() for _ in range(4)]
    promises = [w.promise for w in waiting if isinstance(w, Refusal) and w.promise is not None]
    assert len(promises) == 4
    due = max(p.at for p in promises)
    clock.now = due - 10 * ledger.estimates.hold() - 0.01
    for slot in running[:3]:
        assert isinstance(slot, Slot)
        slot.release()
    assert isinstance(ledger.admit(), Refusal)  # the newcomer
    clock.now = due
    assert isinstance(running[3], Slot)
    running[3].release()
    assert all(isinstance(ledger.admit(p), Slot) for p in promises)


def test_a_client_is_never_told_sooner_than_the_one_ahead_of_it(clock: FakeClock) -> None:
    """A rewrite's end predicted sooner once its pace is measured: a newcomer's release would
    come before the time told to the client ahead of it, who would then find its release
    taken; it is told that client's time at the soonest."""
    ledger = SlotLedger(1, clock=clock)
    ledger.estimates.model.assumed = lambda: Rates(prompt_s=0.001, decode_s=0.1)
    rewrite = ledger.admit(size=JobSize(100, 100))
    assert isinstance(rewrite, Slot)
    ahead = ledger.admit(size=JobSize(10, 2))
    assert isinstance(ahead, Refusal)
    assert ahead.promise is not None
    clock.now += 1.0
    rewrite.begin(clock.now)
    clock.now += 0.1
    rewrite.progress(91, clock.now)  # 90 tokens in 0.1 s: 9 left, 10 ms away
    behind = ledger.admit(size=JobSize(10, 2))
    assert isinstance(behind, Refusal)
    assert behind.promise is not None
    assert behind.promise.at >= ahead.promise.at > clock.now + 1.0


def test_a_hint_is_late_by_its_margin_of_the_last_leg(clock: FakeClock) -> None:
    """With a margin, a client waiting for a running job's end is told that end plus the margin
    of the time to it; one a turn later, plus the margin of the turn, each turn longer by it."""
    ledger = SlotLedger(1, expected_service_s=1.0, clock=clock, hint_margin=0.1)
    assert isinstance(ledger.admit(), Slot)
    first, second = ledger.admit(), ledger.admit()
    assert isinstance(first, Refusal)
    assert isinstance(second, Refusal)
    assert first.retry_hint_ms == 1100
    period_ms = (1000 + ledger.turnaround_s * 1000) / 0.9
    assert second.retry_hint_ms == pytest.approx(1000 + 1.1 * period_ms, abs=1)
