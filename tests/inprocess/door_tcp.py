"""The TCP door: clients that speak the newline-JSON frame protocol by hand.

Inline jobs and one-chunk uploads of two tenants, each maybe with its cancel in the same write,
in one write or one by one; cancels later, of a job running, held or over; retries of held
payloads as told; one job more than a connection may have open; over-long lines (fatal);
clients that close or reset, maybe right after a ping and a job in one write. Every frame that
asks for an answer gets one, never two: a job's payload frame its yield, refusal or terminal
frame (for a running job, later), a manifest and a cancel theirs, a ping its pong; a connection
the server closes says why (its own fatal frame, or a running job's abort that answers for it).
After a drain no payload is admitted. Some jobs ask to wait for their turn (``max_wait_ms``):
such a job owes no answer while it waits in the server's line, and gets one answer in the end
(its terminal frame once it runs, or a yield once its turn passes its budget). Each tenant's
``waiting`` is its payloads held for a retry, as the clients were told, and its jobs in line.
Three jobs in four say that their client goes where a fleet's store sends them (``fleet_wide``):
on a fleet, their yields wait for the store's word; the others' go at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import orjson
from hypothesis import strategies as st

from governor.listeners.jobs import Phase
from protocol.upload import split_payload
from tests.conftest import receipt

from .interleavings import KEYS, GateRunner, move, pick, tenants

if TYPE_CHECKING:
    from .interleavings import Interleavings

LINE_LIMIT = 2048
CAP, JOBS_PER_CONN = 3, 3
TENANTS = tenants(CAP)
PAYLOAD_BYTES = 16
BUFFER_BYTES = 6 * PAYLOAD_BYTES  # small enough that payloads are refused for want of buffer
TERMINAL = frozenset({"done", "abort"})
# A fatal frame for the connection names the last frame's job; unless it is that job's own
# abort ("the connection is closing: ..."), it is the connection's answer, not the job's.
CONNECTION_CODES = frozenset({"line_too_large", "too_many_jobs", "too_many_connections"})
CLOSING = "the connection is closing"
LONG_LINE = b"x" * (LINE_LIMIT + 1) + b"\n"

Kind = Literal["inline", "upload"]
WAIT_MS = 300  # what a job that asks to wait for its turn asks for
JOBS = st.tuples(
    st.sampled_from(["inline", "upload"]),
    st.sampled_from(sorted(KEYS)),  # tenant
    st.booleans(),  # with its cancel in the same write
    st.booleans(),  # it asks to wait for its turn
)


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


class TcpDoor:
    """The frame protocol's door (see the module's docstring)."""

    MAX_CLIENTS: ClassVar[int] = 4
    LEAVINGS: ClassVar[tuple[str, ...]] = ("close", "reset")
    LAST_JOBS_S: ClassVar[float] = WAIT_MS / 1000
    DRAIN_AFTER: ClassVar[int] = 0  # (connections stay open after it: what runs is still seen)
    CANCELS: ClassVar[bool] = True

    def __init__(self, machine: Interleavings) -> None:
        self.m = machine
        self.clients: list[Client] = []
        self.owner: dict[str, Client] = {}  # each job's client
        self.tenant: dict[str, str] = {}  # each job's tenant
        self.jobs = 0

    def settings(self) -> dict[str, Any]:
        return {
            "max_inflight": CAP,
            "max_jobs_per_conn": JOBS_PER_CONN,
            "max_line_bytes": LINE_LIMIT,
            "held_payloads_per_conn": 1,
            "max_buffer_bytes": BUFFER_BYTES,
            "tenants": TENANTS,
        }

    def make_runner(self) -> GateRunner:
        return GateRunner()

    def started(self) -> None:
        pass

    def connect_a_client(self) -> None:
        name = f"c{len(self.clients) + 1}"

        async def connect() -> Client:
            reader, writer = await asyncio.open_connection(*self.m.the_server.address)
            return Client(name, reader, writer, self.m.log)

        self.clients.append(self.m.run(connect()))
        self.m.log(f"{name} connects")
        self.m.settle()

    # What the server owes, and waiting for it --------------------------------------------

    def owes(self, asked: Asked) -> bool:
        """The server still owes ``asked`` its answer (on a connection both sides keep open)."""
        if asked.answers or not asked.sent or asked.what == "ping":
            return False
        if asked.what == "payload":  # unless it runs or waits: its answer is owed later
            return asked.job not in self.m.runner.running() and asked.job not in self.waiting()
        if asked.what == "cancel":  # a running job's terminal frame answers its cancel
            target = asked.target
            return target is not None and bool(target.answers) and not target.admitted
        return True

    def quiet(self) -> bool:
        for client in self.clients:
            if client.left or client.eof:
                continue
            if client.fatal or client.expect_close:  # the close follows the fatal frame
                return False
            if any(self.owes(a) for a in client.every_asked()):
                return False
        both_open = sum(1 for c in self.clients if not c.left and not c.eof)
        return len(self.m.the_server.connections) == both_open

    def after_settle(self) -> None:
        pass

    def pending(self) -> list[Any]:
        return sorted(self.waiting())  # (jobs in line: admitted or refused later)

    def waiting(self) -> set[str]:
        """The jobs waiting in the server's line for their turn."""
        return {
            job
            for conn in self.m.the_server.connections
            for job, state in conn.session.jobs.items()  # type: ignore[attr-defined]
            if state.phase is Phase.WAITING
        }

    # Sending -----------------------------------------------------------------------------

    def job_frames(
        self, client: Client, kind: str, tenant: str, with_cancel: bool, waits: bool = False
    ) -> list[dict[str, Any]]:
        self.jobs += 1
        job = f"J_{self.jobs}"
        self.owner[job] = client
        self.tenant[job] = tenant
        data = job.ljust(PAYLOAD_BYTES, ".")
        seq = client.next_seq()
        drained = self.m.drained
        frames: list[dict[str, Any]]
        if kind == "inline":
            frames = [inline_frame(job, seq, data, KEYS[tenant])]
            client.expect(job, seq, "payload", (seq + 1,), drained)
        else:
            frames = list(upload_frames(job, seq, data, KEYS[tenant]))
            client.expect(job, seq, "manifest", (seq + 1,), drained)
            # A final chunk's answer: seq + 2 if it completes the payload, else seq + 1.
            client.expect(job, seq + 1, "payload", (seq + 2, seq + 3), drained)
        if waits:  # (on its first frame: the job's)
            frames[0]["max_wait_ms"] = WAIT_MS
        if self.jobs % 4:  # (three jobs in four go where a fleet's store sends them)
            frames[0]["fleet_wide"] = True
        client.finals[job] = frames[-1]
        if with_cancel:
            frames.append(self.cancel_frame(client, job))
        return frames

    def cancel_frame(self, client: Client, job: str) -> dict[str, Any]:
        seq = client.next_seq()
        client.expect(job, seq, "cancel", (seq + 1,), self.m.drained)
        return {"v": 0, "verb": "cancel", "job": job, "seq": seq, "ttl_ms": 0}

    def write(self, client: Client, frames: list[dict[str, Any] | bytes], coalesced: bool) -> None:
        """All the frames in one write, or each on its own once the last one is answered."""
        lines = [f if isinstance(f, bytes) else encode(f) for f in frames]
        for frame in frames:
            shown = describe(frame) if isinstance(frame, dict) else f"<{len(frame)} bytes>"
            self.m.log(f"{client.name} > {shown}" + ("  (one write)" if coalesced else ""))
        if coalesced:
            client.write(b"".join(lines), frames)
            self.m.settle()
            return
        for frame, line in zip(frames, lines, strict=True):
            if not client.open:  # the server closed it: what is left is never sent
                self.m.log(f"{client.name}   (closed: the rest is not sent)")
                return
            client.write(line, [frame])
            self.m.settle()

    def submit(self, client: Client, data: st.DataObject) -> None:
        """Inline jobs or uploads, each maybe with its cancel, in one write or one by one."""
        jobs = data.draw(st.lists(JOBS, min_size=1, max_size=JOBS_PER_CONN), label="jobs")
        coalesced = data.draw(st.booleans(), label="coalesced")
        frames = [f for spec in jobs for f in self.job_frames(client, *spec)]
        self.write(client, list(frames), coalesced)

    def cancellable(self) -> list[tuple[Any, str]]:
        sent = [(c, job) for c in self.m.live() for job in sorted(c.last)]
        running = set(self.m.runner.running())
        return [(c, job) for c, job in sent if job in running] or sent

    def cancel(self, client: Client, job: str, data: st.DataObject) -> None:
        """A cancel frame for a job sent before: running, held, or over."""
        self.write(client, [self.cancel_frame(client, job)], coalesced=True)

    def leavers(self) -> list[Any]:
        return self.m.live()

    def disconnect(self, client: Client, how: str, last_words: bool) -> None:
        """Close (or reset) a connection, maybe right after a ping and a job in one write."""
        if last_words:
            seq = client.next_seq()
            client.expect("J_p", seq, "ping", (seq + 1,), self.m.drained)
            frames: list[dict[str, Any] | bytes] = [orjson.loads(ping(seq))]
            frames += self.job_frames(client, "inline", "b", False)
            self.m.log(f"{client.name} > a ping and a job (one write), then at once:")
            client.write(b"".join(encode(f) for f in frames if isinstance(f, dict)), frames)
        sock = client.writer.get_extra_info("socket")
        if how == "reset" and sock is not None:
            with contextlib.suppress(OSError):  # (the server may have closed it meanwhile)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.m.log(f"{client.name} {'resets' if how == 'reset' else 'closes'}")
        client.writer.close()
        client.left = True

    def job_ending(self, job: str, ok: bool) -> None:
        self.m.log(f"runner {'finishes' if ok else 'fails'} {job}")

    def crowd(self, data: st.DataObject) -> None:
        """Tenant b's jobs from two clients at once, one more than the slots (b's own cap is
        above the server's): only the server's cap holds them back."""
        kind = data.draw(st.sampled_from(["inline", "upload"]), label="kind")
        while len(self.m.live()) < 2:
            self.connect_a_client()
        each = -(-(CAP + 1) // 2)  # (at least one more than the slots, from the two)
        writes = [
            (client, [f for _ in range(each) for f in self.job_frames(client, kind, "b", False)])
            for client in self.m.live()[:2]
        ]
        for client, frames in writes:
            for frame in frames:
                self.m.log(f"{client.name} > {describe(frame)}  (all at once)")
            client.write(b"".join(encode(f) for f in frames), list(frames))
        self.m.settle()

    # The door's own moves ----------------------------------------------------------------

    @move(data=st.data(), kind=st.sampled_from(["inline", "upload"]), with_cancel=st.booleans())
    def send_too_many_jobs(self, data: st.DataObject, kind: Kind, with_cancel: bool) -> None:
        """One more job than a connection may have open, in one write."""
        client = self.m.a_client(data)
        frames = [
            f
            for i in range(JOBS_PER_CONN + 1)
            for f in self.job_frames(client, kind, sorted(KEYS)[i % 2], with_cancel)
        ]
        self.write(client, list(frames), coalesced=True)

    @move(data=st.data(), job=st.none() | JOBS, coalesced=st.booleans())
    def send_an_over_long_line(
        self, data: st.DataObject, job: tuple[Kind, str, bool, bool] | None, coalesced: bool
    ) -> None:
        """A line over max_line_bytes (fatal), maybe after a job's frames."""
        client = self.m.a_client(data)
        frames: list[dict[str, Any] | bytes] = []
        if job is not None:
            frames += self.job_frames(client, *job)
        frames.append(LONG_LINE)
        self.write(client, frames, coalesced)

    def held(self) -> list[tuple[Client, str]]:
        return [
            (client, job)
            for client in self.m.live()
            for job, asked in sorted(client.last.items())
            if asked.answers
            and asked.answers[-1]["status"] == "yield"
            and receipt(asked.answers[-1], "conn.payload_held") == 1
        ]

    @move(data=st.data())
    def retry_a_held_job(self, data: st.DataObject) -> None:
        """Resend a yielded job's final frame (inline, or the final chunk), as told to."""
        target = pick(data, self.held(), "held")
        if target is None:
            self.m.log("(no held job to retry)")
            return
        client, job = target
        seq = client.next_seq()
        frame = client.finals[job] | {"seq": seq}
        answers = (seq + 1,) if "payload_inline" in frame else (seq + 1, seq + 2)
        client.expect(job, seq, "payload", answers, self.m.drained)
        self.write(client, [frame], coalesced=True)

    # What the server holds ---------------------------------------------------------------

    def orphans(self) -> set[str]:
        return {job for job in self.m.runner.running() if not self.owner[job].open}

    def buffers_settle(self) -> bool:
        return True  # (the door cannot tell uploads in progress and held payloads apart)

    def held_for_retry(self) -> collections.Counter[str]:
        """Each tenant's payloads held for a retry, as their clients were told: a job whose
        last payload frame was answered ``yield`` with ``conn.payload_held`` 1, not cancelled
        since, on a connection still open."""
        held: collections.Counter[str] = collections.Counter()
        for client in self.m.live():
            cancelled = {
                id(a.target) for a in client.every_asked() if a.what == "cancel" and a.sent
            }
            for job, asked in client.last.items():
                if (
                    asked.answers
                    and asked.answers[-1]["status"] == "yield"
                    and receipt(asked.answers[-1], "conn.payload_held") == 1
                    and id(asked) not in cancelled
                ):
                    held[self.tenant[job]] += 1
        return held

    def check_accounts(self) -> None:
        """Each tenant's ``waiting`` is its payloads held for a retry (the TCP door's places
        kept: see the HTTP door's) and its jobs in line; the line holds those jobs."""
        held = self.held_for_retry()
        waiting = self.waiting()
        in_line = collections.Counter(self.tenant[job] for job in waiting)
        for tenant in self.m.the_server.tenants.all():
            assert tenant.waiting == held[tenant.name] + in_line[tenant.name], (
                f"tenant {tenant.name}: waiting {tenant.waiting}, {held[tenant.name]} payload(s) "
                f"held for a retry, {in_line[tenant.name]} in line"
            )
        line = self.m.the_server.state.line
        assert len(line) == len(waiting), f"{len(line)} in line, {sorted(waiting)} waiting"

    # The answers -------------------------------------------------------------------------

    def problems(self, client: Client) -> list[str]:
        return [f"frames that answer nothing sent: {client.strays}"] if client.strays else []

    def asks(self, client: Client) -> list[Asked]:
        return client.every_asked()

    def owed(self, client: Client) -> list[Asked]:
        return [a for a in client.every_asked() if self.owes(a)]

    def check_answer(self, client: Client, asked: Asked) -> None:
        if asked.after_drain and asked.what == "payload":
            # Never admitted: refused as draining, or before admission for want of buffer
            # space (a manifest_invalid, then its chunk's manifest_missing).
            for answer in asked.answers:
                assert (answer["status"], answer["need_code"]) in (
                    ("yield", "draining"),
                    ("need", "manifest_invalid"),
                    ("need", "manifest_missing"),
                ), f"{client}: after the drain, {asked}"
                if answer["need_code"] == "draining":  # (never admitted here: not kept)
                    assert receipt(answer, "conn.payload_held") == 0, f"{client}: {asked}"

    def check_connection(self, client: Client) -> None:
        # A job running when the connection fails gets its own abort, which answers for the
        # connection too: one terminal frame, not that and the connection's.
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

    def check_final(self) -> None:
        pass

    async def forget(self) -> None:
        pass
