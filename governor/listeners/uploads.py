"""One TCP connection's jobs until they run: the job table, the payload frames (a manifest and
its chunks, or an inline payload), the bytes they hold, and the payloads kept after a yield.

A job id on a connection moves through phases, by this table alone (:data:`TRANSITIONS`)::

    (new) ──manifest or inline──▶ UPLOADING ──verified, admitted──▶ RUNNING ──ended──▶ (gone)
                                      │  ▲                             ▲
                       yielded, kept  ▼  │ a new manifest or payload   │ its retry admitted
                                     HELD ─────────────────────────────┘

A job not running leaves on an error, a cancel or a yield whose payload is not kept; a running
one leaves only when its execution has ended and given back its ticket.

No IO here either: replies go through the session's :class:`~governor.listeners.wire.Wire`, a
verified payload to the session (:meth:`Owner.complete`), and so does a job's first frame
(:meth:`Owner.new_job`: the key is checked there).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from protocol.codes import ErrorCode, NeedCode
from protocol.errors import ManifestInvalid, UploadNeed
from protocol.frames import Request
from protocol.upload import Upload

from ..core.admission import BUFFERS_FULL_HINT_MS, Attempt, Budget, Reservation
from ..core.tenants import Tenant
from ..execution import Execution
from ..state import ServerState
from .wire import Wire


class BuffersFull(Exception):
    """The server's payload buffers cannot take the bytes now: the job yields ``buffers_full``."""


class Phase(Enum):
    UPLOADING = "uploading"
    HELD = "held"  # a verified payload kept after a yield, for the client's retry
    RUNNING = "running"


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.UPLOADING: frozenset({Phase.UPLOADING, Phase.HELD, Phase.RUNNING}),
    Phase.HELD: frozenset({Phase.UPLOADING, Phase.RUNNING}),
    Phase.RUNNING: frozenset({Phase.HELD}),  # (the fleet refused it: Session.fleet_refused)
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
    # The frame that completed its payload, once admitted: the job's answers answer it.
    final: Request | None = None
    # Uploading: dropped unless a chunk comes by then; held: unless its client comes back.
    deadline: float = float("inf")
    seq: int = 0  # of its last frame

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

    wire: Wire

    def new_job(self, req: Request) -> JobState | None:
        """The key checked and the connection's bounds: a new job's state, or None (answered)."""
        ...

    def complete(self, req: Request, state: JobState, payload: bytes | None) -> None:
        """A verified payload to submit (None: the one held, returning for its retry)."""
        ...

    def expect_progress(self, state: JobState, wait_s: float = 0.0) -> None: ...

    def idle_changed(self) -> None: ...


class Uploads:
    def __init__(self, owner: Owner, state: ServerState) -> None:
        self.owner = owner
        self.wire = owner.wire
        self.state = state
        self.config = state.config
        self.jobs: dict[str, JobState] = {}
        self.buffers = Budget(state.config.max_conn_buffer_bytes)  # payload bytes on this conn
        self.held = 0  # payloads kept after a yield

    def add(self, job: str, tenant: Tenant) -> JobState:
        upload = Upload(self.config.max_payload_bytes, self.config.max_chunks)
        # (its deadline is set by what comes of its first frame: an accepted manifest, a hold)
        state = self.jobs[job] = JobState(upload, Attempt(tenant, None))
        return state

    def bytes_in(self, job: str) -> int:
        state = self.jobs.get(job)
        return 0 if state is None else state.upload.bytes_received

    # Frames --------------------------------------------------------------------------------

    def on_manifest(self, req: Request, state: JobState | None) -> None:
        assert req.manifest is not None
        if state is None:
            state = self.owner.new_job(req)
            if state is None:
                return
        elif state.phase is Phase.HELD:  # a new manifest replaces the payload held for a retry
            self.unhold(state)
        state.seq = req.seq
        try:
            manifest = state.upload.apply_manifest(req.manifest)
            self.reserve(state, manifest.total_bytes)
        except UploadNeed as exc:
            self.forget(req.job)
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
        state.seq = req.seq
        if state.phase is Phase.HELD and upload.is_final_chunk_again(req.chunk):
            # A retry after a yield: the payload was kept, so admission is tried again.
            self.owner.complete(req, state, None)
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
            self.owner.complete(req, state, payload)

    def on_inline(self, req: Request, state: JobState | None) -> None:
        assert req.inline is not None
        if state is None:
            state = self.owner.new_job(req)
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
            self.unhold(state)
        state.seq = req.seq
        try:  # (a returning payload is checked again: its digest alone proves nothing)
            payload = state.upload.apply_inline(req.inline)
            self.reserve(state, len(payload), held=len(payload))
        except UploadNeed as exc:
            self.forget(req.job)
            self.wire.error(req, exc)
            return
        except BuffersFull:
            self.buffers_full(req, final_seq(req))
            return
        self.owner.complete(req, state, None if returning else payload)

    # The bytes and the holds -----------------------------------------------------------------

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
        if not self.state.buffers.fits(declared):
            raise BuffersFull
        reservation = state.reservation = Reservation(self.buffers, self.state.buffers, declared)
        reservation.hold(held)

    def buffers_full(self, req: Request, seq: int) -> None:
        """Drop the job and tell its client to send it again later."""
        self.forget(req.job)
        self.wire.yield_(
            req,
            seq=seq,
            need_code=NeedCode.BUFFERS_FULL,
            error_code=ErrorCode.BUSY,
            retry_hint_ms=BUFFERS_FULL_HINT_MS,
            held=False,
            detail="the server's payload buffers are full; send the payload again later",
        )

    def hold(self, state: JobState) -> bool:
        """Keep a refused payload for the client's retry, within this connection's bound."""
        if state.phase is Phase.HELD:
            return True
        if self.held >= self.config.held_payloads_per_conn:
            return False
        state.move(Phase.HELD)
        self.held += 1
        state.attempt.tenant.waiting += 1
        return True

    def unhold(self, state: JobState) -> None:
        state.move(Phase.UPLOADING)
        self.held -= 1
        state.attempt.tenant.waiting -= 1
        self.state.admission.forget(state.attempt)

    def forget(self, job: str) -> None:
        """Drop a job that is not running: its hold, its place in line, its buffers."""
        state = self.jobs.pop(job)
        assert state.execution is None
        if state.phase is Phase.HELD:
            self.unhold(state)  # (and its place in line: only a held job has one)
        if state.reservation is not None:
            state.reservation.release()
        self.owner.idle_changed()

    @staticmethod
    def _is_final(state: JobState) -> bool:
        """Whether the next chunk would complete the upload."""
        manifest = state.upload.manifest
        return manifest is not None and state.upload.chunks_received + 1 >= manifest.chunks
