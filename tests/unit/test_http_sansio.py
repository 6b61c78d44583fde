"""The front door's connection with no IO (:class:`governor.listeners.http_session.HttpSession`),
as h11's tests drive ``h11.Connection``: bytes in, the answers' bytes out (read back by an h11
client), on the test clock; no event loop, no socket, no task. The door is the real one
(:class:`~governor.listeners.http.FrontDoor`: its routes, its places kept for retries) on a
timer the test fires; a job the session starts is handed to the test, which ends it as an
execution would. Each outcome on its own, then generated interleavings of clients, slots
freeing, time passing and clients leaving: every request answered once or its connection
closed, and the slots, buffers and line back to zero."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import h11
import orjson
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from governor.core.admission import Ticket
from governor.execution import Ending, Execution, Replies, Running
from governor.intake import JobAdmitted
from governor.listeners.http import FrontDoor
from governor.listeners.http_session import Cancel, HttpSession
from governor.ops.health import Check, Verdict
from governor.runners import Relayed, Token
from governor.state import ServerState
from protocol.codes import ErrorCode, NeedCode
from tests.clock import FakeClock

from .test_ask import keyed_state, make_state
from .test_conversation import unserved

CHAT = "/v1/chat/completions"


class Timer:
    """The door's timer, fired by the test (``call_later`` on the test clock)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.due: list[tuple[float, Callable[[], None], Handle]] = []

    def call_later(self, delay: float, callback: Callable[[], None]) -> Handle:
        handle = Handle()
        self.due.append((self.clock.now + delay, callback, handle))
        return handle

    def advance(self, seconds: float) -> None:
        """Time passes; what fell due fires, in order."""
        self.clock.now += seconds
        while due := sorted(
            (d for d in self.due if d[0] <= self.clock.now and not d[2].cancelled),
            key=lambda d: d[0],
        ):
            self.due.remove(due[0])
            due[0][1]()


@dataclass
class Handle:
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class Started:
    """What the session needs of a running job's execution, for a test that runs nothing."""

    job: str
    ticket: Ticket
    replies: Replies
    state: ServerState
    terminal_sent: bool = False
    aborted: str | None = None

    def client_gone(self) -> None:
        self.terminal_sent = True

    def abort(self, need_code: NeedCode, error_code: ErrorCode, detail: str) -> None:
        self.aborted = need_code

    def release(self, reason: str) -> None:
        """The ticket back, and its slot offered to the line (the execution's done-callback)."""
        self.ticket.release(reason)
        self.state.offer()

    def end(self, text: str = "hi") -> None:
        """As an execution ends: the ticket back, the terminal answer, the job gone."""
        self.release("done")
        execution = cast(Execution, self)
        result = {"text": text, "finish_reason": "stop", "completion_tokens": 1}
        self.replies.send_terminal(execution, Ending(result=result))
        self.replies.job_ended(execution)


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes = b""

    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass(eq=False)
