"""The bounded wait at the front door, through clients that never retry: every request waits
for its turn within its budget, in its lane's order, within the line's bounds, and leaves the
line exactly once (admitted, refused, drained or gone); and ``GET /health`` on the API port.

Real servers on loopback sockets, the stub runner, httpx and the official SDK with retries
off (a 429 would fail them: none may come where the turn is within the budget).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from governor.core.tenants import TenantConfig
from governor.listeners.openai_api import MAX_WAIT_HEADER
from governor.runners.base import Job, RunEvent
from governor.server import Server
from tests.conftest import ServerFactory, wait_until

CHAT = [{"role": "user", "content": "hi"}]
PATH = "/v1/chat/completions"


async def front(make_server: ServerFactory, **config: Any) -> Server:
    return await make_server(http_listen="127.0.0.1:0", **config)


def url(server: Server) -> str:
    address = server.http_address
    assert address is not None
    return f"http://{address[0]}:{address[1]}"


def line(server: Server) -> int:
    """The requests waiting at the server's front door."""
    door = server.state.line
    assert door is not None
    return len(door)


def body(n: int = 0, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": f"job {n}"}], **fields}


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    """Connections enough for every request at once, none retried."""
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=30.0) as client:
        yield client


async def test_more_requests_than_slots_all_finish_without_a_retry(
    make_server: ServerFactory, http: httpx.AsyncClient
) -> None:
    """Ten at once on two slots: every one is answered 200; those that waited say so; the line
    and its counts are empty after."""
    server = await front(make_server, max_inflight=2, stub_ms=150)
    answers = await asyncio.gather(
        *(http.post(url(server) + PATH, json=body(i)) for i in range(10))
    )
    assert [a.status_code for a in answers] == [200] * 10
    waited = sorted(int(a.headers["x-governor-waited-ms"]) for a in answers)
    assert waited[:2] == [0, 0]  # (the first two found a slot)
    assert all(w > 0 for w in waited[2:])
    metrics = server.state.metrics
    assert metrics.door_waits[("-", "admitted")] == 8
    assert sum(metrics.door_wait.by_lane["-"].counts) == 8
    assert server.state.metrics.http_responses[(PATH, "429")] == 0
    assert line(server) == 0
    assert [t.waiting for t in server.tenants.all()] == [0]
    assert server.ledger.waiting(0) == 0  # (no promise left in admission's line)


async def test_the_sdk_with_retries_off_gets_every_answer(make_server: ServerFactory) -> None:
    server = await front(make_server, max_inflight=2, stub_ms=100)
    client = openai.AsyncOpenAI(base_url=url(server) + "/v1", api_key="none", max_retries=0)
    try:
        answers = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": f"job {i}"}], max_tokens=3
                )
                for i in range(6)
            )
        )
    finally:
        await client.close()
    assert [a.choices[0].message.content for a in answers] == ["stub "] * 6
    assert server.ledger.executed_total == 6


async def test_a_budget_shorter_than_the_turn_is_refused_at_once(
    make_server: ServerFactory, http: httpx.AsyncClient
) -> None:
    server = await front(make_server, max_inflight=1, stub_ms=1500)
    running = asyncio.create_task(http.post(url(server) + PATH, json=body(1)))
    await wait_until(lambda: server.inflight == 1)
    short = await http.post(url(server) + PATH, json=body(2), headers={MAX_WAIT_HEADER: "200"})
    assert short.status_code == 429
    assert short.json()["error"]["code"] == "server_busy"
    assert short.headers["x-governor-waited-ms"] == "0"
    assert int(short.headers["retry-after-ms"]) > 200  # (the turn it would not wait for)
    assert server.state.metrics.not_waited["beyond_budget"] == 1
    assert not server.state.metrics.door_waits  # it never joined the line
    # Within its budget, it waits; a header that is not a number of milliseconds is a 400.
    assert (await http.post(url(server) + PATH, json=body(3))).status_code == 200
    bad = await http.post(url(server) + PATH, json=body(4), headers={MAX_WAIT_HEADER: "soon"})
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, MAX_WAIT_HEADER)
    assert (await running).status_code == 200


