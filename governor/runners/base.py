"""The seam between admission and execution.

A :class:`Runner` first checks a job with :meth:`Runner.prepare`: its spec as the intake parsed
it (:mod:`governor.intake`: once, from a TCP payload or an HTTP body; an invalid one is refused
there, or by the runner's own checks here, before it can take a slot), then executes each
admitted job in one call of :meth:`Runner.run`, an async generator of :class:`Token` events
(partial output, as it is produced; before them, a batched runner's :class:`Fed` progress while
the prompt is fed) ending with one :class:`Finished`. The server cancels the iteration's task to stop a job (client gone,
``ttl_ms`` spent, shutdown): a runner must stop work promptly when cancelled and raise
:class:`RunnerError` for a job that failed, never anything else.

For the health probes, :meth:`Runner.probe` runs the smallest real job (one generated token)
through the same path as a client's, and :meth:`Runner.health` says whether the runner's
supervision of its workers still stands.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from protocol.codes import NeedCode
from protocol.spec import JobSpec, SpecInvalid, check_ceiling, parse_spec

# The health probe's job, the smallest real one: one greedy token (see :meth:`Runner.probe`).
PROBE_SPEC = JobSpec(prompt="Hi", max_new_tokens=1, temperature=0.0)


@dataclass(frozen=True, slots=True)
class CacheShape:
    """One worker's KV cache, as a runner reports it (admission's KV budget is made of these)."""

    cells: int
    sequences: int


class Pause:
    """A job's suspension: admission sets it (a chat took the job's slot back, or its slot is
    free again), the runner running the job carries it out (it stops stepping the job, then
    goes on where it stopped). Set before the runner listens, it is carried out when it
    starts to."""

    __slots__ = ("_listener", "suspended", "suspensions")

    def __init__(self) -> None:
        self.suspended = False
        self.suspensions = 0  # times suspended
        self._listener: Callable[[bool], None] | None = None

    def set(self, suspended: bool) -> None:
        if suspended == self.suspended:
            return
        self.suspended = suspended
        self.suspensions += suspended
        if self._listener is not None:
            self._listener(suspended)

    def listen(self, listener: Callable[[bool], None] | None) -> None:
        """Carry out each change from now on (None: no more); a suspension already set is
        carried out at once."""
        self._listener = listener
        if listener is not None and self.suspended:
            listener(True)


@dataclass(slots=True)  # (not frozen, though never changed: governor/compiled.py)
class Job:
    """A job, prepared by the runner that will run it."""

    id: str
    payload: bytes = b""  # the verified payload it came as (the stub reports its digest)
    spec: JobSpec | None = None  # None: a payload that is not a job spec, for the stub
    tokens: tuple[int, ...] = ()  # the prompt, tokenised
    stop: tuple[str, ...] = ()  # the spec's stop strings and the chat template's
    # Set by admission: how urgent it is (its lane's rank, 0 the interactive lane), for a
    # runner with KV caches the one its cells are reserved in, and for a batched runner its
    # objectives (time to first token, time per output token; 0: none) and its longest pause
    # between two tokens (:mod:`governor.runners.llama.batching`; 0: its TTFT objective).
    priority: int = 0
    kv_cache: int | None = None
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    gap_ms: float = 0.0
    # Set by admission: the share of ``max_new_tokens`` its pool's jobs use (the learnt ratio):
    # a batched runner's steps borrow against the tokens a job is expected to generate.
    ratio: float = 1.0
    # Set by admission for a job it may suspend (:class:`Pause`), on a runner that can.
    pause: Pause | None = None
    # The runner's own reading of the job, made by :meth:`Runner.prepare` (the http runner's
    # request that its upstream can continue after a pause); None: none.
    plan: object | None = None


@dataclass(frozen=True, slots=True)
class Token:
    """Partial output; ``generated``: the job's output tokens so far, where the runner counts
    them (admission predicts a running job's end from its pace).

    ``index``: the sequence (OpenAI's choice) it belongs to, of the spec's ``n``.
    ``logprobs``: with the spec's ``logprobs``, one entry per token in ``text``, in OpenAI's
    chat shape: ``{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
    "bytes"}]}``. ``tool``: the text is (part of) the arguments of a call to this function.
    ``raw``: a forwarding runner's upstream event, to pass to the client as it came."""

    text: str
    generated: int | None = None
    index: int = 0
    logprobs: tuple[dict[str, Any], ...] = ()
    tool: str | None = None
    raw: bytes = b""


