"""Overload states and the fallback ladder under a scripted signal sequence (injected clock)."""

from __future__ import annotations

import pytest

from governor.overload import OverloadController, OverloadSettings, State
from governor.policy import Lane

from .test_ledger import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def controller(clock: FakeClock, **settings: object) -> OverloadController:
    base = {"ttft_slo_ms": 1000.0, "window_s": 10.0, "min_dwell_s": 5.0, "min_samples": 5}
    return OverloadController(OverloadSettings(**{**base, **settings}), clock)  # type: ignore[arg-type]


def feed_ttft(c: OverloadController, clock: FakeClock, ms: float, n: int = 10) -> None:
    for _ in range(n):
        clock.now += 0.1
        c.observe_ttft(ms)


def test_rises_at_once_and_falls_a_level_at_a_time_after_the_dwell(clock: FakeClock) -> None:
    c = controller(clock)
    feed_ttft(c, clock, 200)
    assert c.update() == State.NORMAL
    feed_ttft(c, clock, 1600, n=20)  # p95 past 1.5 x SLO
    assert c.update() == State.INTERACTIVE_ONLY
    clock.now += 10.5  # the slow samples leave the window ...
    feed_ttft(c, clock, 100)
    assert c.update() == State.BATCH_PAUSED  # ... and it falls one level
    assert c.update() == State.BATCH_PAUSED  # not again until the dwell has passed
    clock.now += 5.0
    feed_ttft(c, clock, 100)
    assert c.update() == State.DEGRADED
    clock.now += 5.1
    assert c.update() == State.NORMAL
    assert c.transitions == {
        ("normal", "interactive_only"): 1,
        ("interactive_only", "batch_paused"): 1,
        ("batch_paused", "degraded"): 1,
        ("degraded", "normal"): 1,
    }


def test_hysteresis_holds_a_state_near_its_threshold(clock: FakeClock) -> None:
    c = controller(clock)
    feed_ttft(c, clock, 1000)  # at the SLO: batch_paused
    assert c.update() == State.BATCH_PAUSED
    clock.now += 10.5
    feed_ttft(c, clock, 900)  # below the rising threshold, above the falling one (800)
    assert c.update() == State.BATCH_PAUSED
    clock.now += 10.5
    feed_ttft(c, clock, 700)
    assert c.update() == State.DEGRADED  # 700 >= 0.8 x 800: one level down, to degraded


def test_too_few_samples_say_nothing(clock: FakeClock) -> None:
    c = controller(clock)
    feed_ttft(c, clock, 5000, n=4)
    assert c.update() == State.NORMAL


@pytest.mark.parametrize(
    ("kv", "state"),
    [(0.5, State.NORMAL), (0.8, State.BATCH_PAUSED), (0.96, State.INTERACTIVE_ONLY)],
)
def test_kv_utilisation_drives_the_state(clock: FakeClock, kv: float, state: State) -> None:
    c = controller(clock)
    c.kv_utilisation = kv
    assert c.update() == state


def test_yield_and_error_rates_degrade(clock: FakeClock) -> None:
    c = controller(clock)
    for i in range(10):
        c.observe_admission(yielded=i % 2 == 0)
    assert c.update() == State.DEGRADED
    d = controller(clock)
    for i in range(10):
        d.observe_outcome(failed=i < 3)
    assert d.update() == State.DEGRADED


def test_the_ladder_follows_the_state(clock: FakeClock) -> None:
    c = controller(clock, degraded_max_new_tokens=64)
    assert c.max_new_tokens(Lane.INTERACTIVE, 256) is None
    assert not c.paused(Lane.BACKGROUND)
    c.state = State.DEGRADED
    assert c.max_new_tokens(Lane.INTERACTIVE, 256) == 64
    assert c.max_new_tokens(Lane.INTERACTIVE, 32) is None  # already within the cap
    assert c.max_new_tokens(Lane.HEAVY, 256) is None
    assert not c.paused(Lane.BACKGROUND)
    c.state = State.BATCH_PAUSED
    assert c.paused(Lane.BACKGROUND)
    assert not c.paused(Lane.HEAVY)
    c.state = State.INTERACTIVE_ONLY
    assert c.paused(Lane.HEAVY)
    assert not c.paused(Lane.INTERACTIVE)
    off = controller(clock, pause_background=False, interactive_only=False)
    off.state = State.INTERACTIVE_ONLY
    assert not off.paused(Lane.BACKGROUND)
    assert not off.paused(Lane.HEAVY)
