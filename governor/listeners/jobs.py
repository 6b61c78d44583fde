"""One TCP connection's jobs: the payload frames (a manifest and its chunks, or an inline
payload) checked as they come (:class:`Uploads`); what the connection keeps of a refused job
for its retry, and the bytes every payload holds (:class:`Retries`: the door's own part of the
keep-or-give-up rule, by job id); a verified payload's ask (:class:`governor.intake.Ask`) and
its outcome mapped to a reply (:class:`JobTable`); and the frames a running job's execution
sends (:class:`JobReplies`).

A job id on a connection moves through phases, by this table alone (:data:`TRANSITIONS`)::

    (new) ──manifest or inline──▶ UPLOADING ──verified, admitted──▶ RUNNING ──ended──▶ (gone)
                                   │  ▲  │                           ▲  ▲
                    yielded, kept  ▼  │  ▼ busy, may wait            │  │ its turn came
                                  HELD ◀── WAITING ──────────────────┘  │
                                   │  its turn passed its budget        │ its retry admitted
                                   └────────────────────────────────────┘

A job whose frame asks for a wait (``max_wait_ms``) and is refused for want of a slot waits for
its turn in the line both doors share (:class:`governor.intake.Wait`), unanswered meanwhile: it
is decided again at its hint and whenever the line offers it a freed slot
(:meth:`JobTable.decide_again`), and answered once, when it runs or when its turn passes its
budget (a yield, its payload kept as for any). A new manifest or payload for it replaces it, as
for a held one.

A job not running leaves on an error, a cancel or a yield whose payload is not kept; a running
one leaves only when its execution has ended and given back its ticket.

No IO here either: replies go through the session's :class:`~governor.listeners.wire.Wire`; a
job admitted waits in :attr:`JobTable.admitted` for the listener to start it; a job's first
frame is checked against its key's tenant (:meth:`Uploads.new_job`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from protocol.codes import ErrorCode, NeedCode, Receipt, Status, Verb
from protocol.errors import ManifestInvalid, UploadNeed
from protocol.frames import Reply, Request
from protocol.upload import Upload

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
from ..execution import Ending, Execution, Running
from ..intake import Waiting
from ..runners import Relay, Token
from ..state import ServerState
from .wire import Wire, yield_detail


class BuffersFull(Exception):
    """The server's payload buffers cannot take the bytes now: the job yields ``buffers_full``."""


class Phase(Enum):
    # (hashed several times a frame, in the sets below: by identity, as members compare,
    # and in C, not by Enum.__hash__'s Python call on the name)
    __hash__ = object.__hash__

    UPLOADING = "uploading"
    HELD = "held"  # a verified payload kept after a yield, for the client's retry
    WAITING = "waiting"  # a verified payload waiting in line for its turn, unanswered
    RUNNING = "running"


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.UPLOADING: frozenset({Phase.UPLOADING, Phase.HELD, Phase.WAITING, Phase.RUNNING}),
    Phase.HELD: frozenset({Phase.UPLOADING, Phase.WAITING, Phase.RUNNING}),
    Phase.WAITING: frozenset({Phase.UPLOADING, Phase.HELD, Phase.RUNNING}),
    Phase.RUNNING: frozenset({Phase.HELD}),  # (the fleet refused it: Session.fleet_refused)
}


@dataclass(slots=True, eq=False)
class JobState:
    """What a connection holds for one job id."""

    upload: Upload
    ask: intake.Ask  # its conversation with admission: its attempt, refusals and wait
    phase: Phase = Phase.UPLOADING
    reservation: Reservation | None = None  # its payload bytes against the buffer budgets
    execution: Running | None = None
    # The frame that completed its payload, once admitted: the job's answers answer it.
    final: Request | None = None
    # Uploading: dropped unless a chunk comes by then; held: unless its client comes back;
    # waiting: decided again then (its hint).
    deadline: float = float("inf")
    seq: int = 0  # of its last frame
    max_wait_ms: int | None = None  # the wait its frames asked for (None: a yield at once)
    fleet_wide: bool = False  # its client goes where a yield's `elsewhere` says (its frames')

    def asked(self, req: Request) -> None:
        """What a frame of the job asks of its own conversation (its first frame and a final
        chunk sent again carry it): a wait for its turn, a place anywhere in the fleet."""
        self.seq = req.seq
        if req.max_wait_ms is not None:
            self.max_wait_ms = req.max_wait_ms
        if req.fleet_wide is not None:
            self.fleet_wide = req.fleet_wide

    def move(self, phase: Phase) -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise AssertionError(f"no transition {self.phase.value} -> {phase.value}")
        self.phase = phase


