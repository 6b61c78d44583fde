"""The sidecar's HTTP/1.1 client to its upstream: h11 on a protocol of its own, kept alive.

A sidecar relays one event per generated token, so what its client costs per read is paid
once a token: httpx's stack (httpcore's pool, anyio's streams, sniffio's look-ups) took most
of the governor's CPU per relayed event, and asyncio's streams a fifth of what was left
(``CHANGELOG.md``, 2026-11-27). This client is what the ``http`` runner needs and no more: one
request at a time per connection; h11 (the front door's parser) for the heads and for bodies
of a known length; a chunked body (every stream) decoded by :class:`~.framing.Chunks`, and a
stream's pieces handed on in the connection's own callback (:meth:`Answer.pump`); idle
connections kept for the next request; a bound on a connect and on each silence. The
upstream is ``http://`` or ``https://`` (verified against the system's certificates).

A connection goes back to the pool only when its exchange ended cleanly (h11 says both sides
are done); anything else (a cancelled job, an error, an answer read only in part) closes it.
A request on a kept connection that the upstream had closed meanwhile (no byte of an answer
came back) is sent once more on a new one, as browsers and httpx do.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
import typing
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit

import h11

from .framing import Chunks, UpstreamError, UpstreamTimeout

__all__ = ["Answer", "Upstream", "UpstreamError", "UpstreamTimeout"]

READ_BYTES = 64 * 1024  # the most one read takes from the socket
KEEP_IDLE = 64  # idle connections kept for the next requests
USER_AGENT = b"governor"
LINGER_NONE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: a close resets the connection


class _Connection(asyncio.Protocol):
    """One connection to the upstream: what it has received, waited for by one reader at a
    time (asyncio's streams do the same with more layers, and a relay reads once a token)."""

    def __init__(self) -> None:
        self.state = h11.Connection(h11.CLIENT)
        self.transport: asyncio.Transport | None = None
        self._received: list[bytes] = []
        self._size = 0
        self._ended = False  # the upstream closed its side, or the connection is lost
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None  # a read waiting for data
        self._drained: asyncio.Future[None] | None = None  # a write waiting for room
        # While set, what arrives goes here at once, in this callback (b"": the upstream
        # closed), not to a read (:meth:`Answer.pump`).
        self.pump: Callable[[bytes], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)  # (uvloop's is none by type)

    def data_received(self, data: bytes) -> None:
        if self.pump is not None:
            self.pump(data)
            return
        self._received.append(data)
        self._size += len(data)
        if self._size > READ_BYTES and self.transport is not None:
            self.transport.pause_reading()  # (until a read takes it)
        self._wake()

    def eof_received(self) -> bool:
        self._ended = True
        self._wake()
        if self.pump is not None:
            self.pump(b"")
        return False  # (close the transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended = True
        self._error = exc
        self._wake()
        if self.pump is not None:
            self.pump(b"")
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    def pause_writing(self) -> None:
        self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take(self) -> bytes:
        """What has come and not been read yet (b"": nothing)."""
        data = self._received[0] if len(self._received) == 1 else b"".join(self._received)
        self._received.clear()
        if self._size > READ_BYTES and self.transport is not None and not self._ended:
            self.transport.resume_reading()
        self._size = 0
        return data

    async def read(self) -> bytes:
        """What has come since the last read, waiting for something; b"" once the upstream
        has closed (OSError for a connection lost to an error)."""
        if not self._received:
            if self._ended:
                if self._error is not None:
                    raise self._error if isinstance(self._error, OSError) else OSError(self._error)
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
            return await self.read()
        return self.take()

    async def write(self, data: bytes) -> None:
        assert self.transport is not None
        if self._ended or self.transport.is_closing():
            raise ConnectionResetError("the upstream closed the connection")
        self.transport.write(data)
        if self._drained is not None:
            await self._drained

    @property
    def ended(self) -> bool:
        """The upstream has closed its side, or the connection is lost."""
        return self._ended

    @property
    def usable(self) -> bool:
        return not self._ended and self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def reset(self) -> None:
        """Close with a reset (no linger): the peer's next write fails."""
        if self.transport is None:
            return
        sock = self.transport.get_extra_info("socket")
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_NONE)
        self.transport.abort()


