"""The http runner (sidecar mode) against a real OpenAI-compatible server, and a failing one.

The real one is llama-cpp-python's own server on the embedded model, started once for the
module (with --interrupt_requests False, so that it queues rather than cutting streams short).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import subprocess
import sys
import threading
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson
import pytest

from clients import NO_RETRY, GovernorClient
from governor.runners import Finished, RunnerStartError
from governor.runners.llama.runner import embedded_model_path
from governor.runners.sidecar.runner import HttpRunner, HttpSettings
from loadtest.support import baseline_server
from loadtest.support.processes import free_port, stop
from protocol.spec import JobSpec, Message
from tests.conftest import Daemon, ServerFactory, wait_until
from tests.inprocess.test_ops import failing, ops_server, probe, until_ready

pytestmark = pytest.mark.real_model


def greedy(prompt: str | None = None, **fields: Any) -> JobSpec:
    return dataclasses.replace(JobSpec(prompt=prompt, temperature=0.0, seed=7), **fields)


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    """llama-cpp-python's server on the embedded model (the load tests' queueing baseline),
    stopped by its own PID."""
    proc, url = baseline_server.start(embedded_model_path(), free_port(), threads=1, n_ctx=512)
    try:
        yield url
    finally:
        stop(proc)


def direct(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url + path, data=orjson.dumps(body), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        result: dict[str, Any] = orjson.loads(response.read())
        return result


async def generate(server: Any, spec: JobSpec, **kwargs: Any) -> Any:
    host, port = server.address
    async with await GovernorClient.connect(host, port) as client:
        return await client.generate(spec, retry=NO_RETRY, **kwargs)


async def test_completion_through_the_sidecar(make_server: ServerFactory, upstream: str) -> None:
    server = await make_server(runner="http", upstream=upstream)
    result = await generate(server, greedy("The capital of France is", max_new_tokens=8))
    assert result.done, result.reply
    got = result.reply.result
    expected = await asyncio.to_thread(
        direct,
        upstream,
        "/v1/completions",
        {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "seed": 7},
    )
    assert got["text"] == expected["choices"][0]["text"]
    assert got["completion_tokens"] == expected["usage"]["completion_tokens"]
    assert got["counted"] == "chunks"  # this server sends no usage in a stream
    assert got["finish_reason"] == "length"
    assert got["ttft_ms"] > 0


async def test_the_runner_leaves_ttft_and_tpot_to_the_governor(upstream: str) -> None:
    """Both are measured once, by the governor, from admission: not by the runner's own clock."""
    runner = HttpRunner(HttpSettings(upstream=upstream))
    await runner.start()
    try:
        job = runner.prepare("J_1", greedy("Hi", max_new_tokens=3))
        async with contextlib.aclosing(runner.run(job)) as events:
            finished = [event async for event in events][-1]
    finally:
        await runner.close()
    assert isinstance(finished, Finished)
    assert finished.result["completion_tokens"] == 3
    assert not {"ttft_ms", "tpot_ms"} & finished.result.keys()


async def test_chat_streams_through_the_sidecar(make_server: ServerFactory, upstream: str) -> None:
    server = await make_server(runner="http", upstream=upstream)
    deltas: list[str] = []
    spec = greedy(messages=(Message("user", "Say hello."),), max_new_tokens=10, stream=True)
    result = await generate(server, spec, on_delta=deltas.append)
    assert result.done
    assert deltas
    assert "".join(deltas) == result.reply.result["text"]


async def test_an_upstream_refusal_is_an_abort(make_server: ServerFactory, upstream: str) -> None:
    server = await make_server(runner="http", upstream=upstream + "/wrong/prefix")
    result = await generate(server, greedy("hello", max_new_tokens=8))
    assert (result.reply.status, result.reply.need_code) == ("abort", "upstream_error")
    assert "404" in (result.reply.detail or "")
    assert server.ledger.inflight == 0


class CountingUpstream(ThreadingHTTPServer):
    """An OpenAI-compatible server that streams ``max_tokens`` one-token chunks and reports
    its usage as ``usage`` says: ``"last"`` in a chunk of its own with no choices (OpenAI's,
    vLLM's), ``"finish"`` on the finishing chunk (llama-server's), ``"none"`` not at all
    (llama-cpp-python's server). It keeps the bodies it was sent."""

    daemon_threads = True
    PROMPT_TOKENS = 7
    CACHED_TOKENS = 5

    def __init__(self, usage: str) -> None:
        super().__init__(("127.0.0.1", 0), _CountingHandler)
        self.usage = usage
        self.bodies: list[dict[str, Any]] = []

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"


class _CountingHandler(BaseHTTPRequestHandler):
    server: CountingUpstream

    def do_GET(self) -> None:  # /v1/models: the runner's start-up check
        body = b'{"data": []}'
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # streamed; HTTP/1.0: the close ends it
        request = orjson.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.bodies.append(request)
        n, mode = request["max_tokens"], self.server.usage
        usage = {
            "prompt_tokens": self.server.PROMPT_TOKENS,
            "completion_tokens": n,
            "prompt_tokens_details": {"cached_tokens": self.server.CACHED_TOKENS},
        }
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for i in range(n):
            chunk: dict[str, Any] = {"choices": [{"text": f"t{i} ", "finish_reason": None}]}
            if i == n - 1:
                chunk["choices"][0]["finish_reason"] = "length"
                if mode == "finish":
                    chunk["usage"] = usage
            elif mode == "last":
                chunk["usage"] = None  # (vLLM's, until the last)
            self.wfile.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        if mode == "last":
            self.wfile.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def counting_upstream(usage: str) -> Iterator[CountingUpstream]:
    upstream = CountingUpstream(usage)
    thread = threading.Thread(target=upstream.serve_forever, daemon=True)
    thread.start()
    try:
        yield upstream
    finally:
        upstream.shutdown()
        upstream.server_close()
        thread.join(10)


