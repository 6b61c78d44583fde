"""The admission ledger: a hard cap on concurrent execution, and the retry hint.

:meth:`SlotLedger.admit` is the whole admission decision. It is synchronous, so nothing can
run between checking for a free slot and taking it: with asyncio, inflight can never exceed
the cap. It returns a :class:`Slot` (a token released exactly once, in ``finally``) or a
:class:`Refusal` carrying the ``retry_hint_ms`` to send with the ``yield``.

The retry hint
--------------
Nothing is queued on the server, but the ledger remembers when it told each yielded client
to come back (its *promise*), so that the clients it turned away are spread over the coming
slot releases instead of all returning at the same instant.

* Each job is expected to hold its slot for its own predicted time ``S_i``: the pool's
  :class:`~governor.core.service.ServiceModel` predicts it from the job's size (its prompt and
  ``max_new_tokens``, known at admission), with prefill and decode rates learnt online from
  finished jobs, so that a chat beside a document rewrite is not given the pair's mean. A job
  the model cannot size (a raw payload, or any job before the rates are learnt) is expected to
  take ``S``: an exponentially weighted mean of the observed times of completed jobs (``alpha``
  = 0.2), starting from the runner's own estimate; under a lane policy its lane's ``S`` (from
  its first completed job; the pool's until then). Only a job that completed teaches any of
  these: a runner failure, a cancel or a timeout says nothing about how long jobs take.
* Each running job ``i`` is likely to end within ``w_i = err * S_i`` of ``start_i + S_i``,
  ``err`` being the pool's typical prediction error: the exponentially weighted mean of ``|held
  - S| / S`` over completed jobs (0 until one has). Its slot is expected to free as that window
  opens, ``e_i = start_i + S_i - w_i``, and from then on its first waiter polls: it is told
  ``w_i / 2`` ahead, or, once the job has overrun ``S_i``, as much more as it has overrun, but
  at most a quarter of what it has run. A waiter told the prediction itself would leave the
  slot idle whenever the job ends early, one told "in a quarter of its time" whenever it ends
  a little late; a job far past its prediction is likely a long one, and its waiters told "any
  moment now" would retry in a busy loop. Never sooner than ``now + floor`` (``min_hint_ms``);
  a free slot counts as releasing at ``now + floor``. After its
  release each slot frees again every ``W + T`` seconds, ``T`` being the turnaround: how long
  a released slot waits for the returning client it was promised to (an exponentially
  weighted mean, from ``min_hint_ms``), and ``W`` the mean predicted time of the jobs of the
  clients ahead of the waiting one in line (they take those turns), or its own job's where
  none is. The ``k``-th release from now is the ``k``-th smallest of the times ``e_i + j * (W
  + T)``: a slot that frees long before another turns over many times first.
* ``P`` is the number of promises still outstanding. A promise belongs to a held payload: it
  is withdrawn when the client comes back or the payload is dropped (client gone, new
  manifest), and it lapses ``grace = max(S/4, 20 ms)`` after its time (the client's jitter).
* A new yield is promised release number ``P``: ``hint`` is that release's time less ``now``,
  clamped to ``[min_hint_ms, max_hint_ms]``.
* Promises are kept in order, a line that lives on the clients' side. A slot that frees is
  held for the clients whose promised time is within ``hold = min(2 T, grace)`` of now: a
  newcomer gets a free slot only if more slots are free than such clients. A client later
  than that keeps its place in line (until its promise lapses) but not the slot, so clients
  that ignore their hint cost at most ``hold`` of idle slot each.
* A client that comes back (it resends the final chunk of the payload it was refused) and
  finds no slot for it keeps its place in line and is re-timed to that place's release
  (``k = q``, the promises ahead of it).

Running jobs' progress
----------------------
A job's predicted time holds only as long as the work beside it is what it was when the job
was admitted: on a batched runner every running sequence waits for every step, so a chat
admitted alone runs at another pace once long prompts are fed beside it. So while a job runs,
its execution reports its progress, and its end (``e``) is predicted again from its own pace:

* while its prompt is fed (in chunks, beside other jobs' tokens; :meth:`Slot.feeding`: the
  prompt tokens in the cache), ``e = now + (prompt - fed) * q + (ratio * max_new - 1) * p``,
  ``q`` the fewest seconds per prompt token between two of its reports so far (a prompt fed
  slowly beside chats goes faster once they end: a client told too early is refused and told
  again, one told too late leaves the slot idle), ``p`` the running jobs' mean pace (below),
  else the decode rate learnt;
* while it generates (:meth:`Slot.progress`: tokens generated, and when the first came), ``p``
  its own seconds per token so far, ``e = now + (ratio * max_new - generated) * p``.

Its waiters are told ``e`` itself: the pace is measured, not predicted, and a window of ``err``
of what is left would open again at every re-timing (a client told half of what is left, then
half of that, ...). Past ``e``, or past its expected length (``ratio * max_new`` tokens), how
long it will go on is unknown again, and its end is predicted from its admission, as above. A
newcomer's decode is predicted at the running jobs' mean pace (the pace it will run at beside
them), rather than at the rate learnt from jobs that finished, perhaps alone.

Under a lane policy (:mod:`governor.core.policy`) the line is lane-aware: a promise carries its
job's lane, and a client counts, and a freed slot is held for, only the promises of its own lane
or a higher one. A client of a lower lane counts only the slots it may take: those the
interactive reserve does not keep (``lane_full`` when the only free slots are the reserve's).
It waits in line for the ends of the jobs in those slots, not for a chat's in the reserve, and
the first interactive clients in line are the reserve's, not ahead of it. A policy may lend the
reserve (``reserve_lend_after_s``): once no interactive job has asked for a slot for that long
and none waits in line, every slot is the lower lanes' too, until the next one asks. The lane
quota and the KV budget are then checked in the same decision.

With one client per slot release, a slot is retaken almost as soon as it frees, and most
retries are admitted at their first attempt (``docs/BENCHMARKS.md`` measures both).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from protocol.codes import NeedCode

from .kvbudget import CacheShape, KvBudget
from .policy import LANES, Demand, Lane, LanePolicy
from .service import JobSize, ServiceModel

Clock = Callable[[], float]

EWMA_ALPHA = 0.2
MAX_PROMISES = 65536  # bounds the ledger's memory whatever the number of refused clients
# Withdrawn and lapsed promises linger in the line and the lapse heap until they reach the
# front; both are rebuilt when the dead outnumber the living by this many.
SLACK = 64


class Promise:
    """When a refused client was told to come back; withdrawn with :meth:`SlotLedger.withdraw`.

    ``rank`` is its lane's place in :data:`LANES` (0 without a lane policy): a client waits only
    behind promises of its own lane or a higher one. ``service_s`` is its job's predicted
    service time: how long the slot it is promised will be held once it is back.
    """

    __slots__ = ("at", "lapses", "queued", "rank", "service_s")

    def __init__(self, at: float, lapses: float, rank: int = 0, service_s: float = 0.0) -> None:
        self.at = at
        self.lapses = lapses
        self.rank = rank
        self.service_s = service_s
        self.queued = True  # still in the line: neither withdrawn nor lapsed


@dataclass(frozen=True, slots=True)
class Refusal:
    """No slot now: answer ``yield`` with this code and hint."""

    need_code: NeedCode
    retry_hint_ms: int
    promise: Promise | None = None


@dataclass(frozen=True, slots=True)
class Completed:
    """What a finished job measured, for the service-time estimates (None: not measured).

    ``ttft_s`` is from the slot's start to the first output token; ``prompt_tokens`` and
    ``completion_tokens`` as the runner counted them.
    """

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None


class Slot:
    """One taken execution slot. :meth:`release` gives it back; calling it again does nothing."""

    __slots__ = (
        "_ledger",
        "_released",
        "demand",
        "expected_s",
        "fed_from",
        "kv_cache",
        "kv_tokens",
        "live_end",
        "pace_s",
        "size",
        "started",
    )

    def __init__(
        self, ledger: SlotLedger, started: float, demand: Demand | None, size: JobSize | None
    ) -> None:
        self._ledger = ledger
        self.started = started
        self.demand = demand  # its lane and KV reservation, under a lane policy
        self.size = size  # its prompt and max_new_tokens, when it is an inference job
        # Its own predicted service time (the lane's or the pool's mean where the model cannot
        # size it): every hint that waits on this job's end reads it.
        self.expected_s = ledger.predict_s(size, demand.lane if demand is not None else None)
        self.kv_cache: int | None = None  # the KV cache its cells are reserved in
        self.kv_tokens = 0  # how many
        # From its progress (:meth:`feeding`, :meth:`progress`): seconds per output token so
        # far, and when it is now expected to end (None: from expected_s).
        self.pace_s: float | None = None
        self.live_end: float | None = None
        # Its prompt's last report (when, tokens fed) and its fastest pace so far.
        self.fed_from: tuple[float, int, float] | None = None
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def progress(self, generated: int, first_token: float, now: float) -> None:
        """The job has generated ``generated`` tokens, the first at ``first_token``: its end is
        predicted again from its own pace (see "Running jobs' progress" above)."""
        if self._released:
            return
        self._ledger._progress(self, generated, first_token, now)

    def feeding(self, fed: int, now: float) -> None:
        """``fed`` of the job's prompt tokens are in the cache: its end is predicted again from
        its prompt's pace (see "Running jobs' progress" above)."""
        if self._released:
            return
        self._ledger._feeding(self, fed, now)

    def release(self, *, done: Completed | None = None) -> float:
        """Free the slot; a job that finished (``done``: what it measured) teaches the
        service-time estimates, one that did not (None) teaches them nothing.

        Returns the seconds the slot was held.
        """
        if self._released:
            return 0.0
        self._released = True
        return self._ledger._release(self, done)


