"""Service-level objectives: what each lane promises, what each job is held to, who met it.

Pure code with an injected clock. Each lane has a time-to-first-token (TTFT) and a
time-per-output-token (TPOT) objective; goodput is the jobs that finish within both. A job
without a lane (lanes off) is held to the interactive lane's.

**A job's objectives** (:meth:`SloPolicy.objectives`): its lane's, unless its tenant (the
``ttft_slo_ms`` and ``tpot_slo_ms`` of its ``[[tenants]]`` table) or, over that, the request
(the job spec's fields of the same names) sets its own. An interactive job's may be tightened,
never loosened: a chat that says it does not mind waiting would hide, from the attainment the
overload states read, an overload every other chat feels. The batched runner sizes each step to
the time the generating sequences have banked against their TPOT objectives (and, for
interactive ones, to at most ``interactive_gap_ms``, the longest pause of a running chat): see
:mod:`governor.runners.llama.batching`.

**How a job is judged** (:func:`judge`), when it ends:

* TTFT as its client felt it: from its first refusal, when it was refused (the wait in line is
  the client's wait too), to its first generated text (to its end when it produced none);
* TPOT as the execution measured it; a job of one output token or none has no TPOT, and meets
  any TPOT objective;
* an objective of 0 is none, and always met;
* a job that failed in the backend, or ran out of its ``ttl_ms``, met neither; one that did
  not end on its own (cancelled, its client gone, revoked by the fleet, stopped at shutdown)
  is not judged.

**Attainment** (:class:`Attainment`): per lane, the jobs judged and those that met TTFT, TPOT
and both (goodput), counted since start and as shares over the last ``window_s``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .policy import Lane

OBJECTIVES = ("ttft", "tpot", "both")  # what a share is of: TTFT met, TPOT met, both (goodput)


@dataclass(frozen=True, slots=True)
class Objectives:
    """A TTFT and a TPOT objective, in milliseconds; 0 is none."""

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0


NO_OBJECTIVES = Objectives()

# The defaults (the config's): fitted to the embedded model on a CPU of two cores, where a
# chat's token takes 10 to 40 ms alone, a 1,400-token rewrite's prompt about 5 s, and a step
# feeding 256 tokens of a long prompt about a second (a heavy job's TPOT objective bounds the
# steps while it generates: below that, another rewrite's prompt is fed in small, dear chunks).
DEFAULT_OBJECTIVES: Mapping[Lane, Objectives] = {
    Lane.INTERACTIVE: Objectives(1000.0, 100.0),
    Lane.HEAVY: Objectives(15000.0, 1000.0),
    Lane.BACKGROUND: Objectives(60000.0, 2000.0),
}
# A running chat's longest pause between two tokens: half what a new chat is promised to wait for
# its first, room for a prompt chunk of the batched runner's knee beside 16 chats on this CPU.
DEFAULT_GAP_MS = 500.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SloPolicy:
    lanes: Mapping[Lane, Objectives] = field(default_factory=lambda: dict(DEFAULT_OBJECTIVES))
    interactive_gap_ms: float = (
        DEFAULT_GAP_MS  # see :mod:`governor.runners.llama.batching` (0: none)
    )

    def objectives(
        self,
        lane: Lane | None,
        tenant: Objectives | None = None,
        request: Objectives | None = None,
    ) -> Objectives:
        """A job's objectives: its lane's (the interactive lane's without one), overridden by its
        tenant's, then the request's (0 fields override nothing); an interactive job's never
        looser than the lane's."""
        base = self.lanes[lane or Lane.INTERACTIVE]
        ttft, tpot = base.ttft_ms, base.tpot_ms
        for override in (tenant, request):
            if override is not None:
                ttft = override.ttft_ms or ttft
                tpot = override.tpot_ms or tpot
        if lane in (None, Lane.INTERACTIVE):
            ttft = min(ttft, base.ttft_ms) if base.ttft_ms else ttft
            tpot = min(tpot, base.tpot_ms) if base.tpot_ms else tpot
        return Objectives(ttft, tpot)

    def gap_ms(self, lane: Lane | None) -> float:
        """The longest pause between two tokens of a job of ``lane`` (0: its TTFT objective)."""
        return self.interactive_gap_ms if lane in (None, Lane.INTERACTIVE) else 0.0


@dataclass(frozen=True, slots=True)
class Verdict:
    ttft: bool
    tpot: bool

    @property
    def good(self) -> bool:
        return self.ttft and self.tpot


def judge(
    objectives: Objectives, *, ttft_s: float | None, tpot_s: float | None, succeeded: bool
) -> Verdict:
    """Whether a job that ended met its objectives (see the module docstring): ``ttft_s`` as its
    client felt it, ``tpot_s`` None when it had one output token or none."""
    if not succeeded:
        return Verdict(False, False)
    ttft_ok = not objectives.ttft_ms or (ttft_s is not None and ttft_s * 1000 <= objectives.ttft_ms)
    tpot_ok = not objectives.tpot_ms or tpot_s is None or tpot_s * 1000 <= objectives.tpot_ms
    return Verdict(ttft_ok, tpot_ok)


def share(measured_s: float | None, objective_ms: float) -> float | None:
    """How far a measure went into its objective (1.0: at it; None: no objective or no
    measure): what the overload states read."""
    return measured_s * 1000 / objective_ms if objective_ms and measured_s is not None else None


class Attainment:
    """Per lane: jobs judged, and met TTFT, TPOT, both; since start and over ``window_s``."""

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self.window_s = window_s
        self.clock = clock
        # lane: [judged, ttft met, tpot met, both met]
        self.totals: dict[str, list[int]] = {}
        self._recent: collections.deque[tuple[float, str, Verdict]] = collections.deque()

    def record(self, lane: str, verdict: Verdict) -> None:
        counts = self.totals.setdefault(lane, [0, 0, 0, 0])
        counts[0] += 1
        counts[1] += verdict.ttft
        counts[2] += verdict.tpot
        counts[3] += verdict.good
        self._recent.append((self.clock(), lane, verdict))

    def shares(self) -> dict[str, tuple[int, float, float, float]]:
        """Per lane with a job judged in the window: (jobs, TTFT met, TPOT met, both) as shares
        of its jobs over the last ``window_s``."""
        horizon, recent = self.clock() - self.window_s, self._recent
        while recent and recent[0][0] < horizon:
            recent.popleft()
        counts: dict[str, list[int]] = {}
        for _, lane, verdict in recent:
            c = counts.setdefault(lane, [0, 0, 0, 0])
            c[0] += 1
            c[1] += verdict.ttft
            c[2] += verdict.tpot
            c[3] += verdict.good
        return {lane: (n, t / n, p / n, g / n) for lane, (n, t, p, g) in counts.items()}
