"""The OpenAI-compatible front door (``http_listen``): ``/v1/completions``,
``/v1/chat/completions`` (whole, or streamed as server-sent events) and ``/v1/models``; with a
runner that forwards (the ``http`` runner, a sidecar) also ``/v1/embeddings`` as jobs, and the
upstream's ``/v1/models``, ``/tokenize`` and ``/detokenize`` answered by it with no slot taken,
every forwarded answer relayed as the upstream gave it.

It runs on the daemon's event loop, beside the TCP listener, and every job goes through the same
admission (the ledger, the lanes, the tenants, the ladder, the breakers, the fleet, the drain)
and the same :class:`~governor.execution.Execution`: only the wire differs. What the API maps
to what is :mod:`governor.listeners.openai_api` (pure); a connection's requests, parsed by
``h11`` (no IO in the parser; uvicorn's choice) one at a time, with keep-alive and pipelining,
are :mod:`governor.listeners.http_session` (sans-IO); this module moves bytes, keeps the timer
and starts the tasks.

- ``Authorization: Bearer KEY`` is the tenant's key (or the TLS client certificate, as on the
  TCP side); a missing or unknown one is 401, and ``max_auth_failures`` of them close the
  connection. A key the connection shows for the first time is checked at once while its
  source's budget of failures lasts, else at its turn (the request waits meanwhile;
  :meth:`~governor.core.sources.Sources.key_turn`).
- A request that finds every slot taken waits for its turn, in its lane's order, in the line
  both doors share, when admission's hint says the turn comes within its wait budget
  (``max_wait``, or the ``x-governor-max-wait-ms`` it asks for): :class:`governor.intake.Wait`.
  It is decided again at its hint, and whenever a slot may have freed (a job ended, a waiter
  left, a drain began), in the line's order; ``x-governor-waited-ms`` says how long it waited.
- A yield it does not wait for is 429 (503 for ``draining``, ``breaker_open``,
  ``fleet_unavailable``) with ``retry-after-ms``, ``Retry-After`` (whole seconds, rounded up)
  and an OpenAI error body whose ``code`` is the need code; a busy yield's place in line is
  kept for its retry (:class:`~governor.listeners.openai_api.KeptPlaces`). A request the
  policy refuses for good is 400.
- ``GET /health`` is the admin listener's readiness on this port (200 ready, 503 not), where
  load balancers and tools look for it.
- A job that fails is 502 (504 when out of time, 503 at shutdown); once its stream has begun,
  an ``error`` event ends it instead.
- A client that closes its connection cancels its job at once (its runner stops before its next
  token), and gives up its place in the line at once.

Bounds, as on the TCP side: connections (``max_connections``, all listeners together, and
``max_connections_per_source``; at a limit, a connection between requests that has shown no key
is displaced, 503 ``displaced``); a request head of :data:`~.shell.MAX_HEAD_BYTES` and
:data:`~.shell.MAX_HEADERS` fields (431: the shell's bounds, the admin listener's too); a body
of ``max_payload_bytes`` (413, told by Content-Length before it is read, or counted as it
arrives), counted against the server's payload buffers while it waits or its job runs
(``buffers_full``, 429); requests waiting at the door (``max_waiting``, and
``max_waiting_per_tenant`` of a declared tenant, both doors together; 429 past them); a whole
request within ``upload_timeout`` of its first byte (408), however steadily it trickles; a
connection idle between requests for ``idle_timeout`` (closed); pipelined requests read ahead by
:data:`MAX_READ_AHEAD` bytes at most; and, on the way out, ``write_buffer_bytes`` or
``write_timeout`` of answers unread (cut off, the job cancelled).
"""

from __future__ import annotations

import asyncio
import functools
import math
import socket
import ssl
import time
from collections.abc import Callable, Hashable
from http import HTTPStatus

import h11

from protocol.codes import ErrorCode, NeedCode

from .. import intake
from ..core.admission import Attempt, Yielded
from ..execution import Replies, Running, start
from ..intake import JobAdmitted
from ..ops.health import Verdict
from ..runners import Embedder, Forwarding, Relayed
from ..state import ServerState
from . import openai_api as api
from .base import CallLater, Deadlines, bind, bound_address, loop_later
from .http_session import HEALTH, MODELS, PATHS, PROXIED, PROXY, Exchange, HttpSession
from .outbound import BACKLOG, Outbound, connection_id
from .shell import ClosingError
from .tls import HANDSHAKE_TIMEOUT_S