class Silence:
    """The bound on the upstream's silence while a body is read, kept lazily: a read notes
    when it began, and one timer, when it fires, cancels the reading task only if the read in
    progress has waited ``timeout_s``, else sets itself for when it could have. (An
    ``asyncio.timeout`` around each read cost more than the read: a stream reads once a token.)
    """

    __slots__ = ("_handle", "_loop", "_since", "_task", "fired", "timeout_s")

    def __init__(self, timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self.timeout_s = timeout_s
        self._since: float | None = None  # when the read in progress began (None: none is)
        self.fired = False
        self._handle = self._loop.call_later(timeout_s, self._check)

    def _check(self) -> None:
        since = self._since
        if since is not None and self._loop.time() - since >= self.timeout_s:
            self.fired = True
            self._task.cancel()
            return
        start = since if since is not None else self._loop.time()
        self._handle = self._loop.call_at(start + self.timeout_s, self._check)

    async def read(self, connection: _Connection) -> bytes:
        self._since = self._loop.time()
        try:
            return await connection.read()
        except asyncio.CancelledError:
            if self.fired and self._task.uncancel() == 0:
                raise UpstreamTimeout(
                    f"nothing from the upstream for {self.timeout_s:g} s"
                ) from None
            raise
        except OSError as exc:
            raise UpstreamError(f"the upstream's connection failed: {exc!r}") from None
        finally:
            self._since = None

    def close(self) -> None:
        self._handle.cancel()


class Answer:
    """The upstream's answer: its status and content type, then its body, read as it comes."""

    __slots__ = ("_chunks", "_connection", "_silence", "_timeout_s", "content_type", "status")

    def __init__(self, connection: _Connection, response: h11.Response, timeout_s: float) -> None:
        self._connection = connection
        self._timeout_s = timeout_s
        self._silence: Silence | None = None  # the bound on a chunked body's reads
        self.status = response.status_code
        self.content_type = ""
        chunked = False
        for name, value in response.headers:
            if name == b"content-type":
                self.content_type = value.decode("latin-1")
            elif name == b"transfer-encoding":
                chunked = value.lower() == b"chunked"
        # A chunked body is decoded here, from what h11 has not read of it yet.
        self._chunks: Chunks | None = None
        if chunked and response.status_code not in (204, 304):
            self._chunks = Chunks()
            self._chunks.rest = connection.state.trailing_data[0]

    @property
    def chunked(self) -> bool:
        return self._chunks is not None

    async def pump(self, sink: Callable[[bytes], None]) -> None:
        """A chunked body's data given to ``sink`` as it arrives, in the connection's own
        callback: no task wakes for each read, for a relay that does its work there. Returns
        once the body has ended; raises what ``sink`` raised, :class:`UpstreamError` for a
        broken body, :class:`UpstreamTimeout` for a silence of the client's timeout."""
        chunks, connection = self._chunks, self._connection
        assert chunks is not None
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = loop.create_future()
        heard = loop.time()

        def feed(data: bytes) -> None:
            nonlocal heard
            if ended.done():
                return
            heard = loop.time()
            try:
                for piece in chunks.feed(data):
                    sink(piece)
                if not chunks.done and not data and connection.ended:
                    raise UpstreamError("the upstream closed the connection within a chunked body")
            except Exception as exc:  # (the sink's, or the body's)
                connection.pump = None
                ended.set_exception(exc)
                return
            if chunks.done:
                connection.pump = None
                ended.set_result(None)

        timer: asyncio.TimerHandle | None = None

        def watch() -> None:
            nonlocal timer
            if ended.done():
                return
            if loop.time() - heard >= self._timeout_s:
                connection.pump = None
                ended.set_exception(
                    UpstreamTimeout(f"nothing from the upstream for {self._timeout_s:g} s")
                )
                return
            timer = loop.call_at(heard + self._timeout_s, watch)

        timer = loop.call_at(heard + self._timeout_s, watch)
        connection.pump = feed
        try:
            feed(connection.take())  # (what came with the head, and since)
            await ended
        finally:
            connection.pump = None
            if timer is not None:
                timer.cancel()

    def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes, as they arrive (each read's, not split further)."""
        return self._chunked(self._chunks) if self._chunks is not None else self._framed()

    async def _framed(self) -> AsyncIterator[bytes]:
        """A body h11 frames: of a known length, or up to the connection's close."""
        while True:
            event = _next(self._connection)
            if event is h11.NEED_DATA:
                await _receive(self._connection, self._timeout_s)
                continue
            if type(event) is not h11.Data:  # its end (EndOfMessage; or a close, for a body
                return  # that ends with the connection)
            yield bytes(event.data)

    async def _chunked(self, chunks: Chunks) -> AsyncIterator[bytes]:
        connection = self._connection
        if self._silence is None:
            self._silence = Silence(self._timeout_s)
        silence = self._silence
        data = b""  # (the head's read may have brought part of the body: chunks.rest)
        while True:
            for piece in chunks.feed(data):
                yield piece
            if chunks.done:
                return
            data = await silence.read(connection)
            if not data:
                raise UpstreamError("the upstream closed the connection within a chunked body")

    async def drain(self, timeout_s: float, limit: int) -> None:
        """Read what is left of the body, discarded, for ``timeout_s`` and ``limit`` bytes at
        most: a stream read to its last event ends at once, and its connection is kept; one
        that does not end is left (and its connection closed)."""
        size = 0
        with contextlib.suppress(UpstreamError, TimeoutError):
            async with asyncio.timeout(timeout_s):
                async for chunk in self.chunks():
                    size += len(chunk)
                    if size > limit:
                        return

    def close(self) -> None:
        if self._silence is not None:
            self._silence.close()

    def abort(self) -> None:
        """Reset the connection now, from outside the reading task: its read in progress, or
        its next, fails as for a body cut short. A reset, not a close: the upstream's next
        write to it fails at once (after a close, only its second), and it stops the work a
        step sooner."""
        self._connection.reset()

    def reusable(self) -> bool:
        """The whole exchange is over and the connection may carry another: made ready for
        it (a chunked body read here leaves h11 where the head ended: a new one takes over)."""
        connection = self._connection
        if not connection.usable:
            return False
        if self._chunks is not None:
            if not self._chunks.done or self._chunks.rest:
                return False
            connection.state = h11.Connection(h11.CLIENT)
            return True
        state = connection.state
        if state.our_state is h11.DONE and state.their_state is h11.DONE:
            state.start_next_cycle()
            return True
        return False


def _next(connection: _Connection) -> h11.Event | type[h11.NEED_DATA]:
    try:
        return connection.state.next_event()  # type: ignore[return-value]
    except h11.RemoteProtocolError as exc:
        raise UpstreamError(f"the upstream broke HTTP/1.1: {exc}") from None


async def _receive(connection: _Connection, timeout_s: float) -> bool:
    """Give h11 what the next read brings (b"" at the end of the stream); whether it brought
    anything."""
    try:
        async with asyncio.timeout(timeout_s):
            data = await connection.read()
    except TimeoutError:
        raise UpstreamTimeout(f"nothing from the upstream for {timeout_s:g} s") from None
    except OSError as exc:
        raise UpstreamError(f"the upstream's connection failed: {exc!r}") from None
    try:
        connection.state.receive_data(data)
    except h11.RemoteProtocolError as exc:
        raise UpstreamError(f"the upstream broke HTTP/1.1: {exc}") from None
    return bool(data)


class Upstream:
    """Requests to one upstream (``base_url``: scheme, host, port and an optional path prefix)."""

    def __init__(self, base_url: str, *, timeout_s: float, connect_timeout_s: float = 10.0) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http:// or https:// URL: {base_url!r}")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        self.prefix = url.path.rstrip("/")
        self.authority = url.netloc.rpartition("@")[2].encode("ascii")
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[_Connection] = []

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    @contextlib.asynccontextmanager
    async def request(
        self, method: str, path: str, body: bytes = b"", *, timeout_s: float | None = None
    ) -> AsyncIterator[Answer]:
        """Send a request (``body``: JSON) and give its answer once its head has come; its body
        is read from :meth:`Answer.chunks` within the block. The connection is kept for the
        next request if the whole exchange ended in the block, else closed."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        head = self._head(method, path, body)
        connection, answer = await self._send(head, body, timeout_s)
        try:
            yield answer
        except BaseException:
            connection.close()
            raise
        finally:
            answer.close()
        if len(self._idle) < KEEP_IDLE and answer.reusable():
            self._idle.append(connection)
        else:
            connection.close()

    def _head(self, method: str, path: str, body: bytes) -> h11.Request:
        headers = [(b"host", self.authority), (b"user-agent", USER_AGENT)]
        if body or method == "POST":
            headers += [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
            ]
        return h11.Request(method=method, target=self.prefix + path, headers=headers)

    async def _send(
        self, head: h11.Request, body: bytes, timeout_s: float
    ) -> tuple[_Connection, Answer]:
        """The request on a kept connection (once more on a new one if that one had been
        closed by the upstream before any answer), else on a new one."""
        while self._idle:
            connection = self._idle.pop()
            if not connection.usable:
                connection.close()
                continue
            try:
                return connection, await self._exchange(connection, head, body, timeout_s)
            except UpstreamError as exc:
                connection.close()
                if not isinstance(exc, _Unanswered):
                    raise
        connection = await self._connect()
        try:
            return connection, await self._exchange(connection, head, body, timeout_s)
        except BaseException:
            connection.close()
            raise

    async def _connect(self) -> _Connection:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await asyncio.get_running_loop().create_connection(
                    _Connection, self.host, self.port, ssl=self.ssl
                )
        except TimeoutError:
            raise UpstreamTimeout(
                f"no connection to {self.host}:{self.port} in {self.connect_timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {self.host}:{self.port}: {exc!r}") from None
        return connection

    async def _exchange(
        self, connection: _Connection, head: h11.Request, body: bytes, timeout_s: float
    ) -> Answer:
        """Write the request, read up to the answer's head."""
        state = connection.state
        data = state.send(head)
        if body:
            data += state.send(h11.Data(data=body))
        data += state.send(h11.EndOfMessage())
        try:
            async with asyncio.timeout(timeout_s):
                await connection.write(data)
        except TimeoutError:
            raise UpstreamTimeout(f"the upstream took no request for {timeout_s:g} s") from None
        except OSError as exc:
            raise _Unanswered(f"the upstream's connection failed: {exc!r}") from None
        answered = False  # (a byte of an answer came)
        while True:
            try:
                event = _next(connection)
                if event is h11.NEED_DATA:
                    answered = await _receive(connection, timeout_s) or answered
                    continue
            except UpstreamTimeout:
                raise
            except UpstreamError as exc:
                raise (exc if answered else _Unanswered(str(exc))) from None
            if type(event) is h11.Response:
                return Answer(connection, event, timeout_s)
            if type(event) is h11.ConnectionClosed:
                raise (UpstreamError if answered else _Unanswered)(
                    "the upstream closed the connection without an answer"
                )
            if type(event) is not h11.InformationalResponse:  # (100 Continue: skipped)
                raise UpstreamError(f"the upstream sent {type(event).__name__} for an answer")


class _Unanswered(UpstreamError):
    """The connection failed before any of an answer came: the request may be sent again."""
