"""The OpenAI-compatible front door, through the official ``openai`` SDK and raw HTTP: its yields
are 429s the SDK honours, its jobs go through the same admission, a client that leaves stops
its job before its next token. (Hostile HTTP: ``test_frontdoor_hostile.py``.)"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from clients import NO_RETRY, GovernorClient
from governor.core.tenants import TenantConfig
from governor.listeners.openai_api import MAX_WAIT_HEADER
from governor.runners import Finished, Job, RunEvent, RunnerError, StubRunner, Token
from governor.server import Server
from loadtest.support.redisserver import RedisServer
from protocol.codes import NeedCode
from protocol.spec import JobSpec, Message
from tests.clock import FakeClock
from tests.conftest import ServerFactory, wait_until


def user(text: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": text}]


CHAT = user("hi")


def url(server: Server) -> str:
    address = server.http_address
    assert address is not None
    return f"http://{address[0]}:{address[1]}"


Sdk = Callable[..., openai.AsyncOpenAI]


@pytest.fixture
async def sdk() -> AsyncIterator[Sdk]:
    """``sdk(server, key="none", **options)``: an ``AsyncOpenAI`` client of the server's front
    door, closed after the test."""
    made: list[openai.AsyncOpenAI] = []

    def factory(server: Server, key: str = "none", **options: Any) -> openai.AsyncOpenAI:
        made.append(openai.AsyncOpenAI(base_url=url(server) + "/v1", api_key=key, **options))
        return made[-1]

    yield factory
    for client in made:
        await client.close()


async def front(make_server: ServerFactory, instance: Any = None, **config: Any) -> Server:
    return await make_server(instance, http_listen="127.0.0.1:0", **config)


async def hold_slot(server: Server, sdk: Sdk) -> asyncio.Task[Any]:
    """A job that takes the server's one slot (through the front door too)."""
    client = sdk(server, max_retries=0)
    task = asyncio.create_task(client.chat.completions.create(model="m", messages=CHAT))
    await wait_until(lambda: server.inflight == 1)
    return task


# Yields, as the SDK sees them ------------------------------------------------------------


async def test_a_yield_is_a_rate_limit_error_carrying_retry_after_ms(
    make_server: ServerFactory,
    sdk: Sdk,
) -> None:
    """A request that asks for no wait at the door (or whose turn is past its budget)."""
    server = await front(make_server, max_inflight=1, stub_ms=1000)
    running = await hold_slot(server, sdk)
    with pytest.raises(openai.RateLimitError) as caught:
        await sdk(server, max_retries=0).chat.completions.create(
            model="m", messages=CHAT, max_tokens=4, extra_headers={MAX_WAIT_HEADER: "0"}
        )
    response = caught.value.response
    assert response.headers["x-governor-waited-ms"] == "0"
    hint_ms = int(response.headers["retry-after-ms"])
    assert 100 <= hint_ms <= 1500  # the running job's end, about a second away
    assert int(response.headers["retry-after"]) == math.ceil(hint_ms / 1000)
    assert caught.value.code == "server_busy"
    assert caught.value.body["type"] == "rate_limit_error"  # type: ignore[index]
    assert response.headers["x-governor-inflight"] == "1"
    await running
    assert server.ledger.yielded_total == 1
    answers = server.state.metrics.http_responses
    assert (answers[("/v1/chat/completions", "429")], answers[("/v1/chat/completions", "200")]) == (
        1,
        1,
    )


async def test_the_sdk_own_retries_finish_every_job(make_server: ServerFactory, sdk: Sdk) -> None:
    """Six clients on two slots, the SDK as it comes (two retries), no code of ours, the door
    on its defaults: every job finishes, the ones that found no slot having waited at the door
    for their turn rather than spent the SDK's retries."""
    server = await front(make_server, max_inflight=2, stub_ms=200)
    client = sdk(server)  # max_retries: the SDK's default, 2
    answers = await asyncio.gather(
        *(
            client.chat.completions.create(model="m", messages=user(f"job {i}"), max_tokens=3)
            for i in range(6)
        )
    )
    assert [a.choices[0].message.content for a in answers] == ["stub "] * 6
    assert server.state.metrics.http_responses[("/v1/chat/completions", "429")] == 0
    assert server.ledger.executed_total == 6
    assert server.inflight == 0


