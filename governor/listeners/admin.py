"""The operator's HTTP listener (``metrics_listen``): an event loop of its own, in one thread.

    GET  /metrics        Prometheus text, collected on the event loop (503 if it does not answer)
    GET  /healthz/live   200 or 503, JSON: computed here, off the loop (:mod:`governor.ops.health`)
    GET  /healthz/ready  200 or 503, JSON: computed on the loop; a loop that does not answer
                         within a second is not ready
    POST /drain[?wait=S] from a loopback address only (and with ``Authorization: Bearer TOKEN``
                         when ``drain_token_file`` is set): start the graceful drain, then wait
                         up to S seconds (finite, 0 or more) for running jobs; 200 with
                         ``{"drained": ...}``. The process stays up, drained, until a SIGTERM
                         or SIGINT stops it

Why a thread: a liveness probe served on the daemon's event loop cannot tell a blocked loop
from a slow network; it just gets no answer. Served here, it answers 503 and says how long the
loop has been stalled. Everything that reads the server's state beyond the heartbeat is handed
to the daemon's loop with ``run_coroutine_threadsafe``, so the state has one writer and one
reader.

Why one thread with an event loop, not a thread per connection: whatever a peer does costs a
bounded amount. Requests are parsed by ``h11`` (no IO in the parser), and:

- at most :data:`MAX_CONNECTIONS` connections are open; a new one past that displaces the
  oldest one not waiting for its answer (a trickling client, say), or is closed at once if
  every open one is. A probe sends its request as soon as it connects, so a crowd of slow
  clients cannot keep it out;
- a request (head and body) must arrive within :data:`REQUEST_DEADLINE_S` of the connection,
  however steadily its bytes trickle in (408, then the connection closes); its head is bounded
  as the front door's (:class:`~.shell.Incoming`: 431), its body by :data:`MAX_BODY_BYTES`
  (413); an answer the peer does not read gets as long again;
- ``admin_threads`` calls wait on the daemon's loop at once (a readiness check, a drain, a
  ``/metrics`` collection); more wait for a turn within their own timeout. Liveness never
  waits for one;
- ``/metrics`` is collected at most :data:`METRICS_BURST` times at once and
  :data:`METRICS_PER_S` times a second after that (a token bucket); concurrent requests share
  one collection, and a request past the budget gets the last body, at most ``1 /
  METRICS_PER_S`` seconds old. A scraper polling every few seconds always gets a fresh one;
  a flood costs the daemon's loop two collections a second.

One request per connection (``Connection: close``): the clients are probes and scrapers.
POST /drain is what a Kubernetes preStop hook calls (``governor drain``): only from loopback,
because the listener is usually bound to every interface for the kubelet and Prometheus, and
with a token when other containers of the pod share that loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import math
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Coroutine
from http import HTTPStatus
from pathlib import Path
from typing import Any, TypeVar

import h11
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..config import ConfigError
from ..ops.exporter import registry_for
from ..ops.health import Health
from ..state import ServerState
from .base import bind, bound_address
from .shell import MAX_HEAD_BYTES, ClosingError, Incoming

log = logging.getLogger("governor.listeners.admin")

T = TypeVar("T")
METRICS_TIMEOUT_S = 5.0
READY_TIMEOUT_S = 1.0
MAX_DRAIN_WAIT_S = 600.0
CLOSE_TIMEOUT_S = 5.0
REQUEST_DEADLINE_S = 5.0  # for the whole request, head and body: trickling bytes do not extend it
MAX_BODY_BYTES = 1024  # no endpoint reads a body
MAX_CONNECTIONS = 64
BACKLOG = 1024  # connections the kernel holds until this loop accepts them (capped by somaxconn)
METRICS_BURST = 2
METRICS_PER_S = 2.0
JSON = "application/json"


class LoopStalled(Exception):
    """The daemon's event loop did not run the call in time."""


# POST /drain: begin the drain, then wait up to that many seconds; returns the jobs still running.
Drain = Callable[[float], Coroutine[Any, Any, int]]
# What a request is answered: status, content type, body, extra headers.
Answer = tuple[HTTPStatus, str, bytes, tuple[tuple[str, str], ...]]


