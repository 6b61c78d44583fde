"""Shared fixtures: an in-process server on a port-0 socket, a raw frame client, a daemon process.

Async tests run on both uvloop (what the daemon uses) and the standard asyncio loop, but for the
tests marked ``real_model`` (the embedded model, a llama.cpp server: slow, and not about the
loop), which run on uvloop alone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

import orjson
import pytest
import uvloop
from hypothesis import HealthCheck, settings

from governor import compiled
from governor.config import Config
from governor.runners import Runner
from governor.server import Server
from loadtest.support.redisserver import RedisServer
from tests.clock import FakeClock

LISTEN_LINE = re.compile(rb"listening on (\S+):(\d+)")

# The invariants' state machine and its doors assert outside test modules: their failures
# should show the values as the tests' own do.
# Every property runs on a machine that may be busy (CI, or both cores loaded on purpose):
# hypothesis's timing checks (a 200 ms deadline per example, a health check on slow data
# generation) would fail a test for the machine's load, not for the code's behaviour.
settings.register_profile("governor", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("governor")

pytest.register_assert_rewrite(
    "tests.inprocess.interleavings", "tests.inprocess.door_tcp", "tests.inprocess.door_http"
)


def pytest_report_header(config: pytest.Config) -> str:
    return f"governor: {compiled.summary()[1]}"


def pytest_sessionstart(session: pytest.Session) -> None:
    """A compiled module older than its source would test the old code: refuse to."""
    current, line = compiled.summary()
    if not current:
        pytest.exit(line, returncode=4)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.get_closest_marker("real_model"):  # (slow, and not about the loop: uvloop only)
        return {"uvloop": uvloop.new_event_loop}
    return {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}


async def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``condition`` on the event loop until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


ServerFactory = Callable[..., Awaitable[Server]]


@pytest.fixture
async def make_server() -> AsyncIterator[ServerFactory]:
    """``await make_server(instance=None, **config)``: a started server on 127.0.0.1:0, running
    jobs on ``instance`` if given, else on the runner the config names (the stub by default)."""
    servers: list[Server] = []

    async def factory(instance: Runner | None = None, **config: Any) -> Server:
        config.setdefault("runner", "stub")
        config.setdefault("stub_ms", 50)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        server = Server(Config(listen="127.0.0.1:0", **config), instance)
        await server.start(sock=sock)
        servers.append(server)
        return server

    yield factory
    for server in servers:
        await server.close()


class RawConn:
    """A bare TCP connection speaking frames as dicts, for exact protocol tests."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, server: Server, *, source: str | None = None) -> RawConn:
        """Connect, from the loopback address ``source`` if given (127.0.0.2, ...: another
        client as far as the server can tell)."""
        host, port = server.address
        reader, writer = await asyncio.open_connection(
            host, port, limit=2**24, local_addr=None if source is None else (source, 0)
        )
        return cls(reader, writer)

    def send_raw(self, data: bytes) -> None:
        self.writer.write(data)

    def send(self, frame: Mapping[str, Any]) -> None:
        self.writer.write(orjson.dumps(frame) + b"\n")

    async def recv(self, timeout: float = 5.0) -> dict[str, Any]:
        line = await asyncio.wait_for(self.reader.readline(), timeout)
        assert line.endswith(b"\n"), f"connection closed instead of a reply: {line!r}"
        frame: dict[str, Any] = orjson.loads(line)
        return frame

    async def recv_eof(self, timeout: float = 5.0) -> None:
        """Assert that the server closes the connection (with nothing more to read)."""
        rest = await asyncio.wait_for(self.reader.read(), timeout)
        assert rest == b"", f"expected the connection to close, got {rest!r}"

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


def outcomes(server: Server) -> collections.Counter[str]:
    """Admitted jobs' ends by outcome, over every lane and pool (the exported counter)."""
    counts: collections.Counter[str] = collections.Counter()
    for (outcome, _, _), n in server.metrics.finished.items():
        counts[outcome] += n
    return counts


def receipt(frame: Mapping[str, Any], kind: str) -> int | None:
    for r in frame.get("receipts", ()):
        if r["kind"] == kind:
            value: int = r["value_u64"]
            return value
    return None


@pytest.fixture
async def raw(make_server: ServerFactory) -> AsyncIterator[Callable[[Server], Awaitable[RawConn]]]:
    """``await raw(server)``: a :class:`RawConn` closed after the test."""
    conns: list[RawConn] = []

    async def opener(server: Server) -> RawConn:
        conn = await RawConn.open(server)
        conns.append(conn)
        return conn

    yield opener
    for conn in conns:
        await conn.close()


