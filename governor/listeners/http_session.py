"""The front door's connection with no IO, as h11 is: bytes in (:meth:`HttpSession.receive_data`),
answers out through its :class:`Link`, on the server's clock; no event loop, no socket, no task.

A connection's requests are parsed by ``h11`` under the shell's bounds, one at a time, with
keep-alive and pipelining; each whole request is routed by its door (:class:`Door`) to an
:class:`Exchange`, which answers it: a job's request goes through the connection's
:class:`~governor.intake.Conversation` (its key's turn, its tenant, the place kept for its retry,
the decision, the wait in line) and its job runs where the link starts it. What moves bytes,
keeps the timers and starts tasks is the link: :class:`governor.listeners.http.HttpConnection`
on the daemon's loop, or a test's.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Protocol

import h11

from protocol.codes import ErrorCode, NeedCode

from .. import intake
from ..core.admission import Admitted, Budget, Rejected, Reservation
from ..core.ledger import Refusal
from ..core.sources import KEY_TURN_FAR
from ..execution import Ending, Execution, Replies, Running
from ..intake import JobAdmitted, KeyStep, Waiting
from ..runners import Forwarding, Relay, Relayed, RunnerError, Token
from ..state import ServerState
from . import openai_api as api
from .shell import MAX_HEAD_BYTES, ClosingError, Incoming, header

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


class Cancel(Protocol):
    def cancel(self) -> bool: ...


class Link(Protocol):
    """What a session asks of its connection (the door's protocol, or a test's)."""

    def write(self, data: bytes) -> None:
        """Send ``data`` (a client cut off for leaving too much unread: the session is closed)."""
        ...

    def last(self, data: bytes) -> None:
        """Send ``data`` as the connection's last bytes, and close it now."""
        ...

    def close(self) -> None:
        """Close after what was written."""
        ...

    def reading(self, wanted: bool) -> None:
        """Read the client's bytes, or stop for now."""
        ...

    def due(self, deadline: float) -> None:
        """The session's next deadline (on the server's clock): :meth:`HttpSession.expire` then."""
        ...

    def wake(self) -> None:
        """Outcomes were decided between reads: :meth:`HttpSession.answer_decided` soon, not
        now (inside the release that freed the slot)."""
        ...

    def start(self, job: JobAdmitted, replies: Replies) -> Running:
        """Run an admitted job (:func:`governor.execution.start`)."""
        ...

    def relay(
        self, method: str, path: str, body: bytes, done: Callable[[Relayed | BaseException], None]
    ) -> Cancel:
        """Ask the forwarding runner's upstream, ``done`` called with its answer (not if
        cancelled)."""
        ...


