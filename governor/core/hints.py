"""The retry hint: when to tell a client that found no slot to come back.

Nothing is queued on the server, but the ledger remembers when it told each yielded client to
come back (its *promise*, kept in the :class:`~governor.core.promises.PromiseLine`), so that the
clients it turned away are spread over the coming slot releases instead of all returning at the
same instant.

* A running job's slot is expected to free at the job's expected end
  (:meth:`~governor.core.estimates.ServiceEstimates.end_of`); a free slot counts as releasing
  at ``now + floor`` (``min_hint_ms``). After that each slot frees again every ``W + T``, ``T``
  being the turnaround (how long a released slot waits for the returning client it was promised
  to) and ``W`` the mean predicted time of the jobs of the clients ahead of the waiting one in
  line (they take those turns), or its own job's where none is. The ``k``-th release from now
  is the ``k``-th smallest of the times ``e_i + j * (W + T)`` (:func:`kth_release_parts`): a slot
  that frees long before another turns over many times first.
* ``P`` is the number of promises still outstanding. A promise belongs to a held payload: it is
  withdrawn when the client comes back or the payload is dropped (client gone, new manifest),
  and it lapses ``grace`` after its time (the client's jitter).
* A new yield is promised release number ``P``: ``hint`` is that release's time less ``now``,
  clamped to ``[min_hint_ms, max_hint_ms]``.
* A client that comes back (it resends the final chunk of the payload it was refused) and
  finds no slot for it keeps its place in line and is re-timed to that place's release (``k =
  q``, the promises ahead of it).

* On a runner that feeds a prompt beside every stream (the batched llama runner), a running
  job ends after the prompts of the jobs that take the slots freeing before it
  (:meth:`RetryHints.end_of`, :meth:`~.estimates.ServiceEstimates.fed_beside`), and each turn
  of a slot holds the prompts of the jobs the other slots take meanwhile: one each, of about
  the waiting client's own size.
* A client is told a ``margin`` (``hint_margin``) of the hint's last leg later than the release
  (the leg: the time from the release before it, or from now, the part whose error is the
  hint's): a prediction that errs either way as often would land half the time, and a client
  back a moment early is refused again while one a moment late finds the slot held for it. So
  each turn of a slot takes ``(W + T) / (1 - margin)`` (its client comes a margin of it late).
  And it is told no sooner than the time told to the last client ahead of it in its lane
  (:meth:`~.promises.PromiseLine.latest`): told sooner, it would take the release that client
  waits for.
* A hint comes in parts (:class:`HintParts`), which its client is told: until the predicted end
  of the job whose slot the ``k``-th release comes on, then that slot's turns after it.

Under a lane policy a client counts only the promises of its own lane or a higher one, and only
the slots it may take: those the interactive reserve does not keep
(:class:`~governor.core.lanegate.LaneGate`). It waits for the ends of the jobs in those slots,
not for a chat's in the reserve, and the first interactive clients in line are the reserve's,
not ahead of it. Pure: the caller passes the time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

from .estimates import Running, ServiceEstimates
from .kvbudget import KvBudget
from .lanegate import LaneGate
from .policy import Demand, Lane
from .promises import Promise, PromiseLine
from .service import JobSize


@dataclass(slots=True)  # (not frozen, though never changed: governor/compiled.py)
class HintParts:
    """What a hint that waits on a slot is made of, in milliseconds: ``release_ms``, until the
    predicted end of the job whose slot it waits for; ``turns_ms``, after that end, the turns
    of the jobs promised ahead of it on that slot (``ahead`` jobs are ahead of it in all). The
    hint is their sum (:attr:`ms`); one raised to ``min_hint_ms``, or cut to ``max_hint_ms``,
    is raised or cut in its turns first."""

    release_ms: int
    turns_ms: int = 0
    ahead: int = 0

    @property
    def ms(self) -> int:
        return self.release_ms + self.turns_ms


class Job(Running, Protocol):
    """A running job as the hints see it (a :class:`~governor.core.ledger.Slot`)."""

    demand: Demand | None  # its lane, under a lane policy
    width: int  # the slots it holds: its release frees as many
    kv_cache: int | None  # the KV cache its cells are reserved in
    kv_tokens: int  # how many


class RetryHints:
    """The hints of one pool, from its running jobs, its estimates and its promise line."""

    __slots__ = (
        "_running",
        "cap",
        "estimates",
        "lanes",
        "line",
        "margin",
        "max_hint_ms",
        "min_hint_ms",
    )

    def __init__(
        self,
        cap: int,
        min_hint_ms: int,
        max_hint_ms: int,
        estimates: ServiceEstimates,
        line: PromiseLine,
        lanes: LaneGate,
        running: Collection[Job],
        margin: float = 0.0,
    ) -> None:
        self.cap = cap
        self.min_hint_ms = min_hint_ms
        self.max_hint_ms = max_hint_ms
        self.estimates = estimates
        self.line = line
        self.lanes = lanes
        self._running = running  # the ledger's running jobs: read here, never changed
        self.margin = margin  # of a hint's last leg, added to it (see the module docstring)

    def hint_ms(self, now: float, at: float) -> int:
        """Milliseconds from ``now`` to ``at``, within the hint's bounds."""
        return min(max(_ms(at - now), self.min_hint_ms), self.max_hint_ms)

    def parts(
        self, now: float, at: float, release: float | None = None, ahead: int = 0
    ) -> HintParts:
        """The hint from ``now`` to ``at`` (within its bounds), in parts: until ``release``
        (by default ``at``: a wait for one job's end), then the turns of ``ahead`` jobs."""
        hint_ms = self.hint_ms(now, at)
        if release is None:
            return HintParts(hint_ms)
        release_ms = min(max(_ms(release - now), 0), hint_ms)
        return HintParts(release_ms, hint_ms - release_ms, ahead)

    def end_of(self, now: float, prompt: int = 0) -> Callable[[Job], float]:
        """When each running job is expected to end, the batch's work reckoned once. For a
        client waiting for a slot whose job's prompt is ``prompt`` tokens, on a runner that
        feeds prompts beside every stream: a job also waits for the prompts of the jobs that
        take the slots freeing before its end, one each of about that size, fed from the first
        of those releases on (jobs that end together wait for none)."""
        estimates = self.estimates
        batch = estimates.batch(self._running)
        if not prompt:  # (no waiting client's prompt: each end on its own, when asked)
            return lambda job: estimates.end_of(job, now, batch)
        ends = sorted(
            ((estimates.end_of(job, now, batch), job) for job in self._running),
            key=lambda pair: pair[0],
        )
        told: dict[Job, float] = {}
        for i, (end, job) in enumerate(ends):
            told[job] = end + estimates.fed_beside(i * prompt, end - ends[0][0])
        return told.__getitem__

    def next_end(self, now: float) -> float:
        """When the first running job is expected to end (a free slot frees nothing more)."""
        end_of = self.end_of(now)
        return min((end_of(job) for job in self._running), default=now)

    def kv_release(self, now: float, kv: KvBudget, cells: int) -> float:
        """When one of the caches is expected to have ``cells`` free: the running jobs' ends,
        in order, each giving its cells back to its cache (the first end where none could:
        the cells are held by what is not running)."""
        end_of = self.end_of(now)
        free = [kv.free(i)[0] for i in range(len(kv.caches))]
        for end, cache, tokens in sorted(
            (end_of(job), job.kv_cache, job.kv_tokens)
            for job in self._running
            if job.kv_cache is not None
        ):
            free[cache] += tokens
            if max(free) >= cells:
                return end
        return self.next_end(now)

    def lane_release(self, now: float, lane: Lane) -> float:
        """When the first running job of ``lane`` is expected to end."""
        end_of = self.end_of(now)
        return min(
            (
                end_of(job)
                for job in self._running
                if job.demand is not None and job.demand.lane == lane
            ),
            default=self.next_end(now),
        )

    def place(
        self,
        now: float,
        promise: Promise | None,
        rank: int = 0,
        size: JobSize | None = None,
        later: int = 0,
    ) -> tuple[HintParts, Promise | None]:
        """The hint for a refusal, in parts, and the promise that goes with it (None: the line
        is full).

        A returning client keeps its place in line and is re-timed to the release of that
        place; a newcomer, in constant time, is promised the release after every promise
        outstanding of its own lane or a higher one. The slots turn over at the pace of the
        jobs of the clients ahead: the mean of their predicted times. ``later``: releases that go
        to others first, whatever the line (suspended jobs' slots, taken back first).
        """
        own_s = self.estimates.predict_s(size, self.lanes.lane(rank))
        parts, promise = self.timing(now, promise, rank, size, later)
        at = now + parts.ms / 1000
        kept = self.line.keep(promise, at, at + self.estimates.grace(), rank, own_s)
        if kept is not None:
            kept.told = None  # (until its client is told it)
        return parts, kept

    def timing(
        self,
        now: float,
        promise: Promise | None,
        rank: int = 0,
        size: JobSize | None = None,
        later: int = 0,
    ) -> tuple[HintParts, Promise | None]:
        """:meth:`place`'s hint, the line left as it is; and the promise that keeps its place
        (None: a newcomer's, at the back)."""
        if promise is not None and promise.queued:
            counts, seconds = self.line.ahead_of(promise, rank)
        else:  # a newcomer, or a client whose promise lapsed: to the back
            promise = None
            counts, seconds = self.line.totals()
        ahead, ahead_s = sum(counts[: rank + 1]), sum(seconds[: rank + 1])
        reserve = self.lanes.reserve(rank, now)
        if reserve and counts[0]:  # the reserve serves the first interactive clients
            ahead -= min(counts[0], reserve)
            ahead_s -= seconds[0] * min(counts[0], reserve) / counts[0]
        if ahead > 0:
            turn_s = ahead_s / ahead
        else:
            turn_s = self.estimates.predict_s(size, self.lanes.lane(rank))
        # (a job of n sequences waits for the n-th release after those ahead of it)
        k = ahead + later + (size.width - 1 if size is not None else 0)
        end, turns, period = self.release_parts(now, k, rank, turn_s, size)
        # (late by a margin of the last leg: a client a moment early is refused again)
        lead = self.margin * (period if turns else max(end - now, 0.0))
        at = max(end + turns * period + lead, self.line.latest(promise, rank))
        return self.parts(now, at, end if turns else end + lead, ahead + later), promise

    def release_parts(
        self,
        now: float,
        k: int,
        rank: int = 0,
        turn_s: float | None = None,
        size: JobSize | None = None,
    ) -> tuple[float, int, float]:
        """The ``k``-th slot release from now (``k`` = 0: the next one), for a client of the
        lane ranked ``rank``, as ``(end, turns, period)``: the release is ``turns`` turns of
        ``period`` after the slot's running job's predicted ``end``.

        Each later turn of a slot starts when its promised client is back, not at once, and
        lasts ``W`` (``turn_s``: the predicted time of the jobs that take those turns, the
        lane's mean by default), so a slot turns over every ``W + T``. On a runner that feeds
        prompts beside every stream, a turn also holds the prompts of the jobs the other slots
        take meanwhile, one each, of about ``size``
        (:meth:`~.estimates.ServiceEstimates.fed_beside`).
        """
        prompt = size.prompt_tokens if size is not None else 0
        ends, slots = self._ends(now, rank, prompt)
        floor = now + self.min_hint_ms / 1000
        ends += [floor] * (slots - len(ends))  # a free slot is held for a promise due now
        ends.sort()
        if turn_s is None:
            turn_s = self.estimates.service_for(self.lanes.lane(rank))
        turn_s += self.estimates.fed_beside(prompt * (slots - 1), turn_s)
        # (no turn is shorter than a millisecond: a period of 0 would never move on; and each
        # turn's client comes back a margin of the period after the release it was told)
        period = max(turn_s + self.estimates.turnaround_s, 0.001) / (1.0 - self.margin)
        end, turns = kth_release_parts(ends, period, k)
        return end, turns, period

    def releases_by(self, now: float, rank: int, until: float) -> list[float]:
        """When the slots a client of the lane ranked ``rank`` may take are expected to free
        (each running job's first end), up to ``until``, in order."""
        return sorted(end for end in self._ends(now, rank)[0] if end <= until)

    def _ends(self, now: float, rank: int, prompt: int = 0) -> tuple[list[float], int]:
        """The expected ends of the running jobs whose release frees a slot a client of the
        lane ranked ``rank`` may take, and how many slots it may take.

        Under an interactive reserve of ``r`` slots, a lower lane's client may take ``cap -
        r``: those of the lower lanes' jobs, and of the interactive jobs past the ``r`` the
        reserve holds (the first of them to end frees a slot that is not the reserve's).
        """
        end_of = self.end_of(now, prompt)
        reserve = self.lanes.reserve(rank, now)
        ends: list[float] = []
        interactive: list[float] = []
        for job in self._running:
            lane = job.demand.lane if reserve and job.demand is not None else None
            (interactive if lane == Lane.INTERACTIVE else ends).extend([end_of(job)] * job.width)
        if not reserve:
            return ends, self.cap
        if len(interactive) > reserve:
            interactive.sort()
            ends += interactive[: len(interactive) - reserve]
        return ends, max(self.cap - reserve, 1)


