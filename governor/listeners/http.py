"""The OpenAI-compatible front door (``http_listen``): ``/v1/completions``,
``/v1/chat/completions`` (whole, or streamed as server-sent events) and ``/v1/models``; with a
runner that forwards (the ``http`` runner, a sidecar) also ``/v1/embeddings`` as jobs, and the
upstream's ``/v1/models``, ``/tokenize`` and ``/detokenize`` answered by it with no slot taken,
every forwarded answer relayed as the upstream gave it.

It runs on the daemon's event loop, beside the TCP listener, and every job goes through the same
admission (the ledger, the lanes, the tenants, the ladder, the breakers, the fleet, the drain)
and the same :class:`~governor.execution.Execution`: only the wire differs. What the API maps
to what is :mod:`governor.listeners.openai_api` (pure); this module moves bytes. HTTP is parsed by
``h11`` (no IO in the parser; uvicorn's choice), one request at a time per connection, with
keep-alive and pipelining.

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
import hashlib
import math
import secrets
import socket
import ssl
import time
from collections.abc import Callable, Hashable
from http import HTTPStatus

import h11

from protocol.codes import ErrorCode, NeedCode

from .. import intake
from ..core.admission import (
    Admitted,
    Attempt,
    Budget,
    Rejected,
    Reservation,
    Yielded,
)
from ..core.ledger import Refusal
from ..core.sources import KEY_TURN_FAR
from ..execution import Ending, Execution, start
from ..intake import KeyStep, Waiting
from ..ops.health import Verdict
from ..runners import Embedder, Forwarding, Relay, Relayed, RunnerError, Token
from ..state import ServerState
from . import openai_api as api
from .base import Deadlines, bind, bound_address
from .outbound import BACKLOG, Outbound, connection_id
from .shell import MAX_HEAD_BYTES, ClosingError, Incoming, header
from .tls import HANDSHAKE_TIMEOUT_S

MAX_READ_AHEAD = 64 * 1024  # bytes of pipelined requests read while an answer is on its way
JSON = "application/json"
PATHS = {
    "/v1/completions": api.COMPLETION,
    "/v1/chat/completions": api.CHAT,
    "/v1/embeddings": api.EMBEDDING,  # (for a runner that embeds, or forwards)
}
MODELS = "/v1/models"
HEALTH = "/health"
# A forwarding runner's upstream answers these as they are, with no slot taken: its list of
# models, and llama-server's tokenizer (cheap, bounded as any request is).
PROXIED = {MODELS: ("GET", "HEAD"), "/tokenize": ("POST",), "/detokenize": ("POST",)}
PROXY = "proxy"  # (the kind of request that is one of these)
KNOWN_PATHS = {*PATHS, *PROXIED, HEALTH}  # (named in the responses' metric)
# Answers by hand that tell the client to come back (a yield on TCP), not that it failed.
YIELDS = frozenset({NeedCode.BUFFERS_FULL, NeedCode.DRAINING})
# A job's request waiting for its key's turn: its head, body, kind and key.
Deferred = tuple[h11.Request, bytes, str, str]


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
    ) -> None:
        self.state = state
        self.model = model
        self.tls = tls
        self.readiness = readiness
        runner = state.admission.primary.runner
        # A runner that forwards requests as they came (a sidecar's): see openai_api.
        self.forwarder = runner if isinstance(runner, Forwarding) else None
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
        self.deadlines = Deadlines(state.admission.clock)
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


class Payload(Incoming):
    """The front door's request as it arrives (:class:`~.shell.Incoming`, under the shell's
    bounds and ``max_payload_bytes``), its body's bytes counted against the payload buffers as
    a TCP payload's are (:func:`governor.intake.payload_bytes`): given back when the request
    is done with, or going with its job."""

    def __init__(self, state: ServerState) -> None:
        super().__init__(state.config.max_payload_bytes, KNOWN_PATHS)
        self.state = state
        self.conn_budget = Budget(self.max_body)
        self.reservation: Reservation | None = None

    def head(self, request: h11.Request) -> ClosingError | None:
        refused = super().head(request)
        if refused is None:
            self.reservation = intake.payload_bytes(self.state, self.conn_budget, 0)
        return refused

    def data(self, data: bytes) -> ClosingError | None:
        """More of its body: within its bound, and room for it in the server's buffers?"""
        refused = super().data(data)
        reservation = self.reservation
        if refused is not None or (reservation is not None and reservation.hold(len(self.body))):
            return refused
        self.release()
        no_room = intake.no_room_for_payload(self.state)
        error = api.refusal(no_room)
        return ClosingError(error.status, no_room.need_code, error.message, error.headers)

    def done(self) -> None:
        super().done()
        self.release()

    def release(self) -> None:
        if self.reservation is not None:
            self.reservation.release()
            self.reservation = None

    def take_reservation(self) -> Reservation | None:
        """The body's bytes go with the job (released when its ticket is)."""
        reservation, self.reservation = self.reservation, None
        return reservation


