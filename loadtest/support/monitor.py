"""The monitor: a connection of its own that pings the daemon on a fixed period.

Every ping reply carries the core receipts (``backend.inflight``, ``server.executed_total``,
``server.yielded_total``, ...); the monitor keeps one :class:`Sample` per reply and prints a
line each time the state changes::

    t=44ms inflight=1 executed_total=1 yielded_total=19

``t`` is milliseconds since the starting gun. The totals are this run's: deltas from the values
read by :meth:`Monitor.baseline` just before the start, so a daemon that already served traffic
still gives this run's counts.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TextIO

from clients.client import ClientError, GovernorClient
from protocol.codes import Receipt, Status
from protocol.frames import Reply

PING_TIMEOUT_S = 5.0


class MonitorError(Exception):
    """A ping reply the monitor cannot use."""


@dataclass(frozen=True, slots=True)
class Sample:
    t_ms: float  # since the starting gun; negative for the baseline
    inflight: int
    executed: int  # since the baseline
    yielded: int  # since the baseline

    @property
    def state(self) -> tuple[int, int, int]:
        return self.inflight, self.executed, self.yielded

    def line(self) -> str:
        return (
            f"t={self.t_ms:.0f}ms inflight={self.inflight} "
            f"executed_total={self.executed} yielded_total={self.yielded}"
        )


def _receipt(reply: Reply, kind: Receipt) -> int:
    value = reply.receipt(kind)
    if value is None:
        raise MonitorError(f"the ping reply carries no {kind} receipt")
    return value


class Monitor:
    """Samples the daemon every ``interval_s`` from :meth:`start` until :meth:`stop`, printing
    each change of state to ``out`` (None: silently)."""

    def __init__(self, client: GovernorClient, *, interval_s: float, out: TextIO | None) -> None:
        self.client = client
        self.interval_s = interval_s
        self.out = out
        self.samples: list[Sample] = []  # during the run, the baseline excluded
        self.cap: int | None = None
        self.inflight_peak: int | None = None  # the server's own, since it started
        self.error: Exception | None = None  # why sampling stopped early, if it did
        self._base_executed = 0
        self._base_yielded = 0
        self._last_state: tuple[int, int, int] | None = None
        self._t0 = 0.0
        self._task: asyncio.Task[None] | None = None

    @property
    def max_inflight(self) -> int | None:
        """The highest ``backend.inflight`` sampled during the run (``None``: no sample)."""
        return max((s.inflight for s in self.samples), default=None)

    async def baseline(self) -> None:
        """One ping before the start: the totals later samples are counted from.

        Raises :class:`ClientError`, :class:`OSError`, :class:`TimeoutError` or
        :class:`MonitorError` when the daemon cannot be read.
        """
        reply = await self._ping()
        self._base_executed = _receipt(reply, Receipt.EXECUTED_TOTAL)
        self._base_yielded = _receipt(reply, Receipt.YIELDED_TOTAL)
        self._last_state = (_receipt(reply, Receipt.INFLIGHT), 0, 0)
        self._note_extras(reply)

    def start(self, t0: float) -> None:
        """Sample from now on; ``t0`` is the starting gun's ``time.monotonic()``."""
        if self._task is not None:
            raise RuntimeError("the monitor is already running")
        self._t0 = t0
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loadtest-monitor")

    async def stop(self, *, final_sample: bool = True) -> None:
        """Stop sampling and, unless told not to, take one last sample (the end state)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            # return_exceptions swallows the task's own CancelledError; a cancellation of
            # the caller while it waits here still propagates.
            await asyncio.gather(self._task, return_exceptions=True)
        if final_sample and self.error is None:
            await self._sample_once()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while await self._sample_once():
            # A fixed period, not a fixed pause: a slow ping delays its own sample only.
            next_at = max(next_at + self.interval_s, loop.time())
            await asyncio.sleep(next_at - loop.time())

    async def _sample_once(self) -> bool:
        """Ping and record; False (with :attr:`error` set) when the daemon cannot be read."""
        try:
            reply = await self._ping()
            sample = Sample(
                (time.monotonic() - self._t0) * 1000,
                _receipt(reply, Receipt.INFLIGHT),
                _receipt(reply, Receipt.EXECUTED_TOTAL) - self._base_executed,
                _receipt(reply, Receipt.YIELDED_TOTAL) - self._base_yielded,
            )
        except (ClientError, OSError, TimeoutError, MonitorError) as exc:
            self.error = exc
            return False
        self._note_extras(reply)
        self.samples.append(sample)
        if sample.state != self._last_state:
            self._last_state = sample.state
            if self.out is not None:
                print(sample.line(), file=self.out, flush=True)
        return True

    async def _ping(self) -> Reply:
        reply = await self.client.ping(timeout=PING_TIMEOUT_S)
        if reply.status != Status.OK:
            # e.g. a connection-level abort (too_many_connections, idle_timeout)
            raise MonitorError(f"ping answered {reply.status} {reply.need_code or ''}".rstrip())
        return reply

    def _note_extras(self, reply: Reply) -> None:
        self.cap = reply.receipt(Receipt.CAP)
        peak = reply.receipt(Receipt.INFLIGHT_PEAK)  # an extension: absent from heptamini
        if peak is not None:
            self.inflight_peak = peak
