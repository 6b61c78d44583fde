"""The server over real sockets, in-process: bad input, the cap under races, slot release."""

from __future__ import annotations

import asyncio
import collections
import hashlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import orjson
import pytest

from clients import NO_RETRY, GovernorClient, RetryPolicy
from governor.core.overload import State
from governor.runners import Finished, Job, RunEvent, RunnerError, StubRunner, Token
from governor.server import Server
from protocol.spec import JobSpec
from protocol.upload import PreparedUpload, split_payload
from tests.clock import FakeClock
from tests.conftest import RawConn, ServerFactory, outcomes, receipt, wait_until

Opener = Callable[[Server], Awaitable[RawConn]]


def ping(job: str = "J_p", seq: int = 1) -> dict[str, Any]:
    return {"v": 0, "verb": "ping", "job": job, "seq": seq, "ttl_ms": 0}


def share(
    job: str, seq: int, *, manifest: Any = None, chunk: Any = None, ttl_ms: int = 0
) -> dict[str, Any]:
    frame: dict[str, Any] = {"v": 0, "verb": "share", "job": job, "seq": seq, "ttl_ms": ttl_ms}
    if manifest is not None:
        frame["payload_manifest"] = manifest
    if chunk is not None:
        frame["payload_chunk"] = chunk
    return frame


def send_upload(conn: RawConn, job: str, payload: bytes) -> PreparedUpload:
    """Send a one-chunk upload's two frames without waiting for the replies."""
    prepared = split_payload(payload)
    conn.send(share(job, 1, manifest=prepared.manifest))
    conn.send(share(job, 2, chunk=prepared.chunks[0]))
    return prepared


async def upload_raw(conn: RawConn, job: str, payload: bytes, *, ttl_ms: int = 0) -> dict[str, Any]:
    """Send a one-chunk upload frame by frame; return the reply to the final chunk."""
    prepared = split_payload(payload)
    conn.send(share(job, 1, manifest=prepared.manifest, ttl_ms=ttl_ms))
    ack = await conn.recv()
    assert (ack["verb"], ack["status"], ack["seq"]) == ("clarify", "ok", 2)
    conn.send(share(job, 2, chunk=prepared.chunks[0], ttl_ms=ttl_ms))
    return await conn.recv()


# Bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "need_code"),
    [
        (b"GET / HTTP/1.1", "http_request"),
        (b"<!DOCTYPE html><html></html>", "html_document"),
        (b'<?xml version="1.0"?><a/>', "xml_document"),
        (b"GIF89a\x01\x00\x01\x00", "binary_gif"),
        (b"[1, 2, 3]", "json_array"),
        (b'{"v": 0, "verb": ', "json_malformed"),
        (b"hello there", "not_json"),
        (b"\xff\xfe\x00garbage", "not_json"),
    ],
)
async def test_bad_line_gets_a_coded_need_and_the_connection_stays_open(
    make_server: ServerFactory, raw: Opener, line: bytes, need_code: str
) -> None:
    server = await make_server()
    conn = await raw(server)
    conn.send_raw(line + b"\n")
    reply = await conn.recv()
    assert reply["verb"] == "clarify"
    assert reply["status"] == "need"
    assert (reply["need_code"], reply["error_code"]) == (need_code, "bad_frame")
    assert (reply["job"], reply["seq"]) == ("J_?", 1)
    assert receipt(reply, "server.health") == 1
    # Still open, and later bad lines name the last valid frame's job and seq.
    conn.send(ping("J_ok", 7))
    assert (await conn.recv())["status"] == "ok"
    conn.send_raw(line + b"\r\n")
    again = await conn.recv()
    assert (again["job"], again["seq"], again["need_code"]) == ("J_ok", 8, need_code)
    assert server.state.metrics.bad_frames[need_code] == 2


@pytest.mark.parametrize(
    "frame",
    [
        {"v": 1, "verb": "ping", "job": "J_x", "seq": 1},
        {"v": 0, "verb": "fly", "job": "J_x", "seq": 1},
        {"v": 0, "verb": "ping", "job": "J_x", "seq": 0},
        {"v": 0, "verb": "ping", "job": "J_x", "seq": 1, "status": "ok"},
        {"v": 0, "verb": "ping", "job": "J_x", "seq": 1, "receipts": []},
        {"v": 0, "verb": "share", "job": "J_x", "seq": 1},
        {"v": 0, "verb": "ping", "job": "J_x", "seq": 1, "extra": True},
    ],
)
async def test_envelope_violation_names_the_frame(
    make_server: ServerFactory, raw: Opener, frame: dict[str, Any]
) -> None:
    server = await make_server()
    conn = await raw(server)
    conn.send(frame)
    reply = await conn.recv()
    assert (reply["verb"], reply["status"]) == ("clarify", "need")
    assert (reply["need_code"], reply["error_code"]) == ("envelope_invalid", "bad_envelope")
    expected_seq = frame["seq"] + 1 if frame["seq"] >= 1 else 1
    assert (reply["job"], reply["seq"]) == ("J_x", expected_seq)
    assert reply["detail"]
    conn.send(ping())
    assert (await conn.recv())["status"] == "ok"