def kv_demand(demand: Demand | None, size: JobSize | None) -> int:
    """The KV cells a job reserves: its prompt and ``max_new_tokens`` (0: not an inference
    job)."""
    if demand is not None:
        return demand.kv_tokens
    return size.prompt_tokens + size.max_new_tokens if size is not None else 0


class SlotLedger:
    def __init__(
        self,
        cap: int,
        *,
        expected_service_s: float = 1.0,
        min_hint_ms: int = 5,
        max_hint_ms: int = 60_000,
        clock: Clock = time.monotonic,
        policy: LanePolicy | None = None,
        kv: KvBudget | None = None,
        kv_used: Callable[[], int] | None = None,
    ) -> None:
        if cap < 1:
            raise ValueError("cap must be at least 1")
        self.cap = cap
        self.policy = policy
        self.lane_inflight: collections.Counter[Lane] = collections.Counter()
        # The runner's KV caches (every inference job reserves its cells in one), or, for a
        # runner without one, a lane policy's notional capacity as a single cache.
        if kv is None and policy is not None and policy.kv_capacity:
            kv = KvBudget((CacheShape(policy.kv_capacity, cap),))
        self.kv = kv
        # The cells the caches really hold, as the runner last reported (the reservations
        # stand in for a runner that reports none).
        self.kv_used = kv_used
        self.min_hint_ms = min_hint_ms
        self.max_hint_ms = max_hint_ms
        self.clock = clock
        self.service_s = expected_service_s
        self.model = ServiceModel(expected_service_s)  # a job's service time from its size
        # How far completed jobs' held times fell from their predictions, relative to them
        # (0 until a job has completed).
        self.error = 0.0
        self.lane_service_s: dict[Lane, float] = {}  # under a lane policy, once a lane's job ends
        # How long a released slot waits for the returning client it was promised to.
        self.turnaround_s = min_hint_ms / 1000
        self._freed: list[float] = []  # when each free slot was released, in that order
        self.executed_total = 0  # admissions
        self.yielded_total = 0
        self.peak_inflight = 0
        self.draining = False
        # When an interactive job last asked for a slot (under a lane policy that lends the
        # interactive reserve once none has for a while); the reserve is kept from the start.
        self._interactive_seen = clock()
        self._running: dict[Slot, None] = {}  # insertion-ordered set
        # The running jobs' paces (seconds per output token), summed, and how many have one.
        self._pace_sum = 0.0
        self._paced = 0
        # The line, in order. A promise withdrawn or lapsed (``queued`` False) stays in it, and
        # is skipped, until it reaches the front (removing it from the middle would cost a
        # walk of the line).
        self._promises: deque[Promise] = deque()
        # (lapses, n, promise), earliest first: promises lapse by their own time, not the
        # line's order (a background client first in line may be promised a later time than
        # an interactive client behind it). Entries of re-timed or dequeued promises are stale.
        self._lapsing: list[tuple[float, int, Promise]] = []
        self._pushed = itertools.count()
        self._promised = [0] * len(LANES)  # promises in the line, by rank
        self._promised_s = [0.0] * len(LANES)  # the sum of their jobs' service_s, by rank

    @property
    def inflight(self) -> int:
        return len(self._running)

    @property
    def kv_reserved(self) -> int:
        return self.kv.reserved if self.kv is not None else 0

    @property
    def kv_in_use(self) -> int:
        """The cells the caches hold: as the runner reports, else the reservations."""
        return self.kv_used() if self.kv_used is not None else self.kv_reserved

    @property
    def kv_utilisation(self) -> float:
        """The share of the KV capacity in use (0 without a KV budget)."""
        return self.kv_in_use / self.kv.capacity if self.kv is not None else 0.0

    @property
    def saturated(self) -> bool:
        return len(self._running) >= self.cap

    @property
    def ready(self) -> bool:
        """Would a job be admitted now? (``server.health`` 1.)"""
        return not self.draining and not self.saturated

    def admit(
        self,
        promise: Promise | None = None,
        demand: Demand | None = None,
        size: JobSize | None = None,
    ) -> Slot | Refusal:
        """Take a slot, or say why not and when to come back.

        ``promise`` is the one a returning client was given when it was last refused;
        ``demand`` the job's lane and KV reservation, when a lane policy is in force; ``size``
        its prompt and ``max_new_tokens``, when it is an inference job: the slot's expected
        end, and the turns of the slots it waits for when refused, are predicted from it.
        """
        now = self.clock()
        self._lapse(now)
        rank = LANES.index(demand.lane) if demand is not None and self.policy is not None else 0
        if self.draining:
            if promise is not None:
                self.withdraw(promise)
            return self.refused(Refusal(NeedCode.DRAINING, self.max_hint_ms))
        free = self.cap - len(self._running)
        # The free slots this job may take: not those the interactive reserve keeps.
        if rank == 0:
            self._interactive_seen = now
        reserved = self._unused_reserve(rank, now)
        usable = free - reserved
        # A free slot is not for the taking while clients ahead in line have their time come.
        if usable <= self._due_ahead(now, promise, rank, reserved):
            hint_ms, promise = self._promise(now, promise, rank, size)
            code = NeedCode.LANE_FULL if usable <= 0 < free else NeedCode.SERVER_BUSY
            return self.refused(Refusal(code, hint_ms, promise))
        refusal = None
        if demand is not None and self.policy is not None:
            refusal = self._policy_refusal(now, demand)
        kv_cache, kv_tokens = None, kv_demand(demand, size)
        if refusal is None and self.kv is not None and kv_tokens:
            kv_cache = self.kv.place(kv_tokens)
            if kv_cache is None:
                refusal = Refusal(NeedCode.KV_PRESSURE, self.hint_ms(now, self._next_end(now)))
        if refusal is not None:
            if promise is not None:
                self.withdraw(promise)
            return self.refused(refusal)
        # The slot taken is taken as the one freed last: a slot freed long before (the
        # interactive reserve, idle while no chat comes) was not waiting for this client.
        freed = self._freed.pop() if self._freed else None
        if promise is not None:
            self.withdraw(promise)
            # Only a client that came when it was told says how long a slot waits for it.
            if freed is not None and abs(now - promise.at) <= self._grace():
                self.turnaround_s += EWMA_ALPHA * (now - freed - self.turnaround_s)
        slot = Slot(self, now, demand, size)
        if kv_cache is not None:
            slot.kv_cache, slot.kv_tokens = kv_cache, kv_tokens
        self._running[slot] = None
        if demand is not None:
            self.lane_inflight[demand.lane] += 1
        self.executed_total += 1
        if len(self._running) > self.peak_inflight:
            self.peak_inflight = len(self._running)
        return slot

    def waiting(self, rank: int) -> int:
        """Promises still in the line (withdrawn and lapsed ones are not) of rank <= ``rank``:
        clients waiting for a slot in that lane or a higher one. 0 for a negative ``rank``."""
        self._lapse(self.clock())
        return sum(self._promised[: rank + 1]) if rank >= 0 else 0

    def waiting_above(self, rank: int) -> int:
        """Clients in line of a lane higher than the one ranked ``rank`` that a job of that lane
        would keep from a slot: all of them, less the first interactive ones, whom the
        interactive reserve serves (its slots are not that job's to take anyway)."""
        waiting = self.waiting(rank - 1)
        reserve = self._reserve(rank, self.clock())
        if waiting and reserve:
            waiting -= min(self._promised[0], reserve)
        return waiting

    def place(
        self,
        promise: Promise | None,
        rank: int,
        size: JobSize | None = None,
        *,
        doublings: int = 0,
        until_ms: int | None = None,
    ) -> tuple[int, Promise | None]:
        """A place in line for a client refused before the ledger's own check (a paused lane),
        as :meth:`admit` gives one: ``promise`` is kept and re-timed, a newcomer goes to the
        back. The hint is when that place comes; with ``doublings``, that doubled as many times
        but no later than ``until_ms`` from now, and never before the place comes.
        """
        now = self.clock()
        self._lapse(now)
        return self._promise(now, promise, rank, size, doublings, until_ms)

    def predict_s(self, size: JobSize | None, lane: Lane | None = None) -> float:
        """How long a job of ``size`` (in ``lane``) is expected to hold its slot: the model's
        prediction from its size (at the running jobs' pace, when they have one), or the lane's
        (or the pool's) mean where it has none."""
        model = self.model
        if not model.knows(size):
            return self.service_for(lane)
        return model.predict_s(size, self._running_pace())

    def _running_pace(self) -> float | None:
        """The running jobs' mean seconds per output token (None: none has reported one)."""
        return self._pace_sum / self._paced if self._paced else None

    def _feeding(self, slot: Slot, fed: int, now: float) -> None:
        """A job's prompt being fed (see "Running jobs' progress" above)."""
        size = slot.size
        if size is None:
            return
        last = slot.fed_from
        if last is None or fed <= last[1]:
            slot.fed_from = (now, fed, math.inf) if last is None else last
            return
        since, before, fastest = last
        pace = min((now - since) / (fed - before), fastest)
        slot.fed_from = (now, fed, pace)
        decode_s = self._running_pace()
        if decode_s is None:
            decode_s = self.model.decode_s or 0.0
        after_first = max(self.model.ratio * size.max_new_tokens - 1.0, 0.0)
        slot.live_end = now + max(size.prompt_tokens - fed, 0) * pace + after_first * decode_s

    def _progress(self, slot: Slot, generated: int, first_token: float, now: float) -> None:
        """A running job's progress (see "Running jobs' progress" above)."""
        size = slot.size
        if generated < 2 or size is None:
            return
        pace = (now - first_token) / (generated - 1)
        if slot.pace_s is None:
            self._paced += 1
            self._pace_sum += pace
        else:
            self._pace_sum += pace - slot.pace_s
        slot.pace_s = pace
        expected = self.model.ratio * size.max_new_tokens
        slot.live_end = now + (expected - generated) * pace if generated < expected else None

    def refused(self, refusal: Refusal) -> Refusal:
        """Count a refusal (also one decided outside the ledger, for a tenant's limits)."""
        self.yielded_total += 1
        return refusal

    def _reserve(self, rank: int, now: float) -> int:
        """The slots a job of the lane ranked ``rank`` may not take: the interactive reserve
        (0 for interactive work, without a lane policy, or while the reserve is lent: no
        interactive job has come for ``reserve_lend_after_s`` and none waits in line)."""
        policy = self.policy
        if policy is None or rank == 0:
            return 0
        lend_after = policy.reserve_lend_after_s
        if lend_after and now - self._interactive_seen >= lend_after and not self._promised[0]:
            return 0
        return policy.interactive_reserve

    def _unused_reserve(self, rank: int, now: float) -> int:
        """The free slots a job of the lane ranked ``rank`` may not take: the reserve less
        the interactive jobs running."""
        reserve = self._reserve(rank, now)
        return max(reserve - self.lane_inflight[Lane.INTERACTIVE], 0) if reserve else 0

    def _policy_refusal(self, now: float, demand: Demand) -> Refusal | None:
        """The lane quota and the KV budget, in that order (the interactive reserve is kept
        by :meth:`admit`, in the line)."""
        policy = self.policy
        assert policy is not None
        lane = demand.lane
        quota = policy.lane_slots.get(lane)
        if quota is not None and self.lane_inflight[lane] >= quota:
            return Refusal(NeedCode.LANE_FULL, self.hint_ms(now, self._lane_release(now, lane)))
        # Below the interactive lane: what is reserved must leave the interactive share free,
        # and what the caches really hold must stay under the danger line. (Every lane's job
        # must fit in a cache: :meth:`admit` reserves its cells after this.)
        capacity = self.kv.capacity if self.kv is not None else 0
        if capacity and lane != Lane.INTERACTIVE:
            reserved = self.kv_reserved + demand.kv_tokens
            if (
                reserved > (1.0 - policy.kv_interactive_share) * capacity
                or self.kv_in_use + demand.kv_tokens > policy.kv_danger * capacity
            ):
                return Refusal(NeedCode.KV_PRESSURE, self.hint_ms(now, self._next_end(now)))
        return None

    def next_end_ms(self) -> int:
        """The hint to the first running job's expected end."""
        now = self.clock()
        return self.hint_ms(now, self._next_end(now))

    def revoked(self, slot: Slot) -> None:
        """``slot`` was released before its job ran (the fleet refused it): it executed nothing."""
        assert slot.released
        self.executed_total -= 1

    def _next_end(self, now: float) -> float:
        """When the first running job is expected to end (a free slot frees nothing more)."""
        return min((self.slot_end(slot, now) for slot in self._running), default=now)

    def _lane_release(self, now: float, lane: Lane) -> float:
        """When the first running job of ``lane`` is expected to end."""
        return min(
            self.slot_end(slot, now)
            for slot in self._running
            if slot.demand is not None and slot.demand.lane == lane
        )

    def service_for(self, lane: Lane | None) -> float:
        """The expected service time of a job of ``lane`` (``None``: of any job)."""
        return self.lane_service_s.get(lane, self.service_s) if lane is not None else self.service_s

    def slot_end(self, slot: Slot, now: float) -> float:
        """When a running job is expected to end: from its progress while it is generating
        within its expected length, else from its own predicted service time."""
        end = slot.live_end
        if end is None or end <= now:
            return self.expected_end(slot.started, now, slot.expected_s)
        return max(end, now + self.min_hint_ms / 1000)

    def expected_end(self, started: float, now: float, service_s: float | None = None) -> float:
        """When a job started at ``started`` may have freed its slot: as the window in which
        it is likely to end opens, ``started + S - err * S`` (``service_s``: the job's own
        prediction, :attr:`Slot.expected_s`; the pool's mean by default); inside the window,
        half its half-width from now; once it has overrun ``S``, as much more as it has
        overrun, at most a quarter of what it has run (see the module docstring).
        """
        service = self.service_s if service_s is None else service_s
        window = service * self.error  # (it is likely to end within this of its prediction)
        ran = now - started
        poll = min(max(ran - service, window / 2), ran / 4)
        expected = max(started + service - window, now + poll)
        return max(expected, now + self.min_hint_ms / 1000)

    def hint_ms(self, now: float, at: float) -> int:
        """Milliseconds from ``now`` to ``at``, within the hint's bounds."""
        # (less a nanosecond, so that float noise does not round 600 ms up to 601)
        hint_ms = math.ceil((at - now) * 1000 - 1e-6)
        return min(max(hint_ms, self.min_hint_ms), self.max_hint_ms)

    def withdraw(self, promise: Promise) -> None:
        """Forget a promise: its client came back, or will not."""
        if promise.queued:
            self._dequeued(promise)
            self._sweep()

    def _dequeued(self, promise: Promise) -> None:
        promise.queued = False
        rank = promise.rank
        self._promised[rank] -= 1
        # (a sum kept by adding and subtracting drifts: an empty rank starts again from 0)
        self._promised_s[rank] = (
            self._promised_s[rank] - promise.service_s if self._promised[rank] else 0.0
        )

    def _release(self, slot: Slot, done: Completed | None) -> float:
        del self._running[slot]
        if slot.pace_s is not None:
            self._paced -= 1
            # (a sum kept by adding and subtracting drifts: none left starts again from 0)
            self._pace_sum = self._pace_sum - slot.pace_s if self._paced else 0.0
        if slot.demand is not None:
            self.lane_inflight[slot.demand.lane] -= 1
        if slot.kv_cache is not None:
            assert self.kv is not None
            self.kv.release(slot.kv_cache, slot.kv_tokens)
        now = self.clock()
        self._freed.append(now)
        held = now - slot.started
        if done is not None:
            self.model.observe(
                slot.size, done.prompt_tokens, done.completion_tokens, done.ttft_s, held
            )
            self.service_s += EWMA_ALPHA * (held - self.service_s)
            if slot.expected_s > 0:
                miss = abs(held - slot.expected_s) / slot.expected_s
                self.error += EWMA_ALPHA * (miss - self.error)
            if slot.demand is not None:
                lane = slot.demand.lane
                last = self.lane_service_s.get(lane, held)
                self.lane_service_s[lane] = last + EWMA_ALPHA * (held - last)
        return held

    def _lapse(self, now: float) -> None:
        lapsing = self._lapsing
        if not lapsing or lapsing[0][0] >= now:
            return
        while lapsing and lapsing[0][0] < now:
            lapses, _, promise = heapq.heappop(lapsing)
            if promise.queued and promise.lapses == lapses:  # (else a stale entry)
                self._dequeued(promise)
        self._sweep()

    def _sweep(self) -> None:
        """Drop dequeued promises from the front of the line; rebuild the line and the heap
        when dequeued ones fill most of them (so both stay within twice the live promises)."""
        promises = self._promises
        while promises and not promises[0].queued:
            promises.popleft()
        bound = 2 * sum(self._promised) + SLACK
        if len(promises) > bound:
            self._promises = promises = deque(p for p in promises if p.queued)
        if len(self._lapsing) > bound:
            self._lapsing = [(p.lapses, next(self._pushed), p) for p in promises if p.queued]
            heapq.heapify(self._lapsing)

    def _due_ahead(self, now: float, promise: Promise | None, rank: int, reserved: int = 0) -> int:
        """Clients ahead of ``promise``'s (of all, for a newcomer) a free slot is held for.

        A slot is held for a client from ``hold`` before its promised time (a slot that frees
        a moment early is still its) to ``hold`` after it (a client that is later than that
        keeps its place in line, but not the slot). ``hold`` is two turnarounds, at most the
        grace: a wider window idles slots for late clients, a narrower one lets newcomers take
        slots from punctual ones. The first ``reserved`` interactive clients due take the
        reserve's free slots, not those of a lower lane's client.
        """
        hold = min(2 * self.turnaround_s, self._grace())
        due = interactive = 0
        for p in self._promises:
            if p is promise:
                break
            if not p.queued:
                continue
            if p.at > now + hold:
                break
            if p.at + hold >= now and p.rank <= rank:
                due += 1
                interactive += p.rank == 0
        return due - min(interactive, reserved)

    def _grace(self) -> float:
        return max(self.service_s / 4, 0.02)

    def _promise(
        self,
        now: float,
        promise: Promise | None,
        rank: int = 0,
        size: JobSize | None = None,
        doublings: int = 0,
        until_ms: int | None = None,
    ) -> tuple[int, Promise | None]:
        """The hint for a refusal, and the promise that goes with it.

        A returning client keeps its place in line and is re-timed to the release of that
        place (it is found by walking the line, usually from near its head: clients come back
        in the order they were told); a newcomer, in constant time, is promised the release
        after every promise outstanding of its own lane or a higher one. The slots turn over
        at the pace of the jobs of the clients ahead: the mean of their predicted times.
        """
        promises = self._promises
        own_s = self.predict_s(size, LANES[rank] if self.policy is not None else None)
        if promise is not None and promise.queued:
            counts, seconds = [0] * len(LANES), [0.0] * len(LANES)
            for p in promises:
                if p is promise:
                    break
                if p.queued and p.rank <= rank:
                    counts[p.rank] += 1
                    seconds[p.rank] += p.service_s
        else:  # a newcomer, or a client whose promise lapsed: to the back
            promise = None
            counts, seconds = self._promised, self._promised_s
        ahead, ahead_s = sum(counts[: rank + 1]), sum(seconds[: rank + 1])
        reserve = self._reserve(rank, now)
        if reserve and counts[0]:  # the reserve serves the first interactive clients
            ahead -= min(counts[0], reserve)
            ahead_s -= seconds[0] * min(counts[0], reserve) / counts[0]
        turn_s = ahead_s / ahead if ahead > 0 else own_s
        hint_ms = self.hint_ms(now, self._release_time(now, ahead, rank, turn_s))
        if doublings:
            longest = self.max_hint_ms if until_ms is None else until_ms
            hint_ms = min(max(hint_ms, min(hint_ms << doublings, longest)), self.max_hint_ms)
        at = now + hint_ms / 1000
        lapses = at + self._grace()
        if promise is not None:
            promise.at, promise.lapses = at, lapses
            if promise.service_s != own_s:  # (the model learnt since it was last told)
                self._promised_s[rank] += own_s - promise.service_s
                promise.service_s = own_s
        elif sum(self._promised) >= MAX_PROMISES:
            return hint_ms, None
        else:
            promise = Promise(at, lapses, rank, own_s)
            promises.append(promise)
            self._promised[rank] += 1
            self._promised_s[rank] += own_s
        heapq.heappush(self._lapsing, (lapses, next(self._pushed), promise))
        self._sweep()  # (re-timed promises leave stale entries in the heap)
        return hint_ms, promise

    def _ends(self, now: float, rank: int) -> tuple[list[float], int]:
        """The expected ends of the running jobs whose release frees a slot a client of the
        lane ranked ``rank`` may take, and how many slots it may take.

        Under an interactive reserve of ``r`` slots, a lower lane's client may take ``cap -
        r``: those of the lower lanes' jobs, and of the interactive jobs past the ``r`` the
        reserve holds (the first of them to end frees a slot that is not the reserve's).
        """
        slot_end = self.slot_end
        reserve = self._reserve(rank, now)
        if not reserve:
            return [slot_end(slot, now) for slot in self._running], self.cap
        ends: list[float] = []
        interactive: list[float] = []
        for slot in self._running:
            end = slot_end(slot, now)
            lane = slot.demand.lane if slot.demand is not None else None
            (interactive if lane == Lane.INTERACTIVE else ends).append(end)
        if len(interactive) > reserve:
            interactive.sort()
            ends += interactive[: len(interactive) - reserve]
        return ends, max(self.cap - reserve, 1)

    def _release_time(
        self, now: float, k: int, rank: int = 0, turn_s: float | None = None
    ) -> float:
        """When the ``k``-th slot release from now is expected (``k`` = 0: the next one), for
        a client of the lane ranked ``rank``: the ``k``-th smallest of the times
        ``e_i + j * (W + T)``, ``j >= 0``.

        Each later turn of a slot starts when its promised client is back, not at once, and
        lasts ``W`` (``turn_s``: the predicted time of the jobs that take those turns, the
        lane's mean by default). A slot that frees long before another (a chat beside a
        rewrite) turns over many times first, so the releases are counted in rounds of one
        period from the first: in round ``r``, slot ``i`` frees at ``e_0 + r * (W + T) + o_i``
        once ``r >= q_i``, where ``e_i - e_0 = q_i * (W + T) + o_i``.
        """
        ends, slots = self._ends(now, rank)
        floor = now + self.min_hint_ms / 1000
        ends += [floor] * (slots - len(ends))  # a free slot is held for a promise due now
        ends.sort()
        if turn_s is None:
            turn_s = self.service_for(LANES[rank] if self.policy is not None else None)
        # (no turn is shorter than a millisecond: a period of 0 would never move on)
        period = max(turn_s + self.turnaround_s, 0.001)
        first, n = ends[0], len(ends)
        if ends[-1] - first < period:  # the usual case: each slot frees once before any twice
            r, i = divmod(k, n)
            return ends[i] + r * period
        rounds = [int((end - first) // period) for end in ends]  # q_i, ascending
        # Walk to the round holding release k: the slots in turn (q_i <= r) free once a round.
        turning = before = r = 0
        while True:
            while turning < n and rounds[turning] <= r:
                turning += 1
            if turning == n or k < before + turning * (rounds[turning] - r):
                skip = (k - before) // turning
                r, before = r + skip, before + skip * turning
                break
            before += turning * (rounds[turning] - r)
            r = rounds[turning]
        offsets = sorted(ends[i] - first - rounds[i] * period for i in range(turning))
        return first + r * period + offsets[k - before]