class FrontDoor:
    """The listener (:class:`~governor.listeners.base.Listener`, on ``http_listen``) and what
    its connections share: the model's name, the places kept."""

    early = False

    def __init__(
        self,
        state: ServerState,
        model: str,
        tls: ssl.SSLContext | None,
        readiness: Callable[[], Verdict],
        call_later: CallLater = loop_later,
    ) -> None:
        self.state = state
        self.model = model
        self.tls = tls
        self.readiness = readiness
        runner = state.admission.primary.runner
        # A runner that forwards requests as they came (a sidecar's): see openai_api.
        self.forwarder: Forwarding | None = runner if isinstance(runner, Forwarding) else None
        self.embeds = self.forwarder is not None or isinstance(runner, Embedder)
        self.created = int(time.time())
        config = state.config
        self.places = api.KeptPlaces(
            state.admission.clock,
            functools.partial(intake.gave_up, state),
            grace_s=config.upload_timeout,
            limit=config.max_connections * config.held_payloads_per_conn,
        )
        self._sock: socket.socket | None = None
        self._server: asyncio.Server | None = None
        # Every connection's deadlines on one timer, and the door's own: its places' next expiry.
        self.deadlines = Deadlines(state.admission.clock, call_later)
        self.due_at: int | None = None  # (its place in the deadlines)

    def bind(self) -> None:
        address = self.state.config.http_address
        assert address is not None
        self._sock = bind(*address, BACKLOG)

    async def serve(self) -> None:
        assert self._sock is not None
        tls = self.tls
        self._server = await asyncio.get_running_loop().create_server(
            lambda: HttpConnection(self),
            sock=self._sock,
            backlog=BACKLOG,
            ssl=tls,
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if tls is not None else None,
        )

    @property
    def address(self) -> tuple[str, int]:
        assert self._sock is not None
        return bound_address(self._sock)

    def describe(self) -> str:
        host, port = self.address
        scheme = "http" if self.tls is None else "https"
        return f"OpenAI-compatible front door on {scheme}://{host}:{port}/v1 (model {self.model!r})"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        elif self._sock is not None:
            self._sock.close()
        self.deadlines.close()

    def route(
        self, exchange: Exchange, request: h11.Request, method: str, path: str, body: bytes
    ) -> None:
        """A whole request to what answers it: a job, the upstream (a sidecar's), the door's
        own list of models or readiness, or a 404 or 405."""
        kind = PATHS.get(path)
        forwards = self.forwarder is not None
        if forwards and path in PROXIED:
            if method not in PROXIED[path]:
                exchange.fail(api.not_allowed(", ".join(PROXIED[path])))
            elif path == MODELS:  # (no key needed, as for the door's own list)
                exchange.proxy(request, b"")
            else:
                exchange.job(request, body, PROXY)
        elif path in (HEALTH, MODELS) and method not in ("GET", "HEAD"):
            exchange.fail(api.not_allowed("GET, HEAD"))
        elif path == HEALTH:
            verdict = self.readiness()
            status = HTTPStatus.OK if verdict.ok else HTTPStatus.SERVICE_UNAVAILABLE
            exchange.respond(status, verdict.body())
        elif path == MODELS:
            exchange.respond(HTTPStatus.OK, api.models(self.model, self.created))
        elif kind is None or (kind == api.EMBEDDING and not self.embeds):
            exchange.fail(api.not_found(path, forwards))
        elif method != "POST":
            exchange.fail(api.not_allowed("POST"))
        else:
            exchange.job(request, body, kind)

    # intake.Keeper: a refused request's place in line, kept by its tenant and body ------------

    def take(self, key: Hashable) -> Attempt | None:
        assert isinstance(key, tuple)
        return self.places.take(key)

    def keep(self, key: Hashable, attempt: Attempt, refused: Yielded) -> bool:
        """Keep its place (the next one to expire is forgotten when its time is up)."""
        assert isinstance(key, tuple)
        kept = self.places.keep(key, attempt, refused.retry_hint_ms)
        self.kept()
        return kept

    def kept(self) -> None:
        at = self.places.next_expiry()
        self.deadlines.put(self, math.inf if at is None else at)

    def on_deadline(self) -> None:
        self.places.expire(self.state.now())
        self.kept()


