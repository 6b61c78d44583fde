"""The front door's count holds whatever its HTTP clients do: slots held equal the jobs with a
live execution, places kept for retries add up, every request gets one answer, never two.

The HTTP side of ``test_invariants.py``: a hypothesis state machine drives a real server's
OpenAI front door (``http_listen``) over real loopback sockets, on both event loops, with
clients that speak HTTP/1.1 by hand (keep-alive, pipelined requests; answers parsed by ``h11``):
chats and completions, whole or streamed, of two tenants, with bodies drawn from a small set
(identical requests are one another's retries: a refused request's place is kept for them),
bad keys and bad bodies among them; retries of refused requests at once (back early for their
place, they wait at the door), from the same connection or another; clients that close, reset
or half-close at any moment (while their job runs, while they wait at the door, in the middle
of a pipeline); jobs that finish or fail when the test says so; a drain. After every step it
checks that the slots, the tenants' counts, the payload buffers, the places kept and the
clients waiting at the door add up, and that every request a connected client sent is answered
once, in the shape its status says, unless it runs or waits at the door. At the end every job
finishes, every client leaves, and everything must be given back: the slots and buffers at
once, the places kept once their hints (plus ``upload_timeout``, their grace) have passed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import math
import socket
import struct
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import h11
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
from governor.core.policy import LANES
from governor.listeners import openai_api as api
from governor.listeners.http import HttpConnection
from governor.listeners.openai_api import KeptPlaces
from governor.runners import Job, RunEvent, Token
from governor.server import Server
from protocol.spec import JobSpec

from .test_invariants import KEYS, GateRunner, accounted, given_back, poll
from .test_invariants import TENANTS as SHARED_TENANTS

T = TypeVar("T")
CAP = 2
# The invariants' tenants, but b's own cap above the server's: a's requests past its one are
# refused tenant_busy (no place in the ledger's line), b's past the cap server_busy (a promise).
TENANTS = (SHARED_TENANTS[0], dataclasses.replace(SHARED_TENANTS[1], max_inflight=CAP + 1))
MAX_CLIENTS, PIPELINE = 4, 3
DRAIN_AFTER = 8  # steps before the drain may come (one at once leaves little to see)
GRACE_S = 0.3  # upload_timeout: how long past its hint a refused request's place is kept
SETTLE_S = 2.0  # the longest wait for the answers owed, or for the counts to add up
FINAL_S = 5.0  # the longest wait for everything to be given back once the clients have gone
PLACES_S = 3.0  # a place kept is gone this long past the longest hint told (and its grace)
MAX_NEW_TOKENS = 64
TOKEN = "tok "  # the one token each job yields before it waits for the test's word
BUSY = frozenset({"server_busy", "tenant_busy", "tenant_share"})
PATHS = {
    "chat": "/v1/chat/completions",
    "completion": "/v1/completions",
    "models": "/v1/models",
    "missing": "/v1/nowhere",
}

What = Literal["chat", "completion", "models", "missing"]
Fault = Literal["", "bad_key", "no_key", "bad_json", "unsupported", "bad_spec"]
Leaving = Literal["close", "reset", "half-close"]


class TokenGate(GateRunner):
    """The gate runner, for job specs: each job yields a token (a streamed request's head and
    first chunk go out with it), then runs until the test ends it."""

    max_new_tokens = MAX_NEW_TOKENS

    def prepare(self, job_id: str, spec: JobSpec | None, payload: bytes = b"") -> Job:
        return Job(job_id, payload, spec=spec)

    async def run(self, job: Job) -> AsyncGenerator[RunEvent, None]:
        yield Token(TOKEN)
        async for event in super().run(job):
            yield event


@dataclass(frozen=True)
class Spec:
    """A request as drawn: what it asks for, whose key, which body, what is wrong with it."""

    what: What
    tenant: str = "a"
    prompt: str = "hi"
    stream: bool = False
    fault: Fault = ""

    @property
    def job(self) -> bool:
        return self.what in ("chat", "completion")

    @property
    def counted_path(self) -> str:
        """The path the server counts its answer under (``http_responses``)."""
        return PATHS[self.what] if self.what != "missing" else "other"

    def body(self) -> bytes:
        if not self.job:
            return b""
        if self.fault == "bad_json":
            return b'{"model": "m", "messages": '
        obj: dict[str, Any] = {"model": "m", "max_tokens": 4, "stream": self.stream}
        if self.what == "chat":
            obj["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            obj["prompt"] = self.prompt
        if self.fault == "unsupported":
            obj["n"] = 2  # (refused by the mapping: 400 before admission)
        if self.fault == "bad_spec":
            obj["max_tokens"] = 10 * MAX_NEW_TOKENS  # (refused by the runner: 400 at admission)
        return orjson.dumps(obj)

    def encode(self, n: int) -> bytes:
        """The request on the wire; ``x-test-request`` names it (the server keeps the head of
        the request it is answering: the test finds which one runs or waits)."""
        method = "POST" if self.job else "GET"
        lines = [f"{method} {PATHS[self.what]} HTTP/1.1", "host: governor", f"x-test-request: {n}"]
        if self.job and self.fault != "no_key":
            key = "k-x" if self.fault == "bad_key" else KEYS[self.tenant]
            lines.append(f"authorization: Bearer {key}")
        body = self.body()
        if self.job:
            lines += ["content-type: application/json", f"content-length: {len(body)}"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

    def __str__(self) -> str:
        if not self.job:
            return f"GET {self.what}"
        words = [self.what, self.tenant, self.prompt, "stream" if self.stream else "", self.fault]
        return " ".join(w for w in words if w)


SPECS = st.builds(
    Spec,
    what=st.sampled_from(["chat", "chat", "chat", "completion", "completion", "models", "missing"]),
    tenant=st.sampled_from(sorted(KEYS)),
    prompt=st.sampled_from(["hi", "yo"]),
    stream=st.booleans(),
    fault=st.sampled_from(
        ["", "", "", "", "", "", "bad_key", "no_key", "bad_json", "unsupported", "bad_spec"]
    ),
).map(lambda s: s if s.job else Spec(s.what))
# Most requests are sent and left to be answered; some clients leave at once, in the same step.
THEN = st.sampled_from([None, None, None, None, None, "close", "reset"])


@dataclass
class Head:
    status: int
    headers: dict[str, str]
    drained: bool  # the server was draining when it came (the test had begun the drain)
    broken: bool  # a job had failed by then (the breaker may be open)


@dataclass(eq=False)
class Sent:
    """A request sent, and the answer it got (FIFO on its connection)."""

    n: int
    spec: Spec
    after_drain: bool  # sent once the drain had begun
    head: Head | None = None
    body: bytearray = field(default_factory=bytearray)
    complete: bool = False
    outcome: bool | None = None  # its job ended as the test said: finished (True) or failed

    @property
    def closes(self) -> bool:
        return self.head is not None and self.head.headers.get("connection") == "close"

    def __repr__(self) -> str:
        if self.head is None:
            answer = "no answer"
        else:
            answer = str(self.head.status) + ("" if self.complete else " (in part)")
        return f"<#{self.n} {self.spec}: {answer}>"


def describe(sent: Sent) -> str:
    """An answer, for the transcript."""
    assert sent.head is not None
    words = [f"#{sent.n}", str(sent.head.status)]
    headers = sent.head.headers
    if sent.complete and sent.head.status != 200:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            words.append(str(orjson.loads(bytes(sent.body))["error"]["code"]))
    if "retry-after-ms" in headers:
        words.append(f"retry-after-ms={headers['retry-after-ms']}")
    if sent.head.status == 200 and sent.spec.stream:
        words.append("stream" + ("" if sent.complete else " head"))
    if headers.get("connection") == "close":
        words.append("(close)")
    return " ".join(words)


class Client:
    """One connection, from a loopback address of its own (a source whose keys fail waits
    ``auth_backoff`` alone), and what it sent; a task parses the answers with ``h11``."""

    def __init__(
        self,
        name: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        log: Callable[[str], None],
        moment: Callable[[], tuple[bool, bool]],
    ) -> None:
        self.name = name
        self.reader, self.writer = reader, writer
        self.local: tuple[str, int] = writer.get_extra_info("sockname")[:2]
        self.log = log
        self.moment = moment  # (drained, broken) now
        self.queue: list[Sent] = []
        self.by_n: dict[int, Sent] = {}
        self.problems: list[str] = []  # answers to nothing sent, bytes h11 cannot parse
        self.truncated = False  # the connection ended in the middle of an answer
        self.left = False  # the client closed it (or reset it, or half-closed it)
        self.eof = False  # it is closed (by the server, or after the client left)
        self.reading = asyncio.get_running_loop().create_task(self._read())

    def __repr__(self) -> str:  # hypothesis prints the clients it drew
        return self.name

    @property
    def open(self) -> bool:
        return not (self.left or self.eof)

    def sending(self, sent: Sent) -> None:
        self.queue.append(sent)
        self.by_n[sent.n] = sent

    @staticmethod
    def _parser(data: bytes) -> h11.Connection:
        """A parser for the next answer (h11 parses one answer per request it sent)."""
        parser = h11.Connection(h11.CLIENT)
        parser.send(h11.Request(method="POST", target="/", headers=[("host", "governor")]))
        parser.send(h11.EndOfMessage())
        if data:
            parser.receive_data(data)
        return parser

    async def _read(self) -> None:
        parser = self._parser(b"")
        current: Sent | None = None
        try:
            while data := await self.reader.read(65536):
                parser.receive_data(data)
                while True:
                    ev = parser.next_event()
                    if ev is h11.NEED_DATA or ev is h11.PAUSED:
                        break
                    if isinstance(ev, h11.Response):
                        current = self._head(ev)
                    elif isinstance(ev, h11.Data):
                        if current is not None:
                            current.body += ev.data
                    elif isinstance(ev, h11.EndOfMessage):
                        if current is not None:
                            current.complete = True
                            self.log(f"{self.name} < {describe(current)}")
                        current = None
                        parser = self._parser(parser.trailing_data[0])
                    else:
                        self.problems.append(f"unexpected {ev!r}")
            if current is not None or parser.trailing_data[0]:
                self.truncated = True
        except h11.RemoteProtocolError as exc:
            self.problems.append(f"bytes that are not HTTP: {exc}")
        except OSError:  # reset: what came before it is read already
            self.truncated = current is not None
        finally:
            self.eof = True

    def _head(self, ev: h11.Response) -> Sent | None:
        headers = {k.decode().lower(): v.decode() for k, v in ev.headers}
        sent = next((s for s in self.queue if s.head is None), None)
        if sent is None:
            self.problems.append(f"an answer ({ev.status_code}) to nothing sent")
            return None
        if any(s.closes for s in self.queue):
            self.problems.append(f"an answer ({ev.status_code}) after connection: close")
        sent.head = Head(ev.status_code, headers, *self.moment())
        if sent.spec.stream and ev.status_code == 200:
            self.log(f"{self.name} < {describe(sent)}")
        return sent


class FrontDoorInterleavings(RuleBasedStateMachine):
    """Drives one real server's front door on a loop of its own; ``make_loop`` picks the loop."""

    make_loop: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop

    def __init__(self) -> None:
        super().__init__()
        self.loop = type(self).make_loop()
        self.runner = TokenGate()
        self.server: Server | None = None
        self.clients: list[Client] = []
        self.transcript: list[str] = []
        self.drained = False
        self.broken = False  # a job has failed: the breaker may open
        self.failed = False
        self.requests = 0
        self.steps = 0  # (counted by an invariant: the same whatever the timing)
        self.shown: dict[int, str] = {}  # what the transcript last said of each request

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def log(self, line: str) -> None:
        self.transcript.append(line)

    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        """On a failure: the requests sent and the answers received, in the example's notes."""
        try:
            yield
        except BaseException:
            if self.failed:  # (noted already)
                raise
            self.failed = True
            note("requests and answers (> sent, < received):\n  " + "\n  ".join(self.transcript))
            raise

    @property
    def the_server(self) -> Server:
        assert self.server is not None
        return self.server

    @property
    def places(self) -> KeptPlaces:
        front = self.the_server._front
        assert front is not None
        return front.places

    @initialize()
    def start(self) -> None:
        async def start() -> Server:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            config = Config(
                listen="127.0.0.1:0",
                http_listen="127.0.0.1:0",
                runner="stub",  # (not built: the gate runner is given)
                max_inflight=CAP,
                tenants=TENANTS,
                upload_timeout=GRACE_S,
                max_auth_failures=2,  # a connection's second bad key closes it
                max_connections=2 * MAX_CLIENTS,
                held_payloads_per_conn=1,  # so at most 8 places are kept
                breaker_failures=3,  # three failed jobs open the breaker: 503 for a moment
                breaker_cooldown=0.2,
            )
            server = Server(config, self.runner)
            await server.start(sock=sock)
            return server

        self.server = self.run(start())
        for _ in range(2):
            self.connect_a_client()

    # The server's side of each client ----------------------------------------------------

    def http_connections(self) -> list[HttpConnection]:
        return [c for c in self.the_server.connections if isinstance(c, HttpConnection)]

    def server_side(self, client: Client) -> HttpConnection | None:
        for conn in self.http_connections():
            transport = conn.transport
            if transport is not None and transport.get_extra_info("peername")[:2] == client.local:
                return conn
        return None

    def client_of(self, conn: HttpConnection) -> Client | None:
        transport = conn.transport
        peer = transport.get_extra_info("peername")[:2] if transport is not None else None
        return next((c for c in self.clients if c.local == peer), None)

    def blocked(self, client: Client) -> tuple[int, str] | None:
        """The request the server is answering on ``client``'s connection, if it owes no answer
        yet: it runs (its job has not been ended), or it waits at the door."""
        conn = self.server_side(client)
        if conn is None or conn.exchange is None or conn.request is None:
            return None
        n = int(dict(conn.request.headers)[b"x-test-request"])
        exchange = conn.exchange
        if exchange.door_timer is not None:
            return n, "at the door"
        execution = exchange.execution
        if execution is not None and execution.ticket.job.id in self.runner.running():
            return n, "running"
        return None

    def owed(self, client: Client) -> list[Sent]:
        """The requests the server owes ``client`` an answer to now: those before the one that
        runs or waits (answered, or on their way), all of them if none does."""
        if not client.open:
            return []
        blocked = self.blocked(client)
        return [s for s in client.queue if not s.complete and (blocked is None or s.n < blocked[0])]

    def quiet(self) -> bool:
        """Every answer owed has come, every close has been seen by both sides."""
        for client in self.clients:
            if not client.open:
                continue
            if any(s.closes for s in client.queue):  # the close follows
                return False
            if self.owed(client):
                return False
        both_open = sum(1 for c in self.clients if c.open)
        return len(self.http_connections()) == both_open

    def settle(self) -> None:
        """Wait (bounded) for the server to answer what was sent; the invariants then say
        what is missing, if anything is."""

        async def settle() -> None:
            await poll(self.quiet, SETTLE_S)
            for _ in range(3):  # done-callbacks the last step scheduled
                await asyncio.sleep(0)

        self.run(settle())
        for client in self.live():  # (for the transcript: what runs, what waits)
            blocked = self.blocked(client)
            if blocked is not None and self.shown.get(blocked[0]) != blocked[1]:
                self.shown[blocked[0]] = blocked[1]
                self.log(f"{client.name}   #{blocked[0]} {blocked[1]}")

    def live(self) -> list[Client]:
        return [c for c in self.clients if c.open]

    def end_job(self, job: str, ok: bool) -> None:
        """End a running job; its request (found by the head the server keeps) is told so."""
        with self.reporting():
            self._end_job(job, ok)

    def _end_job(self, job: str, ok: bool) -> None:
        owner = None
        for conn in self.http_connections():
            exchange, client = conn.exchange, self.client_of(conn)
            if exchange is None or exchange.execution is None or client is None:
                continue
            if exchange.execution.ticket.job.id != job or conn.request is None:
                continue
            owner = client.by_n[int(dict(conn.request.headers)[b"x-test-request"])]
            spec, call = owner.spec, exchange.call
            assert call is not None
            assert (call.chat, call.stream) == (spec.what == "chat", spec.stream), owner
            assert exchange.key == (spec.tenant, hashlib.sha256(spec.body()).digest()), owner
            owner.outcome = ok
            self.log(f"runner {'finishes' if ok else 'fails'} {job} (#{owner.n} on {client})")
        if owner is None:
            self.log(f"runner {'finishes' if ok else 'fails'} {job} (its client left)")
        self.runner.end(job, ok)
        self.broken = self.broken or not ok

    # Sending -----------------------------------------------------------------------------

    def send(
        self,
        client: Client,
        specs: list[Spec],
        coalesced: bool,
        then: Leaving | None,
        retry: Sent | None = None,
    ) -> None:
        """The requests in one write, or each on its own once those before it are answered
        (or run, or wait); then, maybe, the client leaves at once."""
        sents: list[Sent] = []
        for spec in specs:
            self.requests += 1
            sents.append(Sent(self.requests, spec, self.drained))
        for sent in sents:
            again = f"  (again: #{retry.n})" if retry is not None else ""
            together = "  (one write)" if coalesced and len(sents) > 1 else ""
            self.log(f"{client.name} > #{sent.n} {sent.spec}{again}{together}")
        if coalesced:
            for sent in sents:
                client.sending(sent)
            client.writer.write(b"".join(s.spec.encode(s.n) for s in sents))
        else:
            for i, sent in enumerate(sents):
                if not client.open:  # the server closed it: what is left is never sent
                    self.log(f"{client.name}   (closed: #{sent.n} and after are not sent)")
                    break
                client.sending(sent)
                client.writer.write(sent.spec.encode(sent.n))
                if i + 1 < len(sents) or then is None:
                    self.settle()
        if then is not None:
            self.depart(client, then)
        self.settle()

    def depart(self, client: Client, how: Leaving) -> None:
        sock = client.writer.get_extra_info("socket")
        if how == "reset" and sock is not None:
            with contextlib.suppress(OSError):  # (the server may have closed it meanwhile)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.log(f"{client.name} {how}s" if how != "reset" else f"{client.name} resets")
        if how == "half-close":
            with contextlib.suppress(OSError):
                client.writer.write_eof()
        else:
            client.writer.close()
        client.left = True

    # Rules -------------------------------------------------------------------------------
    #
    # What a rule may act on (a client, a job, a refused request) depends on timing: a request
    # at the door is decided again at its hint, in real time. So that hypothesis draws the same
    # choices whatever the timing (else it calls the machine flaky), rules are always enabled
    # and pick by a drawn index (see pick): one with nothing to act on does nothing.

    @rule()
    def connect(self) -> None:
        if len(self.live()) >= MAX_CLIENTS:
            self.log(f"(no connect: {MAX_CLIENTS} clients connected)")
            return
        self.connect_a_client()

    def a_client(self, data: st.DataObject) -> Client:
        """A connected client (a new one if none is left)."""
        client = pick(data, self.live(), "client")
        if client is None:
            self.connect_a_client()
            client = self.live()[-1]
        return client

    def connect_a_client(self) -> None:
        name = f"c{len(self.clients) + 1}"
        source = f"127.0.0.{len(self.clients) + 2}"
        address = self.the_server.http_address
        assert address is not None

        async def connect() -> Client:
            reader, writer = await asyncio.open_connection(*address, local_addr=(source, 0))
            return Client(name, reader, writer, self.log, lambda: (self.drained, self.broken))

        self.clients.append(self.run(connect()))
        self.log(f"{name} connects (from {source})")
        self.settle()

    @rule(
        data=st.data(),
        specs=st.lists(SPECS, min_size=1, max_size=PIPELINE),
        coalesced=st.booleans(),
        then=THEN,
    )
    def send_requests(
        self, data: st.DataObject, specs: list[Spec], coalesced: bool, then: Leaving | None
    ) -> None:
        """Requests, pipelined in one write or one by one, maybe with the client leaving at
        once."""
        self.send(self.a_client(data), specs, coalesced, then)

    @rule(spec=SPECS)
    def crowd(self, spec: Spec) -> None:
        """Every client sends the same request at once (more than the slots: some are refused,
        and each is the others' retry)."""
        while len(self.live()) < CAP + 1:
            self.connect_a_client()
        for client in self.live():
            self.requests += 1
            sent = Sent(self.requests, spec, self.drained)
            self.log(f"{client.name} > #{sent.n} {spec}  (all at once)")
            client.sending(sent)
            client.writer.write(spec.encode(sent.n))
        self.settle()

    def refused(self) -> list[Sent]:
        return [
            s
            for c in self.clients
            for s in c.queue
            if s.complete and s.head is not None and s.head.status == 429
        ]

    @rule(data=st.data(), then=THEN)
    def retry_a_refused_request(self, data: st.DataObject, then: Leaving | None) -> None:
        """A request that got 429, sent again at once (its hint not yet passed: back early for
        its place, it may wait at the door), on its connection or another."""
        refused = pick(data, self.refused(), "refused")
        client = self.a_client(data)
        if refused is None:
            self.log("(no refused request to send again)")
            return
        self.send(client, [refused.spec], True, then, retry=refused)

    def asked(self) -> list[Client]:
        return [c for c in self.live() if c.queue]

    @rule(data=st.data(), how=st.sampled_from(["close", "reset", "half-close"]))
    def leave(self, data: st.DataObject, how: Leaving) -> None:
        """A client that asked for something leaves: while its job runs, while it waits at the
        door, or between requests."""
        self.leaves(pick(data, self.asked(), "client"), how)

    def waiting(self) -> list[Client]:
        return [c for c in self.live() if (b := self.blocked(c)) is not None and b[1] != "running"]

    @rule(data=st.data(), how=st.sampled_from(["close", "reset", "half-close"]))
    def leave_the_door(self, data: st.DataObject, how: Leaving) -> None:
        """A client waiting at the door leaves: its place is given up."""
        self.leaves(pick(data, self.waiting(), "client"), how)

    def leaves(self, client: Client | None, how: Leaving) -> None:
        if client is None:
            self.log("(no client to leave)")
            return
        blocked = self.blocked(client)
        if blocked is not None:
            self.log(f"{client.name}   (#{blocked[0]} {blocked[1]})")
        self.depart(client, how)
        self.settle()

    @rule(data=st.data(), ok=st.booleans())
    def end_a_job(self, data: st.DataObject, ok: bool) -> None:
        """The runner finishes a running job, or fails it."""
        job = pick(data, self.runner.running(), "job")
        if job is None:
            self.log("(no job to end)")
            return
        self.end_job(job, ok)
        self.settle()

    @rule(ms=st.sampled_from([10, 50, 200]))
    def wait(self, ms: int) -> None:
        """Time passes: doors are decided again, hints and places run out."""
        self.log(f"({ms} ms pass)")
        self.run(asyncio.sleep(ms / 1000))
        self.settle()

    @precondition(lambda self: not self.drained and self.steps >= DRAIN_AFTER)
    @rule()
    def drain(self) -> None:
        """From now on, new requests are refused with 503 (and the connection closed after);
        running jobs go on."""
        self.drained = True
        self.log("server begins a drain")

        async def drain() -> None:
            self.the_server.begin_drain("test")

        self.run(drain())
        self.settle()

    # Invariants --------------------------------------------------------------------------

    def bodies_held(self) -> int:
        """Request bodies counted against the payload buffers: those of the requests that run
        or wait at the door."""
        return sum(
            len(conn.body)
            for conn in self.http_connections()
            if conn.exchange is not None
            and (conn.exchange.execution is not None or conn.exchange.door_timer is not None)
        )

    def orphans(self) -> set[str]:
        """Jobs the runner still runs whose connection is gone."""
        owned = {
            conn.exchange.execution.ticket.job.id
            for conn in self.http_connections()
            if conn.exchange is not None and conn.exchange.execution is not None
        }
        return set(self.runner.running()) - owned

    def accounts_settle(self) -> bool:
        server = self.the_server
        return (
            server.inflight == server.live_jobs
            and server.buffered_bytes == self.bodies_held()
            and not self.orphans()
        )

    @invariant()
    def count_steps(self) -> None:
        self.steps += 1

    @invariant()
    def slots_held_are_live_jobs(self) -> None:
        if self.server is None:
            return
        server = self.server
        with self.reporting():
            # A task that has just ended gives its slot back in its done-callback, a loop
            # iteration later; a leaked slot is never given back.
            self.run(poll(self.accounts_settle, SETTLE_S))
            inflight, live, buffered, tenants = accounted(server)
            assert inflight == live, f"{inflight} slot(s) held, {live} live execution(s)"
            assert inflight <= CAP
            assert sum(tenants) == inflight, f"tenants' counts {tenants}, {inflight} slot(s)"
            for tenant in server.tenants.all():
                assert tenant.inflight <= tenant.config.max_inflight, tenant.name
            assert len(self.runner.running()) <= live
            assert not self.orphans(), f"jobs run on for clients that left: {self.orphans()}"
            held = self.bodies_held()
            assert buffered == held, f"{buffered} byte(s) buffered, {held} in requests held"

    @invariant()
    def places_add_up(self) -> None:
        """Each tenant's ``waiting`` is its places kept and its requests at the door; the
        ledger's line holds the promises of those, no other."""
        if self.server is None:
            return
        with self.reporting():
            in_line = self.the_server.ledger.waiting(len(LANES) - 1)  # (lapses the old first)
            places = self.places
            kept: collections.Counter[str] = collections.Counter()
            door: collections.Counter[str] = collections.Counter()
            promised = 0
            for (name, _), line in places._by_key.items():
                kept[name] += len(line)
                promised += sum(
                    k.attempt.promise is not None and k.attempt.promise.queued for k in line
                )
            assert places.count == sum(kept.values()), f"{places.count} places, {kept}"
            assert places.count <= places.limit
            for conn in self.http_connections():
                exchange = conn.exchange
                if exchange is None:
                    continue
                assert (exchange.door_timer is not None) == exchange.at_door, "at the door?"
                if exchange.at_door:
                    assert exchange.attempt is not None
                    door[exchange.attempt.tenant.name] += 1
                    promise = exchange.attempt.promise
                    promised += promise is not None and promise.queued
            for tenant in self.the_server.tenants.all():
                assert tenant.waiting == kept[tenant.name] + door[tenant.name], (
                    f"tenant {tenant.name}: waiting {tenant.waiting}, but "
                    f"{kept[tenant.name]} place(s) kept and {door[tenant.name]} at the door"
                )
            assert in_line == promised, (
                f"{in_line} promise(s) in the ledger's line, {promised} held by places kept "
                "and requests at the door"
            )

    @invariant()
    def one_answer_each(self) -> None:
        with self.reporting():
            self.check_answers()

    def check_answers(self) -> None:
        for client in self.clients:
            assert not client.problems, f"{client}: {client.problems}"
            for sent in client.queue:
                if sent.head is not None:
                    self.check_answer(client, sent)
            if client.open:
                owed = self.owed(client)
                assert not owed, f"{client}: no answer to {owed}"
                closing = [s for s in client.queue if s.closes]
                assert not closing, f"{client}: {closing[0]} said it closes, and did not"
            if client.eof and not client.left:
                # The server closed it: idle (HTTP lets it close an idle connection at any
                # time), or after an answer that said so; never on requests it leaves
                # unanswered without a word (it read them: a POST cannot be sent again safely).
                assert not client.truncated, f"{client}: an answer cut short"
                closing = [s for s in client.queue if s.closes]
                last = client.queue.index(closing[0]) if closing else len(client.queue)
                assert all(s.complete for s in client.queue[:last]), (
                    f"{client}: closed, with no answer to "
                    f"{[s for s in client.queue[:last] if not s.complete]}"
                    + ("" if closing else " and no connection: close")
                )

    def check_answer(self, client: Client, sent: Sent) -> None:
        head, spec = sent.head, sent.spec
        assert head is not None
        where = f"{client}: {sent}"
        status, headers = head.status, head.headers
        if "x-governor-inflight" in headers:
            assert int(headers["x-governor-inflight"]) <= CAP, where
        if not sent.complete:  # only a stream is answered in parts (its head at the token)
            assert client.left or (status == 200 and spec.stream), where
            return
        body = bytes(sent.body)
        if not spec.job:
            if spec.what == "models":
                assert status == 200, where
                assert orjson.loads(body)["object"] == "list", where
            else:
                assert status == 404, where
                assert error(body, where)["code"] == "not_found", where
            return
        if spec.fault in ("bad_key", "no_key"):
            assert status == 401, where
            assert error(body, where)["code"] == "unauthorized", where
            assert error(body, where)["type"] == "authentication_error", where
            assert headers.get("www-authenticate") == "Bearer", where
            return
        if spec.fault in ("bad_json", "unsupported"):
            assert status == 400, where
            assert error(body, where)["code"] == "spec_invalid", where
            assert error(body, where)["type"] == "invalid_request_error", where
            return
        if sent.after_drain:
            assert status == 503, f"{where}: sent after the drain"
        if spec.fault == "bad_spec":  # refused for good, but draining comes first
            assert status in (400, 503), where
            if status == 400:
                assert error(body, where)["code"] == "max_new_tokens_invalid", where
        else:
            assert status in (200, 429, 502, 503), where
        if status in (429, 503):
            check_refusal(status, headers, body, head, where)
            if sent.after_drain or spec.fault == "bad_spec":  # (draining is decided first)
                assert error(body, where)["code"] == "draining", where
        elif status == 502:
            assert error(body, where)["code"] == "backend_error", where
            assert client.left or sent.outcome is False, f"{where}: its job did not fail"
        elif status == 200:
            failed = check_success(spec, body, where)
            if not client.left:
                assert sent.outcome is (not failed), f"{where}: its job ended {sent.outcome}"

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

    def at_the_door(self) -> list[HttpConnection]:
        return [c for c in self.http_connections() if c.exchange and c.exchange.at_door]

    async def finish(self) -> None:
        """Every job finishes and is answered (those waiting at the door too, once they run);
        then every client leaves, and the server must give back every slot, byte and count,
        and forget every place kept once its hint and grace have passed."""
        server = self.the_server
        deadline = time.monotonic() + api.DOOR_MAX_S + SETTLE_S
        # (a request at the door may be admitted in any iteration: its job is live before it
        # reaches the runner)
        while server.live_jobs or self.at_the_door():
            for job in self.runner.running():
                self.end_job(job, True)
            await poll(self.quiet, SETTLE_S)
            for _ in range(3):
                await asyncio.sleep(0)
            if time.monotonic() > deadline:
                self.log("(the wait for the last jobs timed out)")
                break
            await asyncio.sleep(0.005)
        self.log("runner finishes every job")
        await poll(self.quiet, SETTLE_S)
        assert not self.runner.running(), f"jobs still running: {self.runner.running()}"
        assert not self.at_the_door(), f"still at the door: {self.at_the_door()}"
        self.check_answers()
        self.check_counted()
        for client in self.clients:
            if not client.left:
                client.left = True
                client.writer.close()
        self.log("every client closes")
        await poll(lambda: accounted(server)[:3] == (0, 0, 0) and not server.connections, FINAL_S)
        inflight, live, buffered, _ = accounted(server)
        assert (inflight, live, buffered) == (0, 0, 0), (
            f"with no client left: {inflight} slot(s) held, {live} live execution(s), "
            f"{buffered} payload byte(s) buffered"
        )
        assert not server.connections
        for tenant in server.tenants.all():
            assert (tenant.inflight, tenant.running) == (0, []), tenant.name
        # The places kept are forgotten at their time: each its hint, plus the grace, from its
        # refusal (the longest hint told a client bounds them all, but for answers lost with
        # a client that left at once: PLACES_S more covers those).
        told = [
            int(s.head.headers["retry-after-ms"])
            for c in self.clients
            for s in c.queue
            if s.head is not None and "retry-after-ms" in s.head.headers
        ]
        longest_s = max(told, default=0) / 1000 + GRACE_S + PLACES_S
        places = self.places
        now = server.state.clock()
        outliving = sorted(
            round(k.until - now, 1)
            for line in places._by_key.values()
            for k in line
            if k.until - now > longest_s
        )
        assert not outliving, (
            f"place(s) kept for {outliving} s more, past the longest hint told a client "
            f"({max(told, default=0)} ms) and the grace ({GRACE_S} s)"
        )
        await poll(
            lambda: (
                given_back(server)
                and places.count == 0
                and server.ledger.waiting(len(LANES) - 1) == 0
            ),
            longest_s + 0.1,
        )
        assert places.count == 0, f"{places.count} place(s) still kept {longest_s:.1f} s on"
        for tenant in server.tenants.all():
            assert tenant.waiting == 0, f"tenant {tenant.name}: waiting {tenant.waiting}"
        assert server.ledger.waiting(len(LANES) - 1) == 0, "promises left in the ledger's line"

    def check_counted(self) -> None:
        """The server counts every answer it sends (``http_responses``): those the clients
        received, and at most one for each request of a client that left unanswered."""
        counted = collections.Counter(self.the_server.state.http_responses)
        received = collections.Counter(
            (s.spec.counted_path, str(s.head.status))
            for c in self.clients
            for s in c.queue
            if s.head is not None
        )
        lost = sum(1 for c in self.clients if c.left for s in c.queue if s.head is None)
        uncounted = received - counted
        assert not uncounted, f"answers received, not counted: {dict(uncounted)}"
        unseen = counted - received
        assert sum(unseen.values()) <= lost, (
            f"answers counted, not received: {dict(unseen)}; {lost} request(s) lost with "
            "clients that left"
        )

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


