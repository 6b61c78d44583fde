"""Where a load test sends its requests, and what it records of each: an :class:`Outcome`.

Two targets with one interface, so that one workload runs unchanged against both:

* :class:`GovernorTarget`: the governor's newline-JSON protocol through
  :class:`clients.GovernorClient`, a pool of connections, retrying on ``yield`` as told;
* :class:`FleetTarget`: the same protocol over several replicas of the governor, each client
  a :class:`clients.FleetClient` (a connection to every replica);
* :class:`OpenAITarget`: an OpenAI-compatible server's streamed ``/v1/completions`` or
  ``/v1/chat/completions``: the queueing baseline (llama-cpp-python's own server on the same
  model, llama.cpp's llama-server, or any such sidecar), or the governor's own front door, whose
  refusals (429 or 503 with ``retry-after-ms``) are yields, retried as the governor target's are.

The driver makes an :class:`Outcome` per request (``timed_out`` until told otherwise) and the
target fills it in as replies arrive, so a request cancelled at the deadline keeps what it had
(attempts, yields, tokens received).
"""

from __future__ import annotations

import asyncio
import collections
import email.utils
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import orjson

from clients.client import ClientError, GovernorClient, RetryBudget, RetryPolicy, UploadResult
from clients.fleet import FleetClient, FleetResult, Replicas, resolve
from governor.core.policy import LANES
from governor.runners.sidecar.runner import sse_events
from protocol.codes import NeedCode, Status
from protocol.frames import Reply
from protocol.spec import JobSpec, Message

from .connections import Endpoint, close_all, connect_all
from .workload import Request, synth_prompt

# Outcome statuses: every request ends in exactly one.
DONE = "done"
YIELDED = "yielded"  # the last answer was yield: retries spent, or none allowed
ABORTED = "aborted"  # abort, or a need that ended the request (HTTP errors for OpenAI)
TIMED_OUT = "timed_out"  # still outstanding at the deadline, then cancelled
ERROR = "error"  # the connection broke
STATUSES = (DONE, YIELDED, ABORTED, TIMED_OUT, ERROR)


