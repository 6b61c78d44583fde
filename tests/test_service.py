"""The service-time model: a job's time from its own size, with rates learnt online."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.ledger import Completed, Refusal, Slot, SlotLedger
from governor.service import JobSize, ServiceModel

from .test_ledger import FakeClock

PREFILL_S, DECODE_S = 0.002, 0.03  # per token: a small model on a CPU


def finish(ledger: SlotLedger, clock: FakeClock, size: JobSize, completion: int) -> None:
    """Run one job of ``size`` that produced ``completion`` tokens at the rates above."""
    slot = ledger.admit(size=size)
    assert isinstance(slot, Slot)
    ttft = size.prompt_tokens * PREFILL_S
    clock.now += ttft + (completion - 1) * DECODE_S
    slot.release(done=Completed(size.prompt_tokens, completion, ttft))


def test_jobs_tenfold_apart_in_size_are_predicted_tenfold_apart() -> None:
    model = ServiceModel(base_s=1.0)
    assert model.predict_s(JobSize(100, 50)) == 1.0  # nothing learnt: the runner's guess
    model.observe(JobSize(200, 100), held_s=0.4 + 99 * DECODE_S, ttft_s=0.4, completion_tokens=100)
    small, large = model.predict_s(JobSize(50, 20)), model.predict_s(JobSize(500, 200))
    assert small == pytest.approx(50 * PREFILL_S + 20 * DECODE_S)
    assert large == pytest.approx(10 * small)


def test_a_job_that_stops_early_teaches_the_completion_ratio() -> None:
    model = ServiceModel(base_s=1.0)
    for _ in range(30):  # every job stops at half its max_new_tokens
        model.observe(
            JobSize(10, 100), held_s=0.02 + 49 * DECODE_S, ttft_s=0.02, completion_tokens=50
        )
    assert model.ratio == pytest.approx(0.5)
    assert model.predict_s(JobSize(10, 100)) == pytest.approx(10 * PREFILL_S + 50 * DECODE_S)


def test_the_hint_follows_the_running_jobs_own_sizes() -> None:
    clock = FakeClock()
    ledger = SlotLedger(2, expected_service_s=1.0, clock=clock)
    finish(ledger, clock, JobSize(100, 100), 100)  # learns the rates
    short, long = JobSize(20, 10), JobSize(1000, 400)
    for size in (long, short):
        assert isinstance(ledger.admit(size=size), Slot)
    refusal = ledger.admit(size=short)
    assert isinstance(refusal, Refusal)
    # The short job's own end (0.34 s), not a mean of the two (about 7 s).
    expected = 20 * PREFILL_S + 10 * DECODE_S
    assert refusal.retry_hint_ms == pytest.approx(expected * 1000, abs=2)


def test_a_job_that_did_not_finish_teaches_nothing() -> None:
    clock = FakeClock()
    ledger = SlotLedger(1, expected_service_s=1.0, clock=clock)
    slot = ledger.admit(size=JobSize(100, 100))
    assert isinstance(slot, Slot)
    clock.now += 50.0
    slot.release()  # a runner failure, a cancel: done is None
    assert ledger.model.prefill_s is None
    assert ledger.model.base_s == 1.0
    assert ledger.service_s == 1.0


SIZES = st.builds(JobSize, st.integers(0, 10_000), st.integers(1, 4096))
OBSERVATIONS = st.lists(
    st.tuples(SIZES, st.floats(0.001, 100.0), st.floats(0.0, 1.0), st.integers(1, 4096)),
    max_size=20,
)


@given(observations=OBSERVATIONS, a=SIZES, b=SIZES)
def test_a_larger_job_is_never_predicted_shorter(
    observations: list[tuple[JobSize, float, float, int]], a: JobSize, b: JobSize
) -> None:
    model = ServiceModel(base_s=1.0)
    for size, held, share, completion in observations:
        model.observe(size, held, held * share, completion)
    low = JobSize(min(a.prompt_tokens, b.prompt_tokens), min(a.max_new_tokens, b.max_new_tokens))
    high = JobSize(max(a.prompt_tokens, b.prompt_tokens), max(a.max_new_tokens, b.max_new_tokens))
    assert 0.0 <= model.predict_s(low) <= model.predict_s(high)
