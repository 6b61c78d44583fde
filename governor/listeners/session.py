"""One connection's protocol session, with no IO: bytes in, frames out, admitted jobs as events.

As in h11's ``Connection``, nothing here touches a socket or the event loop:
:meth:`Session.receive_data` takes bytes and answers through the :class:`Connection` it was
given (its ``write`` and ``close``). Each line is decoded, its upload advanced (:mod:`.jobs`) and, when
a payload is complete, submitted to the intake (:mod:`governor.intake`) before the next line is
looked at. A job admitted comes out of :meth:`Session.next_event` as a
:class:`~governor.intake.JobAdmitted`, and no line is handled until the listener has started it
(:meth:`Session.started`), so that a frame behind it (a cancel, say) finds it running. A job
waiting in line (its frame asked with ``max_wait_ms``) may be admitted between reads, when the
line offers it a freed slot: the session then calls its connection's ``wake`` (the listener
takes the event).

Sequence numbers: an answer to a frame has the frame's ``seq`` + 1, but every answer to a
frame that completes a payload (its yield, its stream, its terminal frame) has the final
chunk's ``seq`` + 2 (v0), or an inline payload's + 1; a bad line is answered with the last
valid frame's job and ``seq`` + 1.
"""

from __future__ import annotations

from typing import Protocol

from protocol.codes import UNKNOWN_JOB, ErrorCode, NeedCode, Status, Verb
from protocol.errors import LineTooLong, RemoteProtocolError
from protocol.frames import Request, decode_request
from protocol.lines import LineReader

from .. import intake
from ..core.sources import KEY_TURN_FAR
from ..execution import Running
from ..intake import KeyStep
from ..state import ServerState
from .jobs import JobState, JobTable, Phase
from .wire import NO_UPLOADS, Wire

# Lines one connection has handled before the others get a turn: a client pipelining thousands
# of frames delays another's ping by one turn of each busy connection, not by all its frames.
LINES_PER_TURN = 64


# What keeps a connection from being idle. A held payload too, bounded by its own deadline (its
# hint and upload_timeout): a client told to come back in 60 s, the longest hint, found its
# payload gone with its connection at the idle timeout's 60 s.
_BUSY = frozenset({Phase.RUNNING, Phase.WAITING, Phase.HELD})


class Connection(Protocol):
    """What a session asks of its connection (the listener's protocol, or a test's)."""

    def write(self, data: bytes) -> None: ...

    def close(self) -> None:
        """Close after the replies written so far."""
        ...

    def wake(self) -> None:
        """An event came between reads (a waiting job admitted): take it, keep the deadline."""
        ...


class _Gone:
    """The connection of a session whose client has gone: its running jobs' last replies go
    nowhere (as they would on the closed transport)."""

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass

    def wake(self) -> None:
        pass


GONE = _Gone()