class Client:
    """One connection: its session, and the link it answers through (http_session.Link)."""

    door: FrontDoor
    state: ServerState
    session: HttpSession = field(init=False)
    out: bytearray = field(default_factory=bytearray)
    closed: bool = False  # the link closed (after what was written)
    reads: bool = True
    deadline: float = float("inf")
    woken: int = 0
    started: list[Started] = field(default_factory=list)
    parser: h11.Connection = field(default_factory=lambda: h11.Connection(h11.CLIENT))

    def __post_init__(self) -> None:
        self.session = HttpSession(self.state, self.door, self, conn_id=id(self))
        self.session.credentials.connected("127.0.0.1", None)
        refused = self.state.connections.opened(
            self, self.session, self.session.source, idle=self.session.is_idle
        )
        assert refused is None
        self.session.opened()

    # http_session.Link

    def write(self, data: bytes) -> None:
        self.out.extend(data)

    def last(self, data: bytes) -> None:
        self.out.extend(data)
        self.close()

    def close(self) -> None:
        self.session.closed = True
        self.closed = True

    def reading(self, wanted: bool) -> None:
        self.reads = wanted

    def due(self, deadline: float) -> None:
        self.deadline = deadline

    def wake(self) -> None:
        self.woken += 1

    def start(self, job: JobAdmitted, replies: Replies) -> Running:
        started = Started(job.job, job.ticket, replies, self.state)
        self.started.append(started)
        return started

    def relay(
        self, method: str, path: str, body: bytes, done: Callable[[Relayed | BaseException], None]
    ) -> Cancel:
        raise AssertionError("no forwarding runner here")

    # state.Connection

    def abort_running(self, need_code: NeedCode, error_code: ErrorCode, detail: str) -> None:
        self.session.abort_running(need_code, error_code, detail)

    # The test's side

    def send(self, data: bytes) -> list[Response]:
        self.session.receive_data(data)
        return self.responses()

    def post(self, body: dict[str, Any], **headers: str) -> list[Response]:
        raw = orjson.dumps(body)
        fields = [("host", "x"), ("content-type", "application/json")]
        fields += [(k.replace("_", "-"), v) for k, v in headers.items()]
        fields.append(("content-length", str(len(raw))))
        head = h11.Connection(h11.CLIENT).send(
            h11.Request(method="POST", target=CHAT, headers=fields)
        )
        assert head is not None
        return self.send(head + raw)

    def responses(self) -> list[Response]:
        """The whole answers written so far (one still streaming stays for the next call)."""
        parser = self.parser
        if self.out:
            parser.receive_data(bytes(self.out))
            self.out.clear()
        done: list[Response] = []
        while True:
            if parser.our_state is h11.IDLE:  # (the parser reads an answer to a request it sent)
                parser.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
                parser.send(h11.EndOfMessage())
            event = parser.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                break
            if isinstance(event, h11.Response):
                headers = {k.decode(): v.decode() for k, v in event.headers}
                self.current = Response(event.status_code, headers)
            elif isinstance(event, h11.Data):
                self.current.body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                done.append(self.current)
                if parser.our_state is h11.DONE and parser.their_state is h11.DONE:
                    parser.start_next_cycle()
            else:  # ConnectionClosed
                break
        return done

    def expire(self) -> None:
        """What the link does at the session's deadline."""
        if self.deadline <= self.state.now() and not self.session.closed:
            self.session.expire(self.state.now())
            if not self.session.closed:
                self.session.schedule()

    def leave(self) -> None:
        self.session.connection_lost()
        self.state.connections.closed(self, self.session)


def chat(text: str = "hello", **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 4, **fields}


def ready() -> Verdict:
    return Verdict({"runner": Check(True, "ready")})


def make_door(state: ServerState, clock: FakeClock) -> tuple[FrontDoor, Timer]:
    timer = Timer(clock)
    return FrontDoor(state, "smol", None, ready, call_later=timer.call_later), timer


@pytest.fixture
def front(clock: FakeClock) -> tuple[ServerState, FrontDoor, Timer]:
    state = make_state(clock, cap=1)
    door, timer = make_door(state, clock)
    return state, door, timer


def drained(state: ServerState) -> tuple[int, int, int]:
    """Slots taken, payload bytes held, requests in line."""
    return state.inflight, state.connections.buffers.used, len(state.line)


def test_pipelined_requests_are_answered_in_order_and_the_connection_stays(
    front: tuple[ServerState, FrontDoor, Timer],
) -> None:
    state, door, _ = front
    client = Client(door, state)
    two = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n" + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    models, health = client.send(two)
    assert (models.status, models.json()["data"][0]["id"]) == (200, "smol")
    assert (health.status, health.json()["status"]) == (200, "ok")
    assert "connection" not in models.headers
    assert not client.closed
    assert client.deadline == pytest.approx(state.now() + state.config.idle_timeout)


