"""The count holds whatever the clients do: slots held equal the jobs with a live execution.

Real servers over real loopback sockets, on both event loops: first the interleavings that
leaked every slot while a job's slot was freed by a ``finally`` in its task (which never runs
for a task cancelled before its first step): a job and its cancel in one write, a job and an
over-long line, one job too many, a reset. Then a hypothesis state machine that drives random
interleavings of them (inline jobs and uploads, cancels with the job or later, retries of held
payloads, over-long lines, a drain, jobs that finish or fail when the test says so), checking
after every step that the slots, the tenants' counts and the buffers add up, and that every
frame that asks for an answer gets one, never two.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import struct
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

import orjson
import pytest
import uvloop
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from governor.config import Config
from governor.core.ledger import Refusal
from governor.core.tenants import TenantConfig
from governor.runners import Finished, Job, RunEvent, RunnerError, RunnerHealth
from governor.server import Server
from loadtest.redisserver import RedisServer
from protocol.spec import JobSpec
from protocol.upload import split_payload

from .conftest import RawConn, ServerFactory, receipt, wait_until

T = TypeVar("T")
LINE_LIMIT = 2048


def encode(frame: dict[str, Any]) -> bytes:
    return orjson.dumps(frame) + b"\n"


def share(job: str, seq: int, key: str | None = None, **payload: Any) -> dict[str, Any]:
    frame: dict[str, Any] = {"v": 0, "verb": "share", "job": job, "seq": seq, "ttl_ms": 0}
    if key is not None:
        frame["api_key"] = key
    return frame | payload


def inline_frame(job: str, seq: int, data: str, key: str | None = None) -> dict[str, Any]:
    digest = hashlib.sha256(data.encode()).hexdigest()
    return share(job, seq, key, payload_inline={"sha256": digest, "data": data})


def upload_frames(
    job: str, seq: int, data: str, key: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A one-chunk upload: its manifest (``seq``) and its final chunk (``seq + 1``)."""
    prepared = split_payload(data.encode(), payload_id=f"P{job}")
    (chunk,) = prepared.chunks
    return share(job, seq, key, payload_manifest=prepared.manifest), share(
        job, seq + 1, payload_chunk=chunk
    )


def inline(job: str, seq: int = 1, data: str = "hello", key: str | None = None) -> bytes:
    return encode(inline_frame(job, seq, data, key))


def job_bytes(kind: str, job: str) -> bytes:
    """A job's frames, inline (answered at seq 2) or uploaded (at seq 2, then 4)."""
    if kind == "inline":
        return inline(job)
    return b"".join(encode(f) for f in upload_frames(job, 1, "hello"))


def cancel(job: str, seq: int = 2) -> bytes:
    return encode({"v": 0, "verb": "cancel", "job": job, "seq": seq, "ttl_ms": 0})


def ping(seq: int = 1) -> bytes:
    return encode({"v": 0, "verb": "ping", "job": "J_p", "seq": seq, "ttl_ms": 0})


def accounted(server: Server) -> tuple[int, int, int, list[int]]:
    """(slots held, live executions, buffered payload bytes, each tenant's inflight)."""
    return (
        server.inflight,
        server.live_jobs,
        server.buffered_bytes,
        [t.inflight for t in server.tenants.all()],
    )


def given_back(server: Server) -> bool:
    """Nothing held: no slot, no execution, no payload byte, no tenant count or place in line."""
    return accounted(server)[:3] == (0, 0, 0) and all(
        t.inflight == 0 and t.waiting == 0 and not t.running for t in server.tenants.all()
    )


async def all_given_back(server: Server) -> None:
    await wait_until(lambda: given_back(server))


# The paths that leaked -------------------------------------------------------------------


Raw = Callable[[Server], Awaitable[RawConn]]


async def read_to_eof(conn: RawConn) -> list[dict[str, Any]]:
    return [
        orjson.loads(line) for line in (await asyncio.wait_for(conn.reader.read(), 5)).splitlines()
    ]


