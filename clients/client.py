"""An asyncio client for the governor (and for heptamini's daemon: it speaks plain v0).

One :class:`GovernorClient` is one connection. Several operations may run on it at once: a
reader task routes each reply to the operation waiting on its job id.

On ``yield`` :meth:`GovernorClient.upload` sleeps for the server's ``retry_hint_ms`` (plus
jitter, so that refused clients do not come back in lockstep) and resends the final chunk,
which the governor kept; a bounded :class:`RetryPolicy` says how many attempts in all.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Self

from protocol.codes import Receipt, Status, Verb
from protocol.errors import ReplyInvalid
from protocol.frames import Reply, decode_reply, encode_request
from protocol.spec import SPEC_CONTENT_TYPE, JobSpec
from protocol.upload import split_payload

MAX_REPLY_BYTES = 16 * 1024 * 1024
INLINE_MAX_BYTES = 64 * 1024  # well within the server's default max_line_bytes


class ClientError(Exception):
    """The exchange with the server broke off."""


class ConnectionLost(ClientError):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How an upload answers ``yield``.

    ``max_attempts`` counts admission attempts in all: 1 never retries. By default the client
    sleeps ``retry_hint_ms`` plus a random ``jitter`` (up to ``jitter_ratio`` of the hint, at
    most ``max_jitter_s``), capped at ``max_sleep_s``. ``fixed_delay_s`` ignores the hint and
    sleeps that long instead: 0 is the naive client that retries at once, 0.5 behaves like
    heptamini's client against its own daemon (load tests compare against both).

    The jitter is small and positive: the governor already spreads refused clients over its
    coming releases, and holds a released slot for the client it was promised to, so arriving
    a little late costs that slot idle time and arriving early costs a refusal.
    """

    max_attempts: int = 10
    fixed_delay_s: float | None = None
    jitter_ratio: float = 0.1
    max_jitter_s: float = 0.002
    max_sleep_s: float = 5.0

    def delay_s(self, hint_ms: int | None, rng: random.Random) -> float:
        if self.fixed_delay_s is not None:
            return self.fixed_delay_s
        base = (hint_ms or 50) / 1000
        jitter = rng.uniform(0, min(base * self.jitter_ratio, self.max_jitter_s))
        return min(base + jitter, self.max_sleep_s)


NO_RETRY = RetryPolicy(max_attempts=1)


@dataclass(slots=True)
class UploadResult:
    """How an upload ended: ``reply`` is the last frame (terminal, ``yield`` or ``need``)."""

    reply: Reply
    attempts: int  # admission attempts made
    yields: list[Reply]
    started: float  # time.monotonic() when the first frame was sent
    admitted_at: float | None  # ... when the attempt that ran was sent (None: it never ran)
    finished: float

    @property
    def status(self) -> Status:
        return self.reply.status

    @property
    def done(self) -> bool:
        return self.reply.status == Status.DONE