def raw_request(payload: dict[str, Any], key: str | None = None) -> bytes:
    data = orjson.dumps(payload)
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST {PATH} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{auth}"
        f"content-length: {len(data)}\r\n\r\n"
    ).encode() + data


async def test_a_client_that_leaves_the_line_frees_its_place_for_the_next(
    make_server: ServerFactory, http: httpx.AsyncClient
) -> None:
    """Two wait behind a running job; the first leaves: its place, its promise and its body's
    bytes go at once, and as the job ends the one behind it is admitted (not at its own,
    later, hint)."""
    server = await front(make_server, max_inflight=1, stub_ms=600)
    (tenant,) = server.tenants.all()
    running = asyncio.create_task(http.post(url(server) + PATH, json=body(1)))
    await wait_until(lambda: server.inflight == 1)
    host, port = server.http_address or ("", 0)
    _, leaver = await asyncio.open_connection(host, port)
    leaver.write(raw_request(body(2)))
    await wait_until(lambda: line(server) == 1)
    behind = asyncio.create_task(http.post(url(server) + PATH, json=body(3)))
    await wait_until(lambda: line(server) == 2 and server.ledger.waiting(0) == 2)
    assert tenant.waiting == 2
    assert server.buffered_bytes > 0
    leaver.close()
    await wait_until(lambda: line(server) == 1 and server.ledger.waiting(0) == 1)
    assert tenant.waiting == 1
    assert (await running).status_code == 200
    # Its job's end offered the slot to the line: the one behind runs now.
    assert (server.inflight, line(server)) == (1, 0)
    answer = await behind
    assert answer.status_code == 200
    assert server.state.metrics.door_waits[("-", "left")] == 1
    assert server.state.metrics.door_waits[("-", "admitted")] == 1
    await wait_until(lambda: server.buffered_bytes == 0 and tenant.waiting == 0)


async def test_a_drain_ends_every_wait_with_a_503_at_once(
    make_server: ServerFactory, http: httpx.AsyncClient
) -> None:
    server = await front(make_server, max_inflight=1, stub_ms=2000)
    running = asyncio.create_task(http.post(url(server) + PATH, json=body(0)))
    await wait_until(lambda: server.inflight == 1)
    waiting = [asyncio.create_task(http.post(url(server) + PATH, json=body(i))) for i in (1, 2, 3)]
    await wait_until(lambda: line(server) == 3)
    server.begin_drain("test")
    answers = await asyncio.wait_for(asyncio.gather(*waiting), 1.0)  # (the job runs 2 s)
    assert [(a.status_code, a.json()["error"]["code"]) for a in answers] == [(503, "draining")] * 3
    assert server.state.metrics.door_waits[("-", "unavailable")] == 3
    assert server.inflight == 1  # the running job goes on
    assert (await running).status_code == 200
    assert line(server) == 0


