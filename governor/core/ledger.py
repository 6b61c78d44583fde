"""One pool's slot ledger: the hard cap on concurrent jobs, and the admission decision.

:meth:`SlotLedger.admit` is the whole admission decision. It is synchronous, so nothing can
run between checking for a free slot and taking it: with asyncio, inflight can never exceed
the cap. It returns a :class:`Slot` (a token released exactly once, in ``finally``) or a
:class:`Refusal` carrying the ``retry_hint_ms`` to send with the ``yield``.

A job is admitted when a slot is free that is neither held for a client in line nor kept by
the interactive reserve, its lane is under its quota, and its KV cells fit. In that order:

* the line (:mod:`.promises`): a slot that frees is held for the clients whose promised time
  is within ``hold`` of now (:meth:`~.estimates.ServiceEstimates.hold`), so a newcomer gets a
  free slot only if more slots are free than such clients; a client later than that keeps its
  place in line (until its promise lapses) but not the slot, so clients that ignore their hint
  cost at most ``hold`` of idle slot each. And a free slot goes past the line only to a job
  predicted to end before it is needed (backfilling, as a batch scheduler's EASY backfill): a
  job is refused while more clients ahead of it are due before its predicted end than free
  slots and running jobs' ends by then can serve, for each job past the line would leave one
  of them to find its release gone, and every client behind it a release later than told;
* the lanes (:mod:`.lanegate`, under a lane policy): a client counts, and a freed slot is held
  for, only the promises of its own lane or a higher one, and a lower lane's job may not take
  the interactive reserve's slots (``lane_full`` when those are the only ones free) nor more
  than its lane's quota;
* the KV budget: under a lane policy, below the interactive lane, what is reserved must leave
  the interactive share free and what the caches really hold must stay under the danger line;
  then every job's cells are reserved in one of the runner's caches while it holds its slot
  (``kv_pressure`` when none has room).

**Preemption** (``preemptible``: the runner suspends a job when told,
:class:`~governor.runners.base.Pausing`: the batched llama runner, the http runner in front of
llama-server). The interactive reserve is lent at once to the jobs it can pause, and taken back
within a step: an interactive job that finds no slot while the reserve is owed to chats (fewer
interactive slots taken than it) and no chat ahead of it is due suspends the newest running jobs
of the lowest lanes until it has its slots; one that finds no room for its KV cells suspends
such jobs until it has. Beyond the reserve, such a chat suspends only jobs it costs no
objective: those that have not generated a token yet and were never suspended
(:func:`~.preemption.fresh`: a burst's rewrites that came in the same instant as its chats do
not keep the chats waiting; a job is suspended so once at most), and those whose TPOT
objective leaves them slack for the chat's expected service (:meth:`Slot.slack_s`: a job
suspended so spends its slack, and is left be once it has too little). A suspended job holds
no slot and no reserved cells (its runner keeps its cells while its cache has room, else
computes them again), stays admitted (one terminal frame, whatever happens), and is resumed,
oldest first and before any newer job of a lower lane starts, as soon as a slot it may take
and its cells in its own cache are free again: at a release, at the next decision, or at
:meth:`SlotPool.resume` (the server calls it periodically). Lower lanes may then reserve the
whole KV capacity (the interactive share and the danger line are for runners that cannot
preempt). A :class:`~governor.runners.base.Pause` on the job tells its runner.

A refused client is told when to come back (:mod:`.hints`: the slot releases to come, from the
running jobs' expected ends, :mod:`.estimates`) and given its place in line, which it keeps
when it comes back and finds no slot; how its hints landed is counted (:mod:`.landing`). A job
that completes teaches the estimates what it took.
With one client per slot release, a slot is retaken almost as soon as it frees, and most
retries are admitted at their first attempt (``docs/BENCHMARKS.md`` measures both).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from protocol.codes import Bound, NeedCode

from ..runners.base import CacheShape, Pause
from .estimates import Completed, ServiceEstimates
from .hints import HintParts, RetryHints
from .kvbudget import KvBudget
from .landing import Landings
from .lanegate import LaneGate
from .policy import LANES, NO_LANE, Demand, Lane, LanePolicy
from .preemption import cell_victims, slack_s, slot_victims
from .promises import Promise, PromiseLine
from .service import JobSize, ServiceModel

__all__ = [
    "DRAINING_HINT_MS",
    "Clock",
    "Completed",
    "Promise",
    "Refusal",
    "Slot",
    "SlotLedger",
    "SlotPool",
    "kv_demand",
]

Clock = Callable[[], float]
# A ``draining`` refusal's hint, the same on every door: not when to come back here (a
# draining replica admits nothing again, and stops when told to), but how soon to send the job
# to another replica, on a new connection, which a load balancer sends to a ready one. A
# constant: nothing here knows when the replica will stop (its SIGTERM comes from outside).
DRAINING_HINT_MS = 1000


@dataclass(slots=True)  # (not frozen, though never changed: governor/compiled.py)
class Refusal:
    """No slot now: answer ``yield`` with this code and hint; ``parts``, what the hint is made
    of when it waits on a slot; ``bound``, what refused it where the code does not say
    (:data:`protocol.codes.BOUNDS` says the rest)."""

    need_code: NeedCode
    retry_hint_ms: int
    promise: Promise | None = None
    parts: HintParts | None = None
    bound: Bound | None = None


class Slot:
    """One taken execution slot. :meth:`release` gives it back; calling it again does nothing."""

    __slots__ = (
        "_ledger",
        "_released",
        "demand",
        "expected_s",
        "fed",
        "first_token",
        "generated",
        "kv_cache",
        "kv_tokens",
        "pace_s",
        "pause",
        "pauses",
        "size",
        "started",
        "suspended_at",
        "ticked",
        "tpot_s",
        "width",
    )

    def __init__(
        self, ledger: SlotPool, started: float, demand: Demand | None, size: JobSize | None
    ) -> None:
        self._ledger = ledger
        self.started = started
        self.demand = demand  # its lane and KV reservation, under a lane policy
        self.size = size  # its prompt and max_new_tokens, when it is an inference job
        self.width = size.width if size is not None else 1  # the slots of the cap it holds
        # Its own predicted service time (the lane's or the pool's mean where the model cannot
        # size it): every hint that waits on this job's end reads it.
        lane = demand.lane if demand is not None else None
        self.expected_s = ledger.estimates.predict_s(size, lane)
        self.kv_cache: int | None = None  # the KV cache its cells are reserved in
        self.kv_tokens = 0  # how many
        # From its progress (:meth:`feeding`, :meth:`begin`, :meth:`progress`): its prompt
        # tokens in the cache, its tokens generated, its last report (when, tokens), and its
        # pace while only decodes ran (seconds a token; None: none measured yet).
        self.fed = 0
        self.generated = 0
        self.ticked: tuple[float, int] | None = None
        self.pace_s: float | None = None
        # Its suspension, for a job the ledger may suspend (preemptible, below the interactive
        # lane): the job's runner reads it.
        self.pause: Pause | None = None
        self.suspended_at: float | None = None  # since when, while suspended
        self.pauses: list[tuple[float, float]] = []  # (from, to) of each suspension past
        self.first_token: float | None = None  # when its first token came (the execution's)
        self.tpot_s = 0.0  # its TPOT objective, set at its admission (0: none)
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    @property
    def begun(self) -> bool:
        """Its first token generated."""
        return self.first_token is not None

    @property
    def suspended(self) -> bool:
        return self.pause is not None and self.pause.suspended

    @property
    def paused_s(self) -> float:
        """Seconds it was suspended, its suspensions past (it runs again, or has ended)."""
        return sum(end - start for start, end in self.pauses)

    def slack_s(self, now: float) -> float:
        """How much longer it may be suspended and still meet its TPOT objective, a mean over
        the tokens it is expected to generate, the time suspended included
        (:func:`~.preemption.slack_s`); 0 before its first token, or with no objective."""
        first, size = self.first_token, self.size
        if first is None or size is None or not self.tpot_s:
            return 0.0
        tokens = self._ledger.estimates.model.ratio * size.max_new_tokens
        return slack_s(first, tokens, self.tpot_s, self._ledger.slot_end(self, now))

    def begin(self, now: float) -> None:
        """Its first token came: its prompt is all in the cache."""
        self.first_token = now
        if self._released:
            return
        if self.size is not None:
            self._ledger.estimates.feeding(self, self.size.prompt_tokens, now)
        self.generated, self.ticked = 1, (now, 1)

    def progress(self, generated: int, now: float) -> None:
        """The job has generated ``generated`` tokens: its pace learns the time since its last
        report unless a prompt was fed, or it was suspended, meanwhile
        (:meth:`ServiceEstimates.progress`)."""
        if self._released or self.ticked is None:
            return
        since = self.ticked[0]
        clean = self._ledger.quiet_since(since) and not (self.pauses and self.pauses[-1][1] > since)
        self._ledger.estimates.progress(self, generated, now, clean)

    def feeding(self, fed: int, now: float) -> None:
        """``fed`` of the job's prompt tokens are in the cache."""
        if self._released:
            return
        self._ledger.estimates.feeding(self, fed, now)

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


