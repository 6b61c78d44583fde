"""The attacks of a hostile network, each against a real server over real sockets.

Memory (declared bytes, stalled uploads, tiny chunks, slow readers), connections (one source
holding them all, keys guessed), and what each leaves behind: nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
from collections.abc import AsyncGenerator, Awaitable, Callable

import orjson
import pytest

from clients import GovernorClient, RetryPolicy
from governor.core.sources import MAX_FAILED_KEYS, MAX_PACED, NOW, Sources, Turn, source_of
from governor.core.tenants import TenantConfig
from governor.runners import Finished, Job, RunEvent, Token
from governor.server import Server
from protocol.upload import split_payload
from tests.conftest import RawConn, ServerFactory, receipt, wait_until

from .test_server import ScriptedRunner, ping, share

Opener = Callable[[Server], Awaitable[RawConn]]
KEY = "k-good"
TENANT = TenantConfig(name="good", key_sha256=hashlib.sha256(KEY.encode()).hexdigest())


def inline(job: str, seq: int, data: str, *, api_key: str | None = None) -> dict[str, object]:
    frame: dict[str, object] = {
        "v": 0,
        "verb": "share",
        "job": job,
        "seq": seq,
        "ttl_ms": 0,
        "payload_inline": {"data": data, "sha256": hashlib.sha256(data.encode()).hexdigest()},
    }
    if api_key is not None:
        frame["api_key"] = api_key
    return frame


def declaring(nbytes: int, payload_id: str = "P_1") -> dict[str, object]:
    """A manifest for ``nbytes`` that its sender never means to send."""
    return {
        "payload_id": payload_id,
        "total_bytes": nbytes,
        "chunk_bytes": 65536,
        "chunks": -(-nbytes // 65536),
        "sha256": "0" * 64,
    }


def sessions(server: Server) -> list[object]:
    return [c.session for c in server.connections]  # type: ignore[attr-defined]


# Memory ------------------------------------------------------------------------------------


async def test_declared_bytes_do_not_take_the_servers_buffers(
    make_server: ServerFactory, raw: Opener
) -> None:
    """16 connections declare 8 manifests of 8 MiB each (1 GiB) and send no chunk: a 5-byte
    job still runs (the declared bytes filled the whole budget before)."""
    server = await make_server(max_buffer_bytes=1 << 30)
    attackers = [await raw(server) for _ in range(16)]
    for conn in attackers:
        for j in range(8):
            conn.send(share(f"J_{j}", 1, manifest=declaring(8 << 20)))
    for conn in attackers:
        for _ in range(8):
            assert (await conn.recv())["status"] == "ok"
    victim = await raw(server)
    victim.send(inline("J_v", 1, "hello"))
    reply = await victim.recv()
    assert (reply["verb"], reply["status"]) == ("confirm", "done"), reply
    assert server.buffered_bytes == 0  # promises held nothing


async def test_a_stalled_upload_is_dropped_however_often_its_client_pings(
    make_server: ServerFactory, raw: Opener
) -> None:
    server = await make_server(upload_timeout=0.3)
    conn = await raw(server)
    conn.send(share("J_s", 1, manifest=declaring(1000)))
    assert (await conn.recv())["status"] == "ok"
    (session,) = sessions(server)
    assert session.table.retries.buffers.used == 1000  # type: ignore[attr-defined]
    pongs = 0
    while True:  # the pings keep the connection, not the upload
        conn.send(ping(seq=pongs + 2))
        reply = await conn.recv()
        if reply["verb"] == "confirm" and reply["status"] == "abort":
            break
        pongs += 1
        await asyncio.sleep(0.05)
    assert (reply["job"], reply["need_code"], reply["error_code"]) == (
        "J_s",
        "upload_timeout",
        "timeout",
    )
    assert reply["seq"] == 2  # its last frame's + 1
    assert pongs >= 3
    assert session.table.retries.buffers.used == 0  # type: ignore[attr-defined]
    assert session.jobs == {}  # type: ignore[attr-defined]
    conn.send(ping(seq=99))  # the connection itself is still served
    assert (await conn.recv())["status"] == "ok"


async def test_a_held_payload_is_dropped_when_its_client_does_not_come_back(
    make_server: ServerFactory, raw: Opener
) -> None:
    server = await make_server(max_inflight=1, stub_ms=1000, upload_timeout=0.2)
    runner, waiter = await raw(server), await raw(server)
    runner.send(inline("J_run", 1, "long"))
    await wait_until(lambda: server.inflight == 1)
    waiter.send(inline("J_wait", 1, "waits"))
    yielded = await waiter.recv()
    assert (yielded["status"], receipt(yielded, "conn.payload_held")) == ("yield", 1)
    # Told to come back in retry_hint_ms; dropped upload_timeout after that.
    dropped = await waiter.recv(timeout=yielded["retry_hint_ms"] / 1000 + 5)
    assert (dropped["job"], dropped["need_code"]) == ("J_wait", "upload_timeout")
    assert "held payload" in dropped["detail"]
    for session in sessions(server):
        assert (session.table.retries.held, session.table.retries.buffers.used) == (0, 0)  # type: ignore[attr-defined]
    assert server.tenants.all()[0].waiting == 0


async def test_chunks_arrive_against_the_servers_budget_and_a_full_one_yields(
    make_server: ServerFactory, raw: Opener
) -> None:
    server = await make_server(max_buffer_bytes=10_000, max_inflight=1, stub_ms=400)
    first = await raw(server)
    prepared = split_payload(b"a" * 8000, chunk_bytes=2)  # 4,000 chunks of 2 bytes
    first.send(share("J_1", 1, manifest=prepared.manifest))
    assert (await first.recv())["status"] == "ok"
    for i, chunk in enumerate(prepared.chunks[:-1]):
        first.send(share("J_1", 2 + i, chunk=chunk))
    for _ in prepared.chunks[:-1]:
        assert (await first.recv())["status"] == "ok"
    assert server.buffered_bytes == 7998  # bytes received: 2 a chunk, not 2 + a header
    # Another payload of 5,000 bytes cannot be held beside it: it yields, nothing is held.
    second = await raw(server)
    second.send(inline("J_2", 1, "b" * 5000))
    reply = await second.recv()
    assert (reply["verb"], reply["status"], reply["need_code"]) == (
        "clarify",
        "yield",
        "buffers_full",
    )
    assert (reply["error_code"], receipt(reply, "conn.payload_held")) == ("busy", 0)
    assert reply["retry_hint_ms"] > 0
    assert server.buffered_bytes == 7998


async def test_the_client_sends_again_after_buffers_full_mid_upload(
    make_server: ServerFactory, raw: Opener
) -> None:
    """A chunk that does not fit yields before the last one; the client reads the answers to
    the frames it had pipelined after it, then sends the whole upload again."""
    server = await make_server(max_buffer_bytes=10_000, max_inflight=2, stub_ms=300)
    hog = await raw(server)
    hog.send(inline("J_hog", 1, "h" * 6000))  # runs 300 ms, holding 6,000 bytes
    await wait_until(lambda: server.inflight == 1)
    host, port = server.address
    async with await GovernorClient.connect(host, port) as client:
        result = await client.upload(
            b"c" * 8000, chunk_bytes=1000, retry=RetryPolicy(max_attempts=20, max_sleep_s=0.5)
        )
    assert result.done, result.reply
    assert [y.need_code for y in result.yields][:1] == ["buffers_full"]
    assert server.buffered_bytes == 0


def test_a_manifest_over_the_chunk_limit_is_invalid() -> None:
    from protocol.errors import ManifestInvalid
    from protocol.upload import Upload

    upload = Upload(max_chunks=100)
    manifest = split_payload(b"x" * 101, chunk_bytes=1).manifest
    with pytest.raises(ManifestInvalid, match="over the limit of 100"):
        upload.apply_manifest(manifest)


class Flood(ScriptedRunner):
    """Streams big tokens as fast as it can: a job whose client may not read them."""

    name = "flood"

    def __init__(self) -> None:
        super().__init__("flood")

    async def probe(self) -> bool:
        return True

    async def run(self, job: Job) -> AsyncGenerator[RunEvent, None]:
        for _ in range(10_000):
            await asyncio.sleep(0)
            yield Token("x" * 4096)
        yield Finished({})


def unread_socket(server: Server) -> socket.socket:
    """A client socket with a 4 KiB receive buffer, which will never be read."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(server.address)
    sock.setblocking(False)
    return sock