def final_seq(req: Request) -> int:
    """The seq of every answer to the frame that completes a payload: the final chunk's + 2 (v0),
    an inline payload's + 1."""
    return req.seq + (1 if req.inline is not None else 2)


class Owner(Protocol):
    """What the uploads need of their session."""

    @property
    def conversation(self) -> intake.Conversation:
        """The connection's intake (a new job's key, checked: its tenant)."""
        ...

    def fatal(
        self,
        need_code: NeedCode,
        error_code: ErrorCode,
        detail: str,
        *,
        job: str | None = None,
        seq: int | None = None,
    ) -> None:
        """The connection's last answer: each running job aborted, then closed."""
        ...

    def expect_progress(self, state: JobState, wait_s: float = 0.0) -> None: ...

    def due(self, deadline: float) -> None:
        """A new deadline (a waiting job's next decision)."""
        ...

    def idle_changed(self) -> None: ...


class _Gone:
    """The owner of a gone connection's table: what its running jobs' ends would tell it (the
    connection idle again, a deadline) goes nowhere, and it has no conversation left."""

    @property
    def conversation(self) -> intake.Conversation:
        raise AssertionError("the connection has gone: no new job asks")

    def fatal(
        self,
        need_code: NeedCode,
        error_code: ErrorCode,
        detail: str,
        *,
        job: str | None = None,
        seq: int | None = None,
    ) -> None:
        pass

    def expect_progress(self, state: JobState, wait_s: float = 0.0) -> None:
        pass

    def due(self, deadline: float) -> None:
        pass

    def idle_changed(self) -> None:
        pass


GONE = _Gone()