class AdminListener:
    """The operator's listener (:class:`~governor.listeners.base.Listener`, on
    ``metrics_listen``): it serves from a thread of its own, from before the runner is ready."""

    early = True

    def __init__(
        self,
        state: ServerState,
        health: Health,
        drain: Drain,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.health = health
        self.drain = drain
        self.loop = loop  # the daemon's
        self.config = state.config
        self.registry = registry_for(state, health)
        self._token = _read_token(state.config.drain_token_file)
        self._slots = asyncio.Semaphore(state.config.admin_threads)
        self._metrics = _MetricsBudget(time.monotonic)
        self._metrics_body: bytes | None = None
        self._collecting: asyncio.Task[bytes] | None = None
        self._open: dict[_AdminConnection, None] = {}  # oldest first
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sock: socket.socket | None = None
        self._address: tuple[str, int] | None = None
        self._thread: threading.Thread | None = None
        self._thread_loop: asyncio.AbstractEventLoop | None = None
        self._stopping = asyncio.Event()  # set on the listener's loop
        self._stopped: asyncio.Future[None] | None = None  # on the daemon's loop

    def bind(self) -> None:
        address = self.config.metrics_address
        assert address is not None
        self._sock = bind(*address, BACKLOG)
        self._address = bound_address(self._sock)

    async def serve(self) -> None:
        """Serve from a thread of the listener's own."""
        self._thread_loop = asyncio.new_event_loop()
        self._stopped = self.loop.create_future()
        self._thread = threading.Thread(target=self._run, name="governor-admin", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        assert self._address is not None
        return self._address

    def describe(self) -> str:
        host, port = self.address
        return f"metrics and health probes on http://{host}:{port}"

    async def close(self) -> None:
        if self._thread_loop is None or self._stopped is None:
            if self._sock is not None:  # bound, never served
                self._sock.close()
            return
        if not self._stopped.done():
            with contextlib.suppress(RuntimeError):  # its loop has already closed
                self._thread_loop.call_soon_threadsafe(self._stopping.set)
        try:  # a listener that does not stop must not hold up the daemon's shutdown
            await asyncio.wait_for(asyncio.shield(self._stopped), CLOSE_TIMEOUT_S)
        except TimeoutError:
            log.warning("the HTTP listener did not stop within %g s", CLOSE_TIMEOUT_S)

    # The listener's thread -----------------------------------------------------------------

    def _run(self) -> None:
        loop = self._thread_loop
        assert loop is not None
        try:
            loop.run_until_complete(self._serve())
        except Exception:
            log.exception("the HTTP listener failed")
        finally:
            loop.close()
            if self._sock is not None:
                self._sock.close()
            stopped = self._stopped
            if stopped is not None:
                with contextlib.suppress(RuntimeError):  # the daemon's loop has closed
                    self.loop.call_soon_threadsafe(_settle, stopped)

    async def _serve(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: _AdminConnection(self), sock=self._sock, backlog=BACKLOG
        )
        try:
            await self._stopping.wait()
        finally:
            server.close()
            for conn in list(self._open):
                conn.abort()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def admit(self, conn: _AdminConnection) -> bool:
        """Make room for a new connection: displace the oldest one still sending its request."""
        if len(self._open) >= MAX_CONNECTIONS:
            victim = next((c for c in self._open if not c.answering), None)
            if victim is None:
                return False  # every open connection waits for its answer
            victim.abort()
        self._open[conn] = None
        return True

    def forget(self, conn: _AdminConnection) -> None:
        self._open.pop(conn, None)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(_retire)
        task.add_done_callback(self._tasks.discard)
        return task

    # Endpoints -----------------------------------------------------------------------------

    async def answer(
        self, method: str, target: str, headers: dict[bytes, bytes], peer: str
    ) -> Answer:
        url = urllib.parse.urlsplit(target)
        if method == "POST":
            if url.path != "/drain":
                return _json(HTTPStatus.NOT_FOUND, {"error": "not found", "try": ["/drain"]})
            return await self._drain(url.query, headers.get(b"authorization"), peer)
        if method not in ("GET", "HEAD"):
            allow = ("Allow", "GET, HEAD, POST")
            return _json(HTTPStatus.METHOD_NOT_ALLOWED, {"error": "method not allowed"}, allow)
        if url.path == "/metrics":
            try:
                body = await self._collect()
            except LoopStalled:
                return _json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": "the event loop is stalled"})
            return HTTPStatus.OK, CONTENT_TYPE_LATEST, body, ()
        if url.path == "/healthz/live":
            verdict = self.health.liveness()
            return _verdict(verdict.ok, verdict.body())
        if url.path == "/healthz/ready":
            try:
                verdict = await self._on_loop(lambda: _call(self.health.readiness), READY_TIMEOUT_S)
            except LoopStalled:
                detail = f"the event loop did not answer within {READY_TIMEOUT_S:g} s"
                check = {"event_loop": {"ok": False, "detail": detail}}
                return _json(HTTPStatus.SERVICE_UNAVAILABLE, {"status": "fail", "checks": check})
            return _verdict(verdict.ok, verdict.body())
        return _json(
            HTTPStatus.NOT_FOUND,
            {"error": "not found", "try": ["/metrics", "/healthz/live", "/healthz/ready"]},
        )

    async def _drain(self, query: str, authorization: bytes | None, peer: str) -> Answer:
        if not _is_loopback(peer):
            return _json(HTTPStatus.FORBIDDEN, {"error": "POST /drain is taken from loopback only"})
        if self._token is not None and not _bearer_matches(authorization, self._token):
            return _json(
                HTTPStatus.UNAUTHORIZED,
                {"error": "POST /drain needs Authorization: Bearer <the drain_token_file's token>"},
                ("WWW-Authenticate", "Bearer"),
            )
        try:
            wait = float(urllib.parse.parse_qs(query).get("wait", ["0"])[0])
        except ValueError:
            wait = math.nan
        if not (math.isfinite(wait) and wait >= 0):
            return _json(
                HTTPStatus.BAD_REQUEST,
                {"error": "wait must be a finite number of seconds, 0 or more"},
            )
        wait = min(wait, MAX_DRAIN_WAIT_S)
        try:
            inflight = await self._on_loop(lambda: self.drain(wait), wait + READY_TIMEOUT_S)
        except LoopStalled:
            return _json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": "the event loop is stalled"})
        body = {"draining": True, "drained": inflight == 0, "inflight": inflight}
        return _json(HTTPStatus.OK, body)

    async def _collect(self) -> bytes:
        """A /metrics body: a shared collection, a new one if the budget allows, else the last."""
        if self._collecting is None:
            if self._metrics_body is not None and not self._metrics.take():
                return self._metrics_body
            self._collecting = self.spawn(self._collect_once())
        return await asyncio.shield(self._collecting)

    async def _collect_once(self) -> bytes:
        try:
            body = await self._on_loop(
                lambda: _call(lambda: generate_latest(self.registry)), METRICS_TIMEOUT_S
            )
        except BaseException:
            self._metrics_body = None  # no stale body while the loop does not answer
            raise
        else:
            self._metrics_body = body
            return body
        finally:
            self._collecting = None

    async def _on_loop(self, make: Callable[[], Coroutine[Any, Any, T]], timeout: float) -> T:
        """Run the coroutine ``make()`` on the daemon's loop, taking one of the admin_threads
        turns; :class:`LoopStalled` if it has not answered within ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout), self._slots:
                coro = make()
                try:
                    future = asyncio.run_coroutine_threadsafe(coro, self.loop)
                except RuntimeError:  # the loop is closed
                    coro.close()
                    raise LoopStalled from None
                # Cancelling the wrapper (the timeout, a closed connection) cancels the call.
                return await asyncio.wrap_future(future)
        except TimeoutError:
            raise LoopStalled from None


class _AdminConnection(asyncio.Protocol):
    """One connection: its request parsed by h11 under the deadline, then one answer."""

    def __init__(self, listener: AdminListener) -> None:
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.reading = True  # the request has not all arrived yet
        self.answering = False  # its answer is being made (not to be displaced)
        self.http = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.incoming = Incoming(MAX_BODY_BYTES)  # the request, under the shell's bounds
        self.received = 0  # bytes of the request
        self.deadline: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if peer else ""
        if not self.listener.admit(self):
            transport.abort()
            return
        loop = asyncio.get_running_loop()
        self.deadline = loop.call_later(REQUEST_DEADLINE_S, self._deadline_passed)

    def data_received(self, data: bytes) -> None:
        if not self.reading:
            return
        # h11 bounds a head that has not all arrived; one that arrives whole in a read, and
        # the body, are bounded here.
        self.received += len(data)
        if self.received > MAX_HEAD_BYTES + MAX_BODY_BYTES:
            self.refuse(self.incoming.too_large())
            return
        self.http.receive_data(data)
        self._advance()

    def refuse(self, error: ClosingError) -> None:
        self.reply(_json(error.status, {"error": error.message}, *error.headers))

    def eof_received(self) -> bool | None:
        if self.reading:
            self.abort()  # a half-sent request: nothing to answer
            return None
        return True  # half-closed after its request: the answer still goes out

    def connection_lost(self, exc: Exception | None) -> None:
        self.listener.forget(self)
        if self.deadline is not None:
            self.deadline.cancel()
        if self.task is not None:
            self.task.cancel()

    def abort(self) -> None:
        self.reading = False
        self.listener.forget(self)
        if self.transport is not None:
            self.transport.abort()

    def _advance(self) -> None:
        try:
            while self.reading:
                event = self.http.next_event()
                if event is h11.NEED_DATA:
                    return
                refused = None
                if isinstance(event, h11.Request):
                    refused = self.incoming.head(event)
                elif isinstance(event, h11.Data):
                    refused = self.incoming.data(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    self._serve()
                else:  # ConnectionClosed (a pipelined request after ours is never read)
                    self.abort()
                if refused is not None:
                    self.refuse(refused)
        except h11.RemoteProtocolError as exc:
            status = HTTPStatus(exc.error_status_hint)
            self.reply(_json(status, {"error": f"bad request: {exc}"}))

    def _serve(self) -> None:
        request = self.incoming.request
        assert self.transport is not None
        assert request is not None
        self.reading = False
        self.answering = True
        if self.deadline is not None:
            self.deadline.cancel()
        self.transport.pause_reading()
        self.task = self.listener.spawn(self._answer(request))

    async def _answer(self, request: h11.Request) -> None:
        method = request.method.decode("ascii", "replace")
        target = request.target.decode("ascii", "replace")
        headers = dict(request.headers)  # names lower-cased by h11; a repeated one: the last
        try:
            answer = await self.listener.answer(method, target, headers, self.peer)
        except Exception:
            log.exception("%s %s failed", method, target)
            answer = _json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error"})
        self.reply(answer, head=method == "HEAD")
        log.debug("%s %s %s %d", self.peer, method, target, answer[0])

    def _deadline_passed(self) -> None:
        self.reply(
            _json(
                HTTPStatus.REQUEST_TIMEOUT,
                {"error": f"the request took over {REQUEST_DEADLINE_S:g} s"},
            )
        )

    def reply(self, answer: Answer, *, head: bool = False) -> None:
        """Send ``answer`` and close: written by hand, since h11 cannot send before it has
        parsed a request head (a deadline, a head too long)."""
        self.reading = self.answering = False
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        status, content_type, body, extra = answer
        lines = [
            f"HTTP/1.1 {status.value} {status.phrase}",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}",
            "Connection: close",
            *(f"{name}: {value}" for name, value in extra),
        ]
        transport.write("\r\n".join(lines).encode("latin-1") + b"\r\n\r\n")
        if not head:
            transport.write(body)
        transport.close()
        if transport.get_write_buffer_size():  # a peer that does not read gets as long again
            if self.deadline is not None:
                self.deadline.cancel()
            self.deadline = asyncio.get_running_loop().call_later(REQUEST_DEADLINE_S, self.abort)


class _MetricsBudget:
    """A token bucket: :data:`METRICS_BURST` collections at once, :data:`METRICS_PER_S` a
    second after that."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.tokens = float(METRICS_BURST)
        self.at = clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(float(METRICS_BURST), self.tokens + (now - self.at) * METRICS_PER_S)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


async def _call(fn: Callable[[], T]) -> T:
    return fn()


def _retire(task: asyncio.Task[Any]) -> None:
    """Mark an exception seen: its waiters (a shared /metrics collection's) may have gone."""
    if not task.cancelled():
        task.exception()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _json(status: HTTPStatus, body: dict[str, Any], *extra: tuple[str, str]) -> Answer:
    return status, JSON, orjson.dumps(body), extra


def _verdict(ok: bool, body: bytes) -> Answer:
    return (HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE), JSON, body, ()


def _read_token(path: str | None) -> bytes | None:
    """The drain token, read once at start: a file that is missing or empty is a config error
    (a preStop hook that cannot drain would be found out only at the next rollout)."""
    if path is None:
        return None
    try:
        token = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"drain_token_file {path!r}: {exc.strerror or exc}") from None
    if not token:
        raise ConfigError(f"drain_token_file {path!r} is empty")
    return token


def _bearer_matches(authorization: bytes | None, token: bytes) -> bool:
    scheme, _, credentials = (authorization or b"").strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(credentials.strip(), token)


def _is_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback
