"""A circuit breaker per runner pool. Pure code, an injectable clock.

    closed --(failures >= min_failures and rate >= error_rate, in the window)--> open
    open --(cooldown elapsed)--> half_open
    half_open --(the trial job succeeds)--> closed
    half_open --(the trial job fails)--> open (a new cooldown)

A pool whose jobs keep failing (a corrupted GPU context, an upstream answering 500s, workers
that crash on load) would otherwise take each job into a slot, fail it after seconds of work,
and see it retried. The breaker turns that slow, capacity-eating failure into a fast, cheap one:
while it is open, admission sends the pool's jobs to the fallback pool if there is one, else
answers ``yield`` with ``breaker_open`` and a hint set by the remaining cooldown.

Only failures of the backend count (``runner_crashed``, ``runner_timeout``, ``backend_error``,
``upstream_*``); a job cancelled, timed out by its own ``ttl_ms`` or ended by its client says
nothing about the pool and is not recorded. Half-open lets one trial through at a time: a
real job, or the readiness probe when no job comes; a trial that ends with no verdict (its
client left) frees the trial for the next one.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum


class BreakerState(IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True, kw_only=True)
class BreakerSettings:
    window_s: float = 30.0  # failures are counted over this sliding window
    min_failures: int = 5  # the count threshold; 0 turns the breaker off
    error_rate: float = 0.5  # the rate threshold: failed / finished jobs in the window
    cooldown_s: float = 15.0  # open this long before a trial is let through


class CircuitBreaker:
    def __init__(self, settings: BreakerSettings, clock: Callable[[], float]) -> None:
        self.settings = settings
        self.clock = clock
        self.state = BreakerState.CLOSED
        self.opened_at = 0.0
        self.trial = False  # a half-open trial is running
        self.transitions: collections.Counter[tuple[str, str]] = collections.Counter()
        self.on_change: Callable[[BreakerState, BreakerState, str], None] | None = None
        self._outcomes: collections.deque[tuple[float, bool]] = collections.deque()  # failed?
        self._failures = 0  # failed outcomes in the deque

    @property
    def enabled(self) -> bool:
        return self.settings.min_failures > 0

    def retry_after_s(self, trial_s: float) -> float | None:
        """None when a job may start now; else the seconds until one may (for the hint).

        ``trial_s`` is how long a trial job is expected to take (the pool's service time).
        """
        if self.state == BreakerState.CLOSED:
            return None
        now = self.clock()
        if self.state == BreakerState.OPEN:
            left = self.opened_at + self.settings.cooldown_s - now
            if left > 0:
                return left
            self._move(BreakerState.HALF_OPEN, "cooldown over")
        # Half-open: one trial at a time; the others wait about as long as a trial takes.
        return trial_s if self.trial else None

    def started(self) -> bool:
        """A job was admitted after :meth:`retry_after_s` said it may; True if it is the trial."""
        if self.state == BreakerState.HALF_OPEN and not self.trial:
            self.trial = True
            return True
        return False

    def record(self, failed: bool | None, *, trial: bool = False) -> None:
        """A job's outcome: True failed in the backend, False succeeded, None no verdict."""
        if trial:
            self.trial = False
            if failed is None or self.state != BreakerState.HALF_OPEN:
                return
            if failed:
                self._open(now=self.clock(), why="the trial job failed")
            else:
                self._forget_window()
                self._move(BreakerState.CLOSED, "the trial job succeeded")
            return
        if failed is None or not self.enabled or self.state != BreakerState.CLOSED:
            return
        now = self.clock()
        self._outcomes.append((now, failed))
        self._failures += failed
        horizon = now - self.settings.window_s
        while self._outcomes and self._outcomes[0][0] < horizon:
            self._failures -= self._outcomes.popleft()[1]
        s = self.settings
        if self._failures >= s.min_failures and self._failures >= s.error_rate * len(
            self._outcomes
        ):
            self._open(
                now,
                f"{self._failures} of {len(self._outcomes)} jobs failed in {s.window_s:g} s",
            )

    def _open(self, now: float, why: str) -> None:
        self.opened_at = now
        self._forget_window()
        self._move(BreakerState.OPEN, why)

    def _forget_window(self) -> None:
        """A new state starts counting afresh: old failures do not linger."""
        self._outcomes.clear()
        self._failures = 0

    def _move(self, state: BreakerState, why: str) -> None:
        before, self.state = self.state, state
        self.transitions[(before.label, state.label)] += 1
        if self.on_change is not None:
            self.on_change(before, state, why)
