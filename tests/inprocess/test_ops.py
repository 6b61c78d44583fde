"""The operator's surface: health probes, the drain, metrics after a scripted run, JSON logs."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import logging
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson
import pytest

from clients import NO_RETRY, GovernorClient, connect
from governor.core.slo import OBJECTIVES
from governor.listeners.admin import _is_loopback
from governor.runners import StubRunner
from governor.server import Server
from governor.telemetry import logs
from protocol.spec import JobSpec
from tests.conftest import Daemon, ServerFactory, wait_until
from tests.system.test_daemon import _scrape

DaemonFactory = Callable[..., Daemon]


def http(url: str, method: str = "GET") -> tuple[int, dict[str, Any]]:
    """Status and JSON body of a request (an error status is an answer, not an exception)."""
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, orjson.loads(response.read())
    except urllib.error.HTTPError as error:
        with error:
            return error.code, orjson.loads(error.read())


def base_url(server: Server) -> str:
    host, port = server.metrics_address or ("", 0)
    return f"http://{host}:{port}"


async def probe(server: Server, path: str) -> tuple[int, dict[str, Any]]:
    return await asyncio.to_thread(http, base_url(server) + path)


async def until_ready(server: Server, timeout: float = 10) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (answer := await probe(server, "/healthz/ready"))[0] != 200:
        assert time.monotonic() < deadline, answer
        await asyncio.sleep(0.02)
    return answer[1]


def failing(body: dict[str, Any]) -> set[str]:
    return {name for name, check in body["checks"].items() if not check["ok"]}


async def ops_server(make_server: ServerFactory, **config: Any) -> Server:
    config.setdefault("probe_interval", 0.05)
    return await make_server(metrics_listen="127.0.0.1:0", **config)


# Liveness ------------------------------------------------------------------------------


async def test_liveness_fails_while_the_event_loop_is_blocked(make_server: ServerFactory) -> None:
    server = await ops_server(make_server, loop_stall_limit=0.3)
    assert (await probe(server, "/healthz/live"))[0] == 200
    url = base_url(server)
    seen: list[tuple[int, dict[str, Any]]] = []
    observed = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            live = http(url + "/healthz/live")
            if live[0] != 200:
                seen.extend([live, http(url + "/healthz/ready")])
                break
        observed.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    # Block the event loop (as a runaway computation would) until the probe has reported it.
    observed.wait(15)
    watcher.join()
    (live_status, live), (ready_status, ready) = seen
    assert live_status == 503
    assert live["status"] == "fail"
    assert failing(live) == {"event_loop"}
    assert "last ran" in live["checks"]["event_loop"]["detail"]
    assert ready_status == 503  # the loop cannot answer for readiness either
    assert failing(ready) == {"event_loop"}
    # The loop runs again: alive.
    deadline = time.monotonic() + 5
    while (await probe(server, "/healthz/live"))[0] != 200:
        assert time.monotonic() < deadline


class HangingProbe(StubRunner):
    """Its probe never answers, as a hung worker's would not."""

    async def probe(self) -> bool:
        await asyncio.Event().wait()
        return True


async def test_a_hung_probe_holds_neither_the_heartbeat_nor_liveness(
    make_server: ServerFactory,
) -> None:
    server = await ops_server(
        make_server, instance=HangingProbe(0.01), loop_stall_limit=0.5, probe_timeout=30
    )
    await asyncio.sleep(1.0)  # twice loop_stall_limit, with the first probe still waiting
    status, body = await probe(server, "/healthz/live")
    assert status == 200, body
    status, body = await probe(server, "/healthz/ready")
    assert (status, failing(body)) == (503, {"probe"})  # no probe has succeeded yet


# Readiness -----------------------------------------------------------------------------


async def test_readiness_says_why_and_fails_at_once_on_drain(make_server: ServerFactory) -> None:
    server = await ops_server(make_server)
    body = await until_ready(server)
    assert body["status"] == "ok"
    assert set(body["checks"]) >= {"probe", "draining", "breaker"}
    assert server.metrics.probes["ok"] >= 1
    server.begin_drain("test")
    status, body = await probe(server, "/healthz/ready")
    assert status == 503
    assert failing(body) == {"draining"}
    assert (await probe(server, "/healthz/live"))[0] == 200  # a restart would not help


@pytest.mark.parametrize("unready", [False, True])
async def test_readiness_on_saturation_is_a_setting(
    make_server: ServerFactory, unready: bool
) -> None:
    server = await ops_server(
        make_server, max_inflight=1, stub_ms=10_000, unready_when_saturated=unready
    )
    await until_ready(server)
    host, port = server.address
    async with await GovernorClient.connect(host, port) as client:
        job = asyncio.ensure_future(client.upload(b"holds the only slot", retry=NO_RETRY))
        await wait_until(lambda: server.ledger.saturated)
        status, body = await probe(server, "/healthz/ready")
        job.cancel()
    if unready:
        assert (status, failing(body)) == (503, {"saturation"})
    else:
        assert status == 200, body  # yield already tells clients; the replica is healthy