def push(sock: socket.socket, data: bytes) -> int:
    """Send what the kernel takes now, without blocking."""
    try:
        return sock.send(data)
    except BlockingIOError:
        return 0


async def test_a_slow_readers_pipelined_pings_wait_and_it_is_cut_off(
    make_server: ServerFactory,
) -> None:
    server = await make_server(write_timeout=0.5, idle_timeout=60)
    sock = unread_socket(server)
    try:
        pings = b"".join(orjson.dumps(ping(seq=i)) + b"\n" for i in range(1, 20_001))
        sent = 0
        await wait_until(lambda: len(server.connections) == 1)
        (session,) = sessions(server)
        deadline = asyncio.get_running_loop().time() + 3
        while sent < len(pings) and asyncio.get_running_loop().time() < deadline:
            sent += push(sock, pings[sent : sent + 65536])
            await asyncio.sleep(0.01)
        # It stopped answering once the client stopped reading: its lines wait, unread.
        assert 0 < session.lines < 20_000  # type: ignore[attr-defined]
        # Cut off write_timeout after it stopped reading, long before the idle timeout.
        await wait_until(lambda: not server.connections, timeout=5)
        assert server.state.connections.refused["write_timeout"] == 1
    finally:
        sock.close()


async def test_a_stream_nobody_reads_is_cut_at_the_write_budget_and_gives_its_slot_back(
    make_server: ServerFactory,
) -> None:
    server = await make_server(Flood(), write_buffer_bytes=65536, write_timeout=60)
    sock = unread_socket(server)
    try:
        sock.setblocking(True)
        sock.sendall(orjson.dumps(inline("J_f", 1, "go")) + b"\n")
        await wait_until(lambda: server.state.connections.refused["slow_reader"] == 1, timeout=10)
        await wait_until(lambda: not server.connections)
        await wait_until(lambda: server.inflight == 0 and server.live_jobs == 0)
    finally:
        sock.close()


