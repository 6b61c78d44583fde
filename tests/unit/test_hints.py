"""The k-th slot release, on its own: pure arithmetic."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.core.hints import kth_release


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
    ends.sort()
    assert kth_release(ends, period, k) == pytest.approx(one_by_one(ends, period, k), abs=1e-6)


@given(
    ends=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=8),
    period=st.floats(0.001, 20.0),
    k=st.integers(0, 60),
)
def test_later_releases_are_never_earlier(ends: list[float], period: float, k: int) -> None:
    ends.sort()
    assert kth_release(ends, period, k) <= kth_release(ends, period, k + 1) + 1e-9
