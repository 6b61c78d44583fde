"""Trusted neighbours: what one client does to an address must not lock out the others of it.

A sidecar's clients all come from 127.0.0.1, a NAT's or a proxy's from one address. Each attack
here runs from the address its victims share, over real sockets on both listeners: wrong keys
(the failer's connection is closed, its neighbours' keys are checked at once while the source's
burst lasts, then at its turn, never refused), a flood of connections that only ping (a new
connection displaces the oldest idle one, so a client that comes to work gets in), and a burst
from one machine (loopback is trusted: no per-source limit). Then the pure rules, for every
sequence hypothesis finds: the counts, who may be displaced, and the pace of failed keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from governor.core.sources import NOW, Displaced, Refused, Sources, Turn, parse_networks, source_of
from governor.core.tenants import TenantConfig
from tests.conftest import RawConn, ServerFactory, wait_until

from .test_frontdoor_hostile import BODY, Dial, front, http_connections, post
from .test_frontdoor_hostile import dial as dial  # (the fixture)
from .test_server import ping

KEY, OTHER_KEY = "k-search", "k-batch"
TENANTS = (
    TenantConfig(name="search", key_sha256=hashlib.sha256(KEY.encode()).hexdigest()),
    TenantConfig(name="batch", key_sha256=hashlib.sha256(OTHER_KEY.encode()).hexdigest()),
)


def inline(job: str, data: str = "a chat", *, api_key: str | None = None) -> dict[str, Any]:
    frame: dict[str, Any] = {
        "v": 0,
        "verb": "share",
        "job": job,
        "seq": 1,
        "ttl_ms": 0,
        "payload_inline": {"data": data, "sha256": hashlib.sha256(data.encode()).hexdigest()},
    }
    if api_key is not None:
        frame["api_key"] = api_key
    return frame


# Wrong keys --------------------------------------------------------------------------------


async def test_four_wrong_keys_from_one_client_cost_its_neighbours_nothing(
    make_server: ServerFactory,
) -> None:
    """Tenants declared, lanes on: one connection sends four jobs with a wrong key in one
    write. The valid tenants' jobs from the same address right after, and key-less pings, are
    answered at once: no turn waited for, no connection refused."""
    server = await make_server(tenants=TENANTS, lanes=True, stub_ms=20)
    wrong = await RawConn.open(server)
    wrong.send_raw(
        b"".join(orjson.dumps(inline(f"J_{i}", api_key="k-typo")) + b"\n" for i in range(4))
    )
    answers = [await wrong.recv() for _ in range(3)]
    assert [a["need_code"] for a in answers] == ["unauthorized"] * 3
    await wrong.recv_eof()
    await wrong.close()
    neighbours = [await RawConn.open(server) for _ in range(3)]
    try:
        for i, (conn, key) in enumerate(zip(neighbours, (KEY, OTHER_KEY, None), strict=True)):
            conn.send(inline(f"J_n{i}", api_key=key) if key else ping())
        replies = [await conn.recv(timeout=2) for conn in neighbours]
        assert [r["status"] for r in replies] == ["done", "done", "ok"]
        assert (
            server.state.connections.sources.waiting == 0
        )  # the burst is not spent: nothing waited
    finally:
        for conn in neighbours:
            await conn.close()


async def test_a_client_retrying_its_wrong_key_spends_nothing_of_its_neighbours(
    make_server: ServerFactory, dial: Dial
) -> None:
    """A misconfigured client sends its one wrong key again and again, on new connections, on
    both listeners, far past the burst: the key is refused at once each time, unchecked, so
    the budget is never spent and a neighbour's valid key is checked at once."""
    server = await front(make_server, tenants=TENANTS, auth_guess_burst=2, stub_ms=20)
    for round_ in range(6):
        conn = await RawConn.open(server)
        for i in range(3):
            conn.send(inline(f"J_{round_}_{i}", api_key="k-typo"))
        assert [(await conn.recv())["need_code"] for _ in range(3)] == ["unauthorized"] * 3
        await conn.close()
        http = await dial(server)
        http.send(post(BODY, "Authorization: Bearer k-typo"))
        assert (await http.answer()).status == 401
        http.abort()
    assert server.state.connections.sources.waiting == 0
    neighbour = await RawConn.open(server)
    neighbour.send(inline("J_n", api_key=KEY))
    assert (await neighbour.recv())["status"] == "done"
    await neighbour.close()