async def test_with_no_wait_at_the_door_the_sdk_comes_back_on_the_hints(
    make_server: ServerFactory, sdk: Sdk
) -> None:
    """Six clients on two slots, the SDK's two retries, no wait at the door: each 429 says when
    to come back, the SDK waits that long before its retry, and every job either finishes or,
    its retries spent, gets its last 429 (whether two retries suffice depends on how the jobs'
    ends fall against their predictions: on a machine this loaded they may not). Nothing is
    left holding a slot or a place."""
    server = await front(make_server, max_inflight=2, stub_ms=200, max_wait=0)
    sent: dict[bytes, list[float]] = collections.defaultdict(list)  # each job's attempts
    told: dict[bytes, list[int]] = collections.defaultdict(list)  # and the hints of its 429s
    loop = asyncio.get_running_loop()

    async def on_request(request: httpx.Request) -> None:
        sent[request.content].append(loop.time())

    async def on_response(response: httpx.Response) -> None:
        if response.status_code == 429:
            hint = int(response.headers["retry-after-ms"])
            assert hint >= 1
            assert int(response.headers["retry-after"]) >= 1
            told[response.request.content].append(hint)

    hooks: dict[str, list[Callable[..., Any]]] = {
        "request": [on_request],
        "response": [on_response],
    }
    client = sdk(server, http_client=httpx.AsyncClient(event_hooks=hooks))
    answers = await asyncio.gather(
        *(
            client.chat.completions.create(model="m", messages=user(f"job {i}"), max_tokens=3)
            for i in range(6)
        ),
        return_exceptions=True,
    )
    done = [a for a in answers if not isinstance(a, BaseException)]
    given_up = [a for a in answers if isinstance(a, BaseException)]
    assert all(isinstance(e, openai.RateLimitError) for e in given_up), given_up
    assert [a.choices[0].message.content for a in done] == ["stub "] * len(done)
    assert len(done) >= 2
    assert server.ledger.executed_total == len(done)
    assert sum(map(len, told.values())) >= 4  # (4 refused at once; retries may be again)
    for body, times in sent.items():
        hints = told[body]
        assert len(times) == min(len(hints) + 1, 3)  # an attempt after each 429, 3 at most
        for gap, hint in zip(itertools.pairwise(times), hints, strict=False):
            assert gap[1] - gap[0] >= hint / 1000 - 0.002  # (the SDK sleeps the hint exactly)
    assert len(given_up) == sum(1 for hints in told.values() if len(hints) == 3)
    assert server.inflight == 0
    assert [t.waiting for t in server.tenants.all()] == [0]


async def test_a_retry_keeps_its_place_in_line(
    make_server: ServerFactory, sdk: Sdk, stopped_clock: FakeClock
) -> None:
    """A refused request sent again (same key, same body) is its own promise: it takes the slot
    held for it, while a newcomer arriving at the same moment is refused (with no wait at the
    door: each decision is the one the test makes)."""
    server = await front(make_server, max_inflight=1, stub_ms=400, max_wait=0)
    running = await hold_slot(server, sdk)
    async with httpx.AsyncClient(base_url=url(server)) as http:

        async def post(content: str) -> httpx.Response:
            body = {"model": "m", "messages": [{"role": "user", "content": content}]}
            return await http.post("/v1/chat/completions", json=body)

        first = await post("waiting")
        assert first.status_code == 429
        assert len(server.state.tenants.all()[0].running) == 1
        # The retry comes back at its time, as a client that honours its hint does. (On the
        # wall clock it would come once the running job's answer has reached this test through
        # the SDK: on a loaded machine, or with the SDK's first answer to parse, later than the
        # two turnarounds (10 ms at first) past its time that a freed slot is held for it. That
        # late, it rightly loses the slot to the newcomer: test_ledger's late client.)
        stopped_clock.now += int(first.headers["retry-after-ms"]) / 1000
        await running  # the slot frees, and is held for the promised client
        late, retry = await asyncio.gather(post("newcomer"), post("waiting"))
        assert (retry.status_code, late.status_code) == (200, 429)
        assert late.json()["error"]["code"] == "server_busy"


