"""The client's retry budget: its arithmetic, then the client against a scripted fake server.

The fake server speaks just enough of the protocol for uploads: ``clarify ok`` to a manifest
and to every chunk but the last, and the scripted answer to the final chunk or to an inline
payload. It counts the answered attempts per job, so the tests see what reached the server.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from clients import GovernorClient, RetryBudget, RetryPolicy, UploadResult
from protocol.codes import ErrorCode, NeedCode, Receipt, Status, Verb
from protocol.frames import Reply, encode_reply

# Arithmetic ------------------------------------------------------------------------------


def test_budget_starts_full_with_grpc_defaults() -> None:
    budget = RetryBudget()
    assert (budget.max_tokens, budget.token_ratio, budget.tokens) == (10.0, 0.1, 10.0)
    assert budget.allows_retry()


def test_each_failure_withdraws_one_token_down_to_zero() -> None:
    budget = RetryBudget(max_tokens=3)
    budget.record_failure()
    assert budget.tokens == 2.0
    for _ in range(5):
        budget.record_failure()
    assert budget.tokens == 0.0


def test_retries_stop_at_half_the_tokens() -> None:
    budget = RetryBudget()
    allowed = []
    for _ in range(6):
        budget.record_failure()
        allowed.append(budget.allows_retry())
    # 9, 8, 7, 6 are above 5; 5 itself is not.
    assert allowed == [True, True, True, True, False, False]


def test_deposits_are_exact_and_capped() -> None:
    budget = RetryBudget()
    for _ in range(10):
        budget.record_failure()
    for _ in range(50):
        budget.record_success()
    assert budget.tokens == 5.0  # fifty deposits of 0.1, with no float drift
    assert not budget.allows_retry()
    budget.record_success()
    assert budget.tokens == 5.1
    assert budget.allows_retry()
    for _ in range(1000):
        budget.record_success()
    assert budget.tokens == 10.0


def test_token_ratio_is_kept_to_three_decimals() -> None:
    budget = RetryBudget(max_tokens=2, token_ratio=0.0016)
    assert budget.token_ratio == 0.002
    budget.record_failure()
    budget.record_success()
    assert budget.tokens == 1.002


@pytest.mark.parametrize(
    ("max_tokens", "token_ratio"), [(0, 0.1), (-1, 0.1), (10, 0), (10, -0.5), (10, 0.0004)]
)
def test_budget_refuses_a_bad_config(max_tokens: float, token_ratio: float) -> None:
    with pytest.raises(ValueError, match="must be at least"):
        RetryBudget(max_tokens=max_tokens, token_ratio=token_ratio)


def test_repr_shows_the_state() -> None:
    budget = RetryBudget(max_tokens=4, token_ratio=0.5)
    budget.record_failure()
    assert repr(budget) == "RetryBudget(tokens=3, max_tokens=4, token_ratio=0.5)"


# A fake server ---------------------------------------------------------------------------


class FakeServer:
    """Answers every admission attempt with ``self.answer``: a ``yield`` need code, or
    ``"done"``, or ``("abort", need_code, error_code)``."""

    def __init__(self) -> None:
        self.answer: str | tuple[str, str, str] = "done"
        self.hint_ms = 1
        self.attempts: collections.Counter[str] = collections.Counter()  # job -> attempts
        self.final_only_resends = 0  # attempts that sent just the final chunk, no manifest
        self.address = ("", 0)
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def total_attempts(self) -> int:
        return sum(self.attempts.values())

    async def start(self) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = (host, port)
        return self.address

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._handlers):
            task.cancel()
        for task in list(self._handlers):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        chunks: dict[str, int] = {}  # job -> chunks in its manifest
        fresh: set[str] = set()  # jobs whose manifest came since their last answered attempt
        try:
            while line := await reader.readline():
                frame: dict[str, Any] = orjson.loads(line)
                job, seq = frame["job"], frame["seq"]
                if (manifest := frame.get("payload_manifest")) is not None:
                    chunks[job] = manifest["chunks"]
                    fresh.add(job)
                    writer.write(self._ok(job, seq))
                    continue
                chunk = frame.get("payload_chunk")
                if chunk is not None and chunk["index"] < chunks[job] - 1:
                    writer.write(self._ok(job, seq))
                    continue
                if chunk is not None and job not in fresh:
                    self.final_only_resends += 1
                fresh.discard(job)
                self.attempts[job] += 1
                writer.write(self._answer(job, seq))
        finally:
            self._handlers.discard(task)
            writer.close()

    @staticmethod
    def _ok(job: str, seq: int) -> bytes:
        return encode_reply(Reply(verb=Verb.CLARIFY, job=job, seq=seq + 1, status=Status.OK))

    def _answer(self, job: str, seq: int) -> bytes:
        answer = self.answer
        if answer == "done":
            reply = Reply(
                verb=Verb.CONFIRM,
                job=job,
                seq=seq + 1,
                status=Status.DONE,
                receipts=((Receipt.BACKEND_MS, 1),),
                result={"text": "ok"},
            )
        elif isinstance(answer, tuple):
            _, need_code, error_code = answer
            reply = Reply(
                verb=Verb.CONFIRM,
                job=job,
                seq=seq + 1,
                status=Status.ABORT,
                need_code=need_code,
                error_code=error_code,
                receipts=((Receipt.BACKEND_MS, 1),),
            )
        else:
            reply = Reply(
                verb=Verb.CLARIFY,
                job=job,
                seq=seq + 1,
                status=Status.YIELD,
                need_code=answer,
                error_code=ErrorCode.UNAVAILABLE if answer == NeedCode.DRAINING else ErrorCode.BUSY,
                retry_hint_ms=self.hint_ms,
                receipts=((Receipt.RETRY_HINT_MS, self.hint_ms), (Receipt.PAYLOAD_HELD, 1)),
            )
        return encode_reply(reply)


@pytest.fixture
async def fake() -> AsyncIterator[FakeServer]:
    server = FakeServer()
    await server.start()
    yield server
    await server.close()


@pytest.fixture
async def client(fake: FakeServer) -> AsyncIterator[GovernorClient]:
    async with await connect_to(fake) as c:
        yield c


async def connect_to(fake: FakeServer, budget: RetryBudget | None = None) -> GovernorClient:
    host, port = fake.address
    return await GovernorClient.connect(host, port, retry_budget=budget)


TEN = RetryPolicy(max_attempts=10)
BUSY_CODES = [
    NeedCode.SERVER_BUSY,
    NeedCode.LANE_FULL,
    NeedCode.LANE_PAUSED,
    NeedCode.KV_PRESSURE,
    NeedCode.TENANT_BUSY,
    NeedCode.TENANT_SHARE,
    NeedCode.RATE_LIMITED,
    "some_future_code",  # unknown codes are treated as busy: paced by the hint, max_attempts
]


async def uploads(client: GovernorClient, n: int, *, inline: bool = True) -> list[UploadResult]:
    """``n`` uploads one after another: inline, or as a manifest and two chunks."""
    return [
        await client.upload(b"payload", retry=TEN, inline=inline, chunk_bytes=4) for _ in range(n)
    ]


# Failure signals -------------------------------------------------------------------------


@pytest.mark.parametrize("inline", [True, False])
async def test_breaker_open_retries_are_bounded_by_the_budget(
    fake: FakeServer, client: GovernorClient, inline: bool
) -> None:
    fake.answer = NeedCode.BREAKER_OPEN
    results = await uploads(client, 20, inline=inline)
    # Failures 1-4 leave 9, 8, 7, 6 tokens (> 5): a retry each. The 5th leaves 5: no more.
    assert fake.total_attempts == 20 + 4  # not 20 * 10
    assert [r.attempts for r in results] == [5] + [1] * 19
    assert all(r.budget_exhausted for r in results)
    assert all(r.reply.need_code == NeedCode.BREAKER_OPEN for r in results)
    assert [len(r.yields) for r in results] == [r.attempts for r in results]
    assert client.retry_budget.tokens == 0.0
    if not inline:
        assert fake.final_only_resends == 4  # the held payload: only the final chunk again


async def test_concurrent_uploads_share_the_clients_budget(
    fake: FakeServer, client: GovernorClient
) -> None:
    fake.answer = NeedCode.BREAKER_OPEN
    results = await asyncio.gather(
        *(client.upload(b"payload", retry=TEN, inline=True) for _ in range(20))
    )
    # However the failures interleave, only the first four of them are followed by a retry.
    assert fake.total_attempts == 24
    assert sum(r.attempts - 1 for r in results) == 4
    assert all(r.budget_exhausted for r in results)


async def test_clients_given_one_budget_share_it(fake: FakeServer) -> None:
    fake.answer = NeedCode.BREAKER_OPEN
    shared = RetryBudget()
    a, b = await connect_to(fake, shared), await connect_to(fake, shared)
    own = await connect_to(fake)
    try:
        assert a.retry_budget is shared
        assert b.retry_budget is shared
        assert own.retry_budget is not shared
        await uploads(a, 3)
        await uploads(b, 3)
        assert fake.total_attempts == 6 + 4
        await uploads(own, 3)  # a budget of its own, still full
        assert fake.total_attempts == 10 + 3 + 4
    finally:
        for c in (a, b, own):
            await c.close()


async def test_the_policy_still_bounds_failing_retries(
    fake: FakeServer, client: GovernorClient
) -> None:
    fake.answer = NeedCode.BREAKER_OPEN
    result = await client.upload(b"x", retry=RetryPolicy(max_attempts=2), inline=True)
    assert result.attempts == 2
    assert not result.budget_exhausted  # the policy stopped it, not the budget
    assert client.retry_budget.tokens == 8.0


@pytest.mark.parametrize(
    "need_code", [NeedCode.BACKEND_ERROR, NeedCode.RUNNER_CRASHED, NeedCode.UPSTREAM_TIMEOUT]
)
async def test_backend_failure_aborts_drain_the_budget(
    fake: FakeServer, client: GovernorClient, need_code: str
) -> None:
    fake.answer = ("abort", need_code, ErrorCode.BACKEND_ERROR)
    results = await uploads(client, 5)
    assert [r.attempts for r in results] == [1] * 5  # an abort is never retried
    assert client.retry_budget.tokens == 5.0
    fake.answer = NeedCode.BREAKER_OPEN
    (result,) = await uploads(client, 1)
    assert (result.attempts, result.budget_exhausted) == (1, True)


@pytest.mark.parametrize(
    ("need_code", "error_code"),
    [
        (NeedCode.TTL_EXPIRED, ErrorCode.TIMEOUT),
        (NeedCode.CANCELLED, ErrorCode.CANCELLED),
        (NeedCode.PROMPT_OVER_CEILING, ErrorCode.POLICY),
        (NeedCode.SHUTDOWN, ErrorCode.UNAVAILABLE),
    ],
)
async def test_other_aborts_leave_the_budget_alone(
    fake: FakeServer, client: GovernorClient, need_code: str, error_code: str
) -> None:
    fake.answer = ("abort", need_code, error_code)
    await uploads(client, 5)
    assert client.retry_budget.tokens == 10.0


# Busy yields and draining ----------------------------------------------------------------


@pytest.mark.parametrize("need_code", BUSY_CODES)
async def test_busy_yields_use_every_attempt_and_no_budget(
    fake: FakeServer, client: GovernorClient, need_code: str
) -> None:
    fake.answer = need_code
    results = await uploads(client, 5)
    assert [r.attempts for r in results] == [10] * 5
    assert not any(r.budget_exhausted for r in results)
    assert client.retry_budget.tokens == 10.0


async def test_busy_yields_are_retried_with_the_budget_spent(
    fake: FakeServer, client: GovernorClient
) -> None:
    fake.answer = NeedCode.BREAKER_OPEN
    await uploads(client, 10)
    assert not client.retry_budget.allows_retry()
    fake.answer = NeedCode.SERVER_BUSY
    (result,) = await uploads(client, 1)
    assert (result.attempts, result.budget_exhausted) == (10, False)


async def test_a_cooldown_longer_than_the_client_waits_ends_the_upload(
    fake: FakeServer, client: GovernorClient
) -> None:
    fake.answer = NeedCode.BREAKER_OPEN
    fake.hint_ms = 10_000  # the rest of a cooldown: more than TEN's max_sleep_s
    result = await client.upload(b"x", retry=TEN, inline=True)
    assert (result.attempts, result.reply.need_code) == (1, NeedCode.BREAKER_OPEN)
    assert not result.budget_exhausted
    assert client.retry_budget.tokens == 9.0


async def test_draining_is_never_retried(fake: FakeServer, client: GovernorClient) -> None:
    fake.answer = NeedCode.DRAINING
    # (the governor sends the maximum hint; a short one makes a wrong retry show at once)
    result = await client.upload(b"x", retry=TEN, inline=True)
    assert (result.attempts, result.status, result.reply.need_code) == (
        1,
        Status.YIELD,
        NeedCode.DRAINING,
    )
    assert not result.budget_exhausted
    assert client.retry_budget.tokens == 10.0


# Refill ----------------------------------------------------------------------------------


async def test_done_jobs_refill_the_budget(fake: FakeServer, client: GovernorClient) -> None:
    fake.answer = NeedCode.BREAKER_OPEN
    await uploads(client, 20)
    assert client.retry_budget.tokens == 0.0
    fake.answer = "done"
    done = await uploads(client, 60)
    assert all(r.done and r.attempts == 1 for r in done)
    assert client.retry_budget.tokens == 6.0
    fake.answer = NeedCode.BREAKER_OPEN
    (refused,) = await uploads(client, 1)  # 6 - 1 = 5: not above half
    assert (refused.attempts, refused.budget_exhausted) == (1, True)
    fake.answer = "done"
    await uploads(client, 11)  # 5 + 1.1
    fake.answer = NeedCode.BREAKER_OPEN
    (retried,) = await uploads(client, 1)  # 6.1 - 1 = 5.1: one retry, then 4.1
    assert (retried.attempts, retried.budget_exhausted) == (2, True)
    assert client.retry_budget.tokens == 4.1


async def test_one_upload_counts_each_failure_and_its_success(
    fake: FakeServer, client: GovernorClient
) -> None:
    fake.answer = NeedCode.BREAKER_OPEN
    answers = iter([NeedCode.BREAKER_OPEN, NeedCode.SERVER_BUSY])

    def on_attempt(sent_at: float, reply: Reply) -> None:
        fake.answer = next(answers, "done")  # the next attempt gets the next answer

    result = await client.upload(b"x", retry=TEN, inline=True, on_attempt=on_attempt)
    assert (result.attempts, result.done, result.budget_exhausted) == (4, True, False)
    assert [y.need_code for y in result.yields] == ["breaker_open"] * 2 + ["server_busy"]
    assert client.retry_budget.tokens == 8.1  # two failures, one job done
