"""Which of a pool's slots a lane's job may take: the lanes' quotas and the interactive reserve.

Under a lane policy (:mod:`governor.core.policy`) each lane may hold at most its quota of slots
(each lane's ``slots``), and ``interactive_reserve`` slots are kept for interactive jobs: a job of a
lower lane may not take them. The reserve is lent: every slot is the lower lanes' too, while no
interactive client waits in line: at once to a job the runner can pause (``lend``: a chat takes
the lent slot back by suspending it, the ledger's preemption), else only once no interactive job
has asked for a slot for ``reserve_lend_after_s`` (0: never), until the next one asks.
Without a policy every job is of rank 0 and may take any slot.

A lane's *rank* is its place in :data:`~governor.core.policy.LANES`, 0 the highest. Pure: the
caller passes the time.
"""

from __future__ import annotations

import collections

from .policy import LANES, Demand, Lane, LanePolicy
from .promises import PromiseLine


class LaneGate:
    """A pool's jobs running per lane, and the slots each lane may take."""

    __slots__ = ("_interactive_seen", "_line", "inflight", "lend", "policy")

    def __init__(
        self, policy: LanePolicy | None, line: PromiseLine, now: float, *, lend: bool = False
    ) -> None:
        self.policy = policy
        self.lend = lend  # the reserve is lent at once (a chat takes a lent slot back)
        self._line = line  # who waits: the reserve is not lent while an interactive client does
        # Slots taken, by lane (a job takes one for each sequence it runs at once).
        self.inflight: collections.Counter[Lane] = collections.Counter()
        # When an interactive job last asked for a slot; the reserve is kept from the start.
        self._interactive_seen = now

    def rank(self, demand: Demand | None) -> int:
        """The rank of a job's lane (0 without a lane policy)."""
        return LANES.index(demand.lane) if demand is not None and self.policy is not None else 0

    def lane(self, rank: int) -> Lane | None:
        """The lane ranked ``rank`` (None without a lane policy)."""
        return LANES[rank] if self.policy is not None else None

    def asked(self, rank: int, now: float) -> None:
        """A job of the lane ranked ``rank`` asked for a slot at ``now``."""
        if rank == 0:
            self._interactive_seen = now

    def reserve(self, rank: int, now: float, *, pausable: bool = True) -> int:
        """The slots a job of the lane ranked ``rank`` may not take: the interactive reserve
        (0 for interactive work, without a lane policy, or while the reserve is lent: no
        interactive job has come for ``reserve_lend_after_s``, or at once with ``lend`` to a
        job the runner can pause, and none waits in line)."""
        policy = self.policy
        if policy is None or rank == 0:
            return 0
        lend_after = policy.reserve_lend_after_s
        if (
            (lend_after or (self.lend and pausable))
            and now - self._interactive_seen >= lend_after
            and not self._line.of_rank(0)
        ):
            return 0
        return policy.interactive_reserve

    def unused_reserve(self, rank: int, now: float, *, pausable: bool = True) -> int:
        """The free slots a job of the lane ranked ``rank`` may not take: the reserve less the
        interactive jobs running."""
        reserve = self.reserve(rank, now, pausable=pausable)
        return max(reserve - self.inflight[Lane.INTERACTIVE], 0) if reserve else 0

    def owes(self, width: int) -> bool:
        """Whether the reserve is owed to an interactive job of ``width`` slots, which may then
        take a lent slot back (``lend``): interactive jobs, it included, would hold no more
        than the reserve."""
        policy = self.policy
        return (
            self.lend
            and policy is not None
            and self.inflight[Lane.INTERACTIVE] + width <= policy.interactive_reserve
        )

    def quota_full(self, lane: Lane, width: int = 1) -> bool:
        """Whether ``lane`` has fewer than ``width`` slots left under its quota."""
        assert self.policy is not None
        quota = self.policy.lanes[lane].slots
        return quota is not None and self.inflight[lane] + width > quota

    def most(self, lane: Lane | None, cap: int) -> int:
        """The most slots a job of ``lane`` could ever hold at once, of a pool of ``cap``: its
        lane's quota, and not the interactive reserve's slots unless the policy lends them."""
        policy = self.policy
        if policy is None or lane is None:
            return cap
        quota = policy.lanes[lane].slots
        most = cap if quota is None else min(cap, quota)
        if lane != Lane.INTERACTIVE and not (policy.reserve_lend_after_s or self.lend):
            most = min(most, cap - policy.interactive_reserve)
        return most
