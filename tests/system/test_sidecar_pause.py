"""A sidecar pauses a lent heavy job for a chat and resumes the same answer, in front of a real
llama-server (``deploy/build-llama-server.sh`` builds it; ``.ci/run`` does): two slots, both
lent to heavy jobs, then a chat that takes one back. The heavy job's greedy text through both
doors, streamed and whole, is the one llama-server gives with no pause; a client that leaves
while its job is paused frees everything, and no request for it reaches the upstream again. A
prompt is counted at the door as llama-server counts it, and one a slot cannot hold is refused
there. The server is stopped by its own PID."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import urllib.request
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from clients import NO_RETRY, GovernorClient, RetryPolicy
from governor.runners.llama.runner import embedded_model_path
from governor.runners.sidecar.runner import HttpRunner
from governor.server import Server
from loadtest.support import llama_server
from loadtest.support.processes import free_port, stop, wait_http_ready
from protocol.spec import JobSpec, Message
from tests.conftest import ServerFactory, wait_until
from tests.system.test_runner_http import direct

pytestmark = pytest.mark.real_model

RETRY = RetryPolicy(max_attempts=1000)
STORY = "Write a long story about a lighthouse keeper who finds a map in a bottle."
HEAVY_TOKENS = 160


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    binary = llama_server.default_binary()
    if not binary.exists():
        pytest.skip(f"no llama-server at {binary}: {llama_server.BUILD_SCRIPT} builds it")
    port = free_port()
    command = llama_server.command(
        binary, embedded_model_path(), port=port, slots=2, ctx=4096, threads=1
    )
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(proc, url + llama_server.READY_PATH, "llama-server", 120)
        yield url
    finally:
        stop(proc)


def unpaused(url: str, topic: str) -> str:
    """llama-server's own greedy answer, no governor between."""
    body = {
        "messages": [{"role": "user", "content": f"{STORY} {topic}"}],
        "max_tokens": HEAVY_TOKENS,
        "temperature": 0,
    }
    return str(direct(url, "/v1/chat/completions", body)["choices"][0]["message"]["content"])


async def sidecar(make_server: ServerFactory, upstream: str) -> Server:
    server = await make_server(
        runner="http",
        upstream=upstream,
        lanes=True,
        max_inflight=2,
        http_listen="127.0.0.1:0",
        probe_interval=600,  # (a probe's token would show on the upstream's slots: one at start)
    )
    assert isinstance(server.runner, HttpRunner)
    assert server.runner.native is not None  # (llama-server: its jobs can be paused)
    return server


def heavy_spec(topic: str) -> JobSpec:
    return JobSpec(
        messages=(Message("user", f"{STORY} {topic}"),),
        max_new_tokens=HEAVY_TOKENS,
        temperature=0.0,
        lane="heavy",
        stream=True,
    )


CHAT = JobSpec(messages=(Message("user", "Say hi."),), max_new_tokens=24, temperature=0.0)


class Tcp:
    """A heavy job on the TCP door: its text, and when its first token came."""

    def __init__(self, server: Server, topic: str) -> None:
        self.server, self.spec = server, heavy_spec(topic)
        self.started = asyncio.Event()
        self.text = ""

    async def run(self) -> None:
        host, port = self.server.address
        async with await GovernorClient.connect(host, port) as client:
            got = await client.generate(
                self.spec, retry=RETRY, on_delta=lambda _: self.started.set()
            )
        assert got.done, got.reply
        assert got.reply.result is not None
        self.text = got.reply.result["text"]


