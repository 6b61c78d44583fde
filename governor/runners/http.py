"""The ``http`` runner: the governor as a sidecar in front of an OpenAI-compatible server.

Each admitted job is one streamed request to the upstream (``/v1/completions`` for a prompt,
``/v1/chat/completions`` for messages): llama.cpp's llama-server, vLLM, llama-cpp-python's own
server. Streaming upstream even when the client did not ask for it gives the time to first
token, and lets a cancelled job close its request at once. The upstream's errors and silences
become ``upstream_error`` and ``upstream_timeout`` aborts. HTTP is httpx's: connection pooling,
timeouts and streamed bodies are what it does well.

Token counts come from the upstream's ``usage`` when it sends one in the stream (it is asked
with ``stream_options: {"include_usage": true}``; llama-server and vLLM send it, in the last
chunk; llama-cpp-python's server sends none in a stream); otherwise ``completion_tokens``
counts the streamed content chunks (one per token on llama.cpp's servers) and
``prompt_tokens`` is null: the runner has no tokenizer to count it with. ``result.counted``
says which (:func:`token_counts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from protocol.codes import NeedCode
from protocol.spec import JobSpec

from .base import (
    Finished,
    Job,
    RunEvent,
    RunnerError,
    RunnerHealth,
    RunnerStartError,
    Token,
    probe_job,
    spec_or_prompt,
)

FINISH_REASONS = {"stop": "stop", "length": "length", "eos": "stop"}


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpSettings:
    upstream: str  # base URL, e.g. http://127.0.0.1:8080
    model: str | None = None  # the "model" field of each request; None: the upstream's default
    max_new_tokens: int = 1024
    timeout_s: float = 120.0  # the upstream may stay silent this long under a job
    start_timeout_s: float = 60.0  # how long start() waits for the upstream to answer


class HttpRunner:
    name = "http"

    def __init__(self, settings: HttpSettings) -> None:
        self.settings = settings
        self._client: httpx.AsyncClient | None = None

    @property
    def expected_service_s(self) -> float:
        return 2.0

    async def start(self) -> None:
        s = self.settings
        self._client = httpx.AsyncClient(
            base_url=s.upstream.rstrip("/"),
            timeout=httpx.Timeout(s.timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        deadline = time.monotonic() + s.start_timeout_s
        while True:  # a sidecar may start before the server it fronts
            try:
                response = await self._client.get("/v1/models", timeout=5.0)
                if response.status_code < 500:
                    return
                problem = f"answered {response.status_code}"
            except httpx.HTTPError as exc:
                problem = f"cannot be reached ({type(exc).__name__})"
            if time.monotonic() > deadline:
                await self.close()
                raise RunnerStartError(
                    f"the upstream {s.upstream} {problem} after {s.start_timeout_s:g} s"
                )
            await asyncio.sleep(0.5)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

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

    def prepare(self, job_id: str, spec: JobSpec | None, payload: bytes = b"") -> Job:
        # No tokenizer here: a prompt too long for the upstream's context is its error to give.
        spec = spec_or_prompt(spec, payload, self.settings.max_new_tokens)
        return Job(job_id, payload, spec=spec, stop=spec.stop)

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

    async def run(self, job: Job) -> AsyncGenerator[RunEvent, None]:
        spec = job.spec
        assert spec is not None
        assert self._client is not None
        path, body = self._request(spec)
        parts: list[str] = []
        usage: dict[str, Any] | None = None
        finish = None
        try:
            async with self._client.stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    detail = (await response.aread())[:300].decode(errors="replace")
                    raise RunnerError(
                        f"the upstream answered {response.status_code}: {detail}",
                        NeedCode.UPSTREAM_ERROR,
                    )
                async for event in sse_events(response):
                    usage = event.get("usage") or usage  # (vLLM sends null until the last)
                    for choice in event.get("choices") or ():
                        finish = choice.get("finish_reason") or finish
                        text = choice.get("text")
                        if text is None:
                            text = (choice.get("delta") or {}).get("content")
                        if text:
                            parts.append(text)
                            yield Token(text)
        except httpx.TimeoutException:
            raise RunnerError(
                f"the upstream sent nothing for {self.settings.timeout_s:g} s",
                NeedCode.UPSTREAM_TIMEOUT,
            ) from None
        except (httpx.HTTPError, orjson.JSONDecodeError, AttributeError) as exc:
            raise RunnerError(f"the upstream failed: {exc!r}", NeedCode.UPSTREAM_ERROR) from None
        # (ttft_ms and tpot_ms are the governor's, measured from admission.)
        yield Finished(
            {
                "text": "".join(parts),
                **token_counts(usage, len(parts)),
                "finish_reason": FINISH_REASONS.get(finish or "", finish),
            }
        )


def token_counts(usage: Any, chunks: int) -> dict[str, Any]:
    """A result's ``prompt_tokens``, ``completion_tokens`` and ``counted``: the upstream's
    ``usage`` where it reported a count, else ``chunks`` (the streamed content chunks) for the
    completion and null for the prompt. A usage of the wrong shape counts as none."""
    reported = usage if isinstance(usage, dict) else {}
    prompt, completion = reported.get("prompt_tokens"), reported.get("completion_tokens")
    by_usage = _count(completion)
    return {
        "prompt_tokens": prompt if _count(prompt) else None,
        "completion_tokens": completion if by_usage else chunks,
        "counted": "usage" if by_usage else "chunks",
    }


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


async def sse_events(response: httpx.Response) -> AsyncIterator[Any]:
    """The JSON of each ``data:`` event of an OpenAI-style stream, up to ``data: [DONE]``
    (``orjson.JSONDecodeError`` for one that is not JSON)."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield orjson.loads(data)
