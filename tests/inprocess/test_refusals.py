"""What a refusal says on each door, on real sockets: the bound that refused the job, and, for
one that waits on a slot, the parts of its hint (until the running job's predicted end, then
the turns of those promised ahead), which add up to the hint."""

from __future__ import annotations

import asyncio

import httpx

from clients.client import GovernorClient
from governor.listeners.openai_api import BOUND_HEADER, MAX_WAIT_HEADER, PART_HEADERS
from protocol.codes import Receipt, Status
from protocol.frames import Reply
from protocol.spec import JobSpec
from tests.conftest import ServerFactory, wait_until
from tests.inprocess.test_frontdoor import CHAT, Sdk, front, hold_slot, sdk, url  # noqa: F401


def parts(reply: Reply) -> tuple[int, int, int]:
    """The hint's parts a yield's receipts say: release, turns, ahead."""
    found = [
        reply.receipt(k)
        for k in (Receipt.HINT_RELEASE_MS, Receipt.HINT_TURNS_MS, Receipt.HINT_AHEAD)
    ]
    release, turns, ahead = (v for v in found if v is not None)  # (fails if one is missing)
    return release, turns, ahead


async def test_a_tcp_yield_names_its_bound_and_its_hints_parts(make_server: ServerFactory) -> None:
    server = await make_server(max_inflight=1, stub_ms=1500)
    host, port = server.address
    async with (
        await GovernorClient.connect(host, port) as holder,
        await GovernorClient.connect(host, port) as first,
        await GovernorClient.connect(host, port) as second,
    ):
        running = asyncio.create_task(holder.generate(JobSpec(prompt="hold", max_new_tokens=4)))
        await wait_until(lambda: server.inflight == 1)
        replies = []
        for client in (first, second):  # (each keeps its held payload: its place in line)
            result = await client.generate(
                JobSpec(prompt="late", max_new_tokens=4), on_yield=lambda _: False
            )
            assert result.reply.status == Status.YIELD
            replies.append(result.reply)
        for reply in replies:
            assert reply.receipt(f"{Receipt.BOUND}.max_inflight") == 1
            release, turns, _ = parts(reply)
            assert release + turns == reply.retry_hint_ms
        (r1, t1, a1), (r2, t2, a2) = (parts(r) for r in replies)
        assert (t1, a1) == (0, 0)  # next in line: the running job's end, nothing else
        assert 0 < r2 <= r1 + 50  # the same end, asked a little later
        assert a2 == 1
        assert t2 > 0
        await running


async def test_an_http_refusal_names_its_bound_and_its_hints_parts(
    make_server: ServerFactory,
    sdk: Sdk,  # noqa: F811
) -> None:
    server = await front(make_server, max_inflight=1, stub_ms=1500, max_wait=0)
    running = await hold_slot(server, sdk)
    async with httpx.AsyncClient(base_url=url(server), headers={MAX_WAIT_HEADER: "0"}) as http:
        refused = await http.post(
            "/v1/chat/completions", json={"model": "m", "messages": CHAT, "max_tokens": 4}
        )
    assert refused.status_code == 429
    headers = refused.headers
    assert headers[BOUND_HEADER] == "max_inflight"
    release, turns, ahead = (int(headers[name]) for name in PART_HEADERS)
    assert release + turns == int(headers["retry-after-ms"])
    assert release > 0
    assert ahead == 0
    await running