class OpenAi:
    """A heavy job on the front door, streamed or whole: the text its client put together."""

    def __init__(self, server: Server, topic: str, *, stream: bool) -> None:
        address = server.http_address
        assert address is not None
        self.url = f"http://{address[0]}:{address[1]}/v1/chat/completions"
        self.body = {
            "model": "any",
            "messages": [{"role": "user", "content": f"{STORY} {topic}"}],
            "max_tokens": HEAVY_TOKENS,
            "temperature": 0,
            "lane": "heavy",
            "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        }
        self.stream = stream
        self.started = asyncio.Event()
        self.text = ""
        self.ids: set[str] = set()
        self.usage: dict[str, Any] = {}

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            if not self.stream:
                self.started.set()  # (nothing comes before the end: the chat waits a little)
                answer = (await client.post(self.url, json=self.body)).json()
                self.text = answer["choices"][0]["message"]["content"]
                self.ids.add(answer["id"])
                self.usage = answer["usage"]
                return
            parts = []
            async with client.stream("POST", self.url, json=self.body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = orjson.loads(line[6:])
                    self.ids.add(chunk["id"])
                    self.usage = chunk.get("usage") or self.usage
                    for choice in chunk["choices"]:
                        piece = choice["delta"].get("content")
                        if piece:
                            parts.append(piece)
                            self.started.set()
            self.text = "".join(parts)


async def chat(server: Server) -> str:
    host, port = server.address
    async with await GovernorClient.connect(host, port) as client:
        got = await client.generate(CHAT, retry=RETRY)
    assert got.done, got.reply
    assert got.reply.result is not None
    return str(got.reply.result["text"])


@pytest.mark.parametrize("door", ["tcp", "openai-stream", "openai-whole"])
async def test_a_paused_heavy_answer_is_the_unpaused_one(
    make_server: ServerFactory, upstream: str, door: str
) -> None:
    server = await sidecar(make_server, upstream)
    topics = ["In the north.", "In the south."]
    if door == "tcp":
        jobs: list[Tcp | OpenAi] = [Tcp(server, t) for t in topics]
    else:
        jobs = [OpenAi(server, t, stream=door == "openai-stream") for t in topics]
    tasks = []
    for job in jobs:  # (one after the other: the second is the newest, the one paused)
        tasks.append(asyncio.create_task(job.run()))
        await wait_until(lambda: server.ledger.taken == len(tasks), 30)
    await asyncio.wait_for(asyncio.gather(*(j.started.wait() for j in jobs)), 60)
    await asyncio.sleep(0.2)
    assert server.ledger.taken == 2  # (every slot lent: the reserve's too)
    chat_text = await asyncio.wait_for(chat(server), 60)
    await asyncio.wait_for(asyncio.gather(*tasks), 120)
    assert chat_text
    assert server.ledger.suspensions["heavy"] == 1
    assert server.ledger.resumes["heavy"] == 1
    # The runner sent the upstream a second request for it (the first was closed): measured.
    resumed = server.metrics.resumes.seconds.by_lane["heavy"]
    assert sum(resumed.counts) == 1
    for job, topic in zip(jobs, topics, strict=True):
        assert job.text == await asyncio.to_thread(unpaused, upstream, topic)
    if door != "tcp":
        paused = jobs[1]
        assert isinstance(paused, OpenAi)
        assert len(paused.ids) == 1  # (one answer, one id, over both attempts)
        assert paused.usage["completion_tokens"] == HEAVY_TOKENS
    assert (server.ledger.inflight, server.ledger.suspended, server.ledger.taken) == (0, 0, 0)


async def test_a_long_prompt_goes_up_in_pieces_and_answers_as_it_would_at_once(
    make_server: ServerFactory, upstream: str
) -> None:
    """No chat runs, but one may come: a heavy job's long prompt goes into llama-server's cache
    in pieces that a chat's TTFT objective leaves room for, then its answer is generated, the
    same greedy text as llama-server's own for the whole prompt."""
    server = await sidecar(make_server, upstream)
    topic = " ".join(f"On day {day} the keeper climbed the stairs again." for day in range(40))
    job = Tcp(server, topic)
    await asyncio.wait_for(job.run(), 120)
    pieces = server.metrics.prompt_pieces.by_lane["heavy"]
    assert sum(pieces.counts) >= 2  # (a prompt of about 500 tokens, pieces of at most 250 ms)
    assert job.text == await asyncio.to_thread(unpaused, upstream, topic)
    assert (server.ledger.inflight, server.ledger.taken) == (0, 0)


async def test_a_client_leaving_while_paused_frees_all_and_is_not_resumed(
    make_server: ServerFactory, upstream: str
) -> None:
    server = await sidecar(make_server, upstream)
    first, second = Tcp(server, "One."), Tcp(server, "Two.")
    kept = asyncio.create_task(first.run())
    await wait_until(lambda: server.ledger.taken == 1, 30)
    leaving = asyncio.create_task(second.run())
    await asyncio.wait_for(asyncio.gather(first.started.wait(), second.started.wait()), 60)
    chatting = asyncio.create_task(chat(server))
    await wait_until(lambda: server.ledger.suspended == 1, 30)
    leaving.cancel()  # (its connection closes while its job is paused)
    with contextlib.suppress(asyncio.CancelledError):
        await leaving
    await wait_until(lambda: server.ledger.suspended == 0, 10)
    await asyncio.wait_for(asyncio.gather(chatting, kept), 120)
    await wait_until(lambda: server.ledger.inflight == 0, 10)
    assert server.ledger.resumes["heavy"] == 0  # (nothing resumed: its client had gone)
    # The upstream runs nothing more: no slot busy a while after the others ended.
    await asyncio.sleep(0.5)
    slots = await asyncio.to_thread(lambda: direct_get(upstream, "/slots"))
    assert not any(slot["is_processing"] for slot in slots)


def direct_get(url: str, path: str) -> Any:
    with urllib.request.urlopen(url + path, timeout=30) as response:
        return orjson.loads(response.read())


# Prompts counted at the door ------------------------------------------------------------------


def upstream_count(url: str, messages: list[dict[str, str]] | None, prompt: str | None) -> int:
    """llama-server's own count of a chat's (templated) or a prompt's tokens."""
    if messages is not None:
        prompt = direct(url, "/apply-template", {"messages": messages})["prompt"]
    body = {"content": prompt, "add_special": True, "parse_special": messages is not None}
    return len(direct(url, "/tokenize", body)["tokens"])


async def test_a_prompt_is_counted_as_llama_server_counts_it_and_one_too_long_refused_at_the_door(
    make_server: ServerFactory, upstream: str
) -> None:
    server = await sidecar(make_server, upstream)
    runner = server.runner
    assert isinstance(runner, HttpRunner)
    prompts = runner.prompts  # (the model's file is readable here: its vocabulary loaded)
    assert prompts is not None
    assert prompts.n_ctx == 2048  # (-c 4096 over 2 slots)
    cases: list[tuple[list[dict[str, str]] | None, str | None]] = [
        ([{"role": "user", "content": STORY}], None),
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}], None),
        (None, "Once upon a time, in a café by the sea,"),
    ]
    for messages, prompt in cases:
        spec = JobSpec(
            messages=tuple(Message(**m) for m in messages) if messages else None, prompt=prompt
        )
        job = runner.prepare("J", spec)
        assert len(job.tokens) == await asyncio.to_thread(
            upstream_count, upstream, messages, prompt
        )
    # A prompt longer than a slot's context: refused on both doors, and no slot taken.
    long = " ".join(["lighthouse"] * 2100)
    host, port = server.address
    async with await GovernorClient.connect(host, port) as client:
        got = await client.generate(JobSpec(prompt=long, max_new_tokens=4), retry=NO_RETRY)
    assert not got.done
    assert got.reply.need_code == "prompt_too_long", got.reply
    address = server.http_address
    assert address is not None
    async with httpx.AsyncClient(timeout=60) as http:
        answer = await http.post(
            f"http://{address[0]}:{address[1]}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": long}], "max_tokens": 4},
        )
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "prompt_too_long"
    assert server.ledger.executed_total == 0
