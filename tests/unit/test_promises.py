"""The promise line on its own: pure, the time passed in."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from governor.core.promises import SLACK, Promise, PromiseLine

RANKS = 3


def new(line: PromiseLine, at: float, lapses: float, rank: int, service_s: float) -> Promise:
    """A newcomer's promise (the line has room)."""
    promise = line.keep(None, at, lapses, rank, service_s)
    assert promise is not None
    return promise


def test_newcomers_go_to_the_back_and_are_counted_by_rank() -> None:
    line = PromiseLine(RANKS)
    a = new(line, 1.0, 1.1, 0, 0.5)
    b = new(line, 2.0, 2.1, 2, 1.5)
    c = new(line, 3.0, 3.1, 1, 0.25)
    assert list(line) == [a, b, c]
    assert len(line) == 3
    assert [line.waiting(r) for r in (-1, 0, 1, 2)] == [0, 1, 2, 3]
    assert [line.of_rank(r) for r in range(RANKS)] == [1, 1, 1]
    assert line.totals() == ([1, 1, 1], [0.5, 0.25, 1.5])


def test_a_re_timed_promise_keeps_its_place() -> None:
    line = PromiseLine(RANKS)
    first = new(line, 1.0, 1.1, 0, 0.5)
    second = new(line, 2.0, 2.1, 0, 0.5)
    assert line.keep(first, 5.0, 5.1, 0, 0.75) is first
    assert list(line) == [first, second]
    assert (first.at, first.lapses, first.service_s) == (5.0, 5.1, 0.75)
    assert line.totals() == ([2, 0, 0], [1.25, 0.0, 0.0])


def test_ahead_of_counts_the_live_promises_of_its_rank_or_higher_before_it() -> None:
    line = PromiseLine(RANKS)
    heavy = new(line, 1.0, 9.0, 1, 2.0)
    new(line, 1.0, 9.0, 0, 0.5)  # an interactive client
    gone = new(line, 1.0, 9.0, 0, 0.5)
    new(line, 1.0, 9.0, 2, 4.0)  # a background client
    me = new(line, 1.0, 9.0, 1, 1.0)
    line.withdraw(gone)
    assert line.ahead_of(me, 1) == ([1, 1, 0], [0.5, 2.0, 0.0])
    assert line.ahead_of(me, 2) == ([1, 1, 1], [0.5, 2.0, 4.0])
    assert line.ahead_of(heavy, 2) == ([0, 0, 0], [0.0, 0.0, 0.0])


def test_due_ahead_counts_clients_within_the_hold_either_side() -> None:
    line = PromiseLine(RANKS)
    new(line, 0.80, 9.0, 0, 1.0)  # due 0.2 s ago: too late for the hold
    new(line, 0.95, 9.0, 0, 1.0)  # due 50 ms ago
    new(line, 1.05, 9.0, 1, 1.0)  # due in 50 ms (a heavy client)
    new(line, 1.50, 9.0, 0, 1.0)  # not yet: the walk stops here
    new(line, 1.00, 9.0, 0, 1.0)  # (behind a later one: not reached)
    assert line.due_ahead(1.0, None, 2, hold=0.1) == 2
    assert line.due_ahead(1.0, None, 0, hold=0.1) == 1  # an interactive client waits for its own
    # The first interactive ones due take the reserve's free slots, not this client's.
    assert line.due_ahead(1.0, None, 2, hold=0.1, reserved=1) == 1
    assert line.due_ahead(1.0, None, 2, hold=0.1, reserved=5) == 1


def test_due_ahead_counts_only_those_ahead_of_a_returning_client() -> None:
    line = PromiseLine(RANKS)
    first = new(line, 1.0, 9.0, 0, 1.0)
    second = new(line, 1.0, 9.0, 0, 1.0)
    assert line.due_ahead(1.0, first, 0, hold=0.1) == 0
    assert line.due_ahead(1.0, second, 0, hold=0.1) == 1


def test_promises_lapse_by_their_own_time_not_the_lines_order() -> None:
    line = PromiseLine(RANKS)
    late = new(line, 5.0, 5.5, 2, 1.0)  # first in line, promised later
    early = new(line, 1.0, 1.5, 0, 1.0)
    line.lapse(1.5)  # (lapses only once past its time)
    assert list(line) == [late, early]
    line.lapse(1.6)
    assert list(line) == [late]
    assert not early.queued
    assert line.totals() == ([0, 0, 1], [0.0, 0.0, 1.0])


def test_a_promise_lapses_only_once_past_its_time() -> None:
    line = PromiseLine(RANKS)
    new(line, 1.0, 1.2, 0, 1.0)
    due_now = new(line, 1.0, 1.5, 0, 1.0)
    line.lapse(1.5)  # the first has lapsed; the second is at its last moment
    assert list(line) == [due_now]


def test_a_re_timed_promise_lapses_at_its_new_time() -> None:
    line = PromiseLine(RANKS)
    promise = new(line, 1.0, 1.5, 0, 1.0)
    line.keep(promise, 3.0, 3.5, 0, 1.0)
    line.lapse(2.0)  # (its first time's heap entry is stale)
    assert list(line) == [promise]
    line.lapse(4.0)
    assert len(line) == 0


