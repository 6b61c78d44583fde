"""One client connection: bytes in, frames through the codec, replies out.

The protocol handling is synchronous inside ``data_received``: a line is decoded, its upload
advanced and, when a payload completes, admission decided, all before the next line is
looked at. Only execution is asynchronous: an admitted job runs in a task owned by this
connection (and tracked by the server), so a connection's running job never blocks its other
frames, pings included.

Every admitted job ends with exactly one terminal frame (``confirm done`` or ``confirm
abort``) unless the client is gone, and its slot is released in ``finally`` on every path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

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

from .ledger import Promise, Refusal, Slot
from .logs import event
from .metrics import NO_LANE
from .overload import OverloadController, State
from .policy import LANES, Demand, Lane, Rejection
from .runners import Job, RunnerError, Token
from .tenants import Tenant

if TYPE_CHECKING:
    from .server import Pool, Server

log = logging.getLogger("governor.connection")
jobs_log = logging.getLogger("governor.jobs")

# Outcomes that say the backend failed: the circuit breaker counts these as failures and
# "done" as a success; any other end (cancelled, out of ttl_ms, its client gone, shutdown)
# says nothing about the pool.
BACKEND_FAILURES = frozenset(
    {
        NeedCode.BACKEND_ERROR,
        NeedCode.RUNNER_CRASHED,
        NeedCode.RUNNER_TIMEOUT,
        NeedCode.RUNNER_UNAVAILABLE,
        NeedCode.UPSTREAM_ERROR,
        NeedCode.UPSTREAM_TIMEOUT,
    }
)
_connection_ids = itertools.count(1)


@dataclass(slots=True, eq=False)
class JobState:
    """What a connection holds for one job id."""

    upload: Upload
    tenant: Tenant
    reserved: int = 0  # payload bytes reserved against the buffer budgets
    held: bool = False  # a verified payload kept after a yield, for the client's retry
    promise: Promise | None = None  # when the held payload's client was told to come back
    job: Job | None = None  # the verified payload as the runner prepared it
    demand: Demand | None = None  # its lane and KV reservation, under a lane policy
    degraded: tuple[str, ...] = ()  # the fallback steps that shaped it
    pool: Pool | None = None  # the fallback pool, when the ladder or the breaker sent it there
    first_yield: float | None = None  # when it was first refused
    yields: int = 0
    # Set on admission:
    request: Request | None = None  # the frame that completed the payload; the terminal answers it
    slot: Slot | None = None
    trial: bool = False  # the half-open breaker's trial job
    task: asyncio.Task[None] | None = None
    first_token: float | None = None
    result: dict[str, Any] | None = None  # the runner's result, once it finished
    terminal_sent: bool = False
    outcome: str = "cancelled"  # "done", or the need_code of its abort, or "client_gone"


class GovernorProtocol(asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self.server = server
        self.config = server.config
        self.ledger = server.ledger
        self.transport: asyncio.Transport | None = None
        self.reader = LineReader(self.config.max_line_bytes)
        self.jobs: dict[str, JobState] = {}
        self.held_count = 0
        self.buffered = 0  # payload bytes reserved by this connection
        # Replies to a bad line name the last valid frame's job and seq.
        self.last_job = UNKNOWN_JOB
        self.last_seq = 0
        self.last_ttl_ms = 0
        self.closed = False
        self.id = next(_connection_ids)  # names the connection in logs
        self._loop = asyncio.get_running_loop()
        self._last_active = self._loop.time()
        self._idle_timer: asyncio.TimerHandle | None = None

    @property
    def running(self) -> int:
        return sum(1 for s in self.jobs.values() if s.task is not None)

    # asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        if not self.server.accept_connection(self):
            self._fatal(
                NeedCode.TOO_MANY_CONNECTIONS,
                ErrorCode.QUOTA,
                f"the server is at its limit of {self.config.max_connections} connections",
            )
            return
        self._idle_timer = self._loop.call_at(
            self._last_active + self.config.idle_timeout, self._check_idle
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        # The client is gone: stop its work now; each job's task frees its slot on the way out.
        for job, state in list(self.jobs.items()):
            if state.task is None:
                self._forget(job)
            else:
                state.terminal_sent = True  # nobody left to tell
                state.outcome = "client_gone"
                state.task.cancel()
        self.server.connection_closed(self)

    def pause_writing(self) -> None:
        # The client is not reading its replies: stop reading its requests until it does.
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        try:
            while not self.closed and (line := self.reader.next_line()) is not None:
                self._last_active = self._loop.time()
                if line.strip():
                    self._handle_line(line)
        except LineTooLong as exc:
            self._fatal(exc.need_code, exc.error_code, exc.detail)

    def eof_received(self) -> bool:
        # EOF is the client leaving: a half-close cannot be told apart from a close, and work
        # must not run on for a client that is gone. Returning False closes the transport,
        # and connection_lost cancels what runs.
        return False

    # Frames ----------------------------------------------------------------------------

    def _handle_line(self, line: bytes) -> None:
        try:
            req = decode_request(line)
        except RemoteProtocolError as exc:
            self.server.bad_frames[exc.need_code] += 1
            job, seq = self.last_job, self.last_seq
            if isinstance(exc, EnvelopeInvalid):  # it may name its own job and seq
                job = exc.job or job
                seq = seq if exc.seq is None else exc.seq
            self._send(error_reply(exc, job, seq + 1, self.last_ttl_ms, self._receipts()))
            return
        self.last_job, self.last_seq, self.last_ttl_ms = req.job, req.seq, req.ttl_ms
        if req.verb == Verb.PING:
            self._send(self._reply(req, Verb.CONFIRM, Status.OK, extra=self.server.ping_receipts()))
            return
        if req.verb == Verb.CANCEL:
            self._on_cancel(req)
            return
        state = self.jobs.get(req.job)
        if state is not None and state.task is not None:
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
        elif state.held:  # a new manifest replaces the payload held for a retry
            self._unhold(state)
        try:
            manifest = state.upload.apply_manifest(req.manifest)
            self._unreserve(state)
            self._reserve(state, manifest.total_bytes)
        except UploadNeed as exc:
            self._forget(req.job)
            self._send(self._error(req, exc))
            return
        self._send(self._reply(req, Verb.CLARIFY, Status.OK))

    def _on_chunk(self, req: Request, state: JobState | None) -> None:
        assert req.chunk is not None
        if state is None:
            missing = UploadNeed(NeedCode.MANIFEST_MISSING, "send 'payload_manifest' first")
            self._send(self._error(req, missing))
            return
        upload = state.upload
        if state.held and upload.is_final_chunk_again(req.chunk):
            # A retry after a yield: the payload was kept, so admission is tried again.
            self._admit(req, state)
            return
        try:
            payload = upload.apply_chunk(req.chunk)
        except UploadNeed as exc:
            self._send(self._error(req, exc))
            return
        if payload is None:
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
            state.held
            and manifest is not None
            and isinstance(digest, str)
            and digest.lower() == manifest.sha256
        )
        if state.held and not returning:
            self._unhold(state)
        try:
            payload = state.upload.apply_inline(req.inline)
            self._unreserve(state)
            self._reserve(state, len(payload))
        except UploadNeed as exc:
            self._forget(req.job)
            self._send(self._error(req, exc))
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
        elif state.task is not None:  # its terminal abort is the answer
            self._terminal(
                state,
                need_code=NeedCode.CANCELLED,
                error_code=ErrorCode.CANCELLED,
                detail="cancelled by the client",
            )
            state.task.cancel()
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
        tenant = self.server.tenants.find(req.api_key)
        if tenant is None:  # says nothing of which tenants exist
            self._abort(
                req, NeedCode.UNAUTHORIZED, ErrorCode.UNAUTHORIZED, "a valid api_key is needed"
            )
            return None
        if len(self.jobs) >= self.config.max_jobs_per_conn:
            self._fatal(
                NeedCode.TOO_MANY_JOBS,
                ErrorCode.QUOTA,
                f"more than {self.config.max_jobs_per_conn} jobs open on one connection",
                job=req.job,
                seq=req.seq + 1,
            )
            return None
        state = self.jobs[req.job] = JobState(Upload(self.config.max_payload_bytes), tenant)
        return state

    def _complete(self, req: Request, state: JobState, payload: bytes) -> None:
        """A verified payload: the runner checks it (a bad spec never takes a slot), then admit."""
        manifest = state.upload.manifest
        assert manifest is not None
        try:
            state.job = self.server.runner.prepare(req.job, payload, manifest.content_type)
        except SpecInvalid as exc:
            refusal = exc
        except Exception:  # a runner bug must cost this job, not the connection
            log.exception("runner failed to prepare job %r", req.job)
            refusal = SpecInvalid(NeedCode.SPEC_INVALID, "the runner cannot run this payload")
        else:
            rejection = self._classify(state)
            if rejection is None:
                self._admit(req, state)
                return
            self._forget(req.job)
            self._abort(
                req, rejection.need_code, ErrorCode.POLICY, rejection.detail, seq=_final_seq(req)
            )
            return
        self._forget(req.job)
        self._send(self._error(req, refusal, seq=_final_seq(req)))

    def _classify(self, state: JobState) -> Rejection | None:
        """Under a lane policy: price the job, give it a lane, or say it can never run."""
        policy, job = self.ledger.policy, state.job
        if policy is None or job is None or job.spec is None:
            return None
        spec = job.spec
        prompt_tokens = len(job.tokens) if job.tokens else spec.estimated_prompt_tokens()
        requested = None
        if spec.lane is not None:
            if spec.lane not in LANES:
                return Rejection(NeedCode.SPEC_INVALID, f"no lane {spec.lane!r}")
            requested = Lane(spec.lane)
        decision = policy.classify(prompt_tokens, spec.max_new_tokens, requested, spec.tool_risk)
        if isinstance(decision, Rejection):
            return decision
        # A tenant pinned to some lanes runs in the first of them at or below the job's own.
        allowed = [
            lane for lane in LANES[LANES.index(decision.lane) :] if state.tenant.allows_lane(lane)
        ]
        if not allowed:
            return Rejection(
                NeedCode.LANE_NOT_ALLOWED, f"the {decision.lane} lane is not open to this tenant"
            )
        state.demand = Demand(allowed[0], decision.kv_tokens)
        return None

    # Admission and execution ---------------------------------------------------------

    def _admit(self, req: Request, state: JobState) -> None:
        started = time.perf_counter()
        promise, state.promise = state.promise, None
        tenant, now = state.tenant, self.ledger.clock()
        overload = self.server.overload
        if overload is not None:
            self._apply_ladder(state, overload)
        tokens = self._tokens(state)
        decision: Slot | Refusal
        over_limit = self._paused(state, now) or self._tenant_refusal(tenant, tokens, now)
        if over_limit is not None:
            if promise is not None:
                self.ledger.withdraw(promise)
            decision = self.ledger.refused(over_limit)
        else:
            decision = self._place(state, promise, now)
        lane = state.demand.lane if state.demand is not None else NO_LANE
        self.server.metrics.decision.observe(lane, time.perf_counter() - started)
        if overload is not None:
            overload.observe_admission(yielded=isinstance(decision, Refusal))
        if isinstance(decision, Refusal):
            self.server.refusals[(decision.need_code, lane, tenant.name)] += 1
            state.yields += 1
            if state.first_yield is None:
                state.first_yield = now
            held = self._hold(state)
            if held:
                state.promise = decision.promise
                detail = "no execution slot free; resend the final chunk after retry_hint_ms"
            else:
                if decision.promise is not None:
                    self.ledger.withdraw(decision.promise)
                self._forget(req.job)
                detail = "no execution slot free, and the payload was not kept; resend it"
            self._send(
                self._reply(
                    req,
                    Verb.CLARIFY,
                    Status.YIELD,
                    seq=_final_seq(req),
                    need_code=decision.need_code,
                    error_code=(
                        ErrorCode.UNAVAILABLE
                        if decision.need_code in (NeedCode.DRAINING, NeedCode.BREAKER_OPEN)
                        else ErrorCode.BUSY
                    ),
                    retry_hint_ms=decision.retry_hint_ms,
                    detail=detail,
                    extra=(
                        (Receipt.RETRY_HINT_MS, decision.retry_hint_ms),
                        (Receipt.PAYLOAD_HELD, int(held)),
                    ),
                )
            )
            return
        if state.held:
            self._unhold(state)
        assert state.job is not None
        self.server.metrics.wait.observe(
            lane, 0.0 if state.first_yield is None else now - state.first_yield
        )
        tenant.inflight += 1
        tenant.starts.append(decision.started)
        tenant.charge(tokens, now)
        state.request = req
        state.slot = decision
        state.task = self.server.spawn(self._run(state))

    def _place(self, state: JobState, promise: Promise | None, now: float) -> Slot | Refusal:
        """A slot in the primary pool, or the fallback pool; or a refusal with its hint.

        While the primary pool's breaker is open its jobs, whatever their lane, go to the
        fallback pool if there is one and it has a slot, else yield ``breaker_open`` with a
        hint set by the cooldown.
        """
        ledger, breaker = self.ledger, self.server.primary.breaker
        blocked = breaker.retry_after_s(ledger.service_s)
        if blocked is not None:
            if promise is not None:
                ledger.withdraw(promise)
            slot = self._to_fallback(state, step="breaker_fallback")
            if slot is not None:
                return slot
            return ledger.refused(
                Refusal(NeedCode.BREAKER_OPEN, ledger.hint_ms(now, now + blocked))
            )
        decision = self._to_fallback(state) or ledger.admit(promise, state.demand)
        if promise is not None and state.pool is not None:
            ledger.withdraw(promise)
        if isinstance(decision, Slot) and state.pool is None:
            state.trial = breaker.started()
        return decision

    def _apply_ladder(self, state: JobState, overload: OverloadController) -> None:
        """The degraded state's step: a lower max_new_tokens for interactive work."""
        job, demand = state.job, state.demand
        if demand is None or job is None or job.spec is None or state.degraded:
            return
        cap = overload.max_new_tokens(demand.lane, job.spec.max_new_tokens)
        if cap is not None:
            cut = job.spec.max_new_tokens - cap
            state.job = dataclasses.replace(
                job, spec=dataclasses.replace(job.spec, max_new_tokens=cap)
            )
            state.demand = Demand(demand.lane, demand.kv_tokens - cut)
            state.degraded = ("interactive_max_new_tokens",)
            self.server.ladder["interactive_max_new_tokens"] += 1

    def _to_fallback(self, state: JobState, step: str = "fallback_model") -> Slot | None:
        """The fallback pool's smaller model, if it has a slot and will take the job.

        The ladder's step (``fallback_model``) sends heavy and background work there while
        degraded; ``breaker_fallback`` sends any job while the primary's breaker is open.
        """
        overload, pool, demand = self.server.overload, self.server.fallback, state.demand
        if pool is None or state.job is None:
            return None
        if step == "fallback_model" and (
            overload is None
            or demand is None
            or overload.state < State.DEGRADED
            or demand.lane == Lane.INTERACTIVE
        ):
            return None
        if pool.ledger.saturated:  # (no need to prepare the job for a full pool)
            return None
        if pool.breaker.retry_after_s(pool.ledger.service_s) is not None:
            return None
        job = state.job
        try:  # the pool's own check: its context may be smaller
            fallback_job = pool.runner.prepare(job.id, job.payload, job.content_type)
        except SpecInvalid:
            return None
        slot = pool.ledger.admit()
        if not isinstance(slot, Slot):
            return None
        state.job, state.pool = fallback_job, pool
        state.trial = pool.breaker.started()
        state.degraded = (*state.degraded, step)
        self.server.ladder[step] += 1
        return slot

    def _paused(self, state: JobState, now: float) -> Refusal | None:
        """The ladder's pauses: background from batch_paused on, heavy in interactive_only."""
        overload = self.server.overload
        if overload is None or state.demand is None or not overload.paused(state.demand.lane):
            return None
        step = "pause_background" if state.demand.lane == Lane.BACKGROUND else "interactive_only"
        self.server.ladder[step] += 1
        until = max(now, overload.changed_at + overload.settings.min_dwell_s)
        return Refusal(NeedCode.LANE_PAUSED, self.ledger.hint_ms(now, until))

    def _tenant_refusal(self, tenant: Tenant, tokens: int, now: float) -> Refusal | None:
        """The tenant's concurrency cap, its weighted share, then its request and token rates."""
        ledger, cap = self.ledger, tenant.config.max_inflight
        share = self.server.tenants.fair_share(tenant, ledger.cap)
        for limit, code in ((cap, NeedCode.TENANT_BUSY), (share, NeedCode.TENANT_SHARE)):
            if limit and tenant.inflight >= limit:  # (a share is contention: shared by weight)
                first_end = min(ledger.expected_end(started, now) for started in tenant.starts)
                return Refusal(code, ledger.hint_ms(now, first_end))
        wait = tenant.wait_s(tokens, now)
        if wait > 0:
            return Refusal(NeedCode.RATE_LIMITED, ledger.hint_ms(now, now + wait))
        return None

    @staticmethod
    def _tokens(state: JobState) -> int:
        """What the job counts against its tenant's token rate: prompt + max_new_tokens."""
        if state.demand is not None:
            return state.demand.kv_tokens
        job = state.job
        if job is None or job.spec is None:
            return 0
        prompt = len(job.tokens) if job.tokens else job.spec.estimated_prompt_tokens()
        return prompt + job.spec.max_new_tokens

    def _hold(self, state: JobState) -> bool:
        """Keep a refused payload for the client's retry, within this connection's bound."""
        if not state.held and self.held_count < self.config.held_payloads_per_conn:
            state.held = True
            self.held_count += 1
            state.tenant.waiting += 1
        return state.held

    async def _run(self, state: JobState) -> None:
        req, slot, job = state.request, state.slot, state.job
        assert req is not None
        assert slot is not None
        assert job is not None
        completed = False
        try:
            try:
                async with asyncio.timeout(req.ttl_ms / 1000 if req.ttl_ms else None):
                    result = await self._execute(job, state)
            except TimeoutError:
                self._terminal(
                    state,
                    need_code=NeedCode.TTL_EXPIRED,
                    error_code=ErrorCode.TIMEOUT,
                    detail=f"ttl_ms of {req.ttl_ms} ran out",
                )
            except RunnerError as exc:
                completed = True
                self._terminal(
                    state, need_code=exc.code, error_code=ErrorCode.BACKEND_ERROR, detail=exc.detail
                )
            except Exception:
                log.exception("runner failed on job %r", job.id)
                self._terminal(
                    state,
                    need_code=NeedCode.BACKEND_ERROR,
                    error_code=ErrorCode.BACKEND_ERROR,
                    detail="the runner failed unexpectedly",
                )
            else:
                completed = True
                state.result = result
                self._terminal(state, result=result)
        finally:
            overload = self.server.overload
            if overload is not None and state.outcome != "cancelled":
                overload.observe_outcome(failed=state.outcome not in ("done", "client_gone"))
            pool = state.pool or self.server.primary
            failed = state.outcome in BACKEND_FAILURES
            pool.breaker.record(
                True if failed else False if state.outcome == "done" else None, trial=state.trial
            )
            held_s = slot.release(completed=completed)
            state.tenant.inflight -= 1
            state.tenant.starts.remove(slot.started)
            if self.jobs.get(job.id) is state:
                self._forget(job.id)
            self.server.job_finished()
            self._job_ended(state, pool, held_s)

    def _job_ended(self, state: JobState, pool: Pool, held_s: float) -> None:
        """The job's measurements, and its one log line."""
        metrics, slot = self.server.metrics, state.slot
        assert slot is not None
        lane = state.demand.lane if state.demand is not None else NO_LANE
        metrics.finished[(state.outcome, lane, pool.name)] += 1
        metrics.e2e.observe(lane, held_s)
        ttft_s = tpot_s = None
        prompt = completion = None
        if state.first_token is not None:
            ttft_s = state.first_token - slot.started
            metrics.ttft.observe(lane, ttft_s)
        if state.result is not None:
            prompt = state.result.get("prompt_tokens")
            completion = state.result.get("completion_tokens")
            if isinstance(prompt, int):
                metrics.prompt_tokens.observe(lane, prompt)
            if isinstance(completion, int):
                metrics.output_tokens.observe(lane, completion)
                if completion > 1 and ttft_s is not None:
                    tpot_s = (held_s - ttft_s) / (completion - 1)
                    metrics.tpot.observe(lane, tpot_s)
        event(
            jobs_log,
            logging.INFO,
            f"job {state.outcome}",
            event="job",
            conn=self.id,
            job=state.request.job if state.request is not None else "",
            tenant=state.tenant.name,
            lane=lane,
            pool=pool.name,
            outcome=state.outcome,
            degraded=list(state.degraded),
            yields=state.yields,
            wait_ms=_ms(None if state.first_yield is None else slot.started - state.first_yield),
            ttft_ms=_ms(ttft_s),
            tpot_ms=_ms(tpot_s),
            e2e_ms=_ms(held_s),
            prompt_tokens=prompt,
            completion_tokens=completion,
        )

    async def _execute(self, job: Job, state: JobState) -> dict[str, Any]:
        parts: list[str] = []
        stream = job.spec is not None and job.spec.stream
        clock, health = self.ledger.clock, self.server.health
        # aclosing: the runner's clean-up runs now, not whenever the generator is collected.
        runner = (state.pool or self.server.primary).runner
        async with contextlib.aclosing(runner.run(job)) as events:
            async for event in events:
                if isinstance(event, Token):
                    now = clock()
                    health.progress(now)
                    if state.first_token is None:
                        state.first_token = now
                        self._first_token(state)
                    parts.append(event.text)
                    if stream and not state.terminal_sent:
                        self._send_delta(state, event.text)
                else:
                    result = dict(event.result)
                    if parts:
                        result.setdefault("text", "".join(parts))
                    return result
        raise RunnerError("the runner ended the job without finishing it")

    def _first_token(self, state: JobState) -> None:
        """Interactive time to first token, measured from admission, feeds the overload state."""
        overload, demand, slot = self.server.overload, state.demand, state.slot
        if overload is not None and demand is not None and demand.lane == Lane.INTERACTIVE:
            assert slot is not None
            assert state.first_token is not None
            overload.observe_ttft((state.first_token - slot.started) * 1000)

    def _send_delta(self, state: JobState, text: str) -> None:
        req = state.request
        assert req is not None
        # Small on purpose: no receipts on a stream frame.
        self._send(
            Reply(Verb.CLARIFY, req.job, _final_seq(req), Status.OK, ttl_ms=req.ttl_ms, delta=text)
        )

    def _terminal(
        self,
        state: JobState,
        *,
        need_code: NeedCode | None = None,
        error_code: ErrorCode | None = None,
        detail: str | None = None,
        result: dict[str, Any] | None = None,
    ) -> None:
        """The job's one terminal frame: done without a ``need_code``, abort with one."""
        if state.terminal_sent or state.request is None or state.slot is None:
            return
        state.terminal_sent = True
        state.outcome = need_code or "done"
        if result is not None and state.degraded:
            result = {**result, "degraded": list(state.degraded)}
        held_ms = round((self.ledger.clock() - state.slot.started) * 1000)
        self._send(
            self._reply(
                state.request,
                Verb.CONFIRM,
                Status.DONE if need_code is None else Status.ABORT,
                seq=_final_seq(state.request),
                need_code=need_code,
                error_code=error_code,
                detail=detail,
                result=result,
                extra=((Receipt.BACKEND_MS, held_ms),),
            )
        )

    def abort_running(self, need_code: NeedCode, error_code: ErrorCode, detail: str) -> None:
        """Send each running job its terminal abort now, then cancel it."""
        for state in list(self.jobs.values()):
            if state.task is not None:
                self._terminal(state, need_code=need_code, error_code=error_code, detail=detail)
                state.task.cancel()

    # Connection-level ----------------------------------------------------------------

    def _check_idle(self) -> None:
        if self.closed:
            return
        now = self._loop.time()
        deadline = self._last_active + self.config.idle_timeout
        if now >= deadline and not self.running:
            self._fatal(
                NeedCode.IDLE_TIMEOUT,
                ErrorCode.TIMEOUT,
                f"no frame for {self.config.idle_timeout:g} s",
            )
            return
        next_check = deadline if deadline > now else now + self.config.idle_timeout
        self._idle_timer = self._loop.call_at(next_check, self._check_idle)

    def _fatal(
        self,
        need_code: NeedCode,
        error_code: ErrorCode,
        detail: str,
        *,
        job: str | None = None,
        seq: int | None = None,
    ) -> None:
        """One abort frame for the connection, one for each running job, then close."""
        if self.closed:
            return
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
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    # Helpers ---------------------------------------------------------------------------

    def _send(self, reply: Reply) -> None:
        if reply.status == Status.ABORT and reply.need_code is not None:
            self.server.metrics.aborts[reply.need_code] += 1
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode_reply(reply))

    def _receipts(self, bytes_in: int = 0) -> tuple[tuple[str, int], ...]:
        ledger = self.ledger
        return (
            (Receipt.HEALTH, int(ledger.ready)),
            (Receipt.INFLIGHT, ledger.inflight),
            (Receipt.CAP, ledger.cap),
            (Receipt.EXECUTED_TOTAL, ledger.executed_total),
            (Receipt.YIELDED_TOTAL, ledger.yielded_total),
            (Receipt.BYTES_IN, bytes_in),
        )

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
        extra: Iterable[tuple[str, int]] = (),
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

    def _need(
        self, req: Request, need_code: str, error_code: str, detail: str, *, seq: int | None = None
    ) -> None:
        self._send(
            self._reply(
                req,
                Verb.CLARIFY,
                Status.NEED,
                seq=seq,
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

    def _reserve(self, state: JobState, nbytes: int) -> None:
        if self.buffered + nbytes > self.config.max_conn_buffer_bytes:
            raise ManifestInvalid(
                f"this connection already buffers {self.buffered} payload bytes; "
                f"its limit is {self.config.max_conn_buffer_bytes}"
            )
        if not self.server.reserve_buffer(nbytes):
            raise ManifestInvalid("the server's payload buffers are full; retry later")
        state.reserved = nbytes
        self.buffered += nbytes

    def _unreserve(self, state: JobState) -> None:
        if state.reserved:
            self.server.release_buffer(state.reserved)
            self.buffered -= state.reserved
            state.reserved = 0

    def _unhold(self, state: JobState) -> None:
        state.held = False
        self.held_count -= 1
        state.tenant.waiting -= 1
        if state.promise is not None:
            self.ledger.withdraw(state.promise)
            state.promise = None

    def _forget(self, job: str) -> None:
        state = self.jobs.pop(job, None)
        if state is not None:
            if state.held:
                self._unhold(state)
            self._unreserve(state)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def _final_seq(req: Request) -> int:
    """The seq of every answer to the frame that completes a payload: the final chunk's + 2 (v0),
    an inline payload's + 1."""
    return req.seq + (1 if req.inline is not None else 2)