def test_a_job_runs_while_a_slot_is_free_and_its_stream_ends_with_done(
    front: tuple[ServerState, FrontDoor, Timer],
) -> None:
    state, door, _ = front
    client = Client(door, state)
    assert client.post(chat(stream=True)) == []  # (its answer is the job's)
    (started,) = client.started
    assert started.job.startswith("http-")
    assert state.inflight == 1
    exchange = client.session.exchange
    assert exchange is not None
    exchange.send_delta(cast(Execution, started), Token("hi"))
    started.end()
    (answer,) = client.responses()
    assert (answer.status, answer.headers["content-type"]) == (200, "text/event-stream")
    events = [e for e in answer.body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    contents = [orjson.loads(e[6:])["choices"][0]["delta"] for e in events[:-1]]
    assert contents[:2] == [{"role": "assistant", "content": ""}, {"content": "hi"}]
    assert client.session.exchange is None
    assert drained(state) == (0, 0, 0)


def test_a_busy_job_is_429_and_its_retries_are_one_unserved_job(
    front: tuple[ServerState, FrontDoor, Timer],
) -> None:
    state, door, _ = front
    first, second = Client(door, state), Client(door, state)
    first.post(chat("first"))
    for _ in range(3):
        (refused,) = second.post(chat("second"), x_governor_max_wait_ms="0")
        assert refused.status == 429
        assert refused.json()["error"]["code"] == NeedCode.SERVER_BUSY
        assert int(refused.headers["retry-after-ms"]) > 0
    assert unserved(state) == (1, 0)
    assert door.places.count == 1
    first.started[0].end()
    assert second.post(chat("second"), x_governor_max_wait_ms="0") == []
    assert len(second.started) == 1
    assert (unserved(state), door.places.count) == ((1, 0), 0)
    second.started[0].end()
    assert drained(state) == (0, 0, 0)


def test_a_place_not_claimed_in_time_gives_up_on_the_doors_timer(
    front: tuple[ServerState, FrontDoor, Timer],
) -> None:
    state, door, timer = front
    first, second = Client(door, state), Client(door, state)
    first.post(chat("first"))
    (refused,) = second.post(chat("second"), x_governor_max_wait_ms="0")
    hint_s = int(refused.headers["retry-after-ms"]) / 1000
    timer.advance(hint_s)
    assert door.places.count == 1  # (kept its hint and upload_timeout more)
    timer.advance(state.config.upload_timeout + 0.05)
    assert (door.places.count, unserved(state)) == (0, (1, 1))


def test_a_job_waits_in_line_and_is_answered_when_a_slot_frees(
    front: tuple[ServerState, FrontDoor, Timer], clock: FakeClock
) -> None:
    state, door, _ = front
    first, second = Client(door, state), Client(door, state)
    first.post(chat("first"))
    assert second.post(chat("second"), x_governor_max_wait_ms="60000") == []
    exchange = second.session.exchange
    assert exchange is not None
    assert exchange.at_door
    assert second.deadline < float("inf")  # (decided again at its hint)
    assert (second.started, second.woken) == ([], 0)

    clock.now += 0.25
    first.started[0].end()  # a slot frees: the waiting request is decided, not yet answered
    assert (second.woken, second.started) == (1, [])
    second.session.answer_decided()  # (the link's next turn)
    (started,) = second.started
    started.end()
    (answer,) = second.responses()
    assert answer.status == 200
    assert int(answer.headers["x-governor-waited-ms"]) == 250
    assert drained(state) == (0, 0, 0)


def test_a_client_that_leaves_in_line_gives_up_its_place_and_a_decided_job_its_slot(
    front: tuple[ServerState, FrontDoor, Timer],
) -> None:
    state, door, _ = front
    first, second, third = Client(door, state), Client(door, state), Client(door, state)
    first.post(chat("first"))
    second.post(chat("second"), x_governor_max_wait_ms="60000")
    third.post(chat("third"), x_governor_max_wait_ms="60000")
    third.leave()  # in line: its place given up
    assert len(state.line) == 1
    first.started[0].end()  # the second is decided: admitted, but its client leaves first
    assert second.woken == 1
    second.leave()
    second.session.answer_decided()
    second.leave()
    assert second.started == []
    assert drained(state) == (0, 0, 0)


def test_a_request_that_does_not_arrive_in_time_is_408_and_closed(
    front: tuple[ServerState, FrontDoor, Timer], clock: FakeClock
) -> None:
    state, door, _ = front
    client = Client(door, state)
    assert client.send(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-len") == []
    clock.now += state.config.upload_timeout
    client.expire()
    (answer,) = client.responses()
    assert (answer.status, answer.json()["error"]["code"]) == (408, NeedCode.UPLOAD_TIMEOUT)
    assert client.closed
    client.leave()
    assert drained(state) == (0, 0, 0)


def test_an_idle_connection_closes_quietly_at_its_timeout(
    front: tuple[ServerState, FrontDoor, Timer], clock: FakeClock
) -> None:
    state, door, _ = front
    client = Client(door, state)
    clock.now += state.config.idle_timeout - 0.01
    client.expire()
    assert not client.closed
    clock.now += 0.01
    client.expire()
    assert client.closed
    assert client.out == b""


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        (b"GARBAGE\r\n\r\n", 400, NeedCode.SPEC_INVALID),
        (b"GET / HTTP/1.1\r\nhost: x\r\n" + b"x-pad: " + b"a" * 70_000, 431, None),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 99999999\r\n\r\n",
            413,
            None,
        ),
    ],
)
def test_a_request_h11_cannot_answer_is_refused_by_hand_and_closed(
    front: tuple[ServerState, FrontDoor, Timer], raw: bytes, status: int, code: str | None
) -> None:
    state, door, _ = front
    client = Client(door, state)
    (answer,) = client.send(raw)
    assert (answer.status, answer.headers["connection"]) == (status, "close")
    assert client.closed
    if code is not None:
        assert answer.json()["error"]["code"] == code
    client.leave()
    assert drained(state) == (0, 0, 0)