@pytest.mark.parametrize("kind", ["inline", "upload"])
async def test_a_job_and_its_cancel_in_one_write(
    make_server: ServerFactory, raw: Raw, kind: str
) -> None:
    server = await make_server(stub_ms=300, max_inflight=4)
    conn = await raw(server)
    conn.send_raw(b"".join(job_bytes(kind, f"J_{i}") + cancel(f"J_{i}", seq=5) for i in range(4)))
    frames = [await conn.recv() for _ in range(4 if kind == "inline" else 8)]
    assert [(f["job"], f["status"], f["need_code"]) for f in frames if f["verb"] == "confirm"] == [
        (f"J_{i}", "abort", "cancelled") for i in range(4)
    ]
    await all_given_back(server)
    conn.send_raw(inline("J_after"))  # the slots are there for the next job (and no second abort)
    assert (await conn.recv())["status"] == "done"


async def test_a_job_and_an_over_long_line_in_one_write(
    make_server: ServerFactory, raw: Raw
) -> None:
    server = await make_server(stub_ms=2000, max_inflight=2, max_line_bytes=LINE_LIMIT)
    conn = await raw(server)
    conn.send_raw(inline("J_1") + b"x" * (LINE_LIMIT + 10) + b"\n")
    (frame,) = await read_to_eof(conn)
    # The job's own abort is the connection's answer too: one terminal frame, not two.
    assert (frame["job"], frame["status"], frame["need_code"]) == ("J_1", "abort", "line_too_large")
    assert frame["detail"].startswith("the connection is closing")
    await all_given_back(server)


async def test_a_job_its_cancel_and_an_over_long_line_in_one_write(
    make_server: ServerFactory, raw: Raw
) -> None:
    server = await make_server(stub_ms=2000, max_inflight=2, max_line_bytes=LINE_LIMIT)
    conn = await raw(server)
    conn.send_raw(inline("J_1") + cancel("J_1", seq=5) + b"x" * (LINE_LIMIT + 10) + b"\n")
    frames = await read_to_eof(conn)
    # The job's terminal frame went out with its cancel, before the line: the connection's
    # own answer is still owed (it names the last frame's job and seq + 1, as for any job).
    assert [(f["job"], f["seq"], f["status"], f["need_code"]) for f in frames] == [
        ("J_1", 2, "abort", "cancelled"),
        ("J_1", 6, "abort", "line_too_large"),
    ]
    await all_given_back(server)


async def test_one_job_too_many_in_one_write(make_server: ServerFactory, raw: Raw) -> None:
    server = await make_server(stub_ms=2000, max_inflight=4, max_jobs_per_conn=4)
    conn = await raw(server)
    conn.send_raw(b"".join(inline(f"J_{i}") for i in range(5)))
    frames = await read_to_eof(conn)
    assert sorted(f["job"] for f in frames) == [f"J_{i}" for i in range(5)]
    assert {f["need_code"] for f in frames} == {"too_many_jobs"}
    await all_given_back(server)


