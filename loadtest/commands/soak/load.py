"""The load of ``soak``: clients sending jobs back to back, the faults among them, and their
tally."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import select
import signal
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from clients.client import ClientError, GovernorClient, RetryPolicy
from protocol.codes import Status, Verb
from protocol.frames import encode_request
from protocol.spec import SPEC_CONTENT_TYPE, JobSpec
from protocol.upload import split_payload

from .daemon import worker_pids

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