async def test_readiness_fails_above_the_kv_danger_line(make_server: ServerFactory) -> None:
    server = await ops_server(
        make_server,
        max_inflight=2,
        stub_ms=10_000,
        lanes=True,
        interactive_reserve=1,
        kv_capacity=400,
        kv_danger=0.5,
    )
    await until_ready(server)
    host, port = server.address
    async with await GovernorClient.connect(host, port) as client:
        spec = JobSpec(prompt="hi", max_new_tokens=250)  # interactive may use the whole budget
        job = asyncio.ensure_future(client.generate(spec, retry=NO_RETRY))
        await wait_until(lambda: server.ledger.kv_reserved > 200)
        status, body = await probe(server, "/healthz/ready")
        job.cancel()
    assert (status, failing(body)) == (503, {"kv"})
    assert "danger line 50%" in body["checks"]["kv"]["detail"]


async def test_a_failing_probe_makes_it_unready(make_server: ServerFactory) -> None:
    server = await ops_server(make_server, stub_fail_rate=1.0, breaker_failures=0)
    await wait_until(lambda: server.metrics.probes["failed"] >= 1)
    status, body = await probe(server, "/healthz/ready")
    assert (status, failing(body)) == (503, {"probe"})
    assert "injected probe failure" in body["checks"]["probe"]["detail"]
    assert (await probe(server, "/healthz/live"))[0] == 200


def test_only_loopback_may_drain() -> None:
    assert _is_loopback("127.0.0.1")
    assert _is_loopback("::1")
    assert _is_loopback("::ffff:127.0.0.1")
    assert not _is_loopback("10.1.2.3")
    assert not _is_loopback("::ffff:10.1.2.3")
    assert not _is_loopback("not an address")


async def test_post_drain_waits_for_running_jobs(make_server: ServerFactory) -> None:
    server = await ops_server(make_server, max_inflight=2, stub_ms=400)
    await until_ready(server)
    host, port = server.address
    async with await GovernorClient.connect(host, port) as client:
        running = asyncio.ensure_future(client.upload(b"in flight", retry=NO_RETRY))
        await wait_until(lambda: server.inflight == 1)
        status, body = await asyncio.to_thread(http, base_url(server) + "/drain?wait=10", "POST")
        assert (status, body) == (200, {"draining": True, "drained": True, "inflight": 0})
        assert (await running).done
        late = await client.upload(b"too late", retry=NO_RETRY)
        assert (late.status, late.reply.need_code) == ("yield", "draining")
    # The listener stays open while draining: a client routed here late gets told so.
    async with await GovernorClient.connect(host, port) as newcomer:
        refused = await newcomer.upload(b"new connection", retry=NO_RETRY)
    assert refused.reply.need_code == "draining"
    assert (await probe(server, "/healthz/ready"))[0] == 503
    assert (await probe(server, "/nowhere"))[0] == 404


async def test_a_drain_deadline_counts_from_its_start(make_server: ServerFactory) -> None:
    server = await ops_server(make_server, stub_ms=60_000, shutdown_grace=2.0)
    host, port = server.address
    async with await GovernorClient.connect(host, port) as client:
        job = asyncio.ensure_future(client.upload(b"never ends", retry=NO_RETRY))
        await wait_until(lambda: server.inflight == 1)
        status, body = await asyncio.to_thread(http, base_url(server) + "/drain?wait=0.1", "POST")
        assert (status, body["drained"], body["inflight"]) == (200, False, 1)
        await asyncio.sleep(2.0)  # the grace period runs out before the shutdown begins ...
        started = time.monotonic()
        assert await server.drain() == 1  # ... so the shutdown aborts at once, not in 2 s
        assert time.monotonic() - started < 1.0
        result = await job
    assert (result.status, result.reply.need_code) == ("abort", "shutdown")


# Metrics after a scripted run -----------------------------------------------------------


