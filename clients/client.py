"""An asyncio client for the governor (and for heptamini's daemon: it speaks plain v0).

One :class:`GovernorClient` is one connection. Several operations may run on it at once: a
reader task routes each reply to the operation waiting on its job id.

On ``yield`` :meth:`GovernorClient.upload` sleeps for the server's ``retry_hint_ms`` (plus
jitter, so that refused clients do not come back in lockstep) and resends the final chunk,
which the governor kept; a bounded :class:`RetryPolicy` says how many attempts in all.
The decisions are :mod:`clients.retry`'s (pure code); this module sends and sleeps.

Yields come in three kinds, and only one of them is retried freely:

- *busy* (``server_busy``, ``lane_full``, ``kv_pressure``, ``tenant_busy``, ``tenant_share``,
  ``rate_limited``, ``lane_paused``, and any code this client does not know): flow control.
  Refusing costs the server microseconds and no GPU, and the hint paces the client, so these
  are bounded per upload by ``RetryPolicy.max_attempts`` alone.
- *failing* (``breaker_open``: the runner pool's circuit breaker is open, and the hint is its
  remaining cooldown): the backend is failing, not busy. Retrying into a failing fleet is how a
  retry storm starts (the load multiplies exactly when capacity is scarce), so these retries
  are also bounded by a :class:`RetryBudget`, shared by every upload on the client (and by
  several clients, given the same one): a token bucket that failures drain and finished jobs
  refill, in the manner of gRPC's retry throttling. A retry the budget refuses ends the upload
  with the yield it got and ``UploadResult.budget_exhausted`` set.
  A ``breaker_open`` hint (the rest of the cooldown) longer than ``RetryPolicy.max_sleep_s``
  ends the upload at once: coming back before the breaker may close only spends budget.
- ``draining``: the server is shutting down and says "go elsewhere"; never retried on this
  connection.

Going elsewhere is :class:`clients.fleet.FleetClient`'s work: it holds one of these clients per
replica, and its ``on_yield`` hook (see :meth:`GovernorClient.upload`) stops a retry here when
another replica would take the job sooner.

Jobs aborted by a failing backend (``error_code`` ``backend_error``: a crashed or hung runner,
an upstream error) are never retried by this client, but they drain the budget too, so that a
client that has just watched jobs fail does not then retry hard when the breaker opens.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from ssl import SSLContext
from types import TracebackType
from typing import Self

from protocol.addresses import parse_address
from protocol.codes import NeedCode, Receipt, Status, Verb
from protocol.errors import ReplyInvalid
from protocol.frames import Reply, decode_reply, encode_request
from protocol.spec import SPEC_CONTENT_TYPE, JobSpec
from protocol.upload import split_payload

from .retry import DEFAULT_RETRY as DEFAULT_RETRY
from .retry import NO_RETRY as NO_RETRY
from .retry import RetryBudget as RetryBudget
from .retry import RetryChoice as RetryChoice
from .retry import RetryPolicy as RetryPolicy

MAX_REPLY_BYTES = 16 * 1024 * 1024
INLINE_MAX_BYTES = 64 * 1024  # well within the server's default max_line_bytes


# How long governor-cli and the load tests let a job wait on the server for its turn, by default
# (the server's max_wait bounds it too). The library's default is no wait: plain v0.
DEFAULT_MAX_WAIT_S = 30.0


def _wait_ms(max_wait: float | None, timeout: float | None) -> int | None:
    """The ``max_wait_ms`` a job's frames ask for: ``max_wait``, within the call's ``timeout``."""
    if max_wait is None:
        return None
    return round(1000 * (max_wait if timeout is None else min(max_wait, timeout)))


class ClientError(Exception):
    """The exchange with the server broke off."""


class ConnectionLost(ClientError):
    pass


# Aborts that end one job and never the connection: a payload held after an upload's last
# yield, dropped when the client did not come back for it (or withdrawn), may be answered
# after that upload has returned; no operation waits for it, and the connection stays open.
_LATE_JOB_ENDS = frozenset({NeedCode.UPLOAD_TIMEOUT, NeedCode.CANCELLED})


@dataclass(slots=True)
class UploadResult:
    """How an upload ended: ``reply`` is the last frame (terminal, ``yield`` or ``need``).

    ``budget_exhausted``: the last reply was a ``breaker_open`` yield that the retry policy
    would have retried, but the client's :class:`RetryBudget` refused.
    """

    reply: Reply
    attempts: int  # admission attempts made
    yields: list[Reply]
    started: float  # time.monotonic() when the first frame was sent
    admitted_at: float | None  # ... when the attempt that ran was sent (None: it never ran)
    finished: float
    budget_exhausted: bool = False

    @classmethod
    def ended(
        cls, choice: RetryChoice, reply: Reply, started: float, admitted_at: float | None
    ) -> UploadResult:
        """An upload that ends now with ``reply``, and what its retries counted."""
        attempts, yields, exhausted = choice.attempts, choice.yields, choice.budget_exhausted
        return cls(reply, attempts, yields, started, admitted_at, time.monotonic(), exhausted)

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
        retry_budget: RetryBudget | None = None,
    ) -> None:
        """``retry_budget``: shared with other clients when given, else this client's own."""
        self.api_key = api_key  # the tenant's key, sent with every job
        self._budget = retry_budget if retry_budget is not None else RetryBudget()
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
        cls,
        host: str,
        port: int,
        *,
        timeout: float = 10.0,
        api_key: str | None = None,
        retry_budget: RetryBudget | None = None,
        ssl: SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> Self:
        """Open a connection; ``timeout`` bounds the TLS handshake too.

        ``ssl``: speak TLS with this context (:func:`clients.tls.client_context` builds one);
        its certificate, if it carries one, names this connection's tenant. The server's
        certificate is checked against ``server_hostname``, by default ``host``.
        """
        if ssl is None and server_hostname is not None:
            raise ValueError("server_hostname is for TLS connections only: give ssl too")
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(
                host,
                port,
                limit=MAX_REPLY_BYTES,
                ssl=ssl,
                server_hostname=server_hostname,
                # The handshake is bounded by ``timeout`` already (asyncio's default is 60 s).
                ssl_handshake_timeout=timeout if ssl is not None else None,
            )
        return cls(reader, writer, api_key=api_key, retry_budget=retry_budget)

    @property
    def retry_budget(self) -> RetryBudget:
        """The budget this client's retries after failure signals draw on."""
        return self._budget

    @property
    def closed(self) -> bool:
        """Whether this connection is over: closed by either side, broken, or aborted by the
        server (an ``idle_timeout``, say). An operation started now gets that at once."""
        return self._closed is not None or self._abort is not None

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
        """A ping's reply. It carries the client's ``api_key``: to a governor with tenants, a
        connection that only pings (a monitor) shows its key that way, or is closed after
        ``auth_grace``; the answer is the same either way."""
        job = f"J_ping{next(self._jobs)}"
        async with self._expecting(job) as inbox, asyncio.timeout(timeout):
            self._write(encode_request(Verb.PING, job, 1, api_key=self.api_key))
            return await self._next(inbox)

    async def upload(
        self,
        payload: bytes,
        *,
        job: str | None = None,
        chunk_bytes: int = 8192,
        content_type: str = "application/octet-stream",
        ttl_ms: int = 0,
        retry: RetryPolicy = DEFAULT_RETRY,
        timeout: float | None = None,
        on_attempt: Callable[[float, Reply], None] | None = None,
        on_delta: Callable[[str], None] | None = None,
        inline: bool = False,
        on_yield: Callable[[Reply], bool] | None = None,
        max_wait: float | None = None,
        fleet_wide: bool = False,
        wait_on_return: bool = False,
    ) -> UploadResult:
        """Upload ``payload`` as one job and wait for its terminal frame, retrying on yield.

        ``max_wait``: seconds the job may wait on a busy server for its turn (``max_wait_ms``,
        at most ``timeout``; the server's ``max_wait`` bounds it too), running the moment its
        turn comes. None (the default): a busy server yields at once; the frames are plain v0.

        A yield is retried as ``retry`` says (a ``breaker_open`` one while the client's
        :attr:`retry_budget` allows; a ``draining`` one is returned at once).
        ``on_attempt(sent_at, reply)``: each admission attempt's answer, with the
        ``time.monotonic()`` it was sent at (load tests time every yield with it).
        ``on_delta(text)``: a streaming job's output before its terminal frame. ``inline``:
        the payload (UTF-8 text) in one frame instead of a manifest and chunks.

        ``on_yield(reply)`` is asked about each yield this upload would retry: False ends the
        upload there, with that yield as its reply (its payload held on the server:
        :meth:`withdraw` drops it); a client of several replicas takes the job elsewhere.
        ``fleet_wide``: the job goes where a yield's ``elsewhere`` says (``on_yield`` takes it
        there): a fleet's store may place it. ``wait_on_return`` (without ``max_wait``): back on
        its held payload after a hint, the job asks to wait as long again for its turn (a hint
        is a prediction: a slot that frees a little late is then taken, not refused again).
        """
        job = job or f"J_{next(self._jobs)}"
        frames = _Frames(
            job,
            payload,
            chunk_bytes=chunk_bytes,
            content_type=content_type,
            ttl_ms=ttl_ms,
            api_key=self.api_key,
            inline=inline,
            max_wait_ms=_wait_ms(max_wait, timeout),
            fleet_wide=fleet_wide or None,
            wait_on_return=wait_on_return,
        )
        choice = RetryChoice(retry, self._budget, self._rng)
        started = time.monotonic()
        async with self._expecting(job) as inbox, asyncio.timeout(timeout):
            reply, admitted_at = await self._attempts(
                inbox, frames, choice, on_attempt, on_delta, on_yield
            )
        return UploadResult.ended(choice, reply, started, admitted_at)

    async def _attempts(
        self,
        inbox: asyncio.Queue[Reply | ClientError],
        frames: _Frames,
        choice: RetryChoice,
        on_attempt: Callable[[float, Reply], None] | None,
        on_delta: Callable[[str], None] | None,
        on_yield: Callable[[Reply], bool] | None,
    ) -> tuple[Reply, float | None]:
        """Attempts until a terminal frame or a yield not retried: it, and the run's sent_at."""
        admitted_at: float | None = None
        whole = True
        unanswered = 0  # frames of the last attempt still to be answered
        while True:
            for _ in range(unanswered):  # (a yield before the last chunk: buffers_full)
                await self._next(inbox)
            sent_at = time.monotonic()
            self._write(frames.attempt(whole))
            reply, unanswered = await self._answer(inbox, frames.pipelined(whole), on_delta)
            if on_attempt is not None:
                on_attempt(sent_at, reply)
            if reply.receipt(Receipt.BACKEND_MS) is not None:  # the job ran
                admitted_at = sent_at
            wait_s = choice.after(reply)
            if wait_s is None or (on_yield is not None and not on_yield(reply)):
                return reply, admitted_at
            await asyncio.sleep(wait_s)
            whole = frames.after_yield(reply)

    async def generate(
        self,
        spec: JobSpec,
        *,
        job: str | None = None,
        ttl_ms: int = 0,
        retry: RetryPolicy = DEFAULT_RETRY,
        timeout: float | None = None,
        on_attempt: Callable[[float, Reply], None] | None = None,
        on_delta: Callable[[str], None] | None = None,
        on_yield: Callable[[Reply], bool] | None = None,
        max_wait: float | None = None,
    ) -> UploadResult:
        """Run an inference job; its ``result`` holds the text, token counts and timings.

        A spec that fits in a line goes in one frame (one round trip); a larger one is
        uploaded in chunks. ``on_attempt``, ``on_delta``, ``on_yield`` and ``max_wait`` are
        :meth:`upload`'s.
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
            on_yield=on_yield,
            max_wait=max_wait,
        )

    async def cancel(self, job: str) -> None:
        """Ask the server to stop ``job``; its upload (or generate) call ends with the abort."""
        self._write(encode_request(Verb.CANCEL, job, 1))

    async def withdraw(self, job: str, *, timeout: float = 5.0) -> Reply:
        """Drop what the server holds for ``job`` between operations (its payload, kept after
        a yield, and with it the job's place in the server's line) and return the answer: an
        abort ``cancelled``, or a need ``job_unknown`` when nothing was held.

        An upload that ends on a yield leaves its payload held; left alone, the server keeps a
        freed slot for it a while, then aborts it with ``upload_timeout`` on this connection,
        where no operation waits for it any more. Call this when the job goes elsewhere.
        """
        async with self._expecting(job) as inbox, asyncio.timeout(timeout):
            self._write(encode_request(Verb.CANCEL, job, 1))
            return await self._next(inbox)

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

    async def _answer(
        self,
        inbox: asyncio.Queue[Reply | ClientError],
        pipelined: int,
        on_delta: Callable[[str], None] | None,
    ) -> tuple[Reply, int]:
        """The reply that ends one attempt, and how many of its frames are left unanswered.

        ``pipelined``: the replies due before the final chunk's (a reply per frame); one that
        is not ``ok`` ends the attempt early. A streaming job's output comes before its
        terminal frame, to ``on_delta``."""
        for answered in range(pipelined):
            reply = await self._next(inbox)
            if reply.status != Status.OK:
                return reply, pipelined - answered
        reply = await self._next(inbox)
        while reply.delta is not None:
            if on_delta is not None:
                on_delta(reply.delta)
            reply = await self._next(inbox)
        return reply, 0

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
                elif reply.status == Status.ABORT and reply.need_code not in _LATE_JOB_ENDS:
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


class _Frames:
    """One upload's frames, numbered in one sequence over its attempts: the whole upload
    pipelined (the manifest and every chunk, or the payload inline in one frame), or, after a
    yield that left the payload held, only its final chunk again."""

    def __init__(
        self,
        job: str,
        payload: bytes,
        *,
        chunk_bytes: int,
        content_type: str,
        ttl_ms: int,
        api_key: str | None,
        inline: bool,
        max_wait_ms: int | None,
        fleet_wide: bool | None,
        wait_on_return: bool,
    ) -> None:
        self.job = job
        self.ttl_ms = ttl_ms
        self.api_key = api_key  # sent with the first frame of a whole upload
        # With the first frame, and a final chunk sent again: what the job asks for itself.
        self.max_wait_ms, self.fleet_wide = max_wait_ms, fleet_wide
        self.wait_on_return = wait_on_return and max_wait_ms is None
        self.prepared = split_payload(payload, chunk_bytes=chunk_bytes, content_type=content_type)
        self.inline = (
            {
                "content_type": content_type,
                "sha256": self.prepared.manifest["sha256"],
                "data": payload.decode(),
            }
            if inline
            else None
        )
        self._seq = itertools.count(1)

    def pipelined(self, whole: bool) -> int:
        """The replies an attempt gets before the final one: one per frame but the last."""
        return len(self.prepared.chunks) if whole and self.inline is None else 0

    def after_yield(self, reply: Reply) -> bool:
        """Whether the retry after this yield sends the whole upload (its payload not held);
        with ``wait_on_return``, one back on its held payload asks to wait as long as the hint."""
        whole = reply.receipt(Receipt.PAYLOAD_HELD) != 1
        if self.wait_on_return:
            self.max_wait_ms = None if whole else reply.retry_hint_ms
        return whole

    def attempt(self, whole: bool) -> bytes:
        """The whole upload, pipelined, or only its final chunk again."""
        job, seq, ttl_ms, key = self.job, self._seq, self.ttl_ms, self.api_key
        asks = functools.partial(
            encode_request, max_wait_ms=self.max_wait_ms, fleet_wide=self.fleet_wide
        )
        if self.inline is not None:
            return asks(Verb.SHARE, job, next(seq), ttl_ms=ttl_ms, inline=self.inline, api_key=key)
        chunks = self.prepared.chunks
        if not whole:
            return asks(Verb.SHARE, job, next(seq), ttl_ms=ttl_ms, chunk=chunks[-1])
        manifest = self.prepared.manifest
        parts = [asks(Verb.SHARE, job, next(seq), ttl_ms=ttl_ms, manifest=manifest, api_key=key)]
        parts += [
            encode_request(Verb.SHARE, job, next(seq), ttl_ms=ttl_ms, chunk=c) for c in chunks
        ]
        return b"".join(parts)


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


async def connect(
    address: str,
    *,
    timeout: float = 10.0,
    api_key: str | None = None,
    retry_budget: RetryBudget | None = None,
    ssl: SSLContext | None = None,
    server_hostname: str | None = None,
) -> GovernorClient:
    """Connect to ``HOST:PORT``; the rest as for :meth:`GovernorClient.connect`."""
    host, port = parse_address(address, allow_port_zero=False)
    return await GovernorClient.connect(
        host,
        port,
        timeout=timeout,
        api_key=api_key,
        retry_budget=retry_budget,
        ssl=ssl,
        server_hostname=server_hostname,
    )