class SlotPool:
    """What one pool's jobs hold: its cap, its running and suspended jobs, the slots and KV
    cells they take and give back, composing its estimates (:attr:`estimates`), its promise
    line (:attr:`line`), its lanes (:attr:`lanes`) and its hints (:attr:`hints`). The decision
    of who may take them is :class:`SlotLedger`'s."""

    def __init__(
        self,
        cap: int,
        *,
        expected_service_s: float = 1.0,
        min_hint_ms: int = 5,
        max_hint_ms: int = 60_000,
        hint_margin: float = 0.0,
        clock: Clock = time.monotonic,
        policy: LanePolicy | None = None,
        kv: KvBudget | None = None,
        kv_used: Callable[[], int] | None = None,
        preemptible: bool = False,
    ) -> None:
        if cap < 1:
            raise ValueError("cap must be at least 1")
        self.cap = cap
        # The runner's KV caches (every inference job reserves its cells in one), or, for a
        # runner without one, a lane policy's notional capacity as a single cache.
        if kv is None and policy is not None and policy.kv_capacity:
            kv = KvBudget((CacheShape(policy.kv_capacity, cap),))
        self.kv = kv
        # The cells the caches really hold, as the runner last reported (the reservations
        # stand in for a runner that reports none).
        self.kv_used = kv_used
        self.clock = clock
        self.preemptible = preemptible
        self._running: dict[Slot, None] = {}  # insertion-ordered set, suspended jobs not in it
        self._suspended: list[Slot] = []  # in the order suspended
        # Suspensions and resumes, by lane.
        self.suspensions: Counter[str] = Counter()
        self.resumes: Counter[str] = Counter()
        self._taken = 0  # the slots the running jobs hold: one each, n for n sequences
        self._freed: list[float] = []  # when each free slot was released, in that order
        self.estimates = ServiceEstimates(expected_service_s, min_hint_ms / 1000)
        self.line = PromiseLine(len(LANES))
        self.lanes = LaneGate(policy, self.line, clock(), lend=preemptible)
        self.landings = Landings()  # the returns at their hints, and the hints' errors
        self.hints = RetryHints(
            cap,
            min_hint_ms,
            max_hint_ms,
            self.estimates,
            self.line,
            self.lanes,
            self._running,
            hint_margin,
        )
        self.executed_total = 0  # admissions
        self.yielded_total = 0
        self.peak_inflight = 0  # the most slots taken at once
        # Slots handed to clients back on their hint, and how long they stood empty between
        # their release and that client's admission: what a hint that lands late costs.
        self.handoffs = 0
        self.handoff_idle_s = 0.0
        self.draining = False

    # Read through the ledger where it is all a caller holds.

    @property
    def policy(self) -> LanePolicy | None:
        return self.lanes.policy

    @property
    def lane_inflight(self) -> Counter[Lane]:
        return self.lanes.inflight

    @property
    def min_hint_ms(self) -> int:
        return self.hints.min_hint_ms

    @property
    def max_hint_ms(self) -> int:
        return self.hints.max_hint_ms

    @property
    def service_s(self) -> float:
        return self.estimates.service_s

    @property
    def error(self) -> float:
        return self.estimates.error

    @property
    def turnaround_s(self) -> float:
        return self.estimates.turnaround_s

    @property
    def lane_service_s(self) -> dict[Lane, float]:
        return self.estimates.lane_service_s

    @property
    def model(self) -> ServiceModel:
        return self.estimates.model

    def service_for(self, lane: Lane | None) -> float:
        """The expected service time of a job of ``lane`` (``None``: of any job)."""
        return self.estimates.service_for(lane)

    def slot_end(self, slot: Slot, now: float) -> float:
        """When a running job is expected to end (:meth:`ServiceEstimates.end_of`)."""
        return self.estimates.end_of(slot, now, self.estimates.batch(self._running))

    def quiet_since(self, since: float) -> bool:
        """No prompt fed since ``since``: none reported fed or begun since, and no running job
        waits for its first token (a prompt fed in one step says nothing until it ends)."""
        return self.estimates.fed_at <= since and all(
            s.first_token is not None or s.size is None for s in self._running
        )

    def hint_ms(self, now: float, at: float) -> int:
        """Milliseconds from ``now`` to ``at``, within the hint's bounds."""
        return self.hints.hint_ms(now, at)

    def waits(self, code: NeedCode, now: float, end: float) -> Refusal:
        """A refusal that waits for one job's predicted ``end``: its hint is all release."""
        parts = self.hints.parts(now, end)
        return Refusal(code, parts.ms, None, parts)

    @property
    def inflight(self) -> int:
        """Jobs admitted and not ended: running, or suspended."""
        return len(self._running) + len(self._suspended)

    @property
    def suspended(self) -> int:
        """Jobs suspended (admitted, holding no slot)."""
        return len(self._suspended)

    @property
    def taken(self) -> int:
        """Slots taken: a job holds one for each sequence it runs at once (its width)."""
        return self._taken

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
        return self._taken >= self.cap

    @property
    def ready(self) -> bool:
        """Would a job be admitted now? (``server.health`` 1.)"""
        return not self.draining and not self.saturated

    def _take(
        self,
        now: float,
        promise: Promise | None,
        demand: Demand | None,
        size: JobSize | None,
        kv_cache: int | None,
        kv_tokens: int,
        pausable: bool = False,
    ) -> Slot:
        """Take a slot for a job :meth:`admit` admitted (its KV cells reserved in ``kv_cache``)."""
        # The slots taken are taken as the ones freed last: a slot freed long before (the
        # interactive reserve, idle while no chat comes) was not waiting for this client.
        slot = Slot(self, now, demand, size)
        freed = None
        for _ in range(min(slot.width, len(self._freed))):
            freed = self._freed.pop()
        if promise is not None:
            hint = self.landings.at_hint(promise, now, self.estimates.hold())
            self.landings.landed(promise, _label(demand), hint if promise.queued else None, freed)
            self.withdraw(promise)
            if freed is not None:
                self.handoffs += 1
                self.handoff_idle_s += now - freed
                # Only a client that came when it was told says how long a slot waits for it:
                # from its release or the time told, whichever came later (a slot freed before
                # that time waited on the hint, not on the client; learnt, that wait would
                # stretch every later hint by as much, and be waited again).
                if abs(now - promise.at) <= self.estimates.grace():
                    self.estimates.came_back(max(now - max(freed, promise.at), 0.0))
        if kv_cache is not None:
            slot.kv_cache, slot.kv_tokens = kv_cache, kv_tokens
        if pausable and demand is not None and demand.lane != Lane.INTERACTIVE:
            slot.pause = Pause()
        self._running[slot] = None
        self._taken += slot.width
        if demand is not None:
            self.lane_inflight[demand.lane] += slot.width
        self.executed_total += 1
        if self._taken > self.peak_inflight:
            self.peak_inflight = self._taken
        return slot

    def _release(self, slot: Slot, done: Completed | None) -> float:
        lane = slot.demand.lane if slot.demand is not None else None
        now = self.clock()
        if slot.suspended:  # (it holds no slot and no cells)
            self._suspended.remove(slot)
        else:
            self._unhold(slot, now)
        held = now - slot.started
        self.estimates.ended(slot, lane, held - slot.paused_s, done)
        self.resume()
        return held

    def _unhold(self, slot: Slot, now: float) -> None:
        """Give back a running job's slots and reserved cells."""
        del self._running[slot]
        self._taken -= slot.width
        if slot.demand is not None:
            self.lane_inflight[slot.demand.lane] -= slot.width
        if slot.kv_cache is not None:
            assert self.kv is not None
            self.kv.release(slot.kv_cache, slot.kv_tokens)
        self._freed.extend([now] * slot.width)

    # Preemption --------------------------------------------------------------------------

    def _suspend(self, victims: list[Slot], now: float) -> None:
        for slot in victims:
            assert slot.pause is not None
            assert slot.demand is not None
            self._unhold(slot, now)
            self._suspended.append(slot)
            slot.suspended_at = now
            self.suspensions[slot.demand.lane.value] += 1
            slot.pause.set(True)

    def resume(self) -> int:
        """Resume suspended jobs, oldest first, while a slot each may take (as a job of its
        lane would, ahead of every client of the lower lanes: only interactive clients due
        keep theirs) and its cells in its cache are free; returns how many."""
        if not self._suspended:  # (on every decision and release: nothing to do, at once)
            return 0
        now, resumed = self.clock(), 0
        self.line.lapse(now)
        for slot in sorted(self._suspended, key=lambda s: s.started):
            assert slot.demand is not None
            rank = self.lanes.rank(slot.demand)
            reserved = self.lanes.unused_reserve(rank, now)
            due = self.line.due_ahead(now, None, 0, self.estimates.hold(), reserved)
            if self.cap - self._taken - reserved - slot.width < due:
                break
            if self.lanes.quota_full(slot.demand.lane, slot.width):
                break
            if slot.kv_cache is not None:
                assert self.kv is not None
                if not self.kv.take(slot.kv_cache, slot.kv_tokens):
                    break
            self._resume(slot, reserved=True)
            resumed += 1
        return resumed

    def _resume(self, slot: Slot, *, reserved: bool = False) -> None:
        """Give a suspended job its slots back, and its cells unless ``reserved`` already."""
        assert slot.pause is not None
        assert slot.demand is not None
        if slot.kv_cache is not None and not reserved:
            assert self.kv is not None
            taken = self.kv.take(slot.kv_cache, slot.kv_tokens)
            assert taken
        now = self.clock()
        if slot.suspended_at is not None:
            slot.pauses.append((slot.suspended_at, now))
            slot.suspended_at = None
        self._suspended.remove(slot)
        self._running[slot] = None
        self._taken += slot.width
        self.peak_inflight = max(self.peak_inflight, self._taken)
        self.lane_inflight[slot.demand.lane] += slot.width
        self.resumes[slot.demand.lane.value] += 1
        slot.pause.set(False)

    def withdraw(self, promise: Promise) -> None:
        """Forget a promise: its client came back, or will not."""
        self.line.withdraw(promise)