@dataclass(frozen=True, slots=True)
class Relay:
    """A forwarding runner's upstream event that carries no generated token (a stream's role,
    its finish, its usage), to pass to a streaming client as it came."""

    raw: bytes


@dataclass(frozen=True, slots=True)
class Relayed:
    """A forwarding runner's upstream answer, for the client as it came: its status, content
    type and body (after a stream's events: what is left of it, ``data: [DONE]``)."""

    status: int
    content_type: str
    body: bytes


@dataclass(frozen=True, slots=True)
class Fed:
    """Progress while the prompt is fed (a batched runner's chunked prefill): ``tokens`` of it
    are in the cache so far (admission predicts the job's end from that pace)."""

    tokens: int


@dataclass(slots=True)
class Resume:
    """One resume of a paused job, as its runner measured it: the prompt tokens computed
    again (a cache held the rest), and the seconds from the resume to its next token (None:
    not measured)."""

    recomputed: int | None = None
    first_token_s: float | None = None


@dataclass(frozen=True, slots=True)
class Finished:
    """The job's end; ``result`` goes into the terminal ``confirm done`` frame. With the
    spec's ``n`` above 1, ``logprobs`` or ``tools``, ``result["choices"]`` holds each
    sequence's ``{"index", "text", "finish_reason", "logprobs"?, "tool_calls"?}`` (its
    ``text`` and ``finish_reason`` are the first's). ``relayed``: a forwarding runner's
    upstream answer."""

    result: Mapping[str, Any] = field(default_factory=dict)
    relayed: Relayed | None = None
    # Each resume of the job after a pause, where its runner measures them: the prompt tokens
    # computed again and the seconds to its next token.
    resumes: Sequence[Resume] = ()
    # Each piece of its prompt sent ahead (the http runner's, in front of llama-server): the
    # seconds from its request to its answer.
    pieces: Sequence[float] = ()


RunEvent = Token | Fed | Relay | Finished


@dataclass(frozen=True, slots=True)
class RunnerHealth:
    """What liveness and readiness need to know of a runner's workers."""

    supervisor_alive: bool  # every worker is running or being restarted
    workers_live: int  # loaded and able to take a job (0 with ``workers`` 0: no workers)
    workers: int  # configured; 0 for a runner without worker processes
    restarts: int = 0


class RunnerStartError(Exception):
    """The runner cannot start (a model that does not load, say); the message is for people."""


class RunnerConfigError(RunnerStartError):
    """The runner cannot start on this configuration: a setting the model cannot honour (an
    ``n_ctx`` over its training context). Like any configuration error, the daemon exits 2."""


