"""How the retry hints land: each return at its hint, and how far the hint was from the moment a
slot was in fact available to it.

A client refused for want of a slot is told a time (its :class:`~governor.core.promises.Promise`:
``at``, told at ``told``, when its yield was answered: :func:`~.admission.answered`; a job that
waits in line on the server is told nothing, and its turn is not a return). When it comes back
at that time (no sooner than ``hold`` before it, the window in which a freed slot is held for
it):

* admitted, its return **landed**; the slot it took was available from ``max(freed, told)``
  (``freed``: when that slot was released; a slot free all along was available when the hint
  was given), and the hint's error is ``at - available``: positive, the slot stood idle that
  long waiting for the time told; negative, the client came late and the slot had freed after
  the time told (the hint was early; the client's lateness hid it).
* refused again, its return was **early**, by as much as the slot it is eventually admitted to
  was released after the time told: that error (negative) is known only then, so the return is
  kept on the promise (the latest ``EARLY_KEPT``) until its client is admitted. A client that
  never is gives no error: nothing says when a slot would have been its.

Each error is observed as a share of its hint (``error / (at - told)``), by lane, in a histogram
of :data:`ERROR_BUCKETS`: ``|error|`` at most a tenth of the hint is a hint that landed well.
Returns are counted by lane and outcome; the landing rate is the landed share.

Pure: the caller passes the times.
"""

from __future__ import annotations

import bisect
from collections import Counter

from .promises import Promise

# The hint's error as a share of the hint: negative early, positive late.
ERROR_BUCKETS = (-1.0, -0.5, -0.25, -0.1, -0.05, -0.02, 0.0, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
EARLY_KEPT = 8  # early returns a promise keeps until its client is admitted (a bound per client)
Hint = tuple[float, float]  # a hint a client came back at: (told, at)


class Landings:
    """The returns at their hints of one pool, and their hints' errors, by lane."""

    __slots__ = ("errors", "returns")

    def __init__(self) -> None:
        # By lane: the errors, as shares of their hints, counted per bucket of ERROR_BUCKETS
        # (the last past them all), and their sum.
        self.errors: dict[str, tuple[list[int], float]] = {}
        self.returns: Counter[tuple[str, str]] = Counter()  # by (lane, "landed" or "early")

    def at_hint(self, promise: Promise, now: float, hold: float) -> Hint | None:
        """Whether a client back with ``promise`` came at the hint it was told (no sooner than
        ``hold`` before it): that hint, ``(told, at)``; None, for a client far early, or a job
        that waited in line on the server (told nothing: not a return)."""
        told = promise.told
        return (told, promise.at) if told is not None and now >= promise.at - hold else None

    def early(self, promise: Promise, lane: str, hint: Hint) -> None:
        """The client came at ``hint`` and was refused again: kept on its promise, which was
        re-timed, until a slot is its."""
        self.returns[lane, "early"] += 1
        kept = promise.early
        if kept is None:
            kept = promise.early = []
        kept.append(hint)
        del kept[:-EARLY_KEPT]

    def landed(
        self,
        promise: Promise,
        lane: str,
        hint: Hint | None,
        freed: float | None,
    ) -> None:
        """The client back with ``promise`` was admitted to a slot released at ``freed`` (None:
        one never taken before); ``hint``: the hint it came at (None: it came far early). Its
        early returns' errors are known now, and, at its hint, this one's."""
        hints = [*(promise.early or ()), *([hint] if hint is not None else [])]
        promise.early = None
        if hint is not None:
            self.returns[lane, "landed"] += 1
        for told, at in hints:
            available = told if freed is None else max(freed, told)
            self.observe(lane, (at - available) / max(at - told, 1e-3))

    def observe(self, lane: str, share: float) -> None:
        """A hint's error, as a share of the hint."""
        counts, total = self.errors.get(lane) or ([0] * (len(ERROR_BUCKETS) + 1), 0.0)
        counts[bisect.bisect_left(ERROR_BUCKETS, share)] += 1
        self.errors[lane] = (counts, total + share)
