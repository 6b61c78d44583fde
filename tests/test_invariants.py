"""The count holds whatever the clients do: slots held equal the jobs with a live execution.

Real servers over real loopback sockets, on both event loops: first the interleavings that
leaked every slot before admission's ticket was released by the job task's done-callback (a
job and its cancel in one write, a job and an over-long line, one job too many, a reset), then
a hypothesis state machine that drives random interleavings of them, with runner successes and
failures and a drain, checking the invariants after every step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import struct
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from typing import Any

import orjson
import pytest
import uvloop
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from governor.config import Config
from governor.ledger import Refusal
from governor.runners import Finished, Job, RunEvent, RunnerError, RunnerHealth, StubRunner
from governor.server import Server
from governor.tenants import TenantConfig

from .conftest import ServerFactory, wait_until

LINE_LIMIT = 2048


def inline(job: str, seq: int = 1, data: str = "hello", key: str | None = None) -> bytes:
    frame: dict[str, Any] = {
        "v": 0,
        "verb": "share",
        "job": job,
        "seq": seq,
        "ttl_ms": 0,
        "payload_inline": {"sha256": hashlib.sha256(data.encode()).hexdigest(), "data": data},
    }
    if key is not None:
        frame["api_key"] = key
    return orjson.dumps(frame) + b"\n"


def cancel(job: str, seq: int = 2) -> bytes:
    return orjson.dumps({"v": 0, "verb": "cancel", "job": job, "seq": seq, "ttl_ms": 0}) + b"\n"


def ping(seq: int = 1) -> bytes:
    return orjson.dumps({"v": 0, "verb": "ping", "job": "J_p", "seq": seq, "ttl_ms": 0}) + b"\n"


def accounted(server: Server) -> tuple[int, int, int, list[int]]:
    """(slots held, live executions, buffered payload bytes, each tenant's inflight)."""
    return (
        server.inflight,
        server.live_jobs,
        server.buffered_bytes,
        [t.inflight for t in server.tenants.all()],
    )


async def all_given_back(server: Server) -> None:
    await wait_until(lambda: accounted(server)[:3] == (0, 0, 0))
    assert all(t.inflight == 0 and not t.running for t in server.tenants.all())


# The paths that leaked -------------------------------------------------------------------


async def test_a_job_and_its_cancel_in_one_write(make_server: ServerFactory) -> None:
    server = await make_server(stub_ms=300, max_inflight=4)
    reader, writer = await asyncio.open_connection(*server.address)
    writer.write(b"".join(inline(f"J_{i}") + cancel(f"J_{i}") for i in range(4)))
    replies = [orjson.loads(await reader.readline()) for _ in range(4)]
    assert [(r["job"], r["status"], r["need_code"]) for r in replies] == [
        (f"J_{i}", "abort", "cancelled") for i in range(4)
    ]
    await all_given_back(server)
    writer.write(inline("J_after"))  # and the slots are there for the next job
    assert orjson.loads(await reader.readline())["status"] == "done"
    writer.close()


async def test_a_job_and_an_over_long_line_in_one_write(make_server: ServerFactory) -> None:
    server = await make_server(stub_ms=2000, max_inflight=2, max_line_bytes=LINE_LIMIT)
    reader, writer = await asyncio.open_connection(*server.address)
    writer.write(inline("J_1") + b"x" * (LINE_LIMIT + 10) + b"\n")
    (frame,) = [orjson.loads(line) for line in (await reader.read()).splitlines()]
    # The job's own abort is the connection's answer too: one terminal frame, not two.
    assert (frame["job"], frame["status"], frame["need_code"]) == ("J_1", "abort", "line_too_large")
    assert frame["detail"].startswith("the connection is closing")
    await all_given_back(server)
    writer.close()


async def test_one_job_too_many_in_one_write(make_server: ServerFactory) -> None:
    server = await make_server(stub_ms=2000, max_inflight=4, max_jobs_per_conn=4)
    reader, writer = await asyncio.open_connection(*server.address)
    writer.write(b"".join(inline(f"J_{i}") for i in range(5)))
    frames = [orjson.loads(line) for line in (await reader.read()).splitlines()]
    assert sorted(f["job"] for f in frames) == [f"J_{i}" for i in range(5)]
    assert {f["need_code"] for f in frames} == {"too_many_jobs"}
    await all_given_back(server)
    writer.close()


async def test_a_reset_right_after_a_ping_and_a_job(make_server: ServerFactory) -> None:
    server = await make_server(stub_ms=2000, max_inflight=2)
    for _ in range(10):
        sock = socket.create_connection(server.address)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.sendall(ping() + inline("J_1"))
        sock.close()  # RST: the answer to the ping fails to write
    await all_given_back(server)


# Random interleavings --------------------------------------------------------------------


class GateRunner(StubRunner):
    """Each job runs until the test lets it finish, or fails it."""

    name = "gate"

    def __init__(self) -> None:
        super().__init__(0.0)
        self.gates: dict[str, asyncio.Future[bool]] = {}

    async def run(self, job: Job) -> AsyncGenerator[RunEvent, None]:
        gate = asyncio.get_running_loop().create_future()
        self.gates[job.id] = gate
        try:
            ok = await gate
        finally:
            del self.gates[job.id]
        if not ok:
            raise RunnerError("gate runner: failed on purpose")
        yield Finished({"runner": self.name})

    def end(self, ok: bool) -> bool:
        for gate in self.gates.values():
            if not gate.done():
                gate.set_result(ok)
                return True
        return False

    def health(self) -> RunnerHealth:
        return RunnerHealth(supervisor_alive=True, workers_live=0, workers=0)


TENANT_KEYS = ("k-a", "k-b")
TENANTS = (
    TenantConfig(name="a", key_sha256=hashlib.sha256(b"k-a").hexdigest(), max_inflight=1),
    TenantConfig(name="b", key_sha256=hashlib.sha256(b"k-b").hexdigest()),
)
CAP, JOBS_PER_CONN = 3, 3
TERMINAL = ("done", "abort")
# A fatal frame for the connection names the last frame's job; unless it is that job's own
# abort ("the connection is closing: ..."), it is the connection's answer, not the job's.
CONNECTION_CODES = frozenset({"line_too_large", "too_many_jobs", "too_many_connections"})


def job_terminal(frame: dict[str, Any]) -> bool:
    if frame.get("status") not in TERMINAL or not frame["job"].startswith("J_"):
        return False
    connection = frame.get("need_code") in CONNECTION_CODES
    return not connection or frame.get("detail", "").startswith("the connection is closing")


class Client:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.terminals: Counter[str] = Counter()
        self.sent = 0
        self.gone = False

    def write(self, data: bytes) -> None:
        if self.writer.is_closing():  # the server closed it and we have not read that yet
            self.gone = True
        else:
            self.writer.write(data)

    async def read_available(self) -> None:
        """What the server has sent, waiting a little for it."""
        while not self.reader.at_eof():
            try:
                line = await asyncio.wait_for(self.reader.readline(), 0.02)
            except TimeoutError:
                return
            if not line:  # the server closed it (a fatal frame)
                self.gone = True
                return
            frame = orjson.loads(line)
            if job_terminal(frame):
                self.terminals[frame["job"]] += 1


class Interleavings(RuleBasedStateMachine):
    """Drives one real server; ``make_loop`` picks the event loop."""

    make_loop: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop

    def __init__(self) -> None:
        super().__init__()
        self.loop = type(self).make_loop()
        self.runner = GateRunner()
        self.clients: list[Client] = []
        self.drained = False
        self.jobs = 0

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    @initialize()
    def start(self) -> None:
        async def start() -> Server:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            config = Config(
                listen="127.0.0.1:0",
                runner="stub",
                max_inflight=CAP,
                max_jobs_per_conn=JOBS_PER_CONN,
                max_line_bytes=LINE_LIMIT,
                held_payloads_per_conn=1,
                tenants=TENANTS,
                shutdown_grace=0.1,
            )
            server = Server(config, self.runner)
            await server.start(sock=sock)
            return server

        self.server = self.run(start())

    def settle(self) -> None:
        """Let the server act on what was sent, then read every client's replies."""

        async def settle() -> None:
            await asyncio.sleep(0)
            for client in self.clients:
                if not client.gone:
                    await client.read_available()

        self.run(settle())

    def live(self) -> list[Client]:
        return [c for c in self.clients if not c.gone]

    @rule()
    def connect(self) -> None:
        if len(self.clients) < 6:
            self.clients.append(Client(*self.run(asyncio.open_connection(*self.server.address))))

    @precondition(lambda self: self.live())
    @rule(
        data=st.data(),
        n=st.integers(1, JOBS_PER_CONN + 1),
        cancelled=st.lists(st.booleans(), min_size=JOBS_PER_CONN + 1),
        coalesced=st.booleans(),
        key=st.sampled_from(TENANT_KEYS),
        long_line=st.booleans(),
    )
    def send_jobs(
        self,
        data: st.DataObject,
        n: int,
        cancelled: list[bool],
        coalesced: bool,
        key: str,
        long_line: bool,
    ) -> None:
        client = data.draw(st.sampled_from(self.live()))
        frames = []
        for i in range(n):
            self.jobs += 1
            job = f"J_{self.jobs}"
            frames.append(inline(job, key=key) + (cancel(job) if cancelled[i] else b""))
        if long_line:
            frames.append(b"x" * (LINE_LIMIT + 1) + b"\n")
        if coalesced:
            client.write(b"".join(frames))
        else:
            for frame in frames:
                client.write(frame)
        self.settle()

    @precondition(lambda self: self.live())
    @rule(data=st.data(), reset=st.booleans(), after_ping=st.booleans())
    def leave(self, data: st.DataObject, reset: bool, after_ping: bool) -> None:
        client = data.draw(st.sampled_from(self.live()))
        if after_ping:
            self.jobs += 1
            client.write(ping() + inline(f"J_{self.jobs}"))
        sock = client.writer.get_extra_info("socket")
        if reset and sock is not None:
            with contextlib.suppress(OSError):  # (the server may have closed it meanwhile)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.writer.close()
        client.gone = True
        self.settle()

    @rule(ok=st.booleans())
    def end_a_job(self, ok: bool) -> None:
        self.runner.end(ok)
        self.settle()

    @precondition(lambda self: not self.drained)
    @rule()
    def drain(self) -> None:
        self.drained = True

        async def drain() -> None:
            self.server.begin_drain("test")

        self.run(drain())
        self.settle()

    @invariant()
    def slots_held_are_jobs_running(self) -> None:
        if not hasattr(self, "server"):
            return
        inflight, live, _, tenants = accounted(self.server)
        assert inflight == live <= CAP
        assert tenants[0] <= 1  # tenant a's max_inflight

    @invariant()
    def never_two_terminal_frames(self) -> None:
        for client in self.clients:
            assert all(n == 1 for n in client.terminals.values()), client.terminals

    def teardown(self) -> None:
        async def finish() -> None:
            for _ in range(100):  # every job still running: let it finish
                if not self.runner.end(True):
                    break
                await asyncio.sleep(0)
            for client in self.clients:
                client.writer.close()
            await all_given_back(self.server)
            await self.server.close()

        try:
            if hasattr(self, "server"):
                self.run(finish())
        finally:
            self.loop.close()


SETTINGS = settings(max_examples=15, stateful_step_count=12, deadline=None)


class OnAsyncio(Interleavings):
    make_loop = asyncio.new_event_loop


class OnUvloop(Interleavings):
    make_loop = uvloop.new_event_loop


@pytest.mark.slow
@pytest.mark.parametrize("machine", [OnAsyncio, OnUvloop], ids=["asyncio", "uvloop"])
def test_random_interleavings_never_leak(machine: type[Interleavings]) -> None:
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()


async def test_a_slot_held_with_no_live_job_fails_liveness(make_server: ServerFactory) -> None:
    server = await make_server(job_timeout=0.5)
    leaked = server.ledger.admit()  # a slot taken behind admission's back: a leak, on purpose
    assert server.health.liveness().ok  # not at once: a job may be a beat from its start
    await wait_until(lambda: not server.health.liveness().ok)
    verdict = server.health.liveness()
    assert verdict.failing() == ["slots"]
    assert "1 slot(s) held with no live job" in verdict.checks["slots"].detail
    assert not isinstance(leaked, Refusal)
    leaked.release()
    await wait_until(lambda: server.health.liveness().ok)