async def test_a_request_back_for_its_place_waits_at_the_door_rather_than_spend_a_retry(
    make_server: ServerFactory,
) -> None:
    """Told 429 (it asked for no wait), then back too early (hints are predictions; an SDK has
    two retries): it is not refused again, it waits at the door for its kept place and runs as
    the slot frees; one whose place is past the door's budget is told so at once."""
    server = await front(make_server, max_inflight=1, stub_ms=400)
    body = {"model": "m", "messages": CHAT}
    async with httpx.AsyncClient(base_url=url(server)) as http:
        running = asyncio.create_task(http.post("/v1/chat/completions", json=body | {"seed": 1}))
        await wait_until(lambda: server.inflight == 1)
        no_wait = {MAX_WAIT_HEADER: "0"}
        first = await http.post("/v1/chat/completions", json=body, headers=no_wait)
        assert first.status_code == 429
        back = await http.post("/v1/chat/completions", json=body)  # at once: ~400 ms early
        assert back.status_code == 200
        assert int(back.headers["x-governor-waited-ms"]) > 0
        assert (await running).status_code == 200
        assert server.ledger.yielded_total >= 2  # refused again, inside, at least once
        assert server.state.metrics.http_responses[("/v1/chat/completions", "429")] == 1
        # A turn further off than the door's budget: told so, not held at the door.
        long = await front(make_server, max_inflight=1, stub_ms=3000, max_wait=1.0)
        async with httpx.AsyncClient(base_url=url(long)) as other:
            slow = asyncio.create_task(other.post("/v1/chat/completions", json=body | {"seed": 1}))
            await wait_until(lambda: long.inflight == 1)
            answers = [await other.post("/v1/chat/completions", json=body) for _ in range(2)]
            assert [a.status_code for a in answers] == [429, 429]
            assert [a.headers["x-governor-waited-ms"] for a in answers] == ["0", "0"]
            assert long.state.metrics.not_waited["beyond_budget"] == 2
            slow.cancel()
    assert [t.waiting for t in server.tenants.all()] == [0]


# Answers ---------------------------------------------------------------------------------


async def test_streamed_chat_through_the_sdk(make_server: ServerFactory, sdk: Sdk) -> None:
    server = await front(make_server, stub_ms=10)
    client = sdk(server)
    stream = await client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "stub "
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.completion_tokens, usage.total_tokens) == (5, 5 + usage.prompt_tokens)
    plain = await client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=5, stream=True
    )
    assert [c.usage async for c in plain] == [None, None, None]  # role, token, finish


async def test_completions_and_models(make_server: ServerFactory, sdk: Sdk) -> None:
    server = await front(make_server, stub_ms=10)
    client = sdk(server)
    completion = await client.completions.create(model="whatever", prompt="Once", max_tokens=3)
    assert completion.choices[0].text == "stub "
    assert completion.model == "stub"  # the served model, whatever the client named
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 3
    models = await client.models.list()
    assert [m.id for m in models.data] == ["stub"]


class Recording(StubRunner):
    """The stub, keeping every job spec it was given."""

    def __init__(self) -> None:
        super().__init__(0.01)
        self.specs: list[JobSpec] = []

    async def run(self, job: Job) -> AsyncGenerator[RunEvent, None]:
        assert job.spec is not None
        self.specs.append(job.spec)
        async for item in super().run(job):
            yield item


async def test_parameters_and_the_lane_reach_the_job(make_server: ServerFactory, sdk: Sdk) -> None:
    runner = Recording()
    server = await front(make_server, runner, lanes=True)
    client = sdk(server)
    await client.chat.completions.create(
        model="m",
        messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        max_completion_tokens=6,
        temperature=0.3,
        top_p=0.9,
        seed=11,
        stop=["END"],
        extra_body={"lane": "background", "top_k": 4},
    )
    await client.completions.create(
        model="m", prompt="p", max_tokens=2, extra_headers={"x-governor-lane": "heavy"}
    )
    chat, text = runner.specs
    assert chat.messages == (Message("system", "s"), Message("user", "u"))
    assert (chat.max_new_tokens, chat.temperature, chat.top_p, chat.seed) == (6, 0.3, 0.9, 11)
    assert (chat.stop, chat.lane, chat.top_k, chat.stream) == (("END",), "background", 4, False)
    assert (text.prompt, text.max_new_tokens, text.lane) == ("p", 2, "heavy")
    # (what a request leaves out is drawn as llama-server draws it)
    assert (text.temperature, text.top_p, text.top_k, text.min_p) == (0.8, 0.95, 40, 0.05)
    finished = server.metrics.finished
    assert finished[("done", "background", "primary")] == 1
    assert finished[("done", "heavy", "primary")] == 1