async def test_the_largest_seq_is_answered(make_server: ServerFactory, raw: Opener) -> None:
    server = await make_server(stub_ms=0)
    conn = await raw(server)
    top = 2**64 - 1
    conn.send(ping("J_top", top))
    assert (await conn.recv())["seq"] == top
    prepared = split_payload(b"at the top")
    conn.send(share("J_top", top, manifest=prepared.manifest))
    conn.send(share("J_top", top, chunk=prepared.chunks[0]))
    assert (await conn.recv())["seq"] == top
    done = await conn.recv()
    assert (done["status"], done["seq"]) == ("done", top)


async def test_line_too_large_aborts_and_closes(make_server: ServerFactory, raw: Opener) -> None:
    server = await make_server(max_line_bytes=1024)
    conn = await raw(server)
    conn.send(ping("J_a", 3))
    await conn.recv()
    conn.send_raw(b'{"x": "' + b"a" * 2000)  # no newline needed: the bound is on buffering
    reply = await conn.recv()
    assert (reply["verb"], reply["status"], reply["need_code"]) == (
        "confirm",
        "abort",
        "line_too_large",
    )
    assert (reply["job"], reply["seq"]) == ("J_a", 4)
    await conn.recv_eof()


async def test_idle_timeout_aborts_and_closes(make_server: ServerFactory, raw: Opener) -> None:
    server = await make_server(idle_timeout=0.2)
    conn = await raw(server)
    reply = await conn.recv(timeout=5)
    assert (reply["status"], reply["need_code"], reply["error_code"]) == (
        "abort",
        "idle_timeout",
        "timeout",
    )
    await conn.recv_eof()
    assert not server.connections


async def test_idle_timeout_waits_for_a_running_job(
    make_server: ServerFactory, raw: Opener
) -> None:
    server = await make_server(idle_timeout=0.2, stub_ms=600)
    conn = await raw(server)
    done = await upload_raw(conn, "J_long", b"work")
    assert done["status"] == "done"  # the job outlived idle_timeout and still reported
    reply = await conn.recv()
    assert reply["need_code"] == "idle_timeout"


async def test_too_many_jobs_aborts_and_closes(make_server: ServerFactory, raw: Opener) -> None:
    server = await make_server(max_jobs_per_conn=2)
    conn = await raw(server)
    manifest = split_payload(b"x").manifest
    for i, job in enumerate(["J_1", "J_2"]):
        conn.send(share(job, i + 1, manifest=manifest))
        assert (await conn.recv())["status"] == "ok"
    conn.send(share("J_3", 9, manifest=manifest))
    reply = await conn.recv()
    assert (reply["verb"], reply["status"]) == ("confirm", "abort")
    assert (reply["need_code"], reply["error_code"], reply["job"], reply["seq"]) == (
        "too_many_jobs",
        "quota",
        "J_3",
        10,
    )
    await conn.recv_eof()
    await wait_until(lambda: server.buffered_bytes == 0)


async def test_finished_jobs_do_not_count_against_the_job_limit(
    make_server: ServerFactory, raw: Opener
) -> None:
    server = await make_server(max_jobs_per_conn=1, stub_ms=0)
    conn = await raw(server)
    for i in range(5):
        assert (await upload_raw(conn, f"J_{i}", b"x"))["status"] == "done"


async def test_connection_limit(make_server: ServerFactory, raw: Opener) -> None:
    """At max_connections a new connection displaces the oldest idle one, which is told why;
    with every connection running a job, it is refused."""
    server = await make_server(max_connections=2, stub_ms=3000)
    first, second = await raw(server), await raw(server)
    for conn in (first, second):
        conn.send(ping())
        assert (await conn.recv())["status"] == "ok"
    third = await raw(server)
    displaced = await first.recv()
    assert (displaced["status"], displaced["need_code"], displaced["error_code"]) == (
        "abort",
        "displaced",
        "quota",
    )
    await first.recv_eof()
    inline = {"data": "x", "sha256": hashlib.sha256(b"x").hexdigest()}
    for i, conn in enumerate((second, third)):
        conn.send({**share(f"J_{i}", 1), "payload_inline": inline})
    await wait_until(lambda: server.inflight == 2)
    fourth = await raw(server)
    reply = await fourth.recv()
    assert (reply["status"], reply["need_code"], reply["error_code"]) == (
        "abort",
        "too_many_connections",
        "quota",
    )
    await fourth.recv_eof()
    assert server.state.connections.displaced == 1


async def test_upload_problems_get_their_need_codes(
    make_server: ServerFactory, raw: Opener
) -> None:
    server = await make_server()
    conn = await raw(server)
    prepared = split_payload(b"abcdef", chunk_bytes=3)
    conn.send(share("J_u", 1, chunk=prepared.chunks[0]))
    reply = await conn.recv()
    assert (reply["need_code"], reply["error_code"], reply["seq"]) == (
        "manifest_missing",
        "need_more",
        2,
    )
    conn.send(share("J_u", 2, manifest={**prepared.manifest, "chunks": 0}))
    reply = await conn.recv()
    assert (reply["need_code"], reply["error_code"]) == ("manifest_invalid", "need_manifest_fix")
    conn.send(share("J_u", 3, manifest=prepared.manifest))
    assert (await conn.recv())["status"] == "ok"
    conn.send(share("J_u", 4, chunk={**prepared.chunks[0], "sha256": "0" * 64}))
    reply = await conn.recv()
    assert (reply["need_code"], receipt(reply, "cdr.bytes_in")) == ("chunk_hash_mismatch", 0)
    conn.send(share("J_u", 5, chunk=prepared.chunks[1]))
    assert (await conn.recv())["need_code"] == "chunk_expected_index"
    conn.send(share("J_u", 6, chunk=prepared.chunks[0]))
    reply = await conn.recv()
    assert (reply["status"], receipt(reply, "cdr.bytes_in")) == ("ok", 3)
    conn.send(share("J_u", 7, chunk=prepared.chunks[1]))
    reply = await conn.recv()
    assert (reply["verb"], reply["status"], reply["seq"]) == ("confirm", "done", 9)
    assert reply["result"]["bytes"] == 6
    assert server.ledger.executed_total == 1


