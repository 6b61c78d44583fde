"""One job's route over the replicas, without sockets: :class:`clients.fleet.route.JobRoute`
over a :class:`~clients.fleet.Replicas` with a clock moved by hand, fed the results a visit
would have returned."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import TypeVar

import pytest

from clients import NoReplicaAvailable, RetryBudget, RetryPolicy, UploadResult
from clients.fleet import Address, Move, Replicas, ReplicaState
from clients.fleet.route import JobRoute
from protocol.codes import ErrorCode, NeedCode, Receipt, Status, Verb
from protocol.frames import Reply
from tests.clock import FakeClock

T = TypeVar("T")
A, B, C = (Address(f"10.0.0.{i}", 7777) for i in (1, 2, 3))
PACED = RetryPolicy(jitter_ratio=0)  # a move's wait is the hint's length exactly


class InOrder(random.Random):
    """Two "random" choices that are always the first two candidates, in address order."""

    def sample(
        self, population: Sequence[T], k: int, *, counts: Iterable[int] | None = None
    ) -> list[T]:
        return list(population)[:k]


def yielded(code: str = NeedCode.SERVER_BUSY, hint_ms: int = 100, *, held: bool = True) -> Reply:
    return Reply(
        Verb.CLARIFY,
        "J",
        2,
        Status.YIELD,
        need_code=code,
        error_code=ErrorCode.BUSY,
        retry_hint_ms=hint_ms,
        receipts=((Receipt.PAYLOAD_HELD, 1),) if held else (),
    )


def aborted(code: str, error_code: str) -> Reply:
    return Reply(Verb.CONFIRM, "J", 2, Status.ABORT, need_code=code, error_code=error_code)


DONE = Reply(Verb.CONFIRM, "J", 2, Status.DONE)


def result(reply: Reply, attempts: int = 1, *, exhausted: bool = False) -> UploadResult:
    yields = [reply] if reply.status == Status.YIELD else []
    return UploadResult(reply, attempts, yields, 0.0, None, 0.0, exhausted)


def route(
    *addresses: Address,
    retry: RetryPolicy = PACED,
    budget: RetryBudget | None = None,
) -> tuple[JobRoute, Replicas, FakeClock]:
    clock = FakeClock()
    replicas = Replicas(addresses, rng=InOrder(), clock=clock)
    job = JobRoute(replicas, budget or RetryBudget(), retry, random.Random(1), clock=clock)
    return job, replicas, clock


def test_a_visit_books_what_its_hooks_see() -> None:
    job, replicas, _ = route(A, B)
    seen: list[Reply] = []
    job.on_attempt = lambda _, reply: seen.append(reply)
    visit = job.visit(A.name)
    visit.seen(0.0, yielded())
    assert visit.answered == 1
    assert seen == [yielded()]
    assert replicas.state(A.name) == ReplicaState.BUSY
    assert not visit.elsewhere(yielded())  # B is free: go there
    assert visit.move == Move(B, 0.0)
    visit.delta("partial")
    assert job.delivered
    assert job.tried == [A.name]


def test_a_done_job_ends_the_route() -> None:
    job, _, clock = route(A, B)
    job.visit(A.name)
    clock.now += 2
    job.ended(A.name, result(DONE))
    assert job.after_reply(A.name, result(DONE), None).move is None
    out = job.result()
    assert (out.replica, out.tried, out.attempts) == (A.name, (A.name,), 1)
    assert out.finished - out.started == 2


def test_a_move_withdraws_the_held_payload_and_a_wait_is_paced() -> None:
    job, _, _ = route(A, B)
    job.visit(A.name)
    job.ended(A.name, result(yielded()))
    step = job.after_reply(A.name, result(yielded()), Move(B, 0.25))
    assert (step.move, step.withdraw, step.pace) == (Move(B, 0.25), True, True)
    assert job.paced(Move(B, 0.25)) == Move(B, 0.25)  # the hint's length, no jitter here
    assert job.paced(Move(B, 0.0)) == Move(B, 0.0)
    capped, _, _ = route(A, B, retry=RetryPolicy(jitter_ratio=0, max_sleep_s=0.1))
    assert capped.paced(Move(B, 0.25)) == Move(B, 0.1)  # as the policy waits a hint
    unheld = job.after_reply(A.name, result(yielded(held=False)), Move(B, 0.0))
    assert not unheld.withdraw


def test_draining_goes_elsewhere_and_avoids_it() -> None:
    job, _, _ = route(A, B)
    job.visit(A.name)
    drained = result(yielded(NeedCode.DRAINING))
    job.ended(A.name, drained)
    step = job.after_reply(A.name, drained, None)
    assert step == type(step)(Move(B, 0.0))
    assert A.name in job.avoid


def test_the_attempts_bound_every_replica_together() -> None:
    job, _, _ = route(A, B, retry=RetryPolicy(max_attempts=3))
    job.visit(A.name)
    job.ended(A.name, result(yielded(), attempts=2))
    assert job.policy().max_attempts == 1
    assert job.may_try()
    job.visit(B.name)
    job.ended(B.name, result(yielded(), attempts=1))
    assert not job.may_try()
    assert job.after_reply(B.name, result(yielded()), Move(A, 0.0)).move is None
    assert len(job.yields) == 2


def test_an_unreachable_replica_counts_a_try_and_a_failure() -> None:
    job, replicas, _ = route(A, B)
    job.visit(A.name)
    assert job.unreachable(A.name, OSError("refused")) == Move(B, 0.0)
    assert job.attempts == 1
    assert replicas.status()[0].failures == 1
    job.visit(B.name)
    assert job.unreachable(B.name, OSError("refused")) is None
    with pytest.raises(NoReplicaAvailable, match="could be reached"):
        job.result()


def test_a_broken_connection_counts_the_attempt_it_was_on() -> None:
    job, _, _ = route(A, B)
    visit = job.visit(A.name)
    visit.seen(0.0, yielded())
    job.broke(visit, ConnectionError("reset"))
    assert job.attempts == 2
    assert job.give_up_on(A.name) == Move(B, 0.0)


def test_a_shutdown_leaves_the_replica_and_other_gone_codes_count_a_failure() -> None:
    job, replicas, _ = route(A, B, C)
    shutdown = aborted(NeedCode.SHUTDOWN, ErrorCode.UNAVAILABLE)
    assert job.gone(A.name, shutdown) == Move(B, 0.0)
    assert replicas.state(A.name) == ReplicaState.DRAINING
    idle = aborted(NeedCode.IDLE_TIMEOUT, ErrorCode.TIMEOUT)
    assert job.gone(B.name, idle) == Move(C, 0.0)
    assert replicas.status()[1].failures == 1


def test_a_backend_error_goes_elsewhere_while_the_budget_allows() -> None:
    budget = RetryBudget(max_tokens=2)
    job, _, _ = route(A, B, budget=budget)
    failed = aborted(NeedCode.BACKEND_ERROR, ErrorCode.BACKEND_ERROR)
    assert job.after_abort(A.name, failed) == Move(B, 0.0)
    budget.record_failure()  # (the client withdraws for each failure signal)
    assert job.after_abort(B.name, failed) is None
    assert job.budget_exhausted
    assert job.after_abort(A.name, aborted(NeedCode.CANCELLED, ErrorCode.CANCELLED)) is None


def test_a_breaker_open_the_client_stopped_on_moves_if_another_can_take_it() -> None:
    job, replicas, _ = route(A, B)
    job.visit(A.name)
    breaker = yielded(NeedCode.BREAKER_OPEN, 60_000)
    replicas.observe(A.name, breaker)
    step = job.after_reply(A.name, result(breaker), None)
    assert step.move == Move(B, 0.0)
    assert A.name in job.avoid
    exhausted = job.after_reply(A.name, result(breaker, exhausted=True), None)
    assert exhausted.move is None


@pytest.mark.parametrize("fleet_wide", [True, False])
def test_a_yield_that_names_another_replica_sends_a_fleet_client_there(fleet_wide: bool) -> None:
    """The fleet's store named the replica that would serve the job first (``elsewhere``): a
    client that takes the fleet's word goes there at once, not to one of its own choice (the
    first in address order here), and may wait there for its turn as long as it was told to
    wait here (hint 100 ms); one that does not ignores it. A yield that names none, or a
    replica the client does not know, leaves the choice to it."""
    replicas = Replicas((A, B, C), rng=InOrder(), clock=FakeClock(), fleet_wide=fleet_wide)

    def after(elsewhere: str | None) -> Move | None:
        reply = yielded()
        reply.elsewhere = elsewhere
        replicas.observe(A.name, reply)
        return replicas.after_yield(A.name)

    sent = after(C.name)
    if fleet_wide:
        assert sent is not None
        assert (sent.address, sent.delay_s) == (C, 0.0)
        assert sent.wait_s == pytest.approx(0.1)
    else:
        assert sent == Move(B, 0.0)
    assert after(None) == Move(B, 0.0)
    assert after("10.9.9.9:1") == Move(B, 0.0)