async def test_a_reconnecting_guesser_leaves_a_valid_key_beside_it_served(
    make_server: ServerFactory,
) -> None:
    """A guesser on the same address, reconnecting as fast as it is closed: a valid key shown
    on a new connection meanwhile is checked at its turn and served, on both listeners."""
    server = await front(
        make_server, tenants=TENANTS, auth_guess_burst=2, auth_guess_rate=5.0, stub_ms=20
    )
    stop = asyncio.Event()
    guessed = 0

    async def guess() -> None:
        nonlocal guessed
        while not stop.is_set():
            conn = await RawConn.open(server)
            with contextlib.suppress(AssertionError, TimeoutError, ConnectionError):
                for i in range(3):
                    conn.send(inline(f"J_g{guessed}", api_key=f"guess-{guessed}-{i}"))
                    await conn.recv()
                    guessed += 1
            await conn.close()

    guesser = asyncio.create_task(guess())
    try:
        await wait_until(lambda: server.state.connections.sources.waiting == 1)
        keyed = await RawConn.open(server)
        keyed.send(inline("J_ok", api_key=KEY))
        assert (await keyed.recv())["status"] == "done"
        await keyed.close()
        address = server.http_address
        assert address is not None
        reader, writer = await asyncio.open_connection(*address)
        writer.write(post(BODY, f"Authorization: Bearer {KEY}"))
        status = await asyncio.wait_for(reader.readline(), 5)
        assert status.startswith(b"HTTP/1.1 200"), status
        writer.close()
    finally:
        stop.set()
        await guesser
    assert guessed >= 2


# A flood of connections --------------------------------------------------------------------


async def test_a_flood_of_pinging_connections_cannot_keep_a_keyed_client_out(
    make_server: ServerFactory,
) -> None:
    """max_connections pinging connections from 127.0.0.1, reconnecting when displaced: a
    client with a valid key from the same address connects and gets its job done; each
    displaced connection was told why before the close."""
    limit = 128
    server = await make_server(tenants=TENANTS, max_connections=limit, stub_ms=20)
    flood = [await RawConn.open(server) for _ in range(limit)]
    for conn in flood:
        conn.send(ping())
    for conn in flood:
        assert (await conn.recv())["status"] == "ok"
    assert len(server.connections) == limit
    stop = asyncio.Event()
    displaced: list[dict[str, Any]] = []

    async def flooding(conn: RawConn) -> None:  # pings; when displaced, reconnects
        while not stop.is_set():
            conn.send(ping())
            try:
                reply = await conn.recv()
            except (AssertionError, ConnectionError):
                await conn.close()
                conn = await RawConn.open(server)
                continue
            if reply["status"] == "abort":
                displaced.append(reply)
                await conn.close()
                conn = await RawConn.open(server)
            else:
                await asyncio.sleep(0.05)
        await conn.close()

    tasks = [asyncio.create_task(flooding(conn)) for conn in flood]
    try:
        for i in range(3):
            keyed = await RawConn.open(server)
            keyed.send(inline(f"J_k{i}", api_key=KEY))
            reply = await keyed.recv(timeout=2)
            assert reply["status"] == "done", reply
            await keyed.close()
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    assert displaced  # (a client writing as it is displaced may read a reset instead)
    assert {(d["need_code"], d["error_code"]) for d in displaced} == {("displaced", "quota")}
    assert server.state.connections.displaced >= len(displaced)
    await wait_until(lambda: not server.connections)
    assert server.state.connections.sources.open_by_source == {}