def test_a_bad_key_is_401_and_the_last_one_allowed_closes_the_connection(
    clock: FakeClock,
) -> None:
    state = keyed_state(clock, max_auth_failures=2)
    door, _ = make_door(state, clock)
    client = Client(door, state)
    (first,) = client.post(chat(), authorization="Bearer wrong-1")
    assert (first.status, first.headers["www-authenticate"]) == (401, "Bearer")
    assert "connection" not in first.headers
    (second,) = client.post(chat(), authorization="Bearer wrong-2")
    assert (second.status, second.headers["connection"]) == (401, "close")
    assert client.closed


# Generated interleavings ---------------------------------------------------------------


class Doors(RuleBasedStateMachine):
    """Clients post jobs (some wait in line), jobs end, time passes, the door's timer fires,
    clients leave and come: every request posted is answered once, or its client left; the
    cap holds throughout; once the clients are gone, nothing is left taken."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.state = make_state(self.clock, cap=1, max_wait=2.0)
        self.door, self.timer = make_door(self.state, self.clock)
        self.clients: list[Client] = []
        self.owed: dict[int, int] = {}  # requests unanswered, by client
        self.answered = 0

    def _live(self) -> list[Client]:
        return [c for c in self.clients if not c.closed]

    @initialize()
    def three_clients(self) -> None:
        self.clients += [Client(self.door, self.state) for _ in range(3)]

    @rule()
    def connect(self) -> None:
        if len(self.clients) < 6:
            self.clients.append(Client(self.door, self.state))

    @precondition(lambda self: self._live())
    @rule(which=st.integers(0, 3), text=st.sampled_from(["a", "b", "c"]), wait=st.booleans())
    def post(self, which: int, text: str, wait: bool) -> None:
        live = self._live()
        client = live[which % len(live)]
        if client.session.exchange is not None:
            return  # (one request at a time here: pipelining has its own tests)
        self.owed[id(client)] = self.owed.get(id(client), 0) + 1
        self._count(client, client.post(chat(text), x_governor_max_wait_ms="2000" if wait else "0"))

    @precondition(lambda self: any(c.started for c in self.clients))
    @rule(which=st.integers(0, 3))
    def end_a_job(self, which: int) -> None:
        running = [c for c in self.clients if c.started]
        client = running[which % len(running)]
        started = client.started.pop(0)
        if client.closed:  # (its execution saw the client go: the ticket comes back alone)
            started.release("cancelled")
        else:
            started.end()
            self._count(client, client.responses())

    @rule(seconds=st.sampled_from([0.01, 0.3, 1.0, 5.0]))
    def time_passes(self, seconds: float) -> None:
        self.timer.advance(seconds)
        for client in self._live():
            client.expire()
            self._count(client, client.responses())

    @precondition(lambda self: self._live())
    @rule(which=st.integers(0, 3))
    def leave(self, which: int) -> None:
        live = self._live()
        client = live[which % len(live)]
        client.closed = True
        client.leave()
        self.owed.pop(id(client), None)
        for started in client.started:
            assert started.terminal_sent  # told the client went

    @rule()
    def next_turn(self) -> None:
        """The loop's next turn: the answers decided between reads go out."""
        self._wake()

    @precondition(lambda self: self._live())
    @rule(which=st.integers(0, 3))
    def server_closes(self, which: int) -> None:
        """The server closes a connection (a drain's end, a client cut off): what was decided
        for it meanwhile is handed out before its transport reports it lost."""
        live = self._live()
        client = live[which % len(live)]
        client.session.close()
        self._wake()
        self.owed.pop(id(client), None)
        client.leave()

    def _wake(self) -> None:
        for client in self.clients:
            while client.woken:
                client.woken -= 1
                client.session.answer_decided()
                self._count(client, client.responses())

    def _count(self, client: Client, answers: list[Response]) -> None:
        for answer in answers:
            assert answer.status in (200, 429), answer
            self.owed[id(client)] -= 1
            assert self.owed[id(client)] >= 0, "two answers to one request"
            self.answered += 1

    @invariant()
    def the_cap_holds(self) -> None:
        assert 0 <= self.state.inflight <= 1

    @invariant()
    def each_unanswered_request_runs_or_waits(self) -> None:
        for client in self._live():
            exchange = client.session.exchange
            owed = self.owed.get(id(client), 0)
            assert owed == (exchange is not None), (owed, exchange)
            if exchange is not None:
                assert exchange.at_door or exchange.execution is not None or client.woken

    def teardown(self) -> None:
        self._wake()
        for client in self._live():
            client.closed = True
            client.leave()
        for client in self.clients:
            for started in client.started:
                started.release("cancelled")
        self.timer.advance(3600)
        assert drained(self.state) == (0, 0, 0)
        jobs, gave_up = unserved(self.state)
        assert self.door.places.count == 0
        assert gave_up <= jobs


def test_any_interleaving_answers_each_request_once_and_leaves_nothing_taken() -> None:
    run = Doors.TestCase
    run.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
    run().runTest()


def test_a_job_decided_for_a_connection_the_server_closed_meanwhile_gives_its_slot_back(
    front: tuple[ServerState, FrontDoor, Timer],
) -> None:
    state, door, _ = front
    first, second = Client(door, state), Client(door, state)
    first.post(chat("first"))
    second.post(chat("second"), x_governor_max_wait_ms="60000")
    first.started[0].end()  # the second is admitted between reads
    assert (second.woken, state.inflight) == (1, 1)
    second.session.close()  # (the server closes it before the loop's next turn)
    second.session.answer_decided()
    second.leave()
    assert second.started == []
    assert drained(state) == (0, 0, 0)
