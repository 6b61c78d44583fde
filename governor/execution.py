"""One admitted job's run: the runner's events, the stream, the one terminal frame, the release.

An :class:`Execution` is made the moment admission issues its ticket, and makes its task and
that task's done-callback in the same synchronous step, so the ticket is given back by
:meth:`Execution._ended` whatever ends the task: the runner finishing or failing, ``ttl_ms``,
a cancel (the client's, a fatal frame's, a drain's), the client leaving, or a cancel that
comes before the task's first step, which no ``finally`` inside the coroutine would see.

Every admitted job gets exactly one terminal frame (``confirm done`` or ``confirm abort``)
while its client is there to read it: :meth:`Execution.end` sends it once, and a task that
ended without one (the server closing it, say) gets an abort from the done-callback.

Timings have one definition, here: time to first token from admission (the slot's start) to
the first generated text; time per output token the rest of the job's time over the output
tokens after the first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from protocol.codes import ErrorCode, NeedCode

from .core.admission import BACKEND_FAILURES, Attempt, Ticket
from .core.ledger import Completed, Refusal
from .core.policy import Lane
from .core.slo import judge, share
from .intake import JobAdmitted
from .runners import Fed, Finished, Forwarding, Relay, Relayed, RunnerError, Token
from .runners.base import Resume
from .state import ServerState
from .telemetry.logs import event

if TYPE_CHECKING:
    from .core.overload import OverloadController
    from .fleetstore import Fleet

# Ends judged against the objectives as misses (see governor.core.slo); "done" is judged too.
JUDGED_FAILURES = BACKEND_FAILURES | {NeedCode.TTL_EXPIRED}

log = logging.getLogger("governor.execution")
jobs_log = logging.getLogger("governor.jobs")


@dataclass(frozen=True, slots=True)
class Ending:
    """A job's terminal frame: ``confirm done`` with its result, or without a ``need_code``
    ``confirm abort``."""

    need_code: str | None = None
    error_code: str | None = None
    detail: str | None = None
    result: dict[str, Any] | None = None
    relayed: Relayed | None = None  # a forwarding runner's upstream answer, to pass on


class Running(Protocol):
    """What a door holds of a running job (an :class:`Execution`; a test's stand-in): its
    name, its ticket, whether its terminal frame went out, and the two ways to stop it. (A
    protocol, not the class: the doors' compiled code checks a class's instances at run time.)"""

    job: str
    ticket: Ticket
    terminal_sent: bool

    def abort(self, need_code: NeedCode, error_code: ErrorCode, detail: str) -> None: ...

    def client_gone(self) -> None: ...


class Replies(Protocol):
    """Where a job's frames go: the session that admitted it (``id`` names it in logs)."""

    id: int

    def send_delta(self, execution: Execution, piece: Token | Relay) -> None:
        """A piece of a streamed answer: generated text, or (a forwarded request's) an upstream
        event that carries none."""

    def send_terminal(self, execution: Execution, ending: Ending) -> None: ...

    def job_ended(self, execution: Execution) -> None: ...

    def fleet_refused(self, execution: Execution, refusal: Refusal) -> None: ...


def timings(
    started: float, first_token: float | None, ended: float, completion_tokens: object
) -> tuple[float | None, float | None]:
    """(time to first token, time per output token) in seconds; None where undefined."""
    if first_token is None:
        return None, None
    ttft = first_token - started
    if isinstance(completion_tokens, int) and completion_tokens > 1:
        return ttft, (ended - first_token) / (completion_tokens - 1)
    return ttft, None


class Execution:
    __slots__ = (
        "attempt",
        "first_token",
        "job",
        "outcome",
        "parts",
        "pieces",
        "replies",
        "result",
        "resumes",
        "state",
        "streams",
        "task",
        "terminal_sent",
        "ticket",
        "tpot_s",
        "ttl_ms",
        "waited_s",
    )

    def __init__(
        self,
        state: ServerState,
        ticket: Ticket,
        attempt: Attempt,
        replies: Replies,
        waited_s: float | None,
        *,
        job: str,
        ttl_ms: int,
    ) -> None:
        self.state = state
        self.ticket = ticket
        self.job = job  # the client's name for the job (its ticket's job id is the server's)
        self.ttl_ms = ttl_ms  # the job's deadline from admission; 0: none
        self.attempt = attempt
        self.replies = replies
        self.waited_s = waited_s  # from its first refusal to its admission
        self.first_token: float | None = None
        self.tpot_s: float | None = None  # once it finished
        spec = ticket.job.spec
        self.streams = spec is not None and spec.stream  # its client asked for a stream
        self.parts: list[str] = []  # its first sequence's text, as it came
        self.result: dict[str, Any] | None = None
        self.resumes: Sequence[Resume] = ()  # its runner's measure of each resume
        self.pieces: Sequence[float] = ()  # and of each prompt piece sent ahead
        self.terminal_sent = False
        self.outcome = "cancelled"  # "done", a need_code, or "client_gone"
        # The task and the callback that releases its ticket, in one step: nothing can run
        # between them, so no cancel can come before the callback is there.
        self.task = asyncio.get_running_loop().create_task(self._run())
        self.task.add_done_callback(self._ended)
        state.jobs.started(self.task)

    # Ending it ---------------------------------------------------------------------------

    def end(
        self,
        *,
        need_code: str | None = None,
        error_code: str | None = None,
        detail: str | None = None,
        result: dict[str, Any] | None = None,
        relayed: Relayed | None = None,
    ) -> None:
        """The job's one terminal frame: done without a ``need_code``, abort with one."""
        if self.terminal_sent:
            return
        self.terminal_sent = True
        self.outcome = need_code or "done"
        self.replies.send_terminal(self, Ending(need_code, error_code, detail, result, relayed))

    def abort(self, need_code: NeedCode, error_code: ErrorCode, detail: str) -> None:
        """Send the terminal abort now, then stop the work."""
        self.end(need_code=need_code, error_code=error_code, detail=detail)
        self.task.cancel()

    def client_gone(self) -> None:
        """Nobody is left to tell: stop the work."""
        if not self.terminal_sent:
            self.terminal_sent = True
            self.outcome = "client_gone"
        self.task.cancel()

    # The run -----------------------------------------------------------------------------

    async def _run(self) -> None:
        fleet = self.state.fleet
        if fleet is not None and not await self._fleet_admits(fleet):
            return
        ttl_ms = self.ttl_ms
        try:
            if ttl_ms:
                async with asyncio.timeout(ttl_ms / 1000):
                    result, relayed = await self._execute()
            else:  # (no deadline: no timeout context to set up for every job)
                result, relayed = await self._execute()
        except TimeoutError:
            self.end(
                need_code=NeedCode.TTL_EXPIRED,
                error_code=ErrorCode.TIMEOUT,
                detail=f"ttl_ms of {ttl_ms} ran out",
            )
        except RunnerError as exc:
            self.end(
                need_code=exc.code,
                error_code=ErrorCode.BACKEND_ERROR,
                detail=exc.detail,
                relayed=exc.relayed,
            )
        except Exception:
            log.exception("runner failed on job %r", self.ticket.job.id)
            self.end(
                need_code=NeedCode.BACKEND_ERROR,
                error_code=ErrorCode.BACKEND_ERROR,
                detail="the runner failed unexpectedly",
            )
        else:
            self.result = result
            self.end(result=result, relayed=relayed)

    async def _fleet_admits(self, fleet: Fleet) -> bool:
        """The fleet's step, after this replica's own admission: the job holds a lease, or the
        admission is taken back and its client told to yield (no terminal frame: it did not
        run)."""
        ticket = self.ticket
        lease = fleet.gate.lease(ticket.tenant.name, ticket.lane)
        try:
            refusal = await fleet.admit(
                lease,
                ticket.tenant.config,
                ticket.tokens,
                ticket.slot.expected_s,
                ticket.pool.ledger.next_end_ms,  # (a walk of the running slots: only if needed)
            )
        except BaseException:  # cancelled while asking: the store may have granted it
            fleet.release(lease)
            raise
        if refusal is None:
            ticket.lease = lease
            return True
        self.terminal_sent = True
        self.outcome = "revoked"
        self.replies.fleet_refused(self, refusal)
        return False

    async def _execute(self) -> tuple[dict[str, Any], Relayed | None]:
        job, runner = self.ticket.job, self.ticket.pool.runner
        if job.spec is not None and job.spec.forward is not None:
            assert isinstance(runner, Forwarding)
            # Pushed, not pulled: a relayed stream's pieces are handled as they arrive.
            return self._finished(await runner.push(job, self._piece))
        # aclosing: the runner's clean-up runs now, not whenever the generator is collected.
        async with contextlib.aclosing(runner.run(job)) as events:
            async for item in events:
                if isinstance(item, Finished):
                    return self._finished(item)
                self._piece(item)
        raise RunnerError("the runner ended the job without finishing it")

    def _piece(self, item: Token | Fed | Relay) -> None:
        """A piece of the job's output, or of its progress: timed, and streamed."""
        ticket, state = self.ticket, self.state
        if isinstance(item, Token):
            now = state.jobs.last_token_at = state.now()
            if self.first_token is None:
                self.first_token = now
                ticket.slot.begin(now)
                self._first_token(now - ticket.slot.started)
            elif item.generated is not None:
                ticket.slot.progress(item.generated, now)
            if item.index == 0 and item.tool is None:
                self.parts.append(item.text)
        elif isinstance(item, Fed):
            ticket.slot.feeding(item.tokens, state.now())
            return
        if self.streams and not self.terminal_sent:
            self.replies.send_delta(self, item)

    def _finished(self, item: Finished) -> tuple[dict[str, Any], Relayed | None]:
        """The job's result, with the governor's own timings and the ladder's steps."""
        ticket, parts = self.ticket, self.parts
        self.resumes, self.pieces = item.resumes, item.pieces
        result = dict(item.result)
        if parts:
            result.setdefault("text", "".join(parts))
            ttft_s, self.tpot_s = timings(
                ticket.slot.started,
                self.first_token,
                self.state.now(),
                result.get("completion_tokens"),
            )
            result["ttft_ms"] = _ms(ttft_s)
            result["tpot_ms"] = _ms(self.tpot_s)
        if ticket.degraded:
            result["degraded"] = list(ticket.degraded)
        return result, item.relayed

    def _first_token(self, ttft_s: float) -> None:
        """Interactive time to first token feeds the overload state, against the job's
        objective, as its client saw it: from its first refusal, if it was refused (a chat held
        in line for seconds by heavy work is the overload the pauses are for, however fast it
        runs once admitted)."""
        if (overload := interactive_overload(self.state, self.ticket)) is not None:
            ttft = share((self.waited_s or 0.0) + ttft_s, self.ticket.objectives.ttft_ms)
            if ttft is not None:
                overload.observe_ttft(ttft)

    # The end, whatever it was ------------------------------------------------------------

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The done-callback: the terminal frame if none went out, the release, the record."""
        if not self.terminal_sent:
            self.end(
                need_code=NeedCode.SHUTDOWN,
                error_code=ErrorCode.UNAVAILABLE,
                detail="the job was stopped before it finished",
            )
        ticket, result = self.ticket, self.result
        if ticket.lease is not None:
            fleet = self.state.fleet
            assert fleet is not None
            fleet.release(ticket.lease)
        if self.outcome == "revoked":  # (the session gave the ticket back and sent a yield)
            self.replies.job_ended(self)
            self.state.jobs.ended(task)
            return
        prompt = completion = None
        if result is not None:
            prompt, completion = result.get("prompt_tokens"), result.get("completion_tokens")
        ttft_s = None if self.first_token is None else self.first_token - ticket.slot.started
        done = Completed(
            prompt_tokens=prompt if isinstance(prompt, int) else None,
            completion_tokens=completion if isinstance(completion, int) else None,
            ttft_s=ttft_s,
        )
        held_s = ticket.release(self.outcome, done)
        self.replies.job_ended(self)
        self.state.released(task, ticket)
        self._record(held_s, ttft_s, prompt, completion)

    def _record(
        self, held_s: float, ttft_s: float | None, prompt: object, completion: object
    ) -> None:
        """The job's measurements, its objectives judged, and its one log line."""
        ticket, metrics = self.ticket, self.state.metrics
        lane, outcome = ticket.lane, self.outcome
        metrics.finished[(outcome, lane, ticket.pool.name)] += 1
        tpot_s = self.tpot_s
        metrics.observe_job(lane, held_s, ttft_s, tpot_s, prompt, completion)
        for resume in self.resumes:
            metrics.resumes.observe(lane, resume.first_token_s, resume.recomputed)
        for seconds in self.pieces:
            metrics.prompt_pieces.observe(lane, seconds)
        objectives, verdict = ticket.objectives, None
        if outcome == "done" or outcome in JUDGED_FAILURES:
            # TTFT as the client felt it: its wait in line too; a job with no text, its end.
            felt_s = (self.waited_s or 0.0) + (held_s if ttft_s is None else ttft_s)
            verdict = judge(objectives, ttft_s=felt_s, tpot_s=tpot_s, succeeded=outcome == "done")
            self.state.slo.record(lane, verdict)
            tpot = share(tpot_s, objectives.tpot_ms)
            if (
                tpot is not None
                and (overload := interactive_overload(self.state, self.ticket)) is not None
            ):
                overload.observe_tpot(tpot)
        if not jobs_log.isEnabledFor(logging.INFO):
            return
        event(
            jobs_log,
            logging.INFO,
            f"job {outcome}",
            event="job",
            conn=self.replies.id,
            job=self.job,
            tenant=ticket.tenant.name,
            lane=lane,
            pool=ticket.pool.name,
            outcome=outcome,
            degraded=list(ticket.degraded),
            yields=self.attempt.refusals,
            suspended=ticket.slot.pause.suspensions if ticket.slot.pause is not None else 0,
            resume_ms=[_ms(r.first_token_s) for r in self.resumes] or None,
            resume_recomputed=[r.recomputed for r in self.resumes] or None,
            prompt_pieces=len(self.pieces) or None,
            wait_ms=_ms(self.waited_s),
            expected_ms=_ms(ticket.slot.expected_s),
            ttft_ms=_ms(ttft_s),
            tpot_ms=_ms(tpot_s),
            e2e_ms=_ms(held_s),
            prompt_tokens=prompt,
            completion_tokens=completion,
            slo_ttft_ms=objectives.ttft_ms or None,
            slo_tpot_ms=objectives.tpot_ms or None,
            met_ttft=None if verdict is None else verdict.ttft,
            met_tpot=None if verdict is None else verdict.tpot,
            good=None if verdict is None else verdict.good,
        )


def interactive_overload(state: ServerState, ticket: Ticket) -> OverloadController | None:
    """The overload states, for an interactive job (they watch its objectives)."""
    overload, demand = state.overload, ticket.demand
    if overload is not None and demand is not None and demand.lane == Lane.INTERACTIVE:
        return overload
    return None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def start(state: ServerState, job: JobAdmitted, replies: Replies) -> Execution:
    """Run an admitted job: its task and the done-callback that releases its ticket."""
    return Execution(
        state, job.ticket, job.attempt, replies, job.waited_s, job=job.job, ttl_ms=job.ttl_ms
    )
