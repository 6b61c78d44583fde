"""The ``http`` runner: the governor as a sidecar in front of an OpenAI-compatible server.

Each admitted job is one streamed request to the upstream (``/v1/completions`` for a prompt,
``/v1/chat/completions`` for messages): llama.cpp's llama-server, vLLM, llama-cpp-python's own
server. Streaming upstream even when the client did not ask for it gives the time to first
token, and lets a cancelled job close its request at once. The upstream's errors and silences
become ``upstream_error`` and ``upstream_timeout`` aborts. HTTP is the lean client of
:mod:`.upstream` (h11, connections kept alive): a sidecar reads once a token.

Token counts come from the upstream's ``usage`` when it sends one in the stream (it is asked
with ``stream_options: {"include_usage": true}``; llama-server and vLLM send it, in the last
chunk; llama-cpp-python's server sends none in a stream); otherwise ``completion_tokens``
counts the streamed content chunks (one per token on llama.cpp's servers) and
``prompt_tokens`` is null: the runner has no tokenizer to count it with. ``result.counted``
says which (:func:`token_counts`).

In front of llama-server (its ``/props`` read at start), a job admitted where it may be paused
(a :class:`~.base.Pause`: below the interactive lane, under lanes) and whose answer can be
continued exactly runs instead on llama-server's own ``/completion`` (:class:`Resumable`, the
pure part in :mod:`.continuation`): its pause resets the request, its resume sends the same
answer's continuation, and its client sees one answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from protocol.codes import NeedCode
from protocol.spec import JobSpec, check_ceiling

from ..base import (
    Finished,
    Job,
    Pause,
    Relay,
    Relayed,
    RunEvent,
    RunnerError,
    RunnerHealth,
    RunnerStartError,
    Token,
    probe_job,
    spec_or_prompt,
)
from .continuation import Ask, Continuation, Pace, ask_of_body, upstream_of
from .continuation import Upstream as Native
from .framing import SseEvents, UpstreamError, UpstreamTimeout
from .prompts import UpstreamPrompts
from .upstream import Answer, Upstream

log = logging.getLogger("governor.runners.http")
FINISH_REASONS = {"stop": "stop", "length": "length", "eos": "stop"}
JSON = "application/json"
SSE = "text/event-stream"
# The most the sidecar holds of an upstream's answer: a whole one, or one event of a stream.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
# How long a stream's end may follow its last event (``data: [DONE]``) for its connection to be
# kept for the next request; the job has ended either way.
END_WAIT_S = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpSettings:
    upstream: str  # base URL, e.g. http://127.0.0.1:8080
    model: str | None = None  # the "model" field of each request; None: the upstream's default
    max_new_tokens: int = 1024
    timeout_s: float = 120.0  # the upstream may stay silent this long under a job
    start_timeout_s: float = 60.0  # how long start() waits for the upstream to answer
    # A chat's TTFT objective, under lanes: a paused job's long prompt goes up in pieces that
    # keep a chat that comes meanwhile from waiting long on one (0: only while chats run).
    chat_ttft_ms: float = 0.0


class HttpRunner:
    name = "http"

    def __init__(self, settings: HttpSettings) -> None:
        self.settings = settings
        self._upstream: Upstream | None = None
        # llama-server's own account of itself, where the upstream is one: its jobs can be
        # paused and resumed (:mod:`.continuation`). None: another server.
        self.native: Native | None = None
        self._resumable: Resumable | None = None
        # Its slot context and its model's vocabulary, where its file can be read here: each
        # prompt is counted at the door (:mod:`.upstream_prompts`). None: not counted.
        self.prompts: UpstreamPrompts | None = None
        self.pace = Pace(settings.chat_ttft_ms / 1000)  # for a long prompt's pieces

    @property
    def expected_service_s(self) -> float:
        return 2.0

    async def start(self) -> None:
        s = self.settings
        try:
            self._upstream = upstream = Upstream(s.upstream, timeout_s=s.timeout_s)
        except ValueError as exc:
            raise RunnerStartError(f"the upstream: {exc}") from None
        deadline = time.monotonic() + s.start_timeout_s
        while True:  # a sidecar may start before the server it fronts
            try:
                async with upstream.request("GET", "/v1/models", timeout_s=5.0) as answer:
                    await read_bounded(answer)
                if answer.status < 500:
                    self.native = native = await self._props()
                    if native is not None:
                        self._resumable = Resumable(upstream, native, s.timeout_s, self.pace)
                        self.prompts = await asyncio.to_thread(UpstreamPrompts.load, native)
                    log.info(
                        "upstream %s: %s", s.upstream, _described(native, self.prompts is not None)
                    )
                    return
                problem = f"answered {answer.status}"
            except UpstreamError as exc:
                problem = f"cannot be reached ({exc})"
            if time.monotonic() > deadline:
                await self.close()
                raise RunnerStartError(
                    f"the upstream {s.upstream} {problem} after {s.start_timeout_s:g} s"
                )
            await asyncio.sleep(0.5)

    async def _props(self) -> Native | None:
        """llama-server's ``/props`` (None from another server: it pauses no job)."""
        assert self._upstream is not None
        try:
            async with self._upstream.request("GET", "/props", timeout_s=5.0) as answer:
                body = await read_bounded(answer)
            return upstream_of(orjson.loads(body)) if answer.status == 200 else None
        except (UpstreamError, orjson.JSONDecodeError):
            return None

    async def close(self) -> None:
        if self._upstream is not None:
            await self._upstream.close()

    async def probe(self) -> bool:
        """One token from the upstream, through :meth:`run`: the path jobs take."""
        async with contextlib.aclosing(self.run(probe_job(self))) as events:
            async for _ in events:
                pass
        return True

    def health(self) -> RunnerHealth:
        return RunnerHealth(supervisor_alive=True, workers_live=0, workers=0)

    @property
    def max_new_tokens(self) -> int:
        return self.settings.max_new_tokens

    def _request(self, spec: JobSpec) -> tuple[str, dict[str, Any]]:
        """The upstream's path and body for ``spec``: a chat or a completion, streamed."""
        body: dict[str, Any] = {
            "max_tokens": spec.max_new_tokens,
            "temperature": spec.temperature,
            "top_p": spec.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if spec.messages is not None:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": m.role, "content": m.content} for m in spec.messages]
        else:
            path = "/v1/completions"
            body["prompt"] = spec.prompt
        for name, value in (("model", self.settings.model), ("seed", spec.seed)):
            if value is not None:
                body[name] = value
        if spec.stop:
            body["stop"] = list(spec.stop)
        # Beyond OpenAI's parameters, but llama-server and vLLM take these: sent only when
        # asked for.
        if spec.top_k:
            body["top_k"] = spec.top_k
        if spec.min_p:
            body["min_p"] = spec.min_p
        if spec.ignore_eos:
            body["ignore_eos"] = True
        return path, body

    def prepare(self, job_id: str, spec: JobSpec | None, payload: bytes = b"") -> Job:
        prompts = self.prompts  # (None: a prompt too long is the upstream's error to give)
        if spec is not None and spec.forward is not None:
            spec = check_ceiling(spec, self.settings.max_new_tokens)
            plan = self._forward_plan(spec)
            tokens = prompts.count_ask(plan) if prompts is not None and plan is not None else ()
            return Job(job_id, payload, spec=spec, tokens=tokens, plan=plan)
        spec = spec_or_prompt(spec, payload, self.settings.max_new_tokens)
        tokens = prompts.count(spec) if prompts is not None else ()
        plan = None
        if self.native is not None:  # (the request :meth:`run` would send, continued)
            path, body = self._request(spec)
            plan = ask_of_body(body, path, shaped=False)
        return Job(job_id, payload, spec=spec, tokens=tokens, stop=spec.stop, plan=plan)

    def _forward_plan(self, spec: JobSpec) -> Ask | None:
        """A forwarded request that llama-server can continue after a pause, read as such."""
        forward = spec.forward
        assert forward is not None
        if self.native is None:
            return None
        fields = forward.fields
        if fields is None:
            try:
                fields = orjson.loads(forward.body)
            except orjson.JSONDecodeError:
                return None
        return ask_of_body(fields, forward.path) if type(fields) is dict else None

    def pausable(self, job: Job) -> bool:
        """A job whose request llama-server continues exactly (:mod:`.continuation`)."""
        return self.native is not None and isinstance(job.plan, Ask)

    def forwarded_body(self, spec: JobSpec) -> bytes:
        """What goes upstream for a forwarded request: its body as it came, unless the
        governor's own fields are to come out of it, the upstream's model name in (with
        ``upstream_model``), or its length bounded (none asked for: the ceiling; the
        degraded state's lower cap)."""
        forward = spec.forward
        assert forward is not None
        fields = forward.fields
        model = self.settings.model
        bound = forward.length_field and spec.max_new_tokens != forward.asked
        if fields is None and model is None and not bound:
            return forward.body
        if fields is None:
            fields = orjson.loads(forward.body)
        fields = dict(fields)
        if model is not None:
            fields["model"] = model
        if bound:
            fields[forward.length_field] = spec.max_new_tokens
        return orjson.dumps(fields)

    async def relay(self, method: str, path: str, body: bytes) -> Relayed:
        """The upstream's answer to a request that takes no slot, as it came."""
        assert self._upstream is not None
        with self._failures():
            async with self._upstream.request(method, path, body) as answer:
                return _relayed(answer, await read_bounded(answer))

    async def run(self, job: Job) -> AsyncGenerator[RunEvent, None]:
        spec = job.spec
        assert spec is not None
        assert self._upstream is not None
        if spec.forward is not None:  # (the execution pushes these: :meth:`push`)
            pushed: list[RunEvent] = []
            finished = await self.push(job, pushed.append)
            for event in pushed:
                yield event
            yield finished
            return
        with self.pace.running(job.priority, job.tpot_ms):  # (a chat: see :class:`Pace`)
            if job.pause is not None and isinstance(job.plan, Ask) and job.plan.openai is None:
                assert self._resumable is not None
                continued = Continuation(job.plan, spec.max_new_tokens)
                async with contextlib.aclosing(self._resumable.answer(job, continued)) as pieces:
                    async for piece in pieces:
                        yield Token(piece, continued.completion_tokens)
                result = {"text": "".join(continued.text), **continued.counts()}
                yield Finished(
                    {**result, "finish_reason": continued.finish},
                    resumes=continued.resumes,
                    pieces=continued.pieces,
                )
                return
            path, body = self._request(spec)
            parts: list[str] = []
            counts = StreamCounts()
            with self._failures():
                async with self._upstream.request("POST", path, orjson.dumps(body)) as answer:
                    if answer.status >= 400:
                        detail = (await read_bounded(answer))[:300].decode(errors="replace")
                        raise RunnerError(
                            f"the upstream answered {answer.status}: {detail}",
                            NeedCode.UPSTREAM_ERROR,
                        )
                    async for event in sse_events(answer.chunks()):
                        text = counts.add(event)
                        if text:
                            parts.append(text)
                            yield Token(text)
                    await answer.drain(END_WAIT_S, MAX_ANSWER_BYTES)
            # (ttft_ms and tpot_ms are the governor's, measured from admission.)
            yield Finished(
                {
                    "text": "".join(parts),
                    **token_counts(counts.usage, len(parts)),
                    "finish_reason": FINISH_REASONS.get(counts.finish or "", counts.finish),
                }
            )

    def _failures(self) -> contextlib.AbstractContextManager[None]:
        return failures(self.settings.timeout_s)

    async def push(self, job: Job, sink: Callable[[Token | Relay], None]) -> Finished:
        """A forwarded request: its body to the upstream, the upstream's answer back as it
        came. A stream's events go to ``sink`` one by one (those with generated text or tool
        calls as tokens, timed) as they arrive, in the connection's callback (no task wakes
        for each: a sidecar relays once a token); an answer other than 2xx is passed on as
        it came too (:func:`_refused`)."""
        with self.pace.running(job.priority, job.tpot_ms):  # (a chat: see :class:`Pace`)
            return await self._push(job, sink)

    async def _push(self, job: Job, sink: Callable[[Token | Relay], None]) -> Finished:
        spec = job.spec
        assert spec is not None
        forward = spec.forward
        assert forward is not None
        assert self._upstream is not None
        if job.pause is not None and isinstance(job.plan, Ask):
            assert self._resumable is not None
            return await self._resumable.push(job, job.plan, sink)
        body = self.forwarded_body(spec)
        with self._failures():
            async with self._upstream.request("POST", forward.path, body) as answer:
                if answer.status >= 300 or not forward.stream:
                    whole = await read_bounded(answer)
                    relayed = _relayed(answer, whole)
                    if answer.status >= 300:
                        raise _refused(relayed)
                    return Finished(whole_counts(whole), relayed)
                counts, events = StreamCounts(), SseEvents(MAX_ANSWER_BYTES)

                def relay(data: bytes) -> None:
                    for raw, event in events.feed(data):
                        token = counts.add(event)
                        sink(
                            Token(token, counts.generated, raw=raw)
                            if token is not None
                            else Relay(raw)
                        )

                if answer.chunked:
                    await answer.pump(relay)
                else:
                    async for data in answer.chunks():
                        relay(data)
                        if events.done:
                            break
                    await answer.drain(END_WAIT_S, MAX_ANSWER_BYTES)
                return Finished(counts.result(), Relayed(200, SSE, b"data: [DONE]\n\n"))


@contextlib.contextmanager
def failures(timeout_s: float) -> Iterator[None]:
    """The upstream's failures as the job's: ``upstream_timeout`` for a silence of
    ``timeout_s``, ``upstream_error`` for the rest (a broken connection, body or event)."""
    try:
        yield
    except UpstreamTimeout:
        raise RunnerError(
            f"the upstream sent nothing for {timeout_s:g} s", NeedCode.UPSTREAM_TIMEOUT
        ) from None
    except (UpstreamError, orjson.JSONDecodeError) as exc:
        raise RunnerError(f"the upstream failed: {exc}", NeedCode.UPSTREAM_ERROR) from None


class Resumable:
    """The http runner's jobs that llama-server can continue (:mod:`.continuation`): each
    runs on its ``/completion`` endpoint in attempts that its pauses close and its resumes
    send again."""

    def __init__(self, upstream: Upstream, native: Native, timeout_s: float, pace: Pace) -> None:
        self.upstream = upstream
        self.native = native
        self.timeout_s = timeout_s
        self.pace = pace

    async def push(self, job: Job, ask: Ask, sink: Callable[[Token | Relay], None]) -> Finished:
        """A forwarded request that can be paused: its answer in the chunks llama-server's
        own OpenAI endpoint would have sent, one ``id`` over every attempt."""
        assert job.spec is not None
        assert ask.openai is not None
        shape, answer = ask.openai, Continuation(ask, job.spec.max_new_tokens)
        shape.begin(self.native)
        first = shape.role() if shape.stream else None
        async with contextlib.aclosing(self.answer(job, answer)) as pieces:
            async for text in pieces:
                raw = shape.piece(text) if shape.stream else b""
                if first is not None:
                    raw, first = first + raw, None
                sink(Token(text, answer.completion_tokens, raw=raw))
        counts = {**answer.counts(), "finish_reason": answer.finish}
        if shape.stream:
            relayed = Relayed(200, SSE, shape.end(answer))
        else:
            relayed = Relayed(200, JSON, shape.whole(answer))
        return Finished(counts, relayed, resumes=answer.resumes, pieces=answer.pieces)

    async def answer(self, job: Job, answer: Continuation) -> AsyncGenerator[str, None]:
        """The answer's text as it comes, over as many attempts as its pauses make: each a
        ``/completion`` request that its pause closes, the next sent once it is resumed."""
        upstream = self.upstream
        ask, pause, loop = answer.ask, job.pause, asyncio.get_running_loop()
        template = None
        if ask.messages is not None:
            template = await self._call("/apply-template", {"messages": ask.messages}, "prompt")
        attempt = Attempt(pause)
        try:
            if job.priority > 0:  # (below the interactive lane: chats may be decoding)
                await self._pieces(answer, template, attempt)
            while True:
                await attempt.resumed()
                if answer.remaining <= 0:  # (paused after its last token)
                    answer.finish = "length"
                    return
                if answer.resumes and answer.prompt is None:
                    await self._prompt(answer, template)
                    continue  # (paused again meanwhile, perhaps)
                sent = loop.time()
                body = orjson.dumps(answer.body(template))
                with failures(self.timeout_s):
                    async with upstream.request("POST", "/completion", body) as reply:
                        if reply.status >= 400:
                            raise _native_refused(reply.status, await read_bounded(reply))
                        try:
                            async with attempt.on(reply):
                                async for event in sse_events(reply.chunks()):
                                    text = answer.feed(event)
                                    if text is not None:
                                        answer.first_of_resume(loop.time() - sent)
                                        yield text
                                    if answer.finish is not None:
                                        self.pace.learn(event.get("timings"))
                                        break
                        except Paused:
                            answer.paused()
                            continue
                        await reply.drain(END_WAIT_S, MAX_ANSWER_BYTES)
                if answer.finish is None:
                    raise RunnerError(
                        "the upstream's answer ended before its last event",
                        NeedCode.UPSTREAM_ERROR,
                    )
                return
        finally:
            attempt.close()

    async def _pieces(self, answer: Continuation, template: str | None, attempt: Attempt) -> None:
        """While chats decode on the upstream, the prompt goes into its cache in pieces each
        step can take within their pace (requests that generate nothing: ``n_predict`` 0),
        before the request that generates; the rest at once when no chat runs."""
        fed = 0
        while (piece := self.pace.piece()) is not None:
            await attempt.resumed()
            prompt = await self._prompt(answer, template)
            if len(prompt) - fed <= piece:
                return
            fed += piece
            body = {"prompt": prompt[:fed], "n_predict": 0, "cache_prompt": True}
            sent = time.monotonic()
            self.pace.learn(await self._call("/completion", body, "timings"))
            answer.pieces.append(time.monotonic() - sent)

    async def _call(self, path: str, body: dict[str, Any], key: str) -> Any:
        """One of llama-server's own endpoints: its answer's ``key``."""
        with failures(self.timeout_s):
            async with self.upstream.request("POST", path, orjson.dumps(body)) as reply:
                whole = await read_bounded(reply)
                if reply.status >= 400:
                    raise _native_refused(reply.status, whole)
            answer = orjson.loads(whole)
        if type(answer) is not dict or key not in answer:
            raise RunnerError(f"the upstream's {path} answered no {key}", NeedCode.UPSTREAM_ERROR)
        return answer[key]

    async def _prompt(self, answer: Continuation, template: str | None) -> list[int]:
        """The answer's prompt in tokens (a chat's ``template``), asked of llama-server once:
        a resume and a prompt's pieces need them."""
        if answer.prompt is None:
            text = template if template is not None else answer.ask.prompt
            answer.prompt = await self._tokens(text or "")
        return answer.prompt

    async def _tokens(self, text: str) -> list[int]:
        """``text`` as llama-server tokenizes a prompt (its special tokens too)."""
        tokens = await self._call(
            "/tokenize", {"content": text, "add_special": True, "parse_special": True}, "tokens"
        )
        if type(tokens) is not list or not all(type(t) is int for t in tokens):
            raise RunnerError(
                "the upstream's /tokenize answered no tokens", NeedCode.UPSTREAM_ERROR
            )
        return tokens


class Paused(Exception):
    """The attempt in progress was closed for its job's pause."""


class Attempt:
    """A pausable job's attempts: its pause closes the one in progress (its reading fails
    with :class:`Paused`), and the next waits until it is resumed."""

    __slots__ = ("_closed", "_pause", "_reply", "_resumed")

    def __init__(self, pause: Pause | None) -> None:
        self._pause = pause
        self._reply: Answer | None = None
        self._closed = False  # the reply in progress was closed for a pause
        self._resumed = asyncio.Event()
        self._resumed.set()
        if pause is not None:
            pause.listen(self._changed)

    def _changed(self, suspended: bool) -> None:
        if not suspended:
            self._resumed.set()
            return
        self._resumed.clear()
        if self._reply is not None:
            self._closed = True
            self._reply.abort()

    async def resumed(self) -> None:
        if not self._resumed.is_set():
            await self._resumed.wait()

    @contextlib.asynccontextmanager
    async def on(self, reply: Answer) -> AsyncIterator[None]:
        """Reading ``reply``: a pause closes it, and its failure is :class:`Paused`."""
        self._reply, self._closed = reply, False
        try:
            if not self._resumed.is_set():  # (paused while it was sent)
                raise Paused
            yield
        except UpstreamError:
            if not self._closed:  # (a failure of the upstream's, not a pause: even one
                raise  # resumed at once, whose reply is closed all the same)
            raise Paused from None
        finally:
            self._reply = None

    def close(self) -> None:
        if self._pause is not None:
            self._pause.listen(None)


def _described(native: Native | None, counted: bool) -> str:
    """What the runner learnt of its upstream at start, for the operator."""
    if native is None:
        return "not llama-server: no job is paused, prompts are not counted at the door"
    return (
        f"llama-server, {native.slots} slot(s) of {native.n_ctx} tokens: jobs it can continue "
        "may be paused; "
        + (
            "prompts counted at the door with its model"
            if counted
            else f"its model ({native.model_path or 'not named'}) cannot be read here: prompts "
            "are not counted at the door"
        )
    )


def _native_refused(status: int, body: bytes) -> RunnerError:
    detail = body[:300].decode(errors="replace")
    code = NeedCode.UPSTREAM_REJECTED if 400 <= status < 500 else NeedCode.UPSTREAM_ERROR
    return RunnerError(f"the upstream answered {status}: {detail}", code)


async def read_bounded(answer: Answer) -> bytes:
    """A whole answer of the upstream's, of :data:`MAX_ANSWER_BYTES` at most (RunnerError past
    that: the governor holds what it relays)."""
    parts, size = [], 0
    async for chunk in answer.chunks():
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise _too_large("answer")
        parts.append(chunk)
    return b"".join(parts)


def _too_large(what: str) -> RunnerError:
    return RunnerError(
        f"the upstream's {what} is over {MAX_ANSWER_BYTES} bytes", NeedCode.UPSTREAM_ERROR
    )


def _relayed(answer: Answer, body: bytes) -> Relayed:
    return Relayed(answer.status, answer.content_type or JSON, body)


def _refused(relayed: Relayed) -> RunnerError:
    """An upstream's answer other than 2xx, passed on as it came: the request's fault (4xx,
    ``upstream_rejected``), or the upstream's (a failure of the backend, ``upstream_error``,
    which its breaker counts)."""
    detail = relayed.body[:300].decode(errors="replace")
    message = f"the upstream answered {relayed.status}: {detail}"
    rejected = 400 <= relayed.status < 500
    return RunnerError(
        message, NeedCode.UPSTREAM_REJECTED if rejected else NeedCode.UPSTREAM_ERROR, relayed
    )


class StreamCounts:
    """What a forwarded stream's events say of the job: its generated pieces (content, text or
    tool calls, any choice), its finish, the upstream's usage where it sends one."""

    def __init__(self) -> None:
        self.generated = 0
        self.usage: Any = None
        self.finish: str | None = None

    def add(self, event: Any) -> str | None:
        """The event's generated text, its choices' together ("" for output that is no text:
        tool calls, reasoning), or None: it has none. (The usage: vLLM sends null until the
        last event.)"""
        if type(event) is not dict:
            return None
        self.usage = event.get("usage") or self.usage
        text = None
        for choice in event.get("choices") or ():
            if type(choice) is not dict:
                continue
            self.finish = choice.get("finish_reason") or self.finish
            delta = choice.get("delta")
            delta = delta if type(delta) is dict else {}
            piece = choice.get("text") or delta.get("content")
            if piece or delta.get("tool_calls") or delta.get("reasoning_content"):
                text = (text or "") + (piece if type(piece) is str else "")
        if text is not None:
            self.generated += 1
        return text

    def result(self) -> dict[str, Any]:
        return {**token_counts(self.usage, self.generated), "finish_reason": self.finish}


def whole_counts(body: bytes) -> dict[str, Any]:
    """A forwarded whole answer's counts, from its ``usage`` (none: null)."""
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        answer = None
    usage = answer.get("usage") if type(answer) is dict else None
    counts = token_counts(usage, 0)
    if counts["counted"] != "usage":
        counts["completion_tokens"] = None
    return counts


def token_counts(usage: Any, chunks: int) -> dict[str, Any]:
    """A result's ``prompt_tokens``, ``completion_tokens`` and ``counted``: the upstream's
    ``usage`` where it reported a count, else ``chunks`` (the streamed content chunks) for the
    completion and null for the prompt; and its ``cached_tokens`` where it reported them (in
    ``prompt_tokens_details``, as llama-server and vLLM do). A usage of the wrong shape counts
    as none."""
    reported = usage if isinstance(usage, dict) else {}
    prompt, completion = reported.get("prompt_tokens"), reported.get("completion_tokens")
    by_usage = _count(completion)
    counts = {
        "prompt_tokens": prompt if _count(prompt) else None,
        "completion_tokens": completion if by_usage else chunks,
        "counted": "usage" if by_usage else "chunks",
    }
    details = reported.get("prompt_tokens_details")
    if isinstance(details, dict) and _count(cached := details.get("cached_tokens")):
        counts["cached_tokens"] = cached
    return counts


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


async def sse_events(chunks: AsyncIterable[bytes]) -> AsyncIterator[Any]:
    """The JSON of each ``data:`` event of an OpenAI-style stream (its body's ``chunks``), up
    to ``data: [DONE]`` (``orjson.JSONDecodeError`` for one that is not JSON)."""
    async for _, event in sse_raw(chunks):
        if event is not None:  # (a comment, a keep-alive: no data)
            yield event


async def sse_raw(chunks: AsyncIterable[bytes]) -> AsyncIterator[tuple[bytes, Any]]:
    """Each event of an OpenAI-style stream (its body's ``chunks``) up to ``data: [DONE]``, as
    :class:`SseEvents` gives them."""
    events = SseEvents(MAX_ANSWER_BYTES)
    async for chunk in chunks:
        for event in events.feed(chunk):
            yield event
        if events.done:
            return
