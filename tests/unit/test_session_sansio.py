"""The TCP session with no IO, as h11's tests drive ``h11.Connection``: bytes in, reply frames
and events out, on a fake clock; no event loop, no socket, no task. An admitted job comes out of
``next_event`` and is "started" here with a stand-in for its execution."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from governor.config import Config
from governor.core.admission import Admission, Pool, Ticket
from governor.core.ledger import DRAINING_HINT_MS, SlotLedger
from governor.core.tenants import Tenants
from governor.execution import Ending
from governor.intake import JobAdmitted
from governor.listeners.jobs import Phase
from governor.listeners.session import Session
from governor.listeners.wire import yield_detail
from governor.runners import StubRunner, Token
from governor.server import build_breaker
from governor.state import ServerState
from protocol.codes import ErrorCode, NeedCode, Receipt, Status, Verb
from protocol.errors import EnvelopeInvalid
from protocol.frames import Reply, decode_reply, decode_request, encode_request
from protocol.upload import split_payload
from tests.clock import FakeClock

PAYLOAD = b"twelve bytes"


def make_state(clock: FakeClock, cap: int = 1, **settings: Any) -> ServerState:
    with pytest.raises(RuntimeError):  # (no event loop runs these tests)
        asyncio.get_running_loop()
    config = Config(max_inflight=cap, **settings)
    ledger = SlotLedger(cap, expected_service_s=1.0, clock=clock)
    pool = Pool("primary", StubRunner(0.0), ledger, build_breaker(config, ledger, "primary"))
    return ServerState(config, Admission(pool, Tenants((), clock)))


@dataclass
class Started:
    """What the session needs of a running job's execution, for a test that runs nothing."""

    job: str
    ticket: Ticket
    terminal_sent: bool = False
    aborted: str | None = None  # the need code it was aborted with

    def client_gone(self) -> None:
        self.terminal_sent = True

    def abort(self, need_code: NeedCode, error_code: ErrorCode, detail: str) -> None:
        self.aborted = need_code


class Client:
    """One connection's session, its replies decoded as they are written."""

    def __init__(self, state: ServerState) -> None:
        self.out = bytearray()
        self.closed = False
        self.woken = 0  # times the session woke its listener between reads
        self.session = Session(state, self, conn_id=1)

    # The session's connection (session.Connection)

    def write(self, data: bytes) -> None:
        self.out.extend(data)

    def close(self) -> None:
        self.closed = True

    def wake(self) -> None:
        self.woken += 1

    def send(self, data: bytes) -> list[Reply]:
        self.session.receive_data(data)
        return self.replies()

    def replies(self) -> list[Reply]:
        lines = bytes(self.out).splitlines()
        self.out.clear()
        return [decode_reply(line) for line in lines]

    def start(self, admitted: JobAdmitted) -> Started:
        """What the listener does with the event: start the job, hand it back."""
        started = Started(admitted.job, admitted.ticket)
        self.session.started(started)
        return started


def upload(job: str, payload: bytes, *, seq: int = 1, chunk_bytes: int = 8192) -> list[bytes]:
    """A manifest frame and its chunks' frames, seq numbered from ``seq``."""
    prepared = split_payload(payload, chunk_bytes=chunk_bytes)
    frames = [encode_request(Verb.SHARE, job, seq, ttl_ms=5000, manifest=prepared.manifest)]
    frames += [
        encode_request(Verb.SHARE, job, seq + 1 + i, ttl_ms=5000, chunk=chunk)
        for i, chunk in enumerate(prepared.chunks)
    ]
    return frames


def receipts(reply: Reply) -> dict[str, int]:
    return dict(reply.receipts)