def _ms(seconds: float) -> int:
    """Whole milliseconds, rounded up (less a nanosecond, so that float noise does not round
    600 ms up to 601)."""
    return math.ceil(seconds * 1000 - 1e-6)


def kth_release_parts(ends: list[float], period: float, k: int) -> tuple[float, int]:
    """The ``k``-th smallest (from 0) of ``ends[i] + j * period`` over every ``i`` and ``j >=
    0``, as ``(ends[i], j)``: when the ``k``-th slot release is expected, slot ``i`` freeing
    first at ``ends[i]`` and then every ``period``; its slot's first end and its turns after.

    ``ends`` is sorted and not empty; ``period`` is positive. Constant time when every slot
    frees once before any frees twice (the usual case); else the releases are counted in rounds
    of one period from the first: in round ``r``, slot ``i`` frees at ``e_0 + r * period +
    o_i`` once ``r >= q_i``, where ``e_i - e_0 = q_i * period + o_i``.
    """
    first, n = ends[0], len(ends)
    if ends[-1] - first < period:  # the usual case
        r, i = divmod(k, n)
        return ends[i], r
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
    # (the slots in turn, by where in a round each frees)
    order = sorted(range(turning), key=lambda i: ends[i] - first - rounds[i] * period)
    i = order[k - before]
    return ends[i], r - rounds[i]