class HttpConnection(asyncio.Protocol):
    """One client connection on the loop: its transport and the door's timer, for its
    :class:`~governor.listeners.http_session.HttpSession` (the link it answers through)."""

    def __init__(self, door: FrontDoor) -> None:
        self.door = door
        self.state = door.state
        conn_id = connection_id()
        self.session = HttpSession(door.state, door, self, conn_id)
        self.out = Outbound(door.state, conn_id)  # its writes, bounded, and its close
        self.transport: asyncio.Transport | None = None
        self.served = False  # counted in the connections and against its source
        self.due_at: int | None = None  # (its place in the door's deadlines)
        self.deadline = math.inf  # the session's next, on the server's clock

    # asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        state, session = self.state, self.session
        session.credentials.connected(*self.out.made(transport))
        self.transport = self.out.transport
        refused = state.connections.opened(self, session, session.source, idle=session.is_idle)
        if refused is not None:  # (a connection limit: another may free within a second)
            session.refuse(
                ClosingError(
                    HTTPStatus.SERVICE_UNAVAILABLE,
                    refused.need_code,
                    refused.detail,
                    api.retry_headers(1000),
                )
            )
            return
        self.served = True
        session.opened()

    def data_received(self, data: bytes) -> None:
        self.session.receive_data(data)

    def eof_received(self) -> bool:
        # The client leaving: its job is cancelled (a half-close is not told apart).
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.door.deadlines.remove(self)
        self.session.connection_lost()
        if self.served:
            self.served = False
            self.state.connections.closed(self, self.session)

    def pause_writing(self) -> None:
        if self.out.pause():
            self._put()

    def resume_writing(self) -> None:
        self.out.resume()
        if not self.session.closed:
            self._put()

    # For the server (state.Connection) -------------------------------------------------

    def abort_running(self, need_code: NeedCode, error_code: ErrorCode, detail: str) -> None:
        self.session.abort_running(need_code, error_code, detail)

    def close(self) -> None:
        """Close after the answers written so far (the server's, or the session's)."""
        self.session.closed = True
        if self.out.close():
            self._put()

    # For the session (http_session.Link) ---------------------------------------------------

    def write(self, data: bytes) -> None:
        if not self.out.write(data):
            self.session.closed = True  # (cut off: its client left too much unread; its job
            # cancelled)

    def last(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)
            transport.close()

    def reading(self, wanted: bool) -> None:
        transport = self.transport
        if transport is not None and transport.is_reading() != wanted:
            if wanted:
                transport.resume_reading()
            else:
                transport.pause_reading()

    def due(self, deadline: float) -> None:
        self.deadline = deadline
        self._put()

    def wake(self) -> None:
        asyncio.get_running_loop().call_soon(self._woken)

    def _woken(self) -> None:
        if not self.session.closed:
            self.session.answer_decided()

    def start(self, job: JobAdmitted, replies: Replies) -> Running:
        return start(self.state, job, replies)

    def relay(
        self, method: str, path: str, body: bytes, done: Callable[[Relayed | BaseException], None]
    ) -> asyncio.Task[Relayed]:
        forwarder = self.door.forwarder
        assert forwarder is not None
        task = asyncio.get_running_loop().create_task(forwarder.relay(method, path, body))

        def relayed(task: asyncio.Task[Relayed]) -> None:
            if not task.cancelled():
                done(task.exception() or task.result())

        task.add_done_callback(relayed)
        return task

    # Deadlines -----------------------------------------------------------------------------

    def _put(self) -> None:
        """Keep its next deadline, the session's or its write's, on the door's one timer."""
        self.door.deadlines.put(self, min(self.deadline, self.out.write_due))

    def on_deadline(self) -> None:
        session = self.session
        now = self.state.now()
        if self.out.overdue(now):
            session.closed = True
            return
        session.expire(now)
        if not session.closed:
            session.schedule()