class HttpConnection(asyncio.Protocol):
    """One client connection: requests parsed by h11 under the bounds, one job at a time."""

    def __init__(self, door: FrontDoor) -> None:
        self.door = door
        self.state = door.state
        self.config = door.state.config
        self.id = connection_id()  # names the connection in logs (execution.Replies)
        # The intake's steps, in their order: the door keeps refused requests' places.
        self.credentials = intake.Credentials(self.state, self.id)
        self.conversation = intake.Conversation(self.state, self.credentials, door, self)
        self.out = Outbound(self.state, self.id)  # its writes, bounded, and its close
        self.transport: asyncio.Transport | None = None
        self.http = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.served = False
        self.closed = False
        self.close_after = False  # this answer is the connection's last
        self.jobs = 0
        self.incoming = Payload(self.state)  # the request being read
        self.exchange: Exchange | None = None  # the request being answered
        self.advancing = False  # in _advance (an answer given there must not re-enter it)
        self.arriving = False  # a request has begun: its deadline runs
        # Its deadline (the request's, or the idle connection's) on the door's one timer, with
        # its exchange's: answered with ``expiry`` (None: closed quietly) when it passes.
        self.due_at: int | None = None
        self.expires_at = math.inf
        self.expiry: HTTPStatus | None = None

    # asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        state, out = self.state, self.out
        self.credentials.connected(*out.made(transport))
        self.transport = out.transport
        refused = state.connections.opened(self, self, self.source, idle=self.is_idle)
        if refused is not None:  # (a connection limit: another may free within a second)
            self._raw(
                ClosingError(
                    HTTPStatus.SERVICE_UNAVAILABLE,
                    refused.need_code,
                    refused.detail,
                    api.retry_headers(1000),
                )
            )
            return
        self.served = True
        self._deadline(self.config.idle_timeout, None)

    @property
    def source(self) -> str:
        return self.credentials.source

    @property
    def is_idle(self) -> bool:
        """Between requests and, with tenants declared, no valid key shown."""
        return not self.arriving and (self.state.tenants.open or not self.credentials.authenticated)

    def displace(self, detail: str) -> None:
        """Make way for a new connection at a limit (only one between requests is asked to):
        a 503 that no request asked for yet, then the close."""
        self._raw(ClosingError(HTTPStatus.SERVICE_UNAVAILABLE, NeedCode.DISPLACED, detail))

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self.exchange is None and not self.arriving:  # the request's deadline, from its
            self.arriving = True  # first byte: set once
            self._deadline(self.config.upload_timeout, HTTPStatus.REQUEST_TIMEOUT)
            self.state.connections.sources.idle(self, False)
        self.http.receive_data(data)
        if self.exchange is None:
            self._advance()
        self._read_ahead()

    def _read_ahead(self) -> None:
        """While an answer is on its way, read pipelined requests ahead by MAX_READ_AHEAD bytes
        (and one read) at most: the bytes h11 holds unhandled, however many answers went since."""
        transport = self.transport
        if transport is None or self.closed:
            return
        if self.exchange is not None and len(self.http.trailing_data[0]) > MAX_READ_AHEAD:
            transport.pause_reading()
        elif not transport.is_reading():
            transport.resume_reading()

    def eof_received(self) -> bool:
        # The client leaving: its job is cancelled (a half-close is not told apart).
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.door.deadlines.remove(self)
        self.conversation.left()
        self.incoming.release()
        exchange = self.exchange
        if exchange is not None:
            exchange.left()
            if exchange.execution is not None:
                exchange.execution.client_gone()
        if self.served:
            self.served = False
            self.state.connections.closed(self, self)

    def pause_writing(self) -> None:
        if self.out.pause():
            self.schedule()

    def resume_writing(self) -> None:
        self.out.resume()
        if not self.closed:
            self.schedule()

    def woken(self) -> None:
        """The line offered the request in line a slot and the conversation decided it: it is
        answered on the next turn of the loop, not inside the release that freed the slot."""
        if not self.closed:
            asyncio.get_running_loop().call_soon(self._answer_decided)

    def _answer_decided(self) -> None:
        while (event := self.conversation.next_event()) is not None:
            ask, outcome = event
            exchange = self.exchange
            if not self.closed and exchange is not None and exchange.ask is ask:
                exchange.answer(outcome)
            else:  # (its client left meanwhile)
                intake.unclaimed(outcome)

    # For the server (state.Connection) -------------------------------------------------

    def abort_running(self, need_code: NeedCode, error_code: ErrorCode, detail: str) -> None:
        exchange = self.exchange
        if exchange is not None and exchange.execution is not None:
            exchange.execution.abort(need_code, error_code, detail)

    def close(self) -> None:
        self.closed = True
        if self.out.close():
            self.schedule()

    # Requests --------------------------------------------------------------------------

    def _advance(self) -> None:
        """Handle what h11 has parsed, up to the next request that needs an answer."""
        if self.advancing:  # (an answer given in the loop below: the loop goes on, not a new one)
            return
        self.advancing = True
        try:
            while not self.closed and self.exchange is None:
                ev = self.http.next_event()
                if ev is h11.NEED_DATA or ev is h11.PAUSED:
                    return
                if isinstance(ev, h11.Request):
                    self._on_head(ev)
                elif isinstance(ev, h11.Data):
                    refused = self.incoming.data(ev.data)
                    if refused is not None:
                        self._raw(refused)
                elif isinstance(ev, h11.EndOfMessage):
                    self._on_request()
                else:  # ConnectionClosed
                    self.close()
        except h11.RemoteProtocolError as exc:
            status = HTTPStatus(exc.error_status_hint)
            self._raw(ClosingError(status, NeedCode.SPEC_INVALID, f"bad request: {exc}"))
        finally:
            self.advancing = False

    def _on_head(self, request: h11.Request) -> None:
        refused = self.incoming.head(request)
        if refused is not None:
            self._raw(refused)
        elif self.http.client_is_waiting_for_100_continue:
            self.write(
                self.http.send(h11.InformationalResponse(status_code=100, headers=[])) or b""
            )

    def _on_request(self) -> None:
        """A whole request: answer it (a job's answer comes when the job ends)."""
        incoming = self.incoming
        request = incoming.request
        assert request is not None
        self._deadline(None, None)
        method = request.method.decode("ascii", "replace")
        self.exchange = Exchange(self, method == "HEAD")
        self.door.route(self.exchange, request, method, incoming.path, bytes(incoming.body))

    def exchange_ended(self) -> None:
        """The answer is out: the next request, or the end of the connection."""
        self.exchange = None
        self.arriving = False
        self.incoming.done()
        if self.closed:
            return
        http = self.http
        # (An answer that said ``connection: close``, or that h11 must close after, leaves h11
        # in MUST_CLOSE; one whose head went out before a drain began did not say so: a request
        # pipelined behind it is answered, its 503 closing the connection.)
        if http.our_state is h11.DONE and http.their_state is h11.DONE and not self.close_after:
            http.start_next_cycle()
            if http.trailing_data[0]:  # (a pipelined request has begun)
                self.arriving = True
                self._deadline(self.config.upload_timeout, HTTPStatus.REQUEST_TIMEOUT)
            else:
                self._deadline(self.config.idle_timeout, None)
                self.state.connections.sources.idle(self, self.is_idle)
            self._advance()
            self._read_ahead()
        else:
            self.close()

    def closing(self) -> bool:
        """Say ``connection: close`` in this answer, and close after it: the server is
        draining, or the client's keys failed (a client that asked to close is closed by h11's
        state)."""
        return self.close_after or self.state.ledger.draining

    # Deadlines and answers out of turn ---------------------------------------------------

    def _deadline(self, seconds: float | None, status: HTTPStatus | None) -> None:
        """The connection's deadline: the idle connection's (``status`` None: closed quietly)
        or the request's (answered ``status``, then closed); ``seconds`` None: none."""
        self.expires_at = math.inf if seconds is None else self.state.now() + seconds
        self.expiry = status
        self.schedule()

    def schedule(self) -> None:
        """Keep its next deadline, its exchange's and its write's included, on the door's one
        timer."""
        exchange = self.exchange
        deadline = min(self.expires_at, self.out.write_due)
        if exchange is not None:
            deadline = min(deadline, exchange.due_at)
        self.door.deadlines.put(self, deadline)

    def on_deadline(self) -> None:
        """What is due now: its answer unread for too long, its exchange's key turn or its next
        decision, or the deadline."""
        now = self.state.now()
        if self.out.overdue(now):
            self.closed = True
            return
        exchange = self.exchange
        if exchange is not None:
            exchange.on_deadline(now)
        if not self.closed and self.expires_at <= now:
            self.expires_at = math.inf
            self._expired(self.expiry)
        if not self.closed:
            self.schedule()

    def _expired(self, status: HTTPStatus | None) -> None:
        if status is None:
            self.close()
        else:
            timeout = self.config.upload_timeout
            detail = f"the request did not arrive within {timeout:g} s"
            self._raw(ClosingError(status, NeedCode.UPLOAD_TIMEOUT, detail))

    def _raw(self, refused: ClosingError) -> None:
        """An error answered by hand, then the connection closed: h11 cannot answer a request
        it has not parsed (a deadline, a head too large, a bad one)."""
        transport = self.transport
        self.closed = True
        if transport is None or transport.is_closing():
            return
        status, code = refused.status, refused.code
        self.state.metrics.http_responses[(self.incoming.path, str(status.value))] += 1
        if code not in YIELDS:  # (counted as TCP counts its abort frames)
            self.state.metrics.aborts[code] += 1
        transport.write(api.closing_error(status, code, refused.message, refused.headers))
        transport.close()

    def write(self, data: bytes) -> None:
        if not self.out.write(data):
            self.closed = True  # (cut off: its client left too much unread; its job cancelled)


