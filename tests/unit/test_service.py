"""The service-time model: a job's time from its own size, with rates learnt online."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.core.ledger import Completed, Refusal, Slot, SlotLedger
from governor.core.policy import Demand, Lane, LanePolicy
from governor.core.service import JobSize, ServiceModel
from governor.runners.base import Rates
from tests.clock import FakeClock

# A small model on a CPU: a fixed overhead per job, then per prompt and per output token.
BASE_S, PREFILL_S, DECODE_S = 0.05, 0.002, 0.03


def machine_s(prompt: int, out: int) -> tuple[float, float]:
    """(ttft, held) of a job on that machine."""
    ttft = BASE_S + prompt * PREFILL_S
    return ttft, ttft + max(out - 1, 0) * DECODE_S


def teach(model: ServiceModel, size: JobSize, out: int | None = None) -> None:
    out = size.max_new_tokens if out is None else out
    ttft, held = machine_s(size.prompt_tokens, out)
    model.observe(size, size.prompt_tokens, out, ttft, held)


def finish(
    ledger: SlotLedger, clock: FakeClock, size: JobSize, demand: Demand | None = None
) -> None:
    """Run one job of ``size`` to its end on that machine, through the ledger."""
    slot = ledger.admit(demand=demand, size=size)
    assert isinstance(slot, Slot)
    ttft, held = machine_s(size.prompt_tokens, size.max_new_tokens)
    clock.now += held
    slot.release(done=Completed(size.prompt_tokens, size.max_new_tokens, ttft))


def test_nothing_learnt_predicts_the_runners_own_estimate() -> None:
    model = ServiceModel(1.5)
    assert model.predict_s(JobSize(100, 50)) == 1.5
    assert model.predict_s(None) == 1.5
    assert not model.knows(JobSize(100, 50))


def test_the_runners_rates_predict_a_sized_job_the_learnt_ones_where_it_says_none() -> None:
    """Where the runner says what its tokens cost (the batched llama runner, from its steps),
    a job is predicted from its size at those rates, before any job has finished and after:
    a finished job's times on a batched runner say what the load was, not what a token
    costs. The rates learnt (and the overhead) serve once the runner says nothing."""
    model = ServiceModel(2.0)
    said = Rates(prompt_s=0.004, decode_s=0.06)
    model.assumed = lambda: said
    rewrite = JobSize(762, 400)
    assert model.knows(rewrite)
    assert model.predict_s(rewrite) == pytest.approx(762 * 0.004 + 399 * 0.06)
    assert model.predict_s(None) == 2.0  # (no size: the mean)
    for size in (JobSize(100, 20), JobSize(10, 20)):
        teach(model, size)
    assert model.predict_s(rewrite) == pytest.approx(762 * 0.004 + 399 * 0.06)
    model.assumed = lambda: None  # (the runner no longer says: what was learnt stands)
    assert model.predict_s(rewrite) == pytest.approx(machine_s(762, 400)[1], rel=0.01)


RATES = Rates(prompt_s=0.004, decode_s=0.05)


def four_running(rewrite: JobSize) -> SlotLedger:
    """Four slots on a runner that says its rates (:data:`RATES`), a ``rewrite`` in each."""
    ledger = SlotLedger(4, expected_service_s=2.0, clock=FakeClock())
    ledger.estimates.model.assumed = lambda: RATES
    for _ in range(4):
        assert isinstance(ledger.admit(size=rewrite), Slot)
    return ledger


def test_the_first_rewrites_refused_wait_for_the_running_ones_ends_from_their_size() -> None:
    """Six rewrites at once on four slots, none finished yet: the two refused are told the
    running rewrites' predicted end from their size (762 prompt tokens, 400 out, at the rates
    the runner said), every prompt fed before any rewrite's last tokens, not the runner's
    prior of 2 s (told 1.3 s for slots that freed 50 s later, each refused a dozen times). The
    four end together: the second refused takes a slot freed with the first's."""
    rewrite = JobSize(762, 400)
    ledger = four_running(rewrite)
    end_s = 4 * 762 * RATES.prompt_s + 399 * RATES.decode_s
    refused = [ledger.admit(size=rewrite) for _ in range(2)]
    hints = [r.retry_hint_ms for r in refused if isinstance(r, Refusal)]
    assert hints == [pytest.approx(end_s * 1000, abs=2)] * 2