class SlotLedger(SlotPool):
    """One pool's admission decision over its slots (:class:`SlotPool`): see the module
    docstring."""

    def admit(
        self,
        promise: Promise | None = None,
        demand: Demand | None = None,
        size: JobSize | None = None,
        *,
        pausable: bool = True,
    ) -> Slot | Refusal:
        """Take a slot, or say why not and when to come back.

        ``promise`` is the one a returning client was given when it was last refused;
        ``demand`` the job's lane and KV reservation, when a lane policy is in force; ``size``
        its prompt and ``max_new_tokens``, when it is an inference job: the slot's expected
        end, and the turns of the slots it waits for when refused, are predicted from it.
        ``pausable``: its runner can suspend it and resume it exactly (on a ``preemptible``
        pool, a job below the interactive lane may then be suspended, and borrow the
        interactive reserve at once; one that cannot is kept from the reserve as without
        preemption).
        """
        now = self.clock()
        self.line.lapse(now)
        self.resume()
        rank = self.lanes.rank(demand)
        if self.draining:
            if promise is not None:
                self.withdraw(promise)
            return self.refused(Refusal(NeedCode.DRAINING, DRAINING_HINT_MS))
        free = self.cap - self._taken
        width = size.width if size is not None else 1
        self.lanes.asked(rank, now)
        # The free slots this job may take: not those the interactive reserve keeps.
        pausable = pausable and self.preemptible
        reserved = self.lanes.unused_reserve(rank, now, pausable=pausable)
        usable = free - reserved
        # A free slot is not for the taking while clients ahead in line have their time come,
        # nor by a job that would still hold it when one is due that no other slot will serve.
        due = self.line.due_ahead(now, promise, rank, self.estimates.hold(), reserved)
        spare = usable - width - due
        short = spare < 0 or self._crowded(now, promise, rank, size, spare)
        # A suspended job goes before any newer job of a lower lane: such a job waits for the
        # slots the suspended jobs will take back, too.
        later = sum(slot.width for slot in self._suspended) if rank > 0 else 0
        victims: list[Slot] = []
        if usable < width and not due and rank == 0:
            lent = self.lanes.owes(width)
            chat_s = self.estimates.predict_s(size, Lane.INTERACTIVE)  # (its hold)
            victims = slot_victims(self._running, width - usable, lent=lent, now=now, spare=chat_s)
            self._suspend(victims, now)
        if (short and not victims) or later:
            # (free slots, but the reserve's: lane_full)
            return self._busy(now, promise, rank, size, later, usable < width <= free)
        kv_tokens = kv_demand(demand, size)
        refusal, kv_cache = self._checks(now, demand, kv_tokens, width, victims, pausable)
        if refusal is not None:
            if promise is not None:
                self.withdraw(promise)
            for slot in victims:  # (what was suspended for it: back as it was)
                self._resume(slot)
            return self.refused(refusal)
        return self._take(now, promise, demand, size, kv_cache, kv_tokens, pausable)

    def _crowded(
        self, now: float, promise: Promise | None, rank: int, size: JobSize | None, spare: int
    ) -> bool:
        """With ``spare`` free slots left once the job and the clients due now have theirs,
        whether it would leave a client of its lane ahead in line without a slot at its time
        (backfilling, as a batch scheduler's EASY backfill: a free slot goes past the line
        only to a job predicted to end before it is needed): each client due before the job's
        predicted end takes a spare slot, else a running job's predicted release by its time."""
        if not len(self.line):
            return False
        hold = self.estimates.hold()
        until = now + self.estimates.predict_s(size, self.lanes.lane(rank))
        releases = self.hints.releases_by(now, rank, until)
        for at in self.line.due_by(now + hold, until, promise, rank):
            while releases and releases[0] <= at + hold:
                releases.pop(0)
                spare += 1
            if not spare:
                return True
            spare -= 1
        return False

    def _busy(
        self,
        now: float,
        promise: Promise | None,
        rank: int,
        size: JobSize | None,
        later: int,
        reserved: bool,
    ) -> Refusal:
        """No slot for the job: its place in line and the hint to it; ``reserved``, the free
        slots are the interactive reserve's."""
        hint = None
        if promise is not None and promise.queued:
            hint = self.landings.at_hint(promise, now, self.estimates.hold())
        parts, kept = self.hints.place(now, promise, rank, size, later)
        if hint is not None and kept is not None and kept is promise:
            self.landings.early(kept, _label(self.lanes.lane(rank)), hint)
        promise = kept
        if reserved:
            refusal = Refusal(
                NeedCode.LANE_FULL, parts.ms, promise, parts, Bound.INTERACTIVE_RESERVE
            )
        else:
            refusal = Refusal(NeedCode.SERVER_BUSY, parts.ms, promise, parts)
        return self.refused(refusal)

    def _checks(
        self,
        now: float,
        demand: Demand | None,
        kv_tokens: int,
        width: int,
        victims: list[Slot],
        pausable: bool,
    ) -> tuple[Refusal | None, int | None]:
        """The lane policy's checks, then a cache for the job's ``kv_tokens`` KV cells: a
        refusal, or the cache they are reserved in (None: no KV budget, or no cells). An
        interactive job may suspend jobs for its cells (added to ``victims``)."""
        if demand is not None and self.policy is not None:
            refusal = self._policy_refusal(now, demand, width, pausable)
            if refusal is not None:
                return refusal, None
        if self.kv is None or not kv_tokens:
            return None, None
        kv_cache = self.kv.place(kv_tokens)
        if kv_cache is None and self.lanes.rank(demand) == 0 and self.lanes.owes(width):
            more = cell_victims(self._running, self.kv, kv_tokens)
            if more:
                self._suspend(more, now)
                victims += more
                kv_cache = self.kv.place(kv_tokens)
        if kv_cache is None:
            at = self.hints.kv_release(now, self.kv, kv_tokens)
            return self.waits(NeedCode.KV_PRESSURE, now, at), None
        return None, kv_cache

    def _policy_refusal(
        self, now: float, demand: Demand, width: int, pausable: bool
    ) -> Refusal | None:
        """The lane quota and the KV budget, in that order (the interactive reserve is kept
        by :meth:`admit`, in the line)."""
        policy = self.policy
        assert policy is not None
        lane = demand.lane
        if self.lanes.quota_full(lane, width):
            return self.waits(NeedCode.LANE_FULL, now, self.hints.lane_release(now, lane))
        # Below the interactive lane: what is reserved must leave the interactive share free,
        # and what the caches really hold must stay under the danger line, unless a chat can
        # take the memory back (the job is pausable). (Every lane's job must fit in a cache:
        # :meth:`admit` reserves its cells after this.)
        capacity = self.kv.capacity if self.kv is not None else 0
        if capacity and lane != Lane.INTERACTIVE and not pausable:
            reserved = self.kv_reserved + demand.kv_tokens
            if (
                reserved > (1.0 - policy.kv_interactive_share) * capacity
                or self.kv_in_use + demand.kv_tokens > policy.kv_danger * capacity
            ):
                return self.waits(NeedCode.KV_PRESSURE, now, self.hints.next_end(now))
        return None

    def waiting(self, rank: int) -> int:
        """Promises still in the line (withdrawn and lapsed ones are not) of rank <= ``rank``:
        clients waiting for a slot in that lane or a higher one. 0 for a negative ``rank``."""
        self.line.lapse(self.clock())
        return self.line.waiting(rank)

    def waiting_above(self, rank: int) -> int:
        """Clients in line of a lane higher than the one ranked ``rank`` that a job of that lane
        would keep from a slot: all of them, less the first interactive ones, whom the
        interactive reserve serves (its slots are not that job's to take anyway)."""
        waiting = self.waiting(rank - 1)
        reserve = self.lanes.reserve(rank, self.clock())
        if waiting and reserve:
            waiting -= min(self.line.of_rank(0), reserve)
        return waiting

    def place(
        self,
        promise: Promise | None,
        rank: int,
        size: JobSize | None = None,
    ) -> tuple[HintParts, Promise | None]:
        """A place in line for a client refused before the ledger's own check (a paused lane),
        as :meth:`admit` gives one: ``promise`` is kept and re-timed, a newcomer goes to the
        back. The hint is when that place comes.
        """
        now = self.clock()
        self.line.lapse(now)
        return self.hints.place(now, promise, rank, size)

    def refused(self, refusal: Refusal) -> Refusal:
        """Count a refusal (also one decided outside the ledger, for a tenant's limits)."""
        self.yielded_total += 1
        return refusal

    def ready_in_ms(self) -> int:
        """How soon a newcomer of the lowest lane would get a slot here (0: one is free and
        no one waits for it): what this replica tells the fleet's store, for the others to
        tell their clients whether it may serve them sooner."""
        now = self.clock()
        self.line.lapse(now)
        rank = 0 if self.lanes.policy is None else len(LANES) - 1
        if self._taken < self.cap and not self.line.waiting(rank):
            return 0
        return self.hints.timing(now, None, rank)[0].ms

    def next_end_ms(self) -> int:
        """The hint to the first running job's expected end."""
        now = self.clock()
        return self.hint_ms(now, self.hints.next_end(now))

    def revoked(self, slot: Slot) -> None:
        """``slot`` was released before its job ran (the fleet refused it): it executed nothing."""
        assert slot.released
        self.executed_total -= 1


def _label(lane: Demand | Lane | None) -> str:
    """A lane's metric label (``-``: lanes off)."""
    if isinstance(lane, Demand):
        lane = lane.lane
    return lane.value if lane is not None else NO_LANE