class Exchange:
    """One request and its answer; for a job, the :class:`~governor.execution.Replies` its
    execution answers through."""

    def __init__(self, conn: HttpConnection, head_only: bool = False) -> None:
        self.conn = conn
        self.id = conn.id
        self.out = Answer(conn, head_only)  # what goes back, on the wire
        self.execution: Execution | None = None
        self.answers: api.Answers | None = None
        self.call: api.Call | None = None
        self.ask: intake.Ask | None = None  # a job's conversation with admission
        self.deferred: Deferred | None = None  # a job's request whose key waits for its turn
        self.proxied: asyncio.Task[Relayed] | None = None  # the upstream answers it
        self.streaming = False  # the 200 and the stream's head are out

    # Plain answers ---------------------------------------------------------------------

    def respond(
        self, status: HTTPStatus, body: bytes, headers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        """A whole answer, then the next request."""
        self.out.whole(status, body, headers)
        self.conn.exchange_ended()

    def fail(self, error: api.ApiError) -> None:
        self.respond(error.status, error.body(), error.headers)

    def _abort(
        self, status: HTTPStatus, need_code: str, message: str, *, ends: bool = True
    ) -> None:
        """The job refused for good (401, 400) or ended with a need code: counted in
        ``governor_aborts_total`` here alone (as the TCP side counts its abort frames), and
        answered; once its stream has begun, with an ``error`` event. ``ends``: the exchange
        ends with this answer (an admitted job's, with its task)."""
        self.conn.state.metrics.aborts[need_code] += 1
        if self.streaming:  # (the 200 is out: the stream ends with an error event)
            self.out.chunk(api.error_event(status, need_code, message))
            self.out.send(h11.EndOfMessage())
        else:
            bearer = status == HTTPStatus.UNAUTHORIZED
            headers = (("www-authenticate", "Bearer"),) if bearer else ()
            self.out.whole(status, api.error_body(status, need_code, message), headers)
        if ends:
            self.conn.exchange_ended()

    # A job -----------------------------------------------------------------------------

    def job(self, request: h11.Request, body: bytes, kind: str) -> None:
        """A job's request: its key checked (at its turn, if it must wait for one), then
        prepared and decided."""
        key = _bearer(header(request, b"authorization"))
        if key is not None:
            step = self.conn.conversation.asked(key)
            if step is KeyStep.FAR:  # the guessers' turns are many: refused for now, unchecked
                self._abort(HTTPStatus.UNAUTHORIZED, NeedCode.UNAUTHORIZED, KEY_TURN_FAR)
                return
            if step is KeyStep.LATER:
                self.deferred = (request, body, kind, key)
                self.conn.schedule()
                return
        self._job(request, body, kind, key)

    @property
    def due_at(self) -> float:
        """When :meth:`on_deadline` has something to do: its key's turn, or its next decision."""
        if self.deferred is not None:
            return self.conn.credentials.key_at
        return math.inf if self.ask is None else self.ask.decide_at

    def on_deadline(self, now: float) -> None:
        """Time passed: its key's turn came, or its next decision at its hint."""
        deferred = self.deferred
        if deferred is not None:
            if self.conn.conversation.turn_came(now):
                self.deferred = None
                self._job(*deferred)
        elif self.ask is not None and self.ask.decide_at <= now:
            self.decide()

    def _job(self, request: h11.Request, body: bytes, kind: str, key: str | None) -> None:
        conn = self.conn
        tenant = conn.conversation.tenant(key)
        if isinstance(tenant, intake.Unauthorized):
            if tenant.closes:  # (this 401 is the connection's last answer)
                conn.close_after = True
            self._abort(
                HTTPStatus.UNAUTHORIZED,
                NeedCode.UNAUTHORIZED,
                "a valid API key is needed: Authorization: Bearer KEY",
            )
            return
        if kind == PROXY:
            self.proxy(request, body)
            return
        try:
            call = api.parse_call(
                body,
                kind=kind,
                lane_header=header(request, b"x-governor-lane"),
                path=conn.incoming.path,
                forwards=conn.door.forwarder is not None,
            )
            asked_ms = api.max_wait_ms(header(request, api.MAX_WAIT_HEADER.encode()))
        except api.ApiError as exc:
            self.fail(exc)
            return
        conn.jobs += 1
        job_id = f"http-{conn.id}-{conn.jobs}"
        self.call = call
        ask = self.ask = conn.conversation.open(
            tenant, (tenant.name, hashlib.sha256(body).digest())
        )
        ask.prepare_fields(job_id, call.spec, body)
        self.answer(conn.conversation.submit(ask, asked_ms, may_wait=True))

    def proxy(self, request: h11.Request, body: bytes) -> None:
        """A request the forwarding runner's upstream answers as it is, with no slot taken:
        the answer is relayed as it came (502 or 504 if none came)."""
        forwarder = self.conn.door.forwarder
        assert forwarder is not None
        method = request.method.decode("ascii", "replace")
        self.proxied = asyncio.get_running_loop().create_task(
            forwarder.relay(method, self.conn.incoming.path, body if method == "POST" else b"")
        )
        self.proxied.add_done_callback(self._proxied)

    def _proxied(self, task: asyncio.Task[Relayed]) -> None:
        self.proxied = None
        if task.cancelled() or self.conn.closed:
            return
        error = task.exception()
        if isinstance(error, RunnerError):
            self._abort(api.abort_status(error.code), error.code, error.detail)
        elif error is not None:
            raise error
        else:
            self._relay(task.result())
            self.conn.exchange_ended()

    @property
    def at_door(self) -> bool:
        """Waiting in line for its turn."""
        return self.ask is not None and self.ask.in_line

    def decide(self) -> None:
        """Decided again at its hint, in line."""
        assert self.ask is not None
        self.answer(self.conn.conversation.decide(self.ask))

    def answer(self, outcome: intake.Outcome) -> None:
        """The ask's outcome on this wire: the job waits in line for its turn (unanswered,
        decided again at its hint or when a slot may have freed before), runs, is refused for
        good (400), or yields: 429 (503), its place kept for its retry already."""
        ask = self.ask
        assert ask is not None
        if isinstance(outcome, Waiting):
            self.conn.schedule()
            return
        self.out.waited_ms = None if ask.wait is None else ask.wait.waited_ms
        if isinstance(outcome, Admitted):
            self._run(ask, outcome)
        elif isinstance(outcome, Rejected):
            error = outcome.error
            code = error.need_code if error is not None else outcome.need_code
            self._abort(HTTPStatus.BAD_REQUEST, code, error.detail if error else outcome.detail)
        else:
            self.fail(api.refusal(outcome))

    def left(self) -> None:
        """The client left while its request waited in line (:meth:`governor.intake.Ask.give_up`)
        or for its key's turn (the conversation gave the turn back)."""
        if self.proxied is not None:
            self.proxied.cancel()
        if self.ask is not None:
            self.ask.give_up()
            intake.gave_up(self.conn.state, self.ask.attempt)

    def _run(self, ask: intake.Ask, decision: Admitted) -> None:
        conn, state, call = self.conn, self.conn.state, self.call
        assert call is not None
        job = ask.admitted(
            decision,
            job=decision.ticket.job.id,
            ttl_ms=0,  # (an OpenAI request carries no deadline of its own)
            reservation=conn.incoming.take_reservation(),
        )
        self.answers = api.Answers(
            call,
            f"{'chatcmpl' if call.chat else 'cmpl'}-{secrets.token_hex(12)}",
            int(time.time()),
            conn.door.model,
        )
        self.execution = start(state, job, self)

    # execution.Replies -------------------------------------------------------------------

    def send_delta(self, execution: Execution, piece: Token | Relay) -> None:
        """A piece of the stream: a forwarded request's upstream event as it came, else the
        token in OpenAI's shape."""
        answers = self.answers
        assert answers is not None
        self._stream()
        if answers.call.forward is not None:
            self.out.chunk(piece.raw)
        elif isinstance(piece, Token):
            self.out.chunk(answers.delta(piece))

    def _stream(self) -> None:
        """The stream's head (200, no length: chunked) and its first events (a chat's role, a
        completion's echo; a forwarded request's are the upstream's)."""
        answers = self.answers
        assert answers is not None
        if not self.streaming:
            self.streaming = True
            self.out.head(
                HTTPStatus.OK, (("cache-control", "no-cache"),), "text/event-stream", None
            )
            self.out.chunk(answers.first() if answers.call.forward is None else b"")

    def _relay(self, relayed: Relayed) -> None:
        """A forwarding runner's upstream answer, as it came: after the stream's events, the
        rest of the stream; else the whole answer, its status and content type."""
        if self.streaming:
            self.out.chunk(relayed.body)
            self.out.send(h11.EndOfMessage())
            return
        status = _status(relayed.status)
        self.out.whole(status, relayed.body, content_type=relayed.content_type)

    def send_terminal(self, execution: Execution, ending: Ending) -> None:
        answers = self.answers
        assert answers is not None
        need_code, result = ending.need_code, ending.result or {}
        if ending.relayed is not None:
            if need_code is not None:
                self.conn.state.metrics.aborts[need_code] += 1
            self._relay(ending.relayed)
            return
        if need_code is None:
            if answers.call.stream:
                self._stream()
                self.out.chunk(answers.last(result))
                self.out.send(h11.EndOfMessage())
            else:
                self.out.whole(HTTPStatus.OK, answers.whole(result))
            return
        message = ending.detail or need_code
        self._abort(api.abort_status(need_code), need_code, message, ends=False)

    def job_ended(self, execution: Execution) -> None:
        self.execution = None
        self.conn.exchange_ended()

    def fleet_refused(self, execution: Execution, refusal: Refusal) -> None:
        """The fleet refused the job admitted here: 429 now, its place kept for its retry as
        any refused job's; the exchange ends with the job's task."""
        assert self.ask is not None
        decision, _ = self.ask.take_back(execution.ticket, refusal, keep_payload=False)
        self.conn.conversation.refused(self.ask, decision)
        error = api.refusal(decision)
        self.out.whole(error.status, error.body(), error.headers)


class Answer:
    """How one exchange's answer goes out on its connection: a whole response, or a head and a
    stream's chunks, with the door's own fields (the slots, the wait); through h11, but for a
    stream's chunks, framed here."""

    def __init__(self, conn: HttpConnection, head_only: bool) -> None:
        self.conn = conn
        self.head_only = head_only  # a HEAD request: the head, no body
        self.waited_ms: int | None = None  # how long the request waited in line, once it left

    def whole(
        self,
        status: HTTPStatus,
        body: bytes,
        headers: tuple[tuple[str, str], ...] = (),
        content_type: str = JSON,
    ) -> None:
        self.head(status, headers, content_type, len(body))
        self.send(None if self.head_only else h11.Data(data=body))
        self.send(h11.EndOfMessage())

    def head(
        self,
        status: HTTPStatus,
        headers: tuple[tuple[str, str], ...],
        content_type: str,
        length: int | None,
    ) -> None:
        conn = self.conn
        fields = [
            ("content-type", content_type),
            ("x-governor-inflight", str(conn.state.inflight)),
            ("x-governor-cap", str(sum(p.ledger.cap for p in conn.state.pools))),
        ]
        if self.waited_ms is not None:
            fields.append(("x-governor-waited-ms", str(self.waited_ms)))
        fields += headers
        if length is not None:
            fields.append(("content-length", str(length)))
        if conn.closing():
            fields.append(("connection", "close"))
        conn.state.metrics.http_responses[(conn.incoming.path, str(status.value))] += 1
        self.send(
            h11.Response(status_code=int(status), headers=fields, reason=status.phrase.encode())
        )

    def send(self, ev: h11.Event | None) -> None:
        if ev is None or self.conn.closed:
            return
        data = self.conn.http.send(ev)
        if data:
            self.conn.write(data)

    def chunk(self, data: bytes) -> None:
        """A piece of a stream's body, framed here: h11's writer for a chunked body keeps no
        count and no state between chunks, and building its ``Data`` event and its frame costs
        more than the stream's own work (once a token). An HTTP/1.0 client's body, ended by
        the connection's close, goes through h11."""
        if not data or self.conn.closed:
            return
        if self.conn.http.their_http_version == b"1.1":
            self.conn.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            self.send(h11.Data(data=data))


def _bearer(authorization: str | None) -> str | None:
    scheme, _, credentials = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not credentials.strip():
        return None
    return credentials.strip()


def _status(code: int) -> HTTPStatus:
    """An upstream's status as h11 sends it (one this module does not know: 502)."""
    try:
        return HTTPStatus(code)
    except ValueError:
        return HTTPStatus.BAD_GATEWAY
