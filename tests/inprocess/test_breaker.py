"""The circuit breaker: pure state machine with a fake clock, then in the server over sockets."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from clients import GovernorClient, RetryBudget, RetryPolicy
from governor.core.breaker import BreakerSettings, BreakerState, CircuitBreaker
from governor.runners import StubRunner
from tests.clock import FakeClock
from tests.conftest import ServerFactory, wait_until

SETTINGS = BreakerSettings(window_s=10.0, min_failures=3, error_rate=0.5, cooldown_s=5.0)


def breaker(clock: FakeClock, **settings: Any) -> CircuitBreaker:
    return CircuitBreaker(dataclasses.replace(SETTINGS, **settings), clock)


def state(b: CircuitBreaker) -> BreakerState:
    """(Read through a call: mypy would keep an attribute narrowed across method calls.)"""
    return b.state


def test_trips_on_count_and_rate_together(clock: FakeClock) -> None:
    b = breaker(clock)
    for failed in (True, False, True):
        b.record(failed)
    assert state(b) == BreakerState.CLOSED  # 2 failures: under the count threshold
    b.record(True)
    assert state(b) == BreakerState.OPEN  # 3 of 4 failed
    assert b.transitions == {("closed", "open"): 1}


def test_a_low_error_rate_never_trips_however_many_failures(clock: FakeClock) -> None:
    b = breaker(clock)
    for i in range(40):
        b.record(i % 3 == 0)  # a third fail: 14 failures, under the 50 % rate
    assert state(b) == BreakerState.CLOSED


def test_failures_leave_the_window(clock: FakeClock) -> None:
    b = breaker(clock)
    b.record(True)
    b.record(True)
    clock.now += 11  # out of the 10 s window
    b.record(True)
    b.record(True)
    assert state(b) == BreakerState.CLOSED
    b.record(True)
    assert state(b) == BreakerState.OPEN


def test_no_verdict_outcomes_count_for_nothing(clock: FakeClock) -> None:
    b = breaker(clock, min_failures=1, error_rate=0.1)
    for _ in range(10):
        b.record(None)
    assert state(b) == BreakerState.CLOSED


def test_open_waits_out_the_cooldown_then_lets_one_trial_through(clock: FakeClock) -> None:
    b = breaker(clock, min_failures=1)
    b.record(True)
    assert b.retry_after_s(trial_s=0.5) == pytest.approx(5.0)
    clock.now += 3
    assert b.retry_after_s(trial_s=0.5) == pytest.approx(2.0)
    clock.now += 2
    assert b.retry_after_s(trial_s=0.5) is None
    assert state(b) == BreakerState.HALF_OPEN
    assert b.started() is True
    # While the trial runs, the others wait about one trial's time.
    assert b.retry_after_s(trial_s=0.5) == 0.5
    assert b.started() is False


def in_trial(clock: FakeClock) -> CircuitBreaker:
    """A breaker opened by one failure, its cooldown over, its trial job started."""
    b = breaker(clock, min_failures=1)
    b.record(True)
    clock.now += 5
    assert b.retry_after_s(trial_s=1) is None
    assert b.started()
    return b


def test_a_trial_that_succeeds_closes_it(clock: FakeClock) -> None:
    b = in_trial(clock)
    b.record(False, trial=True)
    assert state(b) == BreakerState.CLOSED
    assert b.retry_after_s(trial_s=1) is None
    b.record(False)  # and the window starts afresh: an old failure does not linger
    assert state(b) == BreakerState.CLOSED


def test_a_trial_that_fails_opens_it_for_another_cooldown(clock: FakeClock) -> None:
    b = in_trial(clock)
    b.record(True, trial=True)
    assert state(b) == BreakerState.OPEN
    assert b.retry_after_s(trial_s=1) == pytest.approx(5.0)
    assert b.transitions == {
        ("closed", "open"): 1,
        ("open", "half_open"): 1,
        ("half_open", "open"): 1,
    }


def test_a_trial_without_verdict_frees_the_trial(clock: FakeClock) -> None:
    b = in_trial(clock)
    b.record(None, trial=True)  # its client left
    assert state(b) == BreakerState.HALF_OPEN
    assert b.retry_after_s(trial_s=1) is None
    assert b.started()


def test_zero_min_failures_turns_it_off(clock: FakeClock) -> None:
    b = breaker(clock, min_failures=0)
    for _ in range(100):
        b.record(True)
    assert state(b) == BreakerState.CLOSED


# In the server -------------------------------------------------------------------------


async def test_the_breaker_trips_under_an_injected_error_rate_and_recovers(
    make_server: ServerFactory,
) -> None:
    runner = StubRunner(0.01, fail_rate=1.0, seed=1)
    server = await make_server(
        runner,
        max_inflight=2,
        breaker_failures=3,
        breaker_error_rate=0.5,
        breaker_cooldown=0.5,
        probe_interval=60,  # only jobs decide here: the probe is tested below
    )
    host, port = server.address
    async with await GovernorClient.connect(host, port) as client:
        once = RetryPolicy(max_attempts=1)
        failed = [await client.upload(f"job {i}".encode(), retry=once) for i in range(3)]
        assert [r.reply.need_code for r in failed] == ["backend_error"] * 3
        assert server.primary.breaker.state == BreakerState.OPEN
        # Open: a fast, cheap refusal instead of a slot spent on a doomed job.
        refused = await client.upload(b"while open", retry=once)
        assert (refused.status, refused.reply.need_code) == ("yield", "breaker_open")
        assert refused.reply.error_code == "unavailable"
        assert 0 < (refused.reply.retry_hint_ms or 0) <= 500
        assert server.ledger.executed_total == 3
    runner.fail_rate = 0.0  # the backend heals
    # A new client (the first one's retry budget is spent on those failures) honours the
    # hint; after the cooldown its job is the half-open trial.
    async with await GovernorClient.connect(host, port) as client:
        healed = await client.upload(b"after the cooldown", retry=RetryPolicy(max_attempts=5))
        assert healed.done
    assert state(server.primary.breaker) == BreakerState.CLOSED
    assert server.primary.breaker.transitions == {
        ("closed", "open"): 1,
        ("open", "half_open"): 1,
        ("half_open", "closed"): 1,
    }
    assert server.admission.refusals[("breaker_open", "-", "default")] >= 1


async def test_the_probe_is_the_trial_when_no_job_comes(make_server: ServerFactory) -> None:
    runner = StubRunner(0.01, fail_rate=1.0, seed=1)
    server = await make_server(
        runner, breaker_failures=2, breaker_cooldown=0.3, probe_interval=0.05
    )
    host, port = server.address
    async with await GovernorClient.connect(host, port) as client:
        for _ in range(2):
            await client.upload(b"fails", retry=RetryPolicy(max_attempts=1))
    assert server.primary.breaker.state == BreakerState.OPEN
    # After each cooldown the probe is the trial; while the backend fails, it opens it again.
    await wait_until(lambda: server.primary.breaker.transitions[("half_open", "open")] >= 1, 5)
    runner.fail_rate = 0.0
    await wait_until(lambda: server.primary.breaker.state == BreakerState.CLOSED, 5)


async def test_while_open_jobs_go_to_the_fallback_pool(make_server: ServerFactory) -> None:
    server = await make_server(
        max_inflight=2,
        stub_ms=10,
        lanes=True,
        interactive_reserve=1,
        fallback_model="embedded",
        breaker_failures=1,
        breaker_cooldown=60,
    )
    assert server.fallback is not None
    primary = server.runner
    assert isinstance(primary, StubRunner)
    primary.fail_rate = 1.0
    host, port = server.address
    async with await GovernorClient.connect(host, port) as client:
        failed = await client.upload(b"fails on the primary", retry=RetryPolicy(max_attempts=1))
        assert failed.reply.need_code == "backend_error"
        assert server.primary.breaker.state == BreakerState.OPEN
        rescued = await client.upload(b"any lane", retry=RetryPolicy(max_attempts=1))
    assert rescued.done
    assert rescued.reply.result is not None
    assert rescued.reply.result["degraded"] == ["breaker_fallback"]
    assert server.fallback.ledger.executed_total == 1
    assert server.admission.ladder == {"breaker_fallback": 1}
    assert server.metrics.finished[("done", "-", "fallback")] == 1


async def test_a_retry_budget_keeps_clients_from_storming_an_open_breaker(
    make_server: ServerFactory,
) -> None:
    server = await make_server(
        StubRunner(0.001, fail_rate=1.0, seed=1),
        max_inflight=4,
        breaker_failures=1,
        breaker_cooldown=60,
        probe_interval=60,
    )
    host, port = server.address
    budget = RetryBudget()
    clients = [await GovernorClient.connect(host, port, retry_budget=budget) for _ in range(5)]
    try:
        await clients[0].upload(b"trips it", retry=RetryPolicy(max_attempts=1))
        assert server.primary.breaker.state == BreakerState.OPEN
        # A tiny hint ceiling, so that only the budget can stop the retries.
        storm = RetryPolicy(max_attempts=20, max_sleep_s=0.001)
        results = await asyncio.gather(
            *(c.upload(f"{i}".encode(), retry=storm) for i, c in enumerate(clients * 4))
        )
    finally:
        for c in clients:
            await c.close()
    attempts = sum(r.attempts for r in results)
    assert all(r.reply.need_code == "breaker_open" for r in results)
    # 20 uploads: without a budget, 400 attempts; with it, a first attempt each and the few
    # retries the budget had in it.
    assert attempts <= 20 + budget.max_tokens
    assert sum(r.budget_exhausted for r in results) >= 20 - budget.max_tokens