# Refusals and failures -------------------------------------------------------------------


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def test_the_bearer_key_is_the_tenant(make_server: ServerFactory, sdk: Sdk) -> None:
    tenants = (TenantConfig(name="alpha", key_sha256=sha("alpha-key"), max_inflight=1),)
    server = await front(make_server, tenants=tenants, max_inflight=4, stub_ms=300, max_wait=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        await sdk(server, "wrong-key").chat.completions.create(model="m", messages=CHAT)
    assert caught.value.code == "unauthorized"
    assert caught.value.response.headers["www-authenticate"] == "Bearer"
    async with httpx.AsyncClient(base_url=url(server)) as http:  # (the SDK insists on a key)
        missing = await http.post("/v1/completions", json={"model": "m", "prompt": "p"})
    assert (missing.status_code, missing.json()["error"]["code"]) == (401, "unauthorized")
    client = sdk(server, "alpha-key", max_retries=0)
    results = await asyncio.gather(
        *(client.chat.completions.create(model="m", messages=CHAT) for _ in range(2)),
        return_exceptions=True,
    )
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(refused) == 1  # alpha's own cap of one: the key named the tenant
    assert refused[0].code == "tenant_busy"
    assert server.admission.refusals[("tenant_busy", "-", "alpha")] == 1


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"n": 17}, "spec_invalid", None),
        ({"extra_body": {"best_of": 3}}, "spec_invalid", "best_of"),
        ({"max_tokens": 10**6}, "max_new_tokens_invalid", None),
        ({"temperature": 5}, "spec_invalid", None),
        ({"extra_body": {"lane": "nowhere"}}, "spec_invalid", None),
    ],
)
async def test_a_bad_request_is_a_400_naming_its_code(
    make_server: ServerFactory, sdk: Sdk, fields: dict[str, Any], code: str, param: str | None
) -> None:
    server = await front(make_server, lanes=True)
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk(server).chat.completions.create(model="m", messages=CHAT, **fields)
    assert (caught.value.code, caught.value.param) == (code, param)
    assert server.ledger.executed_total == 0


async def test_draining_is_a_503_with_a_hint(make_server: ServerFactory) -> None:
    server = await front(make_server)
    server.begin_drain("test")
    async with httpx.AsyncClient(base_url=url(server)) as http:
        answer = await http.post("/v1/completions", json={"model": "m", "prompt": "p"})
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "draining"
    assert "this replica is draining" in answer.json()["error"]["message"]
    # Retry soon: behind a load balancer, on a new connection, another replica answers.
    assert (answer.headers["retry-after-ms"], answer.headers["retry-after"]) == ("1000", "1")
    assert answer.headers["connection"] == "close"  # (a load balancer's next try goes elsewhere)


async def test_paths_and_methods(make_server: ServerFactory) -> None:
    server = await front(make_server)
    async with httpx.AsyncClient(base_url=url(server)) as http:
        wrong = await http.get("/v1/chat/completions")
        missing = await http.post("/v2/anything", json={})
        head = await http.head("/v1/models")
    assert (wrong.status_code, wrong.headers["allow"], wrong.reason_phrase) == (
        405,
        "POST",
        "Method Not Allowed",
    )
    assert wrong.json()["error"]["code"] == "method_not_allowed"
    assert (missing.status_code, missing.json()["error"]["type"]) == (404, "invalid_request_error")
    assert (head.status_code, head.content) == (200, b"")
    assert server.state.metrics.http_responses[("other", "404")] == 1


class Failing(StubRunner):
    """Fails with ``code`` after ``tokens`` tokens."""

    def __init__(self, code: NeedCode, tokens: int = 0) -> None:
        super().__init__(0.0)
        self.code, self.tokens = code, tokens

    async def run(self, job: Job) -> AsyncGenerator[RunEvent, None]:
        for _ in range(self.tokens):
            yield Token("x")
        raise RunnerError("it broke", self.code)


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (NeedCode.BACKEND_ERROR, 502),
        (NeedCode.RUNNER_CRASHED, 502),
        (NeedCode.UPSTREAM_ERROR, 502),
        (NeedCode.RUNNER_TIMEOUT, 504),
        (NeedCode.UPSTREAM_TIMEOUT, 504),
    ],
)
async def test_a_runner_failure_is_a_502_or_504(
    make_server: ServerFactory, sdk: Sdk, code: NeedCode, status: int
) -> None:
    server = await front(make_server, Failing(code))
    with pytest.raises(openai.APIStatusError) as caught:
        await sdk(server, max_retries=0).chat.completions.create(model="m", messages=CHAT)
    assert (caught.value.status_code, caught.value.code) == (status, code)
    assert server.inflight == 0


