"""The OpenAI-compatible front door (``http_listen``) under a hostile network.

Each attack against a real in-process server over real sockets (raw asyncio streams for the
hostile clients, httpx for the well-behaved one that follows), and after each: the server still
answers a normal request with 200, and holds nothing (no slot, no live job, no payload byte, and
no connection the test has let go). Every test also fails if the event loop's exception handler was called (a
protocol callback that raised: the one kind of crash an asyncio server has).

The bounds are those :mod:`governor.listeners.http` promises: malformed HTTP (400, closed), request
heads (431), bodies (413, ``buffers_full`` 429), the upload deadline (408), the idle keep-alive,
pipelining and its read-ahead, clients that leave mid-job, slow readers, connection limits and
failed keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from governor.core.tenants import TenantConfig
from governor.listeners.http import HttpConnection
from governor.listeners.http_session import MAX_READ_AHEAD
from governor.listeners.shell import MAX_HEAD_BYTES, MAX_HEADERS
from governor.runners import Finished, Job, RunEvent, Runner, Token
from governor.runners.stub import StubRunner
from governor.server import Server
from tests.conftest import RawConn, ServerFactory, outcomes, wait_until

from .test_server import ping, share

KEY = "k-front"
TENANT = TenantConfig(name="front", key_sha256=hashlib.sha256(KEY.encode()).hexdigest())
CHAT = "/v1/chat/completions"
# The most one read of a socket hands the protocol (asyncio's and uvloop's read size), and a
# little more: the read-ahead bound is checked after a read, so a read may overshoot it.
ONE_READ = 256 * 1024 + 4096


def chat_body(content: str = "hi", max_tokens: int = 4, **fields: Any) -> bytes:
    return orjson.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            **fields,
        }
    )


BODY = chat_body()


def post(body: bytes = BODY, *headers: str, target: str = CHAT) -> bytes:
    """A whole POST with a Content-Length, ``headers`` ("Name: value") added to its head."""
    extra = "".join(f"{h}\r\n" for h in headers)
    head = (
        f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def get(target: str = "/v1/models", *headers: str) -> bytes:
    extra = "".join(f"{h}\r\n" for h in headers)
    return f"GET {target} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode()


def chunked(body: bytes, piece: int) -> bytes:
    out = b""
    for i in range(0, len(body), piece):
        part = body[i : i + piece]
        out += b"%x\r\n" % len(part) + part + b"\r\n"
    return out + b"0\r\n\r\n"


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)

    @property
    def code(self) -> Any:
        return self.json()["error"]["code"]


async def read_head(reader: asyncio.StreamReader) -> Answer:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].decode("latin-1").split("\r\n")
    version, status, _ = lines[0].split(" ", 2)
    assert version == "HTTP/1.1", lines[0]
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        assert colon, line
        headers[name.strip().lower()] = value.strip()
    return Answer(int(status), headers, b"")


async def read_chunk(reader: asyncio.StreamReader) -> bytes | None:
    """The next chunk of a chunked body; None at its end."""
    size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
    data = await reader.readexactly(size + 2)
    assert data.endswith(b"\r\n")
    return data[:-2] if size else None


async def read_answer(reader: asyncio.StreamReader, head_only: bool = False) -> Answer:
    """One whole answer (a 1xx, or the answer to a HEAD, is a head alone); a body without a
    length runs to the close."""
    answer = await read_head(reader)
    if 100 <= answer.status < 200 or head_only:
        return answer
    if "content-length" in answer.headers:
        answer.body = await reader.readexactly(int(answer.headers["content-length"]))
    elif answer.headers.get("transfer-encoding") == "chunked":
        while (data := await read_chunk(reader)) is not None:
            answer.body += data
    else:
        answer.body = await reader.read()
    return answer


class Client:
    """A raw HTTP client: bytes out as given, answers parsed by hand (pipelined or not)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, server: Server, source: str | None = None) -> Client:
        address = server.http_address
        assert address is not None
        reader, writer = await asyncio.open_connection(
            *address, limit=2**20, local_addr=None if source is None else (source, 0)
        )
        return cls(reader, writer)

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def answer(self, timeout: float = 5.0, head_only: bool = False) -> Answer:
        return await asyncio.wait_for(read_answer(self.reader, head_only), timeout)

    async def closed(self, timeout: float = 5.0) -> None:
        """Assert that the server closes the connection with nothing more to read."""
        try:
            rest = await asyncio.wait_for(self.reader.read(), timeout)
        except ConnectionResetError:
            return
        assert rest == b"", f"expected the connection to close, got {rest[:200]!r}"

    def abort(self) -> None:
        self.writer.transport.abort()

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


Dial = Callable[..., Awaitable[Client]]


@pytest.fixture
async def dial() -> AsyncIterator[Dial]:
    """``await dial(server, source=None)``: a :class:`Client`, aborted after the test."""
    clients: list[Client] = []

    async def opener(server: Server, source: str | None = None) -> Client:
        client = await Client.open(server, source)
        clients.append(client)
        return client

    yield opener
    for client in clients:
        client.abort()