def pick(data: st.DataObject, items: list[T], label: str) -> T | None:
    """One of ``items`` by a drawn index (the same draw however many there are), or None."""
    index = data.draw(st.integers(0, 15), label=label)
    return items[index % len(items)] if items else None


def error(body: bytes, where: str) -> dict[str, Any]:
    """An OpenAI-shaped error body's ``error``: message, type, param, code."""
    obj = orjson.loads(body)
    assert set(obj) == {"error"}, where
    err: dict[str, Any] = obj["error"]
    assert set(err) == {"message", "type", "param", "code"}, where
    assert isinstance(err["message"], str), where
    assert isinstance(err["code"], str), where
    return err


def check_refusal(
    status: int, headers: dict[str, str], body: bytes, head: Head, where: str
) -> None:
    """A 429 (busy) or a 503 (draining): its code and the hint, in both headers."""
    err = error(body, where)
    if status == 429:
        assert err["code"] in BUSY, where
        assert err["type"] == "rate_limit_error", where
    else:
        assert err["code"] in ("draining", "breaker_open"), where
        assert err["type"] == "server_error", where
        if err["code"] == "draining":
            assert head.drained, f"{where}: 503 with no drain"
        else:
            assert head.broken, f"{where}: the breaker open, and no job failed"
    hint = headers.get("retry-after-ms", "")
    assert hint.isdigit(), f"{where}: retry-after-ms {hint!r}"
    assert int(hint) >= 1, f"{where}: retry-after-ms {hint!r}"
    seconds = str(max(1, math.ceil(int(hint) / 1000)))
    assert headers.get("retry-after") == seconds, f"{where}: retry-after {headers}"
    if err["code"] == "draining":
        assert int(hint) <= api.DRAINING_HINT_MS, where