def test_a_running_job_ends_after_the_prompts_fed_at_the_releases_before_it() -> None:
    """A chat and a rewrite running on two slots of a runner that feeds prompts beside every
    stream; four rewrites refused: the first is told the chat's end, the second the running
    rewrite's end after the first refused one's prompt, fed beside it from the chat's end; the
    fourth waits a turn past that same end."""
    ledger = SlotLedger(2, expected_service_s=2.0, clock=FakeClock())
    ledger.estimates.model.assumed = lambda: RATES
    chat, rewrite = JobSize(100, 20), JobSize(762, 400)
    running = [ledger.admit(size=size) for size in (chat, rewrite)]
    ends = [ledger.slot_end(slot, 0.0) for slot in running if isinstance(slot, Slot)]
    refused = [ledger.admit(size=rewrite) for _ in range(4)]
    parts = [r.parts for r in refused if isinstance(r, Refusal) and r.parts is not None]
    assert len(parts) == 4
    prompt_s = 762 * RATES.prompt_s
    assert parts[0].ms == pytest.approx(ends[0] * 1000, abs=2)
    assert parts[1].ms == pytest.approx((ends[1] + prompt_s) * 1000, abs=2)
    assert parts[3].ahead == 3
    assert parts[3].release_ms == pytest.approx(parts[1].ms, abs=2)


def test_a_turn_on_a_batched_runner_holds_the_prompts_of_the_other_slots_new_jobs() -> None:
    """Nine rewrites at once on four slots: the ninth waits a turn past the running rewrites'
    end, and that turn, on a runner that feeds prompts beside every stream, holds the prompts
    of the jobs the three other slots take meanwhile as well as its own job."""
    rewrite = JobSize(200, 100)
    ledger = four_running(rewrite)
    end_s = 4 * 200 * RATES.prompt_s + 99 * RATES.decode_s
    ninth = [ledger.admit(size=rewrite) for _ in range(5)][-1]
    assert isinstance(ninth, Refusal)
    assert ninth.parts is not None
    assert ninth.parts.release_ms == pytest.approx(end_s * 1000, abs=2)
    turn_s = ledger.estimates.predict_s(rewrite) + ledger.turnaround_s
    others_s = 3 * 200 * RATES.prompt_s
    assert ninth.parts.turns_ms == pytest.approx((turn_s + others_s) * 1000, abs=2)


@given(
    max_new=st.integers(2, 400),
    steps=st.lists(st.floats(0.01, 0.2), min_size=400, max_size=400),
    rates=st.builds(Rates, st.floats(0.0, 0.01), st.floats(0.001, 0.5)),
)
def test_a_running_jobs_predicted_end_converges_to_its_true_end_as_its_tokens_come_out(
    max_new: int, steps: list[float], rates: Rates
) -> None:
    """Whatever the runner said and however its pace varies, once a job generates, the error
    of its predicted end is at most its tokens left times the spread of its pace: it closes
    as its tokens come out, to none at its next to last."""
    clock = FakeClock()
    ledger = SlotLedger(1, expected_service_s=2.0, clock=clock)
    ledger.estimates.model.assumed = lambda: rates
    slot = ledger.admit(size=JobSize(10, max_new))
    assert isinstance(slot, Slot)
    times = [clock.now + 0.1]  # (its first token)
    for step in steps[: max_new - 1]:
        times.append(times[-1] + step)
    end = times[-1]
    spread = max(steps[: max_new - 1]) - min(steps[: max_new - 1])
    slot.begin(times[0])
    for generated in range(2, max_new):
        clock.now = times[generated - 1]
        slot.progress(generated, clock.now)
        predicted = ledger.estimates.end_of(slot, clock.now)
        left = max_new - generated
        assert abs(predicted - max(end, clock.now + ledger.estimates.floor_s)) <= (
            left * spread + 1e-6
        )


def test_jobs_tenfold_apart_in_size_are_predicted_from_their_own_sizes() -> None:
    model = ServiceModel(1.0)
    for prompt, max_new in [(40, 10), (400, 100), (120, 30), (800, 5), (10, 200)] * 4:
        teach(model, JobSize(prompt, max_new))
    assert model.base_s == pytest.approx(BASE_S, rel=0.02)
    assert model.prefill_s == pytest.approx(PREFILL_S, rel=0.02)
    assert model.decode_s == pytest.approx(DECODE_S, rel=1e-6)
    small, large = JobSize(50, 20), JobSize(500, 200)
    assert model.predict_s(small) == pytest.approx(machine_s(50, 20)[1], rel=0.01)
    assert model.predict_s(large) == pytest.approx(machine_s(500, 200)[1], rel=0.01)
    assert model.predict_s(large) > 9 * model.predict_s(small)


def test_the_first_job_is_all_prefill_until_prompts_differ() -> None:
    """One point cannot tell the overhead from the rate: the line goes through the origin."""
    model = ServiceModel(1.0)
    teach(model, JobSize(200, 100))
    assert model.base_s == pytest.approx(0.0, abs=1e-12)
    assert model.prefill_s == pytest.approx((BASE_S + 200 * PREFILL_S) / 200)
    assert model.predict_s(JobSize(200, 100)) == pytest.approx(machine_s(200, 100)[1])
    teach(model, JobSize(20, 100))  # a second prompt length: the overhead shows
    assert model.base_s == pytest.approx(BASE_S, rel=0.005)  # (less the prior's pull)


