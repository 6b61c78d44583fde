"""``soak``: mixed load with faults for minutes on end, watching the daemon for leaks.

Starts a governor (``--runner stub``, a few ms per job, by default; ``--runner llama`` for the
embedded model in worker processes) on 127.0.0.1, or drives the one at ``--addr`` (give its
``--pid`` to read its memory and find its workers, and ``--daemon-log`` to count its
tracebacks). For ``--minutes`` it runs, at once:

* ``--clients`` clients sending jobs back to back (raw uploads and job specs, retrying on
  yield as the hints say);
* one fault every ``--fault-every-ms``, in turn: a job cancelled while it runs, a connection
  dropped (RST) mid-upload and one mid-run, a slow reader (a tiny receive buffer, pings
  pipelined until the kernel's buffers are full, nothing read; held ``--slow-hold-s``), a
  connection sending garbage lines; with the llama runner, every ``--kill-every-s``, a
  worker process SIGKILLed (a child of the daemon, from ``/proc/PID/task/*/children``).

Every ``--sample-s`` it records the daemon's resident memory (``VmRSS``), its open connections
and running jobs (a ping's ``server.connections`` and ``backend.inflight``, the monitor's own
connection not counted) and the tracebacks in its stderr so far. Then it stops the load, waits
up to ``--settle-s`` for the daemon to settle and reports: memory first, last and peak, and
whether it stayed flat (the last third of the samples within 10 % of the first third after the warm-up), slots
still held after settling (leaked), connections still open, tracebacks, and jobs by kind and
outcome. Exit status 1 if a slot leaked, a traceback appeared, or the daemon died; 2 if it could
not be started or reached. Connects to 127.0.0.1 (or ``--addr``) only; stops only the daemon it
started, by its PID; every run ends within ``--minutes`` plus the settling and a margin.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import random
import re
import select
import selectors
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from clients.client import ClientError, GovernorClient, RetryPolicy
from protocol.codes import Receipt, Status, Verb
from protocol.frames import encode_request
from protocol.spec import SPEC_CONTENT_TYPE, JobSpec
from protocol.upload import split_payload

from ..support.connections import run_loop
from ..support.options import parse_addr, positive_float, positive_int, print_json
from ..support.processes import rss_kib, stop

NAME = "soak"
LISTEN_LINE = re.compile(rb"listening on (\S+):(\d+)")
TRACEBACK = "Traceback (most recent call last)"
START_TIMEOUT_S = 120.0  # the llama runner loads a model per worker
FLAT_RATIO = 1.10  # memory is flat when the late samples are within 10 % of the early ones
FAULTS = ("cancel_mid_run", "disconnect_mid_upload", "disconnect_mid_run", "slow_reader", "garbage")
GARBAGE_LINES = (
    b"GET / HTTP/1.1\r\nHost: x\r\n",
    b"<!DOCTYPE html><html>",
    b'{"v": 0, "verb": "share"',
    b'{"v": 0, "verb": "confirm", "job": "J", "seq": 1}',
    b"[1, 2, 3]",
    b"\xef\xbb\xbf{}",
    b"\x00\x01\x02\xff\xfe",
    b"[" * 2000,
)
FAULT_TIMEOUT_S = 30.0  # any one fault's exchange; a stuck one is cut off, not waited for


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME,
        help="mixed load with faults for minutes: memory, slots, tracebacks",
        description=__doc__,
    )
    parser.add_argument(
        "--minutes", type=positive_float, default=5.0, help="how long the load and faults run"
    )
    parser.add_argument(
        "--runner",
        choices=("stub", "llama"),
        default="stub",
        help="the runner of the daemon started here",
    )
    parser.add_argument("--stub-ms", type=int, default=5, help="stub: milliseconds per job")
    parser.add_argument("--max-inflight", type=positive_int, default=4, help="the daemon's slots")
    parser.add_argument(
        "--addr", type=parse_addr, metavar="HOST:PORT", help="drive this daemon, start none"
    )
    parser.add_argument("--pid", type=int, help="with --addr: the daemon's PID (memory, workers)")
    parser.add_argument(
        "--daemon-log", type=Path, help="with --addr: the daemon's stderr, to count tracebacks"
    )
    parser.add_argument(
        "--clients", type=positive_int, default=4, help="clients sending jobs back to back"
    )
    parser.add_argument(
        "--fault-every-ms", type=positive_int, default=50, help="one fault this often"
    )
    parser.add_argument(
        "--slow-readers", type=positive_int, default=4, help="slow readers at once, at most"
    )
    parser.add_argument(
        "--slow-hold-s", type=positive_float, default=5.0, help="seconds each slow reader is held"
    )
    parser.add_argument(
        "--kill-every-s",
        type=positive_float,
        default=20.0,
        help="llama: SIGKILL a worker this often",
    )
    parser.add_argument(
        "--sample-s", type=positive_float, default=5.0, help="seconds between samples"
    )
    parser.add_argument(
        "--warmup-s",
        type=float,
        help="samples before this are warm-up (default: a quarter of the run, at most 60 s)",
    )
    parser.add_argument(
        "--settle-s",
        type=positive_float,
        default=15.0,
        help="seconds to wait at most, after the load, for the daemon to settle",
    )
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag for the daemon's 'governor serve' (repeat: --serve-arg=--write-timeout=2)",
    )
    parser.add_argument("--seed", type=int, default=0, help="of the load's random draws")


# The daemon ---------------------------------------------------------------------------------


class StderrWatch:
    """Reads a daemon's stderr to its end on a thread (a full pipe would block the daemon),
    counting tracebacks and keeping the first one."""

    def __init__(self, stream: IO[bytes], head: bytes = b"") -> None:
        self.tracebacks = 0
        self.first_traceback: list[str] = []
        self._in_traceback = False
        self._lock = threading.Lock()
        for line in head.splitlines(keepends=True):
            self._line(line)
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _line(self, raw: bytes) -> None:
        line = raw.decode(errors="replace").rstrip("\n")
        with self._lock:
            if TRACEBACK in line:
                self.tracebacks += 1
                self._in_traceback = not self.first_traceback
            if self._in_traceback and len(self.first_traceback) < 40:
                self.first_traceback.append(line)

    def _read(self, stream: IO[bytes]) -> None:
        for line in stream:
            self._line(line)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


class LogFileWatch:
    """Counts tracebacks in a daemon's log file (``--daemon-log``), from where it ended at the
    start of the run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = path.stat().st_size
        self.tracebacks = 0
        self.first_traceback: list[str] = []

    def poll(self) -> None:
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += data.rfind(b"\n") + 1
        lines = data[: data.rfind(b"\n") + 1].decode(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if TRACEBACK in line:
                self.tracebacks += 1
                if not self.first_traceback:
                    self.first_traceback = lines[i : i + 40]


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    host: str
    port: int
    stderr: StderrWatch

    def stop(self) -> int:
        """SIGTERM (drain), then SIGKILL after 15 s; its exit status."""
        status = stop(self.proc, grace_s=15)
        self.stderr.join(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return status


def start_daemon(args: argparse.Namespace) -> Daemon:
    """``governor serve`` on 127.0.0.1:0; waits for its listening line (raises OSError)."""
    flags = ["--runner", args.runner, "--max-inflight", str(args.max_inflight)]
    if args.runner == "stub":
        flags += ["--stub-ms", str(args.stub_ms)]
    else:
        flags += ["--threads", "1"]
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "governor", "serve", "--listen", "127.0.0.1:0"),
            *flags,
            *args.serve_arg,
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stderr is not None
    fd, head = proc.stderr.fileno(), b""
    deadline = time.monotonic() + START_TIMEOUT_S
    # Raw reads: a buffered readline() could keep the listening line where select() cannot see.
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0 and selector.select(timeout=left):
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            head += chunk
            if match := LISTEN_LINE.search(head[: head.rfind(b"\n") + 1]):
                watch = StderrWatch(proc.stderr, head)
                return Daemon(proc, match[1].decode(), int(match[2]), watch)
    proc.kill()
    proc.wait()
    proc.stderr.close()
    raise OSError(f"the daemon did not start: {head.decode(errors='replace')[-2000:]}")


def worker_pids(pid: int) -> list[int]:
    """The daemon's child processes (its runner's workers), from /proc."""
    children: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                children += [int(c) for c in (task / "children").read_text().split()]
    return sorted(set(children))


# The load -----------------------------------------------------------------------------------


@dataclass
class Tally:
    """Outcomes by kind: ``{kind: {outcome: count}}``."""

    counts: dict[str, collections.Counter[str]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )

    def add(self, kind: str, outcome: str) -> None:
        self.counts[kind][outcome] += 1

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {kind: dict(sorted(c.items())) for kind, c in sorted(self.counts.items())}


def outcome_of(status: Status, need_code: str | None) -> str:
    if status == Status.DONE:
        return "done"
    if status == Status.YIELD:
        return "yielded"
    return f"{status}:{need_code}" if need_code else str(status)


class Load:
    def __init__(self, args: argparse.Namespace, host: str, port: int, pid: int | None) -> None:
        self.args = args
        self.host, self.port, self.pid = host, port, pid
        self.rng = random.Random(args.seed)
        self.jobs = Tally()
        self.faults = Tally()
        self.slow_readers: list[socket.socket] = []
        self._slow_now = 0
        self._job_ids = 0
        self.tasks: set[asyncio.Task[None]] = set()

    def job_id(self, kind: str) -> str:
        self._job_ids += 1
        return f"{kind}-{self._job_ids}"

    def prompt(self) -> str:
        # The stub takes any size (the buffers are what is soaked); the model a short prompt.
        words = (
            self.rng.randint(4, 12) if self.args.runner == "llama" else self.rng.randint(4, 3000)
        )
        return "soak " * words

    def spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # Normal jobs ----------------------------------------------------------------------------

    async def client(self, stop: asyncio.Event) -> None:
        retry = RetryPolicy(max_attempts=20, max_sleep_s=1.0)
        while not stop.is_set():
            try:
                async with await GovernorClient.connect(self.host, self.port) as client:
                    while not stop.is_set():
                        await self._one_job(client, retry)
            except (ClientError, OSError, TimeoutError) as exc:
                self.jobs.add("client", f"error:{type(exc).__name__}")
                await asyncio.sleep(0.1)

    async def _one_job(self, client: GovernorClient, retry: RetryPolicy) -> None:
        spec = JobSpec(prompt=self.prompt(), max_new_tokens=self.rng.randint(1, 8), temperature=0)
        if self.rng.random() < 0.5:
            kind = "spec"
            result = await client.generate(spec, retry=retry, timeout=FAULT_TIMEOUT_S)
        else:
            kind = "upload"
            result = await client.upload(
                spec.encode(),
                content_type=SPEC_CONTENT_TYPE,
                chunk_bytes=self.rng.choice([1024, 4096, 16384]),
                retry=retry,
                timeout=FAULT_TIMEOUT_S,
            )
        self.jobs.add(kind, outcome_of(result.reply.status, result.reply.need_code))

    # Faults ---------------------------------------------------------------------------------

    async def faults_loop(self, stop: asyncio.Event) -> None:
        turn = 0
        while not stop.is_set():
            kind = FAULTS[turn % len(FAULTS)]
            turn += 1
            if kind == "slow_reader" and self._slow_now >= self.args.slow_readers:
                continue
            self.spawn(self._fault(kind))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.args.fault_every_ms / 1000)

    async def _fault(self, kind: str) -> None:
        run: Callable[[], Awaitable[str]] = getattr(self, "_" + kind)
        try:
            async with asyncio.timeout(FAULT_TIMEOUT_S + self.args.slow_hold_s):
                outcome = await run()
        except (OSError, TimeoutError, ClientError) as exc:
            outcome = f"error:{type(exc).__name__}"
        self.faults.add(kind, outcome)

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(self.host, self.port, limit=2**22)

    def _upload_frames(self, job: str) -> tuple[bytes, list[bytes]]:
        spec = JobSpec(prompt=self.prompt(), max_new_tokens=8, temperature=0)
        prep = split_payload(spec.encode(), chunk_bytes=512, content_type=SPEC_CONTENT_TYPE)
        manifest = encode_request(Verb.SHARE, job, 1, manifest=prep.manifest)
        chunks = [
            encode_request(Verb.SHARE, job, 2 + i, chunk=c) for i, c in enumerate(prep.chunks)
        ]
        return manifest, chunks

    @staticmethod
    def _reset(writer: asyncio.StreamWriter) -> None:
        """Drop the connection with a RST (SO_LINGER 0): no goodbye, unsent bytes lost."""
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async def _disconnect_mid_upload(self) -> str:
        reader, writer = await self._open()
        manifest, chunks = self._upload_frames(self.job_id("upload-rst"))
        writer.write(manifest + b"".join(chunks[:-1]) + chunks[-1][: len(chunks[-1]) // 2])
        await writer.drain()
        await reader.readline()  # the manifest's answer: the server holds the upload now
        self._reset(writer)
        return "reset"

    async def _until_running(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, job: str
    ) -> str:
        """Upload a job and return once it runs ("running"), or how it ended otherwise.

        A ping follows the last chunk: its answer before the job's terminal frame means the
        job was running when the ping was read. A refused job is retried (the final chunk
        again: the payload is held) until it runs.
        """
        manifest, chunks = self._upload_frames(job)
        data = manifest + b"".join(chunks)
        for attempt in range(50):
            writer.write(data + encode_request(Verb.PING, "probe", 1000 + attempt))
            while line := await reader.readline():
                frame = json.loads(line)
                if frame.get("job") == "probe":
                    return "running"
                if frame.get("job") == job and frame.get("status") in ("done", "abort", "yield"):
                    break
            else:
                return "closed"
            if frame["status"] != "yield":
                return str(frame["status"])
            await asyncio.sleep(frame.get("retry_hint_ms", 5) / 1000)
            data = chunks[-1]
        return "yield"

    async def _cancel_mid_run(self) -> str:
        reader, writer = await self._open()
        job = self.job_id("cancel")
        try:
            state = await self._until_running(reader, writer, job)
            if state != "running":
                return f"not_running_{state}"
            writer.write(encode_request(Verb.CANCEL, job, 2000))
            while line := await reader.readline():
                frame = json.loads(line)
                if frame.get("job") == job and frame.get("status") in ("done", "abort"):
                    return outcome_of(Status(frame["status"]), frame.get("need_code"))
            return "closed"
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _disconnect_mid_run(self) -> str:
        reader, writer = await self._open()
        try:
            state = await self._until_running(reader, writer, self.job_id("run-rst"))
        finally:
            self._reset(writer)
        return f"reset_{state}"

    async def _slow_reader(self) -> str:
        """A tiny receive buffer, pings pipelined until the kernel takes no more, nothing read."""
        self._slow_now += 1
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, (self.host, self.port))
            ping = encode_request(Verb.PING, "slow", 1)
            sent, budget = 0, 4 * 1024 * 1024  # bounded, whatever the kernel takes
            while sent < budget:
                try:
                    sent += sock.send(ping * 64)
                except BlockingIOError:
                    break
                await asyncio.sleep(0)
            await asyncio.sleep(self.args.slow_hold_s)
            closed_by_server = _peer_closed(sock)
            return "cut_off" if closed_by_server else "held"
        finally:
            self._reset_sock(sock)
            self._slow_now -= 1

    @staticmethod
    def _reset_sock(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()

    async def _garbage(self) -> str:
        reader, writer = await self._open()
        lines = self.rng.sample(GARBAGE_LINES, 3)
        if self.rng.random() < 0.2:  # over max_line_bytes: the server answers once and closes
            lines.append(b"x" * (300 * 1024))
        writer.write(b"\n".join(lines) + b"\n" + encode_request(Verb.PING, "after", 7))
        outcome = "answered"
        try:
            await writer.drain()
            while line := await reader.readline():
                frame = json.loads(line)
                if frame.get("need_code") == "line_too_large":
                    outcome = "closed_line_too_large"
                if frame.get("job") == "after":
                    break
        except ConnectionError:  # the server closed on the long line before reading it all
            outcome = "closed_line_too_large"
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return outcome

    async def worker_kills(self, stop: asyncio.Event) -> None:
        assert self.pid is not None
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.args.kill_every_s)
            if stop.is_set():
                return
            children = worker_pids(self.pid)
            if not children:
                self.faults.add("worker_kill", "no_worker")
                continue
            victim = self.rng.choice(children)
            try:
                os.kill(victim, signal.SIGKILL)
                self.faults.add("worker_kill", "killed")
            except ProcessLookupError:
                self.faults.add("worker_kill", "gone")


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the server has closed (FIN) or reset (RST) the connection. Not by reading: the
    replies the slow reader never read are still there to be read after a reset."""
    poll = select.poll()
    poll.register(sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return any(
        events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, events in poll.poll(0)
    )


# Sampling -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    t_s: float
    rss_kib: int | None
    connections: int | None  # the monitor's own not counted
    inflight: int | None
    tracebacks: int | None


async def take_sample(
    monitor: GovernorClient, pid: int | None, t0: float, tracebacks: Callable[[], int | None]
) -> Sample:
    connections = inflight = None
    with contextlib.suppress(ClientError, OSError, TimeoutError):
        reply = await monitor.ping(timeout=10.0)
        conns = reply.receipt(Receipt.CONNECTIONS)
        connections = None if conns is None else conns - 1
        inflight = reply.receipt(Receipt.INFLIGHT)
    return Sample(
        round(time.monotonic() - t0, 1),
        rss_kib(pid) if pid else None,
        connections,
        inflight,
        tracebacks(),
    )


def memory_verdict(samples: list[Sample], warmup_s: float) -> dict[str, Any]:
    """Flat when the median of the last third of the samples after the warm-up is within 10 %
    of the median of their first third (at least three samples each). Thirds, not the three
    samples at either end: the resident size goes up and down by tens of MiB with the buffers
    in flight, and three samples say where in that swing each end fell, not where it trends.
    The least-squares slope after the warm-up is reported beside it."""
    rss = [(s.t_s, s.rss_kib) for s in samples if s.rss_kib is not None]
    if not rss:
        return {"rss_kib": None, "flat": None}
    values = [v for _, v in rss]
    after = [(t, v) for t, v in rss if t >= warmup_s] or rss
    third = max(3, len(after) // 3)
    early = statistics.median(v for _, v in after[:third])
    late = statistics.median(v for _, v in after[-third:])
    return {
        "rss_kib": {"first": values[0], "last": values[-1], "max": max(values)},
        "rss_after_warmup_kib": early,
        "rss_final_kib": late,
        "rss_growth_ratio": round(late / early, 3) if early else None,
        "rss_slope_kib_per_min": round(_slope(after) * 60, 1),
        "flat": late <= early * FLAT_RATIO,
        "warmup_s": warmup_s,
    }


def _slope(points: list[tuple[float, int]]) -> float:
    """Least squares, per second (0 for fewer than two distinct times)."""
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / spread if spread else 0.0


# The run ------------------------------------------------------------------------------------


async def soak(
    args: argparse.Namespace,
    host: str,
    port: int,
    pid: int | None,
    tracebacks: Callable[[], int | None],
) -> dict[str, Any]:
    duration = args.minutes * 60
    warmup = args.warmup_s if args.warmup_s is not None else min(duration / 4, 60.0)
    load = Load(args, host, port, pid)
    stop = asyncio.Event()
    samples: list[Sample] = []
    async with await GovernorClient.connect(host, port) as monitor:
        t0 = time.monotonic()
        samples.append(await take_sample(monitor, pid, t0, tracebacks))
        for _ in range(args.clients):
            load.spawn(load.client(stop))
        load.spawn(load.faults_loop(stop))
        if args.runner == "llama" and pid is not None:
            load.spawn(load.worker_kills(stop))
        while (left := duration - (time.monotonic() - t0)) > 0:
            await asyncio.sleep(min(args.sample_s, left))
            samples.append(await take_sample(monitor, pid, t0, tracebacks))
        # Stop: no new work; what is in flight ends (or is cut off) on its own timeouts.
        stop.set()
        load_ended = time.monotonic()
        tasks = set(load.tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=FAULT_TIMEOUT_S + args.slow_hold_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if not task.cancelled() and (exc := task.exception()) is not None:
                raise exc  # a bug in the soak itself, not an outcome
        # Settle: the daemon ends its jobs and closes the connections of clients gone.
        settled = await take_sample(monitor, pid, t0, tracebacks)
        deadline = time.monotonic() + args.settle_s
        while (settled.inflight != 0 or settled.connections != 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            settled = await take_sample(monitor, pid, t0, tracebacks)
        settle_s = time.monotonic() - load_ended
    jobs = load.jobs.as_dict()
    totals: collections.Counter[str] = collections.Counter()
    for kind in ("spec", "upload"):
        for outcome, n in jobs.get(kind, {}).items():
            bucket = outcome if outcome in ("done", "yielded") else "errored"
            totals[bucket] += n
    return {
        "command": NAME,
        "runner": args.runner,
        "minutes": args.minutes,
        "samples": [dataclasses.asdict(s) for s in samples],
        "memory": memory_verdict(samples, warmup),
        "settled": dataclasses.asdict(settled),
        "settle_s": round(settle_s, 1),
        "leaked_slots": settled.inflight,
        "connections_after_settle": settled.connections,
        "tracebacks": tracebacks(),
        "jobs_total": {k: totals.get(k, 0) for k in ("done", "yielded", "errored")},
        "jobs": jobs,
        "faults": load.faults.as_dict(),
    }


def run(args: argparse.Namespace) -> int:
    if args.addr is not None and args.runner == "llama" and args.pid is None:
        print("loadtest soak: --runner llama with --addr needs --pid to find the workers")
        return 2
    daemon: Daemon | None = None
    log_watch: LogFileWatch | None = None
    try:
        if args.addr is None:
            daemon = start_daemon(args)
            host, port, pid = daemon.host, daemon.port, daemon.proc.pid
            watch = daemon.stderr

            def tracebacks() -> int | None:
                return watch.tracebacks
        else:
            (host, port), pid = args.addr, args.pid
            if args.daemon_log is not None:
                log_watch = LogFileWatch(args.daemon_log)
            watch_file = log_watch

            def tracebacks() -> int | None:
                if watch_file is None:
                    return None
                watch_file.poll()
                return watch_file.tracebacks
    except OSError as exc:
        print(f"loadtest soak: {exc}")
        return 2
    try:
        report = run_loop(soak(args, host, port, pid, tracebacks))
    except (OSError, ClientError) as exc:
        print(f"loadtest soak: cannot drive the daemon at {host}:{port}: {exc}")
        return 2
    finally:
        died = daemon is not None and daemon.proc.poll() is not None
        exit_status = daemon.stop() if daemon is not None else None
    report["daemon_died"] = died
    report["daemon_exit_status"] = exit_status
    first = (
        daemon.stderr.first_traceback
        if daemon
        else (log_watch.first_traceback if log_watch else [])
    )
    report["first_traceback"] = first or None
    if daemon is not None:
        report["tracebacks"] = daemon.stderr.tracebacks  # through the drain too
    mem = report["memory"]
    rss = mem["rss_kib"]
    print(
        f"soak {args.minutes:g} min ({args.runner}): jobs {report['jobs_total']}, faults "
        + ", ".join(f"{k} {sum(v.values())}" for k, v in report["faults"].items())
    )
    if rss is not None:
        print(
            f"daemon RSS first {rss['first'] / 1024:.1f} MiB, last {rss['last'] / 1024:.1f} MiB, "
            f"max {rss['max'] / 1024:.1f} MiB; after warm-up {mem['rss_after_warmup_kib'] / 1024:.1f}"
            f" -> {mem['rss_final_kib'] / 1024:.1f} MiB: {'flat' if mem['flat'] else 'GROWING'}"
        )
    print(
        f"after {report['settle_s']} s settling: {report['leaked_slots']} slot(s) held, "
        f"{report['connections_after_settle']} connection(s) open; "
        f"{report['tracebacks']} traceback(s); daemon died: {died}"
    )
    print_json(args, report)
    leaked = report["leaked_slots"] != 0
    return 1 if leaked or bool(report["tracebacks"]) or died else 0