async def test_a_reset_right_after_a_ping_and_a_job(make_server: ServerFactory) -> None:
    server = await make_server(stub_ms=2000, max_inflight=2)
    for _ in range(10):
        sock = socket.create_connection(server.address)
        # Accepted first: a connection reset while still in the listen queue never gets to
        # the server's code.
        await wait_until(lambda: len(server.connections) == 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.sendall(ping() + inline("J_1"))
        sock.close()  # RST: the answer to the ping fails to write, the job is not yet started
        await wait_until(lambda: not server.connections)
    await all_given_back(server)


# Random interleavings --------------------------------------------------------------------


class GateRunner:
    """A :class:`~governor.runners.Runner` whose jobs run until the test ends them, each as it
    says: finished, or failed with a :class:`RunnerError`."""

    name = "gate"

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Future[bool]] = {}

    @property
    def expected_service_s(self) -> float:
        return 0.05

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    max_new_tokens = 1 << 20

    def prepare(self, job_id: str, spec: JobSpec | None, payload: bytes = b"") -> Job:
        return Job(job_id, payload, spec=spec)

    async def run(self, job: Job) -> AsyncGenerator[RunEvent, None]:
        gate = self.gates[job.id] = asyncio.get_running_loop().create_future()
        try:
            ok = await gate
        finally:
            del self.gates[job.id]
        if not ok:
            raise RunnerError("gate runner: failed on purpose")
        yield Finished({"runner": self.name})

    def running(self) -> list[str]:
        """Jobs in the runner that the test has not ended (job ids are unique in a run)."""
        return sorted(job for job, gate in self.gates.items() if not gate.done())

    def end(self, job: str, ok: bool) -> None:
        self.gates[job].set_result(ok)

    async def probe(self) -> bool:
        return True

    def health(self) -> RunnerHealth:
        return RunnerHealth(supervisor_alive=True, workers_live=0, workers=0)


TENANTS = (
    TenantConfig(name="a", key_sha256=hashlib.sha256(b"k-a").hexdigest(), max_inflight=1),
    TenantConfig(name="b", key_sha256=hashlib.sha256(b"k-b").hexdigest(), max_inflight=2),
)
KEYS = {"a": "k-a", "b": "k-b"}
CAP, JOBS_PER_CONN, MAX_CLIENTS = 3, 3, 4
PAYLOAD_BYTES = 16
BUFFER_BYTES = 6 * PAYLOAD_BYTES  # small enough that payloads are refused for want of buffer
SETTLE_S = 2.0  # the longest wait for the answers owed, or for the slots to add up
FINAL_S = 5.0  # the longest wait for everything to be given back once the clients have gone
TERMINAL = frozenset({"done", "abort"})
# A fatal frame for the connection names the last frame's job; unless it is that job's own
# abort ("the connection is closing: ..."), it is the connection's answer, not the job's.
CONNECTION_CODES = frozenset({"line_too_large", "too_many_jobs", "too_many_connections"})
CLOSING = "the connection is closing"
LONG_LINE = b"x" * (LINE_LIMIT + 1) + b"\n"

Kind = Literal["inline", "upload"]
JOBS = st.tuples(
    st.sampled_from(["inline", "upload"]),
    st.sampled_from(sorted(KEYS)),  # tenant
    st.booleans(),  # with its cancel in the same write
)


def closes(frame: dict[str, Any]) -> bool:
    """A running job's own abort as its connection closes."""
    return str(frame.get("detail") or "").startswith(CLOSING)


def describe(frame: dict[str, Any]) -> str:
    words = [f"{frame.get('job')}#{frame.get('seq')}", str(frame.get("verb"))]
    if frame.get("verb") == "share":
        words += [k for k in ("payload_inline", "payload_manifest", "payload_chunk") if k in frame]
        words += [f"key={frame['api_key']}"] if "api_key" in frame else []
    else:
        words += [str(frame.get("status", "")), str(frame.get("need_code") or "")]
        words += ["(closing)"] if closes(frame) else []
    return " ".join(w for w in words if w)


