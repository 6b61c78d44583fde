"""The clients of ``bench sdk-bench``: the official OpenAI SDK's, each sending its chats, and
what each request came to."""

from __future__ import annotations

import argparse
import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .servers import API_KEY

if TYPE_CHECKING:
    import httpx2
    import openai

RUN_TIMEOUT = "RunTimeout"  # a request still outstanding when --run-timeout ended the run


def prompt(k: int) -> str:
    """Request ``k``'s question: its own, and as long as every other one (up to 10,000), so
    that no request is more work than another, and the governor's hints, which it predicts
    from a job's prompt length and the jobs before it, are not thrown off by the prompts."""
    return f"Client {k:04d} asks: in one sentence, what is the sea?"


@dataclass(slots=True)
class Record:
    """One request as its client saw it; times in seconds from the run's start."""

    sent_s: float
    first_s: float | None = None  # the first content delta
    end_s: float | None = None
    tokens: int = 0  # usage's completion_tokens, else content deltas
    usage: bool = False  # the server reported usage
    error: str | None = None  # the exception's type, when it failed
    # Each HTTP answer its attempts got: (seconds from the run's start, status, retry-after-ms).
    answers: list[tuple[float, int, str | None]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.end_s is not None and self.error is None


@dataclass(slots=True)
class Load:
    """What one run's clients saw."""

    records: list[Record] = field(default_factory=list)
    wall_s: float = 0.0
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)


async def chat(
    client: openai.AsyncOpenAI,
    model: str,
    text: str,
    seed: int,
    max_tokens: int,
    record: Record,
    t0: float,
) -> None:
    """One streamed chat completion, filling in ``record``: any exception the SDK raises (its
    retries spent, a timeout, a broken stream) fails the request, named by its type."""
    deltas = 0
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens,
            temperature=0,
            seed=seed,
            stream=True,
            stream_options={"include_usage": True},
        )
        async with stream:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if record.first_s is None:
                        record.first_s = time.monotonic() - t0
                    deltas += 1
                if chunk.usage is not None:
                    record.tokens, record.usage = chunk.usage.completion_tokens, True
    except Exception as exc:  # (what the user of the SDK would have to handle)
        record.error = type(exc).__name__
    if not record.usage:
        record.tokens = deltas
    record.end_s = time.monotonic() - t0


async def model_of(url: str, args: argparse.Namespace) -> str:
    """The server's model (the first ``/v1/models`` lists), after one warm-up request, not
    counted, so that neither server's first-request costs fall in a run. It is one of the
    run's kind (a :func:`prompt` as long, the run's ``max_tokens``): the governor learns a
    job's expected time from the jobs before it, and its hints follow."""
    import openai

    async with openai.AsyncOpenAI(
        base_url=url, api_key=API_KEY, **_timeout(args.request_timeout)
    ) as probe:
        model = (await probe.models.list()).data[0].id
        record = Record(0.0)
        warmup = args.clients * args.requests_per_client  # (a question no request asks)
        await chat(probe, model, prompt(warmup), warmup, args.max_tokens, record, time.monotonic())
    if record.error is not None:
        raise RuntimeError(f"the warm-up request failed: {record.error}")
    return model


def max_retries(args: argparse.Namespace) -> int:
    """``--max-retries``, else the SDK's own default."""
    import openai

    return openai.DEFAULT_MAX_RETRIES if args.max_retries is None else int(args.max_retries)


def _timeout(seconds: float | None) -> dict[str, Any]:
    """The SDK's ``timeout`` argument: left out (its default) unless given."""
    return {} if seconds is None else {"timeout": seconds}


async def load(url: str, args: argparse.Namespace) -> Load:
    """``args.clients`` SDK clients with ``args.max_retries`` retries (None: the SDK's
    default), started together, each sending
    ``args.requests_per_client`` requests one after the other; bounded by ``args.run_timeout``
    (requests outstanding then fail as ``RunTimeout``, and those not yet sent are not)."""
    import openai

    model = await model_of(url, args)
    run = Load()

    current: dict[int, Record] = {}  # each client's request in flight

    def seen(index: int) -> Callable[[httpx2.Response], Awaitable[None]]:
        async def hook(response: httpx2.Response) -> None:
            if response.request.method == "POST":
                run.statuses[response.status_code] += 1
                hint = response.headers.get("retry-after-ms")
                current[index].answers.append(
                    (round(time.monotonic() - t0, 3), response.status_code, hint)
                )

        return hook

    clients = [
        openai.AsyncOpenAI(
            base_url=url,
            api_key=API_KEY,
            http_client=openai.DefaultAsyncHttpxClient(event_hooks={"response": [seen(i)]}),
            max_retries=max_retries(args),
            **_timeout(args.request_timeout),
        )
        for i in range(args.clients)
    ]
    per_client = args.requests_per_client
    t0 = time.monotonic()

    async def one_client(index: int) -> None:
        for r in range(per_client):
            k = index * per_client + r
            record = current[index] = Record(time.monotonic() - t0)
            run.records.append(record)
            await chat(clients[index], model, prompt(k), k, args.max_tokens, record, t0)

    try:
        async with asyncio.timeout(args.run_timeout):
            await asyncio.gather(*(one_client(i) for i in range(args.clients)))
    except TimeoutError:
        pass
    finally:
        run.wall_s = time.monotonic() - t0
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
    for record in run.records:
        if record.end_s is None:
            record.error, record.end_s = RUN_TIMEOUT, run.wall_s
    return run
