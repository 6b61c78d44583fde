"""The count holds whatever the clients do: slots held equal the jobs with a live execution.

Real servers over real loopback sockets, on both event loops: first the interleavings that
leaked every slot while a job's slot was freed by a ``finally`` in its task (which never runs
for a task cancelled before its first step): a job and its cancel in one write, a job and an
over-long line, one job too many, a reset. Then one hypothesis state machine
(``tests/inprocess/interleavings.py``) through each door, the TCP frame protocol (``tests/inprocess/door_tcp.py``)
and the OpenAI front door (``tests/inprocess/door_http.py``): random interleavings of jobs, cancels,
retries, clients that leave anyhow, jobs that finish or fail when the test says so and a drain,
checking after every step that the slots, the tenants' counts and the buffers add up, that
nothing runs on for a client that has gone, and that everything a client sent that asks for an
answer gets one, never two; at the end, that everything is given back.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
import uvloop
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from governor.core.ledger import Refusal
from governor.server import Server
from loadtest.support.redisserver import RedisServer
from tests.conftest import RawConn, ServerFactory, wait_until

from .door_http import HttpDoor
from .door_tcp import LINE_LIMIT, TcpDoor, cancel, inline, job_bytes, ping
from .interleavings import Door, Interleavings, given_back, machine

__all__ = ["inline"]  # (the fleet's tests send these frames too)


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


# Random interleavings, through each door -------------------------------------------------

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}
DOORS: dict[str, Callable[[Interleavings], Door]] = {"tcp": TcpDoor, "http": HttpDoor}
# Each door's examples and steps: the front door's steps are slower (real time passes at its
# door), its examples fewer and longer (a drain comes after eight steps).
BUDGET = {"tcp": (40, 20), "http": (25, 25)}


@pytest.mark.slow
@pytest.mark.parametrize("loop", sorted(LOOPS))
@pytest.mark.parametrize("door", sorted(DOORS))
def test_random_interleavings_never_leak(door: str, loop: str) -> None:
    # A plain test on a loop of the machine's own: pytest-asyncio's loop takes no part.
    examples, steps = BUDGET[door]
    run_state_machine_as_test(
        machine(DOORS[door], LOOPS[loop]),
        settings=settings(max_examples=examples, stateful_step_count=steps, deadline=None),
    )


# A store that answers in time; one slower than fleet_timeout for nearly every job (its breaker
# opens, every lane fails open): admissions decided on the share and the store's late grants mix.
# And, with no fleet cap, an idle replica beside this one: the store places this replica's busy
# yields, sending some jobs there (their payloads dropped here) and keeping others.
STORES: dict[str, dict[str, Any]] = {
    "answering": {"fleet_max_inflight": 1},
    "slow": {"fleet_max_inflight": 1, "fleet_timeout": 0.0003, "fleet_fail_open": "all"},
    "placing": {"neighbour": True},
}


@pytest.mark.slow
@pytest.mark.parametrize("store", sorted(STORES))
def test_random_interleavings_never_leak_with_a_fleet(
    redis_server: RedisServer, store: str
) -> None:
    """The same through the TCP door, with a fleet cap of 1 under the server's 3: jobs admitted
    here are refused by the fleet and taken back (their payloads held for a retry) amid
    cancels, resets and the drain; nothing may leak, and the runner never runs more than the
    fleet leased, nor this replica more than the fleet's cap, whether the store answers in time
    or not. Without the cap, beside another replica, busy yields wait for the store's word and
    some jobs are sent there, amid the same."""
    config: dict[str, Any] = {"redis_url": redis_server.url, **STORES[store]}
    run_state_machine_as_test(
        machine(TcpDoor, uvloop.new_event_loop, config),
        settings=settings(max_examples=30, stateful_step_count=20, deadline=None),
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