async def test_payload_cap(make_server: ServerFactory, raw: Opener) -> None:
    server = await make_server(max_payload_bytes=100)
    conn = await raw(server)
    conn.send(share("J_big", 1, manifest=split_payload(b"x" * 101).manifest))
    assert (await conn.recv())["need_code"] == "manifest_invalid"
    assert server.buffered_bytes == 0


async def test_connection_buffer_budget(make_server: ServerFactory, raw: Opener) -> None:
    server = await make_server(max_conn_buffer_bytes=150)
    conn = await raw(server)
    conn.send(share("J_a", 1, manifest=split_payload(b"x" * 100).manifest))
    assert (await conn.recv())["status"] == "ok"
    conn.send(share("J_b", 2, manifest=split_payload(b"x" * 100).manifest))
    reply = await conn.recv()
    assert reply["need_code"] == "manifest_invalid"
    assert "limit" in reply["detail"]
    # Declared bytes count against the connection; the server's buffers hold what arrived.
    (session,) = (c.session for c in server.connections)  # type: ignore[attr-defined]
    assert (session.table.retries.buffers.used, server.buffered_bytes) == (100, 0)
    await conn.close()
    await wait_until(lambda: not server.connections)
    assert session.table.retries.buffers.used == 0


# Admission -----------------------------------------------------------------------------


async def test_seed_003_one_runs_nineteen_yield_at_once(make_server: ServerFactory) -> None:
    server = await make_server(max_inflight=1, stub_ms=1500)
    host, port = server.address
    clients = [await GovernorClient.connect(host, port) for _ in range(20)]
    try:
        results = await asyncio.gather(*(c.upload(b"seed 003", retry=NO_RETRY) for c in clients))
    finally:
        for c in clients:
            await c.close()
    statuses = collections.Counter(str(r.status) for r in results)
    assert statuses == {"done": 1, "yield": 19}
    done = next(r for r in results if r.status == "done")
    # Yielded at once: every yield arrived before the one admitted job had finished.
    assert all(r.finished < done.finished for r in results if r.status == "yield")
    assert all(
        r.reply.need_code == "server_busy" and r.reply.retry_hint_ms for r in results if r.yields
    )
    assert (server.ledger.executed_total, server.ledger.yielded_total) == (1, 19)
    assert server.ledger.peak_inflight == 1


async def test_a_job_of_n_sequences_holds_n_slots(make_server: ServerFactory) -> None:
    """Over the wire: a job with n 2 on a cap of 3 holds 2 slots while it runs (receipts and
    metrics say so), a second such job yields, a single one runs beside it; n 4 is refused."""
    server = await make_server(max_inflight=3, stub_ms=1500)
    host, port = server.address
    clients = [await GovernorClient.connect(host, port) for _ in range(4)]
    try:
        pair = asyncio.create_task(
            clients[0].generate(JobSpec(prompt="a", max_new_tokens=8, n=2), retry=NO_RETRY)
        )
        await wait_until(lambda: server.ledger.taken == 2)
        ping = await clients[1].ping()
        assert ping.receipt("backend.inflight") == 2
        second = await clients[1].generate(
            JobSpec(prompt="b", max_new_tokens=8, n=2), retry=NO_RETRY
        )
        assert second.status == "yield"
        assert second.reply.need_code == "server_busy"
        single = asyncio.create_task(
            clients[2].generate(JobSpec(prompt="c", max_new_tokens=8), retry=NO_RETRY)
        )
        await wait_until(lambda: server.ledger.taken == 3)
        assert server.ledger.inflight == 2
        never = await clients[3].generate(
            JobSpec(prompt="d", max_new_tokens=8, n=4), retry=NO_RETRY
        )
        assert never.status == "abort"
        assert never.reply.need_code == "spec_invalid"
        assert [str((await t).status) for t in (pair, single)] == ["done", "done"]
    finally:
        for c in clients:
            await c.close()
    assert server.ledger.taken == 0
    assert server.ledger.peak_inflight == 3


@pytest.mark.parametrize("retry", ["none", "hint"])
async def test_hundreds_racing_on_a_cap_of_three(make_server: ServerFactory, retry: str) -> None:
    # (300 connections from one address: over the default per-source limit)
    server = await make_server(max_inflight=3, stub_ms=5, max_connections_per_source=0)
    host, port = server.address
    offered = 300
    policy = NO_RETRY if retry == "none" else RetryPolicy(max_attempts=100, max_sleep_s=0.5)
    clients = [await GovernorClient.connect(host, port) for _ in range(offered)]
    try:
        results = await asyncio.gather(*(c.upload(b"race", retry=policy) for c in clients))
    finally:
        for c in clients:
            await c.close()
    statuses = collections.Counter(str(r.status) for r in results)
    ledger = server.ledger
    assert ledger.peak_inflight <= 3
    assert ledger.executed_total == statuses["done"]
    assert ledger.executed_total + ledger.yielded_total == sum(r.attempts for r in results)
    if retry == "none":
        assert statuses["done"] + statuses["yield"] == offered
        assert statuses["yield"] > 0
    else:
        assert statuses == {"done": offered}
    await wait_until(lambda: ledger.inflight == 0)


async def test_every_admitted_job_gets_exactly_one_terminal_frame(
    make_server: ServerFactory, raw: Opener
) -> None:
    server = await make_server(StubRunner(0.01, fail_rate=0.3, seed=3), max_inflight=2)
    terminal: collections.Counter[str] = collections.Counter()

    async def worker(w: int) -> None:
        conn = await raw(server)
        for i in range(10):
            job = f"J_{w}_{i}"
            reply = await upload_raw(conn, job, job.encode())
            seq = reply["seq"]
            while reply["status"] == "yield":  # as heptaminic does: resend the final chunk
                await asyncio.sleep(reply["retry_hint_ms"] / 1000)
                conn.send(share(job, seq, chunk=split_payload(job.encode()).chunks[0]))
                reply = await conn.recv()
                seq = reply["seq"]
            assert reply["job"] == job
            assert reply["verb"] == "confirm"
            terminal[job] += 1
        conn.send(ping("J_last"))
        assert (await conn.recv())["job"] == "J_last"  # nothing more came for any job

    await asyncio.gather(*(worker(w) for w in range(4)))
    assert set(terminal.values()) == {1}
    assert len(terminal) == 40
    assert server.ledger.executed_total == 40
    assert server.ledger.peak_inflight <= 2
    assert sum(outcomes(server).values()) == 40
    assert outcomes(server)["backend_error"] > 0
    assert outcomes(server)["done"] > 0


async def test_retry_with_identical_final_chunk_after_yield(
    make_server: ServerFactory, raw: Opener
) -> None:
    server = await make_server(max_inflight=1, stub_ms=300)
    busy, conn = await raw(server), await raw(server)
    send_upload(busy, "J_busy", b"first")
    assert (await busy.recv())["status"] == "ok"
    await wait_until(lambda: server.ledger.inflight == 1)
    payload = b"the held payload " * 100
    prepared = split_payload(payload, chunk_bytes=512)
    replies = []
    conn.send(share("J_r", 1, manifest=prepared.manifest))
    for i, chunk in enumerate(prepared.chunks):
        replies.append(await conn.recv())
        conn.send(share("J_r", 2 + i, chunk=chunk))
    refused = await conn.recv()
    assert all(r["status"] == "ok" for r in replies)
    assert (refused["status"], refused["need_code"], refused["error_code"]) == (
        "yield",
        "server_busy",
        "busy",
    )
    assert refused["retry_hint_ms"] > 0
    assert receipt(refused, "conn.payload_held") == 1
    assert receipt(refused, "conn.retry_hint_ms") == refused["retry_hint_ms"]
    # heptaminic resends the identical final chunk with a new seq: refused again while busy ...
    seq = refused["seq"]
    conn.send(share("J_r", seq, chunk=prepared.chunks[-1]))
    again = await conn.recv()
    assert (again["status"], again["seq"]) == ("yield", seq + 2)
    assert (await busy.recv())["status"] == "done"
    # ... and admitted once a slot is free, without uploading the payload again.
    conn.send(share("J_r", seq + 3, chunk=prepared.chunks[-1]))
    done = await conn.recv()
    assert (done["verb"], done["status"], done["seq"]) == ("confirm", "done", seq + 5)
    assert done["result"]["bytes"] == len(payload)
    assert server.buffered_bytes == 0


async def test_held_payloads_are_bounded_per_connection(
    make_server: ServerFactory, raw: Opener
) -> None:
    server = await make_server(max_inflight=1, stub_ms=2000, held_payloads_per_conn=1)
    busy, conn = await raw(server), await raw(server)
    await asyncio.sleep(0)
    send_upload(busy, "J_busy", b"first")
    await wait_until(lambda: server.ledger.inflight == 1)
    held = await upload_raw(conn, "J_a", b"a")
    dropped = await upload_raw(conn, "J_b", b"b")
    assert receipt(held, "conn.payload_held") == 1
    assert receipt(dropped, "conn.payload_held") == 0
    conn.send(share("J_b", 5, chunk=split_payload(b"b").chunks[0]))
    assert (await conn.recv())["need_code"] == "manifest_missing"
    assert server.buffered_bytes == len(b"first") + 1  # the running job's and J_a's held one


async def test_refused_clients_that_leave_do_not_delay_the_next_hint(
    make_server: ServerFactory, raw: Opener
) -> None:
    server = await make_server(max_inflight=1, stub_ms=2000, hint_margin=0)
    busy = await raw(server)
    send_upload(busy, "J_busy", b"first")
    await wait_until(lambda: server.ledger.inflight == 1)
    hints = []
    for i in range(5):
        conn = await raw(server)
        hints.append((await upload_raw(conn, f"J_{i}", b"x"))["retry_hint_ms"])
        await conn.close()  # gone: its held payload and its promise with it
    # Each was sent to the next release, not behind the promises of those who left.
    assert max(hints) <= 2000
    assert max(hints) - min(hints) < 500
    stays = await raw(server)
    waiting = [await upload_raw(stays, f"J_w{i}", b"w") for i in range(3)]
    assert [r["retry_hint_ms"] for r in waiting] == sorted(r["retry_hint_ms"] for r in waiting)
    assert waiting[1]["retry_hint_ms"] >= waiting[0]["retry_hint_ms"] + 1900  # spread by ~S


async def test_client_retry_with_the_library(make_server: ServerFactory) -> None:
    server = await make_server(max_inflight=1, stub_ms=100)
    host, port = server.address
    async with (
        await GovernorClient.connect(host, port) as a,
        await GovernorClient.connect(host, port) as b,
    ):
        ra, rb = await asyncio.gather(a.upload(b"a"), b.upload(b"b"))
    assert ra.done
    assert rb.done
    retried = ra if ra.yields else rb
    assert retried.attempts == len(retried.yields) + 1 >= 2
    assert server.ledger.executed_total == 2


# Execution -----------------------------------------------------------------------------


async def test_ping_is_answered_while_the_connections_job_runs(
    make_server: ServerFactory, raw: Opener
) -> None:
    server = await make_server(max_inflight=1, stub_ms=3000)
    conn = await raw(server)
    prepared = send_upload(conn, "J_s", b"slow")
    assert (await conn.recv())["status"] == "ok"
    await wait_until(lambda: server.ledger.inflight == 1)
    conn.send(ping("J_p", 1))
    reply = await conn.recv(timeout=1.0)
    assert (reply["verb"], reply["status"], reply["job"]) == ("confirm", "ok", "J_p")
    assert receipt(reply, "server.health") == 0  # saturated
    assert receipt(reply, "backend.inflight") == 1
    assert receipt(reply, "backend.cap") == 1
    conn.send(share("J_s", 3, manifest=prepared.manifest))
    busy = await conn.recv(timeout=1.0)
    assert (busy["need_code"], busy["error_code"]) == ("job_running", "conflict")


async def test_client_disconnect_mid_job_frees_the_slot(
    make_server: ServerFactory, raw: Opener
) -> None:
    server = await make_server(max_inflight=1, stub_ms=30_000)
    conn = await raw(server)
    send_upload(conn, "J_gone", b"abandoned")
    await wait_until(lambda: server.ledger.inflight == 1)
    await conn.close()
    await wait_until(lambda: server.ledger.inflight == 0, timeout=2.0)
    assert outcomes(server) == {"client_gone": 1}
    other = await raw(server)
    send_upload(other, "J_next", b"next")
    await wait_until(lambda: server.ledger.inflight == 1)  # the freed slot is taken again


async def test_eof_from_the_client_cancels_its_job(make_server: ServerFactory, raw: Opener) -> None:
    """A half-close looks like a close: the job of a client that sent EOF does not run on."""
    server = await make_server(stub_ms=30_000)
    conn = await raw(server)
    send_upload(conn, "J_h", b"then eof")
    await wait_until(lambda: server.ledger.inflight == 1)
    conn.writer.write_eof()
    await wait_until(lambda: server.ledger.inflight == 0, timeout=2.0)
    assert outcomes(server) == {"client_gone": 1}


async def test_ttl_expiry_aborts_the_job_and_frees_the_slot(
    make_server: ServerFactory, raw: Opener
) -> None:
    server = await make_server(max_inflight=1, stub_ms=10_000)
    conn = await raw(server)
    reply = await upload_raw(conn, "J_t", b"late", ttl_ms=100)
    assert (reply["verb"], reply["status"]) == ("confirm", "abort")
    assert (reply["need_code"], reply["error_code"], reply["ttl_ms"]) == (
        "ttl_expired",
        "timeout",
        100,
    )
    assert server.ledger.inflight == 0


async def test_backend_failure_is_reported_and_the_slot_released(
    make_server: ServerFactory, raw: Opener
) -> None:
    server = await make_server(max_inflight=1, stub_ms=10, stub_fail_rate=1.0)
    conn = await raw(server)
    reply = await upload_raw(conn, "J_f", b"doomed")
    assert (reply["verb"], reply["status"], reply["seq"]) == ("confirm", "abort", 4)
    assert (reply["need_code"], reply["error_code"]) == ("backend_error", "backend_error")
    assert receipt(reply, "cdr.backend.ms") is not None
    assert server.ledger.inflight == 0


class ScriptedRunner:
    """Streams tokens, or breaks in the ways a runner can break."""

    name = "scripted"
    expected_service_s = 0.01

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    max_new_tokens = 64

    def prepare(self, job_id: str, spec: JobSpec | None, payload: bytes = b"") -> Job:
        return Job(job_id, payload, spec=spec)

    async def run(self, job: Job) -> AsyncGenerator[RunEvent, None]:
        if self.behaviour == "crash":
            raise ZeroDivisionError("a bug in the runner")
        for word in job.payload.decode().split():
            await asyncio.sleep(0)
            yield Token(word + " ")
        if self.behaviour == "stream":
            yield Finished({"tokens": len(job.payload.split())})
        elif self.behaviour == "fail":
            raise RunnerError("model exploded")
        # "truncate": ends without Finished