async def poll(condition: Callable[[], bool], timeout: float) -> bool:
    """Let the loop run until ``condition`` holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.002)
    return True


@dataclass(eq=False)
class Asked:
    """A frame the server owes an answer: a job's payload (inline or its final chunk), a
    manifest, a cancel or a ping; ``answers`` are the frames that answered it."""

    job: str
    seq: int
    what: Literal["payload", "manifest", "cancel", "ping"]
    after_drain: bool
    target: Asked | None = None  # a cancel's: its job's payload frame sent before it
    answers: list[dict[str, Any]] = field(default_factory=list)
    sent: bool = False  # (frames sent one by one are asked for before they are sent)

    @property
    def admitted(self) -> bool:
        """A payload frame answered by its execution's terminal frame: here (known keys, no
        lanes) only an admitted job is answered ``done`` or ``abort``."""
        return any(a["status"] in TERMINAL for a in self.answers)

    def __repr__(self) -> str:
        answers = "; ".join(describe(a) for a in self.answers) or "no answer"
        return f"<{self.what} {self.job}#{self.seq}: {answers}>"


class Client:
    """One connection and what it asked; a task reads and sorts the server's frames."""

    def __init__(
        self,
        name: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        log: Callable[[str], None],
    ) -> None:
        self.name = name
        self.reader, self.writer = reader, writer
        self.log = log
        self.asked: dict[tuple[str, int], Asked] = {}  # by (job, the seq of an answer)
        self.frames: dict[tuple[str, int], Asked] = {}  # by (job, its frame's seq)
        self.last: dict[str, Asked] = {}  # each job's last payload frame
        self.finals: dict[str, dict[str, Any]] = {}  # each job's final frame, to resend
        self.fatal: list[dict[str, Any]] = []  # the connection's own fatal frames
        self.strays: list[dict[str, Any]] = []  # frames that answer nothing sent
        self.received: list[dict[str, Any]] = []
        self.expect_close = False  # it sent what must close it (an over-long line)
        self.left = False  # the client closed it
        self.eof = False  # the server closed it (or reset it)
        self._seq = 1
        self.reading = asyncio.get_running_loop().create_task(self._read())

    def __repr__(self) -> str:  # hypothesis prints the clients it drew
        return self.name

    @property
    def open(self) -> bool:
        return not (self.left or self.eof or self.fatal)

    def next_seq(self) -> int:
        """Each frame's seq four past the last: the answers' seqs (+1, +2, and +3 for an
        upload's chunk) never collide, so each answer finds its frame."""
        seq, self._seq = self._seq, self._seq + 4
        return seq

    def expect(
        self,
        job: str,
        seq: int,
        what: Literal["payload", "manifest", "cancel", "ping"],
        answer_seqs: tuple[int, ...],
        after_drain: bool,
    ) -> Asked:
        asked = Asked(job, seq, what, after_drain, self.last.get(job) if what == "cancel" else None)
        for answer_seq in answer_seqs:
            self.asked[(job, answer_seq)] = asked
        self.frames[(job, seq)] = asked
        if what == "payload":
            self.last[job] = asked
        return asked

    def every_asked(self) -> list[Asked]:
        return list(self.frames.values())

    def write(self, data: bytes, frames: list[dict[str, Any] | bytes]) -> None:
        for frame in frames:
            if frame is LONG_LINE:
                self.expect_close = True
            elif isinstance(frame, dict):
                self.frames[(frame["job"], frame["seq"])].sent = True
        self.writer.write(data)

    async def _read(self) -> None:
        try:
            while (line := await self.reader.readline()).endswith(b"\n"):
                self._receive(orjson.loads(line))
        except OSError:  # reset: what it had sent before is read already
            pass
        finally:
            self.eof = True

    def _receive(self, frame: dict[str, Any]) -> None:
        self.log(f"{self.name} < {describe(frame)}")
        self.received.append(frame)
        if frame.get("need_code") in CONNECTION_CODES and not closes(frame):
            self.fatal.append(frame)
            return
        asked = self.asked.get((frame["job"], frame["seq"]))
        if asked is None:
            self.strays.append(frame)
        else:
            asked.answers.append(frame)


