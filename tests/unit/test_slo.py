"""Objectives per lane: what a job is held to, how it is judged, attainment by lane."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.core.policy import LANES, Lane
from governor.core.slo import DEFAULT_OBJECTIVES, Attainment, Objectives, SloPolicy, Verdict, judge
from tests.clock import FakeClock

ms = st.sampled_from([0.0, 1.0, 50.0, 100.0, 250.0, 1000.0, 15000.0, 600000.0])


@given(
    lane=st.sampled_from([*LANES, None]),
    tenant=st.tuples(ms, ms),
    request=st.tuples(ms, ms),
    base=st.tuples(ms, ms),
)
def test_an_interactive_job_is_never_held_to_less_than_its_lane(
    lane: Lane | None,
    tenant: tuple[float, float],
    request: tuple[float, float],
    base: tuple[float, float],
) -> None:
    """Whatever the tenant and the request say: an interactive job's objectives (a job's
    without lanes) are at most its lane's (where the lane has one); the request's own, where
    it sets one, wins over the tenant's, within that."""
    lanes = {**DEFAULT_OBJECTIVES, Lane.INTERACTIVE: Objectives(*base)}
    policy = SloPolicy(lanes=lanes)
    got = policy.objectives(lane, Objectives(*tenant), Objectives(*request))
    lane_own = lanes[lane or Lane.INTERACTIVE]
    for field, asked_tenant, asked_request, floor in (
        ("ttft_ms", tenant[0], request[0], lane_own.ttft_ms),
        ("tpot_ms", tenant[1], request[1], lane_own.tpot_ms),
    ):
        value = getattr(got, field)
        asked = asked_request or asked_tenant or floor
        if lane in (None, Lane.INTERACTIVE) and floor:
            assert value == min(asked, floor)
        else:
            assert value == asked


def test_a_heavy_job_may_loosen_its_lanes_objective_and_the_gap_is_interactive() -> None:
    policy = SloPolicy(interactive_gap_ms=400.0)
    heavy = policy.objectives(Lane.HEAVY, request=Objectives(60000.0, 0.0))
    assert heavy == Objectives(60000.0, DEFAULT_OBJECTIVES[Lane.HEAVY].tpot_ms)
    assert policy.objectives(Lane.INTERACTIVE, request=Objectives(5000.0, 20.0)) == Objectives(
        DEFAULT_OBJECTIVES[Lane.INTERACTIVE].ttft_ms, 20.0
    )
    assert [policy.gap_ms(lane) for lane in (None, *LANES)] == [400.0, 400.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("ttft_s", "tpot_s", "succeeded", "verdict"),
    [
        (0.5, 0.05, True, Verdict(True, True)),
        (1.5, 0.05, True, Verdict(False, True)),
        (0.5, 0.2, True, Verdict(True, False)),
        (0.5, None, True, Verdict(True, True)),  # one token: no TPOT to miss
        (None, None, True, Verdict(False, True)),  # (no first token: the caller gives its end)
        (0.1, 0.01, False, Verdict(False, False)),  # failed: met neither
    ],
)
def test_judging_a_job(
    ttft_s: float | None, tpot_s: float | None, succeeded: bool, verdict: Verdict
) -> None:
    objectives = Objectives(1000.0, 100.0)
    assert judge(objectives, ttft_s=ttft_s, tpot_s=tpot_s, succeeded=succeeded) == verdict
    assert judge(Objectives(), ttft_s=9e9, tpot_s=9e9, succeeded=True) == Verdict(True, True)


def test_attainment_counts_since_start_and_shares_over_the_window() -> None:
    clock = FakeClock()
    slo = Attainment(10.0, clock)
    slo.record("interactive", Verdict(True, True))
    slo.record("interactive", Verdict(True, False))
    slo.record("heavy", Verdict(False, False))
    clock.now += 6
    slo.record("interactive", Verdict(False, True))
    assert slo.totals == {"interactive": [3, 2, 2, 1], "heavy": [1, 0, 0, 0]}
    assert slo.shares() == {
        "interactive": (3, pytest.approx(2 / 3), pytest.approx(2 / 3), pytest.approx(1 / 3)),
        "heavy": (1, 0.0, 0.0, 0.0),
    }
    clock.now += 5  # the first three have left the window
    assert slo.shares() == {"interactive": (1, 0.0, 1.0, 0.0)}
    assert slo.totals["interactive"] == [3, 2, 2, 1]