class _Gone:
    """The link of a session whose client has gone: what its running job would still say goes
    nowhere (as it would on the closed transport)."""

    def write(self, data: bytes) -> None:
        pass

    def last(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass

    def reading(self, wanted: bool) -> None:
        pass

    def due(self, deadline: float) -> None:
        pass

    def wake(self) -> None:
        pass

    def start(self, job: JobAdmitted, replies: Replies) -> Running:
        raise AssertionError("the connection has gone: no job starts for it")

    def relay(
        self, method: str, path: str, body: bytes, done: Callable[[Relayed | BaseException], None]
    ) -> Cancel:
        raise AssertionError("the connection has gone: nothing is relayed for it")


GONE = _Gone()


class Door(intake.Keeper, Protocol):
    """What a session asks of its door: the route of a request, the model's name, the runner
    that forwards (a sidecar's), and (:class:`~governor.intake.Keeper`) the places kept."""

    model: str
    forwarder: Forwarding | None

    def route(
        self, exchange: Exchange, request: h11.Request, method: str, path: str, body: bytes
    ) -> None: ...


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


class HttpSession:
    """One client connection's requests, parsed by h11 under the bounds, answered one at a
    time: its deadlines (the idle connection's, the request's, its exchange's), its keys, its
    conversation with the intake."""

    def __init__(self, state: ServerState, door: Door, link: Link, conn_id: int) -> None:
        self.state = state
        self.config = state.config
        self.door = door
        self.link = link
        self.id = conn_id  # names the connection in logs (execution.Replies)
        # The intake's steps, in their order: the door keeps refused requests' places.
        self.credentials = intake.Credentials(state, conn_id)
        self.conversation = intake.Conversation(state, self.credentials, door, self)
        self.http = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.closed = False
        self.close_after = False  # this answer is the connection's last
        self.jobs = 0
        self.incoming = Payload(state)  # the request being read
        self.exchange: Exchange | None = None  # the request being answered
        self.advancing = False  # in _advance (an answer given there must not re-enter it)
        self.arriving = False  # a request has begun: its deadline runs
        # Its deadline (the request's, or the idle connection's), answered with ``expiry``
        # (None: closed quietly) when it passes.
        self.expires_at = math.inf
        self.expiry: HTTPStatus | None = None

    @property
    def source(self) -> str:
        return self.credentials.source

    @property
    def is_idle(self) -> bool:
        """Between requests and, with tenants declared, no valid key shown."""
        return not self.arriving and (self.state.tenants.open or not self.credentials.authenticated)

    # What happens to the connection ------------------------------------------------------

    def opened(self) -> None:
        """Let in: its idle deadline runs."""
        self._deadline(self.config.idle_timeout, None)

    def displace(self, detail: str) -> None:
        """Make way for a new connection at a limit (only one between requests is asked to):
        a 503 that no request asked for yet, then the close."""
        self.refuse(ClosingError(HTTPStatus.SERVICE_UNAVAILABLE, NeedCode.DISPLACED, detail))

    def receive_data(self, data: bytes) -> None:
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
        if not self.closed:
            ahead = len(self.http.trailing_data[0])
            self.link.reading(self.exchange is None or ahead <= MAX_READ_AHEAD)

    def connection_lost(self) -> None:
        """The client left (a half-close is not told apart): its job is cancelled, its place in
        line given up."""
        self.closed = True
        self.conversation.left()
        self.incoming.release()
        exchange = self.exchange
        if exchange is not None:
            exchange.left()
            if exchange.execution is not None:
                exchange.execution.client_gone()
        # Its links back go: its objects are freed by their reference counts once nothing runs
        # for them, not by the cycle collector.
        self.exchange = None
        self.link = GONE

    def woken(self) -> None:
        """The line offered the request in line a slot and the conversation decided it: it is
        answered on the link's next turn, not inside the release that freed the slot."""
        if not self.closed:
            self.link.wake()

    def answer_decided(self) -> None:
        while (event := self.conversation.next_event()) is not None:
            ask, outcome = event
            exchange = self.exchange
            if not self.closed and exchange is not None and exchange.ask is ask:
                exchange.answer(outcome)
            else:  # (its client left meanwhile)
                intake.unclaimed(outcome)

    def abort_running(self, need_code: NeedCode, error_code: ErrorCode, detail: str) -> None:
        exchange = self.exchange
        if exchange is not None and exchange.execution is not None:
            exchange.execution.abort(need_code, error_code, detail)

    def close(self) -> None:
        self.closed = True
        self.link.close()

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
                        self.refuse(refused)
                elif isinstance(ev, h11.EndOfMessage):
                    self._on_request()
                else:  # ConnectionClosed
                    self.close()
        except h11.RemoteProtocolError as exc:
            status = HTTPStatus(exc.error_status_hint)
            self.refuse(ClosingError(status, NeedCode.SPEC_INVALID, f"bad request: {exc}"))
        finally:
            self.advancing = False

    def _on_head(self, request: h11.Request) -> None:
        refused = self.incoming.head(request)
        if refused is not None:
            self.refuse(refused)
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
        """Tell the link its next deadline, its exchange's included."""
        exchange = self.exchange
        deadline = self.expires_at
        if exchange is not None:
            deadline = min(deadline, exchange.due_at)
        self.link.due(deadline)

    def expire(self, now: float) -> None:
        """What is due at ``now``: its exchange's key turn or its next decision, or the
        deadline."""
        exchange = self.exchange
        if exchange is not None:
            exchange.on_deadline(now)
        if not self.closed and self.expires_at <= now:
            self.expires_at = math.inf
            self._expired(self.expiry)

    def _expired(self, status: HTTPStatus | None) -> None:
        if status is None:
            self.close()
        else:
            timeout = self.config.upload_timeout
            detail = f"the request did not arrive within {timeout:g} s"
            self.refuse(ClosingError(status, NeedCode.UPLOAD_TIMEOUT, detail))

    def refuse(self, refused: ClosingError) -> None:
        """An error answered by hand, then the connection closed: h11 cannot answer a request
        it has not parsed (a deadline, a head too large, a bad one)."""
        if self.closed:
            return
        self.closed = True
        status, code = refused.status, refused.code
        self.state.metrics.http_responses[(self.incoming.path, str(status.value))] += 1
        if code not in YIELDS:  # (counted as TCP counts its abort frames)
            self.state.metrics.aborts[code] += 1
        self.link.last(api.closing_error(status, code, refused.message, refused.headers))

    def write(self, data: bytes) -> None:
        self.link.write(data)


class Exchange:
    """One request and its answer; for a job, the :class:`~governor.execution.Replies` its
    execution answers through."""

    def __init__(self, session: HttpSession, head_only: bool = False) -> None:
        self.session = session
        self.id = session.id
        self.out = Answer(session, head_only)  # what goes back, on the wire
        self.execution: Running | None = None
        self.answers: api.Answers | None = None
        self.call: api.Call | None = None
        self.ask: intake.Ask | None = None  # a job's conversation with admission
        self.deferred: Deferred | None = None  # a job's request whose key waits for its turn
        self.proxied: Cancel | None = None  # the upstream answers it
        self.streaming = False  # the 200 and the stream's head are out

    # Plain answers ---------------------------------------------------------------------

    def respond(
        self, status: HTTPStatus, body: bytes, headers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        """A whole answer, then the next request."""
        self.out.whole(status, body, headers)
        self.session.exchange_ended()

    def fail(self, error: api.ApiError) -> None:
        self.respond(error.status, error.body(), error.headers)

    def _abort(
        self, status: HTTPStatus, need_code: str, message: str, *, ends: bool = True
    ) -> None:
        """The job refused for good (401, 400) or ended with a need code: counted in
        ``governor_aborts_total`` here alone (as the TCP side counts its abort frames), and
        answered; once its stream has begun, with an ``error`` event. ``ends``: the exchange
        ends with this answer (an admitted job's, with its task)."""
        self.session.state.metrics.aborts[need_code] += 1
        if self.streaming:  # (the 200 is out: the stream ends with an error event)
            self.out.chunk(api.error_event(status, need_code, message))
            self.out.send(h11.EndOfMessage())
        else:
            bearer = status == HTTPStatus.UNAUTHORIZED
            headers = (("www-authenticate", "Bearer"),) if bearer else ()
            self.out.whole(status, api.error_body(status, need_code, message), headers)
        if ends:
            self.session.exchange_ended()

    # A job -----------------------------------------------------------------------------

    def job(self, request: h11.Request, body: bytes, kind: str) -> None:
        """A job's request: its key checked (at its turn, if it must wait for one), then
        prepared and decided."""
        key = _bearer(header(request, b"authorization"))
        if key is not None:
            step = self.session.conversation.asked(key)
            if step is KeyStep.FAR:  # the guessers' turns are many: refused for now, unchecked
                self._abort(HTTPStatus.UNAUTHORIZED, NeedCode.UNAUTHORIZED, KEY_TURN_FAR)
                return
            if step is KeyStep.LATER:
                self.deferred = (request, body, kind, key)
                self.session.schedule()
                return
        self._job(request, body, kind, key)

    @property
    def due_at(self) -> float:
        """When :meth:`on_deadline` has something to do: its key's turn, or its next decision."""
        if self.deferred is not None:
            return self.session.credentials.key_at
        return math.inf if self.ask is None else self.ask.decide_at

    def on_deadline(self, now: float) -> None:
        """Time passed: its key's turn came, or its next decision at its hint."""
        deferred = self.deferred
        if deferred is not None:
            if self.session.conversation.turn_came(now):
                self.deferred = None
                self._job(*deferred)
        elif self.ask is not None and self.ask.decide_at <= now:
            self.decide()

    def _job(self, request: h11.Request, body: bytes, kind: str, key: str | None) -> None:
        session = self.session
        tenant = session.conversation.tenant(key)
        if isinstance(tenant, intake.Unauthorized):
            if tenant.closes:  # (this 401 is the connection's last answer)
                session.close_after = True
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
                path=session.incoming.path,
                forwards=session.door.forwarder is not None,
            )
            asked_ms = api.max_wait_ms(header(request, api.MAX_WAIT_HEADER.encode()))
        except api.ApiError as exc:
            self.fail(exc)
            return
        session.jobs += 1
        job_id = f"http-{session.id}-{session.jobs}"
        self.call = call
        ask = self.ask = session.conversation.open(
            tenant, (tenant.name, hashlib.sha256(body).digest())
        )
        ask.prepare_fields(job_id, call.spec, body)
        self.answer(session.conversation.submit(ask, asked_ms, may_wait=True))

    def proxy(self, request: h11.Request, body: bytes) -> None:
        """A request the forwarding runner's upstream answers as it is, with no slot taken:
        the answer is relayed as it came (502 or 504 if none came)."""
        method = request.method.decode("ascii", "replace")
        path = self.session.incoming.path
        self.proxied = self.session.link.relay(
            method, path, body if method == "POST" else b"", self._proxied
        )

    def _proxied(self, answer: Relayed | BaseException) -> None:
        self.proxied = None
        if self.session.closed:
            return
        if isinstance(answer, RunnerError):
            self._abort(api.abort_status(answer.code), answer.code, answer.detail)
        elif isinstance(answer, BaseException):
            raise answer
        else:
            self._relay(answer)
            self.session.exchange_ended()

    @property
    def at_door(self) -> bool:
        """Waiting in line for its turn."""
        return self.ask is not None and self.ask.in_line

    def decide(self) -> None:
        """Decided again at its hint, in line."""
        assert self.ask is not None
        self.answer(self.session.conversation.decide(self.ask))

    def answer(self, outcome: intake.Outcome) -> None:
        """The ask's outcome on this wire: the job waits in line for its turn (unanswered,
        decided again at its hint or when a slot may have freed before), runs, is refused for
        good (400), or yields: 429 (503), its place kept for its retry already."""
        ask = self.ask
        assert ask is not None
        if isinstance(outcome, Waiting):
            self.session.schedule()
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
            intake.gave_up(self.session.state, self.ask.attempt)

    def _run(self, ask: intake.Ask, decision: Admitted) -> None:
        session, call = self.session, self.call
        assert call is not None
        job = ask.admitted(
            decision,
            job=decision.ticket.job.id,
            ttl_ms=0,  # (an OpenAI request carries no deadline of its own)
            reservation=session.incoming.take_reservation(),
        )
        self.answers = api.Answers(
            call,
            f"{'chatcmpl' if call.chat else 'cmpl'}-{secrets.token_hex(12)}",
            int(time.time()),
            session.door.model,
        )
        self.execution = session.link.start(job, self)

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
                self.session.state.metrics.aborts[need_code] += 1
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
        self.session.exchange_ended()

    def fleet_refused(self, execution: Execution, refusal: Refusal) -> None:
        """The fleet refused the job admitted here: 429 now, its place kept for its retry as
        any refused job's; the exchange ends with the job's task."""
        assert self.ask is not None
        decision, _ = self.ask.take_back(execution.ticket, refusal, keep_payload=False)
        self.session.conversation.refused(self.ask, decision)
        error = api.refusal(decision)
        self.out.whole(error.status, error.body(), error.headers)


class Answer:
    """How one exchange's answer goes out on its connection: a whole response, or a head and a
    stream's chunks, with the door's own fields (the slots, the wait); through h11, but for a
    stream's chunks, framed here."""

    def __init__(self, session: HttpSession, head_only: bool) -> None:
        self.session = session
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
        session = self.session
        fields = [
            ("content-type", content_type),
            ("x-governor-inflight", str(session.state.inflight)),
            ("x-governor-cap", str(sum(p.ledger.cap for p in session.state.pools))),
        ]
        if self.waited_ms is not None:
            fields.append(("x-governor-waited-ms", str(self.waited_ms)))
        fields += headers
        if length is not None:
            fields.append(("content-length", str(length)))
        if session.closing():
            fields.append(("connection", "close"))
        session.state.metrics.http_responses[(session.incoming.path, str(status.value))] += 1
        self.send(
            h11.Response(status_code=int(status), headers=fields, reason=status.phrase.encode())
        )

    def send(self, ev: h11.Event | None) -> None:
        if ev is None or self.session.closed:
            return
        data = self.session.http.send(ev)
        if data:
            self.session.write(data)

    def chunk(self, data: bytes) -> None:
        """A piece of a stream's body, framed here: h11's writer for a chunked body keeps no
        count and no state between chunks, and building its ``Data`` event and its frame costs
        more than the stream's own work (once a token). An HTTP/1.0 client's body, ended by
        the connection's close, goes through h11."""
        if not data or self.session.closed:
            return
        if self.session.http.their_http_version == b"1.1":
            self.session.write(b"%x\r\n%b\r\n" % (len(data), data))
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