@pytest.fixture(autouse=True)
async def loop_errors() -> AsyncIterator[list[dict[str, Any]]]:
    """What reached the event loop's exception handler during the test: must be nothing."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: errors.append(context))
    yield errors
    loop.set_exception_handler(previous)
    assert not errors, [(c.get("message"), c.get("exception")) for c in errors]


async def front(
    make_server: ServerFactory, instance: Runner | None = None, **config: Any
) -> Server:
    return await make_server(instance, http_listen="127.0.0.1:0", **config)


def http_connections(server: Server) -> list[HttpConnection]:
    return [c for c in server.state.connections if isinstance(c, HttpConnection)]


def buffered(conn: HttpConnection) -> int:
    """Bytes received on ``conn`` that h11 holds, not yet handled."""
    return len(conn.session.http.trailing_data[0])


def idle(server: Server) -> bool:
    return (server.inflight, server.live_jobs, server.buffered_bytes) == (0, 0, 0)


async def assert_healthy(server: Server) -> None:
    """Nothing leaked, and a well-formed request right after gets its 200."""
    await wait_until(lambda: idle(server), timeout=3)
    held = len(http_connections(server))  # (the test's own, kept alive)
    address = server.http_address
    assert address is not None
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=f"http://{address[0]}:{address[1]}") as client:
        reply = await client.post(CHAT, content=chat_body(max_tokens=1), headers=headers, timeout=5)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["object"] == "chat.completion"
    assert answer["usage"]["completion_tokens"] == 1
    await wait_until(lambda: idle(server) and len(http_connections(server)) <= held, timeout=3)


# Malformed HTTP ----------------------------------------------------------------------------

MALFORMED = {
    "garbage": b"GARBAGE\r\n\r\n",
    "tls_hello": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(40) + b"\r\n\r\n",
    "double_space": b"GET  /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    "no_host": b"GET /v1/models HTTP/1.1\r\n\r\n",
    "header_without_colon": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nNoColon\r\n\r\n",
    "space_before_colon": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad : y\r\n\r\n",
    "nul_in_value": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n",
    "bad_content_length": post().replace(b"Content-Length: ", b"Content-Length: x"),
    "negative_content_length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    b"Content-Length: -1\r\n\r\n",
    "conflicting_lengths": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
    b"Content-Length: 6\r\n\r\nhello!",
    "bad_chunk_size": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
async def test_malformed_http_gets_400_and_a_close_and_the_next_client_is_served(
    make_server: ServerFactory, dial: Dial, name: str
) -> None:
    server = await front(make_server)
    client = await dial(server)
    client.send(MALFORMED[name])
    answer = await client.answer()
    assert answer.status == 400, answer
    assert answer.headers["connection"] == "close"
    assert answer.code == "spec_invalid"
    assert answer.json()["error"]["type"] == "invalid_request_error"
    await client.closed()
    await assert_healthy(server)


async def test_a_transfer_coding_it_cannot_read_is_501_and_a_close(
    make_server: ServerFactory, dial: Dial
) -> None:
    server = await front(make_server)
    client = await dial(server)
    client.send(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n\x1f\x8b"
    )
    answer = await client.answer()
    assert (answer.status, answer.headers["connection"]) == (501, "close")
    await client.closed()
    await assert_healthy(server)


async def test_garbage_behind_good_requests_is_answered_in_its_turn(
    make_server: ServerFactory, dial: Dial
) -> None:
    """A request, a job, then garbage, in one write: 200, 200 (once the job ends), 400, closed."""
    server = await front(make_server, stub_ms=200)
    client = await dial(server)
    client.send(get() + post() + b"NOT HTTP AT ALL\r\n\r\n" + get())
    first, second, third = [await client.answer() for _ in range(3)]
    assert (first.status, second.status, third.status) == (200, 200, 400)
    assert first.json()["object"] == "list"
    assert second.json()["object"] == "chat.completion"
    await client.closed()
    await assert_healthy(server)


# Request heads ------------------------------------------------------------------------------


def many_fields(n: int) -> bytes:
    """A GET whose head has ``n`` fields (Host among them)."""
    return get("/v1/models", *(f"X-F{i}: v" for i in range(n - 1)))


def huge_field(nbytes: int) -> bytes:
    return get("/v1/models", "X-Huge: " + "h" * nbytes)


async def send_trickled(
    client: Client, data: bytes, piece: int, answered: asyncio.Task[Any]
) -> int:
    """Send ``data`` ``piece`` bytes at a time, each in its own segment, until ``answered``
    is done; how many bytes went out."""
    sent = 0
    while sent < len(data) and not answered.done():
        client.send(data[sent : sent + piece])
        sent += piece
        try:
            await client.writer.drain()
        except ConnectionError:
            break
        await asyncio.sleep(0.002)
    return min(sent, len(data))


@pytest.mark.parametrize("how", ["whole", "trickled"])
@pytest.mark.parametrize(
    "head",
    [
        pytest.param(many_fields(MAX_HEADERS + 1), id="fields"),
        pytest.param(many_fields(5000), id="fields_over_the_bytes"),
        pytest.param(huge_field(MAX_HEAD_BYTES + 1024), id="one_huge_field"),
        pytest.param(huge_field(1024 * 1024), id="one_field_of_a_mib"),
    ],
)
async def test_a_head_flood_is_431_and_a_close(
    make_server: ServerFactory, dial: Dial, head: bytes, how: str
) -> None:
    server = await front(make_server)
    client = await dial(server)
    answering = asyncio.ensure_future(client.answer())
    if how == "whole":
        client.send(head)
        sent = len(head)
    else:
        sent = await send_trickled(client, head, 512, answering)
    answer = await answering
    assert (answer.status, answer.headers["connection"]) == (431, "close")
    assert answer.code == "spec_invalid"
    assert server.state.metrics.aborts["spec_invalid"] == 1  # (as TCP counts its aborts)
    await client.closed()
    if how == "trickled":  # refused once the bound was passed, not at the head's end
        assert sent <= min(len(head), MAX_HEAD_BYTES + 16 * 1024), sent
    await assert_healthy(server)


@pytest.mark.parametrize(
    "head",
    [
        pytest.param(many_fields(MAX_HEADERS), id="fields_at_the_limit"),
        pytest.param(huge_field(MAX_HEAD_BYTES - 1024), id="a_head_under_the_bytes"),
    ],
)
async def test_a_head_within_the_bounds_is_served(
    make_server: ServerFactory, dial: Dial, head: bytes
) -> None:
    server = await front(make_server)
    client = await dial(server)
    client.send(head)
    answer = await client.answer()
    assert answer.status == 200, answer
    assert answer.json()["object"] == "list"
    assert "connection" not in answer.headers  # kept alive
    client.send(get())
    assert (await client.answer()).status == 200


# Bodies -------------------------------------------------------------------------------------


@pytest.mark.parametrize("expect", [False, True])
async def test_a_huge_content_length_is_413_before_any_body_is_sent(
    make_server: ServerFactory, dial: Dial, expect: bool
) -> None:
    server = await front(make_server, max_payload_bytes=4096)
    client = await dial(server)
    head = post(b"", *(["Expect: 100-continue"] if expect else []))
    client.send(head.replace(b"Content-Length: 0", b"Content-Length: %d" % 10**15))
    answer = await client.answer()  # no body byte was sent
    assert (answer.status, answer.headers["connection"]) == (413, "close")
    assert answer.code == "payload_too_large"
    assert server.state.metrics.aborts["payload_too_large"] == 1
    await client.closed()
    assert server.buffered_bytes == 0
    await assert_healthy(server)


async def test_a_body_at_the_limit_is_served_and_one_byte_more_is_413(
    make_server: ServerFactory, dial: Dial
) -> None:
    limit = 4096
    server = await front(make_server, max_payload_bytes=limit)
    at_limit = BODY[:-1] + b" " * (limit - len(BODY)) + b"}"
    assert len(at_limit) == limit
    client = await dial(server)
    client.send(post(at_limit))
    assert (await client.answer()).status == 200
    client.send(post(at_limit + b" "))
    answer = await client.answer()
    assert (answer.status, answer.code) == (413, "payload_too_large")
    await client.closed()
    await assert_healthy(server)


async def test_a_chunked_body_growing_past_the_limit_is_413_as_it_arrives(
    make_server: ServerFactory, dial: Dial
) -> None:
    limit = 8192
    server = await front(make_server, max_payload_bytes=limit)
    client = await dial(server)
    client.send(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
    answering = asyncio.ensure_future(client.answer())
    sent = 0
    while not answering.done() and sent < 100 * limit:  # a body that would never end
        client.send(b"400\r\n" + b"a" * 1024 + b"\r\n")
        sent += 1024
        with contextlib.suppress(ConnectionError):
            await client.writer.drain()
        await asyncio.sleep(0.002)
    answer = await answering
    assert (answer.status, answer.code) == (413, "payload_too_large")
    assert sent <= limit + 64 * 1024  # refused as the bytes came, not at the body's end
    await client.closed()
    await assert_healthy(server)


async def test_a_chunked_body_within_the_limit_is_served(
    make_server: ServerFactory, dial: Dial
) -> None:
    server = await front(make_server, max_payload_bytes=4096)
    client = await dial(server)
    client.send(
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        + chunked(BODY, 7)
    )
    answer = await client.answer()
    assert answer.status == 200, answer
    assert answer.json()["usage"]["completion_tokens"] == 4


async def test_expect_100_continue_is_answered_before_the_body(
    make_server: ServerFactory, dial: Dial
) -> None:
    """A client that waits for ``100 Continue`` (curl does, for bodies over 1 KiB) must get it
    before it sends its body."""
    server = await front(make_server)
    client = await dial(server)
    client.send(post(b"", "Expect: 100-continue").replace(b"Length: 0", b"Length: %d" % len(BODY)))
    interim = await client.answer(timeout=2)
    assert interim.status == 100
    client.send(BODY)
    assert (await client.answer()).status == 200
    await assert_healthy(server)


async def test_bodies_count_against_the_servers_buffers(
    make_server: ServerFactory, dial: Dial
) -> None:
    """A running job holds its body's bytes; a body that does not fit beside them is 429
    ``buffers_full`` (and so is one larger than all the buffers); the retry, once the job is
    done, is served."""
    server = await front(make_server, max_buffer_bytes=6000, max_inflight=2, stub_ms=300)
    holder_body = chat_body("h" * 4000)
    holder = await dial(server)
    holder.send(post(holder_body))
    await wait_until(lambda: server.inflight == 1)
    assert server.buffered_bytes == len(holder_body)
    late_body = chat_body("l" * 2500)
    for body in (late_body, chat_body("x" * 7000)):
        late = await dial(server)
        late.send(post(body))
        answer = await late.answer()
        assert (answer.status, answer.code) == (429, "buffers_full")
        assert answer.json()["error"]["type"] == "rate_limit_error"
        assert int(answer.headers["retry-after-ms"]) > 0
        assert int(answer.headers["retry-after"]) >= 1
        await late.closed()
    assert server.buffered_bytes == len(holder_body)  # the refused held nothing
    assert server.state.metrics.aborts["buffers_full"] == 0  # (a yield: come back)
    server.ledger.draining = True  # a drain: no retry here would be admitted, as on TCP
    late = await dial(server)
    late.send(post(late_body))
    answer = await late.answer()
    assert (answer.status, answer.code) == (503, "draining")
    assert answer.headers["connection"] == "close"
    server.ledger.draining = False
    assert (await holder.answer()).status == 200
    await wait_until(lambda: server.buffered_bytes == 0)
    retry = await dial(server)
    retry.send(post(late_body))
    assert (await retry.answer()).status == 200
    await assert_healthy(server)


# Deadlines ----------------------------------------------------------------------------------


TRICKLED = {
    # No head first, then a head that never ends, a byte at a time.
    "head": (b"", (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\n" + "X-Pad: y\r\n" * 1000).encode()),
    # A whole head, then a body promised long, a few bytes at a time.
    "body": (post(b"").replace(b"Length: 0", b"Length: 100000"), b"{" * 10000),
}


@pytest.mark.parametrize("part", sorted(TRICKLED))
async def test_a_trickled_request_gets_408_at_its_deadline_however_steadily_it_comes(
    make_server: ServerFactory, dial: Dial, part: str
) -> None:
    upload_timeout = 0.5
    server = await front(make_server, upload_timeout=upload_timeout, idle_timeout=60)
    client = await dial(server)
    head, data = TRICKLED[part]
    answering = asyncio.ensure_future(client.answer(timeout=upload_timeout + 5))
    started = time.monotonic()
    client.send(head)
    sent = 0
    while not answering.done() and sent < len(data):  # a byte every 20 ms
        client.send(data[sent : sent + 1])
        sent += 1
        await asyncio.sleep(0.02)
    answer = await answering
    took = time.monotonic() - started
    assert (answer.status, answer.headers["connection"]) == (408, "close")
    assert answer.code == "upload_timeout"
    assert server.state.metrics.aborts["upload_timeout"] == 1
    assert upload_timeout * 0.8 <= took < upload_timeout + 3, took
    assert upload_timeout / 0.02 / 2 < sent < len(data)  # it was still coming, all along
    await client.closed()
    await assert_healthy(server)


async def test_a_silent_connection_is_closed_quietly_at_the_idle_timeout(
    make_server: ServerFactory, dial: Dial
) -> None:
    idle_timeout = 0.4
    server = await front(make_server, idle_timeout=idle_timeout, upload_timeout=0.1)
    client = await dial(server)
    started = time.monotonic()
    await client.closed(timeout=idle_timeout + 3)  # closed, not answered 408
    assert idle_timeout * 0.8 <= time.monotonic() - started < idle_timeout + 3
    await assert_healthy(server)


async def test_an_idle_keep_alive_connection_is_closed_after_idle_timeout(
    make_server: ServerFactory, dial: Dial
) -> None:
    idle_timeout = 0.4
    server = await front(make_server, idle_timeout=idle_timeout)
    client = await dial(server)
    for _ in range(2):  # kept alive between requests that come in time
        client.send(post())
        answer = await client.answer()
        assert answer.status == 200
        assert "connection" not in answer.headers
        await asyncio.sleep(idle_timeout / 2)
    started = time.monotonic()
    await client.closed(timeout=idle_timeout + 3)
    assert time.monotonic() - started < idle_timeout + 3
    await wait_until(lambda: not http_connections(server))
    await assert_healthy(server)


async def test_a_job_longer_than_the_idle_timeout_is_answered(
    make_server: ServerFactory, dial: Dial
) -> None:
    server = await front(make_server, idle_timeout=0.2, upload_timeout=0.2, stub_ms=700)
    client = await dial(server)
    client.send(post())
    answer = await client.answer()
    assert answer.status == 200
    client.send(get())  # and the connection is still kept
    assert (await client.answer()).status == 200
    await assert_healthy(server)


# Pipelining ---------------------------------------------------------------------------------


async def test_pipelined_requests_are_answered_in_order_one_at_a_time(
    make_server: ServerFactory, dial: Dial
) -> None:
    server = await front(make_server, max_inflight=3, stub_ms=100)
    client = await dial(server)
    client.send(b"".join(post(chat_body(max_tokens=n)) for n in (1, 2, 3)))
    answers = [await client.answer() for _ in range(3)]
    assert [a.status for a in answers] == [200, 200, 200]
    assert [a.json()["usage"]["completion_tokens"] for a in answers] == [1, 2, 3]
    assert server.ledger.peak_inflight == 1  # one job at a time on one connection
    client.send(post(chat_body(max_tokens=4)))
    fourth = await client.answer()
    assert (fourth.status, fourth.json()["usage"]["completion_tokens"]) == (200, 4)
    await assert_healthy(server)


async def test_pipelined_answers_keep_their_order_whatever_their_kind(
    make_server: ServerFactory, dial: Dial
) -> None:
    server = await front(make_server, stub_ms=100)
    client = await dial(server)
    client.send(
        post(chat_body(max_tokens=2))
        + get()
        + get("/nowhere")
        + get(CHAT)
        + post(b"{not json")
        + post(chat_body(max_tokens=3, stream=True))
        + b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
        + post(chat_body(max_tokens=5), "Connection: close")
    )
    answers = [await client.answer(head_only=i == 6) for i in range(7)]
    assert [a.status for a in answers] == [200, 200, 404, 405, 400, 200, 200]
    assert answers[0].json()["usage"]["completion_tokens"] == 2
    assert answers[5].headers["content-type"] == "text/event-stream"
    assert answers[5].body.endswith(b"data: [DONE]\n\n")
    assert int(answers[6].headers["content-length"]) > 0  # HEAD: the length, no body
    last = await client.answer()
    assert (last.status, last.headers["connection"]) == (200, "close")
    assert last.json()["usage"]["completion_tokens"] == 5
    await client.closed()
    await assert_healthy(server)


async def test_many_pipelined_requests_answered_at_once_are_all_answered(
    make_server: ServerFactory, dial: Dial
) -> None:
    """Requests answered without a job (here /v1/models) are answered one after another as
    they are parsed: 400 of them in one write must not run the handler out of stack."""
    server = await front(make_server)
    client = await dial(server)
    n = 400
    client.send(get() * n)
    answers = [await client.answer() for _ in range(n)]
    assert all(a.status == 200 for a in answers)
    await assert_healthy(server)


def fat_job(i: int, max_tokens: int = 1) -> bytes:
    """A job of about 32 KiB whose answer tells it apart (prompt_tokens 8000 + i)."""
    return post(chat_body("x" * (32_000 + 4 * i), max_tokens=max_tokens))


async def test_read_ahead_behind_a_running_job_pauses_reading(
    make_server: ServerFactory, dial: Dial
) -> None:
    """1 MiB pipelined behind a job of a second: the server reads MAX_READ_AHEAD (and one read)
    of it, stops reading, and answers everything in order once the job is done."""
    server = await front(make_server, stub_ms=0, stub_output_ms=10)
    client = await dial(server)
    client.send(fat_job(0, max_tokens=101))
    await wait_until(lambda: len(http_connections(server)) == 1 and server.inflight == 1)
    n = 32
    client.send(b"".join(fat_job(i) for i in range(1, n + 1)))
    (conn,) = http_connections(server)
    transport = conn.transport
    assert transport is not None
    await wait_until(lambda: not transport.is_reading(), timeout=2)
    assert server.inflight == 1  # the first job still runs
    assert MAX_READ_AHEAD < buffered(conn) <= MAX_READ_AHEAD + ONE_READ
    answers = [await client.answer() for _ in range(n + 1)]
    assert [a.status for a in answers] == [200] * (n + 1)
    assert [a.json()["usage"]["prompt_tokens"] for a in answers] == [8000 + i for i in range(n + 1)]
    await assert_healthy(server)


async def test_read_ahead_stays_bounded_over_many_pipelined_jobs(
    make_server: ServerFactory, dial: Dial
) -> None:
    """A client pipelining 3 MiB of small jobs: while they are answered one at a time, the
    bytes read and not yet handled stay within MAX_READ_AHEAD (and one read), job after job."""
    server = await front(make_server, stub_ms=2)
    client = await dial(server)
    request = post()
    n = (3 << 20) // len(request)
    client.send(request * n)
    await wait_until(lambda: len(http_connections(server)) == 1)
    (conn,) = http_connections(server)
    answered = 0

    async def read_answers() -> None:
        nonlocal answered
        while True:
            assert (await client.answer()).status == 200
            answered += 1

    reading = asyncio.ensure_future(read_answers())
    peak = 0
    try:
        while answered < 40:
            peak = max(peak, buffered(conn))
            assert not reading.done()
            await asyncio.sleep(0.002)
    finally:
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading
    assert peak <= MAX_READ_AHEAD + ONE_READ, f"{peak} bytes read ahead after {answered} jobs"
    client.abort()
    await assert_healthy(server)


# Clients that leave -------------------------------------------------------------------------


async def test_a_client_leaving_mid_upload_frees_its_bytes(
    make_server: ServerFactory, dial: Dial
) -> None:
    server = await front(make_server)
    client = await dial(server)
    body = chat_body("u" * 10_000)
    client.send(post(body)[: -len(body) // 2])
    await wait_until(lambda: server.buffered_bytes > 0)
    client.abort()
    await wait_until(lambda: idle(server) and not http_connections(server), timeout=2)
    await assert_healthy(server)


@pytest.mark.parametrize("how", ["close", "abort", "half_close"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_leaving_mid_job_cancels_it_and_frees_its_slot(
    make_server: ServerFactory, dial: Dial, stream: bool, how: str
) -> None:
    """The job would run 5 s: its client leaves (mid-stream, for a stream, after its first
    token), and within 2 s nothing is held."""
    server = await front(make_server, stub_ms=0, stub_output_ms=1000)
    client = await dial(server)
    body = chat_body("p" * 10_000, max_tokens=6, stream=stream)
    client.send(post(body))
    await wait_until(lambda: server.inflight == 1)
    assert server.buffered_bytes == len(body)  # the body is held while its job runs
    if stream:
        head = await read_head(client.reader)
        assert (head.status, head.headers["content-type"]) == (200, "text/event-stream")
        events = b""
        while b"stub " not in events:  # the first token is out; the rest would take 5 s
            data = await asyncio.wait_for(read_chunk(client.reader), 2)
            assert data is not None
            events += data
    started = time.monotonic()
    if how == "close":
        client.writer.close()
    elif how == "abort":
        client.abort()
    else:  # (the front door does not tell a half-close from a close)
        client.writer.write_eof()
    await wait_until(lambda: idle(server) and not http_connections(server), timeout=2)
    assert time.monotonic() - started < 2
    assert outcomes(server)["client_gone"] == 1
    await assert_healthy(server)


# Slow readers -------------------------------------------------------------------------------
# The stub streams one token ("stub "), then sleeps out the rest of its job: its streams are a
# few hundred bytes, which no unread socket can back up. A runner with a long stream (as the
# real ones have) is needed to back one up: this one is the stub with many big tokens.


TOKEN = "x" * 16384


class Firehose(StubRunner):
    """The stub, streaming its job's max_new_tokens tokens of 16 KiB: the first ``burst`` as fast
    as it can, the others one every ``pace_s``."""

    name = "firehose"

    def __init__(self, burst: int, pace_s: float = 0.0) -> None:
        super().__init__(0.0)
        self.burst = burst
        self.pace_s = pace_s

    async def run(self, job: Job) -> AsyncGenerator[RunEvent, None]:
        assert job.spec is not None
        for i in range(job.spec.max_new_tokens):
            await asyncio.sleep(0 if i < self.burst else self.pace_s)
            yield Token(TOKEN)
        yield Finished({"completion_tokens": job.spec.max_new_tokens})


def unread_socket(server: Server) -> socket.socket:
    """A client socket with a 4 KiB receive buffer, which will never be read."""
    address = server.http_address
    assert address is not None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(address)
    return sock


@pytest.mark.parametrize(
    ("runner", "config", "reason"),
    [
        (Firehose(1024), {"write_buffer_bytes": 65536, "write_timeout": 60}, "slow_reader"),
        (
            Firehose(512, 0.1),
            {"write_buffer_bytes": 64 << 20, "write_timeout": 0.5},
            "write_timeout",
        ),
    ],
    ids=["write_buffer_bytes", "write_timeout"],
)
async def test_a_stream_nobody_reads_is_cut_off_and_gives_its_slot_back(
    make_server: ServerFactory, runner: Firehose, config: dict[str, Any], reason: str
) -> None:
    """A 16 MiB stream (or 8 MiB, then a token every 100 ms) to a client that reads nothing (the
    kernel's buffers take 4 MiB at most): cut off at ``write_buffer_bytes`` unread (or after
    ``write_timeout`` unread), its job cancelled."""
    server = await front(make_server, runner, **config)
    sock = unread_socket(server)
    try:
        sock.sendall(post(chat_body(stream=True, max_tokens=1024)))
        await wait_until(lambda: server.state.connections.refused[reason] == 1, timeout=5)
        await wait_until(lambda: idle(server) and not http_connections(server), timeout=2)
        assert outcomes(server)["client_gone"] == 1
        assert sum(server.state.connections.refused.values()) == 1
    finally:
        sock.close()
    address = server.http_address
    assert address is not None
    async with (  # a client that reads gets its whole stream
        httpx.AsyncClient(base_url=f"http://{address[0]}:{address[1]}") as client,
        client.stream("POST", CHAT, content=chat_body(stream=True, max_tokens=300)) as reply,
    ):
        assert reply.status_code == 200
        assert (await reply.aread()).count(TOKEN.encode()) == 300
    await assert_healthy(server)


# Connections --------------------------------------------------------------------------------


async def assert_refused(client: Client, status: int, code: str) -> Answer:
    answer = await client.answer()
    assert (answer.status, answer.code, answer.headers["connection"]) == (status, code, "close")
    await client.closed()
    return answer


async def test_connections_over_the_limit_get_503_and_are_closed(
    make_server: ServerFactory, dial: Dial
) -> None:
    """At max_connections with none idle (each has a request arriving), one more is refused."""
    server = await front(make_server, max_connections=2)
    held = [await dial(server) for _ in range(2)]
    for client in held:
        client.send(post()[:20])  # a request begun: not idle
    await wait_until(lambda: sum(c.session.arriving for c in http_connections(server)) == 2)
    third = await dial(server)
    answer = await assert_refused(third, 503, "too_many_connections")
    assert answer.headers["retry-after"] == "1"
    assert answer.headers["retry-after-ms"] == "1000"
    assert server.state.connections.refused["too_many_connections"] == 1
    held[0].send(post()[20:])  # the held ones are served meanwhile
    assert (await held[0].answer()).status == 200
    for client in held:
        client.abort()
    await assert_healthy(server)


async def test_the_connection_limit_counts_both_listeners(
    make_server: ServerFactory, dial: Dial
) -> None:
    server = await front(make_server, max_connections=2, stub_ms=3000)
    tcp = await RawConn.open(server)
    try:
        inline = {"data": "x", "sha256": hashlib.sha256(b"x").hexdigest()}
        tcp.send({**share("J_1", 1), "payload_inline": inline})
        await wait_until(lambda: server.inflight == 1)  # a job running: not idle
        http = await dial(server)
        http.send(post()[:20])
        await wait_until(lambda: sum(c.session.arriving for c in http_connections(server)) == 1)
        await assert_refused(await dial(server), 503, "too_many_connections")
        other_tcp = await RawConn.open(server)
        try:
            refused = await other_tcp.recv()
            assert refused["need_code"] == "too_many_connections"
            await other_tcp.recv_eof()
        finally:
            await other_tcp.close()
        http.abort()
    finally:
        await tcp.close()
    await wait_until(lambda: not server.state.connections)
    await assert_healthy(server)


async def test_one_source_at_its_limit_leaves_room_for_others(
    make_server: ServerFactory, dial: Dial
) -> None:
    """An untrusted source's connections that showed a key hold its limit: one more is refused,
    and another source is served."""
    server = await front(
        make_server,
        tenants=(TENANT,),
        max_connections=8,
        max_connections_per_source=2,
        trusted_sources="",
    )
    held = [await dial(server) for _ in range(2)]
    for client in held:
        client.send(post(BODY, f"Authorization: Bearer {KEY}"))
        assert (await client.answer()).status == 200
    answer = await assert_refused(await dial(server), 503, "too_many_connections")
    assert "this address" in answer.json()["error"]["message"]
    other = await dial(server, source="127.0.0.2")
    other.send(post(BODY, f"Authorization: Bearer {KEY}"))
    assert (await other.answer()).status == 200
    for client in [*held, other]:
        client.abort()
    await wait_until(lambda: not http_connections(server))
    assert server.state.connections.sources.open_by_source == {}
    assert idle(server)


async def test_failed_keys_close_the_connection_and_not_the_neighbours(
    make_server: ServerFactory, dial: Dial
) -> None:
    """The connection that fails ``max_auth_failures`` keys is closed; a new connection from
    the same address with a valid key is served at once (the burst is not spent), over HTTP and
    over TCP."""
    server = await front(make_server, tenants=(TENANT,), max_auth_failures=2)
    client = await dial(server)
    client.send(post())  # no key
    first = await client.answer()
    assert (first.status, first.code) == (401, "unauthorized")
    assert first.headers["www-authenticate"] == "Bearer"
    assert "connection" not in first.headers  # one failure: kept
    client.send(post(BODY, f"Authorization: Bearer {KEY}"))
    assert (await client.answer()).status == 200
    # The next guess is the connection's last; what was pipelined after it is not answered.
    client.send(
        post(BODY, "Authorization: Bearer guess") + post(BODY, f"Authorization: Bearer {KEY}")
    )
    second = await client.answer()
    assert (second.status, second.headers["connection"]) == (401, "close")
    await client.closed()
    again = await dial(server)
    again.send(post(BODY, f"Authorization: Bearer {KEY}"))
    assert (await again.answer()).status == 200
    tcp = await RawConn.open(server)
    try:
        tcp.send(ping())
        assert (await tcp.recv())["status"] == "ok"
    finally:
        await tcp.close()
    again.abort()
    await wait_until(lambda: idle(server) and not http_connections(server))


async def test_a_key_past_the_burst_waits_for_its_turn_and_is_served(
    make_server: ServerFactory, dial: Dial
) -> None:
    """Past the source's burst a new key is checked at its turn (the request waits), a valid
    one is served and gives its turn back; a client that leaves gives its turn back too."""
    server = await front(make_server, tenants=(TENANT,), auth_guess_burst=2, auth_guess_rate=0.5)
    guesser = await dial(server)
    guesser.send(b"".join(post(BODY, f"Authorization: Bearer guess-{i}") for i in range(2)))
    assert [(await guesser.answer()).status for _ in range(2)] == [401, 401]
    sources = server.state.connections.sources
    spent = sources._paid_at["127.0.0.1"]
    leaving = await dial(server)
    leaving.send(post(BODY, "Authorization: Bearer another-guess"))  # its turn: about 2 s away
    await wait_until(lambda: sources._paid_at["127.0.0.1"] > spent)
    leaving.abort()
    await wait_until(lambda: sources._paid_at["127.0.0.1"] == spent)  # given back
    keyed = await dial(server)
    keyed.send(post(BODY, f"Authorization: Bearer {KEY}"))
    assert (await keyed.answer()).status == 200
    assert sources._paid_at["127.0.0.1"] == spent  # its turn given back
    for client in (guesser, keyed):
        client.abort()
    await wait_until(lambda: idle(server) and not http_connections(server))


async def test_pipelined_guesses_get_max_auth_failures_answers_then_a_close(
    make_server: ServerFactory, dial: Dial
) -> None:
    server = await front(
        make_server,
        tenants=(TENANT,),
        max_auth_failures=3,
        auth_guess_burst=3,
        auth_guess_rate=0.1,
    )
    client = await dial(server)
    client.send(b"".join(post(BODY, f"Authorization: Bearer guess-{i}") for i in range(10)))
    answers = [await client.answer() for _ in range(3)]
    assert [a.status for a in answers] == [401] * 3
    assert [a.headers.get("connection") for a in answers] == [None, None, "close"]
    await client.closed()
    assert server.state.connections.sources.waiting == 1
    assert server.inflight == 0


# Properties ---------------------------------------------------------------------------------

PROPERTIES = settings(
    max_examples=40,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


_servers: weakref.WeakKeyDictionary[ServerFactory, Server] = weakref.WeakKeyDictionary()


async def shared_server(make_server: ServerFactory, **config: Any) -> Server:
    """One server for all of a property test's examples (the fixture is the test's, not the
    example's): whatever an example leaks is there for the next to trip on."""
    if make_server not in _servers:
        _servers[make_server] = await front(make_server, **config)
    return _servers[make_server]