async def test_work_in_flight_and_a_shown_key_are_never_displaced(
    make_server: ServerFactory,
) -> None:
    """At the limit: a connection running a job, one holding a payload after a yield, one that
    showed a key are kept; the idle one that showed nothing goes first, the oldest of them
    first; with none left idle, the newcomer is refused."""
    server = await make_server(tenants=TENANTS, max_connections=5, max_inflight=1, stub_ms=3000)
    running, held, keyed, idle_old, idle_new = [await RawConn.open(server) for _ in range(5)]
    running.send(inline("J_run", api_key=KEY))
    await wait_until(lambda: server.inflight == 1)
    held.send(inline("J_held", api_key=KEY))  # yields; its payload is kept for the retry
    assert (await held.recv())["status"] == "yield"
    keyed.send({**ping(), "api_key": OTHER_KEY})
    idle_old.send(ping())
    idle_new.send(ping())
    for conn in (keyed, idle_old, idle_new):
        assert (await conn.recv())["status"] == "ok"
    first = await RawConn.open(server)
    assert (await idle_old.recv())["need_code"] == "displaced"
    await idle_old.recv_eof()
    second = await RawConn.open(server)
    assert (await idle_new.recv())["need_code"] == "displaced"
    third = await RawConn.open(server)
    assert (await first.recv())["need_code"] == "displaced"
    fourth = await RawConn.open(server)
    assert (await second.recv())["need_code"] == "displaced"
    for conn in (running, held, keyed, third):
        conn.send(ping())
        assert (await conn.recv())["status"] == "ok"  # (third: a ping is not work)
    third.send(inline("J_third", api_key=KEY))  # work now: held in line after a yield
    assert (await third.recv())["status"] == "yield"
    fourth.send({**ping(), "api_key": KEY})  # a key shown: none idle now
    assert (await fourth.recv())["status"] == "ok"
    refused = await RawConn.open(server)
    assert (await refused.recv())["need_code"] == "too_many_connections"
    for conn in (running, held, keyed, idle_old, idle_new, first, second, third, fourth, refused):
        await conn.close()


async def test_the_front_door_displaces_an_idle_connection_with_a_503(
    make_server: ServerFactory, dial: Dial
) -> None:
    """At the limit, the front door's oldest connection between requests that showed no key
    gets an unasked 503 ``displaced`` and is closed; one with a request arriving is kept."""
    server = await front(make_server, tenants=TENANTS, max_connections=3)
    arriving, idle_one = await dial(server), await dial(server)
    arriving.send(post(BODY, f"Authorization: Bearer {KEY}")[:30])
    await wait_until(lambda: sum(c.session.arriving for c in http_connections(server)) == 1)
    tcp = await RawConn.open(server)
    tcp.send({**ping(), "api_key": KEY})
    assert (await tcp.recv())["status"] == "ok"
    newcomer = await dial(server)
    answer = await idle_one.answer()
    assert (answer.status, answer.code, answer.headers["connection"]) == (503, "displaced", "close")
    await idle_one.closed()
    arriving.send(post(BODY, f"Authorization: Bearer {KEY}")[30:])
    assert (await arriving.answer()).status == 200
    newcomer.send(post(BODY, f"Authorization: Bearer {KEY}"))
    assert (await newcomer.answer()).status == 200
    await tcp.close()


# A burst from one machine ------------------------------------------------------------------