class Retries:
    """What a connection keeps of its refused jobs for their retries: the payloads held by job
    id (``held_payloads_per_conn`` at most), the jobs turned away without theirs (by id, oldest
    first, ``max_jobs_per_conn`` at most: the same id sent again is the same job back, the one
    unserved demand, not a new one), and every payload's bytes against the connection's budget
    (``max_conn_buffer_bytes``) and the server's."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.config = state.config
        self.buffers = Budget(state.config.max_conn_buffer_bytes)  # payload bytes on this conn
        self.held = 0  # payloads kept after a yield
        self.turned_away: dict[str, Attempt] = {}

    def turn_away(self, job: str, attempt: Attempt) -> None:
        """Remember a refused job whose payload was not kept, for its retry (the oldest one
        past the connection's bound on jobs is taken to have given up)."""
        if len(self.turned_away) >= self.config.max_jobs_per_conn:
            oldest = next(iter(self.turned_away))
            intake.gave_up(self.state, self.turned_away.pop(oldest))
        self.turned_away[job] = attempt

    def client_gone(self) -> None:
        """None of the jobs turned away will be back."""
        for attempt in self.turned_away.values():
            intake.gave_up(self.state, attempt)
        self.turned_away.clear()

    def reserve(self, state: JobState, declared: int, *, held: int = 0) -> None:
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
        reservation = intake.payload_bytes(self.state, self.buffers, declared)
        if reservation is None:
            raise BuffersFull
        state.reservation = reservation
        reservation.hold(held)

    def hold(self, state: JobState) -> bool:
        """Keep a refused payload for the client's retry, within this connection's bound."""
        if state.phase is Phase.HELD:
            return True
        if self.held >= self.config.held_payloads_per_conn:
            return False
        state.move(Phase.HELD)
        self.held += 1
        state.ask.attempt.tenant.waiting += 1
        return True

    def unhold(self, state: JobState, to: Phase = Phase.UPLOADING, *, forget: bool = True) -> None:
        """A held payload is no longer held; with ``forget`` its place in admission's line is
        given up too."""
        state.move(to)
        self.held -= 1
        state.ask.attempt.tenant.waiting -= 1
        if forget:
            state.ask.forget()


class Uploads:
    """A connection's jobs as their frames make them: a manifest and its chunks, or an inline
    payload, checked as they come, their bytes reserved by the table's :class:`Retries`; a
    verified payload goes to the table (:meth:`JobTable.complete`)."""

    def __init__(self, table: JobTable) -> None:
        self.table = table
        self.owner = table.owner
        self.wire = table.wire
        self.state = table.state
        self.config = table.config
        self.jobs = table.jobs
        self.retries = table.retries

    def new_job(self, req: Request) -> JobState | None:
        """A job id not seen before on this connection, for its key's tenant; None if refused
        (its reply is sent: a job without a valid key, or past the connection's bound)."""
        conversation, config = self.owner.conversation, self.config
        tenant = conversation.tenant(req.api_key)
        if isinstance(tenant, intake.Unauthorized):
            if tenant.closes:  # (its abort, for the connection, answers the job too)
                self.owner.fatal(
                    NeedCode.UNAUTHORIZED,
                    ErrorCode.UNAUTHORIZED,
                    f"a valid api_key is needed; after {tenant.failures} failed keys the "
                    "connection closes",
                    job=req.job,
                    seq=req.seq + 1,
                )
            else:
                detail = "a valid api_key is needed"
                self.wire.abort(req, NeedCode.UNAUTHORIZED, ErrorCode.UNAUTHORIZED, detail)
            return None
        if len(self.jobs) >= config.max_jobs_per_conn:
            self.owner.fatal(
                NeedCode.TOO_MANY_JOBS,
                ErrorCode.QUOTA,
                f"more than {config.max_jobs_per_conn} jobs open on one connection",
                job=req.job,
                seq=req.seq + 1,
            )
            return None
        upload = Upload(config.max_payload_bytes, config.max_chunks)
        # (its deadline is set by what comes of its first frame: an accepted manifest, a hold)
        ask = conversation.open(tenant, req.job)
        state = self.jobs[req.job] = JobState(upload, ask)
        self.owner.idle_changed()
        return state

    # Frames --------------------------------------------------------------------------------

    def on_manifest(self, req: Request, state: JobState | None) -> None:
        assert req.manifest is not None
        if state is None:
            state = self.new_job(req)
            if state is None:
                return
        else:  # a new manifest replaces the payload held for a retry, or waiting
            self.table.replace(state)
        state.asked(req)
        try:
            manifest = state.upload.apply_manifest(req.manifest)
            self.retries.reserve(state, manifest.total_bytes)
        except UploadNeed as exc:
            self.table.forget(req.job)
            self.wire.error(req, exc)
            return
        except BuffersFull:
            self.buffers_full(req, req.seq + 1)
            return
        self.owner.expect_progress(state)
        self.wire.ok(req)

    def on_chunk(self, req: Request, state: JobState | None) -> None:
        assert req.chunk is not None
        if state is None:
            self.wire.error(
                req, UploadNeed(NeedCode.MANIFEST_MISSING, "send 'payload_manifest' first")
            )
            return
        upload = state.upload
        state.asked(req)
        if state.phase is not Phase.UPLOADING and upload.is_final_chunk_again(req.chunk):
            # A retry after a yield: the payload was kept, so admission is tried again.
            self.table.complete(req, state, None)
            return
        reservation = state.reservation
        # The server's budget is charged before the bytes are decoded: with what base64 can
        # hold at most, then (below) with what the upload holds.
        b64 = req.chunk.get("bytes_b64")
        most = len(b64) * 3 // 4 if type(b64) is str else 0
        if reservation is not None and not reservation.hold(upload.bytes_received + most):
            self.buffers_full(req, final_seq(req) if self._is_final(state) else req.seq + 1)
            return
        try:
            payload = upload.apply_chunk(req.chunk)
        except UploadNeed as exc:
            self.wire.error(req, exc)
            return
        finally:
            if reservation is not None:
                reservation.hold(upload.bytes_received)
        if payload is None:
            self.owner.expect_progress(state)
            self.wire.ok(req)
        else:
            self.table.complete(req, state, payload)

    def on_inline(self, req: Request, state: JobState | None) -> None:
        assert req.inline is not None
        if state is None:
            state = self.new_job(req)
            if state is None:
                return
        manifest = state.upload.manifest
        digest = req.inline.get("sha256")
        # The same payload again after a yield is a returning client, like a resent final chunk.
        returning = (
            state.phase is not Phase.UPLOADING
            and manifest is not None
            and isinstance(digest, str)
            and digest.lower() == manifest.sha256
        )
        if not returning:
            self.table.replace(state)
        state.asked(req)
        try:  # (a returning payload is checked again: its digest alone proves nothing)
            payload = state.upload.apply_inline(req.inline)
            self.retries.reserve(state, len(payload), held=len(payload))
        except UploadNeed as exc:
            self.table.forget(req.job)
            self.wire.error(req, exc)
            return
        except BuffersFull:
            self.buffers_full(req, final_seq(req))
            return
        self.table.complete(req, state, None if returning else payload)

    def buffers_full(self, req: Request, seq: int) -> None:
        """Drop the job and tell its client to send it again later; while the server drains,
        to send it elsewhere (no retry here would be admitted: the answer it would get)."""
        self.table.forget(req.job)
        refusal = intake.no_room_for_payload(self.state)
        if refusal.need_code == NeedCode.DRAINING:
            detail = yield_detail(refusal.need_code, held=False)
        else:
            detail = "the server's payload buffers are full; send the payload again later"
        self.wire.yield_(req, refusal, seq=seq, held=False, detail=detail)

    @staticmethod
    def _is_final(state: JobState) -> bool:
        """Whether the next chunk would complete the upload."""
        manifest = state.upload.manifest
        return manifest is not None and state.upload.chunks_received + 1 >= manifest.chunks


class JobTable:
    """A connection's jobs (:attr:`jobs`): their frames (:attr:`uploads`), what is kept of them
    for a retry (:attr:`retries`), and their asks' outcomes mapped to replies, to a wait in line
    or to the event that starts a job; its executions answer through :attr:`replies`."""

    def __init__(self, owner: Owner, wire: Wire, state: ServerState, conn_id: int) -> None:
        self.owner = owner
        self.wire = wire
        self.state = state
        self.config = state.config
        self.id = conn_id  # names the connection in the executions' logs
        self.jobs: dict[str, JobState] = {}
        # Made at the first job's frame (an idle connection holds neither: see docs/BENCHMARKS.md).
        self._retries: Retries | None = None
        self._uploads: Uploads | None = None
        # A job admitted and not yet started by the listener (Session.next_event).
        self.admitted: intake.JobAdmitted | None = None
        self._replies: JobReplies | None = None  # (made for the first job started)

    def replace(self, state: JobState) -> None:
        """A new payload for a job held or waiting: it gives up its hold or its wait."""
        if state.phase is Phase.HELD:
            self.retries.unhold(state)
        elif state.phase is Phase.WAITING:
            state.ask.give_up()
            state.move(Phase.UPLOADING)

    def forget(self, job: str, *, gave_up: bool = True) -> None:
        """Drop a job that is not running: its hold or its wait, its place in admission's line,
        its buffers; with ``gave_up``, it will not be back (else its client may send it again:
        a yield whose payload was not kept)."""
        state = self.jobs.pop(job)
        if gave_up:
            intake.gave_up(self.state, state.ask.attempt)
        assert state.execution is None
        if state.phase is Phase.HELD:
            self.retries.unhold(state)
        else:
            state.ask.give_up()
            state.ask.forget()  # (a promise its yield left)
        if state.reservation is not None:
            state.reservation.release()
        self.owner.idle_changed()

    @property
    def retries(self) -> Retries:
        if self._retries is None:
            self._retries = Retries(self.state)
        return self._retries

    @property
    def uploads(self) -> Uploads:
        if self._uploads is None:
            self._uploads = Uploads(self)
        return self._uploads

    def bytes_in(self, job: str) -> int:
        """A job's payload bytes received so far (the replies' ``cdr.bytes_in``)."""
        state = self.jobs.get(job)
        return 0 if state is None else state.upload.bytes_received

    def client_gone(self) -> None:
        """The connection is gone: a job admitted and not started gives its ticket back here,
        the others not running are forgotten, and each execution stops and gives back its own."""
        admitted, self.admitted = self.admitted, None
        if admitted is not None:
            admitted.ticket.release("client_gone")
            self.jobs.pop(admitted.job)
        for job, state in list(self.jobs.items()):
            if state.execution is None:
                self.forget(job)
            else:
                state.execution.client_gone()
        if self._retries is not None:
            self._retries.client_gone()
        # Its links back up go with it: the connection's objects are then freed as soon as
        # nothing runs for them, by their reference counts, not by the cycle collector (see
        # docs/BENCHMARKS.md, the yield path against heptaminid).
        self.owner = GONE
        self._uploads = None
        self._replies = None

    def abort_running(self, need_code: NeedCode, error_code: ErrorCode, detail: str) -> None:
        """Send each running job its terminal abort now, then cancel it."""
        for state in list(self.jobs.values()):
            if state.execution is not None:
                state.execution.abort(need_code, error_code, detail)

    @property
    def replies(self) -> JobReplies:
        """What this connection's executions answer through."""
        if self._replies is None:
            self._replies = JobReplies(self)
        return self._replies

    def complete(self, req: Request, state: JobState, payload: bytes | None) -> None:
        """A verified payload (None: the one held, back for its retry) to the intake; the
        outcome mapped to a reply, to a wait in line, or to the event that starts the job."""
        ask = state.ask
        if payload is not None:
            manifest = state.upload.manifest
            assert manifest is not None
            ask.prepare(req.job, payload, manifest.content_type)
        state.final = req
        # (a frame of a job in line: its wait starts again)
        conversation, wait_ms = self.owner.conversation, state.max_wait_ms
        self.decided(state, conversation.submit(ask, wait_ms, may_wait=wait_ms is not None))

    def decide_again(self, job: str) -> None:
        """A waiting job decided again at its hint (unless another job of this connection is
        being started: its turn comes once that one has)."""
        state = self.jobs.get(job)
        if state is not None and state.phase is Phase.WAITING and self.admitted is None:
            self.decided(state, self.owner.conversation.decide(state.ask))

    def answer_decided(self, conversation: intake.Conversation) -> None:
        """The outcomes the conversation decided between reads, answered in turn (an admitted
        one waits for the listener to start the one before it)."""
        while self.admitted is None and (event := conversation.next_event()) is not None:
            ask, outcome = event
            state = self.jobs.get(ask.key) if isinstance(ask.key, str) else None
            if state is not None and state.ask is ask:
                self.decided(state, outcome)
            else:  # (its job is gone meanwhile)
                intake.unclaimed(outcome)

    # intake.Keeper: what this door keeps of a refused job for its retry, by its id ------------

    def take(self, key: Hashable) -> Attempt | None:
        """The attempt of a job turned away without its payload, back for its retry."""
        assert isinstance(key, str)
        return None if self._retries is None else self._retries.turned_away.pop(key, None)

    def keep(self, key: Hashable, attempt: Attempt, refused: Yielded) -> bool:
        """Keep the refused job's payload for its retry, within the connection's bound; else
        (or while the server drains: no retry here would be admitted, and its bytes would turn
        the drain's later answers into buffers_full) turn it away, remembered by its id (its
        payload is dropped as its yield is answered: :meth:`yielded`)."""
        assert isinstance(key, str)
        state = self.jobs[key]
        if refused.need_code != NeedCode.DRAINING and self.retries.hold(state):
            return True
        if state.phase is Phase.HELD:  # (held before the drain: held no more)
            self.retries.unhold(state, forget=False)
        self.retries.turn_away(key, attempt)
        return True

    def decided(self, state: JobState, outcome: intake.Outcome) -> None:
        """The ask's outcome on this wire: the job waits unanswered, starts, is refused for
        good, or yields."""
        req = state.final
        assert req is not None
        if isinstance(outcome, Waiting):
            if state.phase is Phase.HELD:  # (its place in admission's line stays)
                self.retries.unhold(state, Phase.WAITING, forget=False)
            elif state.phase is Phase.UPLOADING:
                state.move(Phase.WAITING)
            state.deadline = outcome.until
            self.owner.due(state.deadline)
        elif isinstance(outcome, Admitted):
            if state.phase is Phase.HELD:
                self.retries.unhold(state, Phase.RUNNING)
            else:
                state.move(Phase.RUNNING)
            state.deadline = float("inf")
            reservation, state.reservation = state.reservation, None
            self.admitted = state.ask.admitted(
                outcome, job=req.job, ttl_ms=req.ttl_ms, reservation=reservation
            )
        elif isinstance(outcome, Rejected):
            self.forget(req.job)
            if outcome.error is not None:
                self.wire.error(req, outcome.error, seq=final_seq(req))
            else:
                self.wire.abort(
                    req, outcome.need_code, ErrorCode.POLICY, outcome.detail, seq=final_seq(req)
                )
        else:
            self.yielded(req, state, outcome)

    def yielded(self, req: Request, state: JobState, decision: Yielded) -> None:
        """Answer ``yield``, the job kept for its retry already (:meth:`keep`): its payload
        held, or turned away."""
        held = state.phase is Phase.HELD
        if held:
            self.owner.expect_progress(state, decision.retry_hint_ms / 1000)
        elif self.jobs.get(req.job) is state:
            self.forget(req.job, gave_up=False)  # (turned away: remembered by its id)
        # On a fleet, the store places the job if its client goes where it is sent (a client
        # that cannot is not counted in another replica's line, and keeps its place here). A
        # newcomer's place is withdrawn while the store is asked, and taken again (at the
        # back) if the job stays: a job sent elsewhere then leaves no gap in the line that the
        # jobs refused after it were promised times behind.
        if decision.fleet_saturated is not None and state.fleet_wide:  # (a fleet's busy yield)
            newcomer = held and state.ask.attempt.refusals == 1
            answer = self._placed(req, state, held, newcomer)
            if intake.place(self.state, decision, answer, withdrawn=newcomer):
                if newcomer:
                    state.ask.forget()
                return
        self._send_yield(req, decision, held)

    def _placed(
        self, req: Request, state: JobState, held: bool, newcomer: bool
    ) -> Callable[[Yielded], None]:
        """The answer to a yield that waited for the fleet's word (owed to its frame even if
        the job went meanwhile: cancelled, its held payload then no longer held). A job sent
        to another replica keeps neither its payload nor a place in line here."""

        def answer(decision: Yielded) -> None:
            still = held and self.jobs.get(req.job) is state and state.phase is Phase.HELD
            if still and not decision.fleet_saturated:
                self.forget(req.job, gave_up=False)
                self.retries.turn_away(req.job, state.ask.attempt)
                still = False
            elif still and newcomer:
                decision = state.ask.place_again(decision)
            self._send_yield(req, decision, still)

        return answer

    def _send_yield(self, req: Request, decision: Yielded, held: bool) -> None:
        self.wire.yield_(
            req,
            decision,
            seq=final_seq(req),
            held=held,
            detail=yield_detail(decision.need_code, held),
        )

    def on_cancel(self, req: Request) -> None:
        """A cancel: a running job's terminal abort answers it; a waiting job's abort answers
        its payload; an uploading or held one is dropped."""
        state = self.jobs.get(req.job)
        if state is None:
            detail = f"no job {req.job!r} on this connection"
            self.wire.need(req, NeedCode.JOB_UNKNOWN, ErrorCode.BAD_ENVELOPE, detail)
        elif state.execution is not None:  # its terminal abort is the answer
            state.execution.abort(
                NeedCode.CANCELLED, ErrorCode.CANCELLED, "cancelled by the client"
            )
        elif state.phase is Phase.WAITING:  # as if running: the abort that answers its payload
            final = state.final
            assert final is not None
            self.forget(req.job)
            self.wire.abort(
                final,
                NeedCode.CANCELLED,
                ErrorCode.CANCELLED,
                "cancelled by the client while it waited for its turn",
                seq=final_seq(final),
            )
        else:  # uploading, or held after a yield: dropped
            self.forget(req.job)
            self.wire.abort(
                req,
                NeedCode.CANCELLED,
                ErrorCode.CANCELLED,
                "cancelled by the client before it ran",
            )

    def expired(self, job: str, state: JobState) -> None:
        """An upload that stalled, or a held payload whose client did not come back: dropped."""
        held = state.phase is Phase.HELD
        self.forget(job)
        why = (
            "the client did not come back for its held payload"
            if held
            else f"no chunk for {self.config.upload_timeout:g} s"
        )
        self.wire.abort_named(
            job,
            state.seq + 1,
            0,
            NeedCode.UPLOAD_TIMEOUT,
            ErrorCode.TIMEOUT,
            why + "; the payload was dropped",
        )


class JobReplies:
    """The :class:`~governor.execution.Replies` a connection's executions answer through: a
    running job's stream and terminal frame, its end, and the fleet's refusal of it."""

    def __init__(self, table: JobTable) -> None:
        self.table = table
        self.jobs = table.jobs
        self.id = table.id  # names the connection in the executions' logs
        self.wire = table.wire
        self.state = table.state

    def _final(self, execution: Running) -> Request:
        final = self.jobs[execution.job].final
        assert final is not None
        return final

    def send_delta(self, execution: Running, piece: Token | Relay) -> None:
        """The first sequence's text (with ``n`` above 1, the others' are in the result)."""
        if not isinstance(piece, Token) or piece.index or piece.tool is not None:
            return
        req = self._final(execution)
        # Small on purpose: no receipts on a stream frame.
        self.wire.send(
            Reply(
                Verb.CLARIFY,
                req.job,
                final_seq(req),
                Status.OK,
                ttl_ms=req.ttl_ms,
                delta=piece.text,
            )
        )

    def send_terminal(self, execution: Running, ending: Ending) -> None:
        req = self.jobs[execution.job].final
        assert req is not None
        held_ms = round((self.state.now() - execution.ticket.slot.started) * 1000)
        self.wire.send(
            self.wire.reply(
                req,
                Verb.CONFIRM,
                Status.DONE if ending.need_code is None else Status.ABORT,
                seq=req.seq + (1 if req.inline is not None else 2),  # (final_seq: hot path)
                need_code=ending.need_code,
                error_code=ending.error_code,
                detail=ending.detail,
                result=ending.result,
                extra=((Receipt.BACKEND_MS, held_ms),),
            )
        )

    def job_ended(self, execution: Running) -> None:
        state = self.jobs.get(execution.job)
        if state is not None and state.execution is execution:
            del self.jobs[execution.job]
            self.table.owner.idle_changed()

    def fleet_refused(self, execution: Execution, refusal: Refusal) -> None:
        """The fleet refused a job this replica admitted: its ticket is given back (the payload's
        buffers return to the job), and its client told to yield, as if refused here."""
        state = self.jobs.get(execution.job)
        gone = self.table.owner is GONE
        if gone or state is None or state.execution is not execution:  # (the connection is gone)
            intake.revoke(self.state, execution.attempt, execution.ticket, refusal)
            return
        decision, reservation = state.ask.take_back(execution.ticket, refusal, keep_payload=True)
        assert state.final is not None
        state.reservation = reservation
        state.execution = None
        self.table.owner.conversation.refused(state.ask, decision)
        self.table.yielded(state.final, state, decision)
