"""Which running jobs a chat suspends, when preemption takes a lent slot or lent memory back.

Pure: over the running jobs the ledger passes (:class:`~governor.core.ledger.Slot`), nothing
changed here; the ledger suspends the jobs chosen (see its "Preemption" paragraph). A job may
be suspended when it has a :class:`~governor.runners.base.Pause` (the ledger gives one to
every job below the interactive lane on a runner that suspends jobs). The newest job of the
lowest lane goes first: it has done the least work, and its lane's objectives are the loosest.
Beyond the reserve, a chat suspends only jobs it costs no objective: **fresh** ones, none of
their tokens generated yet and never suspended before (they came in the same instant as the
chat, or just before it), and jobs whose TPOT objective leaves them **slack** for the chat's
expected service: their objective is a mean over their tokens, and a job that generates faster
than it may be held back that long and still meet it (its earlier pauses spent part of it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

from ..runners.base import Pause
from .kvbudget import KvBudget
from .policy import LANES, Demand


class Suspendable(Protocol):
    """A running job as preemption sees it."""

    started: float
    demand: Demand | None
    width: int
    pause: Pause | None
    kv_cache: int | None
    kv_tokens: int

    @property
    def begun(self) -> bool: ...

    def slack_s(self, now: float) -> float: ...


def fresh(job: Suspendable) -> bool:
    """No token of the job's generated yet, and never suspended: a chat's slot may come from
    it beyond the reserve (its client has seen nothing; it is suspended once at most so)."""
    return not job.begun and job.pause is not None and not job.pause.suspensions


def slack_s(first_token: float, tokens: float, tpot_s: float, end: float) -> float:
    """How much later than ``end`` a job may end and still meet a TPOT objective of ``tpot_s``
    (a mean over its gaps) over ``tokens`` tokens, the first at ``first_token``; 0 if none."""
    return max(first_token + max(tokens - 1.0, 0.0) * tpot_s - end, 0.0)


J = TypeVar("J", bound=Suspendable)


def victim_order(job: Suspendable) -> tuple[int, float]:
    """The lowest lane first, the newest first within it."""
    rank = LANES.index(job.demand.lane) if job.demand is not None else 0
    return (-rank, -job.started)


def slot_victims(
    running: Iterable[J], short: int, *, lent: bool, now: float, spare: float
) -> list[J]:
    """The jobs to suspend for ``short`` slots: the first that hold that many, in
    :func:`victim_order`, of those holding a ``lent`` slot (any that may be suspended: the
    reserve is owed), or else those :func:`fresh` or with a slack of ``spare`` seconds (the
    chat's expected service) at ``now``; none where all of them hold fewer."""
    victims: list[J] = []
    held = 0
    for job in sorted(running, key=victim_order):
        if held >= short:
            break
        if job.pause is not None and (lent or fresh(job) or job.slack_s(now) >= spare > 0):
            victims.append(job)
            held += job.width
    return victims if held >= short else []


def cell_victims(running: Iterable[J], kv: KvBudget, cells: int) -> list[J]:
    """The jobs to suspend for room for ``cells`` KV cells (and a sequence) in one cache: the
    first, in :func:`victim_order`, whose reservations give one cache that room; none where
    all of them do not."""
    free = [kv.free(i) for i in range(len(kv.caches))]
    victims: list[J] = []
    for job in sorted(running, key=victim_order):
        if job.pause is None or job.kv_cache is None:
            continue
        victims.append(job)
        room, sequences = free[job.kv_cache]
        free[job.kv_cache] = (room + job.kv_tokens, sequences + 1)
        if any(room >= cells and sequences for room, sequences in free):
            return victims
    return []