@pytest.mark.parametrize(
    ("behaviour", "status", "need_code"),
    [
        ("stream", "done", None),
        ("crash", "abort", "backend_error"),
        ("fail", "abort", "backend_error"),
        ("truncate", "abort", "backend_error"),
    ],
)
async def test_runner_outcomes(
    make_server: ServerFactory, raw: Opener, behaviour: str, status: str, need_code: str | None
) -> None:
    server = await make_server(ScriptedRunner(behaviour), max_inflight=1)
    conn = await raw(server)
    reply = await upload_raw(conn, "J_x", b"one two three")
    assert (reply["status"], reply.get("need_code")) == (status, need_code)
    if behaviour == "stream":
        result = reply["result"]
        assert result.pop("ttft_ms") >= 0  # measured by the governor, from admission
        assert result.pop("tpot_ms") is None  # (no completion_tokens to divide by)
        assert result == {"tokens": 3, "text": "one two three "}
    assert server.ledger.inflight == 0
    assert (await upload_raw(conn, "J_y", b"again"))["status"] == status  # still serving


# Drain ---------------------------------------------------------------------------------


async def test_drain_finishes_admitted_jobs_and_yields_new_ones(
    make_server: ServerFactory, raw: Opener
) -> None:
    server = await make_server(max_inflight=3, stub_ms=300)
    conns = [await raw(server) for _ in range(3)]
    for i, conn in enumerate(conns):
        send_upload(conn, f"J_{i}", b"drain me")
    await wait_until(lambda: server.ledger.inflight == 3)
    late = await raw(server)
    drain = asyncio.ensure_future(server.drain(grace=10))
    await wait_until(lambda: server.ledger.draining)
    refused = await upload_raw(late, "J_late", b"too late")
    assert (refused["status"], refused["need_code"], refused["error_code"]) == (
        "yield",
        "draining",
        "unavailable",
    )
    for conn in conns:
        assert (await conn.recv())["status"] == "ok"
        assert (await conn.recv())["status"] == "done"
    assert await drain == 0
    assert outcomes(server) == {"done": 3}


async def test_drain_aborts_jobs_still_running_at_the_deadline(
    make_server: ServerFactory, raw: Opener
) -> None:
    server = await make_server(max_inflight=1, stub_ms=30_000)
    conn = await raw(server)
    send_upload(conn, "J_slow", b"too slow")
    await wait_until(lambda: server.ledger.inflight == 1)
    assert await server.drain(grace=0.2) == 1
    assert (await conn.recv())["status"] == "ok"
    reply = await conn.recv()
    assert (reply["verb"], reply["status"], reply["seq"]) == ("confirm", "abort", 4)
    assert (reply["need_code"], reply["error_code"]) == ("shutdown", "unavailable")
    await conn.recv_eof()
    assert server.ledger.inflight == 0
    assert outcomes(server) == {"shutdown": 1}


def test_stub_runner_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="fail_rate"):
        StubRunner(0.1, fail_rate=2.0)


# Extensions: one-frame payloads and cancel -------------------------------------------


def inline(job: str, seq: int, data: str, **fields: Any) -> dict[str, Any]:
    digest = hashlib.sha256(data.encode()).hexdigest()
    return share(job, seq) | {"payload_inline": {"sha256": digest, "data": data, **fields}}


async def test_inline_payload_in_one_round_trip(make_server: ServerFactory, raw: Opener) -> None:
    server = await make_server(stub_ms=0)
    conn = await raw(server)
    conn.send(inline("J_i", 5, "héllo"))
    done = await conn.recv()
    assert (done["verb"], done["status"], done["seq"]) == ("confirm", "done", 6)
    assert done["result"]["bytes"] == len("héllo".encode())
    conn.send(inline("J_j", 7, "x") | {"payload_inline": {"sha256": "0" * 64, "data": "x"}})
    assert (await conn.recv())["need_code"] == "payload_hash_mismatch"
    conn.send(inline("J_k", 8, "x", colour="red"))
    assert (await conn.recv())["need_code"] == "inline_invalid"
    assert server.ledger.executed_total == 1


async def test_inline_retry_after_a_yield_keeps_its_place(
    make_server: ServerFactory, raw: Opener
) -> None:
    server = await make_server(max_inflight=1, stub_ms=300)
    busy, conn = await raw(server), await raw(server)
    send_upload(busy, "J_busy", b"first")
    await wait_until(lambda: server.ledger.inflight == 1)
    conn.send(inline("J_w", 1, "wait for me"))
    refused = await conn.recv()
    assert (refused["status"], refused["seq"]) == ("yield", 2)
    assert receipt(refused, "conn.payload_held") == 1
    assert (await busy.recv())["status"] == "ok"
    assert (await busy.recv())["status"] == "done"
    conn.send(inline("J_w", 3, "wait for me"))  # the same frame again, as a client retries
    done = await conn.recv()
    assert (done["status"], done["seq"]) == ("done", 4)