async def test_a_burst_from_loopback_is_not_held_to_the_per_source_limit(
    make_server: ServerFactory,
) -> None:
    """A trusted address (loopback by default; here 127.0.0.1 alone): more connections than
    max_connections_per_source from it are all served; an untrusted one is still held to the
    limit (its own oldest idle connection displaced)."""
    server = await make_server(max_connections_per_source=16, trusted_sources="127.0.0.1")
    burst = [await RawConn.open(server) for _ in range(40)]
    for conn in burst:
        conn.send(ping())
    assert [(await conn.recv())["status"] for conn in burst] == ["ok"] * 40
    others = [await RawConn.open(server, source="127.0.0.2") for _ in range(17)]
    assert (await others[0].recv())["need_code"] == "displaced"
    assert server.state.connections.sources.open_by_source["127.0.0.2"] == 16
    for conn in [*burst, *others]:
        await conn.close()
    await wait_until(lambda: not server.connections)


def test_trusted_sources_parse_addresses_and_cidrs() -> None:
    sources: Sources[int] = Sources(
        max_connections=4,
        max_per_source=1,
        trusted=parse_networks("127.0.0.0/8, ::1, 10.1.0.0/16, 2001:db8::/48"),
        clock=lambda: 0.0,
    )
    trusted = ["127.0.0.9", "::1", "10.1.2.3", source_of("2001:db8:0:5::1"), "10.2.0.1", ""]
    assert [sources.is_trusted(s) for s in trusted] == [True] * 4 + [False] * 2
    assert not sources.is_trusted(source_of("2001:db9::1"))
    with pytest.raises(ValueError, match=r"'10\.1\.0\.0/33'"):
        parse_networks("10.1.0.0/33")


# The rules, for every sequence -------------------------------------------------------------

SOURCES = ("10.0.0.1", "10.0.0.2", "127.0.0.1")


class Connections(RuleBasedStateMachine):
    """Connections open, change between idle and busy, and close in any order: the limits hold,
    only idle connections are displaced, the oldest idle first, and every count returns to 0."""

    @initialize(total=st.integers(1, 6), per_source=st.integers(0, 3))
    def start(self, total: int, per_source: int) -> None:
        self.sources: Sources[int] = Sources(
            max_connections=total,
            max_per_source=per_source,
            trusted=parse_networks("127.0.0.0/8"),
            clock=lambda: 0.0,
        )
        self.total, self.per_source = total, per_source
        self.open: dict[int, str] = {}  # the model: every connection counted, and its source
        self.idle_order: list[int] = []  # idle connections, the one idle longest first
        self.next_id = 0

    @rule(source=st.sampled_from(SOURCES), idle=st.booleans())
    def connect(self, source: str, idle: bool) -> None:
        conn, self.next_id = self.next_id, self.next_id + 1
        at_source = sum(1 for s in self.open.values() if s == source)
        opened = self.sources.open(conn, source, idle=idle)
        source_full = self.per_source and at_source >= self.per_source and source != SOURCES[2]
        if source_full:
            candidates = [c for c in self.idle_order if self.open[c] == source]
        elif len(self.open) >= self.total:
            candidates = list(self.idle_order)
        else:
            assert opened is None
            candidates = []
        if source_full or len(self.open) >= self.total:
            if not candidates:
                assert isinstance(opened, Refused)
                assert opened.need_code == "too_many_connections"
                return
            assert isinstance(opened, Displaced)
            assert opened.victim == candidates[0]  # the one idle longest
            del self.open[opened.victim]
            self.idle_order.remove(opened.victim)
        self.open[conn] = source
        if idle:
            self.idle_order.append(conn)

    @precondition(lambda self: self.open)
    @rule(data=st.data(), idle=st.booleans())
    def change(self, data: st.DataObject, idle: bool) -> None:
        conn = data.draw(st.sampled_from(sorted(self.open)))
        self.sources.idle(conn, idle)
        if not idle and conn in self.idle_order:
            self.idle_order.remove(conn)
        elif idle and conn not in self.idle_order:
            self.idle_order.append(conn)

    @precondition(lambda self: self.open)
    @rule(data=st.data(), twice=st.booleans())
    def close(self, data: st.DataObject, twice: bool) -> None:
        conn = data.draw(st.sampled_from(sorted(self.open)))
        self.sources.close(conn)
        if twice:
            self.sources.close(conn)  # (a displaced connection's own close comes later)
        del self.open[conn]
        if conn in self.idle_order:
            self.idle_order.remove(conn)

    @invariant()
    def counts_agree(self) -> None:
        sources = self.sources
        assert sources.connections == len(self.open) <= self.total
        by_source: dict[str, int] = {}
        for source in self.open.values():
            by_source[source] = by_source.get(source, 0) + 1
        assert sources.open_by_source == by_source
        assert list(sources._idle) == self.idle_order

    def teardown(self) -> None:
        for conn in list(self.open):
            self.sources.close(conn)
        assert self.sources.connections == 0
        assert self.sources.open_by_source == {}
        assert not self.sources._idle
        assert not self.sources._idle_by_source


