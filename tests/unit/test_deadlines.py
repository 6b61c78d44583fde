"""The listener's one timer for its connections' deadlines (``listeners.base.Deadlines``),
against a model: for any deadlines set, moved and dropped, a firing at a time hands each
connection due by then (its deadline rounded up to the grain) its deadline once, and no other;
a connection is kept in one place whatever it was moved through; the timer is armed for the
earliest bucket (no later, after a removal; exactly, after a firing)."""

from __future__ import annotations

import asyncio
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from governor.listeners.base import GRAIN, Deadlines
from tests.clock import FakeClock


class Conn:
    def __init__(self, name: int, fired: list[int]) -> None:
        self.name = name
        self.due_at: int | None = None
        self.fired = fired

    def on_deadline(self) -> None:
        self.fired.append(self.name)


MOVES = st.lists(
    st.tuples(
        st.integers(0, 7),  # which connection
        st.one_of(st.none(), st.floats(100.0, 103.0)),  # its new deadline (None: dropped)
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(moves=MOVES, at=st.floats(100.0, 103.5))
def test_a_firing_hands_each_due_connection_its_deadline_once(
    moves: list[tuple[int, float | None]], at: float
) -> None:
    async def run() -> None:
        clock, fired = FakeClock(100.0), list[int]()
        deadlines = Deadlines(clock)
        conns = [Conn(i, fired) for i in range(8)]
        model: dict[int, float] = {}
        for i, deadline in moves:
            if deadline is None:
                deadlines.remove(conns[i])
                model.pop(i, None)
            else:
                deadlines.put(conns[i], deadline)
                model[i] = deadline
        assert len(deadlines) == len(model)
        if model:  # armed no later than the earliest (a bucket emptied since may fire first)
            assert deadlines._timer_key is not None
            assert deadlines._timer_key <= min(math.ceil(d / GRAIN) for d in model.values())
        clock.now = at
        deadlines._fire()
        due = sorted(i for i, d in model.items() if math.ceil(d / GRAIN) <= math.floor(at / GRAIN))
        assert sorted(fired) == due
        assert len(deadlines) == len(model) - len(due)
        assert all(conns[i].due_at is None for i in due)
        left = [d for i, d in model.items() if i not in due]
        if left:
            assert deadlines._timer_key == min(math.ceil(d / GRAIN) for d in left)
        deadlines.close()

    asyncio.run(run())


def test_a_connection_put_back_within_its_firing_waits_for_the_next_turn() -> None:
    """One that is still due when it puts itself back is handed it again at the next firing,
    not in a loop within this one."""

    async def run() -> None:
        clock = FakeClock(100.0)
        deadlines = Deadlines(clock)
        fired: list[int] = []

        class Again(Conn):
            def on_deadline(self) -> None:
                super().on_deadline()
                deadlines.put(self, clock.now)  # still due

        conn = Again(1, fired)
        deadlines.put(conn, clock.now)
        deadlines._fire()
        assert fired == [1]
        assert conn.due_at is not None
        for _ in range(100):  # the timer, armed at once, fires on one of the loop's next turns
            if len(fired) >= 2:
                break
            await asyncio.sleep(0)
        assert fired[:2] == [1, 1]
        deadlines.close()

    asyncio.run(run())