class RunnerError(Exception):
    """A job failed in the backend. ``code`` is the ``need_code`` of its ``confirm abort``;
    ``relayed``, a forwarding runner's upstream answer to pass on as it came."""

    def __init__(
        self,
        detail: str,
        code: NeedCode = NeedCode.BACKEND_ERROR,
        relayed: Relayed | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.code = code
        self.relayed = relayed


class Runner(Protocol):
    name: str

    @property
    def max_new_tokens(self) -> int:
        """The most new tokens a job may ask for: the ceiling its spec is parsed against."""
        ...

    @property
    def expected_service_s(self) -> float:
        """A first guess at a job's service time, before any has been observed."""
        ...

    async def start(self) -> None:
        """Get ready to run jobs (load models, start workers)."""
        ...

    async def close(self) -> None: ...

    def prepare(self, job_id: str, spec: JobSpec | None, payload: bytes = b"") -> Job:
        """Check a job before it may take a slot; raises ``SpecInvalid``. ``spec``: as the
        intake parsed it (perhaps against another runner's ceiling: a fallback pool's runner
        is given the primary's job); None for a payload that is not a JSON job spec (a runner
        that generates text takes it as its prompt: :func:`spec_or_prompt`)."""
        ...

    def run(self, job: Job) -> AsyncGenerator[RunEvent, None]: ...

    async def probe(self) -> bool:
        """Generate one token through the real path; False if no worker is free to do it.

        Raises :class:`RunnerError` when it fails; the caller bounds it with a timeout.
        """
        ...

    def health(self) -> RunnerHealth: ...


@dataclass(frozen=True, slots=True)
class Rates:
    """What a runner says a token costs it now, in seconds: a prompt token (``prompt_s``),
    a generated token of a stream beside the others every slot holds (``decode_s``), and how
    much such a step grows for each more cell its streams attend over (``cell_s``: every
    generated token adds one to its stream)."""

    prompt_s: float
    decode_s: float
    cell_s: float = 0.0


@runtime_checkable
class Rated(Protocol):
    """A runner that knows what its tokens cost before any job has finished (the batched
    llama runner, from its steps): admission predicts the first jobs' times from their sizes
    with it (:attr:`~governor.core.service.ServiceModel.assumed`)."""

    def rates(self) -> Rates | None:
        """What a token costs now (None: not yet known)."""
        ...


@runtime_checkable
class Refilling(Protocol):
    """A runner that keeps a freed slot busy: told whether jobs wait at the doors, it holds the
    step after a job's last token for the next job's run (the batched llama runner)."""

    def waiting(self, jobs: bool) -> None:
        """Jobs wait for a slot (True), or no longer do."""
        ...

    def offered(self, job: Job) -> None:
        """The slot ``job`` held has been offered to the jobs waiting: those admitted to it
        have started (their runs go out before anything this call sends)."""
        ...


@runtime_checkable
class Forwarding(Protocol):
    """A runner that OpenAI requests go to as they came (:attr:`JobSpec.forward`), not as job
    specs: the http runner, a sidecar that leaves what it does not read to its upstream."""

    async def relay(self, method: str, path: str, body: bytes) -> Relayed:
        """The upstream's answer to a request that takes no slot (its models, its tokenizer);
        raises :class:`RunnerError` when none comes."""
        ...

    async def push(self, job: Job, sink: Callable[[Token | Relay], None]) -> Finished:
        """Run a forwarded job (its spec's ``forward``), giving its stream's pieces to ``sink``
        as they come, synchronously (what :meth:`Runner.run` would yield, but for the end,
        returned); raises :class:`RunnerError` as ``run`` does."""
        ...


@runtime_checkable
class Embedder(Protocol):
    """A runner that embeds texts (the embedded llama runner): a job spec's ``input`` runs
    as an embeddings job, its result's ``embeddings`` one vector a text."""

    async def embed(self, texts: list[str]) -> tuple[list[list[float]], int]: ...


@runtime_checkable
class KvCacheRunner(Protocol):
    """A runner with KV caches of its own (the batched llama runner, one per worker):
    admission reserves each job's cells in one of them, and tells the runner which
    (:attr:`Job.kv_cache`)."""

    def kv_caches(self) -> tuple[CacheShape, ...]:
        """The caches, as configured (each may hold a little more: llama.cpp pads them)."""
        ...

    def kv_used(self) -> int:
        """The cells the caches hold now, as their workers last reported."""
        ...


@runtime_checkable
class Pausing(Protocol):
    """A runner that carries out a job's :attr:`Job.pause`: it stops the job when admission
    suspends it (a chat took its slot back) and goes on where it stopped when resumed, its
    client seeing one answer (the batched llama runner; the http runner in front of an upstream
    that continues an answer from its tokens)."""

    def pausable(self, job: Job) -> bool:
        """Whether ``job`` can be suspended and resumed with the same answer as unpaused
        (False for every job where the runner cannot pause at all)."""
        ...


def probe_job(runner: Runner) -> Job:
    """The job :meth:`Runner.probe` runs, prepared as a client's would be."""
    return runner.prepare("probe", PROBE_SPEC, PROBE_SPEC.encode())


def spec_or_prompt(spec: JobSpec | None, payload: bytes, max_new_tokens: int) -> JobSpec:
    """What a runner that generates text runs: the job's spec, within its ceiling; for a
    payload that is not a JSON job spec, its UTF-8 text as the prompt. A request that came to
    be forwarded as it is (a sidecar's, :attr:`JobSpec.forward`) is no job spec: refused."""
    if spec is not None:
        if spec.forward is not None:
            raise SpecInvalid(NeedCode.SPEC_INVALID, "this request is for the upstream server only")
        return check_ceiling(spec, max_new_tokens)
    return parse_spec(payload, "text/plain", max_new_tokens_ceiling=max_new_tokens)
