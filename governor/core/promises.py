"""The promise line: when each yielded client was told to come back, in the order told.

Nothing is queued on the server; the line lives on the clients' side. What the server keeps is
one :class:`Promise` per client it turned away: the time it was told to come back (``at``),
when that stops counting (``lapses``: ``at`` plus the client's jitter), its lane's rank and its
job's predicted service time. :class:`PromiseLine` holds them in the order given:

* a newcomer goes to the back (:meth:`PromiseLine.keep` with no promise); a client that comes
  back and is refused again keeps its place and is re-timed;
* a promise leaves the line when it is withdrawn (its client came back, or will not) or when
  its ``lapses`` has passed (:meth:`PromiseLine.lapse`), by its own time, not the line's order;
* a client counts only the promises of its own rank or a higher one (a lower number), so the
  counts and the predicted seconds of the promises are kept per rank;
* :meth:`PromiseLine.due_ahead` counts the clients ahead whose promised time is within
  ``hold`` of now: a slot that frees is held for them.

The line never holds more than ``limit`` live promises, and a withdrawn or lapsed promise is
skipped, not searched for, so withdrawing costs constant time; the dead are dropped from the
front, and both the line and the lapse heap are rebuilt once the dead outnumber the living by
``SLACK``. Everything here is pure: the caller passes the time.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterator

MAX_PROMISES = 65536  # bounds the line's memory whatever the number of refused clients
# Withdrawn and lapsed promises linger in the line and the lapse heap until they reach the
# front; both are rebuilt when the dead outnumber the living by this many.
SLACK = 64


class Promise:
    """When a refused client was told to come back; withdrawn with
    :meth:`PromiseLine.withdraw`.

    ``rank`` is its lane's place in :data:`~governor.core.policy.LANES` (0 without a lane
    policy): a client waits only behind promises of its own lane or a higher one. ``service_s``
    is its job's predicted service time: how long the slot it is promised will be held once it
    is back.
    """

    __slots__ = ("at", "early", "lapses", "queued", "rank", "service_s", "told")

    def __init__(self, at: float, lapses: float, rank: int = 0, service_s: float = 0.0) -> None:
        self.at = at
        self.lapses = lapses
        self.rank = rank
        self.service_s = service_s
        self.queued = True  # still in the line: neither withdrawn nor lapsed
        # When its client was told ``at`` (its yield answered: :func:`~.admission.answered`);
        # None while it is not (a job that waits in line on the server is told nothing).
        self.told: float | None = None
        # Its client's returns at a hint that were refused again, (told, at) of each, until
        # a slot is its (:class:`~governor.core.landing.Landings`); None: none.
        self.early: list[tuple[float, float]] | None = None


class PromiseLine:
    """The live promises in the order given, with their counts and seconds per rank."""

    __slots__ = ("_count", "_lapsing", "_limit", "_promises", "_pushed", "_seconds")

    def __init__(self, ranks: int, limit: int = MAX_PROMISES) -> None:
        self._limit = limit
        # In order. A promise withdrawn or lapsed (``queued`` False) stays in it, and is
        # skipped, until it reaches the front (removing it from the middle would cost a walk).
        self._promises: deque[Promise] = deque()
        # (lapses, n, promise), earliest first: promises lapse by their own time, not the
        # line's order (a background client first in line may be promised a later time than
        # an interactive client behind it). Entries of re-timed or dequeued promises are stale.
        self._lapsing: list[tuple[float, int, Promise]] = []
        self._pushed = itertools.count()
        self._count = [0] * ranks  # live promises, by rank
        self._seconds = [0.0] * ranks  # the sum of their jobs' service_s, by rank

    def __len__(self) -> int:
        """The live promises, of every rank."""
        return sum(self._count)

    def __iter__(self) -> Iterator[Promise]:
        """The live promises, in order."""
        return (p for p in self._promises if p.queued)

    @property
    def stored(self) -> int:
        """The promises the line holds, dead ones included (at most ``2 * len + SLACK``)."""
        return len(self._promises)

    def waiting(self, rank: int) -> int:
        """The live promises of rank <= ``rank`` (0 for a negative ``rank``)."""
        return sum(self._count[: rank + 1]) if rank >= 0 else 0

    def of_rank(self, rank: int) -> int:
        """The live promises of exactly ``rank``."""
        return self._count[rank]

    def totals(self) -> tuple[list[int], list[float]]:
        """Per rank: the live promises, and the sum of their jobs' service times."""
        return list(self._count), list(self._seconds)

    def ahead_of(self, promise: Promise, rank: int) -> tuple[list[int], list[float]]:
        """Per rank <= ``rank``: the live promises ahead of ``promise`` (which is in the line),
        and the sum of their jobs' service times. Walks the line from its front: clients come
        back in the order they were told, so a returning one is usually near it."""
        counts, seconds = [0] * len(self._count), [0.0] * len(self._count)
        for p in self._promises:
            if p is promise:
                break
            if p.queued and p.rank <= rank:
                counts[p.rank] += 1
                seconds[p.rank] += p.service_s
        return counts, seconds

    def latest(self, promise: Promise | None, rank: int) -> float:
        """The latest time told to a live promise of ``rank`` ahead of ``promise`` (None: of
        all: a newcomer goes to the back); -inf when there is none. A client is told no sooner
        than those ahead of it in its lane: told sooner, it would take the release they wait
        for and leave them to come back to none."""
        latest = -math.inf
        if promise is None:  # (the back's, told last: a step or two back from the end)
            return next(
                (p.at for p in reversed(self._promises) if p.queued and p.rank == rank), latest
            )
        for p in self._promises:
            if p is promise:
                break
            if p.queued and p.rank == rank and p.at > latest:
                latest = p.at
        return latest

    def due_by(self, since: float, until: float, promise: Promise | None, rank: int) -> list[float]:
        """The times promised to the clients of ``rank`` ahead of ``promise`` (of all, for
        None) that fall from ``since`` to ``until``, in order."""
        return sorted(
            p.at
            for p in itertools.takewhile(lambda p: p is not promise, self._promises)
            if p.queued and p.rank == rank and since <= p.at <= until
        )

    def due_ahead(
        self, now: float, promise: Promise | None, rank: int, hold: float, reserved: int = 0
    ) -> int:
        """The clients of rank <= ``rank`` ahead of ``promise`` (of all, for None) that a free
        slot is held for: those promised a time within ``hold`` of ``now``, either side.

        A slot that frees a moment early is still theirs; a client later than ``hold`` keeps
        its place in line but not the slot. The first ``reserved`` clients of rank 0 due are
        not counted: they take the interactive reserve's free slots, not this client's.
        """
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

    def keep(
        self, promise: Promise | None, at: float, lapses: float, rank: int, service_s: float
    ) -> Promise | None:
        """Re-time ``promise`` (in the line) in its place, or give a newcomer (None) a new
        promise at the back; None when the line is full.

        A re-timed promise's service time is the one predicted now (the model may have learnt
        since it was told); its seconds are moved in the sums of ``rank``, the rank it is
        asked for now.
        """
        if promise is not None:
            promise.at, promise.lapses = at, lapses
            if promise.service_s != service_s:
                self._seconds[rank] += service_s - promise.service_s
                promise.service_s = service_s
        elif len(self) >= self._limit:
            return None
        else:
            promise = Promise(at, lapses, rank, service_s)
            self._promises.append(promise)
            self._count[rank] += 1
            self._seconds[rank] += service_s
        heapq.heappush(self._lapsing, (lapses, next(self._pushed), promise))
        self._sweep()  # (re-timed promises leave stale entries in the heap)
        return promise

    def withdraw(self, promise: Promise) -> None:
        """Take ``promise`` out of the line: its client came back, or will not. Withdrawing a
        promise that is not in the line does nothing."""
        if promise.queued:
            self._dequeue(promise)
            self._sweep()

    def lapse(self, now: float) -> None:
        """Take out of the line the promises whose ``lapses`` is before ``now``."""
        lapsing = self._lapsing
        if not lapsing or lapsing[0][0] >= now:
            return
        while lapsing and lapsing[0][0] < now:
            lapses, _, promise = heapq.heappop(lapsing)
            if promise.queued and promise.lapses == lapses:  # (else a stale entry)
                self._dequeue(promise)
        self._sweep()

    def _dequeue(self, promise: Promise) -> None:
        promise.queued = False
        rank = promise.rank
        self._count[rank] -= 1
        # (a sum kept by adding and subtracting drifts: an empty rank starts again from 0)
        self._seconds[rank] = self._seconds[rank] - promise.service_s if self._count[rank] else 0.0

    def _sweep(self) -> None:
        """Drop dequeued promises from the front of the line; rebuild the line and the heap
        when dequeued ones fill most of them (so both stay within twice the live promises)."""
        promises = self._promises
        while promises and not promises[0].queued:
            promises.popleft()
        bound = 2 * len(self) + SLACK
        if len(promises) > bound:
            self._promises = promises = deque(p for p in promises if p.queued)
        if len(self._lapsing) > bound:
            self._lapsing = [(p.lapses, next(self._pushed), p) for p in promises if p.queued]
            heapq.heapify(self._lapsing)
