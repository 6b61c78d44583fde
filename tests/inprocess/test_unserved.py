"""Unserved demand through each door, on real sockets: a job refused again and again is one job
turned away (its tokens once), the yields count every refusal, and a job whose client leaves
unserved gave up, once."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from clients.client import GovernorClient
from clients.retry import RetryPolicy
from governor.listeners.openai_api import MAX_WAIT_HEADER
from governor.runners import StubRunner
from governor.server import Server
from protocol.codes import Status
from protocol.spec import JobSpec
from tests.conftest import ServerFactory, wait_until
from tests.inprocess.test_frontdoor import CHAT, Sdk, front, hold_slot, sdk, url  # noqa: F401


def unserved(server: Server) -> tuple[int, int, int]:
    return server.admission.unserved.totals()


def yields(server: Server) -> int:
    return sum(server.admission.refusals.values())


@pytest.mark.parametrize("held", [8, 1])
async def test_tcp_jobs_retried_on_their_hints_count_once_each(
    make_server: ServerFactory, held: int
) -> None:
    """Seven jobs on one connection and one slot, retried by the client library every 40 ms
    (sooner than their hints, so each is refused several times): held payloads sent again
    (``held`` 8), or most of them sent whole again by id (1)."""
    server = await make_server(max_inflight=1, stub_ms=150, held_payloads_per_conn=held)
    host, port = server.address
    async with await GovernorClient.connect(host, port) as client:
        specs = [JobSpec(prompt=f"job {i}", max_new_tokens=4 + i) for i in range(7)]
        eager = RetryPolicy(max_attempts=500, fixed_delay_s=0.04)
        results = await asyncio.gather(
            *(client.generate(s, timeout=30, retry=eager) for s in specs)
        )
    assert all(r.reply.status == Status.DONE for r in results)
    refused = [r for r in results if r.yields]
    assert len(refused) >= 5  # (one slot: all but the first few were refused)
    jobs, tokens, gave_up = unserved(server)
    assert (jobs, gave_up) == (len(refused), 0)
    assert yields(server) == sum(len(r.yields) for r in results) > jobs  # retried, counted once
    assert tokens >= sum(4 + i for i, r in enumerate(results) if r.yields)


async def test_a_tcp_job_whose_client_leaves_unserved_gave_up(make_server: ServerFactory) -> None:
    server = await make_server(max_inflight=1, stub_ms=2000)
    host, port = server.address
    async with await GovernorClient.connect(host, port) as holder:
        running = asyncio.create_task(holder.generate(JobSpec(prompt="hold", max_new_tokens=4)))
        await wait_until(lambda: server.inflight == 1)
        for _ in range(2):  # each its client's only job: it leaves after its yield
            async with await GovernorClient.connect(host, port) as client:
                result = await client.generate(
                    JobSpec(prompt="late", max_new_tokens=4), on_yield=lambda _: False
                )
                assert result.reply.status == Status.YIELD
        await wait_until(lambda: unserved(server)[2] == 2)
        assert unserved(server)[0] == 2
        await running
    assert unserved(server)[::2] == (2, 2)


async def test_http_retries_of_one_request_count_once_and_a_client_that_leaves_gave_up(
    make_server: ServerFactory,
    sdk: Sdk,  # noqa: F811
) -> None:
    server = await front(make_server, max_inflight=1, stub_ms=1500, max_wait=10)
    running = await hold_slot(server, sdk)
    body = {"model": "m", "messages": CHAT, "max_tokens": 5}
    now = {MAX_WAIT_HEADER: "0"}  # (refused at once: no wait at the door)
    async with httpx.AsyncClient(base_url=url(server), headers=now) as http:
        for _ in range(3):  # the same request again: its kept place, one job
            refused = await http.post("/v1/chat/completions", json=body)
            assert refused.status_code == 429
        other = await http.post("/v1/chat/completions", json=body | {"max_tokens": 6})
        assert other.status_code == 429
    assert yields(server) == 4
    assert unserved(server)[0] == 2
    # One that waits at the door, and whose client leaves before its turn.
    waiting = asyncio.create_task(
        sdk(server, max_retries=0).chat.completions.create(
            model="m", messages=CHAT, max_tokens=7, extra_headers={MAX_WAIT_HEADER: "5000"}
        )
    )
    await wait_until(lambda: len(server.state.line) == 1)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await wait_until(lambda: unserved(server)[2] == 1)
    assert unserved(server)[0] == 3
    await running


# One rule on both doors: every refusal keeps its job's attempt for the retry ------------------

KINDS = ["server_busy", "breaker_open", "draining"]


async def refusing(
    make_server: ServerFactory, kind: str, **config: object
) -> tuple[Server, asyncio.Task[None] | None]:
    """A server whose every admission is refused with ``kind``: its one slot held by a long
    job (the task holding it), its breaker open (a job failed; a cooldown of 2 s), or
    draining."""
    if kind == "breaker_open":
        runner = StubRunner(0.01, fail_rate=1.0, seed=1)
        server = await make_server(
            runner, breaker_failures=1, breaker_cooldown=2, probe_interval=600, **config
        )
        host, port = server.address
        async with await GovernorClient.connect(host, port) as client:
            failed = await client.upload(b"fails", retry=RetryPolicy(max_attempts=1))
            assert failed.reply.need_code == "backend_error"
        return server, None
    server = await make_server(max_inflight=1, stub_ms=1500, **config)
    if kind == "draining":
        server.begin_drain("test")
        return server, None
    host, port = server.address
    hold = asyncio.create_task(held_slot(host, port))
    await wait_until(lambda: server.inflight == 1)
    return server, hold


async def held_slot(host: str, port: int) -> None:
    async with await GovernorClient.connect(host, port) as holder:
        await holder.upload(b"hold")


async def release(hold: asyncio.Task[None] | None) -> None:
    if hold is not None:
        hold.cancel()
        await asyncio.gather(hold, return_exceptions=True)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_tcp_job_retried_through_any_refusal_is_one_unserved_job(
    make_server: ServerFactory, kind: str
) -> None:
    server, hold = await refusing(make_server, kind)
    host, port = server.address
    spec, once = JobSpec(prompt="again", max_new_tokens=4), RetryPolicy(max_attempts=1)
    async with await GovernorClient.connect(host, port) as client:
        for _ in range(5):  # (sent whole again by its id, as a client that retries would)
            result = await client.generate(spec, job="again", retry=once)
            assert result.reply.need_code == kind
    assert unserved(server)[0] == 1
    await wait_until(lambda: unserved(server)[2] == 1)  # (its client left)
    await release(hold)


@pytest.mark.parametrize("kind", KINDS)
async def test_an_http_request_retried_through_any_refusal_is_one_unserved_job(
    make_server: ServerFactory, kind: str
) -> None:
    server, hold = await refusing(make_server, kind, http_listen="127.0.0.1:0", upload_timeout=1)
    body = {"model": "m", "messages": CHAT, "max_tokens": 5}
    async with httpx.AsyncClient(base_url=url(server), headers={MAX_WAIT_HEADER: "0"}) as http:
        for _ in range(5):
            refused = await http.post("/v1/chat/completions", json=body)
            assert refused.json()["error"]["code"] == kind
    assert unserved(server)[0] == 1
    await wait_until(lambda: unserved(server)[2] == 1, timeout=10)  # (its place expired)
    await release(hold)
