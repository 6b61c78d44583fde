"""``attack``: one of a hostile network's attacks on the daemon, and what it costs a bystander.

Kinds (each bounded by ``--hold`` seconds, to 127.0.0.1 only):

- ``slow-readers``: ``--clients`` sockets with a 4 KiB receive buffer pipeline pings and
  read nothing.
- ``budget``: 16 connections each declare 8 payloads of 8 MiB and send no chunk.
- ``lockout``: ``--clients`` connections from 127.0.0.1, each pinging every 5 s, and
  reconnecting at once when the daemon closed it.
- ``keys``: one client guesses API keys as fast as the daemon answers, reconnecting when
  closed (run the daemon with a tenant declared); the report counts the keys checked
  (``guesses``) and those refused unchecked, their turn too far off.
- ``typo``: a misconfigured client: each second a new connection sends four jobs with a wrong
  key in one write (run the daemon with a tenant declared).
- ``tiny-chunks``: 8 connections each upload 65,535 chunks of 2 bytes and never the last one.
- ``admin-trickle``: ``--clients`` connections to the HTTP listener (``--metrics-listen``), each
  sending its request head a byte every 3 s; reports the daemon's threads.
- ``metrics-flood``: ``GET /metrics`` at ``--rate`` a second (8 clients, one request per
  connection) on the HTTP listener.

Meanwhile a bystander on another loopback address (``--bystander``, default 127.0.0.2; give
127.0.0.1 for a neighbour on the attacker's own address) pings every 50 ms; at the end it runs
one small job. The report gives the daemon's RSS (``--pid``)
before, at its highest and after, the bystander's ping latency and failures, the connections
the daemon still holds at the end (its ``server.connections`` receipt) and the job's answer.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import hashlib
import socket
import time
from typing import Any

from clients.helptext import add_renamed
from governor.core.sources import KEY_TURN_FAR
from protocol.codes import Receipt, Status, Verb
from protocol.errors import ReplyInvalid
from protocol.frames import Reply, decode_reply, encode_request

from ..support.connections import add_key_arguments, api_key_from, run_loop
from ..support.options import DEFAULT_ADDR, parse_addr, positive_float, positive_int, print_json
from ..support.processes import proc_status, rss_kib
from ..support.stats import percentile

NAME = "attack"
KINDS = (
    "slow-readers",
    "budget",
    "lockout",
    "keys",
    "typo",
    "tiny-chunks",
    "admin-trickle",
    "metrics-flood",
)
TINY_CHUNKS = 65536


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME, help="an attack on the daemon, and what a bystander sees", description=__doc__
    )
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument(
        "--addr", type=parse_addr, default=DEFAULT_ADDR, metavar="HOST:PORT", help="the daemon"
    )
    parser.add_argument("--pid", type=int, help="the daemon's PID, to read its memory")
    parser.add_argument(
        "--clients", type=positive_int, default=60, help="slow-readers, lockout: connections"
    )
    parser.add_argument(
        "--hold", type=positive_float, default=20.0, help="seconds the attack lasts"
    )
    parser.add_argument("--bystander", default="127.0.0.2", help="the bystander's source address")
    add_key_arguments(parser)  # the bystander's key, as the traffic commands take theirs
    listen = parser.add_argument(
        "--metrics-listen",
        type=parse_addr,
        metavar="HOST:PORT",
        help="the HTTP listener (the daemon's metrics_listen)",
    )
    add_renamed(parser, "--metrics-addr", listen)
    parser.add_argument(
        "--rate", type=positive_float, default=1227.0, help="metrics-flood: requests per second"
    )


class Bystander:
    """Pings every 50 ms from its own address, reconnecting when refused; a job at the end."""

    def __init__(self, addr: tuple[str, int], source: str, api_key: str | None) -> None:
        self.addr, self.source, self.api_key = addr, source, api_key
        self.latencies_ms: list[float] = []
        self.failures = 0
        self.connections: int | None = None
        self._seq = 0

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.wait_for(
            asyncio.open_connection(*self.addr, local_addr=(self.source, 0), limit=2**22), 5
        )

    async def _ask(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, line: bytes
    ) -> Reply:
        writer.write(line)
        answer = await asyncio.wait_for(reader.readline(), 5)
        if not answer:
            raise ConnectionError("closed")
        return decode_reply(answer)

    async def ping_until(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                reader, writer = await self._open()
            except (OSError, TimeoutError):
                self.failures += 1
                await asyncio.sleep(0.05)
                continue
            try:
                while not stop.is_set():
                    self._seq += 1
                    started = time.perf_counter()
                    ping = encode_request(Verb.PING, "J_p", self._seq, api_key=self.api_key)
                    reply = await self._ask(reader, writer, ping)
                    if reply.status != Status.OK:
                        self.failures += 1
                        break
                    self.latencies_ms.append((time.perf_counter() - started) * 1000)
                    self.connections = reply.receipt(Receipt.CONNECTIONS)
                    await asyncio.sleep(0.05)
            except (OSError, TimeoutError, ConnectionError, ReplyInvalid):
                self.failures += 1
            finally:
                writer.close()

    async def job(self) -> str:
        """One job on a new connection: its answer, and the time from connecting to it."""
        data = "a bystander's job"
        inline = {"data": data, "sha256": hashlib.sha256(data.encode()).hexdigest()}
        share = encode_request(Verb.SHARE, "J_b", 1, inline=inline, api_key=self.api_key)
        started = time.perf_counter()
        try:
            reader, writer = await self._open()
            try:
                reply = await self._ask(reader, writer, share)
            finally:
                writer.close()
        except (OSError, TimeoutError, ConnectionError, ReplyInvalid) as exc:
            return f"failed: {exc!r}"
        ms = (time.perf_counter() - started) * 1000
        return f"{reply.status} {reply.need_code or ''}".strip() + f" in {ms:.0f} ms"


async def slow_readers(args: argparse.Namespace, stop: asyncio.Event) -> dict[str, Any]:
    pings = b"".join(encode_request(Verb.PING, "J_s", i) for i in range(1, 5001))
    socks: list[socket.socket] = []
    for _ in range(args.clients):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(args.addr)
        sock.setblocking(False)
        socks.append(sock)
    sent = 0
    try:
        while not stop.is_set():
            for sock in socks:
                with contextlib.suppress(BlockingIOError, OSError):
                    sent += sock.send(pings)
            await asyncio.sleep(0.05)
    finally:
        for sock in socks:
            sock.close()
    return {"bytes_sent": sent}


async def budget(args: argparse.Namespace, stop: asyncio.Event) -> dict[str, Any]:
    manifest = {
        "payload_id": "P",
        "total_bytes": 8 << 20,
        "chunk_bytes": 65536,
        "chunks": 128,
        "sha256": "0" * 64,
    }
    writers = []
    for _ in range(16):
        _, writer = await asyncio.open_connection(*args.addr)
        writer.write(
            b"".join(encode_request(Verb.SHARE, f"J_{j}", 1, manifest=manifest) for j in range(8))
        )
        writers.append(writer)
    seq = 1
    while not stop.is_set():  # pings keep the connections, as before
        await asyncio.sleep(1.0)
        seq += 1
        for writer in writers:
            if not writer.transport.is_closing():
                writer.write(encode_request(Verb.PING, "J_k", seq))
    for writer in writers:
        writer.close()
    return {"declared_bytes": 16 * 8 * (8 << 20)}


async def lockout(args: argparse.Namespace, stop: asyncio.Event) -> dict[str, Any]:
    opened = 0

    async def flood(first_ping: float) -> None:
        nonlocal opened
        await asyncio.sleep(first_ping)
        seq = 0
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(*args.addr)
            except OSError:
                await asyncio.sleep(1.0)
                continue
            opened += 1
            try:
                while not stop.is_set():
                    seq += 1
                    writer.write(encode_request(Verb.PING, "J_l", seq))
                    line = await asyncio.wait_for(reader.readline(), 10)
                    if not line or decode_reply(line).status != Status.OK:
                        break  # closed (displaced, or no key within auth_grace): again
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 5.0)
            except (OSError, TimeoutError, RuntimeError, ReplyInvalid):
                pass
            finally:
                writer.close()

    tasks = [asyncio.create_task(flood(i / args.clients)) for i in range(args.clients)]
    await stop.wait()
    await asyncio.gather(*tasks)
    return {"attacker_connections": args.clients, "connections_opened": opened}


async def keys(args: argparse.Namespace, stop: asyncio.Event) -> dict[str, Any]:
    data = "x"
    inline = {"data": data, "sha256": hashlib.sha256(data.encode()).hexdigest()}
    guesses = connections = refused = 0
    started = time.monotonic()
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(*args.addr)
        except OSError:
            await asyncio.sleep(0.01)
            continue
        connections += 1
        try:
            while not stop.is_set():
                writer.write(
                    encode_request(
                        Verb.SHARE, f"J_{guesses}", 1, inline=inline, api_key=f"g{guesses}"
                    )
                )
                line = await asyncio.wait_for(reader.readline(), 15)
                if not line:
                    break
                reply = decode_reply(line)
                if reply.need_code == "unauthorized" and reply.detail != KEY_TURN_FAR:
                    guesses += 1  # (checked, and failed)
                else:  # not checked: a key whose turn is far off, or an address refused
                    refused += 1
        except (OSError, TimeoutError, RuntimeError):  # (uvloop: a write after the close)
            pass
        finally:
            writer.close()
    elapsed = time.monotonic() - started
    return {
        "guesses": guesses,
        "guesses_per_s": round(guesses / elapsed, 1),
        "connections": connections,
        "refused_unchecked": refused,  # (before 2026-11-26: auth_backoff refusals)
    }


async def typo(args: argparse.Namespace, stop: asyncio.Event) -> dict[str, Any]:
    """A misconfigured client: every second, a new connection and four jobs with a wrong key
    in one write (it is closed after ``max_auth_failures`` of them)."""
    data = "x"
    inline = {"data": data, "sha256": hashlib.sha256(data.encode()).hexdigest()}
    rounds = answered = 0
    while not stop.is_set():
        rounds += 1
        with contextlib.suppress(OSError, TimeoutError):
            reader, writer = await asyncio.open_connection(*args.addr)
            writer.write(
                b"".join(
                    encode_request(Verb.SHARE, f"J_{i}", 1, inline=inline, api_key="k-typo")
                    for i in range(4)
                )
            )
            while await asyncio.wait_for(reader.readline(), 5):
                answered += 1
            writer.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
    return {"rounds": rounds, "answers": answered}


async def tiny_chunks(args: argparse.Namespace, stop: asyncio.Event) -> dict[str, Any]:
    piece = b"ab"
    chunk = {
        "payload_id": "P",
        "sha256": hashlib.sha256(piece).hexdigest(),
        "bytes_b64": base64.b64encode(piece).decode(),
    }
    manifest = {
        "payload_id": "P",
        "total_bytes": 2 * TINY_CHUNKS,
        "chunk_bytes": 2,
        "chunks": TINY_CHUNKS,
        "sha256": "0" * 64,
    }

    async def one(n: int) -> int:
        reader, writer = await asyncio.open_connection(*args.addr, limit=2**22)
        answered = 0

        async def read() -> None:  # (a client that reads: the daemon keeps taking its frames)
            nonlocal answered
            with contextlib.suppress(OSError):
                while await reader.readline():
                    answered += 1

        reading = asyncio.create_task(read())
        writer.write(encode_request(Verb.SHARE, f"J_{n}", 1, manifest=manifest))
        for first in range(0, TINY_CHUNKS - 1, 1024):
            writer.write(
                b"".join(
                    encode_request(
                        Verb.SHARE, f"J_{n}", 2 + i, chunk={**chunk, "index": i, "offset": 2 * i}
                    )
                    for i in range(first, min(first + 1024, TINY_CHUNKS - 1))
                )
            )
            try:
                await writer.drain()
            except OSError:
                break
        await stop.wait()
        writer.close()
        reading.cancel()
        return answered

    answered = await asyncio.gather(*(one(n) for n in range(8)))
    return {"chunks_sent": 8 * (TINY_CHUNKS - 1), "answered": sum(answered)}


def threads(pid: int | None) -> int | None:
    return None if pid is None else proc_status(pid, "Threads")


def metrics_listen(args: argparse.Namespace) -> tuple[str, int]:
    if args.metrics_listen is None:
        raise SystemExit(f"loadtest attack {args.kind}: --metrics-listen is needed")
    addr: tuple[str, int] = args.metrics_listen
    return addr


async def admin_trickle(args: argparse.Namespace, stop: asyncio.Event) -> dict[str, Any]:
    host, port = metrics_listen(args)
    head = f"GET /metrics HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()

    async def connect() -> asyncio.StreamWriter | None:
        try:
            return (await asyncio.open_connection(host, port))[1]
        except OSError:
            return None

    made = await asyncio.gather(*(connect() for _ in range(args.clients)))
    writers = [w for w in made if w is not None]
    sent = 0
    while not stop.is_set() and sent < len(head):
        for writer in writers:
            if not writer.transport.is_closing():
                writer.write(head[sent : sent + 1])
        sent += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 3.0)
    cut = sum(writer.transport.is_closing() for writer in writers)
    for writer in writers:
        writer.close()
    return {"connections": len(writers), "cut_by_daemon": cut}


async def metrics_flood(args: argparse.Namespace, stop: asyncio.Event) -> dict[str, Any]:
    host, port = metrics_listen(args)
    request = f"GET /metrics HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    statuses: collections.Counter[str] = collections.Counter()
    started = time.monotonic()
    interval = 8 / args.rate  # each of 8 clients

    async def client(k: int) -> None:
        due = started + k * interval / 8
        while not stop.is_set():
            due += interval
            try:
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(request)
                status = (await reader.readline()).split(b" ")[1:2]
                statuses[status[0].decode() if status else "none"] += 1
                await reader.read()
                writer.close()
            except (OSError, IndexError):
                statuses["error"] += 1
            await asyncio.sleep(max(0.0, due - time.monotonic()))

    await asyncio.gather(*(client(k) for k in range(8)))
    elapsed = time.monotonic() - started
    return {"requests_per_s": round(sum(statuses.values()) / elapsed), "statuses": statuses}


ATTACKS = {
    "slow-readers": slow_readers,
    "budget": budget,
    "lockout": lockout,
    "keys": keys,
    "typo": typo,
    "tiny-chunks": tiny_chunks,
    "admin-trickle": admin_trickle,
    "metrics-flood": metrics_flood,
}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    stop = asyncio.Event()
    bystander = Bystander(args.addr, args.bystander, api_key_from(args))
    rss_before = rss_kib(args.pid) if args.pid else None
    peak = rss_before or 0
    most_threads = threads(args.pid) or 0
    watching = asyncio.create_task(bystander.ping_until(stop))
    attack = asyncio.create_task(ATTACKS[args.kind](args, stop))
    deadline = time.monotonic() + args.hold
    while time.monotonic() < deadline and not attack.done():
        await asyncio.sleep(0.25)
        if args.pid:
            peak = max(peak, rss_kib(args.pid) or 0)
            most_threads = max(most_threads, threads(args.pid) or 0)
    held_at_end = bystander.connections  # (the bystander's own connection included)
    job = await bystander.job()  # while the attack still runs
    stop.set()
    outcome = await attack
    await watching
    await asyncio.sleep(1.0)
    latencies = sorted(bystander.latencies_ms)
    return {
        "command": NAME,
        "kind": args.kind,
        "hold_s": args.hold,
        "attack": outcome,
        "rss_before_mib": None if rss_before is None else round(rss_before / 1024, 1),
        "rss_peak_mib": round(peak / 1024, 1) if args.pid else None,
        "rss_after_mib": round((rss_kib(args.pid) or 0) / 1024, 1) if args.pid else None,
        "daemon_threads_max": most_threads if args.pid else None,
        "bystander_pings": len(latencies),
        "bystander_failures": bystander.failures,
        "bystander_ping_p50_ms": round(percentile(latencies, 50), 3) if latencies else None,
        "bystander_ping_p99_ms": round(percentile(latencies, 99), 3) if latencies else None,
        "connections_held_at_end": held_at_end,
        "bystander_job": job,
    }


def run(args: argparse.Namespace) -> int:
    report = run_loop(measure(args))
    print(
        f"{args.kind}: daemon RSS {report['rss_before_mib']} -> peak {report['rss_peak_mib']} "
        f"-> {report['rss_after_mib']} MiB; bystander pings p99 "
        f"{report['bystander_ping_p99_ms']} ms, {report['bystander_failures']} failed; "
        f"connections held at the end {report['connections_held_at_end']}; "
        f"its job: {report['bystander_job']}"
    )
    print_json(args, report)
    return 0