async def test_a_stream_that_fails_midway_ends_with_an_error_event(
    make_server: ServerFactory,
    sdk: Sdk,
) -> None:
    server = await front(make_server, Failing(NeedCode.RUNNER_CRASHED, tokens=2))
    stream = await sdk(server).chat.completions.create(model="m", messages=CHAT, stream=True)
    received: list[str | None] = []

    async def read() -> None:
        async for chunk in stream:
            received.append(chunk.choices[0].delta.content)

    with pytest.raises(openai.APIError, match="it broke"):
        await read()
    assert received == ["", "x", "x"]  # the role, then the two tokens before the failure
    assert server.inflight == 0


# A client that leaves --------------------------------------------------------------------


class Gated(StubRunner):
    """Generates a token each time the test allows one; notes whether it was cancelled."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.permits = asyncio.Semaphore(0)
        self.yielded = 0
        self.cancelled = False

    async def run(self, job: Job) -> AsyncGenerator[RunEvent, None]:
        try:
            while True:
                await self.permits.acquire()
                self.yielded += 1
                yield Token("t ")
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        yield Finished({})  # (never)


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_leaves_stops_its_job_before_its_next_token(
    make_server: ServerFactory, stream: bool
) -> None:
    runner = Gated()
    server = await front(make_server, runner)
    host, port = server.http_address or ("", 0)
    reader, writer = await asyncio.open_connection(host, port)
    body = orjson.dumps({"model": "m", "messages": CHAT, "max_tokens": 100, "stream": stream})
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    for _ in range(3):
        runner.permits.release()
    await wait_until(lambda: runner.yielded == 3)
    if stream:  # the three tokens reached the client
        seen = b""
        while seen.count(b'"content":"t "') < 3:
            seen += await reader.read(65536)
    writer.close()
    # No permit is given: the job must be stopped by the client's leaving alone.
    await wait_until(lambda: runner.cancelled and server.inflight == 0, timeout=5)
    assert runner.yielded == 3
    assert server.buffered_bytes == 0
    assert server.metrics.finished[("client_gone", "-", "primary")] == 1


# The fleet -------------------------------------------------------------------------------


async def test_the_fleet_refusal_is_a_429(
    make_server: ServerFactory, sdk: Sdk, redis_server: RedisServer
) -> None:
    servers = [
        await front(
            make_server,
            redis_url=redis_server.url,
            fleet_max_inflight=1,
            stub_ms=500,
            fleet_timeout=1.0,
        )
        for _ in range(2)
    ]
    running = await hold_slot(servers[0], sdk)
    fleet = servers[0].fleet
    assert fleet is not None
    await wait_until(lambda: bool(fleet.gate.leases))  # (the fleet's step follows admission)
    with pytest.raises(openai.RateLimitError) as caught:
        await sdk(servers[1], max_retries=0).chat.completions.create(model="m", messages=CHAT)
    assert caught.value.code == "fleet_busy"
    assert int(caught.value.response.headers["retry-after-ms"]) > 0
    assert servers[1].inflight == 0  # admitted there, then given back
    await running
    answer = await sdk(servers[1]).chat.completions.create(model="m", messages=CHAT)
    assert answer.choices[0].message.content == "stub "


# The real model --------------------------------------------------------------------------


async def test_the_sdk_gets_what_the_tcp_protocol_gets_on_the_model(
    make_server: ServerFactory,
    sdk: Sdk,
) -> None:
    """The embedded model, greedy: the SDK's streamed chat and the TCP client's job agree."""
    server = await front(make_server, runner="llama", max_inflight=1, n_ctx=512, threads=1)
    stream = await sdk(server).chat.completions.create(
        model="m",
        messages=user("Name a colour."),
        max_tokens=8,
        temperature=0,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None
    assert 1 <= usage.completion_tokens <= 8
    assert usage.prompt_tokens > 5  # (the chat template's tokens included)
    spec = JobSpec(
        messages=(Message("user", "Name a colour."),),
        max_new_tokens=8,
        temperature=0.0,
        seed=7,
        top_p=1.0,
    )
    host, port = server.address
    async with await GovernorClient.connect(host, port) as client:
        result = await client.generate(spec, retry=NO_RETRY)
    assert result.reply.result is not None
    assert text == result.reply.result["text"]
    assert text.strip()
    counts = collections.Counter(k[0] for k, v in server.metrics.finished.items() if v)
    assert counts == {"done": 1}  # both jobs counted under one key: done
