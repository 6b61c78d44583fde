"""The sidecar's HTTP/1.1 client against a scripted server on a real socket: connections kept
and reused, a kept connection the server closed, silences, broken bodies, a reader that stops."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import trustme

from governor.runners.sidecar.upstream import Upstream, UpstreamError, UpstreamTimeout

Reply = Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]  # False: close after it


class Scripted:
    """A server whose every answer is ``reply``'s; it counts connections and requests."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()  # a client closed a connection
        self.handlers: set[asyncio.Task[None]] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)  # (a handler still replying when the test ends is cancelled)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                self.requests.append(head + await reader.readexactly(length))
                if not await self.reply(head, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed.set()
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def scripted(reply: Reply) -> AsyncIterator[tuple[Scripted, str]]:
    server = Scripted(reply)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        listener.close()
        for task in server.handlers:
            task.cancel()
        await asyncio.gather(*server.handlers, return_exceptions=True)


def chunked(*pieces: bytes) -> bytes:
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    body = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces)
    return head + body + b"0\r\n\r\n"


async def stream(head: bytes, writer: asyncio.StreamWriter) -> bool:
    writer.write(chunked(b"data: 1\n\n", b"data: 2\n\n"))
    return True


async def whole(head: bytes, writer: asyncio.StreamWriter) -> bool:
    writer.write(
        b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    )
    return True


async def read_all(upstream: Upstream, body: bytes = b"{}") -> tuple[int, str, bytes]:
    async with upstream.request("POST", "/v1/x", body) as answer:
        data = b"".join([chunk async for chunk in answer.chunks()])
        return answer.status, answer.content_type, data


@pytest.mark.parametrize("reply", [stream, whole])
async def test_a_connection_is_kept_and_reused(reply: Reply) -> None:
    async with scripted(reply) as (server, url):
        upstream = Upstream(url + "/prefix", timeout_s=5)
        answers = [await read_all(upstream, b'{"n": %d}' % i) for i in range(5)]
        await upstream.close()
    expected = (
        (200, "text/event-stream", b"data: 1\n\ndata: 2\n\n")
        if reply is stream
        else (201, "application/json", b"{}")
    )
    assert answers == [expected] * 5
    assert server.connections == 1
    assert [r.split(b" ")[1] for r in server.requests] == [b"/prefix/v1/x"] * 5
    assert server.requests[3].endswith(b'{"n": 3}')
    assert b"content-length: 8" in server.requests[0].lower()


async def test_a_kept_connection_the_server_closed_is_replaced() -> None:
    """The server answers one request a connection and closes it when the next comes, without
    an answer: each later request, sent on the kept connection, goes again on a new one."""
    # (the writers themselves, kept: a writer's id, once it is freed, may be a new one's)
    answered: set[asyncio.StreamWriter] = set()

    async def once(head: bytes, writer: asyncio.StreamWriter) -> bool:
        if writer in answered:
            return False  # (closed with the request unanswered)
        answered.add(writer)
        return await stream(head, writer)

    async with scripted(once) as (server, url):
        upstream = Upstream(url, timeout_s=5)
        for _ in range(3):
            assert (await read_all(upstream))[2] == b"data: 1\n\ndata: 2\n\n"
        await upstream.close()
    assert server.connections == 3
    assert len(server.requests) == 5  # (two of them sent twice)


async def test_a_silent_upstream_times_out_and_the_task_goes_on() -> None:
    """The head and one event, then nothing: the read ends with UpstreamTimeout after the
    bound, and the task is not left cancelled."""

    async def stall(head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(chunked(b"data: 1\n\n")[: -len(b"0\r\n\r\n")])
        await asyncio.sleep(30)
        return False

    async with scripted(stall) as (_, url):
        upstream = Upstream(url, timeout_s=0.3)
        got: list[bytes] = []
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def read() -> None:
            async with upstream.request("POST", "/v1/x", b"{}") as answer:
                async for chunk in answer.chunks():
                    got.append(chunk)

        with pytest.raises(UpstreamTimeout, match=r"0\.3 s"):
            await read()
        assert 0.25 < loop.time() - started < 3
        assert got == [b"data: 1\n\n"]
        task = asyncio.current_task()
        assert task is not None
        assert task.cancelling() == 0
        await asyncio.sleep(0)  # (no cancellation pending)
        await upstream.close()


async def test_a_slow_reader_is_not_the_upstreams_silence() -> None:
    """The bound is on each read, not on the whole body: events 0.2 s apart under a bound of
    0.3 s take longer than it in all, and are read whole."""

    async def slow(head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(chunked()[: -len(b"0\r\n\r\n")])
        for i in range(4):
            await asyncio.sleep(0.2)
            writer.write(b"9\r\ndata: %d\n\n\r\n" % i)
        writer.write(b"0\r\n\r\n")
        return True

    async with scripted(slow) as (_, url):
        upstream = Upstream(url, timeout_s=0.3)
        assert (await read_all(upstream))[2] == b"".join(b"data: %d\n\n" % i for i in range(4))
        await upstream.close()


@pytest.mark.parametrize(
    "wire",
    [
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n",  # cut mid-chunk
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",  # not a size
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{}",  # shorter than it says
        b"NOT HTTP\r\n\r\n",
    ],
)
async def test_a_broken_answer_is_an_upstream_error(wire: bytes) -> None:
    async def broken(head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(wire)
        return False

    async with scripted(broken) as (_, url):
        upstream = Upstream(url, timeout_s=2)
        with pytest.raises(UpstreamError) as caught:
            await read_all(upstream)
        assert not isinstance(caught.value, UpstreamTimeout)
        await upstream.close()


async def test_a_reader_that_stops_closes_its_connection() -> None:
    """A job cancelled mid-stream: its connection is closed (the upstream sees it and stops),
    not kept with half an answer in it."""

    async def endless(head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(chunked()[: -len(b"0\r\n\r\n")])
        for _ in range(200):
            writer.write(b"9\r\ndata: x\n\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)
        return True

    async with scripted(endless) as (server, url):
        upstream = Upstream(url, timeout_s=2)
        async with upstream.request("POST", "/v1/x", b"{}") as answer:
            async for _ in answer.chunks():
                break
        await asyncio.wait_for(server.closed.wait(), 5)
        await upstream.close()


async def test_no_upstream_is_an_error_and_a_bad_url_is_refused() -> None:
    listener = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    listener.close()
    await listener.wait_closed()
    with pytest.raises(UpstreamError, match="cannot connect"):
        await read_all(Upstream(f"http://127.0.0.1:{port}", timeout_s=1))
    with pytest.raises(ValueError, match="not an http"):
        Upstream("ftp://example.com", timeout_s=1)


async def test_an_https_upstream_is_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An https:// upstream is checked against the system's certificates (here a throwaway CA
    given as SSL_CERT_FILE, as an operator would): trusted, it answers; not, it is an error."""
    ca = trustme.CA()
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(served)
    server = Scripted(stream)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0, ssl=served)
    url = f"https://localhost:{listener.sockets[0].getsockname()[1]}"
    try:
        with pytest.raises(UpstreamError, match="CERTIFICATE_VERIFY_FAILED"):
            await read_all(Upstream(url, timeout_s=2))
        bundle = tmp_path / "ca.pem"
        ca.cert_pem.write_to_path(str(bundle))
        monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
        upstream = Upstream(url, timeout_s=2)
        assert (await read_all(upstream))[2] == b"data: 1\n\ndata: 2\n\n"
        await upstream.close()
    finally:
        listener.close()
        for task in server.handlers:
            task.cancel()
        await asyncio.gather(*server.handlers, return_exceptions=True)