@dataclass(slots=True)
class Outcome:
    """One request, as the client saw it; times are seconds from the run's start."""

    request: Request
    sent_s: float
    status: str = TIMED_OUT
    reason: str | None = None  # need_code, HTTP status or exception type
    end_s: float | None = None
    first_token_s: float | None = None
    tokens: int = 0  # output tokens received
    attempts: int = 0
    # Per yield: (when it reached the client, its need_code, ms from that attempt's send).
    yields: list[tuple[float, str, float]] = field(default_factory=list)
    first_retry_admitted: bool = False

    @property
    def ttft_ms(self) -> float | None:
        """From the first send to the first output, yields and retries included."""
        return None if self.first_token_s is None else (self.first_token_s - self.sent_s) * 1000

    @property
    def e2e_ms(self) -> float | None:
        return (
            None if self.status != DONE or self.end_s is None else (self.end_s - self.sent_s) * 1000
        )

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first (None below 2 tokens)."""
        if self.status != DONE or self.end_s is None or self.first_token_s is None:
            return None
        if self.tokens < 2:
            return None
        return (self.end_s - self.first_token_s) * 1000 / (self.tokens - 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """How requests are made up: an inference job from its tokens, a raw payload upload, or a
    ping; and whether each goes on a connection of its own."""

    payload_bytes: int | None = None  # set: upload this many random bytes (no tokens, no TTFT)
    chunk_bytes: int = 8192
    temperature: float = 0.0
    send_lane: bool = True  # governor: a class named like a lane asks for that lane
    ping: bool = False  # governor: a ping instead of a job (the protocol's cheapest exchange)
    reconnect: bool = False  # governor: a new connection per request, closed after it
    chat: bool = False  # the prompt goes as one user message, through the chat template
    ignore_eos: bool = False  # governor: generate max_new_tokens whatever the model says
    # Fixed prompts, request i taking prompts[i % len(prompts)]; empty: synthetic ones.
    prompts: tuple[str, ...] = ()
    max_wait: float | None = None  # governor: seconds a job may wait for its turn (max_wait_ms)

    def prompt(self, request: Request, index: int) -> str:
        if self.prompts:
            return self.prompts[index % len(self.prompts)]
        return synth_prompt(request.prompt_tokens, f"r{index}")


class Target(Protocol):
    kind: str  # "governor" or "openai"
    addr: str

    async def open(self, connections: int, *, timeout: float) -> None: ...

    async def send(self, index: int, outcome: Outcome, t0: float, connection: int) -> None: ...

    async def close(self) -> None: ...


def _since(t0: float) -> float:
    return time.monotonic() - t0


class GovernorTarget:
    kind = "governor"

    def __init__(
        self,
        endpoint: Endpoint,
        shape: Shape,
        retry: RetryPolicy,
        metrics: tuple[str, int] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.addr = endpoint.addr
        self.shape = shape
        self.retry = retry
        self.metrics = metrics  # its --metrics-listen: how its hints landed is read there
        self.clients: list[GovernorClient] = []
        self._timeout = 10.0

    async def open(self, connections: int, *, timeout: float) -> None:
        self._timeout = timeout
        count = 0 if self.shape.reconnect else connections
        await connect_all(self.endpoint, count, opened=self.clients, timeout=timeout)

    async def close(self) -> None:
        clients, self.clients = self.clients, []
        await close_all(clients)

    async def send(self, index: int, outcome: Outcome, t0: float, connection: int) -> None:
        try:
            if not self.shape.reconnect:
                await self._send(self.clients[connection % len(self.clients)], index, outcome, t0)
                return
            client = await self.endpoint.connect(timeout=self._timeout)
            try:
                await self._send(client, index, outcome, t0)
            finally:
                await client.close()
        except (ClientError, OSError, TimeoutError) as exc:
            outcome.status, outcome.reason, outcome.end_s = ERROR, type(exc).__name__, _since(t0)

    async def _send(self, client: GovernorClient, index: int, outcome: Outcome, t0: float) -> None:
        await exchange(client, self.shape, self.retry, index, outcome, t0)


class FleetTarget:
    """The governor over several replicas: each of the driver's connections is a
    :class:`FleetClient` with a connection to every replica, and all of them share one
    :class:`Replicas` (what one client learns of a replica's load, the others use).

    ``addr`` is the addresses as given, comma-separated. There is no monitor: a monitor pings
    one governor, and its inflight would be one replica's.
    """

    kind = "governor"

    def __init__(self, endpoints: Sequence[Endpoint], shape: Shape, retry: RetryPolicy) -> None:
        if not endpoints:
            raise ValueError("a fleet needs at least one address")
        self.endpoints = list(endpoints)
        self.addr = ",".join(e.addr for e in self.endpoints)
        self.shape = shape
        self.retry = retry
        self.replicas: Replicas | None = None
        self.clients: list[FleetClient] = []
        self.done_by: collections.Counter[str] = collections.Counter()  # jobs done, by replica
        self._timeout = 10.0

    def _client(self) -> FleetClient:
        assert self.replicas is not None, "open() first"
        first = self.endpoints[0]  # (every endpoint has the same TLS options)
        return FleetClient(
            self.replicas,
            api_key=first.api_key,
            ssl=first.ssl,
            server_hostname=first.server_hostname,
            connect_timeout=self._timeout,
        )

    async def open(self, connections: int, *, timeout: float) -> None:
        """Resolve the addresses and connect every client to every replica; raises
        :class:`clients.NoReplicaAvailable` when a client can reach none."""
        self._timeout = timeout
        async with asyncio.timeout(timeout):
            found = await resolve([e.addr for e in self.endpoints])
        self.replicas = Replicas(found)
        count = 0 if self.shape.reconnect else connections
        self.clients = [self._client() for _ in range(count)]
        async with asyncio.TaskGroup() as group:
            for client in self.clients:
                group.create_task(client.open())

    async def close(self) -> None:
        clients, self.clients = self.clients, []
        await close_all(clients)

    def replica_counts(self) -> dict[str, int]:
        """Jobs done by each replica (every replica named, 0 for one that finished none)."""
        counts = (
            dict.fromkeys((a.name for a in self.replicas.addresses), 0) if self.replicas else {}
        )
        counts.update(self.done_by)
        return counts

    async def send(self, index: int, outcome: Outcome, t0: float, connection: int) -> None:
        try:
            if not self.shape.reconnect:
                client = self.clients[connection % len(self.clients)]
                self._count(await exchange(client, self.shape, self.retry, index, outcome, t0))
                return
            async with self._client() as client:
                self._count(await exchange(client, self.shape, self.retry, index, outcome, t0))
        except (ClientError, OSError, TimeoutError) as exc:
            outcome.status, outcome.reason, outcome.end_s = ERROR, type(exc).__name__, _since(t0)

    def _count(self, result: UploadResult | None) -> None:
        if isinstance(result, FleetResult) and result.done:
            self.done_by[result.replica] += 1


async def exchange(
    client: GovernorClient | FleetClient,
    shape: Shape,
    retry: RetryPolicy,
    index: int,
    outcome: Outcome,
    t0: float,
) -> UploadResult | None:
    """Send request ``index`` as ``shape`` says and fill in ``outcome``; the job's result
    (None for a ping)."""
    req = outcome.request

    def on_attempt(sent_at: float, reply: Reply) -> None:
        outcome.attempts += 1
        if reply.status == Status.YIELD:
            now = time.monotonic()
            outcome.yields.append((now - t0, reply.need_code or "?", (now - sent_at) * 1000))

    def on_delta(text: str) -> None:
        if outcome.first_token_s is None:
            outcome.first_token_s = _since(t0)
        outcome.tokens += 1

    job = f"{req.cls}-{index}"
    if shape.ping:
        outcome.attempts = 1
        reply = await client.ping()
        outcome.end_s = outcome.first_token_s = _since(t0)
        outcome.status, outcome.reason = (
            (DONE, None)
            if reply.status == Status.OK
            else (ABORTED, reply.need_code or str(reply.status))
        )
        return None
    if shape.payload_bytes is not None:
        result = await client.upload(
            random.Random(index).randbytes(shape.payload_bytes),
            job=job,
            chunk_bytes=shape.chunk_bytes,
            retry=retry,
            on_attempt=on_attempt,
            max_wait=shape.max_wait,
        )
    else:
        text = shape.prompt(req, index)
        spec = JobSpec(
            prompt=None if shape.chat else text,
            messages=(Message("user", text),) if shape.chat else None,
            max_new_tokens=req.output_tokens,
            temperature=shape.temperature,
            seed=index,
            ignore_eos=shape.ignore_eos,
            stream=True,
            lane=req.cls if shape.send_lane and req.cls in LANES else None,
        )
        result = await client.generate(
            spec,
            job=job,
            retry=retry,
            on_attempt=on_attempt,
            on_delta=on_delta,
            max_wait=shape.max_wait,
        )
    outcome.end_s = _since(t0)
    outcome.first_retry_admitted = result.attempts == 2 and result.admitted_at is not None
    reply = result.reply
    if reply.status == Status.DONE:
        outcome.status = DONE
        if outcome.first_token_s is None:  # a payload job's output is its done frame
            outcome.first_token_s = outcome.end_s
        tokens = (reply.result or {}).get("completion_tokens")
        if isinstance(tokens, int):
            outcome.tokens = tokens
    elif reply.status == Status.YIELD:
        outcome.status, outcome.reason = YIELDED, reply.need_code or "?"
    else:
        outcome.status, outcome.reason = ABORTED, reply.need_code or str(reply.status)
    return result


# HTTP statuses that are a refusal (a yield) when they carry a hint; any other is an abort.
YIELD_STATUSES = frozenset({429, 503})


def retry_hint_ms(headers: Mapping[str, str]) -> int | None:
    """A refusal's hint in ms, read as the OpenAI SDKs read it: ``retry-after-ms``, else
    ``Retry-After`` (seconds, or an HTTP date); None when neither is there or makes sense."""
    for name, scale in (("retry-after-ms", 1), ("retry-after", 1000)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            amount = float(value) * scale
        except ValueError:
            if name == "retry-after-ms":
                continue
            try:  # an HTTP date
                amount = (email.utils.parsedate_to_datetime(value).timestamp() - time.time()) * 1000
            except (TypeError, ValueError):
                return None
            amount = max(amount, 0.0)
        return math.ceil(amount) if math.isfinite(amount) and amount >= 0 else None
    return None


def error_code(body: bytes) -> str | None:
    """The ``code`` of an OpenAI-style error body ``{"error": {"code": ...}}`` (the governor's
    front door puts its need code there); None when the body is not one."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    error = obj.get("error") if isinstance(obj, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) and code else None


@dataclass(frozen=True, slots=True)
class _Refused:
    """An attempt that did not stream to its end: its status, the error's code (None when its
    body had none), the hint (None: not a yield) and, for a stream cut by an ``error`` event,
    the reason it ends with."""

    status: int
    code: str | None
    hint_ms: int | None = None
    reason: str | None = None


class OpenAITarget:
    """Streamed ``POST /v1/completions`` (``/v1/chat/completions`` for a chat shape) on an
    OpenAI-compatible server.

    ``extra`` goes into every request body as is: a server's own fields, such as llama-server's
    ``ignore_eos`` and ``cache_prompt``. A server that reports ``usage`` (ask with
    ``"stream_options": {"include_usage": true}``) has its completion token count taken over
    the count of chunks with text.

    A 429 or 503 carrying a hint (``retry-after-ms``, else ``Retry-After``) is a yield, as the
    governor's front door answers when it has no slot: recorded on the outcome with the error
    body's ``code`` (the need code) and retried as ``retry`` says, after ``retry.delay_s`` of the
    hint, with the identical body (the front door keeps its place in line). As
    :class:`clients.GovernorClient` does, a ``draining`` yield is never retried, and a
    ``breaker_open`` one only while the target's :class:`~clients.client.RetryBudget` allows
    (shared by its requests) and its hint is within ``retry.max_sleep_s``. Any other status is
    an abort (``http_<status>``); a stream that ends with an ``error`` event is one too (its
    code as the reason). A queueing server never yields: it is loaded as before.

    ``api_key``: sent as ``Authorization: Bearer KEY`` on every request (the governor's front
    door with tenants declared; a server that wants no key ignores it).
    """

    kind = "openai"

    def __init__(
        self,
        url: str,
        shape: Shape,
        model: str | None = None,
        extra: dict[str, Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
        api_key: str | None = None,
    ) -> None:
        self.addr = url.rstrip("/")
        self.shape = shape
        self.model = model
        self.extra = dict(extra or {})
        self.retry = retry if retry is not None else RetryPolicy()
        self.budget = RetryBudget()
        self._rng = random.Random()
        self._http: httpx.AsyncClient | None = None
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key is not None else {}

    async def open(self, connections: int, *, timeout: float) -> None:
        self._http = httpx.AsyncClient(
            base_url=self.addr,
            headers=self._headers,
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
            timeout=httpx.Timeout(None, connect=timeout),
        )
        try:  # reachable before the start, as the governor target's connections are
            (await self._http.get("/v1/models")).raise_for_status()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def body(self, index: int, request: Request) -> dict[str, Any]:
        shape = self.shape
        text = shape.prompt(request, index)
        body: dict[str, Any] = {
            "max_tokens": request.output_tokens,
            "temperature": shape.temperature,
            "seed": index,
            "stream": True,
            **self.extra,
        }
        if shape.chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        if self.model:
            body["model"] = self.model
        return body

    async def send(self, index: int, outcome: Outcome, t0: float, connection: int) -> None:
        assert self._http is not None, "open() first"
        path = "/v1/chat/completions" if self.shape.chat else "/v1/completions"
        content = orjson.dumps(self.body(index, outcome.request))  # the same bytes every attempt
        retry = self.retry
        while True:
            sent_at = time.monotonic()
            outcome.attempts += 1
            try:
                refused = await self._attempt(path, content, outcome, t0)
            except (httpx.HTTPError, orjson.JSONDecodeError, OSError) as exc:
                outcome.status, outcome.reason = ERROR, type(exc).__name__
                outcome.end_s = _since(t0)
                return
            if refused is None:  # streamed to its end
                self.budget.record_success()
                outcome.status, outcome.end_s = DONE, _since(t0)
                outcome.first_retry_admitted = outcome.attempts == 2
                return
            if refused.hint_ms is None or refused.status not in YIELD_STATUSES:
                if refused.code == NeedCode.BACKEND_ERROR:
                    self.budget.record_failure()
                outcome.status, outcome.end_s = ABORTED, _since(t0)
                outcome.reason = refused.reason or f"http_{refused.status}"
                return
            now = time.monotonic()
            code = refused.code or f"http_{refused.status}"
            outcome.yields.append((now - t0, code, (now - sent_at) * 1000))
            failing = code == NeedCode.BREAKER_OPEN
            if failing:
                self.budget.record_failure()
            if (
                outcome.attempts >= retry.max_attempts
                or code == NeedCode.DRAINING
                or (failing and not self.budget.allows_retry())
                or (failing and refused.hint_ms / 1000 > retry.max_sleep_s)
            ):
                outcome.status, outcome.reason, outcome.end_s = YIELDED, code, _since(t0)
                return
            await asyncio.sleep(retry.delay_s(refused.hint_ms, self._rng))

    async def _attempt(
        self, path: str, content: bytes, outcome: Outcome, t0: float
    ) -> _Refused | None:
        """One attempt: None when its stream ran to its end (the outcome has its tokens), else
        what refused it, or what cut the stream (an ``error`` event, after its 200)."""
        assert self._http is not None
        shape = self.shape
        reported: int | None = None
        headers = {"content-type": "application/json"}
        async with self._http.stream("POST", path, content=content, headers=headers) as response:
            if response.status_code != 200:
                body = await response.aread()
                hint = retry_hint_ms(response.headers)
                return _Refused(response.status_code, error_code(body), hint_ms=hint)
            async for chunk in sse_events(response.aiter_bytes()):
                error = chunk.get("error")
                if isinstance(error, dict):
                    code = error.get("code")
                    code = code if isinstance(code, str) and code else None
                    return _Refused(200, code, reason=code or "stream_error")
                choice = (chunk.get("choices") or [{}])[0]
                if shape.chat:
                    piece = (choice.get("delta") or {}).get("content")
                else:
                    piece = choice.get("text")
                if piece:
                    if outcome.first_token_s is None:
                        outcome.first_token_s = _since(t0)
                    outcome.tokens += 1
                usage = chunk.get("usage") or {}
                if isinstance(usage.get("completion_tokens"), int):
                    reported = usage["completion_tokens"]
        if reported is not None:
            outcome.tokens = reported
        return None
