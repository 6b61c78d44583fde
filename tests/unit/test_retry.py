"""The retry choice of one upload, without sockets: :class:`clients.retry.RetryChoice` over a
policy, a shared budget and a seeded random generator."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.retry import (
    DEFAULT_RETRY,
    NO_RETRY,
    RetryBudget,
    RetryChoice,
    RetryPolicy,
    backend_failing,
)
from protocol.codes import ErrorCode, NeedCode, Status, Verb
from protocol.frames import Reply


def yielded(need_code: str, hint_ms: int | None = 10) -> Reply:
    return Reply(
        verb=Verb.CLARIFY,
        job="J",
        seq=2,
        status=Status.YIELD,
        need_code=need_code,
        error_code=ErrorCode.BUSY,
        retry_hint_ms=hint_ms,
    )


def done() -> Reply:
    return Reply(verb=Verb.CONFIRM, job="J", seq=2, status=Status.DONE)


def aborted(need_code: str, error_code: str) -> Reply:
    return Reply(
        verb=Verb.CONFIRM,
        job="J",
        seq=2,
        status=Status.ABORT,
        need_code=need_code,
        error_code=error_code,
    )


def choice(
    policy: RetryPolicy = DEFAULT_RETRY, budget: RetryBudget | None = None, seed: int = 0
) -> RetryChoice:
    return RetryChoice(policy, budget or RetryBudget(), random.Random(seed))


# Examples ------------------------------------------------------------------------------


def test_a_terminal_answer_ends_the_upload() -> None:
    c = choice()
    assert c.after(done()) is None
    assert (c.attempts, c.yields, c.budget_exhausted) == (1, [], False)


def test_a_busy_yield_waits_its_hint_and_a_little_jitter() -> None:
    c = choice(RetryPolicy(jitter_ratio=0.1, max_jitter_s=0.002))
    wait = c.after(yielded(NeedCode.SERVER_BUSY, 10))
    assert wait is not None
    assert 0.010 <= wait <= 0.0110
    assert c.attempts == 1
    assert len(c.yields) == 1


def test_no_hint_counts_as_fifty_milliseconds() -> None:
    wait = choice(RetryPolicy(jitter_ratio=0)).after(yielded(NeedCode.SERVER_BUSY, None))
    assert wait == 0.05


def test_a_fixed_delay_ignores_the_hint_and_never_goes_negative() -> None:
    assert choice(RetryPolicy(fixed_delay_s=0.5)).after(yielded("lane_full", 3000)) == 0.5
    assert choice(RetryPolicy(fixed_delay_s=-1.0)).after(yielded("lane_full", 3000)) == 0.0


def test_the_wait_is_capped() -> None:
    assert choice(RetryPolicy(max_sleep_s=1.0)).after(yielded("lane_full", 60_000)) == 1.0


def test_attempts_are_bounded_by_the_policy() -> None:
    c = choice(RetryPolicy(max_attempts=3))
    waits = [c.after(yielded(NeedCode.SERVER_BUSY)) for _ in range(3)]
    assert [w is not None for w in waits] == [True, True, False]
    assert c.attempts == 3
    assert choice(NO_RETRY).after(yielded(NeedCode.SERVER_BUSY)) is None


def test_draining_is_never_retried() -> None:
    c = choice()
    assert c.after(yielded(NeedCode.DRAINING)) is None
    assert not c.budget_exhausted


def test_breaker_open_retries_stop_at_half_the_budget() -> None:
    budget = RetryBudget(max_tokens=4)
    c = choice(budget=budget)
    assert c.after(yielded(NeedCode.BREAKER_OPEN)) is not None  # 3 of 4 left
    assert c.after(yielded(NeedCode.BREAKER_OPEN)) is None  # 2 of 4: not more than half
    assert c.budget_exhausted
    assert budget.tokens == 2


def test_a_cooldown_longer_than_the_client_waits_ends_the_upload() -> None:
    c = choice(RetryPolicy(max_sleep_s=1.0))
    assert c.after(yielded(NeedCode.BREAKER_OPEN, 1001)) is None
    assert not c.budget_exhausted
    # A busy yield with that hint is still retried (after the capped wait).
    assert choice(RetryPolicy(max_sleep_s=1.0)).after(yielded("lane_full", 1001)) == 1.0


def test_answers_are_booked_in_the_budget() -> None:
    budget = RetryBudget(max_tokens=10, token_ratio=0.5)
    choice(budget=budget).after(aborted(NeedCode.BACKEND_ERROR, ErrorCode.BACKEND_ERROR))
    assert budget.tokens == 9
    choice(budget=budget).after(aborted(NeedCode.CANCELLED, ErrorCode.CANCELLED))
    assert budget.tokens == 9  # not a failure signal
    choice(budget=budget).after(done())
    assert budget.tokens == 9.5
    choice(budget=budget).after(yielded(NeedCode.SERVER_BUSY))
    assert budget.tokens == 9.5  # flow control: neither


def test_failure_signals() -> None:
    assert backend_failing(yielded(NeedCode.BREAKER_OPEN))
    assert backend_failing(aborted(NeedCode.BACKEND_ERROR, ErrorCode.BACKEND_ERROR))
    assert not backend_failing(yielded(NeedCode.SERVER_BUSY))
    assert not backend_failing(done())


def test_the_jitter_is_the_generator_s() -> None:
    reply = yielded(NeedCode.SERVER_BUSY, 20)
    assert choice(seed=7).after(reply) == choice(seed=7).after(reply)
    assert len({choice(seed=s).after(reply) for s in range(20)}) > 1


# Properties ------------------------------------------------------------------------------

YIELD_CODES = [
    NeedCode.SERVER_BUSY,
    NeedCode.LANE_FULL,
    NeedCode.BREAKER_OPEN,
    NeedCode.DRAINING,
    "fleet_busy",
    "some_future_code",
]
replies = st.one_of(
    st.builds(
        yielded,
        st.sampled_from(YIELD_CODES),
        st.one_of(st.none(), st.integers(0, 20_000)),
    ),
    st.just(done()),
    st.just(aborted(NeedCode.BACKEND_ERROR, ErrorCode.BACKEND_ERROR)),
    st.just(aborted(NeedCode.CANCELLED, ErrorCode.CANCELLED)),
)
policies = st.builds(
    RetryPolicy,
    max_attempts=st.integers(1, 12),
    fixed_delay_s=st.one_of(st.none(), st.floats(-1.0, 2.0)),
    jitter_ratio=st.floats(0.0, 1.0),
    max_jitter_s=st.floats(0.0, 0.5),
    max_sleep_s=st.floats(0.0, 10.0),
)
budgets = st.builds(RetryBudget, max_tokens=st.floats(0.5, 20.0), token_ratio=st.floats(0.01, 1.0))


@settings(max_examples=300, deadline=None)
@given(policies, budgets, st.lists(replies, min_size=1, max_size=30), st.integers(0, 2**32))
def test_waits_are_bounded_and_attempts_end(
    policy: RetryPolicy, budget: RetryBudget, answers: list[Reply], seed: int
) -> None:
    c = choice(policy, budget, seed)
    for reply in answers:
        before = budget.tokens
        wait = c.after(reply)
        if wait is None:
            break
        assert reply.status == Status.YIELD
        assert reply.need_code != NeedCode.DRAINING
        assert c.attempts < policy.max_attempts
        assert wait >= 0
        if policy.fixed_delay_s is not None:
            assert wait == max(policy.fixed_delay_s, 0)
        else:
            hint_s = (reply.retry_hint_ms or 50) / 1000
            assert min(hint_s, policy.max_sleep_s) <= wait <= policy.max_sleep_s
            assert wait <= hint_s + policy.max_jitter_s
        if backend_failing(reply):
            assert budget.tokens == pytest.approx(max(before - 1, 0))
            assert 2 * budget.tokens > budget.max_tokens
            assert (reply.retry_hint_ms or 0) / 1000 <= policy.max_sleep_s
    assert c.attempts <= policy.max_attempts
    assert c.attempts <= len(answers)
    assert len(c.yields) <= c.attempts
    if c.budget_exhausted:
        assert c.yields[-1].need_code == NeedCode.BREAKER_OPEN


@settings(max_examples=100, deadline=None)
@given(budgets, st.integers(1, 40), st.integers(1, 12))
def test_a_breaker_storm_gets_at_most_half_the_budget_in_retries(
    budget: RetryBudget, uploads: int, max_attempts: int
) -> None:
    # Every upload sharing the budget meets breaker_open on each attempt, nothing succeeds.
    policy = RetryPolicy(max_attempts=max_attempts)
    retries = 0
    for n in range(uploads):
        c = choice(policy, budget, n)
        while c.after(yielded(NeedCode.BREAKER_OPEN, 10)) is not None:
            retries += 1
    assert retries <= budget.max_tokens / 2
    assert retries <= uploads * (max_attempts - 1)