class Interleavings(RuleBasedStateMachine):
    """Drives one real server on a loop of its own; ``make_loop`` picks the loop."""

    make_loop: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    # More settings for the server: a fleet's (a real Redis) in the fleet's variant.
    config: ClassVar[dict[str, Any]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.loop = type(self).make_loop()
        self.runner = GateRunner()
        self.server: Server | None = None
        self.clients: list[Client] = []
        self.transcript: list[str] = []
        self.drained = False
        self.failed = False
        self.jobs = 0

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def log(self, line: str) -> None:
        self.transcript.append(line)

    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        """On a failure: the frames sent and received, in the falsifying example's notes."""
        try:
            yield
        except BaseException:
            self.failed = True
            note("frames (> sent, < received):\n  " + "\n  ".join(self.transcript))
            raise

    @property
    def the_server(self) -> Server:
        assert self.server is not None
        return self.server

    @initialize()
    def start(self) -> None:
        async def start() -> Server:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            config = Config(
                listen="127.0.0.1:0",
                runner="stub",  # (not built: the gate runner is given)
                max_inflight=CAP,
                max_jobs_per_conn=JOBS_PER_CONN,
                max_line_bytes=LINE_LIMIT,
                held_payloads_per_conn=1,
                max_buffer_bytes=BUFFER_BYTES,
                tenants=TENANTS,
                **self.config,
            )
            server = Server(config, self.runner)
            await server.start(sock=sock)
            return server

        self.server = self.run(start())

    # What the server owes, and waiting for it --------------------------------------------

    def owed(self, asked: Asked) -> bool:
        """The server still owes ``asked`` its answer (on a connection both sides keep open)."""
        if asked.answers or not asked.sent or asked.what == "ping":
            return False
        if asked.what == "payload":  # unless it runs: then its terminal frame is owed later
            return asked.job not in self.runner.running()
        if asked.what == "cancel":  # a running job's terminal frame answers its cancel
            target = asked.target
            return target is not None and bool(target.answers) and not target.admitted
        return True

    def quiet(self) -> bool:
        """Every answer owed has come, every close has been seen by both sides."""
        server = self.the_server
        for client in self.clients:
            if client.left or client.eof:
                continue
            if client.fatal or client.expect_close:  # the close follows the fatal frame
                return False
            if any(self.owed(a) for a in client.every_asked()):
                return False
        both_open = sum(1 for c in self.clients if not c.left and not c.eof)
        return len(server.connections) == both_open

    def settle(self) -> None:
        """Wait (bounded) for the server to answer what was sent; the invariants then say
        what is missing, if anything is."""

        async def settle() -> None:
            await poll(self.quiet, SETTLE_S)
            for _ in range(3):  # done-callbacks the last step scheduled
                await asyncio.sleep(0)

        self.run(settle())

    # Sending -----------------------------------------------------------------------------

    def live(self) -> list[Client]:
        return [c for c in self.clients if c.open]

    def job_frames(
        self, client: Client, kind: str, tenant: str, with_cancel: bool
    ) -> list[dict[str, Any]]:
        self.jobs += 1
        job = f"J_{self.jobs}"
        data = job.ljust(PAYLOAD_BYTES, ".")
        seq = client.next_seq()
        frames: list[dict[str, Any]]
        if kind == "inline":
            frames = [inline_frame(job, seq, data, KEYS[tenant])]
            client.expect(job, seq, "payload", (seq + 1,), self.drained)
        else:
            frames = list(upload_frames(job, seq, data, KEYS[tenant]))
            client.expect(job, seq, "manifest", (seq + 1,), self.drained)
            # A final chunk's answer: seq + 2 if it completes the payload, else seq + 1.
            client.expect(job, seq + 1, "payload", (seq + 2, seq + 3), self.drained)
        client.finals[job] = frames[-1]
        if with_cancel:
            frames.append(self.cancel_frame(client, job))
        return frames

    def cancel_frame(self, client: Client, job: str) -> dict[str, Any]:
        seq = client.next_seq()
        client.expect(job, seq, "cancel", (seq + 1,), self.drained)
        return {"v": 0, "verb": "cancel", "job": job, "seq": seq, "ttl_ms": 0}

    def write(self, client: Client, frames: list[dict[str, Any] | bytes], coalesced: bool) -> None:
        """All the frames in one write, or each on its own once the last one is answered."""
        lines = [f if isinstance(f, bytes) else encode(f) for f in frames]
        for frame in frames:
            shown = describe(frame) if isinstance(frame, dict) else f"<{len(frame)} bytes>"
            self.log(f"{client.name} > {shown}" + ("  (one write)" if coalesced else ""))
        if coalesced:
            client.write(b"".join(lines), frames)
            self.settle()
            return
        for frame, line in zip(frames, lines, strict=True):
            if not client.open:  # the server closed it: what is left is never sent
                self.log(f"{client.name}   (closed: the rest is not sent)")
                return
            client.write(line, [frame])
            self.settle()

    # Rules -------------------------------------------------------------------------------

    @precondition(lambda self: len(self.live()) < MAX_CLIENTS)
    @rule()
    def connect(self) -> None:
        name = f"c{len(self.clients) + 1}"

        async def connect() -> Client:
            reader, writer = await asyncio.open_connection(*self.the_server.address)
            return Client(name, reader, writer, self.log)

        self.clients.append(self.run(connect()))
        self.log(f"{name} connects")
        self.settle()

    @precondition(lambda self: self.live())
    @rule(
        data=st.data(),
        jobs=st.lists(JOBS, min_size=1, max_size=JOBS_PER_CONN),
        coalesced=st.booleans(),
    )
    def send_jobs(
        self, data: st.DataObject, jobs: list[tuple[Kind, str, bool]], coalesced: bool
    ) -> None:
        """Inline jobs or uploads, each maybe with its cancel, in one write or one by one."""
        client = data.draw(st.sampled_from(self.live()), label="client")
        frames = [f for spec in jobs for f in self.job_frames(client, *spec)]
        self.write(client, list(frames), coalesced)

    @precondition(lambda self: self.live())
    @rule(data=st.data(), kind=st.sampled_from(["inline", "upload"]), with_cancel=st.booleans())
    def send_too_many_jobs(self, data: st.DataObject, kind: Kind, with_cancel: bool) -> None:
        """One more job than a connection may have open, in one write."""
        client = data.draw(st.sampled_from(self.live()), label="client")
        frames = [
            f
            for i in range(JOBS_PER_CONN + 1)
            for f in self.job_frames(client, kind, sorted(KEYS)[i % 2], with_cancel)
        ]
        self.write(client, list(frames), coalesced=True)

    @precondition(lambda self: self.live())
    @rule(data=st.data(), job=st.none() | JOBS, coalesced=st.booleans())
    def send_an_over_long_line(
        self, data: st.DataObject, job: tuple[Kind, str, bool] | None, coalesced: bool
    ) -> None:
        """A line over max_line_bytes (fatal), maybe after a job's frames."""
        client = data.draw(st.sampled_from(self.live()), label="client")
        frames: list[dict[str, Any] | bytes] = []
        if job is not None:
            frames += self.job_frames(client, *job)
        frames.append(LONG_LINE)
        self.write(client, frames, coalesced)

    @precondition(lambda self: any(c.last for c in self.live()))
    @rule(data=st.data())
    def cancel_a_job(self, data: st.DataObject) -> None:
        """A cancel for a job sent before: running, held, or over."""
        client = data.draw(st.sampled_from([c for c in self.live() if c.last]), label="client")
        running = [j for j in sorted(client.last) if j in self.runner.running()]
        job = data.draw(st.sampled_from(running or sorted(client.last)), label="job")
        self.write(client, [self.cancel_frame(client, job)], coalesced=True)

    def held(self) -> list[tuple[Client, str]]:
        return [
            (client, job)
            for client in self.live()
            for job, asked in sorted(client.last.items())
            if asked.answers
            and asked.answers[-1]["status"] == "yield"
            and receipt(asked.answers[-1], "conn.payload_held") == 1
        ]

    @precondition(lambda self: self.held())
    @rule(data=st.data())
    def retry_a_held_job(self, data: st.DataObject) -> None:
        """Resend a yielded job's final frame (inline, or the final chunk), as told to."""
        client, job = data.draw(st.sampled_from(self.held()), label="held")
        seq = client.next_seq()
        frame = client.finals[job] | {"seq": seq}
        answers = (seq + 1,) if "payload_inline" in frame else (seq + 1, seq + 2)
        client.expect(job, seq, "payload", answers, self.drained)
        self.write(client, [frame], coalesced=True)

    @precondition(lambda self: self.live())
    @rule(data=st.data(), reset=st.booleans(), after_ping=st.booleans())
    def leave(self, data: st.DataObject, reset: bool, after_ping: bool) -> None:
        """Close (or reset) a connection, maybe right after a ping and a job in one write."""
        client = data.draw(st.sampled_from(self.live()), label="client")
        if after_ping:
            seq = client.next_seq()
            client.expect("J_p", seq, "ping", (seq + 1,), self.drained)
            frames: list[dict[str, Any] | bytes] = [orjson.loads(ping(seq))]
            frames += self.job_frames(client, "inline", "b", False)
            self.log(f"{client.name} > a ping and a job (one write), then at once:")
            client.write(b"".join(encode(f) for f in frames if isinstance(f, dict)), frames)
        sock = client.writer.get_extra_info("socket")
        if reset and sock is not None:
            with contextlib.suppress(OSError):  # (the server may have closed it meanwhile)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.log(f"{client.name} {'resets' if reset else 'closes'}")
        client.writer.close()
        client.left = True
        self.settle()

    @precondition(lambda self: self.runner.running())
    @rule(data=st.data(), ok=st.booleans())
    def end_a_job(self, data: st.DataObject, ok: bool) -> None:
        """The runner finishes a running job, or fails it."""
        job = data.draw(st.sampled_from(self.runner.running()), label="job")
        self.log(f"runner {'finishes' if ok else 'fails'} {job}")
        self.runner.end(job, ok)
        self.settle()

    @precondition(lambda self: not self.drained)
    @rule()
    def drain(self) -> None:
        """From now on, new jobs are refused with ``yield draining``; running ones go on."""
        self.drained = True
        self.log("server begins a drain")

        async def drain() -> None:
            self.the_server.begin_drain("test")

        self.run(drain())
        self.settle()

    # Invariants --------------------------------------------------------------------------

    @invariant()
    def slots_held_are_live_jobs(self) -> None:
        if self.server is None:
            return
        server = self.server
        with self.reporting():
            # A task that has just ended gives its slot back in its done-callback, a loop
            # iteration later; a leaked slot is never given back.
            self.run(poll(lambda: server.inflight == server.live_jobs, SETTLE_S))
            inflight, live, buffered, tenants = accounted(server)
            assert inflight == live, f"{inflight} slot(s) held, {live} live execution(s)"
            assert inflight <= CAP
            assert sum(tenants) == inflight, f"tenants' counts {tenants}, {inflight} slot(s)"
            for tenant in server.tenants.all():
                assert tenant.inflight <= tenant.config.max_inflight, tenant.name
            assert len(self.runner.running()) <= live
            assert buffered <= BUFFER_BYTES
            if server.fleet is not None:  # the runner runs only jobs the fleet leased
                leases = len(server.fleet.gate.leases)
                assert leases <= self.config["fleet_max_inflight"]
                assert len(self.runner.running()) <= leases

    @invariant()
    def one_answer_each(self) -> None:
        with self.reporting():
            self.check_answers()

    def check_answers(self) -> None:
        for client in self.clients:
            assert not client.strays, f"{client}: frames that answer nothing sent"
            for asked in client.every_asked():
                assert len(asked.answers) <= 1, f"{client}: two answers to {asked}"
                if client.open:
                    assert not self.owed(asked), f"{client}: no answer to {asked}"
                if asked.after_drain and asked.what == "payload":
                    # Never admitted: refused as draining, or before admission for want
                    # of buffer space (a manifest_invalid, then its chunk's
                    # manifest_missing).
                    for answer in asked.answers:
                        assert (answer["status"], answer["need_code"]) in (
                            ("yield", "draining"),
                            ("need", "manifest_invalid"),
                            ("need", "manifest_missing"),
                        ), f"{client}: after the drain, {asked}"
            # A job running when the connection fails gets its own abort, which answers for
            # the connection too: one terminal frame, not that and the connection's.
            closing = {f["job"] for f in client.received if closes(f)}
            assert len(client.fatal) <= 1, f"{client}: two fatal frames"
            for fatal in client.fatal:
                assert fatal["job"] not in closing, f"{client}: two aborts for {fatal['job']}"
            if client.expect_close and not client.left:
                assert client.eof, f"{client}: an over-long line, and still open"
            if client.eof and not client.left:  # the server closed it: it must say why
                codes = {f.get("need_code") for f in client.received}
                assert codes & CONNECTION_CODES, f"{client}: closed without a word"
                if client.expect_close:  # for its line, or a job over its limit before it
                    assert codes & {"line_too_large", "too_many_jobs"}, (
                        f"{client}: closed, but not for its line"
                    )

    # The end -----------------------------------------------------------------------------

    def teardown(self) -> None:
        try:
            if self.server is not None and not self.failed:
                with self.reporting():
                    self.run(self.finish())
        finally:
            self.run(self.close())
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    async def finish(self) -> None:
        """Every running job finishes and is answered; then every client leaves, and the
        server must give back every slot, tenant count and buffered byte."""
        server = self.the_server
        for job in self.runner.running():
            self.runner.end(job, True)
        self.log("runner finishes every job")
        await poll(self.quiet, SETTLE_S)
        self.check_answers()
        for client in self.clients:
            if not client.left:
                client.left = True
                client.writer.close()
        self.log("every client closes")
        await poll(lambda: given_back(server) and not server.connections, FINAL_S)
        inflight, live, buffered, _ = accounted(server)
        assert (inflight, live, buffered) == (0, 0, 0), (
            f"with no client left: {inflight} slot(s) held, {live} live execution(s), "
            f"{buffered} payload byte(s) buffered"
        )
        for tenant in server.tenants.all():
            assert (tenant.inflight, tenant.waiting, tenant.running) == (0, 0, []), tenant.name
        assert not server.connections

    async def close(self) -> None:
        for client in self.clients:
            client.writer.close()
            client.reading.cancel()
        await asyncio.gather(*(c.reading for c in self.clients), return_exceptions=True)
        if self.server is not None:
            server = self.server
            await server.close()
            await poll(lambda: not server.connections, FINAL_S)  # their connection_lost ran
        for client in self.clients:  # their transports must close before the loop does
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(client.writer.wait_closed(), 1.0)


class OnAsyncio(Interleavings):
    make_loop = asyncio.new_event_loop


class OnUvloop(Interleavings):
    make_loop = uvloop.new_event_loop


@pytest.mark.slow
@pytest.mark.parametrize("machine", [OnAsyncio, OnUvloop], ids=["asyncio", "uvloop"])
def test_random_interleavings_never_leak(machine: type[Interleavings]) -> None:
    # A plain test on a loop of the machine's own: pytest-asyncio's loop takes no part.
    run_state_machine_as_test(
        machine, settings=settings(max_examples=40, stateful_step_count=20, deadline=None)
    )


@pytest.mark.slow
def test_random_interleavings_never_leak_with_a_fleet(redis_server: RedisServer) -> None:
    """The same, with a fleet cap of 1 under the server's 2: jobs admitted here are refused by
    the fleet and taken back (their payloads held for a retry) amid cancels, resets and the
    drain; nothing may leak, and the runner never runs more than the fleet leased."""

    class OnAFleet(OnUvloop):
        config: ClassVar[dict[str, Any]] = {
            "redis_url": redis_server.url,
            "fleet_max_inflight": 1,
        }

    run_state_machine_as_test(
        OnAFleet, settings=settings(max_examples=30, stateful_step_count=20, deadline=None)
    )


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