@st.composite
def splits(draw: st.DrawFn, data: bytes) -> list[bytes]:
    cuts = sorted(draw(st.sets(st.integers(1, len(data) - 1), max_size=20)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


SPLIT_REQUEST = post(chat_body("split me", max_tokens=3), f"X-Pad: {'p' * 100}")
SPLIT_CHUNKED = (
    f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    + chunked(chat_body("split me", max_tokens=3), 5)
)


@PROPERTIES
@given(pieces=splits(SPLIT_REQUEST) | splits(SPLIT_CHUNKED))
async def test_a_request_split_anyhow_gets_the_same_answer(
    make_server: ServerFactory, pieces: list[bytes]
) -> None:
    server = await shared_server(make_server, stub_ms=0)
    client = await Client.open(server)
    try:
        for piece in pieces:
            client.send(piece)
            await client.writer.drain()
            await asyncio.sleep(0)  # (each its own segment, mostly)
        answer = await client.answer()
        assert answer.status == 200, answer
        result = answer.json()
        assert result["object"] == "chat.completion"
        assert result["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
        client.send(get())  # and the connection is still good
        assert (await client.answer()).status == 200
    finally:
        client.abort()
    await wait_until(lambda: idle(server) and not http_connections(server))


HOSTILE_PIECES = st.sampled_from(
    [
        b"GET /v1/models HTTP/1.1\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\n",
        b"Host: x\r\n",
        b"Content-Length: 5\r\n",
        b"Content-Length: 99999999999\r\n",
        b"Transfer-Encoding: chunked\r\n",
        b"Expect: 100-continue\r\n",
        b"Connection: close\r\n",
        b"\r\n",
        b"\n",
        b"5\r\nhello\r\n",
        b"0\r\n\r\n",
        BODY,
        post(),
        get(),
        b"\x00\xff",
        b" ",
        b":",
    ]
)
GARBAGE = st.lists(HOSTILE_PIECES | st.binary(max_size=64), max_size=12).map(b"".join)


@PROPERTIES
@given(garbage=GARBAGE, pieces=st.integers(1, 4))
async def test_any_bytes_get_well_formed_answers_or_a_close_and_leak_nothing(
    make_server: ServerFactory, garbage: bytes, pieces: int
) -> None:
    """Whatever a client sends, then half-closes: what comes back is a run of whole HTTP
    answers, the connection ends, and nothing is held after (the loop handler sees no error)."""
    server = await shared_server(make_server, stub_ms=0, max_payload_bytes=4096)
    client = await Client.open(server)
    try:
        step = -(-len(garbage) // pieces) or 1
        with contextlib.suppress(RuntimeError, OSError):  # (closed by the server meanwhile)
            for i in range(0, len(garbage), step):
                client.send(garbage[i : i + step])
                await asyncio.sleep(0)
            client.writer.write_eof()
        try:
            back = await asyncio.wait_for(client.reader.read(), 5)
        except ConnectionResetError:
            back = b""  # (closed with bytes unread: a reset may overtake the answers)
        answers = asyncio.StreamReader()
        answers.feed_data(back)
        answers.feed_eof()
        while not answers.at_eof():
            answer = await read_answer(answers)
            assert 100 <= answer.status < 600, answer
    finally:
        client.abort()
    await wait_until(lambda: idle(server) and not http_connections(server))
    after = await Client.open(server)  # and the next client is served
    try:
        after.send(get())
        assert (await after.answer()).status == 200
    finally:
        after.abort()
