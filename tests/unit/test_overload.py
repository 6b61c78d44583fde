"""Overload states and the fallback ladder under a scripted signal sequence (injected clock)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.core.overload import OverloadController, OverloadSettings, State
from governor.core.policy import Lane
from tests.clock import FakeClock


def controller(clock: FakeClock, **settings: object) -> OverloadController:
    base = {"window_s": 10.0, "min_dwell_s": 5.0, "min_samples": 5}
    return OverloadController(OverloadSettings(**{**base, **settings}), clock)  # type: ignore[arg-type]


SLO_MS = 1000.0  # the interactive TTFT objective the tests' TTFTs are measured against


def feed_ttft(c: OverloadController, clock: FakeClock, ms: float, n: int = 10) -> None:
    for _ in range(n):
        clock.now += 0.1
        c.observe_ttft(ms / SLO_MS)


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


@pytest.mark.parametrize("kv", [0.85, 0.96, 1.0])
def test_kv_utilisation_of_a_preemptible_runner_is_not_distress(
    clock: FakeClock, kv: float
) -> None:
    """The batched llama runner suspends lent work to take its memory back: a full cache
    proposes no level there, while the default still reacts to it."""
    c = controller(clock, kv_preemptible=True)
    c.kv_utilisation = kv
    assert c.update() == State.NORMAL
    assert c.signals()["kv_utilisation"] == kv  # still reported
    d = controller(clock)
    d.kv_utilisation = kv
    assert d.update() >= State.BATCH_PAUSED


def test_a_preemptible_runner_still_moves_on_missed_objectives_and_errors(
    clock: FakeClock,
) -> None:
    c = controller(clock, kv_preemptible=True)
    c.kv_utilisation = 1.0
    feed_ttft(c, clock, 1600, n=20)
    assert c.update() == State.INTERACTIVE_ONLY
    d = controller(clock, kv_preemptible=True)
    for i in range(10):
        d.observe_outcome(failed=i < 3)
    assert d.update() == State.DEGRADED


def test_the_error_rate_degrades(clock: FakeClock) -> None:
    d = controller(clock)
    for i in range(10):
        d.observe_outcome(failed=i < 3)
    assert d.update() == State.DEGRADED
    clock.now += 10.5  # the failures leave the window; the runner now succeeds
    for _ in range(10):
        d.observe_outcome(failed=False)
    assert d.update() == State.NORMAL


def test_a_burst_of_refusals_on_a_healthy_backend_stays_normal(clock: FakeClock) -> None:
    """The yield rate is demand, not distress: more jobs than slots, 90 % of the attempts
    refused, with the objectives met and no errors, moves no state (and so caps no chat)."""
    c = controller(clock)
    for i in range(100):
        clock.now += 0.05
        c.observe_admission(yielded=i % 10 != 0)
        if i % 10 == 0:
            c.observe_outcome(failed=False)
    feed_ttft(c, clock, 300)
    c.kv_utilisation = 0.5
    assert c.signals()["yield_rate"] == pytest.approx(0.9)  # still measured and reported
    assert c.update() == State.NORMAL
    assert c.max_new_tokens(Lane.INTERACTIVE, 1024) is None
    assert not c.paused(Lane.BACKGROUND)
    assert not c.transitions


@given(
    yields=st.lists(st.booleans(), max_size=80),
    ttft=st.lists(st.floats(0.0, 3000.0), max_size=30),
    failures=st.lists(st.booleans(), max_size=30),
    kv=st.floats(0.0, 1.0),
    preemptible=st.booleans(),
)
def test_refusals_never_move_the_state(
    yields: list[bool],
    ttft: list[float],
    failures: list[bool],
    kv: float,
    preemptible: bool,
) -> None:
    """Whatever the distress signals, the same state with or without any admissions and
    yields."""
    states = []
    for admissions in ([], yields):
        clock = FakeClock()
        c = controller(clock, kv_preemptible=preemptible)
        for ms in ttft:
            clock.now += 0.1
            c.observe_ttft(ms / SLO_MS)
        for failed in failures:
            clock.now += 0.1
            c.observe_outcome(failed=failed)
        for yielded in admissions:
            c.observe_admission(yielded=yielded)
        c.kv_utilisation = kv
        states.append(c.update())
    assert states[0] == states[1]
    if preemptible and not ttft and not any(failures):
        assert states[1] == State.NORMAL


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


# When a pause can end ---------------------------------------------------------------------


def test_chats_slower_than_their_tpot_objective_raise_the_state_too(clock: FakeClock) -> None:
    """TTFT within its objective, TPOT at 1.2 times it: a twentieth of the chats miss, so
    batch work is paused; it can fall once those TPOT samples have left the window."""
    c = controller(clock)
    feed_ttft(c, clock, 200)
    for _ in range(10):
        clock.now += 0.1
        c.observe_tpot(1.2)
    assert c.update() == State.BATCH_PAUSED
    assert c.signals()["tpot_p95"] == pytest.approx(1.2)
    last_slow = clock.now
    assert c.paused(Lane.BACKGROUND)
    assert not c.paused(Lane.HEAVY)  # (heavy work is paused only from interactive_only)
    for _ in range(10):
        clock.now += 0.1
        c.observe_tpot(0.5)
    clock.now = last_slow + 10.5
    feed_ttft(c, clock, 200)
    assert c.update() == State.DEGRADED
