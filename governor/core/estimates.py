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
admitted: on a batched runner every running sequence waits for every step, and a step that
feeds a prompt is many times one that only decodes. So while jobs run, their executions report
their progress (:meth:`ServiceEstimates.feeding`: a prompt's tokens in the cache;
:meth:`ServiceEstimates.progress`: tokens generated), and a sized job's end is predicted from
the work left in the batch (:meth:`ServiceEstimates.end_of`)::

    end = now + A + R * (p + G * R / 2)

* ``A``, the prompts still to feed (:meth:`ServiceEstimates.batch`, on a runner that says its
  rates: the batched llama runner): every running job's prompt tokens not yet in the cache, at
  a prompt token's pace ``q``, measured as prompts are fed (the time since the last prompt
  report over the tokens reported, decayed by ``FEED_DECAY`` a report, with ``FEED_PRIOR``
  tokens at the runner's rate, else the rate learnt). A runner that feeds a prompt holds every
  stream's next token for it: four long rewrites admitted together all end after the last
  one's prompt, not one prompt after their own. But a step feeds a chunk of a prompt at most,
  so a job ``R`` tokens from its end waits for ``R`` chunks at most
  (:meth:`ServiceEstimates.chunk_s`: a report's mean time). On any other runner, a job's own
  prompt only, before its first token.
* ``R``, the job's tokens left: its expected length (``ratio * max_new``) less those it has
  generated.
* ``p``, the seconds a step takes while only decodes run: the job's own pace, smoothed
  (``PACE_WEIGHT`` a token) over the intervals between its reports in which no prompt was fed
  (no job waited for its first token, fed or began); before it has one, the running jobs' mean
  pace, else the runner's decode rate (every slot generating), else the rate learnt. A pace
  taken over intervals that fed prompts would count the prompts twice (they are ``A``), and a
  pace since the first token would keep the long prompt steps of the job's first seconds for
  the rest of its run (a rewrite that began while three more prompts went in was predicted to
  end 180 s later, 30 s before it did).
* ``G``, how much a step grows each step (the batched llama runner's word: a step's cost a
  cell more, times the running streams, each a cell more a step): a long job's steps grow
  dearer as its context does, and a pace measured now is the pace of its cheapest steps left.

A job with a TPOT objective ends, at the latest, where its objective puts it (its first token
plus its expected length at the objective's pace): the runner defers prompts for it. Past its
expected length how long it will go on is unknown again, and its end is predicted from its
admission, as above; a job without a size, or on a runner whose rates are unknown, likewise.
Its waiters are told that end itself: the rates are measured, not predicted, and a window of
``err`` of what is left would open again at every re-timing (a client told half of what is
left, then half of that, ...). A newcomer's decode is predicted at the running jobs' mean pace
(the pace it will run at beside them).

Everything here is pure arithmetic: the caller passes the time.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from .policy import Lane
from .service import JobSize, ServiceModel

EWMA_ALPHA = 0.2
PACE_WEIGHT = 0.1  # the weight of one token's interval in a running job's smoothed pace
FEED_DECAY = 0.8  # the weight left to the earlier reports in the prompts' pace, per report
FEED_PRIOR = 256  # the weight, in prompt tokens, of the runner's (or learnt) rate in that pace


@dataclass(frozen=True, slots=True)
class Completed:
    """What a finished job measured, for the service-time estimates (None: not measured).

    ``ttft_s`` is from the slot's start to the first output token; ``prompt_tokens`` and
    ``completion_tokens`` as the runner counted them.
    """

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None


class Batch(NamedTuple):
    """What a batch's running jobs hold every stream's tokens for
    (:meth:`ServiceEstimates.batch`): ``prompts_s``, ``A``, their prompts still to feed;
    ``growth_s``, ``G``, how much a step grows each step."""

    prompts_s: float = 0.0
    growth_s: float = 0.0


NO_BATCH = Batch()


class Running(Protocol):
    """A running job as the estimates see it (a :class:`~governor.core.ledger.Slot`)."""

    started: float
    expected_s: float  # its own predicted service time
    size: JobSize | None
    tpot_s: float  # its TPOT objective (0: none)
    first_token: float | None  # when its first token came (None: not yet)
    # From its progress: its prompt tokens in the cache, its tokens generated, its last report
    # (when, tokens generated), and its pace (seconds a token while only decodes ran; None:
    # none measured yet).
    fed: int
    generated: int
    ticked: tuple[float, int] | None
    pace_s: float | None

    @property
    def paused_s(self) -> float:
        """Of its time since it started, the seconds it was suspended (its suspensions past)."""
        ...


class ServiceEstimates:
    """One pool's estimates of how long its jobs hold their slots: see the module docstring."""

    __slots__ = (
        "_fed",
        "_pace_sum",
        "_paced",
        "error",
        "fed_at",
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
        # The prompts' pace: the seconds, the tokens and the reports that fed them, decayed.
        self._fed = (0.0, 0.0, 0.0)
        self.fed_at = -math.inf  # when a prompt was last reported fed

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
        return model.predict_s(size, self.running_pace(), self.prompt_pace())

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

    def decode_pace(self, job: Running | None = None) -> float | None:
        """Seconds a step takes while only decodes run: ``job``'s own pace, else the running
        jobs' mean, else the runner's decode rate, else the one learnt (None: none known)."""
        if job is not None and job.pace_s is not None:
            return job.pace_s
        running = self.running_pace()
        return running if running is not None else self.model.decode_rate()

    def prompt_pace(self) -> float | None:
        """Seconds a prompt token takes on this runner now: measured as prompts were fed, with
        ``FEED_PRIOR`` tokens at the runner's rate, else the one learnt (so that a few short
        prompts, their time all overhead, do not say what a long one costs); None: neither
        measured nor known."""
        seconds, tokens, _ = self._fed
        prior = self.model.prompt_rate()
        if prior is not None:
            seconds, tokens = seconds + FEED_PRIOR * prior, tokens + FEED_PRIOR
        return seconds / tokens if tokens else None

    def batch(self, jobs: Collection[Running]) -> Batch:
        """What the running ``jobs`` hold every stream's tokens for: the seconds their prompt
        tokens not yet in the cache take (``A``), and how much a step grows each step as their
        streams' cells do (``G``); on a runner that feeds them beside every stream (one that
        says its rates: the batched llama runner), none on any other (each job its own, as the
        stub's)."""
        rates = self.model.assumed()
        rate = self.prompt_pace() if rates is not None else None
        if rates is None or not rate:
            return NO_BATCH
        tokens = sum(
            max(job.size.prompt_tokens - job.fed, 0)
            for job in jobs
            if job.size is not None and job.first_token is None
        )
        return Batch(tokens * rate, rates.cell_s * len(jobs))

    def fed_beside(self, tokens: int, left_s: float) -> float:
        """How much later a running job ``left_s`` from its end ends for ``tokens`` prompt tokens
        fed beside it meanwhile (on a runner that feeds them so, as :meth:`batch`): their time,
        at most a chunk for each of its tokens left."""
        if not tokens or left_s <= 0 or self.model.assumed() is None:
            return 0.0
        pace, rate = self.decode_pace(), self.prompt_pace()
        if not pace or not rate:
            return 0.0
        return min(tokens * rate, left_s / pace * self.chunk_s())

    def end_of(self, job: Running, now: float, batch: Batch = NO_BATCH) -> float:
        """When a running job is expected to end: from the work left in the ``batch`` (of the
        running jobs, :meth:`batch`) while it is within its expected length, else from its own
        predicted service time (see "Running jobs' progress")."""
        size = job.size
        pace = self.decode_pace(job) if size is not None else None  # (none asked of the unsized)
        expected = self.model.ratio * size.max_new_tokens if size is not None else 0.0
        if (
            size is None
            or pace is None
            or (job.first_token is None and not self.model.knows(size))
            or job.generated >= expected
        ):
            return self.expected_end(job.started + job.paused_s, now, job.expected_s)
        tokens = expected - max(job.generated, 1)  # (the first comes with the prompt)
        left = tokens * (pace + batch.growth_s * tokens / 2)  # (each step a little dearer)
        # (a step feeds a chunk of prompt at most: a job with few tokens left ends first)
        end = now + min(batch.prompts_s, max(tokens, 1.0) * self.chunk_s()) + left
        if job.first_token is None:  # (its own prompt, where the others' are not counted)
            own = max(size.prompt_tokens - job.fed, 0) * (self.prompt_pace() or 0.0)
            end += max(own - batch.prompts_s, 0.0) + self.model.overhead_s()
        if job.tpot_s and job.first_token is not None:  # (its objective defers the prompts)
            end = min(end, max(job.first_token + job.paused_s + expected * job.tpot_s, now + left))
        return max(end, now + self.floor_s)

    def feeding(self, job: Running, fed: int, now: float) -> None:
        """``fed`` of the job's prompt tokens are in the cache: the prompts' pace learns the
        time since the last prompt was reported fed (or since the job's admission, if later):
        two prompts fed in one step share its time."""
        tokens = fed - job.fed
        if tokens <= 0:
            return
        job.fed = fed
        seconds = max(now - max(job.started, self.fed_at), 0.0)
        self.fed_at = now
        last_s, last_n, reports = self._fed
        d = FEED_DECAY
        self._fed = (d * last_s + seconds, d * last_n + tokens, d * reports + 1.0)

    def chunk_s(self) -> float:
        """The seconds a report of a prompt fed took, on average (inf: none measured yet): what
        a step that feeds a prompt holds every stream's next token for."""
        seconds, _, reports = self._fed
        return seconds / reports if reports else math.inf

    def progress(self, job: Running, generated: int, now: float, clean: bool) -> None:
        """The job has generated ``generated`` tokens; ``clean``: no prompt was fed since its
        last report, so the interval teaches its pace (see "Running jobs' progress")."""
        last = job.ticked
        job.ticked = (now, generated)
        job.generated = generated
        if last is None or generated <= last[1] or not clean or job.size is None:
            return
        tokens = generated - last[1]
        pace = (now - last[0]) / tokens
        old = job.pace_s
        if old is None:
            self._paced += 1
        else:
            pace = old + (1.0 - (1.0 - PACE_WEIGHT) ** tokens) * (pace - old)
        self._pace_sum += pace - (old or 0.0)
        job.pace_s = pace

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
