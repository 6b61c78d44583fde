"""The operator's HTTP listener under abuse: slow clients, floods, bad drains, long heads.

Real sockets against an in-process server's ``metrics_listen`` on port 0, spoken to with raw
bytes from the test's event loop (no client threads, so the thread count is the listener's).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from governor import cli
from governor.config import ConfigError
from governor.listeners import admin
from governor.listeners.shell import MAX_HEADERS
from governor.server import Server
from tests.conftest import ServerFactory

Address = tuple[str, int]


async def exchange(address: Address, data: bytes, timeout: float = 5.0) -> tuple[int, bytes]:
    """Send ``data`` on a new connection; the status and body of the reply, read to the close."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(data)
        reply = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), reply
    return int(head.split(b" ", 2)[1]), body


async def get(address: Address, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    return await exchange(address, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode(), timeout)


async def post(address: Address, path: str, *headers: str) -> tuple[int, dict[str, Any]]:
    head = "".join(f"{h}\r\n" for h in headers)
    status, body = await exchange(
        address, f"POST {path} HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode()
    )
    return status, orjson.loads(body)


async def admin_server(make_server: ServerFactory, **config: Any) -> tuple[Server, Address]:
    server = await make_server(metrics_listen="127.0.0.1:0", **config)
    assert server.metrics_address is not None
    return server, server.metrics_address


# Slow clients ------------------------------------------------------------------------------


async def test_trickling_clients_hold_no_thread_keep_no_probe_out_and_are_cut(
    make_server: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    deadline = 2.0
    monkeypatch.setattr(admin, "REQUEST_DEADLINE_S", deadline)
    _, address = await admin_server(make_server)
    threads_before = threading.active_count()
    n = 400
    connected = 0
    all_connected = asyncio.Event()

    async def trickle() -> tuple[float, float]:
        """Send a request head a byte every 0.5 s; how long until the listener cut it, from
        before the connection was opened and from after (the listener's deadline starts when
        it accepts, somewhere between, or later still when its backlog is long)."""
        nonlocal connected
        opening = time.monotonic()
        reader, writer = await asyncio.open_connection(*address)
        started = time.monotonic()
        connected += 1
        if connected == n:
            all_connected.set()
        try:
            for byte in b"GET /healthz/live HTTP/1.1\r\n" + b"X: y\r\n" * 100:
                if writer.is_closing():  # (cut while its read waited: uvloop would raise)
                    break
                writer.write(bytes([byte]))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(reader.read(1024), 0.5)
                    break  # an answer (408), or the close
        except ConnectionError:
            pass  # displaced by a newer connection
        finally:
            writer.close()
        ended = time.monotonic()
        return ended - opening, ended - started

    clients = [asyncio.ensure_future(trickle()) for _ in range(n)]
    await asyncio.wait_for(all_connected.wait(), 10)
    assert threading.active_count() - threads_before <= 1  # not one thread per connection
    started = time.monotonic()
    status, body = await get(address, "/healthz/live", timeout=1.0)
    assert status == 200, body
    assert time.monotonic() - started < 1.0
    held = await asyncio.wait_for(asyncio.gather(*clients), deadline + 10)
    # Every one was cut, the last ones by the deadline, though each kept sending.
    assert max(since_opened for _, since_opened in held) < deadline + 1.5
    assert sum(1 for since_opening, _ in held if since_opening >= deadline) >= 1
    assert (await get(address, "/healthz/live"))[0] == 200


async def test_the_backlog_holds_200_connections_while_the_listener_is_busy(
    make_server: ServerFactory,
) -> None:
    server, address = await admin_server(make_server)
    listener = server._admin
    assert listener is not None
    assert listener._thread_loop is not None
    gate = threading.Event()
    listener._thread_loop.call_soon_threadsafe(gate.wait, 30)  # it accepts nothing meanwhile
    try:
        opening = [asyncio.open_connection(*address) for _ in range(200)]
        conns = await asyncio.wait_for(asyncio.gather(*opening), 5)  # the kernel queued them
    finally:
        gate.set()
    for _, writer in conns:
        writer.close()
    assert (await get(address, "/healthz/live"))[0] == 200


async def test_a_request_head_over_the_bound_gets_431(make_server: ServerFactory) -> None:
    _, address = await admin_server(make_server)
    long_head = b"GET /healthz/live HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 16384 + b"\r\n\r\n"
    try:
        status, body = await exchange(address, long_head)
    except ConnectionError:
        return  # closed before its reply could be read: also an answer
    assert status == 431, body


async def test_the_front_doors_bounds_hold_here_too(make_server: ServerFactory) -> None:
    """The admin listener reads its requests through the front door's shell: a head of too
    many fields is 431, a body past its bound (no endpoint takes one) is 413, and neither
    drains the server."""
    server, address = await admin_server(make_server)
    fields = "".join(f"X-{i}: v\r\n" for i in range(MAX_HEADERS))
    status, body = await exchange(
        address, f"GET /healthz/live HTTP/1.1\r\nHost: x\r\n{fields}\r\n".encode()
    )
    assert status == 431, body
    assert str(MAX_HEADERS) in orjson.loads(body)["error"]
    big = b"x" * (admin.MAX_BODY_BYTES + 1)
    for length in (b"", b"Content-Length: %d\r\n" % len(big)):
        head = b"POST /drain HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        if length:
            head = b"POST /drain HTTP/1.1\r\nHost: x\r\n" + length + b"\r\n"
            data = head + big
        else:
            data = head + b"%x\r\n" % len(big) + big + b"\r\n0\r\n\r\n"
        status, body = await exchange(address, data)
        assert status == 413, body
        assert f"{admin.MAX_BODY_BYTES} bytes" in orjson.loads(body)["error"]
    assert not server.ledger.draining
    assert (await get(address, "/healthz/live"))[0] == 200


# /metrics ------------------------------------------------------------------------------------


async def test_a_metrics_flood_costs_the_event_loop_a_few_collections(
    make_server: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    event_loop_thread = threading.get_ident()
    collections: list[int] = []

    def counted(registry: CollectorRegistry) -> bytes:
        collections.append(threading.get_ident())
        return generate_latest(registry)

    monkeypatch.setattr(admin, "generate_latest", counted)
    _, address = await admin_server(make_server)

    async def scraper() -> None:
        for _ in range(250):
            status, body = await get(address, "/metrics")
            assert status == 200
            assert b"governor_inflight " in body

    started = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*(scraper() for _ in range(8))), 120)
    took = time.monotonic() - started
    assert set(collections) == {event_loop_thread}
    assert len(collections) <= admin.METRICS_BURST + math.ceil(took * admin.METRICS_PER_S), took


# POST /drain -------------------------------------------------------------------------------------


@pytest.mark.parametrize("wait", ["nan", "inf", "-inf", "-1", "soon"])
async def test_a_drain_wait_must_be_finite_and_not_negative(
    make_server: ServerFactory, wait: str
) -> None:
    server, address = await admin_server(make_server)
    status, body = await post(address, f"/drain?wait={wait}")
    assert status == 400
    assert "finite" in body["error"]
    assert not server.ledger.draining
    status, body = await post(address, "/drain?wait=0")
    assert (status, body["draining"]) == (200, True)


async def test_a_drain_token_is_required_once_configured(
    make_server: ServerFactory, tmp_path: Path
) -> None:
    token_file = tmp_path / "drain-token"
    token_file.write_text("  s3cret-token\n")
    server, address = await admin_server(make_server, drain_token_file=str(token_file))
    for header in ((), ("Authorization: Bearer wrong",), ("Authorization: Basic s3cret-token",)):
        status, body = await post(address, "/drain?wait=1", *header)
        assert status == 401, (header, body)
        assert "Bearer" in body["error"]
    assert not server.ledger.draining
    status, body = await post(address, "/drain?wait=1", "Authorization: Bearer s3cret-token")
    assert (status, body) == (200, {"draining": True, "drained": True, "inflight": 0})
    assert server.ledger.draining
    assert (await get(address, "/healthz/ready"))[0] == 503


async def test_governor_drain_sends_its_token_file(
    make_server: ServerFactory, tmp_path: Path
) -> None:
    token_file = tmp_path / "drain-token"
    token_file.write_text("s3cret-token\n")
    server, (host, port) = await admin_server(make_server, drain_token_file=str(token_file))
    argv = ["drain", "--metrics-listen", f"{host}:{port}", "--wait", "1"]
    assert await asyncio.to_thread(cli.main, argv) == 1  # 401
    assert not server.ledger.draining
    assert await asyncio.to_thread(cli.main, [*argv, "--token-file", str(token_file)]) == 0
    assert server.ledger.draining


@pytest.mark.parametrize("content", [None, " \n"])
async def test_a_missing_or_empty_drain_token_file_fails_the_start(
    make_server: ServerFactory, tmp_path: Path, content: str | None
) -> None:
    token_file = tmp_path / "drain-token"
    if content is not None:
        token_file.write_text(content)
    with pytest.raises(ConfigError, match="drain_token_file"):
        await make_server(metrics_listen="127.0.0.1:0", drain_token_file=str(token_file))


def test_the_metrics_budget_allows_a_burst_then_a_steady_rate() -> None:
    now = [0.0]
    budget = admin._MetricsBudget(lambda: now[0])
    assert [budget.take() for _ in range(admin.METRICS_BURST + 1)] == [
        True
    ] * admin.METRICS_BURST + [False]
    now[0] += 0.9 / admin.METRICS_PER_S
    assert not budget.take()
    now[0] += 0.1 / admin.METRICS_PER_S
    assert budget.take()
    now[0] += 3600
    assert sum(budget.take() for _ in range(10)) == admin.METRICS_BURST