def test_an_admitted_job_is_an_event_and_the_lines_behind_it_wait_until_it_started(
    clock: FakeClock,
) -> None:
    state = make_state(clock)
    client = Client(state)
    manifest, chunk = upload("J_1", PAYLOAD)
    ping = encode_request(Verb.PING, "P_1", 7)

    (ok,) = client.send(manifest)
    assert (ok.verb, ok.status, ok.job, ok.seq) == (Verb.CLARIFY, Status.OK, "J_1", 2)
    assert client.session.next_event() is None

    assert client.send(chunk + ping) == []  # (the ping waits behind the admitted job)
    admitted = client.session.next_event()
    assert admitted is not None
    assert (admitted.job, admitted.ttl_ms, admitted.waited_s) == ("J_1", 5000, None)
    assert admitted.ticket.reservation is not None  # the payload's bytes go with the ticket
    assert state.inflight == 1

    started = client.start(admitted)
    assert client.session.next_event() is None
    (pong,) = client.send(b"")
    assert (pong.job, pong.seq, pong.status) == ("P_1", 8, Status.OK)

    client.session.table.replies.send_delta(started, Token("stub "))
    client.session.table.replies.send_terminal(started, Ending(result={"ok": 1}))
    delta, done = client.replies()
    assert (delta.status, delta.seq, delta.delta) == (Status.OK, 4, "stub ")  # final chunk + 2
    assert (done.verb, done.status, done.seq, done.result) == (
        Verb.CONFIRM,
        Status.DONE,
        4,
        {"ok": 1},
    )
    admitted.ticket.release("done")
    client.session.table.replies.job_ended(started)
    assert client.session.jobs == {}
    assert (
        state.inflight,
        client.session.table.retries.buffers.used,
        state.connections.buffers.used,
    ) == (
        0,
        0,
        0,
    )


def test_a_job_yields_when_every_slot_is_taken_and_its_held_payload_is_admitted_later(
    clock: FakeClock,
) -> None:
    state = make_state(clock, cap=1)
    first, second = Client(state), Client(state)
    for frame in upload("J_1", PAYLOAD):
        first.send(frame)
    admitted = first.session.next_event()
    assert admitted is not None
    started = first.start(admitted)

    manifest, chunk = upload("J_2", PAYLOAD)
    second.send(manifest)
    (refused,) = second.send(chunk)
    assert (refused.verb, refused.status, refused.seq) == (Verb.CLARIFY, Status.YIELD, 4)
    assert (refused.need_code, refused.error_code) == (NeedCode.SERVER_BUSY, ErrorCode.BUSY)
    assert refused.retry_hint_ms is not None
    assert refused.retry_hint_ms > 0
    assert receipts(refused)[Receipt.PAYLOAD_HELD] == 1
    assert second.session.next_event() is None
    assert second.session.table.retries.held == 1

    admitted.ticket.release("done")
    first.session.table.replies.job_ended(started)
    clock.now += refused.retry_hint_ms / 1000
    assert second.send(chunk) == []  # the final chunk again: the held payload's retry
    retried = second.session.next_event()
    assert retried is not None
    assert retried.job == "J_2"
    assert retried.waited_s == pytest.approx(refused.retry_hint_ms / 1000)
    assert second.session.table.retries.held == 0


def test_a_draining_yield_says_so_and_sends_the_job_elsewhere_soon(clock: FakeClock) -> None:
    state = make_state(clock, cap=2)  # (free slots: only the drain refuses)
    state.ledger.draining = True
    client = Client(state)
    *frames, final = upload("J_1", PAYLOAD)
    for frame in frames:
        client.send(frame)
    (refused,) = client.send(final)
    assert (refused.status, refused.need_code) == (Status.YIELD, NeedCode.DRAINING)
    assert refused.error_code == ErrorCode.UNAVAILABLE
    # The hint is how soon to go to another replica, the same as the front door's 503 says:
    # neither "come back here in a minute" nor "no slot free".
    assert refused.retry_hint_ms == receipts(refused)[Receipt.RETRY_HINT_MS] == DRAINING_HINT_MS
    assert refused.detail == yield_detail(NeedCode.DRAINING, held=False)
    assert "this replica is draining" in refused.detail
    assert "another replica" in refused.detail
    assert "slot" not in refused.detail
    assert receipts(refused)[Receipt.PAYLOAD_HELD] == 0  # (never admitted here again)
    assert client.session.table.retries.held == 0