# Connections -------------------------------------------------------------------------------


async def test_one_source_at_its_limit_leaves_room_for_others(make_server: ServerFactory) -> None:
    """An untrusted source's connections with work in flight hold its limit: one more is
    refused, and another source is served."""
    server = await make_server(
        max_connections=8, max_connections_per_source=4, trusted_sources="", stub_ms=5000
    )
    held = [await RawConn.open(server) for _ in range(4)]
    for i, conn in enumerate(held):
        conn.send(inline(f"J_{i}", 1, "working"))
    await wait_until(lambda: server.inflight == 4)
    extra = await RawConn.open(server)
    try:
        refused = await extra.recv()
        assert (refused["need_code"], refused["error_code"]) == ("too_many_connections", "quota")
        assert "this address" in refused["detail"]
        await extra.recv_eof()
        other = await RawConn.open(server, source="127.0.0.2")
        other.send(ping())
        assert (await other.recv())["status"] == "ok"
        await other.close()
    finally:
        for conn in [*held, extra]:
            await conn.close()
    await wait_until(lambda: not server.connections)
    assert server.state.connections.sources.open_by_source == {}


async def test_without_a_valid_key_within_the_grace_a_connection_is_closed(
    make_server: ServerFactory,
) -> None:
    server = await make_server(tenants=(TENANT,), auth_grace=0.3)
    idle, keyed = await RawConn.open(server), await RawConn.open(server)
    try:
        keyed.send({**ping(), "api_key": KEY})
        assert (await keyed.recv())["status"] == "ok"
        idle.send(ping())  # a ping without a key is answered, but shows nothing
        assert (await idle.recv())["status"] == "ok"
        closed = await idle.recv(timeout=5)
        assert (closed["need_code"], closed["error_code"]) == ("unauthorized", "unauthorized")
        await idle.recv_eof()
        keyed.send(inline("J_k", 1, "still here", api_key=KEY))
        assert (await keyed.recv())["status"] == "done"
    finally:
        await idle.close()
        await keyed.close()


async def test_guessing_keys_closes_the_connection_and_paces_the_sources_keys(
    make_server: ServerFactory,
) -> None:
    """Three failures close the connection; a client that reconnects to guess on gets its
    keys checked at the source's rate, past its burst, and a valid key beside it is served."""
    server = await make_server(
        tenants=(TENANT,), max_auth_failures=3, auth_guess_burst=3, auth_guess_rate=4.0
    )
    guesser = await RawConn.open(server)
    for i in range(1, 6):
        guesser.send(inline(f"J_{i}", 1, "x", api_key=f"guess-{i}"))
    answers = [await guesser.recv() for _ in range(3)]
    await guesser.recv_eof()
    await guesser.close()
    assert [a["status"] for a in answers] == ["abort"] * 3
    assert [a["job"] for a in answers] == ["J_1", "J_2", "J_3"]  # one answer a job
    assert "connection closes" in answers[-1]["detail"]
    checked = 3
    loop = asyncio.get_running_loop()
    started = loop.time()
    while loop.time() - started < 1.5:  # reconnecting, a guess a frame
        conn = await RawConn.open(server)
        for i in range(3):
            conn.send(inline(f"J_{i}", 1, "x", api_key=f"again-{checked}-{i}"))
            checked += (await conn.recv())["need_code"] == "unauthorized"
        await conn.close()
    elapsed = loop.time() - started
    assert checked <= 3 + 4.0 * elapsed + 2  # the burst, then the rate (and a turn or two)
    keyed = await RawConn.open(server)  # beside the guesser: waits its turn, is served
    keyed.send(inline("J_ok", 1, "fine", api_key=KEY))
    assert (await keyed.recv())["status"] == "done"
    await keyed.close()


