"""A connection's objects are freed when it ends by their reference counts, not left for the
cycle collector: on both doors, whether its job yielded, ran to its end, or still ran when its
client left. (A burst of new connections spent a good share of the daemon's CPU collecting the
cycles each left behind.) As Python, a job cancelled as its client leaves stays in a cycle of
its coroutine's own (the interpreter's, not the governor's): that case runs on the compiled
build alone. The connections here are the listeners' own protocols on a
transport that records what is written, in a started server; no socket."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from governor.compiled import status
from governor.listeners.http import HttpConnection
from governor.listeners.tcp import GovernorProtocol
from governor.server import Server
from protocol.codes import Verb
from protocol.frames import encode_request
from protocol.upload import split_payload
from tests.conftest import ServerFactory, wait_until

CHAT = b'{"messages":[{"role":"user","content":"hello"}],"max_tokens":2}'


class Transport:
    """What the protocols use of a transport: the writes kept, the close recorded."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closing = False
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def write(self, data: bytes) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    abort = close

    def get_write_buffer_size(self) -> int:
        return 0

    def is_reading(self) -> bool:
        return self.reading

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


def upload(job: str) -> bytes:
    prepared = split_payload(b"hello", chunk_bytes=8192)
    frames = encode_request(Verb.SHARE, job, 1, ttl_ms=0, manifest=prepared.manifest)
    return frames + encode_request(Verb.SHARE, job, 2, ttl_ms=0, chunk=prepared.chunks[0])


def chat() -> bytes:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    return head + b"content-length: %d\r\n\r\n%b" % (len(CHAT), CHAT)


@pytest.fixture
def no_collector() -> Iterator[Callable[[], list[str]]]:
    """The collector off meanwhile; the call returns the governor's objects it would have had
    to free (those in cycles no reference count frees)."""
    gc.collect()
    gc.disable()

    def cycles() -> list[str]:
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            ours = [type(o) for o in gc.garbage if type(o).__module__.startswith("governor.")]
            return sorted(f"{t.__module__}.{t.__qualname__}" for t in ours)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()

    yield cycles
    gc.enable()


def tcp(server: Server) -> tuple[GovernorProtocol, Transport]:
    listener = server._tcp
    assert listener is not None
    conn, transport = GovernorProtocol(server.state, listener.deadlines), Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport


def http(server: Server) -> tuple[HttpConnection, Transport]:
    door = server._front
    assert door is not None
    conn, transport = HttpConnection(door), Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport


@pytest.mark.parametrize("door", ["tcp", "http"])
@pytest.mark.parametrize("end", ["yielded", "ran", "left_running"])
async def test_a_connection_leaves_nothing_for_the_cycle_collector(
    make_server: ServerFactory, no_collector: Callable[[], list[str]], door: str, end: str
) -> None:
    if end == "left_running" and status()["governor.execution"] != "compiled":
        pytest.skip("as Python, a cancelled job's coroutine keeps its execution in a cycle")
    stub_ms = 0 if end == "ran" else 60_000
    server = await make_server(http_listen="127.0.0.1:0", stub_ms=stub_ms, max_inflight=1)
    connect = tcp if door == "tcp" else http
    request = upload if door == "tcp" else (lambda _: chat())
    if end == "yielded":  # the slot taken by another connection's job
        holder, _ = connect(server)
        holder.data_received(request("J_hold"))
        await wait_until(lambda: server.inflight == 1)
    gc.collect()  # (what earlier servers left: only this connection's objects are counted)
    conn, transport = connect(server)
    conn.data_received(request("J_1"))
    out = transport.out
    if end == "ran":
        answered = b'"done"' if door == "tcp" else b" 200 "
        await wait_until(lambda: server.inflight == 0 and answered in out)
    else:
        expected = {"yielded": b"yield" if door == "tcp" else b"429", "left_running": b""}[end]
        assert expected in out
    conn.connection_lost(None)
    del conn, transport
    if end == "left_running":
        await wait_until(lambda: server.inflight == 0)
    for _ in range(3):
        await asyncio.sleep(0)  # (the execution's done-callbacks)
    left = no_collector()
    assert left == [], "\n".join(left)