async def test_with_lanes_a_chat_is_admitted_before_heavy_requests_that_waited_longer(
    make_server: ServerFactory, http: httpx.AsyncClient
) -> None:
    """One slot (no interactive reserve), taken by a heavy job; three heavy requests wait,
    then a chat: as the slot frees, the chat runs first, the heavy ones in their order."""
    server = await front(
        make_server, max_inflight=1, lanes=True, interactive_reserve=0, stub_ms=200
    )
    started: list[str] = []
    runner = server.runner
    original = runner.run

    def run(job: Job) -> AsyncGenerator[RunEvent, None]:
        # (a job runs as it is admitted: the runner sees them in their admission's order)
        assert job.spec is not None
        assert job.spec.messages
        started.append(job.spec.messages[-1].content)
        return original(job)

    runner.run = run  # type: ignore[method-assign]
    heavy = {"x-governor-lane": "heavy"}

    def post(n: int, headers: dict[str, str]) -> asyncio.Task[httpx.Response]:
        return asyncio.create_task(http.post(url(server) + PATH, json=body(n), headers=headers))

    tasks = [post(0, heavy)]
    await wait_until(lambda: server.inflight == 1)
    for n in (1, 2, 3):
        tasks.append(post(n, heavy))
        await wait_until(functools.partial(lambda n: line(server) == n, n))
    tasks.append(post(4, {}))
    await wait_until(lambda: line(server) == 4)
    answers = await asyncio.gather(*tasks)
    assert [a.status_code for a in answers] == [200] * 5
    # The chat, ahead of the heavy requests that came before it; those in their order.
    assert started == ["job 0", "job 4", "job 1", "job 2", "job 3"]
    waits = server.state.metrics.door_waits
    assert (waits[("interactive", "admitted")], waits[("heavy", "admitted")]) == (1, 3)


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def test_the_line_is_bounded_in_all_and_per_tenant(
    make_server: ServerFactory, http: httpx.AsyncClient
) -> None:
    """A tenant that floods the line gets 429 past its own bound while another's requests
    still wait; past the total, everyone's busy request is refused at once."""
    tenants = tuple(TenantConfig(name=n, key_sha256=sha(n)) for n in ("noisy", "quiet"))
    server = await front(
        make_server,
        tenants=tenants,
        max_inflight=1,
        stub_ms=1500,
        max_waiting=3,
        max_waiting_per_tenant=2,
    )

    def post(n: int, key: str) -> asyncio.Task[httpx.Response]:
        headers = {"authorization": f"Bearer {key}"}
        return asyncio.create_task(http.post(url(server) + PATH, json=body(n), headers=headers))

    running = post(0, "noisy")
    await wait_until(lambda: server.inflight == 1)
    noisy = [post(n, "noisy") for n in (1, 2)]
    await wait_until(lambda: line(server) == 2)
    over = await post(3, "noisy")  # its tenant's bound: refused at once
    assert (over.status_code, over.json()["error"]["code"]) == (429, "server_busy")
    quiet = post(4, "quiet")  # the other tenant still waits
    await wait_until(lambda: line(server) == 3)
    full = await post(5, "quiet")  # the line's own bound
    assert full.status_code == 429
    assert server.state.metrics.not_waited["line_full"] == 2
    for task in (running, *noisy, quiet):
        task.cancel()


async def test_waiting_bodies_count_against_the_payload_buffers(
    make_server: ServerFactory, http: httpx.AsyncClient
) -> None:
    padding = "x" * 3000
    server = await front(make_server, max_inflight=1, stub_ms=1500, max_buffer_bytes=8000)
    running = asyncio.create_task(http.post(url(server) + PATH, json=body(0, user=padding)))
    await wait_until(lambda: server.inflight == 1)
    waiter = asyncio.create_task(http.post(url(server) + PATH, json=body(1, user=padding)))
    await wait_until(lambda: line(server) == 1)
    held = server.buffered_bytes
    assert held > 6000  # the running job's body and the waiting one's
    refused = await http.post(url(server) + PATH, json=body(2, user=padding))
    assert (refused.status_code, refused.json()["error"]["code"]) == (429, "buffers_full")
    waiter.cancel()
    running.cancel()


async def test_health_on_the_api_port_is_readiness(
    make_server: ServerFactory, http: httpx.AsyncClient
) -> None:
    server = await front(make_server)
    ready = await http.get(url(server) + "/health")
    assert ready.status_code == 200
    assert ready.json()["status"] == "ok"
    assert (await http.head(url(server) + "/health")).status_code == 200
    assert (await http.post(url(server) + "/health")).status_code == 405
    server.begin_drain("test")  # a draining replica is not ready: balancers stop sending
    async with httpx.AsyncClient() as other:
        unready = await other.get(url(server) + "/health")
    assert unready.status_code == 503
    assert unready.json()["status"] == "fail"
    assert server.state.metrics.http_responses[("/health", "503")] == 1