class Session:
    """One connection's protocol state: its jobs (:attr:`table`) and its deadlines
    (:meth:`next_deadline`, :meth:`expire`): no frame for ``idle_timeout`` while nothing runs;
    with tenants declared, no valid key within ``auth_grace``; and each job's own: an upload
    with no new chunk for ``upload_timeout``, a held payload whose client has not come back
    within its hint and ``upload_timeout`` more. Pings and other jobs' frames keep the
    connection, never an upload.

    Keys (:class:`~governor.intake.Credentials`): a key the connection shows for the first time
    is checked when its source's budget of failures allows; until its turn the frame waits
    (:attr:`deferred`) and so do the lines behind it. The connection is *idle* (:attr:`is_idle`,
    to be displaced at a limit) while it has no job and, with tenants declared, has shown no
    valid key.
    """

    def __init__(self, state: ServerState, conn: Connection, conn_id: int) -> None:
        self.state = state
        self.config = config = state.config
        self.clock = state.admission.clock
        self.id = conn_id  # names the connection in logs
        self._conn = conn
        self._handling = False  # in receive_data or expire: an event admitted is seen there
        self.wire = Wire(state, conn)
        self.table = JobTable(self, self.wire, state, conn_id)
        self.wire.uploads = self.table  # (the table needs the wire first)
        self.credentials = intake.Credentials(state, conn_id)
        # The intake's steps in order (made when a frame asks: none on an idle connection).
        self._conversation: intake.Conversation | None = None
        self.deferred: Request | None = None  # a frame whose key waits for its turn
        self.jobs = self.table.jobs
        self.reader = LineReader(config.max_line_bytes)
        self.lines = 0  # lines received
        self._turn_ends = LINES_PER_TURN
        self._cut_short = False  # the last turn stopped at an admission: it goes on
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
        self.idle = True  # as last told to the sources
        # The earliest deadline set since the connection last asked (None: none earlier).
        self.sooner: float | None = None

    @property
    def source(self) -> str:
        return self.credentials.source

    @property
    def conversation(self) -> intake.Conversation:
        if self._conversation is None:
            self._conversation = intake.Conversation(self.state, self.credentials, self.table, self)
        return self._conversation

    @property
    def busy(self) -> int:
        """Jobs running, waiting in line or held for a retry (the connection is not idle)."""
        return sum(1 for s in self.jobs.values() if s.phase in _BUSY)

    @property
    def is_idle(self) -> bool:
        """Nothing in flight and, with tenants declared, no valid key shown."""
        return not self.jobs and (self.state.tenants.open or not self.credentials.authenticated)

    def idle_changed(self) -> None:
        idle = self.is_idle
        if idle != self.idle:
            self.idle = idle
            self.state.connections.sources.idle(self, idle)

    # Events from the connection ----------------------------------------------------------

    def receive_data(self, data: bytes) -> bool:
        """Bytes from the client: its whole lines are handled, :data:`LINES_PER_TURN` at most.
        True when lines may remain: call again (with ``b""``) once other connections have had
        their turn. None is handled while the client does not read its replies
        (:attr:`paused`: they wait for :meth:`resume`), nor while a job admitted waits in
        :meth:`next_event` (the same turn goes on once it has been started)."""
        reader = self.reader
        if data:
            reader.feed(data)
        lines = self.lines
        if not self._cut_short:
            self._turn_ends = lines + LINES_PER_TURN
        self._handling = True
        try:
            while (
                self.lines < self._turn_ends
                and not (self.closed or self.paused or self.deferred or self.table.admitted)
                and (line := reader.next_line()) is not None
            ):
                self.lines += 1
                if line.strip():
                    self._handle_line(line)
        except LineTooLong as exc:
            self.fatal(exc.need_code, exc.error_code, exc.detail)
        finally:
            self._handling = False
        self._cut_short = self.table.admitted is not None
        if self.lines != lines:  # a whole line is a live client; a trickle of bytes is not
            self.last_frame_at = self.clock()
        return self.lines >= self._turn_ends and not (self.closed or self._cut_short)

    def next_event(self) -> intake.JobAdmitted | None:
        """A job admitted, for the listener to start (:func:`governor.execution.start`) and hand
        back (:meth:`started`) before more lines are handled; None: none."""
        return self.table.admitted

    def started(self, execution: Running) -> None:
        """The job :meth:`next_event` gave out runs: its frames answer through this session."""
        assert self.table.admitted is not None
        assert self.table.admitted.job == execution.job
        self.table.admitted = None
        self.jobs[execution.job].execution = execution
        self.table.answer_decided(self.conversation)  # (what was decided behind it)

    def pause(self) -> None:
        """The client has stopped reading its replies: stop handling its lines."""
        self.paused = True

    def resume(self) -> None:
        """It reads again: the lines that waited are handled at the next :meth:`receive_data`."""
        self.paused = False

    def next_deadline(self, now: float) -> float:
        """When :meth:`expire` next has something to do. While a job runs the idle timeout
        waits: it is looked at again an ``idle_timeout`` later."""
        config = self.config
        deadline = self.last_frame_at + config.idle_timeout
        if deadline <= now and self.busy:
            deadline = now + config.idle_timeout
        if not self.credentials.authenticated:
            deadline = min(deadline, self.opened_at + config.auth_grace)
        if self.credentials.waiting:
            deadline = min(deadline, self.credentials.key_at)
        for state in self.jobs.values():
            deadline = min(deadline, state.deadline)
        return deadline

    def expire(self, now: float) -> bool:
        """End what has outlived its deadline: the connection, or a job's upload or hold; decide
        a waiting job again at its hint; and handle a frame whose key's turn has come. True when
        an event or lines may wait (call :meth:`receive_data` with ``b""``, after
        :meth:`next_event`)."""
        if self.closed:
            return False
        self._handling = True
        try:
            return self._expire(now)
        finally:
            self._handling = False

    def _expire(self, now: float) -> bool:
        config = self.config
        if not self.credentials.authenticated and now >= self.opened_at + config.auth_grace:
            self.fatal(
                NeedCode.UNAUTHORIZED,
                ErrorCode.UNAUTHORIZED,
                f"no valid api_key within {config.auth_grace:g} s",
            )
            return False
        if now >= self.last_frame_at + config.idle_timeout and not self.busy:
            timeout = config.idle_timeout
            self.fatal(NeedCode.IDLE_TIMEOUT, ErrorCode.TIMEOUT, f"no frame for {timeout:g} s")
            return False
        deferred, went_on = self.deferred, False
        if deferred is not None and self.conversation.turn_came(now):
            self.deferred, went_on = None, True  # (no line was handled meanwhile)
            self.idle_changed()
            self._handle(deferred)
        for job, state in list(self.jobs.items()):
            if state.deadline > now or self.jobs.get(job) is not state:
                continue
            if state.phase is Phase.WAITING:
                self.table.decide_again(job)
            else:
                self.table.expired(job, state)
        return (went_on or self.table.admitted is not None) and not self.closed

    def woken(self) -> None:
        """The conversation decided a waiting job the line offered a slot: answered, and the
        listener woken to start it if admitted (unless it is handling this session now)."""
        self.table.answer_decided(self.conversation)
        if not self._handling and (self.table.admitted is not None or self.sooner is not None):
            self._conn.wake()  # (a job to start, or its next decision's deadline to keep)

    def expect_progress(self, state: JobState, wait_s: float = 0.0) -> None:
        """The job is dropped unless it moves on within ``wait_s`` + ``upload_timeout``."""
        state.deadline = self.clock() + wait_s + self.config.upload_timeout
        self.due(state.deadline)

    def due(self, deadline: float) -> None:
        """A new deadline: the listener moves its timer if it comes before the one it has."""
        if self.sooner is None or deadline < self.sooner:
            self.sooner = deadline

    def connection_lost(self) -> None:
        """The client is gone: stop its work now; each execution gives back its own ticket."""
        self.closed = True
        self.deferred = None
        self.credentials.turn_unused()
        if self._conversation is not None:
            self._conversation.left()
            self._conversation = None
        self.table.client_gone()
        # (the table lets go of the session, the session of its connection: see client_gone)
        self._conn = self.wire.out = GONE
        self.wire.uploads = NO_UPLOADS

    def displace(self, detail: str) -> None:
        """Make way for a new connection at a limit (only an idle one is asked to)."""
        self.fatal(NeedCode.DISPLACED, ErrorCode.QUOTA, detail)

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
            seq = self.last_seq + 1 if seq is None else seq
            self.wire.abort_named(
                job or self.last_job, seq, self.last_ttl_ms, need_code, error_code, detail
            )
        self.table.abort_running(need_code, error_code, "the connection is closing: " + detail)
        self.closed = True
        self._conn.close()

    # Frames ------------------------------------------------------------------------------

    def _handle_line(self, line: bytes) -> None:
        try:
            req = decode_request(line)
        except RemoteProtocolError as exc:
            self.wire.bad_line(exc, self.last_job, self.last_seq, self.last_ttl_ms)
            return
        self.last_job, self.last_seq, self.last_ttl_ms = req.job, req.seq, req.ttl_ms
        key = req.api_key
        if key is not None and self._looks_up(req):
            step = self.conversation.asked(key)
            self.idle_changed()
            if step is KeyStep.FAR:  # the guessers' turns are many: refused for now, unchecked
                if req.verb != Verb.PING:
                    self.wire.abort(
                        req, NeedCode.UNAUTHORIZED, ErrorCode.UNAUTHORIZED, KEY_TURN_FAR
                    )
                    return
            elif step is KeyStep.LATER:  # the source's failures are spent: it waits its turn
                self.deferred = req
                self.due(self.credentials.key_at)
                return
        self._handle(req)

    def _looks_up(self, req: Request) -> bool:
        """Whether ``req``'s key is looked up: an unauthenticated ping's, a new job's."""
        if req.verb == Verb.PING:
            return not self.credentials.authenticated
        return req.verb == Verb.SHARE and req.chunk is None and req.job not in self.jobs

    def _handle(self, req: Request) -> None:
        if req.verb == Verb.PING:
            receipts = self.state.ping_receipts()
            self.wire.send(self.wire.reply(req, Verb.CONFIRM, Status.OK, extra=receipts))
            return
        if req.verb == Verb.CANCEL:
            self.table.on_cancel(req)
            return
        state = self.jobs.get(req.job)
        if state is not None and state.phase is Phase.RUNNING:
            self.wire.need(
                req,
                NeedCode.JOB_RUNNING,
                ErrorCode.CONFLICT,
                f"job {req.job!r} is running; use another job id",
            )
        elif req.manifest is not None:
            self.table.uploads.on_manifest(req, state)
        elif req.chunk is not None:
            self.table.uploads.on_chunk(req, state)
        else:
            self.table.uploads.on_inline(req, state)