@pytest.mark.parametrize("draining", [False, True])
def test_a_chunk_the_full_buffers_cannot_take_is_told_draining_during_a_drain(
    clock: FakeClock, draining: bool
) -> None:
    """A payload held from before a drain still fills the server's buffers. A chunk they have no
    room for is refused ``buffers_full``, but during a drain ``draining``: no retry here would be
    admitted (the answer the client would get next)."""
    state = make_state(clock, cap=1, max_buffer_bytes=2 * len(PAYLOAD))
    first, second, third = Client(state), Client(state), Client(state)
    for frame in upload("J_1", PAYLOAD):  # runs: its payload's bytes stay counted
        first.send(frame)
    admitted = first.session.next_event()
    assert admitted is not None
    first.start(admitted)
    manifest, chunk = upload("J_3", PAYLOAD)
    assert [r.status for r in third.send(manifest)] == [Status.OK]  # (room for it then)
    for frame in upload("J_2", PAYLOAD):
        (answer,) = second.send(frame)
    assert (answer.need_code, receipts(answer)[Receipt.PAYLOAD_HELD]) == (NeedCode.SERVER_BUSY, 1)
    state.ledger.draining = draining
    (refused,) = third.send(chunk)
    assert refused.status == Status.YIELD
    assert receipts(refused)[Receipt.PAYLOAD_HELD] == 0
    if draining:
        assert (refused.need_code, refused.error_code) == (NeedCode.DRAINING, ErrorCode.UNAVAILABLE)
        assert refused.retry_hint_ms == DRAINING_HINT_MS
        assert refused.detail == yield_detail(NeedCode.DRAINING, held=False)
    else:
        assert (refused.need_code, refused.error_code) == (NeedCode.BUFFERS_FULL, ErrorCode.BUSY)
    assert "J_3" not in third.session.jobs  # dropped either way: its bytes given back
    assert state.connections.buffers.used == 2 * len(PAYLOAD)


def test_a_cancel_read_with_the_final_chunk_finds_the_job_running(clock: FakeClock) -> None:
    client = Client(make_state(clock))
    manifest, chunk = upload("J_1", PAYLOAD)
    client.send(manifest)
    assert client.send(chunk + encode_request(Verb.CANCEL, "J_1", 3)) == []
    admitted = client.session.next_event()
    assert admitted is not None
    started = client.start(admitted)
    assert client.send(b"") == []  # (its execution's terminal abort is the cancel's answer)
    assert started.aborted == NeedCode.CANCELLED


def test_a_job_admitted_and_never_started_is_given_back_when_its_client_leaves(
    clock: FakeClock,
) -> None:
    state = make_state(clock)
    client = Client(state)
    manifest, chunk = upload("J_1", PAYLOAD)
    client.send(manifest + chunk)
    assert client.session.next_event() is not None
    assert (state.inflight, state.connections.buffers.used) == (1, len(PAYLOAD))
    client.session.connection_lost()
    assert client.session.next_event() is None
    assert client.session.jobs == {}
    assert (
        state.inflight,
        state.connections.buffers.used,
        client.session.table.retries.buffers.used,
    ) == (
        0,
        0,
        0,
    )


def test_a_bad_line_is_answered_with_its_code_and_the_connection_goes_on(
    clock: FakeClock,
) -> None:
    state = make_state(clock)
    client = Client(state)
    client.send(encode_request(Verb.PING, "P_1", 3))
    (bad,) = client.send(b"GET / HTTP/1.1\r\n")
    assert (bad.verb, bad.status) == (Verb.CLARIFY, Status.NEED)
    assert bad.need_code == NeedCode.HTTP_REQUEST
    assert (bad.job, bad.seq) == ("P_1", 4)  # the last valid frame's job and seq + 1
    assert state.metrics.bad_frames[NeedCode.HTTP_REQUEST] == 1
    (pong,) = client.send(encode_request(Verb.PING, "P_2", 5))
    assert pong.status == Status.OK
    assert not client.closed