TestConnections = Connections.TestCase
TestConnections.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@settings(max_examples=300, deadline=None)
@given(
    burst=st.integers(1, 5),
    rate=st.sampled_from([0.5, 1.0, 4.0]),
    steps=st.lists(
        st.tuples(
            st.floats(0, 2.0),  # seconds before the next key
            st.booleans(),  # valid?
            st.booleans(),  # does its connection leave before its turn?
        ),
        max_size=60,
    ),
)
def test_failed_keys_are_checked_at_most_at_the_rate_after_the_burst(
    burst: int, rate: float, steps: list[tuple[float, bool, bool]]
) -> None:
    """Whatever keys come, valid or not, leaving or staying: the failed keys checked within any
    window of w seconds are at most burst + rate * w; and a key is checked at once while no
    failure has spent the budget."""
    now = [0.0]
    sources: Sources[int] = Sources(
        max_connections=1,
        max_per_source=0,
        guess_rate=rate,
        guess_burst=burst,
        clock=lambda: now[0],
    )
    source = "10.0.0.1"
    waiting: list[tuple[float, int, Turn, bool, bool]] = []  # reserved turns, in order
    failed_at: list[float] = []

    def take_turns_until(t: float) -> None:
        for at, n, turn, valid, leaves in sorted(w for w in waiting if w[0] <= t):
            waiting.remove((at, n, turn, valid, leaves))
            now[0] = max(now[0], at)
            if leaves:
                sources.turn_unused(source, turn)
            else:
                sources.key_checked(source, f"k{n}", valid, turn)
                if not valid:
                    failed_at.append(now[0])

    for n, (gap, valid, leaves) in enumerate(steps):
        arrives = now[0] + gap
        take_turns_until(arrives)
        now[0] = arrives
        turn = sources.key_turn(source, max_wait=1e9)
        assert turn is not None
        if not failed_at and not waiting:
            assert turn is NOW
        if turn is NOW:
            sources.key_checked(source, f"k{n}", valid, turn)
            if not valid:
                failed_at.append(now[0])
        else:
            waiting.append((now[0] + turn.wait, n, turn, valid, leaves))
    take_turns_until(float("inf"))
    for i, start in enumerate(failed_at):
        for j in range(i, len(failed_at)):
            assert j - i + 1 <= burst + rate * (failed_at[j] - start) + 1e-6


def test_a_turn_further_than_the_wait_allowed_is_not_reserved() -> None:
    now = [0.0]
    sources: Sources[int] = Sources(
        max_connections=1, max_per_source=0, guess_rate=1.0, guess_burst=1, clock=lambda: now[0]
    )
    sources.key_checked("s", "k-wrong", False, NOW)
    assert sources.failed_before("s", "k-wrong")  # the same key again: refused, unchecked
    assert not sources.failed_before("s", "k-other")
    assert not sources.failed_before("t", "k-wrong")
    first = sources.key_turn("s", max_wait=2.0)
    assert first == Turn(1.0, 2.0)  # reserved: the next is 2 s away
    second = sources.key_turn("s", max_wait=2.0)
    assert second == Turn(2.0, 3.0)
    assert sources.key_turn("s", max_wait=2.0) is None  # 3 s away: nothing reserved
    sources.turn_unused("s", first)  # not the last reserved: lost
    assert sources.key_turn("s", max_wait=2.0) is None
    sources.turn_unused("s", second)  # the last: given back
    assert sources.key_turn("s", max_wait=2.0) == Turn(2.0, 3.0)
    now[0] = 10.0
    assert sources.key_turn("s", max_wait=2.0) is NOW


