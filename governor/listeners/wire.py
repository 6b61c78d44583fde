"""The TCP session's replies: built from the frame they answer, written, and counted.

Every reply carries the server's receipts and ``cdr.bytes_in`` (its job's payload bytes
received so far); every ``confirm abort`` with a need code is counted here, once, in
``governor_aborts_total``.
"""

from __future__ import annotations

from typing import Any, Protocol

from protocol.codes import NeedCode, Receipt, Status, Verb
from protocol.errors import EnvelopeInvalid, RemoteProtocolError
from protocol.frames import Reply, Request, encode_reply, error_reply

from ..core.admission import Yielded
from ..state import ServerState


class Writer(Protocol):
    """Where the replies go: the connection (the listener's, or a test's)."""

    def write(self, data: bytes) -> None: ...


class Uploads(Protocol):
    """What the replies say of a job's upload: its payload bytes received so far."""

    def bytes_in(self, job: str) -> int: ...


class _NoUploads:
    def bytes_in(self, job: str) -> int:
        return 0


NO_UPLOADS = _NoUploads()


class Wire:
    def __init__(self, state: ServerState, out: Writer) -> None:
        self.state = state
        self.out = out
        self.uploads: Uploads = NO_UPLOADS  # (the session's job table, once it has one)

    def bytes_in(self, job: str) -> int:
        return self.uploads.bytes_in(job)

    def send(self, reply: Reply) -> None:
        if reply.status == Status.ABORT and reply.need_code is not None:
            self.state.metrics.aborts[reply.need_code] += 1
        self.out.write(encode_reply(reply))

    def receipts(self, bytes_in: int = 0) -> tuple[tuple[str, int], ...]:
        return (*self.state.receipts(), (Receipt.BYTES_IN, bytes_in))

    def reply(
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
        """A reply to ``req``, by default with its ``seq`` + 1."""
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
            receipts=(*self.receipts(self.bytes_in(req.job)), *extra),
            result=result,
        )

    def ok(self, req: Request) -> None:
        self.send(self.reply(req, Verb.CLARIFY, Status.OK))

    def need(self, req: Request, need_code: str, error_code: str, detail: str) -> None:
        self.send(
            self.reply(
                req,
                Verb.CLARIFY,
                Status.NEED,
                need_code=need_code,
                error_code=error_code,
                detail=detail,
            )
        )

    def abort(
        self, req: Request, need_code: str, error_code: str, detail: str, *, seq: int | None = None
    ) -> None:
        self.send(
            self.reply(
                req,
                Verb.CONFIRM,
                Status.ABORT,
                seq=seq,
                need_code=need_code,
                error_code=error_code,
                detail=detail,
            )
        )

    def abort_named(
        self, job: str, seq: int, ttl_ms: int, need_code: str, error_code: str, detail: str
    ) -> None:
        """``confirm abort`` naming ``job`` and ``seq`` without a frame to answer: the
        connection's own (a fatal error, a deadline), or a job's dropped at its deadline."""
        self.send(
            Reply(
                Verb.CONFIRM,
                job,
                seq,
                Status.ABORT,
                ttl_ms=ttl_ms,
                need_code=need_code,
                error_code=error_code,
                detail=detail,
                receipts=self.receipts(),
            )
        )

    def error(self, req: Request, exc: RemoteProtocolError, *, seq: int | None = None) -> None:
        """The error's own reply (its codes and detail) to ``req``."""
        receipts = self.receipts(self.bytes_in(req.job))
        seq = req.seq + 1 if seq is None else seq
        self.send(error_reply(exc, req.job, seq, req.ttl_ms, receipts))

    def bad_line(self, exc: RemoteProtocolError, job: str, seq: int, ttl_ms: int) -> None:
        """A line that is no valid frame, counted and answered with its error: for the job and
        ``seq`` + 1 it names itself, else (``job``, ``seq``) the last valid frame's."""
        self.state.metrics.bad_frames[exc.need_code] += 1
        if isinstance(exc, EnvelopeInvalid):
            job = exc.job or job
            seq = seq if exc.seq is None else exc.seq
        self.send(error_reply(exc, job, seq + 1, ttl_ms, self.receipts()))

    def yield_(self, req: Request, decision: Yielded, *, seq: int, held: bool, detail: str) -> None:
        """``clarify yield``: come back after the hint; ``held``, the payload was kept. Its
        receipts say what bound refused it and, when it waits on a slot, the hint's parts."""
        hint_ms = decision.retry_hint_ms
        reply = self.reply(
            req,
            Verb.CLARIFY,
            Status.YIELD,
            seq=seq,
            need_code=decision.need_code,
            error_code=decision.error_code,
            retry_hint_ms=hint_ms,
            detail=detail,
            extra=(
                (Receipt.RETRY_HINT_MS, hint_ms),
                (Receipt.PAYLOAD_HELD, int(held)),
                *refusal_receipts(decision),
            ),
        )
        if decision.fleet_elsewhere is not None:  # (the store's word: go there now)
            reply.elsewhere = decision.fleet_elsewhere
        self.send(reply)


def refusal_receipts(decision: Yielded) -> tuple[tuple[str, int], ...]:
    """A yield's bound (``bound.NAME``: 1), whether it speaks for the fleet
    (``fleet.saturated``: 1) and, when it waits on a slot, its hint's parts."""
    bound: tuple[tuple[str, int], ...] = ((f"{Receipt.BOUND}.{decision.what_bound}", 1),)
    if decision.fleet_saturated:
        bound += ((Receipt.FLEET_SATURATED, 1),)
    parts = decision.parts
    if parts is None:
        return bound
    return (
        *bound,
        (Receipt.HINT_RELEASE_MS, parts.release_ms),
        (Receipt.HINT_TURNS_MS, parts.turns_ms),
        (Receipt.HINT_AHEAD, parts.ahead),
    )


def yield_detail(need_code: str, held: bool) -> str:
    """An admission yield's sentence for people: what it means for the job (a ``draining``
    one's hint is how soon to go to another replica, not when to come back)."""
    if need_code == NeedCode.DRAINING:  # (never held: a draining governor admits no job again)
        return (
            "this replica is draining: it admits no new job again; send the job to another "
            "replica after retry_hint_ms"
        )
    if held:
        return "no execution slot free; resend the final chunk after retry_hint_ms"
    return "no execution slot free, and the payload was not kept; resend it"