async def test_metrics_after_a_scripted_run(make_server: ServerFactory) -> None:
    server = await ops_server(
        make_server,
        max_inflight=2,
        stub_ms=0,
        stub_output_ms=5,
        lanes=True,
        interactive_reserve=1,
    )
    await until_ready(server)
    host, port = server.address
    chat = JobSpec(prompt="hello there", max_new_tokens=8)
    async with await GovernorClient.connect(host, port) as client:
        # The third asks for a TPOT the stub's 5 ms a token misses: judged, not good.
        tight = dataclasses.replace(chat, tpot_slo_ms=1.0)
        done = [await client.generate(c, retry=NO_RETRY) for c in (chat, chat, tight)]
        assert all(r.done for r in done)
        # A heavy job may not take the interactive reserve: one yield, lane_full.
        heavy = JobSpec(prompt="word " * 1000, max_new_tokens=300)
        long = JobSpec(prompt="hold", max_new_tokens=1000)  # heavy: 5 s of stub output
        blocker = asyncio.ensure_future(client.generate(long, job="J_block", retry=NO_RETRY))
        await wait_until(lambda: server.ledger.inflight == 1)
        refused = await client.generate(heavy, retry=NO_RETRY)
        assert refused.reply.need_code == "lane_full"
        await client.cancel("J_block")
        assert (await blocker).reply.need_code == "cancelled"
    m = await asyncio.to_thread(_scrape, server)
    lane = 'lane="interactive"'
    finished = f'governor_jobs_finished_total{{{lane},outcome="done",pool="primary"}}'
    assert m[finished] == 3
    assert m[f"governor_time_to_first_token_seconds_count{{{lane}}}"] == 3
    assert m[f"governor_time_per_output_token_seconds_count{{{lane}}}"] == 3
    assert m[f"governor_e2e_job_latency_seconds_count{{{lane}}}"] == 3
    assert m[f"governor_job_output_tokens_sum{{{lane}}}"] == 3 * 8
    assert m[f"governor_job_prompt_tokens_count{{{lane}}}"] == 3
    # TPOT: 7 tokens after the first at 5 ms each.
    tpot = m[f"governor_time_per_output_token_seconds_sum{{{lane}}}"] / 3
    assert 0.004 < tpot < 0.05
    # Every admission attempt was timed: 3 chats, 1 blocker (heavy), 1 refused heavy.
    assert m[f"governor_admission_decision_seconds_count{{{lane}}}"] == 3
    assert m['governor_admission_decision_seconds_count{lane="heavy"}'] == 2
    assert m[f"governor_admission_wait_seconds_count{{{lane}}}"] == 3
    assert m['governor_yields_total{lane="heavy",reason="lane_full",tenant="default"}'] == 1
    assert m['governor_aborts_total{reason="cancelled"}'] == 1
    assert m['governor_jobs_finished_total{lane="heavy",outcome="cancelled",pool="primary"}'] == 1
    assert m['governor_breaker_state{pool="primary"}'] == 0
    assert m["governor_ready"] == 1
    assert m["governor_live"] == 1
    assert m['governor_probes_total{result="ok"}'] >= 1
    assert m["governor_probe_duration_seconds_count"] == m['governor_probes_total{result="ok"}']
    assert m['governor_lane_inflight{lane="interactive"}'] == 0
    assert m["governor_kv_capacity_tokens"] == 0
    assert m['governor_tenant_inflight{tenant="default"}'] == 0
    # Objectives: the three chats judged (the cancelled heavy job is not), two good.
    assert m[f"governor_slo_jobs_total{{{lane}}}"] == 3
    met = {o: m[f'governor_slo_met_total{{{lane},objective="{o}"}}'] for o in OBJECTIVES}
    assert met == {"ttft": 3, "tpot": 2, "both": 2}
    shares = {o: m[f'governor_slo_attainment{{{lane},objective="{o}"}}'] for o in OBJECTIVES}
    assert shares == {"ttft": 1.0, "tpot": pytest.approx(2 / 3), "both": pytest.approx(2 / 3)}
    assert not [k for k in m if k.startswith("governor_slo_") and 'lane="heavy"' in k]


