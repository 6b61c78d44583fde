"""Overload states, driven by measured signals, with hysteresis and a minimum dwell.

    normal < degraded < batch_paused < interactive_only

Pure code with an injectable clock. The server feeds it what it measures (interactive time to
first token, admissions and yields, job outcomes, KV utilisation) and calls :meth:`update`
periodically. Each signal proposes a level: the state rises at once to the highest level any
signal proposes, and falls one level at a time, only once every signal has stayed below the
current level's *lower* thresholds (80 % of the rising ones) for ``min_dwell_s``.

The fallback ladder follows the state (each step configurable):

    degraded          interactive jobs' max_new_tokens lowered to ``degraded_max_new_tokens``;
                      heavy and background jobs to the fallback pool, if there is one
    batch_paused      ... and background jobs refused: yield ``lane_paused``
    interactive_only  ... and heavy jobs refused too: only interactive work is admitted
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

from .policy import Lane


class State(IntEnum):
    NORMAL = 0
    DEGRADED = 1
    BATCH_PAUSED = 2
    INTERACTIVE_ONLY = 3

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True, kw_only=True)
class OverloadSettings:
    ttft_slo_ms: float = 1000.0  # interactive p95 time to first token
    window_s: float = 30.0  # signals are measured over this sliding window
    min_dwell_s: float = 10.0  # a state lasts at least this long before it falls
    kv_danger: float = 0.8
    yield_rate: float = 0.5  # share of admission attempts refused: degraded above it
    error_rate: float = 0.2  # share of jobs failing in the runner: degraded above it
    min_samples: int = 5  # a rate or percentile needs this many samples to speak
    degraded_max_new_tokens: int = 128  # ladder step: 0 disables it
    pause_background: bool = True  # ladder step
    interactive_only: bool = True  # ladder step


HYSTERESIS = 0.8  # falling thresholds, as a share of the rising ones


class OverloadController:
    def __init__(self, settings: OverloadSettings, clock: Callable[[], float]) -> None:
        self.settings = settings
        self.clock = clock
        self.state = State.NORMAL
        self.changed_at = clock()
        self.transitions: collections.Counter[tuple[str, str]] = collections.Counter()
        self._ttft: collections.deque[tuple[float, float]] = collections.deque()
        self._admissions: collections.deque[tuple[float, bool]] = collections.deque()  # yielded?
        self._outcomes: collections.deque[tuple[float, bool]] = collections.deque()  # failed?
        self.kv_utilisation = 0.0

    # What the server measures ----------------------------------------------------------

    def observe_ttft(self, ms: float) -> None:
        self._ttft.append((self.clock(), ms))

    def observe_admission(self, yielded: bool) -> None:
        self._admissions.append((self.clock(), yielded))

    def observe_outcome(self, failed: bool) -> None:
        self._outcomes.append((self.clock(), failed))

    # The state -------------------------------------------------------------------------

    def signals(self) -> dict[str, float | None]:
        """The measured signals over the window (None: too few samples)."""
        now = self.clock()
        horizon = now - self.settings.window_s
        for samples in (self._ttft, self._admissions, self._outcomes):
            while samples and samples[0][0] < horizon:
                samples.popleft()
        return {
            "ttft_p95_ms": self._p95([ms for _, ms in self._ttft]),
            "yield_rate": self._rate([y for _, y in self._admissions]),
            "error_rate": self._rate([f for _, f in self._outcomes]),
            "kv_utilisation": self.kv_utilisation,
        }

    def _p95(self, values: list[float]) -> float | None:
        if len(values) < self.settings.min_samples:
            return None
        ordered = sorted(values)
        return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]

    def _rate(self, flags: list[bool]) -> float | None:
        if len(flags) < self.settings.min_samples:
            return None
        return sum(flags) / len(flags)

    def _level(self, signals: dict[str, float | None], scale: float) -> State:
        """The state the signals call for, with thresholds scaled by ``scale``."""
        s, level = self.settings, State.NORMAL
        ttft = signals["ttft_p95_ms"]
        if ttft is not None:
            slo = s.ttft_slo_ms * scale
            if ttft >= 1.5 * slo:
                level = max(level, State.INTERACTIVE_ONLY)
            elif ttft >= slo:
                level = max(level, State.BATCH_PAUSED)
            elif ttft >= 0.8 * slo:
                level = max(level, State.DEGRADED)
        kv = signals["kv_utilisation"] or 0.0
        if kv >= min(0.95, s.kv_danger + 0.15) * scale:
            level = max(level, State.INTERACTIVE_ONLY)
        elif kv >= s.kv_danger * scale:
            level = max(level, State.BATCH_PAUSED)
        for name, threshold in (("yield_rate", s.yield_rate), ("error_rate", s.error_rate)):
            value = signals[name]
            if value is not None and value >= threshold * scale:
                level = max(level, State.DEGRADED)
        return level

    def update(self) -> State:
        """Re-evaluate; returns the (possibly new) state."""
        now = self.clock()
        signals = self.signals()
        rising = self._level(signals, 1.0)
        if rising > self.state:
            self._move(rising, now)
        elif self._level(signals, HYSTERESIS) < self.state and (
            now - self.changed_at >= self.settings.min_dwell_s
        ):
            self._move(State(self.state - 1), now)
        return self.state

    def _move(self, state: State, now: float) -> None:
        self.transitions[(self.state.label, state.label)] += 1
        self.state = state
        self.changed_at = now

    # The ladder ------------------------------------------------------------------------

    def paused(self, lane: Lane) -> bool:
        s = self.settings
        if lane == Lane.BACKGROUND and s.pause_background:
            return self.state >= State.BATCH_PAUSED
        if lane != Lane.INTERACTIVE and s.interactive_only:
            return self.state >= State.INTERACTIVE_ONLY
        return False

    def pause_hint_s(self, lane: Lane, attempt: int) -> float:
        """When a pause on ``lane`` may end; longer for a job refused ``attempt`` times."""
        rest = self.changed_at + self.settings.min_dwell_s - self.clock()
        return float(min(max(rest, 1.0) * 2.0 ** (attempt - 1), self.settings.window_s))

    def max_new_tokens(self, lane: Lane, asked: int) -> int | None:
        """A lowered max_new_tokens for this job, or None to leave it as asked."""
        cap = self.settings.degraded_max_new_tokens
        if lane == Lane.INTERACTIVE and cap and self.state >= State.DEGRADED and asked > cap:
            return cap
        return None
