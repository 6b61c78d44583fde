"""``door-refusal``: what a refusal at the front door costs the server, for a client that asks
not to wait (``x-governor-max-wait-ms: 0``).

A governor on the stub runner, one slot, held by a request that runs for the whole test. Then
``--requests`` chat requests asking for no wait, one after the other on one keep-alive
connection (each a 429 ``server_busy`` with its hint), and as many ``GET /v1/models`` (the
cheapest answer the front door gives: parsing and writing HTTP, no admission). For each kind:
the daemon's CPU time per answer (its user and system seconds from ``/proc``, over the run,
divided by the answers: the server's time, whatever the client costs) and the round trip as the
client saw it, p50 and p99 (the server's time plus the client's and the kernel's: an upper
bound). ``--rounds`` alternate the two kinds. With ``--json``, the last line of stdout is the
report as JSON.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from typing import Any

import orjson

from clients.helptext import RawDescriptionDefaultsHelpFormatter

from ..support.options import positive_int, print_json
from ..support.processes import REPO, cpu_s, free_port, stop, wait_http_ready
from ..support.stats import percentile

NAME = "door-refusal"
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def request(path: str, body: bytes | None, headers: tuple[str, ...] = ()) -> bytes:
    method = "POST" if body is not None else "GET"
    lines = [f"{method} {path} HTTP/1.1", "host: governor", *headers]
    if body is not None:
        lines += ["content-type: application/json", f"content-length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


def read_answer(sock: socket.socket, pending: bytearray) -> int:
    """Read one answer (a head with content-length, then its body); returns its status."""
    while b"\r\n\r\n" not in pending:
        pending += sock.recv(65536)
    head, _, rest = bytes(pending).partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        rest += sock.recv(65536)
    pending[:] = rest[length:]
    return int(head.split(b" ", 2)[1])


def measure(port: int, pid: int, wire: bytes, count: int, expect: int) -> dict[str, Any]:
    """``count`` answers to ``wire``, one after the other on one connection."""
    times: list[float] = []
    pending = bytearray()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(10):  # (warm: the connection, the server's caches)
            sock.sendall(wire)
            read_answer(sock, pending)
        cpu_before = cpu_s(pid)
        for _ in range(count):
            started = time.perf_counter()
            sock.sendall(wire)
            status = read_answer(sock, pending)
            times.append(time.perf_counter() - started)
            if status != expect:
                raise RuntimeError(f"expected {expect}, got {status}")
        cpu = cpu_s(pid) - cpu_before
    return {
        "answers": count,
        "server_cpu_us_per_answer": round(cpu / count * 1e6, 1),
        "rtt_p50_us": round(percentile(times, 50) * 1e6, 1),
        "rtt_p99_us": round(percentile(times, 99) * 1e6, 1),
    }


def bench(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    argv = [
        sys.executable,
        *("-m", "governor", "serve", "--runner", "stub", "--stub-ms", "3600000"),
        *("--max-inflight", "1", "--listen", "127.0.0.1:0", "--http-listen", f"127.0.0.1:{port}"),
        *("--probe-interval", "600", "--log-level", "warning"),
    ]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_http_ready(proc, f"http://127.0.0.1:{port}/v1/models", "governor", 60.0)
        holder = socket.create_connection(("127.0.0.1", port))
        holder.sendall(request("/v1/chat/completions", BODY))
        time.sleep(0.5)  # (its job takes the slot)
        refusal = request("/v1/chat/completions", BODY, ("x-governor-max-wait-ms: 0",))
        models = request("/v1/models", None)
        rows = []
        for _ in range(args.rounds):
            rows.append({"kind": "refusal"} | measure(port, proc.pid, refusal, args.requests, 429))
            rows.append({"kind": "models"} | measure(port, proc.pid, models, args.requests, 200))
        holder.close()
    finally:
        stop(proc)
    summary = {}
    for kind in ("refusal", "models"):
        mine = [r for r in rows if r["kind"] == kind]
        summary[kind] = {
            key: sorted(r[key] for r in mine)[len(mine) // 2]
            for key in ("server_cpu_us_per_answer", "rtt_p50_us", "rtt_p99_us")
        }
    return {"requests": args.requests, "rounds": args.rounds, "runs": rows, "median": summary}


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        NAME,
        help="the server's time for a no-wait 429 at the front door",
        description=__doc__,
        formatter_class=RawDescriptionDefaultsHelpFormatter,
    )
    parser.add_argument("--requests", type=positive_int, default=2000, help="answers per run")
    parser.add_argument("--rounds", type=positive_int, default=3, help="runs of each kind")


def run(args: argparse.Namespace) -> int:
    report = bench(args)
    for row in report["runs"]:
        print(
            f"{row['kind']:8} server {row['server_cpu_us_per_answer']:7.1f} us/answer  "
            f"round trip p50 {row['rtt_p50_us']:7.1f} us  p99 {row['rtt_p99_us']:7.1f} us"
        )
    print_json(args, report)
    return 0