async def test_log_lines_the_writer_cannot_take_are_dropped_and_counted(
    make_server: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = await ops_server(make_server)
    # A writer that has fallen behind: never started, room for one line.
    writer = logs.LineWriter(io.StringIO(), max_pending=1)
    monkeypatch.setattr(logs, "_writer", writer)
    for n in range(3):
        logs.event(logging.getLogger("governor.test"), logging.WARNING, f"line {n}")  # no block
    m = await asyncio.to_thread(_scrape, server)
    assert writer.dropped >= 2
    assert m["governor_log_records_dropped_total"] == writer.dropped


# The daemon: governor drain, JSON logs --------------------------------------------------


def metrics_addr(d: Daemon) -> str:
    match = re.search(rb"metrics and health probes on http://(\S+):(\d+)", d.stderr_head)
    assert match is not None, d.stderr_head
    return f"{match[1].decode()}:{match[2].decode()}"


def governor_drain(addr: str, wait: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "governor", "drain", "--metrics-listen", addr, "--wait", str(wait)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


class HeldUpstream(ThreadingHTTPServer):
    """An OpenAI-compatible server for the http runner whose jobs end when the test says so.

    A probe (``max_tokens`` 1) is answered at once; a job streams one token, then waits for
    :attr:`release`. A job of the daemon's then runs exactly as long as the test holds it, on
    a loaded machine too, where a job of a fixed duration may end before a slow client acts.
    """

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _HeldHandler)
        self.arrived = threading.Event()  # a job's request has come in
        self.release = threading.Event()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"


class _HeldHandler(BaseHTTPRequestHandler):
    server: HeldUpstream

    def do_GET(self) -> None:  # /v1/models: the runner's start-up check
        body = b'{"data": []}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # /v1/completions, streamed; HTTP/1.0: the close ends it
        request = orjson.loads(self.rfile.read(int(self.headers["content-length"])))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        self._event({"choices": [{"text": "held", "finish_reason": None}]})
        if request["max_tokens"] > 1:
            self.server.arrived.set()
            self.server.release.wait(60)
        self._event({"choices": [{"text": " free", "finish_reason": "length"}]})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, obj: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + orjson.dumps(obj) + b"\n\n")

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the daemon's requests are no news


@pytest.fixture
def held_upstream() -> Iterator[HeldUpstream]:
    upstream = HeldUpstream()
    thread = threading.Thread(target=upstream.serve_forever, daemon=True)
    thread.start()
    try:
        yield upstream
    finally:
        upstream.release.set()
        upstream.shutdown()
        upstream.server_close()
        thread.join(10)


def test_governor_drain_then_sigterm_loses_nothing_and_logs_json(
    daemon: DaemonFactory, held_upstream: HeldUpstream
) -> None:
    d = daemon(
        "--runner",
        "http",
        "--upstream",
        held_upstream.url,
        "--metrics-listen",
        "127.0.0.1:0",
        "--log-format",
        "json",
        "--probe-interval",
        "0.1",
    )
    addr = metrics_addr(d)
    # Readiness is logged by the heartbeat after the first probe succeeds, up to 0.2 s after
    # the listening line: a drain sent before it would leave no "passes" line to check below.
    d.wait_for_log(rb"readiness passes")

    async def scenario() -> tuple[str, float]:
        async with await connect(d.addr) as client, await connect(d.addr) as watcher:
            job = asyncio.ensure_future(client.upload(b"in flight", retry=NO_RETRY))
            assert await asyncio.to_thread(held_upstream.arrived.wait, 30)
            held_from = time.monotonic()
            cut_short = await asyncio.to_thread(governor_drain, addr, 0.1)
            assert cut_short.returncode == 1, cut_short  # the job is held: still running
            assert not job.done()
            held_s = time.monotonic() - held_from
            held_upstream.release.set()
            drained = await asyncio.to_thread(governor_drain, addr, 30)
            assert drained.returncode == 0, drained
            assert orjson.loads(drained.stdout)["drained"] is True
            assert job.done()
            late = await watcher.upload(b"late", retry=NO_RETRY)
            assert late.reply.need_code == "draining"
            return str((await job).status), held_s

    status, held_s = asyncio.run(scenario())
    assert status == "done"
    d.signal(signal.SIGTERM)
    code, err = d.wait()
    assert code == 0, err.decode()
    lines = [orjson.loads(line) for line in err.splitlines() if line.startswith(b"{")]
    assert lines, err.decode()
    assert all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)
    (job,) = [line for line in lines if line.get("event") == "job" and line["outcome"] == "done"]
    assert job["tenant"] == "default"
    assert job["lane"] == "-"
    assert job["pool"] == "primary"
    assert job["e2e_ms"] >= held_s * 1000  # it ran through the whole hold
    assert job["expected_ms"] > 0  # what the governor predicted it would hold the slot
    # Without lanes, the interactive lane's objectives; judged as the client felt it.
    assert (job["slo_ttft_ms"], job["slo_tpot_ms"]) == (1000.0, 100.0)
    felt_ms = (job["wait_ms"] or 0) + (job["ttft_ms"] or job["e2e_ms"])
    assert job["met_ttft"] == (felt_ms <= 1000)
    assert job["good"] == (job["met_ttft"] and job["met_tpot"])
    assert isinstance(job["conn"], int)
    drain = [line for line in lines if line.get("event") == "drain"]
    assert [line["reason"] for line in drain] == ["POST /drain"]
    readiness = [line for line in lines if line.get("event") == "readiness"]
    assert [line["ok"] for line in readiness][:1] == [True]
    assert readiness[-1]["ok"] is False
    assert readiness[-1]["failing"] == ["draining"]
