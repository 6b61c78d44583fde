"""One connection's protocol session, with no IO: bytes in, frames out, jobs admitted.

As in h11's ``Connection``, nothing here touches a socket: :meth:`Session.receive_data`
takes bytes and answers through the ``write`` and ``close`` callables it was given. Each line
is decoded, its upload advanced and, when a payload is complete, admission decided, before
the next line is looked at; an admitted job's run is its :class:`~governor.execution.Execution`.

A job id on a connection moves through phases, by this table alone (:data:`TRANSITIONS`)::

    (new) ──manifest or inline──▶ UPLOADING ──verified, admitted──▶ RUNNING ──ended──▶ (gone)
                                      │  ▲                             ▲
                       yielded, kept  ▼  │ a new manifest or payload   │ its retry admitted
                                     HELD ─────────────────────────────┘

A job not running leaves on an error, a cancel or a yield whose payload is not kept; a running
one leaves only when its execution has ended and given back its ticket.

Sequence numbers: an answer to a frame has the frame's ``seq`` + 1, but every answer to a
frame that completes a payload (its yield, its stream, its terminal frame) has the final
chunk's ``seq`` + 2 (v0), or an inline payload's + 1; a bad line is answered with the last
valid frame's job and ``seq`` + 1.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from protocol.codes import UNKNOWN_JOB, ErrorCode, NeedCode, Receipt, Status, Verb
from protocol.errors import (
    EnvelopeInvalid,
    LineTooLong,
    ManifestInvalid,
    RemoteProtocolError,
    UploadNeed,
)
from protocol.frames import Reply, Request, decode_request, encode_reply, error_reply
from protocol.lines import LineReader
from protocol.spec import SpecInvalid
from protocol.upload import Upload

from ..core.admission import (
    BUFFERS_FULL_HINT_MS,
    Admitted,
    Attempt,
    Budget,
    Rejected,
    Reservation,
    Yielded,
)
from ..core.ledger import Refusal
from ..core.sources import KEY_TURN_FAR, NOW, Turn
from ..core.tenants import Tenant
from ..execution import Execution
from ..ops.logs import event
from ..state import ServerState

log = logging.getLogger("governor.listeners.tcp")

# Lines one connection has handled before the others get a turn: a client pipelining thousands
# of frames delays another's ping by one turn of each busy connection, not by all its frames.
LINES_PER_TURN = 64


class BuffersFull(Exception):
    """The server's payload buffers cannot take the bytes now: the job yields ``buffers_full``."""


class Phase(Enum):
    UPLOADING = "uploading"
    HELD = "held"  # a verified payload kept after a yield, for the client's retry
    RUNNING = "running"


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.UPLOADING: frozenset({Phase.UPLOADING, Phase.HELD, Phase.RUNNING}),
    Phase.HELD: frozenset({Phase.UPLOADING, Phase.RUNNING}),
    Phase.RUNNING: frozenset({Phase.HELD}),  # (the fleet refused it: see fleet_refused)
}


@dataclass(slots=True, eq=False)
class JobState:
    """What a connection holds for one job id."""

    upload: Upload
    attempt: Attempt
    phase: Phase = Phase.UPLOADING
    reservation: Reservation | None = None  # its payload bytes against the buffer budgets
    first_refusal: float | None = None
    execution: Execution | None = None
    # Uploading: dropped unless a chunk comes by then; held: unless its client comes back.
    deadline: float = float("inf")
    seq: int = 0  # of its last frame

    def move(self, phase: Phase) -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise AssertionError(f"no transition {self.phase.value} -> {phase.value}")
        self.phase = phase


def _final_seq(req: Request) -> int:
    """The seq of every answer to the frame that completes a payload: the final chunk's + 2 (v0),
    an inline payload's + 1."""
    return req.seq + (1 if req.inline is not None else 2)


