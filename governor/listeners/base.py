"""The shape every listener shares, so that the server starts and stops them in one loop.

A listener binds when the daemon starts (a taken address fails the start at once, before the
model loads), serves when the daemon is ready for it (the probes while the runner loads, the
job doors once it is ready) and closes when the daemon stops, as aiohttp's sites and trio's
listeners do.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import socket
from collections.abc import Callable
from typing import Protocol


class Listener(Protocol):
    early: bool  # serves while the runner starts (the probes), not only once it is ready

    @property
    def address(self) -> tuple[str, int]:
        """The bound address (its port, where port 0 asked for any)."""
        ...

    def bind(self) -> None:
        """Take the address now; raises OSError where it is taken."""
        ...

    async def serve(self) -> None:
        """Accept connections from now on; returns once they are accepted."""
        ...

    async def close(self) -> None:
        """Stop accepting (a listener never bound or never served closes too)."""
        ...

    def describe(self) -> str | None:
        """What the log says once it serves; None: the server says it itself."""
        ...


def bind(host: str, port: int, backlog: int) -> socket.socket:
    """A listening socket on ``host:port`` (an IPv6 host where it has a colon)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=backlog)


def bound_address(sock: socket.socket) -> tuple[str, int]:
    host, port = sock.getsockname()[:2]
    return str(host), int(port)


class Due(Protocol):
    """A connection with deadlines, as :class:`Deadlines` keeps it."""

    due_at: int | None  # the grain its next deadline falls in, while it is kept

    def on_deadline(self) -> None:
        """Its deadline has come (or just passed): it handles what is due, and is put back."""
        ...


# The width of a deadline's bucket, seconds: a deadline is late by at most this.
GRAIN = 0.01


class Timer(Protocol):
    def cancel(self) -> None: ...


# Call a function after so many seconds (the running loop's ``call_later``, or a test's).
CallLater = Callable[[float, Callable[[], None]], Timer]


def loop_later(delay: float, callback: Callable[[], None]) -> Timer:
    return asyncio.get_running_loop().call_later(delay, callback)


class Deadlines:
    """One timer for every connection of a listener, instead of a timer each.

    A timer is the heaviest thing an idle connection holds (over half a kilobyte on uvloop);
    with 10,000 idle connections that is most of the daemon's memory for them. Each connection
    sits instead in the bucket of :data:`GRAIN` seconds its next deadline falls in (moved, never
    copied, when the deadline moves: no stale entries pile up however often it does), and one
    timer fires at the earliest bucket. A deadline is late by at most a grain.
    """

    def __init__(self, clock: Callable[[], float], call_later: CallLater = loop_later) -> None:
        self._clock = clock
        self._call_later = call_later
        self._buckets: dict[int, set[Due]] = {}
        self._keys: list[int] = []  # a heap of the buckets' keys (some may be gone)
        self._timer: Timer | None = None
        self._timer_key: int | None = None

    def __len__(self) -> int:
        return sum(len(bucket) for bucket in self._buckets.values())

    def put(self, conn: Due, deadline: float) -> None:
        """Keep ``conn`` until ``deadline`` (on the clock given), in place of its last one."""
        key = math.ceil(deadline / GRAIN) if deadline < math.inf else None
        if key == conn.due_at:
            return
        self.remove(conn)
        if key is None:
            return
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = set()
            heapq.heappush(self._keys, key)
        bucket.add(conn)
        conn.due_at = key
        if self._timer_key is None or key < self._timer_key:
            self._arm(key)

    def remove(self, conn: Due) -> None:
        key = conn.due_at
        if key is None:
            return
        conn.due_at = None
        bucket = self._buckets[key]
        bucket.discard(conn)
        if not bucket:
            del self._buckets[key]  # (its key leaves the heap when it reaches the top)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._unset()

    def _unset(self) -> None:
        self._timer = self._timer_key = None

    def _arm(self, key: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        delay = max(key * GRAIN - self._clock(), 0.0)
        self._timer = self._call_later(delay, self._fire)
        self._timer_key = key

    def _fire(self) -> None:
        """The buckets due now; each connection put back lands in a later turn's."""
        # (unset in a call: mypyc would take a narrowing to None here for the whole method,
        # though the connections handed their deadlines below arm the timer again)
        self._unset()
        now = math.floor(self._clock() / GRAIN)
        keys, due = self._keys, []
        while keys and (keys[0] <= now or keys[0] not in self._buckets):
            bucket = self._buckets.pop(heapq.heappop(keys), None)
            if bucket:
                due.append(bucket)
        for bucket in due:
            for conn in bucket:
                conn.due_at = None
            for conn in bucket:
                conn.on_deadline()
        while keys and keys[0] not in self._buckets:
            heapq.heappop(keys)
        if keys and (self._timer_key is None or keys[0] < self._timer_key):
            self._arm(keys[0])
