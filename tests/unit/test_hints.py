"""The k-th slot release, on its own: pure arithmetic."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.core.estimates import ServiceEstimates
from governor.core.hints import HintParts, RetryHints, kth_release_parts
from governor.core.lanegate import LaneGate
from governor.core.promises import PromiseLine


def kth_release(ends: list[float], period: float, k: int) -> float:
    """When the k-th release is expected: its slot's first end, then that slot's turns."""
    end, turns = kth_release_parts(ends, period, k)
    return end + turns * period


def one_by_one(ends: list[float], period: float, k: int) -> float:
    """The k-th release, a slot at a time: the earliest frees and is retaken."""
    times = sorted(ends)
    for _ in range(k):
        times[0] += period
        times.sort()
    return times[0]


def test_each_slot_frees_once_before_any_frees_twice() -> None:
    ends = [1.0, 1.5]
    assert [kth_release(ends, 1.0, k) for k in range(5)] == [1.0, 1.5, 2.0, 2.5, 3.0]


def test_a_slot_that_frees_early_turns_over_before_a_late_one_frees() -> None:
    ends = [1.0, 4.0]  # a chat beside a rewrite
    assert [kth_release(ends, 1.0, k) for k in range(6)] == [1.0, 2.0, 3.0, 4.0, 4.0, 5.0]


@given(
    ends=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=8),
    period=st.floats(0.001, 20.0),
    k=st.integers(0, 60),
)
def test_the_kth_release_is_the_slots_taken_one_by_one(
    ends: list[float], period: float, k: int
) -> None:
    """In parts: the first end of the slot it comes on, and the turns of that slot after it
    (what a hint says it is made of)."""
    ends.sort()
    end, turns = kth_release_parts(ends, period, k)
    assert end in ends
    assert turns >= 0
    assert kth_release(ends, period, k) == pytest.approx(one_by_one(ends, period, k), abs=1e-6)


@given(
    ends=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=8),
    period=st.floats(0.001, 20.0),
    k=st.integers(0, 60),
)
def test_later_releases_are_never_earlier(ends: list[float], period: float, k: int) -> None:
    ends.sort()
    assert kth_release(ends, period, k) <= kth_release(ends, period, k + 1) + 1e-9


def test_a_hints_parts_add_up_to_it_within_its_bounds() -> None:
    line = PromiseLine(3)
    estimates = ServiceEstimates(1.0, 0.005)
    hints = RetryHints(2, 5, 1_000, estimates, line, LaneGate(None, line, 0.0), [])
    assert hints.parts(10.0, 10.4) == HintParts(400)  # a wait for one end: all release
    assert hints.parts(10.0, 10.9, 10.3, 2) == HintParts(300, 600, 2)
    cut = hints.parts(10.0, 12.5, 10.3, 5)  # past max_hint_ms: cut in its turns
    assert (cut.ms, cut.release_ms) == (1_000, 300)
    raised = hints.parts(10.0, 10.0, 9.0)  # a free slot: the floor, its turns none
    assert (raised.ms, raised.release_ms, raised.turns_ms) == (5, 0, 5)
