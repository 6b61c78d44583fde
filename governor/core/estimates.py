"""How long a slot will stay taken: the service-time estimates a pool's ledger learns online.

* Each job is expected to hold its slot for its own predicted time ``S_i``: the pool's
  :class:`~governor.core.service.ServiceModel` predicts it from the job's size (its prompt and
  ``max_new_tokens``, known at admission), with prefill and decode rates learnt from finished
  jobs, so that a chat beside a document rewrite is not given the pair's mean. A job the model
  cannot size (a raw payload, or any job before the rates are learnt) is expected to take
  ``S``: an exponentially weighted mean (``EWMA_ALPHA``) of the observed times of completed
  jobs, starting from the runner's own estimate; under a lane policy its lane's ``S`` (from its
  first completed job; the pool's until then). Only a job that completed teaches any of these:
  a runner failure, a cancel or a timeout says nothing about how long jobs take.
* ``err`` is the pool's typical prediction error: the exponentially weighted mean of ``|held -
  S_i| / S_i`` over completed jobs (0 until one has). A running job is likely to end within
  ``w = err * S_i`` of ``start + S_i``, so its slot is expected to free as that window opens,
  ``start + S_i - w``, and from then on its first waiter polls: it is told ``w / 2`` ahead, or,
  once the job has overrun ``S_i``, as much more as it has overrun, but at most a quarter of
  what it has run (:meth:`ServiceEstimates.expected_end`). A waiter told the prediction itself
  would leave the slot idle whenever the job ends early, one told "in a quarter of its time"
  whenever it ends a little late; a job far past its prediction is likely a long one, and its
  waiters told "any moment now" would retry in a busy loop. Never sooner than ``floor_s``.
* ``T``, the turnaround: how long a released slot waits for the returning client it was
  promised to, an exponentially weighted mean over clients that came when told (from
  ``floor_s``). A promise lapses ``grace = max(S/4, 20 ms)`` after its time (the client's
  jitter), and a freed slot is held for a promised client within ``hold = min(2 T, grace)`` of
  its time.

Running jobs' progress
----------------------
A job's predicted time holds only as long as the work beside it is what it was when the job was
admitted: on a batched runner every running sequence waits for every step, so a chat admitted
alone runs at another pace once long prompts are fed beside it. So while a job runs, its
execution reports its progress, and its end is predicted again from its own pace:

* while its prompt is fed (in chunks, beside other jobs' tokens; :meth:`ServiceEstimates.feeding`:
  the prompt tokens in the cache), ``end = now + (prompt - fed) * q + (ratio * max_new - 1) *
  p``, ``q`` the fewest seconds per prompt token between two of its reports so far (a prompt
  fed slowly beside chats goes faster once they end: a client told too early is refused and
  told again, one told too late leaves the slot idle), ``p`` the running jobs' mean pace
  (below), else the decode rate (learnt, or the runner's);
* while it generates (:meth:`ServiceEstimates.progress`: tokens generated, and when the first
  came), ``p`` its own seconds per token so far, ``end = now + (ratio * max_new - generated) *
  p``.

Its waiters are told that end itself: the pace is measured, not predicted, and a window of
``err`` of what is left would open again at every re-timing (a client told half of what is
left, then half of that, ...). Past that end, or past its expected length (``ratio * max_new``
tokens), how long it will go on is unknown again, and its end is predicted from its admission,
as above. A newcomer's decode is predicted at the running jobs' mean pace (the pace it will run
at beside them), rather than at the rate learnt from jobs that finished, perhaps alone.

Everything here is pure arithmetic: the caller passes the time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from .policy import Lane
from .service import JobSize, ServiceModel

EWMA_ALPHA = 0.2


@dataclass(frozen=True, slots=True)
class Completed:
    """What a finished job measured, for the service-time estimates (None: not measured).

    ``ttft_s`` is from the slot's start to the first output token; ``prompt_tokens`` and
    ``completion_tokens`` as the runner counted them.
    """

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None


class Running(Protocol):
    """A running job as the estimates see it (a :class:`~governor.core.ledger.Slot`)."""

    started: float
    expected_s: float  # its own predicted service time
    size: JobSize | None
    # From its progress: seconds per output token so far, when it is now expected to end
    # (None: from expected_s), and its prompt's last report (when, tokens fed, fastest pace).
    pace_s: float | None
    live_end: float | None
    fed_from: tuple[float, int, float] | None

    @property
    def paused_s(self) -> float:
        """Of its time since it started, the seconds it was suspended (its suspensions past)."""
        ...


class ServiceEstimates:
    """One pool's estimates of how long its jobs hold their slots: see the module docstring."""

    __slots__ = (
        "_pace_sum",
        "_paced",
        "error",
        "floor_s",
        "lane_service_s",
        "model",
        "service_s",
        "turnaround_s",
    )

    def __init__(self, expected_service_s: float, floor_s: float) -> None:
        self.floor_s = floor_s  # no job is expected to end sooner than this from now
        self.service_s = expected_service_s  # S: the pool's mean over completed jobs
        self.model = ServiceModel(expected_service_s)  # a job's service time from its size
        # How far completed jobs' held times fell from their predictions, relative to them
        # (0 until a job has completed).
        self.error = 0.0
        self.lane_service_s: dict[Lane, float] = {}  # under a lane policy, once a lane's job ends
        self.turnaround_s = floor_s  # T
        # The running jobs' paces (seconds per output token), summed, and how many have one.
        self._pace_sum = 0.0
        self._paced = 0

    @property
    def paced(self) -> int:
        """The running jobs that have reported a pace."""
        return self._paced

    def service_for(self, lane: Lane | None) -> float:
        """The expected service time of a job of ``lane`` (``None``: of any job)."""
        return self.lane_service_s.get(lane, self.service_s) if lane is not None else self.service_s

    def predict_s(self, size: JobSize | None, lane: Lane | None = None) -> float:
        """How long a job of ``size`` (in ``lane``) is expected to hold its slot: the model's
        prediction from its size (at the running jobs' pace, when they have one), or the lane's
        (or the pool's) mean where it has none."""
        model = self.model
        if not model.knows(size):
            return self.service_for(lane)
        return model.predict_s(size, self.running_pace())

    def running_pace(self) -> float | None:
        """The running jobs' mean seconds per output token (None: none has reported one)."""
        return self._pace_sum / self._paced if self._paced else None

    def grace(self) -> float:
        """How long after its time a promise still counts: the client's jitter."""
        return max(self.service_s / 4, 0.02)

    def hold(self) -> float:
        """How long either side of a client's promised time a free slot is held for it.

        Two turnarounds, at most the grace: a wider window idles slots for late clients, a
        narrower one lets newcomers take slots from punctual ones.
        """
        return min(2 * self.turnaround_s, self.grace())

    def expected_end(self, started: float, now: float, service_s: float | None = None) -> float:
        """When a job started at ``started`` may have freed its slot: as the window in which
        it is likely to end opens, ``started + S - err * S`` (``service_s``: the job's own
        prediction; the pool's mean by default); inside the window, half its half-width from
        now; once it has overrun ``S``, as much more as it has overrun, at most a quarter of
        what it has run (see the module docstring).
        """
        service = self.service_s if service_s is None else service_s
        window = service * self.error  # (it is likely to end within this of its prediction)
        ran = now - started
        poll = min(max(ran - service, window / 2), ran / 4)
        expected = max(started + service - window, now + poll)
        return max(expected, now + self.floor_s)

    def end_of(self, job: Running, now: float) -> float:
        """When a running job is expected to end: from its progress while it is within its
        expected length, else from its own predicted service time."""
        end = job.live_end
        if end is None or end <= now:
            return self.expected_end(job.started + job.paused_s, now, job.expected_s)
        return max(end, now + self.floor_s)

    def feeding(self, job: Running, fed: int, now: float) -> None:
        """``fed`` of the job's prompt tokens are in the cache: its end is predicted again
        from its prompt's pace (see "Running jobs' progress")."""
        size = job.size
        if size is None:
            return
        last = job.fed_from
        if last is None or fed <= last[1]:
            job.fed_from = (now, fed, math.inf) if last is None else last
            return
        since, before, fastest = last
        pace = min((now - since) / (fed - before), fastest)
        job.fed_from = (now, fed, pace)
        decode_s = self.running_pace()
        if decode_s is None:
            decode_s = self.model.decode_rate() or 0.0
        after_first = max(self.model.ratio * size.max_new_tokens - 1.0, 0.0)
        job.live_end = now + max(size.prompt_tokens - fed, 0) * pace + after_first * decode_s

    def progress(self, job: Running, generated: int, first_token: float, now: float) -> None:
        """The job has generated ``generated`` tokens, the first at ``first_token``: its end is
        predicted again from its own pace (see "Running jobs' progress")."""
        size = job.size
        if generated < 2 or size is None:
            return
        pace = (now - first_token) / (generated - 1)
        if job.pace_s is None:
            self._paced += 1
            self._pace_sum += pace
        else:
            self._pace_sum += pace - job.pace_s
        job.pace_s = pace
        expected = self.model.ratio * size.max_new_tokens
        job.live_end = now + (expected - generated) * pace if generated < expected else None

    def ended(self, job: Running, lane: Lane | None, held: float, done: Completed | None) -> None:
        """A job of ``lane`` left its slot after ``held`` seconds: its pace no longer counts,
        and one that finished (``done``: what it measured) teaches the estimates."""
        if job.pace_s is not None:
            self._paced -= 1
            # (a sum kept by adding and subtracting drifts: none left starts again from 0)
            self._pace_sum = self._pace_sum - job.pace_s if self._paced else 0.0
        if done is None:
            return
        self.model.observe(job.size, done.prompt_tokens, done.completion_tokens, done.ttft_s, held)
        self.service_s += EWMA_ALPHA * (held - self.service_s)
        if job.expected_s > 0:
            miss = abs(held - job.expected_s) / job.expected_s
            self.error += EWMA_ALPHA * (miss - self.error)
        if lane is not None:
            last = self.lane_service_s.get(lane, held)
            self.lane_service_s[lane] = last + EWMA_ALPHA * (held - last)

    def came_back(self, waited_s: float) -> None:
        """A promised client came when told and took a slot that had waited ``waited_s`` for
        it since its release: the turnaround learns it."""
        self.turnaround_s += EWMA_ALPHA * (waited_s - self.turnaround_s)
