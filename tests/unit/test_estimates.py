"""The service-time estimates on their own: pure, the time passed in."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.core.estimates import EWMA_ALPHA, Completed, ServiceEstimates
from governor.core.policy import Lane
from governor.core.service import JobSize


@dataclass
class Job:
    """A running job, as a slot is to the estimates."""

    started: float
    expected_s: float
    size: JobSize | None = None
    pace_s: float | None = None
    live_end: float | None = None
    fed_from: tuple[float, int, float] | None = None
    paused_s: float = 0.0


def test_the_hold_is_two_turnarounds_at_most_the_grace() -> None:
    estimates = ServiceEstimates(1.0, 0.005)
    assert (estimates.grace(), estimates.hold()) == (0.25, 0.01)
    estimates.came_back(2.0)  # a slot waited two seconds for its client
    assert estimates.turnaround_s == pytest.approx(0.005 + EWMA_ALPHA * (2.0 - 0.005))
    assert estimates.hold() == 0.25
    short = ServiceEstimates(0.01, 0.005)
    assert short.grace() == 0.02  # a client's jitter is never under 20 ms


def test_a_completed_job_teaches_the_means_and_a_failed_one_nothing() -> None:
    estimates = ServiceEstimates(1.0, 0.005)
    estimates.ended(Job(0.0, 1.0), Lane.HEAVY, 3.0, None)
    assert (estimates.service_s, estimates.error, estimates.lane_service_s) == (1.0, 0.0, {})
    estimates.ended(Job(0.0, 1.0), Lane.HEAVY, 3.0, Completed())
    assert estimates.service_s == pytest.approx(1.0 + EWMA_ALPHA * 2.0)
    assert estimates.error == pytest.approx(EWMA_ALPHA * 2.0)
    assert estimates.lane_service_s == {Lane.HEAVY: 3.0}  # a lane's first job is its mean
    assert estimates.service_for(Lane.HEAVY) == 3.0
    assert estimates.service_for(Lane.BACKGROUND) == estimates.service_s
    assert estimates.model.observed == 1


def test_a_jobs_end_follows_its_progress_while_it_is_ahead() -> None:
    estimates = ServiceEstimates(1.0, 0.005)
    job = Job(0.0, 1.0, JobSize(10, 16))
    assert estimates.end_of(job, 0.5) == estimates.expected_end(0.0, 0.5, 1.0) == 1.0
    estimates.progress(job, 6, 0.1, 0.6)  # 5 tokens in 0.5 s: 100 ms a token, 10 to go
    assert job.live_end == pytest.approx(1.6)
    assert estimates.end_of(job, 0.6) == job.live_end
    assert estimates.end_of(job, 1.7) == estimates.expected_end(0.0, 1.7, 1.0)  # past it


REPORTS = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 40), st.booleans()),  # (job, tokens, end it)
    max_size=40,
)


@given(reports=REPORTS)
def test_the_running_pace_is_the_mean_of_the_running_jobs_and_back_to_none(
    reports: list[tuple[int, int, bool]],
) -> None:
    estimates = ServiceEstimates(1.0, 0.005)
    jobs = [Job(0.0, 1.0, JobSize(10, 32)) for _ in range(5)]
    running = set(range(5))
    now = 1.0
    for i, tokens, end in reports:
        now += 0.25
        if i not in running:
            continue
        if end:
            estimates.ended(jobs[i], None, now, None)
            running.discard(i)
        else:
            estimates.progress(jobs[i], tokens, 0.5, now)
        paces = [pace for j in running if (pace := jobs[j].pace_s) is not None]
        assert estimates.paced == len(paces)
        if paces:
            assert estimates.running_pace() == pytest.approx(sum(paces) / len(paces))
        else:
            assert estimates.running_pace() is None
    for i in running:
        estimates.ended(jobs[i], None, now, None)
    assert (estimates.paced, estimates.running_pace()) == (0, None)