def test_each_chunk_and_the_whole_payload_are_checked_against_their_sha256(
    clock: FakeClock,
) -> None:
    client = Client(make_state(clock))
    manifest, *chunks = upload("J_1", PAYLOAD, chunk_bytes=5)
    assert len(chunks) == 3
    client.send(manifest)

    forged: dict[str, Any] = dict(decode_chunk(chunks[0]), sha256="0" * 64)
    (mismatch,) = client.send(encode_request(Verb.SHARE, "J_1", 2, chunk=forged))
    assert (mismatch.status, mismatch.need_code) == (Status.NEED, NeedCode.CHUNK_HASH_MISMATCH)

    for chunk in chunks[:2]:
        (ok,) = client.send(chunk)
        assert ok.status == Status.OK
    assert client.session.jobs["J_1"].upload.bytes_received == 10
    assert client.send(chunks[2]) == []
    assert client.session.next_event() is not None

    other = Client(make_state(FakeClock()))
    wrong = split_payload(PAYLOAD, chunk_bytes=5).manifest | {"sha256": "f" * 64}
    other.send(encode_request(Verb.SHARE, "J_9", 1, manifest=wrong))
    _, *chunks = upload("J_9", PAYLOAD, chunk_bytes=5)
    answers = [other.send(chunk)[0] for chunk in chunks]
    assert [a.status for a in answers] == [Status.OK, Status.OK, Status.NEED]
    assert answers[-1].need_code == NeedCode.PAYLOAD_HASH_MISMATCH
    assert other.session.next_event() is None


def test_a_stalled_upload_is_dropped_at_its_deadline_on_the_fake_clock(
    clock: FakeClock,
) -> None:
    state = make_state(clock)
    client = Client(state)
    manifest, _ = upload("J_1", PAYLOAD)
    client.send(manifest)
    deadline = clock.now + state.config.upload_timeout
    assert client.session.next_deadline(clock.now) == deadline
    assert state.connections.buffers.used == 0
    assert client.session.table.retries.buffers.used == len(PAYLOAD)

    clock.now = deadline - 0.001
    client.session.expire(clock.now)
    assert client.replies() == []

    clock.now = deadline
    client.session.expire(clock.now)
    (dropped,) = client.replies()
    assert (dropped.verb, dropped.status, dropped.job) == (Verb.CONFIRM, Status.ABORT, "J_1")
    assert (dropped.need_code, dropped.error_code) == (NeedCode.UPLOAD_TIMEOUT, ErrorCode.TIMEOUT)
    assert client.session.jobs == {}
    assert client.session.table.retries.buffers.used == 0
    assert state.metrics.aborts[NeedCode.UPLOAD_TIMEOUT] == 1
    assert not client.closed


def decode_chunk(frame: bytes) -> dict[str, Any]:
    chunk = orjson.loads(frame)["payload_chunk"]
    assert isinstance(chunk, dict)
    return chunk


# A job that asks to wait for its turn (max_wait_ms) ---------------------------------------------


def waiting_job(job: str, max_wait_ms: int | None, data: str = "hello") -> bytes:
    digest = hashlib.sha256(data.encode()).hexdigest()
    inline = {"sha256": digest, "data": data}
    return encode_request(Verb.SHARE, job, 1, ttl_ms=0, inline=inline, max_wait_ms=max_wait_ms)


def running(state: ServerState) -> tuple[Client, Started, JobAdmitted]:
    """A client whose job holds the one slot."""
    client = Client(state)
    client.send(waiting_job("J_run", None))
    admitted = client.session.next_event()
    assert admitted is not None
    return client, client.start(admitted), admitted


def end(client: Client, started: Started, admitted: JobAdmitted, state: ServerState) -> None:
    """The running job ends: its ticket back, and the line offered the slot (as job_ended)."""
    admitted.ticket.release("done")
    client.session.table.replies.job_ended(started)
    state.offer()