def test_sources_group_ipv6_by_64_and_keep_ipv4_whole() -> None:
    assert source_of("2001:db8::1") == source_of("2001:db8::ffff:1") == "2001:db8::/64"
    assert source_of("2001:db8:0:1::1") != source_of("2001:db8::1")
    assert source_of("::ffff:10.0.0.1") == "10.0.0.1"
    assert source_of("10.0.0.1") != source_of("10.0.0.2")


def test_sources_bound_the_budgets_they_remember_and_the_lines_they_log() -> None:
    now = [0.0]
    sources: Sources[int] = Sources(
        max_connections=8, max_per_source=2, guess_rate=1.0, guess_burst=1, clock=lambda: now[0]
    )
    for i in range(MAX_PACED + 100):
        sources.key_checked(f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}", "k", False, NOW)
    assert len(sources._paid_at) == MAX_PACED
    assert len(sources._failed) == MAX_FAILED_KEYS  # the wrong keys remembered, the latest
    assert not sources.failed_before("10.0.0.0", "k")
    assert sources.failed_before(f"10.0.{(MAX_PACED + 99) >> 8}.{(MAX_PACED + 99) & 255}", "k")
    assert sources.key_turn("10.0.0.0", 10.0) is NOW  # the oldest budget was forgotten first
    last = f"10.0.{(MAX_PACED + 99) >> 8}.{(MAX_PACED + 99) & 255}"
    assert sources.key_turn(last, 10.0) == Turn(1.0, 2.0)
    logged = sum(sources.line("x") is not None for _ in range(1000))
    assert logged == 10  # the burst, then about one a second
    assert sources.unlogged == 990
    now[0] += 5.0
    assert sources.line("x") == "x (990 such lines not written)"
    assert sum(sources.line("x") is not None for _ in range(99)) == 4
    now[0] += 11.0
    assert sources.key_turn(last, 10.0) is NOW


async def test_a_stalled_upload_beside_a_running_job_is_still_dropped_in_time(
    make_server: ServerFactory, raw: Opener
) -> None:
    """The idle timeout waits while a job runs; the upload deadline beside it does not."""
    server = await make_server(stub_ms=4000, idle_timeout=1.0, upload_timeout=0.3)
    conn = await raw(server)
    conn.send(inline("J_run", 1, "runs 4 s"))
    await wait_until(lambda: server.inflight == 1)
    await asyncio.sleep(1.1)  # past the idle timeout: it is looked at again a second later
    conn.send(share("J_s", 1, manifest=declaring(1000)))
    assert (await conn.recv())["status"] == "ok"
    started = asyncio.get_running_loop().time()
    dropped = await conn.recv(timeout=3)
    assert (dropped["job"], dropped["need_code"]) == ("J_s", "upload_timeout")
    assert asyncio.get_running_loop().time() - started < 0.8  # not at the idle re-check


@pytest.mark.parametrize("turn", ["per_turn", "unbounded"])
async def test_a_pipelining_flood_delays_anothers_ping_by_a_turn_not_by_its_frames(
    make_server: ServerFactory, raw: Opener, monkeypatch: pytest.MonkeyPatch, turn: str
) -> None:
    from governor.listeners import session as session_module

    if turn == "unbounded":  # as before turns: the test must see the difference
        monkeypatch.setattr(session_module, "LINES_PER_TURN", 10**9)
    server = await make_server()
    flood, other = await raw(server), await raw(server)
    for seq in (1, 2):
        flood.send(ping(seq=seq))
        assert (await flood.recv())["status"] == "ok"
    other.send(ping(seq=1))
    assert (await other.recv())["status"] == "ok"
    flooding = next(s for s in sessions(server) if s.lines == 2)  # type: ignore[attr-defined]
    flood.send_raw(b"".join(orjson.dumps(ping(seq=i)) + b"\n" for i in range(3, 20_003)))
    await wait_until(lambda: flooding.lines > 2)  # type: ignore[attr-defined]
    before = flooding.lines  # type: ignore[attr-defined]
    other.send(ping(seq=3))
    assert (await other.recv())["status"] == "ok"
    handled_meanwhile = flooding.lines - before  # type: ignore[attr-defined]
    if turn == "per_turn":
        assert handled_meanwhile <= 8 * session_module.LINES_PER_TURN
    else:
        assert handled_meanwhile > 8 * 64
