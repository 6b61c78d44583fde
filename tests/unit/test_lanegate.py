"""The lanes' quotas and the interactive reserve on their own: pure, the time passed in."""

from __future__ import annotations

from governor.core.lanegate import LaneGate
from governor.core.policy import Demand, Lane, LanePolicy, LaneSettings, lane_table
from governor.core.promises import PromiseLine


def test_without_a_policy_every_job_is_of_rank_0_and_may_take_any_slot() -> None:
    gate = LaneGate(None, PromiseLine(3), 0.0)
    assert gate.rank(Demand(Lane.BACKGROUND, 10)) == 0
    assert gate.lane(2) is None
    assert gate.reserve(2, 0.0) == gate.unused_reserve(2, 0.0) == 0


def test_the_reserve_is_kept_from_lower_lanes_less_the_chats_running() -> None:
    gate = LaneGate(LanePolicy(interactive_reserve=2), PromiseLine(3), 0.0)
    assert gate.rank(Demand(Lane.HEAVY, 10)) == 1
    assert gate.lane(1) == Lane.HEAVY
    assert (gate.reserve(0, 0.0), gate.reserve(1, 0.0)) == (0, 2)
    gate.inflight[Lane.INTERACTIVE] += 1
    assert (gate.reserve(1, 0.0), gate.unused_reserve(1, 0.0)) == (2, 1)
    gate.inflight[Lane.INTERACTIVE] += 2
    assert gate.unused_reserve(1, 0.0) == 0


def test_the_reserve_is_lent_while_no_chat_asks_or_waits() -> None:
    line = PromiseLine(3)
    gate = LaneGate(LanePolicy(interactive_reserve=1, reserve_lend_after_s=5.0), line, 0.0)
    assert gate.reserve(2, 4.9) == 1  # kept from the start
    assert gate.reserve(2, 5.0) == 0  # lent: no chat for 5 s
    waiting = line.keep(None, 6.0, 6.1, 0, 0.1)  # a chat waits in line
    assert waiting is not None
    assert gate.reserve(2, 5.0) == 1
    line.withdraw(waiting)
    gate.asked(1, 5.0)  # (a heavy job asking changes nothing)
    assert gate.reserve(2, 5.0) == 0
    gate.asked(0, 5.0)  # a chat asks: kept again for 5 s
    assert (gate.reserve(2, 9.9), gate.reserve(2, 10.0)) == (1, 0)


def test_a_lane_at_its_quota_is_full() -> None:
    policy = LanePolicy(
        lanes=lane_table(heavy=LaneSettings(slots=1), background=LaneSettings(slots=2))
    )
    gate = LaneGate(policy, PromiseLine(3), 0.0)
    assert not gate.quota_full(Lane.HEAVY)
    gate.inflight[Lane.HEAVY] += 1
    gate.inflight[Lane.INTERACTIVE] += 9
    assert gate.quota_full(Lane.HEAVY)
    assert not gate.quota_full(Lane.INTERACTIVE)
    assert not gate.quota_full(Lane.BACKGROUND)