def test_a_job_that_asks_to_wait_runs_when_the_slot_frees_unanswered_meanwhile(
    clock: FakeClock,
) -> None:
    state = make_state(clock, cap=1)
    first, started, admitted = running(state)
    second = Client(state)
    assert second.send(waiting_job("J_2", 5000)) == []  # no yield: it waits
    assert second.session.jobs["J_2"].phase is Phase.WAITING
    assert len(state.line) == 1
    assert second.session.next_event() is None
    assert state.connections.buffers.used == 2 * len("hello")  # (its payload stays counted)

    clock.now += 0.25
    end(first, started, admitted, state)
    assert second.woken == 1  # the listener is told: it takes the event and starts the job
    event = second.session.next_event()
    assert event is not None
    assert event.job == "J_2"
    assert event.waited_s == pytest.approx(0.25)
    done = second.start(event)
    second.session.table.replies.send_terminal(done, Ending(result={"ok": 1}))
    (answer,) = second.replies()
    assert (answer.status, answer.seq) == (Status.DONE, 2)  # the one answer to its frame
    assert len(state.line) == 0
    assert state.metrics.door_waits[("-", "admitted")] == 1
    assert sum(state.metrics.door_wait.by_lane["-"].counts) == 1


def test_a_waiting_job_is_decided_again_at_its_hint_and_yields_once_its_turn_passes_its_budget(
    clock: FakeClock,
) -> None:
    state = make_state(clock, cap=1)
    running(state)  # (never ends)
    client = Client(state)
    arrived = clock.now
    client.send(waiting_job("J_2", 1500))
    answers: list[Reply] = []
    for _ in range(100):  # decided again at each deadline, until the budget is passed
        assert client.session.jobs["J_2"].phase is Phase.WAITING
        clock.now = client.session.next_deadline(clock.now)
        client.session.expire(clock.now)
        answers = client.replies()
        if answers:
            break
    (refused,) = answers
    assert (refused.status, refused.need_code) == (Status.YIELD, NeedCode.SERVER_BUSY)
    assert refused.retry_hint_ms is not None
    assert clock.now - arrived <= 1.5  # it waited within its budget, never past it
    assert clock.now - arrived + refused.retry_hint_ms / 1000 > 1.5  # and yielded then
    assert receipts(refused)[Receipt.PAYLOAD_HELD] == 1  # kept for the retry, as any yield's
    assert client.session.jobs["J_2"].phase is Phase.HELD
    assert len(state.line) == 0
    assert state.metrics.door_waits[("-", "refused")] == 1
    assert not client.closed


def test_without_the_field_or_with_no_budget_a_busy_job_yields_at_once(clock: FakeClock) -> None:
    state = make_state(clock, cap=1)
    running(state)
    client = Client(state)
    (plain,) = client.send(waiting_job("J_2", None))
    (no_budget,) = client.send(waiting_job("J_3", 0))
    for refused in (plain, no_budget):
        assert (refused.status, refused.need_code) == (Status.YIELD, NeedCode.SERVER_BUSY)
    assert len(state.line) == 0
    assert state.metrics.not_waited["beyond_budget"] == 1  # (only the one that asked)


def test_a_turn_predicted_past_the_budget_is_refused_at_once(clock: FakeClock) -> None:
    state = make_state(clock, cap=1)
    running(state)
    client = Client(state)
    (refused,) = client.send(waiting_job("J_2", 10))  # its turn is about a second away
    assert refused.status == Status.YIELD
    assert len(state.line) == 0
    assert state.metrics.not_waited["beyond_budget"] == 1


@pytest.mark.parametrize("how", ["cancel", "leave", "new payload"])
def test_a_waiting_job_whose_client_cancels_leaves_or_replaces_it_gives_its_place_up(
    clock: FakeClock, how: str
) -> None:
    state = make_state(clock, cap=1)
    first, started, admitted = running(state)
    client, behind = Client(state), Client(state)
    client.send(waiting_job("J_2", 5000))
    behind.send(waiting_job("J_3", 5000))
    assert len(state.line) == 2
    if how == "cancel":
        (answer,) = client.send(encode_request(Verb.CANCEL, "J_2", 2))
        assert (answer.status, answer.need_code) == (Status.ABORT, NeedCode.CANCELLED)
        assert answer.seq == 2  # it answers the job's frame, as a running job's abort would
        assert "J_2" not in client.session.jobs
    elif how == "leave":
        client.session.connection_lost()
    else:  # a new manifest for the same job id: the waiting payload is dropped for it
        manifest, _ = upload("J_2", PAYLOAD, seq=2)
        (ok,) = client.send(manifest)
        assert ok.status == Status.OK
        assert client.session.jobs["J_2"].phase is Phase.UPLOADING
    assert len(state.line) == 1
    assert state.metrics.door_waits[("-", "left")] == 1
    end(first, started, admitted, state)  # the slot goes to the one still waiting
    event = behind.session.next_event()
    assert event is not None
    assert event.job == "J_3"
    assert client.session.next_event() is None
    assert sum(t.waiting for t in state.tenants.all()) == 0


