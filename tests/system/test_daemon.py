"""The daemon as a real process: CLI, config file, signals and drain, governor-cli, /metrics."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients import NO_RETRY, GovernorClient, UploadResult, connect
from governor.core.ledger import DRAINING_HINT_MS
from governor.server import Server
from tests.conftest import Daemon, ServerFactory, wait_until
from tests.system.test_deploy import http_get, metrics_address

DaemonFactory = Callable[..., Daemon]


def cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return cli_of("clients", *args, timeout=timeout)


def cli_of(package: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``python -m PACKAGE ARGS``: governor-cli (``clients``) or ``governor``."""
    return subprocess.run(
        [sys.executable, "-m", package, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_serve_on_port_zero_logs_the_bound_address(daemon: DaemonFactory) -> None:
    d = daemon("--max-inflight", "2", "--runner", "stub", "--stub-ms", "10")
    assert d.port > 0
    assert b"max_inflight=2" in d.stderr_head


def test_cli_ping_exit_codes(daemon: DaemonFactory, tmp_path: Path) -> None:
    d = daemon("--max-inflight", "1", "--stub-ms", "5000")
    ready = cli("--addr", d.addr, "ping")
    assert ready.returncode == 0, ready.stderr
    assert '"server.health","value_u64":1' in ready.stdout
    payload = tmp_path / "job.txt"
    payload.write_text("hold the only slot")
    holder = subprocess.Popen(
        [sys.executable, "-m", "clients", "--addr", d.addr, "upload", str(payload)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(200):  # until the holder's job is admitted
            saturated = cli("--addr", d.addr, "ping")
            if saturated.returncode != 0:
                break
        assert saturated.returncode == 2, saturated.stdout
        refused = cli(
            "--addr", d.addr, "upload", str(payload), "--max-attempts", "1", "--max-wait", "0"
        )
        assert refused.returncode == 1
        assert '"status":"yield"' in refused.stdout
        assert '"need_code":"server_busy"' in refused.stdout
        # By default it waits on the daemon for its turn: one attempt, done after the holder's.
        waited = cli("--addr", d.addr, "upload", str(payload), "--max-attempts", "1")
        assert waited.returncode == 0, waited.stdout + waited.stderr
        assert '"status":"done"' in waited.stdout
    finally:
        out, _ = holder.communicate(timeout=30)
    assert holder.returncode == 0
    assert b'"status":"done"' in out
    unreachable = cli("--addr", "127.0.0.1:1", "--timeout", "2", "ping")
    assert unreachable.returncode == 1


def test_cli_ping_waits_for_a_daemon_still_starting(daemon: DaemonFactory) -> None:
    """``ping --wait`` pings again until the daemon answers ready; without it, a port not yet
    open is an error at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{probe.getsockname()[1]}"
    assert cli("--addr", addr, "ping").returncode == 1
    waiting = subprocess.Popen(
        [sys.executable, "-m", "clients", "--addr", addr, "ping", "--wait", "30"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(1.0)  # (the pinger's first tries find the port closed)
        assert waiting.poll() is None, waiting.communicate()
        daemon("--listen", addr, "--stub-ms", "10")
        out, err = waiting.communicate(timeout=30)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.communicate()
    assert waiting.returncode == 0, err
    assert '"server.health","value_u64":1' in out


def test_cli_upload_abort_exits_2(daemon: DaemonFactory, tmp_path: Path) -> None:
    d = daemon("--stub-ms", "1", "--stub-fail-rate", "1")
    payload = tmp_path / "p.bin"
    payload.write_bytes(bytes(range(256)) * 100)
    result = cli("--addr", d.addr, "upload", str(payload), "--chunk-bytes", "1000")
    assert result.returncode == 2
    assert '"need_code":"backend_error"' in result.stdout


def test_sigterm_drains_without_losing_an_admitted_job(daemon: DaemonFactory) -> None:
    d = daemon("--max-inflight", "3", "--stub-ms", "800", "--shutdown-grace", "20")

    async def scenario() -> list[str]:
        clients = [await connect(d.addr) for _ in range(3)]
        try:
            uploads = [
                asyncio.ensure_future(c.upload(b"in flight", retry=NO_RETRY)) for c in clients
            ]
            async with await connect(d.addr) as probe:
                for _ in range(500):
                    reply = await probe.ping()
                    if reply.receipt("backend.inflight") == 3:
                        break
                assert reply.receipt("backend.inflight") == 3
                d.signal(signal.SIGTERM)
                for _ in range(500):
                    if (await probe.ping()).receipt("server.draining") == 1:
                        break
                # Connections already open stay, but new work is refused.
                late = await probe.upload(b"late", retry=NO_RETRY)
                assert late.status == "yield"
                assert late.reply.need_code == "draining"
            results = await asyncio.gather(*uploads)
            return [str(r.status) for r in results]
        finally:
            for c in clients:
                await c.close()

    assert asyncio.run(scenario()) == ["done"] * 3
    code, err = d.wait()
    assert code == 0, err.decode()
    assert b"draining" in err
    assert b"0 job(s) aborted" in err


def test_governor_drain_leaves_the_daemon_up_until_sigterm_stops_it_at_once(
    daemon: DaemonFactory,
) -> None:
    """Drain, then SIGTERM. ``governor drain`` (POST /drain) closes admission and waits for
    the running jobs; the process stays up, drained, answering its probes and telling new jobs
    to go elsewhere. The SIGTERM that follows (the kubelet's, once a preStop hook returns)
    stops it at once: not after shutdown_grace, which is longer than this test may run."""
    d = daemon(
        "--max-inflight", "2", "--stub-ms", "300", "--shutdown-grace", "600",
        "--metrics-listen", "127.0.0.1:0",
    )  # fmt: skip
    addr = metrics_address(d)

    async def scenario() -> tuple[UploadResult, UploadResult]:
        async with await connect(d.addr) as client, await connect(d.addr) as probe:
            job = asyncio.ensure_future(client.upload(b"in flight", retry=NO_RETRY))
            for _ in range(500):
                if (await probe.ping()).receipt("backend.inflight") == 1:
                    break
            drained = await asyncio.to_thread(
                cli_of, "governor", "drain", "--metrics-listen", addr, "--wait", "30"
            )
            assert drained.returncode == 0, drained
            assert orjson.loads(drained.stdout) == {
                "draining": True,
                "drained": True,
                "inflight": 0,
            }
            finished = await job
        assert d.proc.poll() is None, "the drain alone must not stop the process"
        async with await connect(d.addr) as newcomer:  # (a client routed here late)
            refused = await newcomer.upload(b"late", retry=NO_RETRY)
        return finished, refused

    finished, refused = asyncio.run(scenario())
    assert finished.status == "done"
    assert (refused.status, refused.reply.need_code) == ("yield", "draining")
    # Go elsewhere, soon: not "come back here in a minute", nor "no slot free".
    assert refused.reply.retry_hint_ms == DRAINING_HINT_MS
    assert "draining" in (refused.reply.detail or "")
    assert "slot" not in (refused.reply.detail or "")
    assert http_get(f"http://{addr}/healthz/ready")[0] == 503
    d.signal(signal.SIGTERM)
    code, err = d.wait(timeout=30)
    assert code == 0, err.decode()
    assert b"stopping the drained daemon" in err
    assert b"0 job(s) aborted" in err


def test_second_signal_aborts_running_jobs(daemon: DaemonFactory) -> None:
    d = daemon("--max-inflight", "1", "--stub-ms", "60000", "--shutdown-grace", "60")

    async def scenario() -> str | None:
        async with await connect(d.addr) as client, await connect(d.addr) as probe:
            upload = asyncio.ensure_future(client.upload(b"forever", retry=NO_RETRY))
            for _ in range(500):
                if (await probe.ping()).receipt("backend.inflight") == 1:
                    break
            d.signal(signal.SIGINT)
            for _ in range(500):  # the first signal only starts the drain ...
                reply = await probe.ping()
                if reply.receipt("server.draining") == 1:
                    break
            assert reply.receipt("backend.inflight") == 1
            assert not upload.done()
            d.signal(signal.SIGINT)  # ... the second one ends it
            result = await asyncio.wait_for(upload, 10)
            assert result.status == "abort"
            return result.reply.need_code

    assert asyncio.run(scenario()) == "shutdown"
    code, err = d.wait()
    assert code == 0
    assert b"1 job(s) aborted" in err


def test_config_file_with_flag_override(daemon: DaemonFactory, tmp_path: Path) -> None:
    config = tmp_path / "governor.toml"
    config.write_text('max_inflight = 5\nstub_ms = 7\nlog_level = "debug"\n')
    d = daemon("--config", str(config), "--max-inflight", "6")
    ping = cli("--addr", d.addr, "ping")
    assert '"backend.cap","value_u64":6' in ping.stdout


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("max_inflight = 0\n", "max_inflight must be at least 1"),
        ("max_infligth = 3\n", "unknown key 'max_infligth'"),
        ('max_inflight = "3"\n', "max_inflight must be of type int"),
        ("max_inflight = \n", "not valid TOML"),
        ('listen = "nowhere"\n', "is not HOST:PORT"),
        ('runner = "gpu"\n', "runner must be one of"),
    ],
)
def test_bad_config_exits_2_with_a_clear_message(tmp_path: Path, toml: str, message: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(toml)
    result = subprocess.run(
        [sys.executable, "-m", "governor", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert message in result.stderr


def test_address_in_use_exits_1(daemon: DaemonFactory) -> None:
    d = daemon()
    result = subprocess.run(
        [sys.executable, "-m", "governor", "serve", "--runner", "stub", "--listen", d.addr],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 1
    assert "cannot serve" in result.stderr


async def test_metrics_endpoint(make_server: ServerFactory) -> None:
    server = await make_server(max_inflight=1, stub_ms=200, metrics_listen="127.0.0.1:0")
    host, port = server.address
    async with (
        await GovernorClient.connect(host, port) as a,
        await GovernorClient.connect(host, port) as b,
    ):
        first = asyncio.ensure_future(a.upload(b"one", retry=NO_RETRY))
        await wait_until(lambda: server.ledger.inflight == 1)
        second = await b.upload(b"two", retry=NO_RETRY)
        during = await asyncio.to_thread(_scrape, server)
        await first
    after = await asyncio.to_thread(_scrape, server)
    assert second.status == "yield"
    assert during["governor_inflight"] == 1
    assert during["governor_health"] == 0
    assert after["governor_inflight"] == 0
    assert after["governor_inflight_cap"] == 1
    assert after["governor_executed_total"] == 1
    assert after["governor_yielded_total"] == 1
    assert after["governor_health"] == 1
    assert after['governor_jobs_finished_total{lane="-",outcome="done",pool="primary"}'] == 1
    assert after["governor_connections"] == 0
    mhost, mport = server.metrics_address or ("", 0)
    with pytest.raises(urllib.error.HTTPError) as info:
        await asyncio.to_thread(
            urllib.request.urlopen, f"http://{mhost}:{mport}/nothing", timeout=5
        )
    assert info.value.code == 404
    info.value.close()


def _scrape(server: Server) -> dict[str, float]:
    host, port = server.metrics_address or ("", 0)
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples
