"""The service-time estimates on their own: pure, the time passed in."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.core.estimates import (
    EWMA_ALPHA,
    PACE_WEIGHT,
    Batch,
    Completed,
    ServiceEstimates,
)
from governor.core.policy import Lane
from governor.core.service import JobSize


@dataclass
class Job:
    """A running job, as a slot is to the estimates."""

    started: float
    expected_s: float
    size: JobSize | None = None
    tpot_s: float = 0.0
    first_token: float | None = None
    fed: int = 0
    generated: int = 0
    ticked: tuple[float, int] | None = None
    pace_s: float | None = None
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
    job = Job(0.0, 1.0, JobSize(10, 16), first_token=0.1, generated=1, ticked=(0.1, 1))
    assert estimates.end_of(job, 0.5) == estimates.expected_end(0.0, 0.5, 1.0) == 1.0
    estimates.progress(job, 6, 0.6, clean=True)  # 5 tokens in 0.5 s: 100 ms a token, 10 to go
    assert job.pace_s == pytest.approx(0.1)
    assert estimates.end_of(job, 0.6) == pytest.approx(1.6)
    assert estimates.end_of(job, 0.6, Batch(prompts_s=2.0)) == pytest.approx(3.6)  # to feed
    # (each of its 10 steps 1 ms dearer than the one before: half of 10 x 10 ms more)
    assert estimates.end_of(job, 0.6, Batch(growth_s=0.001)) == pytest.approx(1.6 + 0.05)
    estimates.progress(job, 16, 1.7, clean=True)  # at its expected length: unknown again
    assert estimates.end_of(job, 1.7) == estimates.expected_end(0.0, 1.7, 1.0)


def test_a_pace_learns_only_from_intervals_without_prompts_and_forgets_slowly() -> None:
    """An interval in which a prompt was fed is not the pace (the prompts are counted apart),
    and one slow interval moves a measured pace by its weight a token."""
    estimates = ServiceEstimates(1.0, 0.005)
    job = Job(0.0, 1.0, JobSize(10, 100), first_token=0.1, generated=1, ticked=(0.1, 1))
    estimates.progress(job, 3, 2.1, clean=False)  # two tokens beside a long prompt
    assert (job.pace_s, job.ticked, estimates.paced) == (None, (2.1, 3), 0)
    estimates.progress(job, 5, 2.3, clean=True)
    assert job.pace_s == pytest.approx(0.1)
    estimates.progress(job, 6, 3.3, clean=True)  # one token of a second
    assert job.pace_s == pytest.approx(0.1 + PACE_WEIGHT * 0.9)
    assert estimates.running_pace() == job.pace_s


REPORTS = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 40), st.booleans()),  # (job, tokens, end it)
    max_size=40,
)


@given(reports=REPORTS)
def test_the_running_pace_is_the_mean_of_the_running_jobs_and_back_to_none(
    reports: list[tuple[int, int, bool]],
) -> None:
    estimates = ServiceEstimates(1.0, 0.005)
    jobs = [Job(0.0, 1.0, JobSize(10, 32), ticked=(0.5, 1)) for _ in range(5)]
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
            estimates.progress(jobs[i], tokens, now, clean=True)
        paces = [pace for j in running if (pace := jobs[j].pace_s) is not None]
        assert estimates.paced == len(paces)
        if paces:
            assert estimates.running_pace() == pytest.approx(sum(paces) / len(paces))
        else:
            assert estimates.running_pace() is None
    for i in running:
        estimates.ended(jobs[i], None, now, None)
    assert (estimates.paced, estimates.running_pace()) == (0, None)