class GovernorClient:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        api_key: str | None = None,
    ) -> None:
        self.api_key = api_key  # the tenant's key, sent with every job
        self._reader = reader
        self._writer = writer
        self._inbox: dict[str, asyncio.Queue[Reply | ClientError]] = {}
        self._jobs = itertools.count(1)
        self._rng = random.Random()
        self._closed: ClientError | None = None
        self._abort: Reply | None = None  # the server's connection-level abort, if it sent one
        self._reader_task = asyncio.get_running_loop().create_task(self._read_replies())

    @classmethod
    async def connect(
        cls, host: str, port: int, *, timeout: float = 10.0, api_key: str | None = None
    ) -> Self:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port, limit=MAX_REPLY_BYTES)
        return cls(reader, writer, api_key=api_key)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._closed is None:
            self._closed = ConnectionLost("the connection was closed by this client")
        self._reader_task.cancel()
        self._writer.close()
        with contextlib.suppress(OSError, asyncio.CancelledError):
            await self._reader_task
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()

    # Operations ------------------------------------------------------------------------

    async def ping(self, *, timeout: float = 10.0) -> Reply:
        job = f"J_ping{next(self._jobs)}"
        async with self._expecting(job) as inbox, asyncio.timeout(timeout):
            self._write(encode_request(Verb.PING, job, 1))
            return await self._next(inbox)

    async def upload(
        self,
        payload: bytes,
        *,
        job: str | None = None,
        chunk_bytes: int = 8192,
        content_type: str = "application/octet-stream",
        ttl_ms: int = 0,
        retry: RetryPolicy = RetryPolicy(),
        timeout: float | None = None,
        on_attempt: Callable[[float, Reply], None] | None = None,
        on_delta: Callable[[str], None] | None = None,
        inline: bool = False,
    ) -> UploadResult:
        """Upload ``payload`` as one job and wait for its terminal frame, retrying on yield.

        ``on_attempt(sent_at, reply)`` is called as each admission attempt is answered, with
        the ``time.monotonic()`` at which it was sent: load tests time every yield with it,
        including those of an upload cut short by ``timeout``. ``on_delta(text)`` gets the
        output a streaming job sends before its terminal frame. With ``inline`` the payload
        (UTF-8 text) goes in one frame instead of a manifest and chunks.
        """
        job = job or f"J_{next(self._jobs)}"
        prepared = split_payload(payload, chunk_bytes=chunk_bytes, content_type=content_type)
        seq = itertools.count(1)

        inline_payload = (
            {
                "content_type": content_type,
                "sha256": prepared.manifest["sha256"],
                "data": payload.decode(),
            }
            if inline
            else None
        )

        def frames(whole: bool) -> bytes:
            """The whole upload, pipelined, or only its final chunk again."""
            key = self.api_key
            if inline_payload is not None:
                return encode_request(
                    Verb.SHARE, job, next(seq), ttl_ms=ttl_ms, inline=inline_payload, api_key=key
                )
            if not whole:
                chunk = prepared.chunks[-1]
                return encode_request(Verb.SHARE, job, next(seq), ttl_ms=ttl_ms, chunk=chunk)
            parts = [
                encode_request(
                    Verb.SHARE,
                    job,
                    next(seq),
                    ttl_ms=ttl_ms,
                    manifest=prepared.manifest,
                    api_key=key,
                )
            ]
            parts += [
                encode_request(Verb.SHARE, job, next(seq), ttl_ms=ttl_ms, chunk=c)
                for c in prepared.chunks
            ]
            return b"".join(parts)

        started = time.monotonic()
        yields: list[Reply] = []
        admitted_at: float | None = None
        attempts = 0
        whole = True
        async with self._expecting(job) as inbox, asyncio.timeout(timeout):
            while True:
                attempts += 1
                sent_at = time.monotonic()
                self._write(frames(whole))
                # Whole: a reply per frame, the last one for the final chunk; else just that one.
                for _ in range(len(prepared.chunks) if whole and not inline else 0):
                    reply = await self._next(inbox)
                    if reply.status != Status.OK:
                        break
                else:
                    reply = await self._next(inbox)
                    while reply.delta is not None:  # a streaming job's output, as it comes
                        if on_delta is not None:
                            on_delta(reply.delta)
                        reply = await self._next(inbox)
                if on_attempt is not None:
                    on_attempt(sent_at, reply)
                if reply.receipt(Receipt.BACKEND_MS) is not None:  # the job ran
                    admitted_at = sent_at
                if reply.status != Status.YIELD:
                    break
                yields.append(reply)
                if attempts >= retry.max_attempts:
                    break
                await asyncio.sleep(retry.delay_s(reply.retry_hint_ms, self._rng))
                whole = reply.receipt(Receipt.PAYLOAD_HELD) != 1
        return UploadResult(reply, attempts, yields, started, admitted_at, time.monotonic())

    async def generate(
        self,
        spec: JobSpec,
        *,
        job: str | None = None,
        ttl_ms: int = 0,
        retry: RetryPolicy = RetryPolicy(),
        timeout: float | None = None,
        on_attempt: Callable[[float, Reply], None] | None = None,
        on_delta: Callable[[str], None] | None = None,
    ) -> UploadResult:
        """Run an inference job; its ``result`` holds the text, token counts and timings.

        A spec that fits in a line goes in one frame (one round trip); a larger one is
        uploaded in chunks. ``on_attempt`` and ``on_delta`` are :meth:`upload`'s.
        """
        payload = spec.encode()
        return await self.upload(
            payload,
            job=job,
            content_type=SPEC_CONTENT_TYPE,
            ttl_ms=ttl_ms,
            retry=retry,
            timeout=timeout,
            on_attempt=on_attempt,
            on_delta=on_delta,
            inline=len(payload) < INLINE_MAX_BYTES,
        )

    async def cancel(self, job: str) -> None:
        """Ask the server to stop ``job``; its upload (or generate) call ends with the abort."""
        self._write(encode_request(Verb.CANCEL, job, 1))

    # Plumbing --------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        if self._closed is not None or self._abort is not None:
            return  # the reply waiting in the operation's inbox says why
        self._writer.write(data)

    def _expecting(self, job: str) -> _Expecting:
        return _Expecting(self, job)

    async def _next(self, inbox: asyncio.Queue[Reply | ClientError]) -> Reply:
        item = await inbox.get()
        if isinstance(item, ClientError):
            raise item
        return item

    async def _read_replies(self) -> None:
        error: ClientError = ConnectionLost("the server closed the connection")
        try:
            while True:
                line = await self._reader.readline()
                if not line.endswith(b"\n"):
                    break
                try:
                    reply = decode_reply(line)
                except ReplyInvalid as exc:
                    error = ClientError(f"unreadable reply: {exc}")
                    break
                inbox = self._inbox.get(reply.job)
                if inbox is not None:
                    inbox.put_nowait(reply)
                elif reply.status == Status.ABORT:
                    # A connection-level abort (too many connections, idle timeout, ...) names
                    # no job of ours: every operation gets it, also one started later.
                    self._abort = reply
                    for waiting in self._inbox.values():
                        waiting.put_nowait(reply)
        except (OSError, asyncio.LimitOverrunError, ValueError) as exc:
            error = ConnectionLost(f"connection lost: {exc!r}")
        self._closed = error
        for inbox in self._inbox.values():
            inbox.put_nowait(error)


class _Expecting:
    """Registers a job's inbox for the length of one operation."""

    def __init__(self, client: GovernorClient, job: str) -> None:
        self.client = client
        self.job = job

    async def __aenter__(self) -> asyncio.Queue[Reply | ClientError]:
        if self.job in self.client._inbox:
            raise ValueError(f"job {self.job!r} is already in progress on this connection")
        inbox: asyncio.Queue[Reply | ClientError] = asyncio.Queue()
        if self.client._abort is not None:
            inbox.put_nowait(self.client._abort)
        elif self.client._closed is not None:
            inbox.put_nowait(self.client._closed)
        self.client._inbox[self.job] = inbox
        return inbox

    async def __aexit__(self, *exc_info: object) -> None:
        del self.client._inbox[self.job]


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) into its parts; raises ``ValueError``."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


async def connect(address: str, *, timeout: float = 10.0) -> GovernorClient:
    """Connect to ``HOST:PORT``."""
    host, port = parse_address(address)
    return await GovernorClient.connect(host, port, timeout=timeout)