def check_success(spec: Spec, body: bytes, where: str) -> bool:
    """A 200 for a job: the whole completion, or the stream's events; True when the stream
    ended with an error event (its job failed after its head went out)."""
    chat = spec.what == "chat"
    if not spec.stream:
        obj = orjson.loads(body)
        assert obj["object"] == ("chat.completion" if chat else "text_completion"), where
        (choice,) = obj["choices"]
        text = choice["message"]["content"] if chat else choice["text"]
        assert text == TOKEN, where
        assert set(obj["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}, where
        return False
    events = body.split(b"\n\n")
    assert events[-1] == b"", f"{where}: {body!r}"
    datas = [e.removeprefix(b"data: ") for e in events[:-1]]
    assert all(e.startswith(b"data: ") for e in events[:-1]), f"{where}: {body!r}"
    if datas[-1] != b"[DONE]":
        assert error(datas[-1], where)["code"] == "backend_error", where
        return True
    chunks = [orjson.loads(d) for d in datas[:-1]]
    kind = "chat.completion.chunk" if chat else "text_completion"
    assert all(c["object"] == kind for c in chunks), f"{where}: {body!r}"
    deltas = [c["choices"][0]["delta"] if chat else c["choices"][0] for c in chunks]
    text = "".join(d.get("content" if chat else "text") or "" for d in deltas)
    assert text == TOKEN, f"{where}: {body!r}"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop", where
    return False


class OnAsyncio(FrontDoorInterleavings):
    make_loop = asyncio.new_event_loop


class OnUvloop(FrontDoorInterleavings):
    make_loop = uvloop.new_event_loop


@pytest.mark.slow
@pytest.mark.parametrize("machine", [OnAsyncio, OnUvloop], ids=["asyncio", "uvloop"])
def test_the_front_door_never_leaks(machine: type[FrontDoorInterleavings]) -> None:
    # A plain test on a loop of the machine's own: pytest-asyncio's loop takes no part.
    run_state_machine_as_test(
        machine, settings=settings(max_examples=25, stateful_step_count=25, deadline=None)
    )