@pytest.mark.parametrize("usage", ["last", "finish"])
async def test_the_upstreams_usage_gives_the_counts(make_server: ServerFactory, usage: str) -> None:
    with counting_upstream(usage) as upstream:
        server = await make_server(runner="http", upstream=upstream.url)
        result = await generate(server, greedy("hello", max_new_tokens=20))
    assert result.done, result.reply
    got = result.reply.result
    assert (got["prompt_tokens"], got["completion_tokens"], got["counted"]) == (
        CountingUpstream.PROMPT_TOKENS,
        20,
        "usage",
    )
    assert got["cached_tokens"] == CountingUpstream.CACHED_TOKENS
    assert got["text"] == "".join(f"t{i} " for i in range(20))
    # Asked for, or a server that follows OpenAI's API would send no usage in a stream.
    job = [b for b in upstream.bodies if b["max_tokens"] == 20]
    assert job[0]["stream_options"] == {"include_usage": True}


async def test_without_usage_the_prompt_count_is_null_and_the_chunks_are_counted(
    make_server: ServerFactory,
) -> None:
    with counting_upstream("none") as upstream:
        server = await make_server(runner="http", upstream=upstream.url)
        result = await generate(server, greedy("hello", max_new_tokens=20))
    got = result.reply.result
    assert (got["prompt_tokens"], got["completion_tokens"], got["counted"]) == (
        None,
        20,
        "chunks",
    )


@pytest.mark.parametrize("usage", ["last", "none"])
def test_governor_cli_prints_the_counts_it_has_and_says_which_it_lacks(
    daemon: Callable[..., Daemon], usage: str
) -> None:
    with counting_upstream(usage) as upstream:
        d = daemon("--runner", "http", "--upstream", upstream.url)
        done = subprocess.run(
            [sys.executable, "-m", "clients", "--addr", d.addr, "generate", "hello",
             "--max-new-tokens", "20"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("governor-cli:")]
    assert "None" not in line
    if usage == "last":
        assert line.startswith("governor-cli: 7 prompt + 20 generated tokens, finish length")
    else:
        assert line.startswith(
            "governor-cli: prompt tokens not reported by the upstream + 20 generated tokens "
            "(counted from the streamed chunks), finish length"
        )


@contextlib.asynccontextmanager
async def fake_upstream(behaviour: str) -> AsyncIterator[str]:
    """A server that answers /v1/models, then fails completions in the way asked."""
    handlers: set[asyncio.Task[Any]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            if head.startswith(b"GET /v1/models"):
                body = b'{"data": []}'
                status = b"200 OK"
            elif behaviour == "500":
                body, status = b"model exploded", b"500 Internal Server Error"
            elif behaviour == "hang":
                await asyncio.sleep(3600)  # until the test is over
            else:  # "drop": close mid-stream
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                await writer.drain()
                writer.close()
                return
            writer.write(
                b"HTTP/1.1 " + status + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body
            )
            await writer.drain()
        writer.close()

    listener = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        listener.close()
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)


@pytest.mark.parametrize(
    ("behaviour", "need_code"),
    [("500", "upstream_error"), ("drop", "upstream_error"), ("hang", "upstream_timeout")],
)
async def test_upstream_failures_become_coded_aborts(
    make_server: ServerFactory, behaviour: str, need_code: str
) -> None:
    async with fake_upstream(behaviour) as url:
        server = await make_server(runner="http", upstream=url, job_timeout=1.0)
        result = await generate(server, greedy("hello", max_new_tokens=4))
    assert (result.reply.status, result.reply.need_code) == ("abort", need_code)
    assert server.ledger.inflight == 0


async def test_an_unreachable_upstream_stops_startup() -> None:
    runner = HttpRunner(
        HttpSettings(upstream=f"http://127.0.0.1:{free_port()}", start_timeout_s=0.1)
    )
    with pytest.raises(RunnerStartError, match="cannot be reached"):
        await runner.start()


async def test_readiness_probes_the_upstream(make_server: ServerFactory, upstream: str) -> None:
    server = await ops_server(make_server, runner="http", upstream=upstream)
    body = await until_ready(server, timeout=60)
    assert body["checks"]["probe"]["ok"]
    assert server.metrics.probes["ok"] >= 1


async def test_an_upstream_that_fails_its_probes_fails_readiness(
    make_server: ServerFactory,
) -> None:
    async with fake_upstream("500") as url:
        server = await ops_server(make_server, runner="http", upstream=url)
        await wait_until(lambda: server.metrics.probes["failed"] >= 1)
        status, body = await probe(server, "/healthz/ready")
        live = await probe(server, "/healthz/live")
    assert (status, failing(body)) == (503, {"probe"})
    assert "the upstream answered 500" in body["checks"]["probe"]["detail"]
    assert live[0] == 200  # a restart of the governor would not mend its upstream