async def test_cancel(make_server: ServerFactory, raw: Opener) -> None:
    server = await make_server(max_inflight=1, stub_ms=30_000)
    conn = await raw(server)
    conn.send({"v": 0, "verb": "cancel", "job": "J_none", "seq": 1})
    unknown = await conn.recv()
    assert (unknown["status"], unknown["need_code"]) == ("need", "job_unknown")
    conn.send(share("J_up", 1, manifest=split_payload(b"abc").manifest))
    assert (await conn.recv())["status"] == "ok"
    conn.send({"v": 0, "verb": "cancel", "job": "J_up", "seq": 2})
    dropped = await conn.recv()
    assert (dropped["verb"], dropped["status"], dropped["need_code"], dropped["seq"]) == (
        "confirm",
        "abort",
        "cancelled",
        3,
    )
    assert server.buffered_bytes == 0
    send_upload(conn, "J_run", b"run")
    assert (await conn.recv())["status"] == "ok"
    await wait_until(lambda: server.ledger.inflight == 1)
    conn.send({"v": 0, "verb": "cancel", "job": "J_run", "seq": 9})
    stopped = await conn.recv()
    assert (stopped["verb"], stopped["status"], stopped["need_code"], stopped["seq"]) == (
        "confirm",
        "abort",
        "cancelled",
        4,
    )
    await wait_until(lambda: server.ledger.inflight == 0)
    assert outcomes(server) == {"cancelled": 1}
    conn.send(ping())
    assert (await conn.recv())["verb"] == "confirm"  # and nothing else came for the job


# Lanes ---------------------------------------------------------------------------------


def spec_frame(job: str, seq: int, **spec: Any) -> dict[str, Any]:
    data = orjson.dumps(spec).decode()
    return inline(job, seq, data, content_type="application/vnd.governor.job+json")


REWRITE = {"prompt": "word " * 2000, "max_new_tokens": 200}  # ~2500 tokens: heavy


async def kept_off_the_reserve(server: Server, conn: RawConn) -> dict[str, Any]:
    """On 2 slots with a reserve of 1: J_h1 runs, J_h2 is refused; its yield."""
    conn.send(spec_frame("J_h1", 1, **REWRITE))
    await wait_until(lambda: server.ledger.inflight == 1)
    conn.send(spec_frame("J_h2", 1, **REWRITE))
    refused = await conn.recv()
    assert (refused["job"], refused["status"], refused["need_code"], refused["error_code"]) == (
        "J_h2",
        "yield",
        "lane_full",
        "busy",
    )
    return refused


async def test_lanes_keep_a_slot_for_interactive_work(
    make_server: ServerFactory, raw: Opener
) -> None:
    server = await make_server(
        max_inflight=2,
        stub_ms=2000,
        lanes=True,
        interactive_reserve=1,
        prompt_ceiling=5000,
        hint_margin=0,
    )
    conn = await raw(server)
    refused = await kept_off_the_reserve(server, conn)
    assert 0 < refused["retry_hint_ms"] <= 2000
    conn.send(spec_frame("J_chat", 1, prompt="Hi!", max_new_tokens=32))
    await wait_until(lambda: server.ledger.inflight == 2)  # the reserve took the chat
    assert server.ledger.lane_inflight == {"heavy": 1, "interactive": 1}
    conn.send(spec_frame("J_huge", 1, prompt="word " * 5000, max_new_tokens=8))
    aborted = await conn.recv()
    assert (aborted["verb"], aborted["status"], aborted["need_code"], aborted["error_code"]) == (
        "confirm",
        "abort",
        "prompt_over_ceiling",
        "policy",
    )
    conn.send(spec_frame("J_odd", 1, prompt="x", lane="vip"))
    assert (await conn.recv())["need_code"] == "spec_invalid"
    assert server.admission.refusals == {("lane_full", "heavy", "default"): 1}


async def test_an_idle_reserve_is_lent_to_heavy_work(
    make_server: ServerFactory, raw: Opener, stopped_clock: FakeClock
) -> None:
    """``reserve_lend_after``: no chat for that long, a heavy job refused off the reserve is
    admitted into it when it comes back."""
    server = await make_server(
        max_inflight=2, stub_ms=2000, lanes=True, interactive_reserve=1, reserve_lend_after=0.3
    )
    conn = await raw(server)
    await kept_off_the_reserve(server, conn)
    stopped_clock.now += 0.35  # no chat since the daemon started: the reserve is lent
    conn.send(spec_frame("J_h2", 3, **REWRITE))
    await wait_until(lambda: server.ledger.inflight == 2)
    assert server.ledger.lane_inflight == {"heavy": 2}