async def test_on_the_defaults_a_burst_from_loopback_passes_the_per_source_limit(
    make_server: ServerFactory,
) -> None:
    """The defaults (256 a source, loopback trusted): 300 connections from 127.0.0.1 at once,
    each answered."""
    server = await make_server()
    burst = await asyncio.gather(*(RawConn.open(server) for _ in range(300)))
    for conn in burst:
        conn.send(ping())
    assert [(await conn.recv())["status"] for conn in burst] == ["ok"] * 300
    assert len(server.connections) == 300
    assert server.state.connections.displaced == 0
    for conn in burst:
        await conn.close()
    await wait_until(lambda: not server.connections)


async def test_a_frame_waiting_for_its_turn_stops_the_reading(
    make_server: ServerFactory,
) -> None:
    """Lines sent behind a frame whose key waits for its turn are not read meanwhile (what the
    daemon holds stays bounded); its turn comes, and spends nothing of the budget."""
    server = await make_server(tenants=TENANTS, auth_guess_burst=1, auth_guess_rate=0.5)
    failer = await RawConn.open(server)
    failer.send(inline("J_f", api_key="k-typo"))
    assert (await failer.recv())["need_code"] == "unauthorized"
    sources = server.state.connections.sources
    spent = sources._paid_at["127.0.0.1"]
    waiter = await RawConn.open(server)
    waiter.send(inline("J_w", api_key=KEY))
    pings = orjson.dumps(ping()) + b"\n"
    waiter.send_raw(pings * (8 * 1024 * 1024 // len(pings)))  # 8 MiB behind it
    sessions = [c.session for c in server.connections]  # type: ignore[attr-defined]
    await wait_until(lambda: any(s.deferred is not None for s in sessions))
    (session,) = [s for s in sessions if s.deferred is not None]
    await wait_until(lambda: waiter.writer.transport.get_write_buffer_size() > 0)
    await asyncio.sleep(0.2)  # (what more the daemon would read, if it read)
    assert session.reader.buffered < 1024 * 1024
    assert sources._paid_at["127.0.0.1"] > spent  # its turn reserved
    waiter.writer.transport.abort()  # (noticed at its turn, when reading resumes)
    await wait_until(lambda: len(server.connections) == 1)
    assert sources._paid_at.get("127.0.0.1", spent) <= spent  # the turn given back
    await failer.close()


async def test_an_sdk_whose_kept_alive_connection_was_displaced_is_served_on_a_new_one(
    make_server: ServerFactory, dial: Dial
) -> None:
    """httpx (the OpenAI SDK's transport) keeps its connection alive between requests; once it
    is displaced (its unasked 503 and the close wait on the socket), the next request goes out
    on a new connection and is served: the 503 is never taken for its answer."""
    server = await front(make_server, max_connections=2)
    address = server.http_address
    assert address is not None
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with httpx.AsyncClient(base_url=f"http://{address[0]}:{address[1]}") as sdk:
        assert (await sdk.post("/v1/chat/completions", json=body)).status_code == 200
        others = [await dial(server), await dial(server)]  # the second displaces the SDK's
        await wait_until(lambda: server.state.connections.displaced == 1)
        others[0].send(post()[:10])  # a request arriving: not idle
        others[1].send(post()[:10])
        await wait_until(lambda: sum(c.session.arriving for c in http_connections(server)) == 2)
        for other in others:
            other.abort()  # room again
        await wait_until(lambda: not http_connections(server))
        answer = await sdk.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200
