"""The sidecar is transparent: through the ``http`` runner, an OpenAI request reaches the
upstream as the client sent it (the governor's own fields aside), and the upstream's answer
reaches the client as it came: streamed events, tool calls, log probabilities, several
choices, its errors. Against an upstream that records what it receives and answers what the
test tells it to; the real servers are in ``tests/system/test_sidecar_servers.py``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import h11
import httpx
import openai
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clients import NO_RETRY, GovernorClient
from governor.config import Config
from governor.listeners import openai_api as api
from governor.runners.base import PROBE_SPEC
from governor.runners.sidecar import runner as http_runner
from governor.runners.sidecar.runner import HttpRunner, HttpSettings
from governor.server import Server
from protocol.spec import GOVERNOR_FIELDS, JobSpec
from tests.conftest import ServerFactory

CEILING = 256  # the runner's max_new_tokens


@dataclass
class Received:
    method: str
    path: str
    body: bytes


@dataclass
class Answer:
    status: int = 200
    content_type: str = "application/json"
    body: bytes = b"{}"
    events: list[bytes] | None = None  # a stream's, each sent as a chunk of its own


@dataclass
class Upstream:
    """An OpenAI-compatible server that keeps every request it receives and answers each path
    as ``answers`` says (``/v1/models``: a list of one model)."""

    url: str = ""
    received: list[Received] = field(default_factory=list)
    answers: dict[str, Answer] = field(default_factory=dict)

    def jobs(self) -> list[Received]:
        """The requests for jobs: not the runner's start-up checks (its models, and whether it
        is llama-server), nor its readiness probes."""
        start = ("/v1/models", "/props")
        return [r for r in self.received if r.path not in start and not _probe(r)]


def _probe(request: Received) -> bool:
    if request.path != "/v1/completions":
        return False
    body = orjson.loads(request.body)
    return bool(body.get("prompt") == PROBE_SPEC.prompt and body.get("max_tokens") == 1)


async def _serve(
    upstream: Upstream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    conn = h11.Connection(h11.SERVER)
    with contextlib.suppress(OSError, asyncio.CancelledError, h11.ProtocolError):
        while True:
            request: h11.Request | None = None
            body = b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(65536)
                    conn.receive_data(data)
                    if not data:
                        return
                elif isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    return
            assert request is not None
            path = request.target.decode()
            upstream.received.append(Received(request.method.decode(), path, body))
            models = Answer(body=b'{"object":"list","data":[{"id":"up","object":"model"}]}')
            answer = upstream.answers.get(path, models if path == "/v1/models" else Answer())
            headers = [("content-type", answer.content_type)]
            if answer.events is None:
                headers.append(("content-length", str(len(answer.body))))
            writer.write(conn.send(h11.Response(status_code=answer.status, headers=headers)) or b"")
            for chunk in answer.events if answer.events is not None else [answer.body]:
                writer.write(conn.send(h11.Data(data=chunk)) or b"")
                await writer.drain()
            writer.write(conn.send(h11.EndOfMessage()) or b"")
            await writer.drain()
            conn.start_next_cycle()


@contextlib.asynccontextmanager
async def recording_upstream() -> AsyncIterator[Upstream]:
    upstream = Upstream()
    tasks: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await _serve(upstream, reader, writer)
        finally:
            writer.close()

    listener = await asyncio.start_server(handle, "127.0.0.1", 0)
    upstream.url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    try:
        yield upstream
    finally:
        listener.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def sidecar(make_server: ServerFactory, upstream: Upstream, **config: Any) -> Server:
    config.setdefault("max_new_tokens", CEILING)
    return await make_server(
        runner="http", upstream=upstream.url, http_listen="127.0.0.1:0", **config
    )


def base(server: Server) -> str:
    address = server.http_address
    assert address is not None
    return f"http://{address[0]}:{address[1]}"


async def post(server: Server, path: str, body: bytes, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base(server), timeout=30) as client:
        return await client.post(path, content=body, headers=headers)


# What reaches the upstream ------------------------------------------------------------------

AGENT_CHAT = {
    "model": "whatever-the-client-calls-it",
    "messages": [
        {"role": "system", "content": "You call tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ],
    "tool_choice": {"type": "function", "function": {"name": "weather"}},
    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
    "logprobs": True,
    "top_logprobs": 2,
    "n": 2,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.25,
    "logit_bias": {"15": -100},
    "max_completion_tokens": 12,
    "top_k": 40,
    "min_p": 0.05,
    "repeat_penalty": 1.1,
    "grammar": 'root ::= "x"',
    "chat_template_kwargs": {"enable_thinking": False},
    "parallel_tool_calls": False,
}


# Beyond OpenAI's API (the SDK sends them as extra_body).
LLAMA_SERVER_FIELDS = ("top_k", "min_p", "repeat_penalty", "grammar", "chat_template_kwargs")


async def test_a_request_reaches_the_upstream_byte_for_byte(make_server: ServerFactory) -> None:
    async with recording_upstream() as upstream:
        server = await sidecar(make_server, upstream)
        body = orjson.dumps(AGENT_CHAT, option=orjson.OPT_INDENT_2)  # (its spacing too)
        response = await post(server, "/v1/chat/completions", body)
    assert response.status_code == 200
    (job,) = upstream.jobs()
    assert (job.method, job.path, job.body) == ("POST", "/v1/chat/completions", body)


async def test_the_governors_fields_stay_with_the_governor(make_server: ServerFactory) -> None:
    """``lane`` and the objectives are for admission; the length the operator bounds (none
    asked for: the ceiling); the rest goes as it came."""
    async with recording_upstream() as upstream:
        server = await sidecar(make_server, upstream)
        asked = {
            "prompt": "hi",
            "lane": "interactive",
            "ttft_slo_ms": 900,
            "top_k": 3,
            "echo": True,
        }
        response = await post(server, "/v1/completions", orjson.dumps(asked))
    assert response.status_code == 200
    (job,) = upstream.jobs()
    assert orjson.loads(job.body) == {
        "prompt": "hi",
        "top_k": 3,
        "echo": True,
        "max_tokens": CEILING,
    }


async def test_the_upstream_model_name_replaces_the_clients(make_server: ServerFactory) -> None:
    async with recording_upstream() as upstream:
        server = await sidecar(make_server, upstream, upstream_model="served")
        body = {"model": "gpt-4o", "prompt": "hi", "max_tokens": 3}
        await post(server, "/v1/completions", orjson.dumps(body))
    (job,) = upstream.jobs()
    assert orjson.loads(job.body) == {**body, "model": "served"}


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)
# Fields the governor reads (their values it checks) or keeps: the others are the upstream's.
READ = {"messages", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options"}
EXTRA = st.dictionaries(
    st.text(min_size=1, max_size=12).filter(lambda k: k not in READ | GOVERNOR_FIELDS),
    JSON_VALUES,
    max_size=6,
)


@settings(max_examples=40, deadline=None)
@given(EXTRA)
def test_any_extra_fields_reach_the_upstream_unchanged(extra: dict[str, Any]) -> None:
    """Whatever fields a client adds (vLLM's, llama-server's, ones not yet invented), the
    upstream receives them as they were: through a real server, sockets and all."""

    async def scenario() -> bytes:
        async with recording_upstream() as upstream:
            server = Server(_config(upstream.url))
            await server.start()
            try:
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
                response = await post(server, "/v1/chat/completions", orjson.dumps(body))
                assert response.status_code == 200, response.text
            finally:
                await server.close()
        (job,) = upstream.jobs()
        return job.body

    received = asyncio.run(scenario())
    assert orjson.loads(received) == {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **extra,
    }


def _config(upstream: str) -> Config:
    return Config(
        listen="127.0.0.1:0",
        runner="http",
        upstream=upstream,
        http_listen="127.0.0.1:0",
        max_new_tokens=CEILING,
    )


# What reaches the client ---------------------------------------------------------------------


def chunk(choices: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-up",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "up",
        "system_fingerprint": "fp_up",
        "choices": choices,
        **more,
    }


TOP = [
    {"token": "{", "logprob": -0.1, "bytes": [123]},
    {"token": "[", "logprob": -2.5, "bytes": [91]},
]
STREAM = [
    chunk([{"index": i, "delta": {"role": "assistant", "content": None}} for i in (0, 1)]),
    chunk(
        [
            {
                "index": 0,
                "delta": {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_up",
                            "type": "function",
                            "function": {"name": "weather", "arguments": ""},
                        }
                    ]
                },
                "logprobs": {
                    "content": [
                        {"token": "{", "logprob": -0.1, "bytes": [123], "top_logprobs": TOP}
                    ]
                },
            }
        ]
    ),
    chunk(
        [
            {
                "index": 0,
                "delta": {
                    "tool_calls": [{"index": 0, "function": {"arguments": '{"city":"Oslo"}'}}]
                },
            }
        ]
    ),
    chunk([{"index": 1, "delta": {"content": "It is cold."}}]),
    chunk([{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]),
    chunk([{"index": 1, "delta": {}, "finish_reason": "stop"}]),
    chunk([], usage={"prompt_tokens": 30, "completion_tokens": 9, "total_tokens": 39}),
]


def sse(events: list[dict[str, Any]]) -> list[bytes]:
    return [b"data: " + orjson.dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


async def test_a_stream_comes_back_event_for_event(make_server: ServerFactory) -> None:
    async with recording_upstream() as upstream:
        upstream.answers["/v1/chat/completions"] = Answer(
            content_type="text/event-stream", events=sse(STREAM)
        )
        server = await sidecar(make_server, upstream)
        body: dict[str, Any] = {
            **AGENT_CHAT,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        response = await post(server, "/v1/chat/completions", orjson.dumps(body))
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        assert response.content == b"".join(sse(STREAM))
        # And the SDK reads it as it would from the upstream: the tool call, both choices.
        client = openai.AsyncOpenAI(base_url=base(server) + "/v1", api_key="none", max_retries=0)
        async with client:
            extra = {k: body.pop(k) for k in LLAMA_SERVER_FIELDS}
            stream = await client.chat.completions.create(**body, extra_body=extra)
            chunks = [c async for c in stream]
    calls = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or ()]
    assert calls[0].function is not None
    assert (calls[0].id, calls[0].function.name) == ("call_up", "weather")
    assert "".join(tc.function.arguments or "" for tc in calls if tc.function) == '{"city":"Oslo"}'
    assert {ch.index for c in chunks for ch in c.choices} == {0, 1}
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == 39
    assert {c.system_fingerprint for c in chunks} == {"fp_up"}
    assert server.ledger.inflight == 0


async def test_a_stream_is_timed_from_its_tokens(make_server: ServerFactory) -> None:
    """The role event is not a token: the job's time to first token is its first piece of
    output's, and its counts the upstream's usage."""
    async with recording_upstream() as upstream:
        upstream.answers["/v1/chat/completions"] = Answer(
            content_type="text/event-stream", events=sse(STREAM)
        )
        server = await sidecar(make_server, upstream)
        runner = server.admission.primary.runner
        assert isinstance(runner, HttpRunner)
        call = api.parse_call(
            orjson.dumps({**AGENT_CHAT, "stream": True}),
            kind=api.CHAT,
            lane_header=None,
            path="/v1/chat/completions",
            forwards=True,
        )
        spec = call.spec(CEILING)
        events = [e async for e in runner.run(runner.prepare("j", spec))]
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["Relay", "Token", "Token", "Token", "Relay", "Relay", "Relay", "Finished"]
    finished = events[-1]
    assert finished.result["completion_tokens"] == 9  # type: ignore[union-attr]
    assert finished.result["finish_reason"] == "stop"  # type: ignore[union-attr]


WHOLE = orjson.dumps(
    {
        "id": "chatcmpl-up",
        "object": "chat.completion",
        "created": 1,
        "model": "up",
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": f'{{"n": {i}}}'},
                "logprobs": {
                    "content": [
                        {"token": "{", "logprob": -0.1, "bytes": [123], "top_logprobs": TOP}
                    ]
                },
                "finish_reason": "stop",
            }
            for i in (0, 1)
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13},
        "timings": {"predicted_ms": 3.5},
    }
)


async def test_a_whole_answer_comes_back_as_it_came(make_server: ServerFactory) -> None:
    async with recording_upstream() as upstream:
        upstream.answers["/v1/chat/completions"] = Answer(body=WHOLE)
        server = await sidecar(make_server, upstream)
        client = openai.AsyncOpenAI(base_url=base(server) + "/v1", api_key="none", max_retries=0)
        async with client:
            completion = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "json please"}],
                n=2,
                logprobs=True,
                top_logprobs=2,
                response_format={"type": "json_object"},
            )
        raw = await post(server, "/v1/chat/completions", orjson.dumps(AGENT_CHAT))
    assert raw.content == WHOLE
    assert [orjson.loads(c.message.content or "") for c in completion.choices] == [
        {"n": 0},
        {"n": 1},
    ]
    assert completion.choices[1].logprobs is not None
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 8


async def test_an_upstream_refusal_is_passed_on_and_trips_no_breaker(
    make_server: ServerFactory,
) -> None:
    """A 4xx is the request's fault: the client gets the upstream's answer as it came, and
    however many come, the backend is not judged failing."""
    refusal = b'{"error":{"message":"tools are not supported by this model","code":400}}'
    async with recording_upstream() as upstream:
        upstream.answers["/v1/chat/completions"] = Answer(status=400, body=refusal)
        server = await sidecar(make_server, upstream, breaker_failures=2)
        for _ in range(4):
            response = await post(server, "/v1/chat/completions", orjson.dumps(AGENT_CHAT))
            assert (response.status_code, response.content) == (400, refusal)
        streamed = await post(
            server, "/v1/chat/completions", orjson.dumps({**AGENT_CHAT, "stream": True})
        )
    assert (streamed.status_code, streamed.content) == (400, refusal)
    assert server.admission.primary.breaker.state.name == "CLOSED"
    assert server.admission.primary.breaker._failures == 0
    assert server.metrics.aborts["upstream_rejected"] == 5
    assert server.ledger.inflight == 0


async def test_an_upstream_failure_is_passed_on_and_counts_against_the_breaker(
    make_server: ServerFactory,
) -> None:
    async with recording_upstream() as upstream:
        upstream.answers["/v1/chat/completions"] = Answer(status=500, body=b"model exploded")
        server = await sidecar(make_server, upstream, breaker_failures=2)
        for _ in range(2):
            response = await post(server, "/v1/chat/completions", orjson.dumps(AGENT_CHAT))
            assert (response.status_code, response.content) == (500, b"model exploded")
        refused = await post(server, "/v1/chat/completions", orjson.dumps(AGENT_CHAT))
    assert server.metrics.aborts["upstream_error"] == 2
    assert refused.status_code == 503  # the breaker opened: the backend is failing
    assert refused.json()["error"]["code"] == "breaker_open"


async def test_an_upstream_that_does_not_answer_is_a_502(make_server: ServerFactory) -> None:
    async with recording_upstream() as upstream:
        server = await sidecar(make_server, upstream)
    response = await post(server, "/v1/chat/completions", orjson.dumps(AGENT_CHAT))
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_error"


# Other paths -----------------------------------------------------------------------------


async def test_embeddings_are_admitted_and_forwarded(make_server: ServerFactory) -> None:
    vectors = b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.5,-0.5]}],"model":"up","usage":{"prompt_tokens":3,"total_tokens":3}}'
    async with recording_upstream() as upstream:
        upstream.answers["/v1/embeddings"] = Answer(body=vectors)
        server = await sidecar(make_server, upstream)
        client = openai.AsyncOpenAI(base_url=base(server) + "/v1", api_key="none", max_retries=0)
        async with client:
            answer = await client.embeddings.create(model="m", input=["one", "two"])
    assert answer.data[0].embedding == [0.5, -0.5]
    (job,) = upstream.jobs()
    assert orjson.loads(job.body)["input"] == ["one", "two"]
    assert "max_tokens" not in orjson.loads(job.body)  # (an embedding generates nothing)
    assert server.ledger.executed_total == 1


async def test_models_and_the_tokenizer_are_the_upstreams(make_server: ServerFactory) -> None:
    async with recording_upstream() as upstream:
        upstream.answers["/tokenize"] = Answer(body=b'{"tokens":[1,2,3]}')
        upstream.answers["/detokenize"] = Answer(body=b'{"content":"abc"}')
        server = await sidecar(make_server, upstream)
        async with httpx.AsyncClient(base_url=base(server), timeout=30) as client:
            models = await client.get("/v1/models")
            tokens = await client.post("/tokenize", content=b'{"content":"abc"}')
            text = await client.post("/detokenize", content=b'{"tokens":[1,2,3]}')
            wrong = await client.get("/tokenize")
    assert models.json()["data"][0]["id"] == "up"
    assert (tokens.json(), text.json()) == ({"tokens": [1, 2, 3]}, {"content": "abc"})
    assert (wrong.status_code, wrong.headers["allow"]) == (405, "POST")
    assert [r.path for r in upstream.jobs()] == ["/tokenize", "/detokenize"]
    assert server.ledger.inflight == 0


async def test_the_embedded_runners_door_serves_no_embeddings(make_server: ServerFactory) -> None:
    server = await make_server(http_listen="127.0.0.1:0")
    response = await post(server, "/v1/embeddings", b'{"input": "x"}')
    assert response.status_code == 404
    assert "no embeddings" in response.json()["error"]["message"]


def test_n_counts_in_a_forwarded_jobs_cost() -> None:
    def spec(n: int) -> JobSpec:
        body = orjson.dumps({"prompt": "x" * 400, "max_tokens": 50, "n": n})
        call = api.parse_call(
            body, kind=api.COMPLETION, lane_header=None, path="/v1/completions", forwards=True
        )
        return call.spec(CEILING)

    one, two = spec(1), spec(2)
    assert (one.estimated_prompt_tokens(), two.estimated_prompt_tokens()) == (100, 100)
    assert two.output_tokens == 2 * one.output_tokens == 100


def test_a_degraded_cap_bounds_the_forwarded_length() -> None:
    runner = HttpRunner(HttpSettings(upstream="http://127.0.0.1:9"))
    body = orjson.dumps({"prompt": "x", "max_completion_tokens": 500, "top_k": 2})
    call = api.parse_call(
        body, kind=api.COMPLETION, lane_header=None, path="/v1/completions", forwards=True
    )
    spec = call.spec(1024)
    assert runner.forwarded_body(spec) == body  # as asked: as it came
    lowered = dataclasses.replace(spec, max_new_tokens=128)
    assert orjson.loads(runner.forwarded_body(lowered)) == {
        "prompt": "x",
        "max_completion_tokens": 128,
        "top_k": 2,
    }


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_bad_body_is_refused_before_the_upstream(
    make_server: ServerFactory, path: str
) -> None:
    async with recording_upstream() as upstream:
        server = await sidecar(make_server, upstream)
        for body, param in (
            (b"[1]", None),
            (b'{"max_tokens": "9"}', "max_tokens"),
            (b'{"n": "2"}', "n"),
            (b'{"stream": 1}', "stream"),
            (b'{"max_tokens": 100000}', None),
        ):
            response = await post(server, path, body)
            assert response.status_code == 400, body
            assert response.json()["error"]["param"] == param
    assert upstream.jobs() == []


async def test_events_without_data_are_relayed_as_they_came(make_server: ServerFactory) -> None:
    """A keep-alive comment in the upstream's stream (sse-starlette's ``: ping``, say) reaches
    the client as it came, whatever its line endings."""
    events = [b": ping\n\n", *sse(STREAM[:2])[:-1], b": ping\r\n\r\n", *sse(STREAM[3:])]
    async with recording_upstream() as upstream:
        upstream.answers["/v1/chat/completions"] = Answer(
            content_type="text/event-stream", events=events
        )
        server = await sidecar(make_server, upstream)
        body = orjson.dumps({**AGENT_CHAT, "stream": True})
        response = await post(server, "/v1/chat/completions", body)
    relayed = [e for e in events if e != b"data: [DONE]\n\n"]
    assert response.content == b"".join(relayed) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("stream", [False, True])
async def test_an_upstream_answer_over_the_bound_is_a_502(
    make_server: ServerFactory, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """What the sidecar holds of an upstream's answer is bounded: a whole answer, or an event
    that never ends, past ``MAX_ANSWER_BYTES``, fails the job; the slot comes back."""
    monkeypatch.setattr(http_runner, "MAX_ANSWER_BYTES", 4096)
    endless = [b"data: " + b"x" * 1024 for _ in range(8)]  # (no blank line ever)
    async with recording_upstream() as upstream:
        upstream.answers["/v1/chat/completions"] = (
            Answer(content_type="text/event-stream", events=endless)
            if stream
            else Answer(body=b"{" + b" " * 8192 + b"}")
        )
        server = await sidecar(make_server, upstream)
        body = orjson.dumps({**AGENT_CHAT, "stream": stream})
        response = await post(server, "/v1/chat/completions", body)
    assert response.status_code == 502
    assert "over 4096 bytes" in response.json()["error"]["message"]
    assert server.ledger.inflight == 0


# A pausable job's failures (in front of a server that says it is llama-server) --------------

LLAMA_PROPS = orjson.dumps(
    {
        "default_generation_settings": {"n_ctx": 2048},
        "total_slots": 2,
        "model_alias": "up",
        "build_info": "b1",
    }
)


def native_events(*events: dict[str, Any]) -> list[bytes]:
    return [b"data: " + orjson.dumps(event) + b"\n\n" for event in events]


@pytest.mark.parametrize(
    ("completion", "code"),
    [
        # The stream ends before its last event (no "stop": true): the upstream's failure.
        (
            Answer(
                content_type="text/event-stream",
                events=native_events(
                    {"content": "a", "tokens": [5], "tokens_predicted": 1, "tokens_evaluated": 3}
                ),
            ),
            "upstream_error",
        ),
        # The upstream refuses the request: the request's fault.
        (Answer(status=400, body=b'{"error": "no"}'), "upstream_rejected"),
    ],
)
async def test_a_pausable_jobs_upstream_failure_aborts_it_once_and_frees_its_slot(
    make_server: ServerFactory, completion: Answer, code: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with recording_upstream() as upstream:
        upstream.answers["/props"] = Answer(body=LLAMA_PROPS)
        upstream.answers["/tokenize"] = Answer(body=b'{"tokens": [1, 2, 3]}')
        upstream.answers["/completion"] = completion
        with caplog.at_level("INFO", logger="governor.runners.http"):
            server = await sidecar(make_server, upstream, lanes=True, max_inflight=2)
        runner = server.runner
        assert isinstance(runner, HttpRunner)
        assert runner.native is not None
        # (its /props names no model file: the operator is told prompts are not counted)
        assert runner.prompts is None
        assert "(not named) cannot be read here" in caplog.text
        host, port = server.address
        spec = JobSpec(prompt="p", max_new_tokens=8, temperature=0.0, lane="heavy")
        async with await GovernorClient.connect(host, port) as client:
            got = await client.generate(spec, retry=NO_RETRY)
        assert not got.done
        assert got.reply.need_code == code
        # (its prompt tokenized, shorter than a piece: it ran at once there)
        assert [r.path for r in upstream.jobs()] == ["/tokenize", "/completion"]
        assert (server.ledger.inflight, server.ledger.taken) == (0, 0)


async def test_a_forwarded_chat_sets_the_pace_of_long_prompts_while_it_runs() -> None:
    """A chat on the front door (forwarded as it came) is a chat that a heavy prompt beside
    it goes upstream in pieces for, from its start to its end; a heavy job is none."""
    async with recording_upstream() as upstream:
        events = [b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n']
        upstream.answers["/v1/chat/completions"] = Answer(
            content_type="text/event-stream", events=[*events, b"data: [DONE]\n\n"]
        )
        runner = HttpRunner(HttpSettings(upstream=upstream.url))
        await runner.start()
        try:
            body = orjson.dumps({"messages": [{"role": "user", "content": "x"}], "stream": True})
            call = api.parse_call(
                body, kind=api.CHAT, lane_header=None, path="/v1/chat/completions", forwards=True
            )
            chat = dataclasses.replace(runner.prepare("j", call.spec(CEILING)), tpot_ms=100.0)
            assert runner.pace.piece() is None
            seen: list[int | None] = []
            await runner.push(chat, lambda _: seen.append(runner.pace.piece()))
            assert seen == [runner.pace.FIRST]  # (a piece's tokens while it streamed)
            assert runner.pace.piece() is None  # (ended)
            heavy = dataclasses.replace(chat, priority=1)
            await runner.push(heavy, lambda _: seen.append(runner.pace.piece()))
            assert seen[-1] is None
        finally:
            await runner.close()