async def test_the_overload_state_sees_a_chat_s_ttft_from_its_first_refusal(
    make_server: ServerFactory, raw: Opener
) -> None:
    """A chat held in line behind heavy work is slow for its user however fast it runs once
    admitted: the overload signal counts its wait, the TTFT metric (from admission) does not."""
    server = await make_server(max_inflight=1, stub_ms=300, lanes=True, interactive_reserve=0)
    assert server.overload is not None
    conn = await raw(server)
    conn.send(spec_frame("J_h", 1, prompt="word " * 400, max_new_tokens=200, lane="heavy"))
    await wait_until(lambda: server.ledger.inflight == 1)
    chat = spec_frame("J_chat", 1, prompt="Hi!", max_new_tokens=8)
    conn.send(chat)
    refused = await conn.recv()
    assert (refused["job"], refused["status"]) == ("J_chat", "yield")
    heavy_done = await conn.recv()
    await asyncio.sleep(0.1)
    conn.send(chat | {"seq": 3})
    done = {f["job"]: f for f in (heavy_done, await conn.recv()) if f.get("status") == "done"}
    assert set(done) == {"J_h", "J_chat"}
    admitted_ttft_ms = done["J_chat"]["result"]["ttft_ms"]
    objective_ms = server.config.interactive_ttft_slo_ms
    (observed_ms,) = [share * objective_ms for _, share in server.overload._slo["ttft"]]
    # It waited for the rest of the heavy job's 300 ms and its own 100 ms, then ran.
    assert observed_ms - admitted_ttft_ms >= 300


async def test_overload_states_drive_the_fallback_ladder(
    make_server: ServerFactory, raw: Opener
) -> None:
    server = await make_server(
        max_inflight=2,
        stub_ms=200,
        lanes=True,
        interactive_reserve=1,
        interactive_ttft_slo_ms=1,  # any measured TTFT is far over it (for the whole overload_window)
        overload_dwell=5,
        degraded_max_new_tokens=16,
    )
    conn = await raw(server)
    for i in range(5):  # interactive jobs whose TTFT (200 ms) is 200 x the objective
        conn.send(spec_frame(f"J_{i}", 1, prompt="hi", max_new_tokens=8))
        while (await conn.recv())["status"] != "done":
            pass
    assert server.overload is not None
    await wait_until(lambda: server.overload is not None and server.overload.state == 3)
    conn.send(ping("J_p", 1))
    assert receipt(await conn.recv(), "server.overload_state") == 3  # interactive_only
    # Paused, but nobody of a higher lane waits: the heavy job takes the idle slot.
    conn.send(spec_frame("J_idle", 1, prompt="word " * 2000, max_new_tokens=200))
    assert (await conn.recv())["status"] == "done"
    # Two chats run and two wait in line, one more than the reserve serves: now the heavy
    # lane yields to them.
    chats = await raw(server)
    for job in ("J_a", "J_b", "J_c", "J_d"):
        chats.send(spec_frame(job, 1, prompt="hi", max_new_tokens=8))
    for job in ("J_c", "J_d"):
        waiting = await chats.recv()
        assert (waiting["job"], waiting["need_code"]) == (job, "server_busy")
    hints = []
    for attempt in range(2):
        conn.send(spec_frame("J_heavy", 1 + attempt, prompt="word " * 2000, max_new_tokens=200))
        paused = await conn.recv()
        assert (paused["status"], paused["need_code"], paused["error_code"]) == (
            "yield",
            "lane_paused",
            "busy",
        )
        hints.append(paused["retry_hint_ms"])
    # The paused client keeps a place in line: it is told when that place comes (the chats
    # ahead of it served, a few hundred ms), not when the pause can end (about a window, 30 s,
    # away: every sample is slow). (That a hint doubles for a job paused again, up to the
    # pause's end, is shown in test_admission, on a fake clock.)
    assert all(0 < hint < 5000 for hint in hints)
    ended = [(await chats.recv())["status"] for _ in range(2)]
    assert ended == ["done", "done"]
    for job in ("J_c", "J_d"):
        chats.send({"v": 0, "verb": "cancel", "job": job, "seq": 2, "ttl_ms": 0})
        assert (await chats.recv())["need_code"] == "cancelled"  # its place in line given up
    conn.send(spec_frame("J_long_chat", 1, prompt="hi", max_new_tokens=200))
    while (done := await conn.recv())["status"] != "done":
        pass
    assert done["result"]["degraded"] == ["interactive_max_new_tokens"]
    assert done["result"]["completion_tokens"] == 16
    # One activation for the job the pause refused twice; one for the chat it shortened.
    assert server.admission.ladder == {"interactive_only": 1, "interactive_max_new_tokens": 1}
    assert server.overload.transitions[("normal", "interactive_only")] == 1


async def test_degraded_state_routes_low_priority_work_to_the_fallback_pool(
    make_server: ServerFactory, raw: Opener
) -> None:
    server = await make_server(
        max_inflight=2,
        stub_ms=50,
        lanes=True,
        interactive_reserve=1,
        fallback_model="embedded",
        overload_dwell=60,
    )
    assert server.overload is not None
    assert server.fallback is not None
    server.overload.state = State.DEGRADED  # as measured signals would set it
    server.overload.changed_at = server.ledger.clock()
    conn = await raw(server)
    conn.send(spec_frame("J_heavy", 1, prompt="word " * 2000, max_new_tokens=200))
    done = await conn.recv()
    assert (done["status"], done["result"]["degraded"]) == ("done", ["fallback_model"])
    conn.send(spec_frame("J_chat", 1, prompt="hi", max_new_tokens=8))
    chat = await conn.recv()
    assert chat["status"] == "done"
    assert "degraded" not in chat["result"]  # interactive work stays on the primary pool
    assert (server.fallback.ledger.executed_total, server.ledger.executed_total) == (1, 1)
    assert server.admission.ladder == {"fallback_model": 1}
