"""The HTTP door: the OpenAI front door (``http_listen``), with clients that speak HTTP/1.1 by hand.

Keep-alive, pipelined requests; answers parsed by ``h11``: chats and completions, whole or
streamed, of two tenants, with bodies drawn from a small set (identical requests are one
another's retries: a refused request's place is kept for them), bad keys and bad bodies among
them, some that ask not to wait at the door; requests that wait there for their turn (within
``max_wait``), and retries of refused requests at once (back early for their place), from
the same connection or another; clients that close, reset or half-close at any moment
(while their job runs, which is HTTP's only cancel; while they wait at the door; in the middle
of a pipeline); time that passes. Besides what every door holds, it checks that the payload
buffers hold exactly the bodies of the requests held, that the places kept and the clients
waiting at the door add up to each tenant's ``waiting`` and to the promises in the ledger's
line, that the door's line holds exactly the requests waiting at it, that each answer has the shape its status says, that the server counts every answer it
sends, and at the end that the places kept are forgotten once their hints (plus
``upload_timeout``, their grace) have passed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import math
import socket
import struct
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import h11
import orjson
from hypothesis import strategies as st

from governor.core.ledger import DRAINING_HINT_MS
from governor.core.policy import LANES
from governor.listeners import openai_api as api
from governor.listeners.http import HttpConnection
from governor.listeners.http_session import Exchange
from governor.listeners.openai_api import KeptPlaces
from governor.runners import Job, RunEvent, Token
from protocol.spec import JobSpec

from .interleavings import KEYS, GateRunner, given_back, move, pick, poll, tenants

if TYPE_CHECKING:
    from .interleavings import Interleavings

CAP = 2
TENANTS = tenants(CAP)
PIPELINE = 3
GRACE_S = 0.3  # upload_timeout: how long past its hint a refused request's place is kept
WAIT_S = 1.0  # max_wait: how long a request may wait at the door for its turn
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
    no_wait: bool = False  # it asks not to wait at the door (x-governor-max-wait-ms: 0)

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
            obj["best_of"] = 2  # (refused by the mapping: 400 before admission)
        if self.fault == "bad_spec":
            obj["max_tokens"] = 10 * MAX_NEW_TOKENS  # (refused by the runner: 400 at admission)
        return orjson.dumps(obj)

    def encode(self, n: int) -> bytes:
        """The request on the wire; ``x-test-request`` names it (the server keeps the head of
        the request it is answering: the test finds which one runs or waits)."""
        method = "POST" if self.job else "GET"
        lines = [f"{method} {PATHS[self.what]} HTTP/1.1", "host: governor", f"x-test-request: {n}"]
        if self.job and self.no_wait:
            lines.append(f"{api.MAX_WAIT_HEADER}: 0")
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
        words.append("no-wait" if self.no_wait else "")
        return " ".join(w for w in words if w)


SPECS = st.builds(
    Spec,
    what=st.sampled_from(["chat", "chat", "chat", "completion", "completion", "models", "missing"]),
    tenant=st.sampled_from(sorted(KEYS)),
    prompt=st.sampled_from(["hi", "yo"]),
    stream=st.booleans(),
    no_wait=st.sampled_from([False, False, True]),
    fault=st.sampled_from(
        ["", "", "", "", "", "", "bad_key", "no_key", "bad_json", "unsupported", "bad_spec"]
    ),
).map(lambda s: s if s.job else Spec(s.what))
# Most requests are sent and left to be answered; some clients leave at once, in the same step.
THEN: st.SearchStrategy[Leaving | None] = st.sampled_from(
    [None, None, None, None, None, "close", "reset"]
)


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
    def answers(self) -> list[Head]:
        """Its answer, if it came (one at most: a second would answer the next request)."""
        return [] if self.head is None else [self.head]

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


class HttpDoor:
    """The OpenAI front door's door (see the module's docstring)."""

    MAX_CLIENTS: ClassVar[int] = 4
    LEAVINGS: ClassVar[tuple[str, ...]] = ("close", "reset", "half-close")
    LAST_JOBS_S: ClassVar[float] = WAIT_S
    DRAIN_AFTER: ClassVar[int] = 8  # (each answer after it closes its connection)
    # A client cancels its job by leaving (closing, resetting or half-closing while its job
    # runs): disconnect draws that, among the clients that asked for something.
    CANCELS: ClassVar[bool] = False

    def __init__(self, machine: Interleavings) -> None:
        self.m = machine
        self.clients: list[Client] = []
        self.requests = 0
        self.shown: dict[int, str] = {}  # what the transcript last said of each request

    def settings(self) -> dict[str, Any]:
        return {
            "http_listen": "127.0.0.1:0",
            "max_inflight": CAP,
            "tenants": TENANTS,
            "upload_timeout": GRACE_S,
            "max_wait": WAIT_S,
            "max_auth_failures": 2,  # a connection's second bad key closes it
            "max_connections": 2 * self.MAX_CLIENTS,
            "held_payloads_per_conn": 1,  # so at most 8 places are kept
            "breaker_failures": 3,  # three failed jobs open the breaker: 503 for a moment
            "breaker_cooldown": 0.2,
        }

    def make_runner(self) -> GateRunner:
        return TokenGate()

    def started(self) -> None:
        for _ in range(2):
            self.connect_a_client()

    @property
    def places(self) -> KeptPlaces:
        front = self.m.the_server._front
        assert front is not None
        return front.places

    def connect_a_client(self) -> None:
        name = f"c{len(self.clients) + 1}"
        source = f"127.0.0.{len(self.clients) + 2}"
        address = self.m.the_server.http_address
        assert address is not None

        async def connect() -> Client:
            reader, writer = await asyncio.open_connection(*address, local_addr=(source, 0))
            return Client(name, reader, writer, self.m.log, lambda: (self.m.drained, self.m.broken))

        self.clients.append(self.m.run(connect()))
        self.m.log(f"{name} connects (from {source})")
        self.m.settle()

    # The server's side of each client ----------------------------------------------------

    def http_connections(self) -> list[HttpConnection]:
        return [c for c in self.m.the_server.connections if isinstance(c, HttpConnection)]

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
        if conn is None or conn.session.exchange is None or conn.session.incoming.request is None:
            return None
        n = int(dict(conn.session.incoming.request.headers)[b"x-test-request"])
        exchange = conn.session.exchange
        if _decided_later(exchange):
            return n, "at the door"
        execution = exchange.execution
        if execution is not None and execution.ticket.job.id in self.m.runner.running():
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
        for client in self.clients:
            if not client.open:
                continue
            if any(s.closes for s in client.queue):  # the close follows
                return False
            if self.owed(client):
                return False
        both_open = sum(1 for c in self.clients if c.open)
        return len(self.http_connections()) == both_open

    def after_settle(self) -> None:
        for client in self.m.live():  # (for the transcript: what runs, what waits)
            blocked = self.blocked(client)
            if blocked is not None and self.shown.get(blocked[0]) != blocked[1]:
                self.shown[blocked[0]] = blocked[1]
                self.m.log(f"{client.name}   #{blocked[0]} {blocked[1]}")

    def pending(self) -> list[HttpConnection]:
        return [
            c for c in self.http_connections() if c.session.exchange and c.session.exchange.at_door
        ]

    def job_ending(self, job: str, ok: bool) -> None:
        """Its request (found by the head the server keeps) is told how its job ends."""
        owner = None
        for conn in self.http_connections():
            exchange, client = conn.session.exchange, self.client_of(conn)
            if exchange is None or exchange.execution is None or client is None:
                continue
            if exchange.execution.ticket.job.id != job or conn.session.incoming.request is None:
                continue
            owner = client.by_n[int(dict(conn.session.incoming.request.headers)[b"x-test-request"])]
            spec, call = owner.spec, exchange.call
            assert call is not None
            assert (call.chat, call.stream) == (spec.what == "chat", spec.stream), owner
            assert exchange.ask is not None
            assert exchange.ask.key == (spec.tenant, hashlib.sha256(spec.body()).digest()), owner
            owner.outcome = ok
            self.m.log(f"runner {'finishes' if ok else 'fails'} {job} (#{owner.n} on {client})")
        if owner is None:
            self.m.log(f"runner {'finishes' if ok else 'fails'} {job} (its client left)")

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
            sents.append(Sent(self.requests, spec, self.m.drained))
        for sent in sents:
            again = f"  (again: #{retry.n})" if retry is not None else ""
            together = "  (one write)" if coalesced and len(sents) > 1 else ""
            self.m.log(f"{client.name} > #{sent.n} {sent.spec}{again}{together}")
        if coalesced:
            for sent in sents:
                client.sending(sent)
            client.writer.write(b"".join(s.spec.encode(s.n) for s in sents))
        else:
            for i, sent in enumerate(sents):
                if not client.open:  # the server closed it: what is left is never sent
                    self.m.log(f"{client.name}   (closed: #{sent.n} and after are not sent)")
                    break
                client.sending(sent)
                client.writer.write(sent.spec.encode(sent.n))
                if i + 1 < len(sents) or then is None:
                    self.m.settle()
        if then is not None:
            self.depart(client, then)
        self.m.settle()

    def depart(self, client: Client, how: str) -> None:
        sock = client.writer.get_extra_info("socket")
        if how == "reset" and sock is not None:
            with contextlib.suppress(OSError):  # (the server may have closed it meanwhile)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.m.log(f"{client.name} {how}s" if how != "reset" else f"{client.name} resets")
        if how == "half-close":
            with contextlib.suppress(OSError):
                client.writer.write_eof()
        else:
            client.writer.close()
        client.left = True

    def submit(self, client: Client, data: st.DataObject) -> None:
        """Requests, pipelined in one write or one by one, maybe with the client leaving at
        once."""
        specs = data.draw(st.lists(SPECS, min_size=1, max_size=PIPELINE), label="requests")
        coalesced = data.draw(st.booleans(), label="coalesced")
        then = data.draw(THEN, label="then")
        self.send(client, specs, coalesced, then)

    def running_on(self) -> dict[str, Client]:
        """Each running job's client, where its connection is still there."""
        running = set(self.m.runner.running())
        owners: dict[str, Client] = {}
        for conn in self.http_connections():
            exchange, client = conn.session.exchange, self.client_of(conn)
            if exchange is None or exchange.execution is None or client is None:
                continue
            if (job := exchange.execution.ticket.job.id) in running:
                owners[job] = client
        return owners

    def cancellable(self) -> list[tuple[Any, str]]:
        return []  # (no cancel but leaving: see CANCELS)

    def cancel(self, client: Client, job: str, data: st.DataObject) -> None:
        raise AssertionError("HTTP has no cancel but leaving: the machine draws disconnect")

    def leavers(self) -> list[Any]:
        """The clients that asked for something: they leave while their job runs, while they
        wait at the door, or between requests."""
        return [c for c in self.m.live() if c.queue]

    def disconnect(self, client: Client, how: str, last_words: bool) -> None:
        # (no last words: a client's requests are in its queue already)
        blocked = self.blocked(client)
        if blocked is not None:
            self.m.log(f"{client.name}   (#{blocked[0]} {blocked[1]})")
        self.depart(client, how)

    # The door's own moves ----------------------------------------------------------------

    def crowd(self, data: st.DataObject) -> None:
        """Every client sends the same request at once (more than the slots: some are refused,
        and each is the others' retry)."""
        spec = data.draw(SPECS, label="spec")
        while len(self.m.live()) < CAP + 1:
            self.connect_a_client()
        for client in self.m.live():
            self.requests += 1
            sent = Sent(self.requests, spec, self.m.drained)
            self.m.log(f"{client.name} > #{sent.n} {spec}  (all at once)")
            client.sending(sent)
            client.writer.write(spec.encode(sent.n))
        self.m.settle()

    def refused(self) -> list[Sent]:
        return [
            s
            for c in self.clients
            for s in c.queue
            if s.complete and s.head is not None and s.head.status == 429
        ]

    @move(data=st.data(), then=THEN)
    def retry_a_refused_request(self, data: st.DataObject, then: Leaving | None) -> None:
        """A request that got 429, sent again at once (its hint not yet passed: back early for
        its place, it may wait at the door), on its connection or another."""
        refused = pick(data, self.refused(), "refused")
        client = self.m.a_client(data)
        if refused is None:
            self.m.log("(no refused request to send again)")
            return
        self.send(client, [refused.spec], True, then, retry=refused)

    def waiting(self) -> list[Client]:
        return [
            c for c in self.m.live() if (b := self.blocked(c)) is not None and b[1] != "running"
        ]

    @move(data=st.data(), how=st.sampled_from(["close", "reset", "half-close"]))
    def leave_the_door(self, data: st.DataObject, how: Leaving) -> None:
        """A client waiting at the door leaves: its place is given up."""
        client = pick(data, self.waiting(), "client")
        if client is None:
            self.m.log("(no client to leave)")
            return
        self.disconnect(client, how, last_words=False)
        self.m.settle()

    @move(ms=st.sampled_from([10, 50, 200]))
    def wait(self, ms: int) -> None:
        """Time passes: doors are decided again, hints and places run out."""
        self.m.log(f"({ms} ms pass)")
        self.m.run(asyncio.sleep(ms / 1000))
        self.m.settle()

    # What the server holds ---------------------------------------------------------------

    def bodies_held(self) -> int:
        """Request bodies counted against the payload buffers: those of the requests that run
        or wait at the door."""
        return sum(
            len(conn.session.incoming.body)
            for conn in self.http_connections()
            if conn.session.exchange is not None
            and (
                conn.session.exchange.execution is not None or _decided_later(conn.session.exchange)
            )
        )

    def orphans(self) -> set[str]:
        return set(self.m.runner.running()) - set(self.running_on())

    def buffers_settle(self) -> bool:
        return self.m.the_server.buffered_bytes == self.bodies_held()

    def check_accounts(self) -> None:
        """The buffers hold the bodies of the requests held, no more, no fewer; each tenant's
        ``waiting`` is its places kept and its requests at the door; the ledger's line holds
        the promises of those, no other."""
        buffered, held = self.m.the_server.buffered_bytes, self.bodies_held()
        assert buffered == held, f"{buffered} byte(s) buffered, {held} in requests held"
        in_line = self.m.the_server.ledger.waiting(len(LANES) - 1)  # (lapses the old first)
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
            exchange = conn.session.exchange
            if exchange is None:
                continue
            assert _decided_later(exchange) == exchange.at_door, "at the door?"
            if exchange.at_door:
                assert exchange.ask is not None
                door[exchange.ask.attempt.tenant.name] += 1
                promise = exchange.ask.attempt.promise
                promised += promise is not None and promise.queued
        door_line = self.m.the_server.state.line
        assert door_line is not None
        assert len(door_line) == sum(door.values()), f"{len(door_line)} in line, {door} at door"
        for tenant in self.m.the_server.tenants.all():
            assert tenant.waiting == kept[tenant.name] + door[tenant.name], (
                f"tenant {tenant.name}: waiting {tenant.waiting}, but "
                f"{kept[tenant.name]} place(s) kept and {door[tenant.name]} at the door"
            )
        assert in_line == promised, (
            f"{in_line} promise(s) in the ledger's line, {promised} held by places kept "
            "and requests at the door"
        )

    # The answers -------------------------------------------------------------------------

    def problems(self, client: Client) -> list[str]:
        return client.problems

    def asks(self, client: Client) -> list[Sent]:
        return client.queue

    def check_connection(self, client: Client) -> None:
        if client.open:
            closing = [s for s in client.queue if s.closes]
            assert not closing, f"{client}: {closing[0]} said it closes, and did not"
        if client.eof and not client.left:
            # The server closed it: idle (HTTP lets it close an idle connection at any time),
            # or after an answer that said so; never on requests it leaves unanswered without
            # a word (it read them: a POST cannot be sent again safely).
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
        if status in (200, 429, 503):  # (decided by admission: at once, or after a wait)
            assert headers.get("x-governor-waited-ms", "").isdigit(), f"{where}: {headers}"
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

    def check_final(self) -> None:
        """The server counts every answer it sends (``http_responses``): those the clients
        received, and at most one for each request of a client that left unanswered."""
        counted = collections.Counter(self.m.the_server.state.metrics.http_responses)
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

    async def forget(self) -> None:
        """The places kept are forgotten at their time: each its hint, plus the grace, from
        its refusal (the longest hint told a client bounds them all, but for answers lost with
        a client that left at once: PLACES_S more covers those)."""
        server = self.m.the_server
        told = [
            int(s.head.headers["retry-after-ms"])
            for c in self.clients
            for s in c.queue
            if s.head is not None and "retry-after-ms" in s.head.headers
        ]
        longest_s = max(told, default=0) / 1000 + GRACE_S + PLACES_S
        places = self.places
        now = server.state.now()
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
        assert int(hint) == DRAINING_HINT_MS, where


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


def _decided_later(exchange: Exchange) -> bool:
    """The request waits in line, to be decided again at its hint."""
    return exchange.ask is not None and exchange.ask.decide_at < math.inf