@dataclass
class Daemon:
    """A ``governor serve`` process started by a test, stopped by its own PID.

    Its stderr is read to the end by a thread, so that a daemon logging every job never
    blocks on a full pipe; :meth:`wait_for_log` waits on that thread for a line.
    """

    proc: subprocess.Popen[bytes]
    host: str
    port: int
    stderr_head: bytes
    stderr_rest: list[bytes] = field(default_factory=list)
    reader: threading.Thread = field(init=False)
    _new_line: threading.Condition = field(init=False, default_factory=threading.Condition)
    _eof: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        stderr = self.proc.stderr
        assert stderr is not None
        self.reader = threading.Thread(target=self._read_to_eof, args=(stderr,), daemon=True)
        self.reader.start()

    def _read_to_eof(self, stderr: IO[bytes]) -> None:
        for line in stderr:
            with self._new_line:
                self.stderr_rest.append(line)
                self._new_line.notify_all()
        with self._new_line:
            self._eof = True
            self._new_line.notify_all()

    def wait_for_log(self, pattern: bytes, timeout: float = 30.0) -> None:
        """Block until the daemon has logged a line matching ``pattern``; fail if it exits or
        ``timeout`` seconds pass first."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._new_line:
            while not regex.search(self.stderr_head + b"".join(self.stderr_rest)):
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    raise AssertionError(
                        f"the daemon logged no {pattern!r}"
                        + (" before it exited" if self._eof else f" within {timeout:g} s")
                    )
                self._new_line.wait(left)

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 30.0) -> tuple[int, bytes]:
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout)
        return code, self.stderr_head + b"".join(self.stderr_rest)


def start_daemon(*args: str, timeout: float = 60.0) -> Daemon:
    """Start ``python -m governor serve ARGS`` (on the stub runner unless ARGS name one) and
    wait for its listening line."""
    runner = () if "--runner" in args else ("--runner", "stub")
    proc = subprocess.Popen(
        [sys.executable, "-m", "governor", "serve", "--listen", "127.0.0.1:0", *runner, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stderr is not None
    fd = proc.stderr.fileno()
    head = b""
    deadline = time.monotonic() + timeout
    # Raw reads: a buffered readline() could take the listening line into Python's buffer,
    # where select() never sees it, and the wait would run to its timeout.
    with selectors.DefaultSelector() as selector:  # a silent daemon must not hang the test
        selector.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0 and selector.select(timeout=left):
            chunk = os.read(fd, 65536)
            if not chunk:  # EOF: the daemon exited
                break
            head += chunk
            if match := LISTEN_LINE.search(head[: head.rfind(b"\n") + 1]):
                return Daemon(proc, match[1].decode(), int(match[2]), head)
    proc.kill()
    proc.wait()
    proc.stderr.close()
    raise AssertionError(f"daemon did not start: {head.decode(errors='replace')}")


def stop_daemon(daemon: Daemon) -> None:
    if daemon.proc.poll() is None:
        daemon.proc.send_signal(signal.SIGTERM)
        try:
            daemon.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            daemon.proc.kill()
            daemon.proc.wait()
    daemon.reader.join(10)
    if daemon.proc.stderr is not None:
        daemon.proc.stderr.close()


@pytest.fixture
def daemon() -> Iterator[Callable[..., Daemon]]:
    """``daemon(*flags)``: a running ``governor serve`` process, stopped after the test."""
    started: list[Daemon] = []

    def factory(*args: str) -> Daemon:
        d = start_daemon(*args)
        started.append(d)
        return d

    yield factory
    for d in started:
        stop_daemon(d)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A real Redis of the test's own (Debian's redis-server on a free port), stopped by its
    PID before the test's event loop closes (uvloop's close waits for live children)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def clock() -> FakeClock:
    """The test clock, at 1000 s (:class:`tests.clock.FakeClock`)."""
    return FakeClock()


@pytest.fixture
def stopped_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The clock of the servers made after it: their ledger's, which every part of a server
    reads (admission, the lanes, the line, the sessions' deadlines). Requests that real sockets
    deliver some milliseconds apart (more on a loaded machine) then reach admission at the
    moment the test says, and time that must pass for a rule passes when the test moves it."""
    import functools

    import governor.server
    from governor.core.ledger import SlotLedger

    clock = FakeClock(time.monotonic())
    monkeypatch.setattr(governor.server, "SlotLedger", functools.partial(SlotLedger, clock=clock))
    return clock
