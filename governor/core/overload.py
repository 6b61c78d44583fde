"""Overload states, driven by measured signals, with hysteresis and a minimum dwell.

    normal < degraded < batch_paused < interactive_only

Pure code with an injectable clock. The server feeds it what it measures (interactive jobs'
attainment of their objectives: how far each one's time to first token, from its first
refusal, and its time per output token went into them; admissions and yields, job outcomes,
KV utilisation) and calls :meth:`update` periodically.

The state moves on distress only: the interactive p95 TTFT and TPOT (each as a share of the
job's own objective), the backend's error rate (the share of jobs failing in the runner) and
KV utilisation (none when ``kv_preemptible``: the runner takes memory back from lent work).
Refusals are demand, not distress: a burst of more jobs than slots on a healthy backend is
refused and told when to come back, and the state stays ``normal``. The yield rate is
measured (:meth:`OverloadController.signals`, for metrics and health) but never moves the
state. Each signal proposes a level: the state rises at once to the highest level any signal
proposes, and falls one level at a time, only once every signal has stayed below the current
level's *lower* thresholds (80 % of the rising ones) for ``min_dwell_s``.

The fallback ladder follows the state (each step configurable):

    degraded          interactive jobs' max_new_tokens lowered to ``degraded_max_new_tokens``;
                      heavy and background jobs to the fallback pool, if there is one
    batch_paused      ... and background jobs refused: yield ``lane_paused``
    interactive_only  ... and heavy jobs refused too: only interactive work is admitted

A paused lane is not left idle: its job still takes a slot no client of a higher lane waits
for, and a paused client is told when its place in line comes (:mod:`governor.core.admission`).
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
    window_s: float = 30.0  # signals are measured over this sliding window
    min_dwell_s: float = 10.0  # a state lasts at least this long before it falls
    kv_danger: float = 0.8  # KV utilisation: batch_paused above it
    # The runner takes memory back from lower-lane work by suspending it (the batched llama
    # runner), so a full cache of lent work is not distress: KV utilisation then proposes no
    # level.
    kv_preemptible: bool = False
    error_rate: float = 0.2  # share of jobs failing in the runner: degraded above it
    min_samples: int = 5  # a rate or percentile needs this many samples to speak
    degraded_max_new_tokens: int = 128  # ladder step: 0 disables it
    pause_background: bool = True  # ladder step
    interactive_only: bool = True  # ladder step
    evaluate_s: float = 0.5  # how often the server calls update (a state changes no sooner)


HYSTERESIS = 0.8  # falling thresholds, as a share of the rising ones
# The interactive p95 TTFT or TPOT, as a multiple of each job's objective, at which each level
# is proposed: at 1.0, a twentieth of the chats miss it.
SLO_LEVELS = ((State.INTERACTIVE_ONLY, 1.5), (State.BATCH_PAUSED, 1.0), (State.DEGRADED, 0.8))
OBJECTIVES = ("ttft", "tpot")


class OverloadController:
    def __init__(self, settings: OverloadSettings, clock: Callable[[], float]) -> None:
        self.settings = settings
        self.clock = clock
        self.state = State.NORMAL
        self.changed_at = clock()
        self.transitions: collections.Counter[tuple[str, str]] = collections.Counter()
        # Interactive jobs' TTFT and TPOT, each as a share of its objective, by objective.
        self._slo: dict[str, collections.deque[tuple[float, float]]] = {
            name: collections.deque() for name in OBJECTIVES
        }
        # Admission attempts (yielded?): reported as the yield rate, never moving the state.
        self._admissions: collections.deque[tuple[float, bool]] = collections.deque()
        self._outcomes: collections.deque[tuple[float, bool]] = collections.deque()  # failed?
        self.kv_utilisation = 0.0

    # What the server measures ----------------------------------------------------------

    def observe_ttft(self, share: float) -> None:
        """An interactive job's first token: its TTFT over its objective."""
        self._slo["ttft"].append((self.clock(), share))

    def observe_tpot(self, share: float) -> None:
        """An interactive job's end: its TPOT over its objective."""
        self._slo["tpot"].append((self.clock(), share))

    def observe_admission(self, yielded: bool) -> None:
        """An admission attempt: for the yield rate, which is reported only (demand, not
        distress: it moves no state)."""
        self._admissions.append((self.clock(), yielded))

    def observe_outcome(self, failed: bool) -> None:
        self._outcomes.append((self.clock(), failed))

    # The state -------------------------------------------------------------------------

    def signals(self) -> dict[str, float | None]:
        """The measured signals over the window (None: too few samples)."""
        now = self.clock()
        horizon = now - self.settings.window_s
        windows: list[
            collections.deque[tuple[float, float]] | collections.deque[tuple[float, bool]]
        ]
        windows = [*self._slo.values(), self._admissions, self._outcomes]
        for samples in windows:
            while samples and samples[0][0] < horizon:
                samples.popleft()
        return {
            **{f"{name}_p95": self._p95([v for _, v in self._slo[name]]) for name in OBJECTIVES},
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
        """The state the signals call for, with thresholds scaled by ``scale``: the interactive
        objectives' p95s, KV utilisation and the error rate; never the yield rate (demand)."""
        s, level = self.settings, State.NORMAL
        for name in OBJECTIVES:
            p95 = signals[f"{name}_p95"]
            if p95 is not None:
                for state, share in SLO_LEVELS:
                    if p95 >= share * scale:
                        level = max(level, state)
                        break
        level = max(level, self._kv_level(signals["kv_utilisation"] or 0.0, scale))
        errors = signals["error_rate"]
        if errors is not None and errors >= s.error_rate * scale:
            level = max(level, State.DEGRADED)
        return level

    def _kv_level(self, kv: float, scale: float) -> State:
        s = self.settings
        if s.kv_preemptible:  # a full cache of lent work is reclaimed, not distress
            return State.NORMAL
        if kv >= min(0.95, s.kv_danger + 0.15) * scale:
            return State.INTERACTIVE_ONLY
        if kv >= s.kv_danger * scale:
            return State.BATCH_PAUSED
        return State.NORMAL

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

    def pause_level(self, lane: Lane) -> State | None:
        """The lowest state that pauses ``lane`` (None: no state does)."""
        s = self.settings
        if lane == Lane.BACKGROUND and s.pause_background:
            return State.BATCH_PAUSED
        if lane != Lane.INTERACTIVE and s.interactive_only:
            return State.INTERACTIVE_ONLY
        return None

    def paused(self, lane: Lane) -> bool:
        level = self.pause_level(lane)
        return level is not None and self.state >= level

    def max_new_tokens(self, lane: Lane, asked: int) -> int | None:
        """A lowered max_new_tokens for this job, or None to leave it as asked."""
        cap = self.settings.degraded_max_new_tokens
        if lane == Lane.INTERACTIVE and cap and self.state >= State.DEGRADED and asked > cap:
            return cap
        return None