def test_a_job_that_stops_early_teaches_the_completion_ratio() -> None:
    model = ServiceModel(1.0)
    for _ in range(40):  # every job stops at half its max_new_tokens
        teach(model, JobSize(10, 100), out=50)
        teach(model, JobSize(30, 100), out=50)
    assert model.ratio == pytest.approx(0.5)
    assert model.decode_s == pytest.approx(DECODE_S)
    assert model.predict_s(JobSize(10, 100)) == pytest.approx(machine_s(10, 50)[1], rel=0.01)
    # Token-weighted: a short job that runs to its end does not hide long ones stopping early.
    ratio = ServiceModel(1.0)
    for _ in range(40):
        teach(ratio, JobSize(10, 10), out=10)
        teach(ratio, JobSize(10, 1000), out=100)
    assert ratio.ratio == pytest.approx(110 / 1010, rel=0.03)  # not (1 + 0.1) / 2


def test_a_job_without_a_first_token_time_teaches_decode_from_the_line() -> None:
    model = ServiceModel(1.0)
    teach(model, JobSize(100, 10))
    teach(model, JobSize(10, 10))
    decode = model.decode_s
    held = machine_s(100, 40)[1]
    model.observe(JobSize(100, 40), 100, 40, None, held + 39 * DECODE_S)  # decoding at half speed
    assert model.decode_s is not None
    assert decode is not None
    assert model.decode_s > decode
    blind = ServiceModel(1.0)  # nothing fitted yet: only the mean and the ratio learn
    blind.observe(JobSize(100, 40), 100, 20, None, 3.0)
    assert not blind.knows(JobSize(100, 40))
    assert blind.ratio == 0.5
    assert blind.mean_s == pytest.approx(1.0 + 0.2 * 2.0)


def test_a_job_without_a_size_is_predicted_as_the_mean_of_jobs() -> None:
    """The stub's raw payloads: today's estimate, an exponentially weighted mean."""
    clock = FakeClock()
    ledger = SlotLedger(1, expected_service_s=1.0, clock=clock)
    for held in (3.0, 2.0, 0.5):
        slot = ledger.admit()
        assert isinstance(slot, Slot)
        clock.now += held
        slot.release(done=Completed())
        assert ledger.model.predict_s(None) == pytest.approx(ledger.service_s)
    assert ledger.service_s != 1.0
    assert ledger.model.prefill_s is None


def test_the_hint_follows_the_running_jobs_own_sizes() -> None:
    clock = FakeClock()
    ledger = SlotLedger(2, expected_service_s=1.0, clock=clock)
    finish(ledger, clock, JobSize(100, 100))  # learns the rates
    finish(ledger, clock, JobSize(10, 100))
    short, long = JobSize(20, 10), JobSize(1000, 400)
    for size in (long, short):
        assert isinstance(ledger.admit(size=size), Slot)
    refusal = ledger.admit(size=short)
    assert isinstance(refusal, Refusal)
    # The short job's own end, its overhead and its tokens at the rates learnt (0.36 s), not
    # the pool's mean (about 3 s) nor the long job's end (each job its own on this runner).
    end_ms = machine_s(20, 10)[1] * 1000
    assert refusal.retry_hint_ms == pytest.approx(end_ms, abs=2)
    # The second refused client waits for the long job: the short slot turns over first.
    second = ledger.admit(size=short)
    assert isinstance(second, Refusal)
    turn_ms = end_ms + ledger.turnaround_s * 1000
    assert second.retry_hint_ms == pytest.approx(end_ms + turn_ms, abs=3)


def test_the_slots_turn_over_at_the_pace_of_the_jobs_waiting_ahead() -> None:
    """A chat behind two long rewrites waits for the rewrites, not for two chats."""
    clock = FakeClock()
    ledger = SlotLedger(1, expected_service_s=1.0, clock=clock)
    finish(ledger, clock, JobSize(100, 100))
    finish(ledger, clock, JobSize(10, 100))
    chat, rewrite = JobSize(20, 10), JobSize(2000, 300)
    assert isinstance(ledger.admit(size=chat), Slot)
    for _ in range(2):
        assert isinstance(ledger.admit(size=rewrite), Refusal)
    refusal = ledger.admit(size=chat)
    assert isinstance(refusal, Refusal)
    end, turn = ledger.model.predict_s(chat), ledger.model.predict_s(rewrite)
    assert turn > 20 * end
    expected = end + 2 * (turn + ledger.turnaround_s)
    assert refusal.retry_hint_ms == pytest.approx(expected * 1000, abs=2)