def test_a_drain_answers_the_waiting_jobs_at_once_and_keeps_nothing(clock: FakeClock) -> None:
    state = make_state(clock, cap=1)
    running(state)
    client = Client(state)
    client.send(waiting_job("J_2", 5000))
    state.ledger.draining = True
    state.offer()  # (what a drain's start does)
    (refused,) = client.replies()
    assert (refused.status, refused.need_code) == (Status.YIELD, NeedCode.DRAINING)
    assert receipts(refused)[Receipt.PAYLOAD_HELD] == 0
    assert client.session.jobs == {}
    assert len(state.line) == 0
    assert state.metrics.door_waits[("-", "unavailable")] == 1


def test_a_connection_whose_job_waits_is_not_idle(clock: FakeClock) -> None:
    state = make_state(clock, cap=1, idle_timeout=0.5)
    running(state)
    client = Client(state)
    client.send(waiting_job("J_2", 5000))
    clock.now += 0.6  # past the idle timeout, before the job's next decision
    client.session.expire(clock.now)
    assert not client.closed
    assert client.replies() == []


def test_a_connection_holding_a_payload_for_a_retry_outlives_the_idle_timeout(
    clock: FakeClock,
) -> None:
    """A refused job's payload held for its client's retry: the connection is not closed for
    idleness before the hold's own deadline (its hint and upload_timeout), so a client told
    to come back later than idle_timeout finds its payload; once the hold has lapsed, the idle
    connection is closed."""
    state = make_state(clock, cap=1, idle_timeout=0.5, upload_timeout=1.0)
    running(state)
    client = Client(state)
    (refused,) = client.send(waiting_job("J_2", 0))
    assert refused.status == Status.YIELD
    assert receipts(refused)[Receipt.PAYLOAD_HELD] == 1
    hold_ends = clock.now + (refused.retry_hint_ms or 0) / 1000 + 1.0
    clock.now += 0.6  # past the idle timeout, the payload still held
    client.session.expire(clock.now)
    assert not client.closed
    assert client.replies() == []
    clock.now = max(hold_ends, clock.now) + 0.01
    client.session.expire(clock.now)
    (dropped,) = client.replies()
    assert (dropped.job, dropped.need_code) == ("J_2", NeedCode.UPLOAD_TIMEOUT)
    client.session.expire(clock.now)  # (nothing held, nothing running, no frame for long)
    assert client.closed


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"max_wait_ms": -1}, "'max_wait_ms' must be an integer"),
        ({"max_wait_ms": True}, "'max_wait_ms' must be an integer"),
        ({"max_wait_ms": 86_400_001}, "'max_wait_ms' must be an integer"),
        ({"verb": "ping", "max_wait_ms": 5}, "a ping carries no 'max_wait_ms'"),
        ({"fleet_wide": 1}, "'fleet_wide' must be true or false"),
        ({"fleet_wide": "yes"}, "'fleet_wide' must be true or false"),
        ({"verb": "ping", "fleet_wide": True}, "a ping carries no 'fleet_wide'"),
    ],
)
def test_a_bad_wait_or_fleet_wide_is_a_bad_envelope(extra: dict[str, Any], why: str) -> None:
    frame = orjson.loads(waiting_job("J_1", None)) | extra
    if frame["verb"] == "ping":
        del frame["payload_inline"]
    with pytest.raises(EnvelopeInvalid, match=why):
        decode_request(orjson.dumps(frame))
