"""The TCP door's bounded wait, end to end: the bundled client asks for it (``max_wait``), every
job past the cap runs without a yield in its turn, and both doors' jobs wait in one line.

Real servers on loopback sockets, the stub runner; the sans-IO session's own tests drive every
outcome of a wait (tests/unit/test_session_sansio.py)."""

from __future__ import annotations

import asyncio

import httpx

from clients.client import NO_RETRY, GovernorClient, UploadResult
from governor.server import Server
from protocol.codes import Status
from tests.conftest import ServerFactory, wait_until


async def job(server: Server, n: int, max_wait: float | None) -> UploadResult:
    host, port = server.address
    async with await GovernorClient.connect(host, port) as client:
        return await client.upload(
            f"job {n}".encode(), inline=True, retry=NO_RETRY, max_wait=max_wait, timeout=20
        )


async def test_jobs_past_the_cap_that_ask_to_wait_all_run_with_no_yield(
    make_server: ServerFactory,
) -> None:
    server = await make_server(max_inflight=2, stub_ms=150)
    results = await asyncio.gather(*(job(server, n, 10.0) for n in range(8)))
    assert [r.reply.status for r in results] == [Status.DONE] * 8  # (no retry: one attempt)
    assert [len(r.yields) for r in results] == [0] * 8
    metrics = server.state.metrics
    assert metrics.door_waits[("-", "admitted")] == 6
    assert len(server.state.line) == 0
    assert [t.waiting for t in server.tenants.all()] == [0]
    assert server.ledger.waiting(0) == 0  # (no promise left in admission's line)
    assert server.ledger.landings.returns == {}  # (no client was told a hint to come back at)

    plain = await asyncio.gather(*(job(server, n, None) for n in range(4)))
    assert sorted(r.reply.status for r in plain).count(Status.YIELD) == 2  # v0: a yield at once


async def test_both_doors_wait_in_one_line_in_arrival_order(make_server: ServerFactory) -> None:
    server = await make_server(max_inflight=1, stub_ms=300, http_listen="127.0.0.1:0")
    address = server.http_address
    assert address is not None
    first = asyncio.ensure_future(job(server, 0, None))  # holds the slot
    await wait_until(lambda: server.state.inflight == 1)
    tcp = asyncio.ensure_future(job(server, 1, 10.0))
    await wait_until(lambda: len(server.state.line) == 1)
    async with httpx.AsyncClient(timeout=20) as http:
        request = asyncio.ensure_future(
            http.post(
                f"http://{address[0]}:{address[1]}/v1/completions",
                json={"model": "m", "prompt": "hi", "max_tokens": 4},
            )
        )
        await wait_until(lambda: len(server.state.line) == 2)  # one line, both doors
        answer = await request
        result = await tcp
    assert (await first).reply.status == Status.DONE
    assert result.reply.status == Status.DONE
    assert answer.status_code == 200
    assert result.admitted_at is not None
    # The TCP job waited first, so it ran first: the HTTP request, in line before the first job
    # ended, waited for the TCP job's whole run too (its stub_ms; how much of the first job's
    # run it waited for depends on when it came, so that part is not counted).
    assert int(answer.headers["x-governor-waited-ms"]) >= 300
    assert server.state.metrics.door_waits[("-", "admitted")] == 2


async def test_a_client_that_comes_back_early_waits_for_its_turn_with_wait_on_return(
    make_server: ServerFactory,
) -> None:
    """``wait_on_return``: a job back on its held payload before its slot frees (here it comes
    back every 150 ms on a 600 ms job) asks to wait as long again as its hint, and runs when
    its turn comes instead of being refused at each return (as it is without)."""
    from clients.client import RetryPolicy

    server = await make_server(max_inflight=1, stub_ms=600)
    host, port = server.address
    early = RetryPolicy(max_attempts=50, fixed_delay_s=0.15)

    async def second(wait_on_return: bool) -> UploadResult:
        first = asyncio.ensure_future(job(server, 0, None))  # holds the slot
        await wait_until(lambda: server.state.inflight == 1)
        async with await GovernorClient.connect(host, port) as client:
            result = await client.upload(
                b"job 1", inline=True, retry=early, wait_on_return=wait_on_return, timeout=20
            )
        assert (await first).reply.status == Status.DONE
        return result

    waited = await second(True)
    assert waited.reply.status == Status.DONE
    assert waited.attempts == 2  # refused once; back with its wait, admitted in its turn
    assert server.state.metrics.door_waits[("-", "admitted")] == 1
    refused = await second(False)
    assert refused.reply.status == Status.DONE
    assert refused.attempts > 2