def test_a_job_that_did_not_finish_teaches_nothing() -> None:
    clock = FakeClock()
    policy = LanePolicy()
    ledger = SlotLedger(2, expected_service_s=1.0, clock=clock, policy=policy)
    demand = Demand(Lane.HEAVY, 200)
    finish(ledger, clock, JobSize(100, 100), demand)
    finish(ledger, clock, JobSize(10, 100), demand)
    model = ledger.model
    before = (model.base_s, model.prefill_s, model.decode_s, model.ratio, model.mean_s)
    service, lanes, observed = ledger.service_s, dict(ledger.lane_service_s), model.observed
    slot = ledger.admit(demand=demand, size=JobSize(100, 100))
    assert isinstance(slot, Slot)
    clock.now += 50.0
    assert slot.release() == 50.0  # a runner failure, a cancel, a timeout: done is None
    assert (model.base_s, model.prefill_s, model.decode_s, model.ratio, model.mean_s) == before
    assert (ledger.service_s, ledger.lane_service_s, model.observed) == (service, lanes, observed)


SIZES = st.builds(JobSize, st.integers(0, 10_000), st.integers(1, 4096))
FINISHED = st.tuples(
    st.one_of(st.none(), SIZES),  # the job's size (None: a raw payload)
    st.floats(0.0, 100.0),  # held_s
    st.one_of(st.none(), st.floats(0.0, 1.0)),  # ttft as a share of held_s (None: not seen)
    st.one_of(st.none(), st.integers(0, 5000)),  # completion tokens (None: not counted)
)


@given(finished=st.lists(FINISHED, max_size=30), a=SIZES, b=SIZES)
def test_a_larger_job_is_never_predicted_shorter(
    finished: list[tuple[JobSize | None, float, float | None, int | None]], a: JobSize, b: JobSize
) -> None:
    model = ServiceModel(1.0)
    for size, held, share, completion in finished:
        ttft = None if share is None else held * share
        model.observe(size, None, completion, ttft, held)
    low = JobSize(min(a.prompt_tokens, b.prompt_tokens), min(a.max_new_tokens, b.max_new_tokens))
    high = JobSize(max(a.prompt_tokens, b.prompt_tokens), max(a.max_new_tokens, b.max_new_tokens))
    assert 0.0 <= model.predict_s(low) <= model.predict_s(high)
    assert 0.0 <= model.ratio <= 1.0


@given(
    base=st.floats(0.0, 1.0),
    prefill=st.floats(0.0, 0.01),
    decode=st.floats(0.001, 0.1),
    sizes=st.lists(SIZES, min_size=2, max_size=20).filter(
        lambda s: max(z.prompt_tokens for z in s) - min(z.prompt_tokens for z in s) >= 50
    ),
)
def test_noiseless_jobs_are_predicted_as_they_ran(
    base: float, prefill: float, decode: float, sizes: list[JobSize]
) -> None:
    model = ServiceModel(1.0)
    for size in sizes:
        ttft = base + size.prompt_tokens * prefill
        held = ttft + (size.max_new_tokens - 1) * decode
        model.observe(size, size.prompt_tokens, size.max_new_tokens, ttft, held)
    for size in sizes:
        ran = base + size.prompt_tokens * prefill + (size.max_new_tokens - 1) * decode
        assert model.predict_s(size) == pytest.approx(ran, rel=0.02, abs=0.005)


JOBS = st.lists(
    st.tuples(st.integers(1, 2000), st.integers(2, 400), st.integers(0, 400)),  # prompt, max, out
    min_size=1,
    max_size=6,
)


@given(jobs=JOBS, rates=st.builds(Rates, st.floats(1e-5, 0.02), st.floats(0.001, 0.5)))
def test_a_hint_is_never_earlier_than_the_release_it_waits_on(
    jobs: list[tuple[int, int, int]], rates: Rates
) -> None:
    """Whatever the running jobs' sizes, their progress and the runner's rates, a client refused
    while every slot is taken is told no sooner than the first running job's predicted end
    (the release it waits on), unless that is past the longest hint."""
    clock = FakeClock()
    ledger = SlotLedger(len(jobs), clock=clock)
    ledger.estimates.model.assumed = lambda: rates
    slots = [ledger.admit(size=JobSize(prompt, max_new)) for prompt, max_new, _ in jobs]
    for slot, (_, max_new, out) in zip(slots, jobs, strict=True):
        assert isinstance(slot, Slot)
        clock.now += 0.5
        if out:
            slot.begin(clock.now)
            clock.now += out * rates.decode_s
            slot.progress(min(out, max_new), clock.now)
    refused = ledger.admit(size=JobSize(100, 10))
    assert isinstance(refused, Refusal)
    release = min(ledger.slot_end(s, clock.now) for s in slots if isinstance(s, Slot))
    wait_ms = (release - clock.now) * 1000
    assert refused.retry_hint_ms >= min(wait_ms - 1e-6, ledger.hints.max_hint_ms)