class Session:
    """One connection's protocol state.

    Besides its jobs, a session keeps the connection's deadlines (:meth:`next_deadline`,
    :meth:`expire`): no frame for ``idle_timeout`` while nothing runs; with tenants declared,
    no valid key within ``auth_grace``; and each job's own: an upload with no new chunk for
    ``upload_timeout``, a held payload whose client has not come back within its hint and
    ``upload_timeout`` more. Pings and other jobs' frames keep the connection, never an upload.

    Keys: a key the connection shows for the first time is checked when its source's budget of
    failures allows (:meth:`~governor.core.sources.Sources.key_turn`); until its turn the frame waits
    (:attr:`deferred`) and so do the lines behind it. A key found valid is remembered for the
    connection's later frames. The connection is *idle* (:attr:`is_idle`, to be displaced at a
    limit) while it has no job and, with tenants declared, has shown no valid key.
    """

    def __init__(
        self,
        state: ServerState,
        write: Callable[[bytes], None],
        close: Callable[[], None],
        conn_id: int,
    ) -> None:
        self.state = state
        self.config = config = state.config
        self.admission = state.admission
        self.clock = state.clock
        self.id = conn_id  # names the connection in logs
        self.source = ""  # the client's address (its /64 for IPv6), once connected
        self._write = write
        self._close = close
        self.reader = LineReader(config.max_line_bytes)
        self.jobs: dict[str, JobState] = {}
        self.buffers = Budget(config.max_conn_buffer_bytes)  # payload bytes on this connection
        self.held = 0  # payloads kept after a yield
        self.lines = 0  # lines received
        # Replies to a bad line name the last valid frame's job and seq.
        self.last_job = UNKNOWN_JOB
        self.last_seq = 0
        self.last_ttl_ms = 0
        self.closed = False
        # The client does not read its replies: its lines wait in the reader until it does.
        self.paused = False
        now = self.clock()
        self.last_frame_at = now
        self.opened_at = now
        self.cert_tenant: Tenant | None = None  # named by a verified client certificate
        self.authenticated = state.tenants.open  # a valid key or certificate was shown
        self.auth_failures = 0
        self.keys: dict[str, Tenant] = {}  # keys shown valid on this connection
        # A frame whose key waits for its turn until ``deferred_at``; no line is handled meanwhile.
        self.deferred: Request | None = None
        self.deferred_at = 0.0
        self.turn = NOW  # the deferred frame's
        self.idle = True  # as last told to the sources
        # The earliest deadline set since the connection last asked (None: none earlier).
        self.sooner: float | None = None

    @property
    def running(self) -> int:
        return sum(1 for s in self.jobs.values() if s.phase is Phase.RUNNING)

    @property
    def is_idle(self) -> bool:
        """Nothing in flight and, with tenants declared, no valid key shown."""
        return not self.jobs and (self.state.tenants.open or not self.authenticated)

    def _idle_changed(self) -> None:
        idle = self.is_idle
        if idle != self.idle:
            self.idle = idle
            self.state.sources.idle(self, idle)

    # Events from the connection ----------------------------------------------------------

    def receive_data(self, data: bytes) -> bool:
        """Bytes from the client: its whole lines are handled, :data:`LINES_PER_TURN` at most.
        True when lines may remain: call again (with ``b""``) once other connections have had
        their turn. None is handled while the client does not read its replies
        (:attr:`paused`): they wait for :meth:`resume`."""
        reader = self.reader
        if data:
            reader.feed(data)
        lines = self.lines
        turn_ends = lines + LINES_PER_TURN
        try:
            while (
                not (self.closed or self.paused or self.deferred)
                and (line := reader.next_line()) is not None
            ):
                self.lines += 1
                if line.strip():
                    self._handle_line(line)
                if self.lines == turn_ends:
                    break
        except LineTooLong as exc:
            self.fatal(exc.need_code, exc.error_code, exc.detail)
        if self.lines != lines:  # a whole line is a live client; a trickle of bytes is not
            self.last_frame_at = self.clock()
        return self.lines == turn_ends and not self.closed

    def pause(self) -> None:
        """The client has stopped reading its replies: stop handling its lines."""
        self.paused = True

    def resume(self) -> bool:
        """It reads again: handle the lines that waited (as :meth:`receive_data`)."""
        self.paused = False
        return self.receive_data(b"")

    def next_deadline(self, now: float) -> float:
        """When :meth:`expire` next has something to do. While a job runs the idle timeout
        waits: it is looked at again an ``idle_timeout`` later."""
        config = self.config
        deadline = self.last_frame_at + config.idle_timeout
        if deadline <= now and self.running:
            deadline = now + config.idle_timeout
        if not self.authenticated:
            deadline = min(deadline, self.opened_at + config.auth_grace)
        if self.deferred is not None:
            deadline = min(deadline, self.deferred_at)
        for state in self.jobs.values():
            deadline = min(deadline, state.deadline)
        return deadline

    def expire(self, now: float) -> bool:
        """End what has outlived its deadline: the connection, or a job's upload or hold; and
        handle a frame whose key's turn has come. True when that frame was handled: the lines
        behind it may be (call :meth:`receive_data` with ``b""``)."""
        if self.closed:
            return False
        config = self.config
        if not self.authenticated and now >= self.opened_at + config.auth_grace:
            self.fatal(
                NeedCode.UNAUTHORIZED,
                ErrorCode.UNAUTHORIZED,
                f"no valid api_key within {config.auth_grace:g} s",
            )
            return False
        if now >= self.last_frame_at + config.idle_timeout and not self.running:
            timeout = config.idle_timeout
            self.fatal(NeedCode.IDLE_TIMEOUT, ErrorCode.TIMEOUT, f"no frame for {timeout:g} s")
            return False
        deferred = self.deferred
        if deferred is not None and now >= self.deferred_at:
            self.deferred = None
            assert deferred.api_key is not None
            self._check_key(deferred.api_key, self.turn)
            self._handle(deferred)
        for job, state in list(self.jobs.items()):
            if state.deadline <= now:
                held = state.phase is Phase.HELD
                self._forget(job)
                self._send(
                    Reply(
                        Verb.CONFIRM,
                        job,
                        state.seq + 1,
                        Status.ABORT,
                        ttl_ms=0,
                        need_code=NeedCode.UPLOAD_TIMEOUT,
                        error_code=ErrorCode.TIMEOUT,
                        detail=(
                            "the client did not come back for its held payload"
                            if held
                            else f"no chunk for {config.upload_timeout:g} s"
                        )
                        + "; the payload was dropped",
                        receipts=self._receipts(),
                    )
                )
        return deferred is not None and self.deferred is None and not self.closed

    def _expect_progress(self, state: JobState, wait_s: float = 0.0) -> None:
        """The job is dropped unless it moves on within ``wait_s`` + ``upload_timeout``."""
        state.deadline = deadline = self.clock() + wait_s + self.config.upload_timeout
        if self.sooner is None or deadline < self.sooner:
            self.sooner = deadline

    def connection_lost(self) -> None:
        """The client is gone: stop its work now; each execution gives back its own ticket."""
        self.closed = True
        if self.deferred is not None:
            self.deferred = None
            self.state.sources.turn_unused(self.source, self.turn)
        for job, state in list(self.jobs.items()):
            if state.execution is None:
                self._forget(job)
            else:
                state.execution.client_gone()

    def displace(self, detail: str) -> None:
        """Make way for a new connection at a limit (only an idle one is asked to)."""
        self.fatal(NeedCode.DISPLACED, ErrorCode.QUOTA, detail)

    def abort_running(self, need_code: NeedCode, error_code: ErrorCode, detail: str) -> None:
        """Send each running job its terminal abort now, then cancel it."""
        for state in list(self.jobs.values()):
            if state.execution is not None:
                state.execution.abort(need_code, error_code, detail)

    def fatal(
        self,
        need_code: NeedCode,
        error_code: ErrorCode,
        detail: str,
        *,
        job: str | None = None,
        seq: int | None = None,
    ) -> None:
        """One abort frame for each running job and one for the connection, then close.

        The connection's frame names the last frame's job; when that job is running and has
        not been answered yet, its own abort is the answer (a job gets one terminal frame,
        never two). One already answered (cancelled in the same read, say) leaves the
        connection's frame owed.
        """
        if self.closed:
            return
        named = self.jobs.get(job or self.last_job)
        if named is None or named.execution is None or named.execution.terminal_sent:
            self._send(
                Reply(
                    Verb.CONFIRM,
                    job or self.last_job,
                    seq if seq is not None else self.last_seq + 1,
                    Status.ABORT,
                    ttl_ms=self.last_ttl_ms,
                    need_code=need_code,
                    error_code=error_code,
                    detail=detail,
                    receipts=self._receipts(),
                )
            )
        self.abort_running(need_code, error_code, "the connection is closing: " + detail)
        self.closed = True
        self._close()

    # Frames ------------------------------------------------------------------------------

    def _handle_line(self, line: bytes) -> None:
        try:
            req = decode_request(line)
        except RemoteProtocolError as exc:
            self.state.bad_frames[exc.need_code] += 1
            job, seq = self.last_job, self.last_seq
            if isinstance(exc, EnvelopeInvalid):  # it may name its own job and seq
                job = exc.job or job
                seq = seq if exc.seq is None else exc.seq
            self._send(error_reply(exc, job, seq + 1, self.last_ttl_ms, self._receipts()))
            return
        self.last_job, self.last_seq, self.last_ttl_ms = req.job, req.seq, req.ttl_ms
        key, sources = req.api_key, self.state.sources
        if (
            key is not None
            and key not in self.keys
            and self._looks_up(req)
            and not sources.failed_before(self.source, key)
        ):
            turn = sources.key_turn(self.source, self.config.auth_grace)
            if turn is None:  # the guessers' turns are many: refused for now, unchecked
                if req.verb != Verb.PING:
                    self._abort(req, NeedCode.UNAUTHORIZED, ErrorCode.UNAUTHORIZED, KEY_TURN_FAR)
                    return
            elif turn.wait > 0:  # the source's failures are spent: this key waits for its turn
                self.deferred, self.turn = req, turn
                self.deferred_at = self.clock() + turn.wait
                if self.sooner is None or self.deferred_at < self.sooner:
                    self.sooner = self.deferred_at
                return
            else:
                self._check_key(key, turn)
        self._handle(req)

    def _looks_up(self, req: Request) -> bool:
        """Whether ``req``'s key is looked up: an unauthenticated ping's, a new job's."""
        if self.state.tenants.open:
            return False
        if req.verb == Verb.PING:
            return not self.authenticated
        return req.verb == Verb.SHARE and req.chunk is None and req.job not in self.jobs

    def _check_key(self, key: str, turn: Turn) -> None:
        """Check a key not yet seen on this connection; a valid one is remembered."""
        tenant = self.state.tenants.find(key)
        self.state.sources.key_checked(self.source, key, tenant is not None, turn)
        if tenant is not None:
            self.keys[key] = tenant
            self.authenticated = True
            self._idle_changed()

    def _handle(self, req: Request) -> None:
        if req.verb == Verb.PING:
            self._send(self._reply(req, Verb.CONFIRM, Status.OK, extra=self.state.ping_receipts()))
            return
        if req.verb == Verb.CANCEL:
            self._on_cancel(req)
            return
        state = self.jobs.get(req.job)
        if state is not None and state.phase is Phase.RUNNING:
            self._need(
                req,
                NeedCode.JOB_RUNNING,
                ErrorCode.CONFLICT,
                f"job {req.job!r} is running; use another job id",
            )
        elif req.manifest is not None:
            self._on_manifest(req, state)
        elif req.chunk is not None:
            self._on_chunk(req, state)
        else:
            self._on_inline(req, state)

    def _on_manifest(self, req: Request, state: JobState | None) -> None:
        assert req.manifest is not None
        if state is None:
            state = self._new_job(req)
            if state is None:
                return
        elif state.phase is Phase.HELD:  # a new manifest replaces the payload held for a retry
            self._unhold(state)
        state.seq = req.seq
        try:
            manifest = state.upload.apply_manifest(req.manifest)
            self._reserve(state, manifest.total_bytes)
        except UploadNeed as exc:
            self._forget(req.job)
            self._send(self._error(req, exc))
            return
        except BuffersFull:
            self._buffers_full(req, req.seq + 1)
            return
        self._expect_progress(state)
        self._send(self._reply(req, Verb.CLARIFY, Status.OK))

    def _on_chunk(self, req: Request, state: JobState | None) -> None:
        assert req.chunk is not None
        if state is None:
            missing = UploadNeed(NeedCode.MANIFEST_MISSING, "send 'payload_manifest' first")
            self._send(self._error(req, missing))
            return
        upload = state.upload
        state.seq = req.seq
        if state.phase is Phase.HELD and upload.is_final_chunk_again(req.chunk):
            # A retry after a yield: the payload was kept, so admission is tried again.
            self._admit(req, state)
            return
        reservation = state.reservation
        # The server's budget is charged before the bytes are decoded: with what base64 can
        # hold at most, then (below) with what the upload holds.
        b64 = req.chunk.get("bytes_b64")
        most = len(b64) * 3 // 4 if type(b64) is str else 0
        if reservation is not None and not reservation.hold(upload.bytes_received + most):
            self._buffers_full(req, _final_seq(req) if self._is_final(state) else req.seq + 1)
            return
        try:
            payload = upload.apply_chunk(req.chunk)
        except UploadNeed as exc:
            self._send(self._error(req, exc))
            return
        finally:
            if reservation is not None:
                reservation.hold(upload.bytes_received)
        if payload is None:
            self._expect_progress(state)
            self._send(self._reply(req, Verb.CLARIFY, Status.OK))
        else:
            self._complete(req, state, payload)

    def _on_inline(self, req: Request, state: JobState | None) -> None:
        assert req.inline is not None
        if state is None:
            state = self._new_job(req)
            if state is None:
                return
        manifest = state.upload.manifest
        digest = req.inline.get("sha256")
        # The same payload again after a yield is a returning client, like a resent final chunk.
        returning = (
            state.phase is Phase.HELD
            and manifest is not None
            and isinstance(digest, str)
            and digest.lower() == manifest.sha256
        )
        if state.phase is Phase.HELD and not returning:
            self._unhold(state)
        state.seq = req.seq
        try:  # (a returning payload is checked again: its digest alone proves nothing)
            payload = state.upload.apply_inline(req.inline)
            self._reserve(state, len(payload), held=len(payload))
        except UploadNeed as exc:
            self._forget(req.job)
            self._send(self._error(req, exc))
            return
        except BuffersFull:
            self._buffers_full(req, _final_seq(req))
            return
        if returning:
            self._admit(req, state)
        else:
            self._complete(req, state, payload)

    def _on_cancel(self, req: Request) -> None:
        state = self.jobs.get(req.job)
        if state is None:
            self._need(
                req,
                NeedCode.JOB_UNKNOWN,
                ErrorCode.BAD_ENVELOPE,
                f"no job {req.job!r} on this connection",
            )
        elif state.execution is not None:  # its terminal abort is the answer
            state.execution.abort(
                NeedCode.CANCELLED, ErrorCode.CANCELLED, "cancelled by the client"
            )
        else:  # uploading, or held after a yield: dropped
            self._forget(req.job)
            self._abort(
                req,
                NeedCode.CANCELLED,
                ErrorCode.CANCELLED,
                "cancelled by the client before it ran",
            )

    def _new_job(self, req: Request) -> JobState | None:
        """A job id not seen before on this connection; None if refused (its reply is sent)."""
        tenants, key = self.state.tenants, req.api_key
        if tenants.open:
            tenant: Tenant | None = tenants.find(None)
        elif key is not None:
            tenant = self.keys.get(key)  # (checked as the frame came: _handle_line)
        else:
            tenant = self.cert_tenant
        if tenant is None:  # says nothing of which tenants exist
            self.auth_failures += 1
            if self.auth_failures >= self.config.max_auth_failures:
                self._keys_failed(req)  # (its abort, for the connection, answers the job too)
            else:
                self._abort(
                    req, NeedCode.UNAUTHORIZED, ErrorCode.UNAUTHORIZED, "a valid api_key is needed"
                )
            return None
        if len(self.jobs) >= self.config.max_jobs_per_conn:
            self.fatal(
                NeedCode.TOO_MANY_JOBS,
                ErrorCode.QUOTA,
                f"more than {self.config.max_jobs_per_conn} jobs open on one connection",
                job=req.job,
                seq=req.seq + 1,
            )
            return None
        upload = Upload(self.config.max_payload_bytes, self.config.max_chunks)
        # (its deadline is set by what comes of this frame: an accepted manifest, a hold)
        state = self.jobs[req.job] = JobState(upload, Attempt(tenant, None))
        self._idle_changed()
        return state

    def _keys_failed(self, req: Request) -> None:
        """Too many unauthorized answers: close."""
        line = self.state.sources.line(
            f"closing connection {self.id} from {self.source} after {self.auth_failures} "
            "failed keys"
        )
        if line is not None:
            event(
                log,
                logging.WARNING,
                line,
                event="keys_failed",
                source=self.source,
                failures=self.auth_failures,
            )
        self.fatal(
            NeedCode.UNAUTHORIZED,
            ErrorCode.UNAUTHORIZED,
            f"a valid api_key is needed; after {self.auth_failures} failed keys the connection "
            "closes",
            job=req.job,
            seq=req.seq + 1,
        )

    # Admission ---------------------------------------------------------------------------

    def _complete(self, req: Request, state: JobState, payload: bytes) -> None:
        """A verified payload: the runner prepares it (a bad spec never takes a slot), then
        admission decides."""
        manifest = state.upload.manifest
        assert manifest is not None
        attempt = state.attempt
        attempt.job, attempt.spec_error = None, None
        try:
            attempt.job = self.admission.primary.runner.prepare(
                req.job, payload, manifest.content_type
            )
        except SpecInvalid as exc:
            attempt.spec_error = exc
        except Exception:  # a runner bug must cost this job, not the connection
            log.exception("runner failed to prepare job %r", req.job)
            attempt.spec_error = SpecInvalid(
                NeedCode.SPEC_INVALID, "the runner cannot run this payload"
            )
        self._admit(req, state)

    def _admit(self, req: Request, state: JobState) -> None:
        attempt, metrics = state.attempt, self.state.metrics
        started = time.perf_counter()
        decision = self.admission.decide(attempt)
        metrics.decision.observe(attempt.lane, time.perf_counter() - started)
        if isinstance(decision, Admitted):
            ticket = decision.ticket
            ticket.reservation, state.reservation = state.reservation, None
            if state.phase is Phase.HELD:
                self._unhold(state)
            first = state.first_refusal
            waited = None if first is None else ticket.slot.started - first
            metrics.wait.observe(ticket.lane, waited or 0.0)
            state.move(Phase.RUNNING)
            state.deadline = float("inf")
            state.execution = Execution(self.state, ticket, req, attempt, self, waited)
            return
        if isinstance(decision, Rejected):
            self._forget(req.job)
            if decision.error is not None:
                self._send(self._error(req, decision.error, seq=_final_seq(req)))
            else:
                self._abort(
                    req, decision.need_code, ErrorCode.POLICY, decision.detail, seq=_final_seq(req)
                )
            return
        self._yielded(req, state, decision)

    def fleet_refused(self, execution: Execution, refusal: Refusal) -> None:
        """The fleet refused a job this replica admitted: its ticket is given back (the payload's
        buffers return to the job), and its client told to yield, as if refused here."""
        req, ticket = execution.request, execution.ticket
        state = self.jobs.get(req.job)
        if state is None or state.execution is not execution:  # (the connection is gone)
            self.admission.revoke(execution.attempt, ticket, refusal)
            return
        state.reservation, ticket.reservation = ticket.reservation, None
        decision = self.admission.revoke(execution.attempt, ticket, refusal)
        state.execution = None
        self._yielded(req, state, decision)

    def _yielded(self, req: Request, state: JobState, decision: Yielded) -> None:
        """Answer ``yield``, keeping the payload for the retry if the connection may."""
        if state.first_refusal is None:
            state.first_refusal = self.state.clock()
        held = self._hold(state)
        if held:
            self._expect_progress(state, decision.retry_hint_ms / 1000)
            detail = "no execution slot free; resend the final chunk after retry_hint_ms"
        else:
            self._forget(req.job)
            detail = "no execution slot free, and the payload was not kept; resend it"
        self._send(
            self._reply(
                req,
                Verb.CLARIFY,
                Status.YIELD,
                seq=_final_seq(req),
                need_code=decision.need_code,
                error_code=decision.error_code,
                retry_hint_ms=decision.retry_hint_ms,
                detail=detail,
                extra=(
                    (Receipt.RETRY_HINT_MS, decision.retry_hint_ms),
                    (Receipt.PAYLOAD_HELD, int(held)),
                ),
            )
        )

    def _hold(self, state: JobState) -> bool:
        """Keep a refused payload for the client's retry, within this connection's bound."""
        if state.phase is Phase.HELD:
            return True
        if self.held >= self.config.held_payloads_per_conn:
            return False
        state.move(Phase.HELD)
        self.held += 1
        state.attempt.tenant.waiting += 1
        return True

    def _unhold(self, state: JobState) -> None:
        state.move(Phase.UPLOADING)
        self.held -= 1
        state.attempt.tenant.waiting -= 1
        self.admission.forget(state.attempt)

    def _reserve(self, state: JobState, declared: int, *, held: int = 0) -> None:
        """Count a payload's declared bytes against the connection's budget and the ``held``
        bytes (those it has already) against the server's (what the job had before, for an
        earlier payload, is given back first). A payload whose declared size the server's
        budget has no room for now raises :class:`BuffersFull`; one over the connection's,
        ``manifest_invalid``."""
        if state.reservation is not None:
            state.reservation.release()
            state.reservation = None
        if not self.buffers.fits(declared):
            raise ManifestInvalid(
                f"this connection already buffers {self.buffers.used} payload bytes; "
                f"its limit is {self.buffers.limit}"
            )
        if not self.state.buffers.fits(declared):
            raise BuffersFull
        reservation = state.reservation = Reservation(self.buffers, self.state.buffers, declared)
        reservation.hold(held)

    def _buffers_full(self, req: Request, seq: int) -> None:
        """Drop the job and tell its client to send it again later."""
        self._forget(req.job)
        self._send(
            self._reply(
                req,
                Verb.CLARIFY,
                Status.YIELD,
                seq=seq,
                need_code=NeedCode.BUFFERS_FULL,
                error_code=ErrorCode.BUSY,
                retry_hint_ms=BUFFERS_FULL_HINT_MS,
                detail="the server's payload buffers are full; send the payload again later",
                extra=(
                    (Receipt.RETRY_HINT_MS, BUFFERS_FULL_HINT_MS),
                    (Receipt.PAYLOAD_HELD, 0),
                ),
            )
        )

    @staticmethod
    def _is_final(state: JobState) -> bool:
        """Whether the next chunk would complete the upload."""
        manifest = state.upload.manifest
        return manifest is not None and state.upload.chunks_received + 1 >= manifest.chunks

    def _forget(self, job: str) -> None:
        """Drop a job that is not running: its hold, its place in line, its buffers."""
        state = self.jobs.pop(job)
        assert state.execution is None
        if state.phase is Phase.HELD:
            self._unhold(state)  # (and its place in line: only a held job has one)
        if state.reservation is not None:
            state.reservation.release()
        self._idle_changed()

    # Replies for executions (execution.Replies) ------------------------------------------

    def send_delta(self, execution: Execution, text: str) -> None:
        req = execution.request
        # Small on purpose: no receipts on a stream frame.
        self._send(
            Reply(Verb.CLARIFY, req.job, _final_seq(req), Status.OK, ttl_ms=req.ttl_ms, delta=text)
        )

    def send_terminal(
        self,
        execution: Execution,
        *,
        need_code: str | None,
        error_code: str | None,
        detail: str | None,
        result: dict[str, Any] | None,
    ) -> None:
        req = execution.request
        held_ms = round((self.state.clock() - execution.ticket.slot.started) * 1000)
        self._send(
            self._reply(
                req,
                Verb.CONFIRM,
                Status.DONE if need_code is None else Status.ABORT,
                seq=_final_seq(req),
                need_code=need_code,
                error_code=error_code,
                detail=detail,
                result=result,
                extra=((Receipt.BACKEND_MS, held_ms),),
            )
        )

    def job_ended(self, execution: Execution) -> None:
        job = execution.request.job
        state = self.jobs.get(job)
        if state is not None and state.execution is execution:
            del self.jobs[job]
            self._idle_changed()

    # Replies -----------------------------------------------------------------------------

    def _send(self, reply: Reply) -> None:
        if reply.status == Status.ABORT and reply.need_code is not None:
            self.state.metrics.aborts[reply.need_code] += 1
        self._write(encode_reply(reply))

    def _receipts(self, bytes_in: int = 0) -> tuple[tuple[str, int], ...]:
        return (*self.state.receipts(), (Receipt.BYTES_IN, bytes_in))

    def _reply(
        self,
        req: Request,
        verb: Verb,
        status: Status,
        *,
        seq: int | None = None,
        need_code: str | None = None,
        error_code: str | None = None,
        retry_hint_ms: int | None = None,
        detail: str | None = None,
        result: dict[str, Any] | None = None,
        extra: tuple[tuple[str, int], ...] = (),
    ) -> Reply:
        """A reply to ``req``; ``cdr.bytes_in`` is its job's payload bytes received so far."""
        return Reply(
            verb,
            req.job,
            req.seq + 1 if seq is None else seq,
            status,
            ttl_ms=req.ttl_ms,
            need_code=need_code,
            error_code=error_code,
            retry_hint_ms=retry_hint_ms,
            detail=detail,
            receipts=(*self._receipts(self._bytes_in(req.job)), *extra),
            result=result,
        )

    def _need(self, req: Request, need_code: str, error_code: str, detail: str) -> None:
        self._send(
            self._reply(
                req,
                Verb.CLARIFY,
                Status.NEED,
                need_code=need_code,
                error_code=error_code,
                detail=detail,
            )
        )

    def _abort(
        self, req: Request, need_code: str, error_code: str, detail: str, *, seq: int | None = None
    ) -> None:
        self._send(
            self._reply(
                req,
                Verb.CONFIRM,
                Status.ABORT,
                seq=seq,
                need_code=need_code,
                error_code=error_code,
                detail=detail,
            )
        )

    def _error(self, req: Request, exc: RemoteProtocolError, *, seq: int | None = None) -> Reply:
        receipts = self._receipts(self._bytes_in(req.job))
        seq = req.seq + 1 if seq is None else seq
        return error_reply(exc, req.job, seq, req.ttl_ms, receipts)

    def _bytes_in(self, job: str) -> int:
        state = self.jobs.get(job)
        return 0 if state is None else state.upload.bytes_received