def test_withdrawing_twice_or_after_the_lapse_does_nothing() -> None:
    line = PromiseLine(RANKS)
    a = new(line, 1.0, 1.5, 1, 1.0)
    b = new(line, 2.0, 2.5, 1, 1.0)
    line.withdraw(a)
    line.withdraw(a)
    line.lapse(3.0)
    line.withdraw(b)
    assert (len(line), line.totals()) == (0, ([0, 0, 0], [0.0, 0.0, 0.0]))


def test_a_full_line_gives_no_new_promise_but_still_re_times() -> None:
    line = PromiseLine(RANKS, limit=2)
    a = new(line, 1.0, 1.5, 0, 1.0)
    new(line, 2.0, 2.5, 0, 1.0)
    assert line.keep(None, 3.0, 3.5, 0, 1.0) is None
    assert line.keep(a, 4.0, 4.5, 0, 1.0) is a
    line.withdraw(a)
    assert line.keep(None, 3.0, 3.5, 0, 1.0) is not None


def test_the_dead_are_dropped_so_memory_follows_the_live() -> None:
    line = PromiseLine(RANKS)
    keeper = new(line, 0.0, 1e9, 0, 1.0)  # first in line for ever: the front never clears
    for i in range(10 * SLACK):
        line.withdraw(new(line, float(i), float(i) + 0.5, 1, 1.0))
        assert line.stored <= 2 * len(line) + SLACK
    assert list(line) == [keeper]


# The line against a model: a list of every promise given, in order, with its state ----------


class LineMachine(RuleBasedStateMachine):
    """Any sequence of newcomers, re-timings, withdrawals and time passing."""

    promises = Bundle("promises")

    def __init__(self) -> None:
        super().__init__()
        self.line = PromiseLine(RANKS, limit=12)
        self.now = 0.0
        self.given: list[Promise] = []  # in the order given; the model's own record
        self.gone: set[int] = set()  # ids withdrawn or lapsed

    def live(self) -> list[Promise]:
        return [p for p in self.given if id(p) not in self.gone]

    @rule(
        target=promises,
        ahead=st.floats(0.0, 5.0),
        grace=st.floats(0.0, 1.0),
        rank=st.integers(0, RANKS - 1),
        service_s=st.floats(0.0, 10.0),
    )
    def newcomer(self, ahead: float, grace: float, rank: int, service_s: float) -> Promise | None:
        full = len(self.live()) >= 12
        at = self.now + ahead
        promise = self.line.keep(None, at, at + grace, rank, service_s)
        if full:
            assert promise is None
            return None
        assert promise is not None
        assert (promise.at, promise.lapses, promise.rank, promise.service_s) == (
            at,
            at + grace,
            rank,
            service_s,
        )
        self.given.append(promise)
        return promise

    @rule(
        promise=promises,
        ahead=st.floats(0.0, 5.0),
        grace=st.floats(0.0, 1.0),
        service_s=st.floats(0.0, 10.0),
    )
    def re_time(
        self, promise: Promise | None, ahead: float, grace: float, service_s: float
    ) -> None:
        if promise is None or not promise.queued:  # (only a promise in the line is re-timed)
            return
        at = self.now + ahead
        assert self.line.keep(promise, at, at + grace, promise.rank, service_s) is promise

    @rule(promise=consumes(promises))
    def withdraw(self, promise: Promise | None) -> None:
        if promise is None:
            return
        self.line.withdraw(promise)
        self.gone.add(id(promise))

    @rule(promise=promises)
    def withdraw_again(self, promise: Promise | None) -> None:
        if promise is not None and id(promise) in self.gone:
            self.line.withdraw(promise)  # nothing happens

    @rule(dt=st.floats(0.0, 2.0))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self.line.lapse(self.now)
        for p in self.given:
            if p.lapses < self.now:
                self.gone.add(id(p))

    @invariant()
    def the_line_is_the_live_promises_in_the_order_given(self) -> None:
        assert list(self.line) == self.live()
        assert all(p.queued == (id(p) not in self.gone) for p in self.given)

    @invariant()
    def no_promise_outlives_its_lapse(self) -> None:
        assert all(p.lapses >= self.now for p in self.line)

    @invariant()
    def the_counts_are_the_lines(self) -> None:
        live = self.live()
        counts, seconds = self.line.totals()
        for rank in range(RANKS):
            mine = [p for p in live if p.rank == rank]
            assert counts[rank] == self.line.of_rank(rank) == len(mine)
            expected = sum(p.service_s for p in mine)
            assert seconds[rank] == pytest.approx(expected, abs=1e-6)
            if not mine:
                assert seconds[rank] == 0.0  # an empty rank is back to zero, not to drift
        assert len(self.line) == len(live) <= 12
        assert [self.line.waiting(r) for r in range(-1, RANKS)] == [
            sum(1 for p in live if p.rank <= r) for r in range(-1, RANKS)
        ]

    @invariant()
    def ahead_is_counted_from_the_front(self) -> None:
        live = self.live()
        for i, promise in enumerate(live):
            for rank in range(RANKS):
                counts, _ = self.line.ahead_of(promise, rank)
                assert sum(counts) == sum(1 for p in live[:i] if p.rank <= rank)

    @invariant()
    def memory_follows_the_live(self) -> None:
        assert self.line.stored <= 2 * len(self.line) + SLACK


LineMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_the_line_against_its_model = LineMachine.TestCase
