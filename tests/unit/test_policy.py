"""Lanes, the interactive reserve and the KV budget: pure policy, an injected clock, no sockets."""

from __future__ import annotations

import pytest

from governor.core.ledger import Completed, Refusal, Slot, SlotLedger
from governor.core.policy import Demand, Lane, LanePolicy, LaneSettings, Rejection, lane_table
from tests.clock import FakeClock


@pytest.mark.parametrize(
    ("prompt", "max_new", "requested", "lane"),
    [
        (20, 64, None, Lane.INTERACTIVE),  # 20 + 2 * 64 = 148
        (1000, 250, None, Lane.HEAVY),  # 1000 + 500 = 1500, over the 1400 of interactive
        (2000, 200, None, Lane.HEAVY),  # 2400
        (40000, 6, None, Lane.BACKGROUND),  # a long-document rewrite
        (20, 64, Lane.BACKGROUND, Lane.BACKGROUND),  # asking for a lower lane is fine
        (2000, 200, Lane.INTERACTIVE, Lane.HEAVY),  # asking for a higher one is not
        (20, 600, None, Lane.HEAVY),  # over interactive's max_new_tokens cap of 256
    ],
)
def test_classification(prompt: int, max_new: int, requested: Lane | None, lane: Lane) -> None:
    policy = LanePolicy(
        lanes=lane_table(interactive=LaneSettings(max_cost=1400, max_new_tokens=256))
    )
    demand = policy.classify(prompt, max_new, requested)
    assert demand == Demand(lane, prompt + max_new)


def test_tool_risk_moves_a_job_down() -> None:
    policy = LanePolicy(tool_risk_weight=2000.0)
    assert policy.classify(20, 64) == Demand(Lane.INTERACTIVE, 84)
    assert policy.classify(20, 64, tool_risk=1.0) == Demand(Lane.HEAVY, 84)


def test_cost_weights() -> None:
    policy = LanePolicy(prompt_weight=1.0, output_weight=2.0, tool_risk_weight=100.0)
    assert policy.cost(10, 5, tool_risk=1.0) == 10 + 10 + 100


@pytest.mark.parametrize(
    ("policy", "prompt", "max_new", "code"),
    [
        (LanePolicy(prompt_ceiling=1000), 1001, 10, "prompt_over_ceiling"),
        (LanePolicy(kv_capacity=500), 400, 101, "kv_over_capacity"),
        (LanePolicy(), 10, 5000, "max_new_tokens_invalid"),
    ],
)
def test_jobs_that_can_never_run_are_rejected(
    policy: LanePolicy, prompt: int, max_new: int, code: str
) -> None:
    rejection = policy.classify(prompt, max_new)
    assert isinstance(rejection, Rejection)
    assert rejection.need_code == code
    assert rejection.detail


def ledger_with(clock: FakeClock, cap: int = 4, **policy: object) -> SlotLedger:
    return SlotLedger(cap, expected_service_s=1.0, clock=clock, policy=LanePolicy(**policy))  # type: ignore[arg-type]


INTERACTIVE = Demand(Lane.INTERACTIVE, 100)
HEAVY = Demand(Lane.HEAVY, 1000)
BACKGROUND = Demand(Lane.BACKGROUND, 1000)


def test_heavy_work_never_takes_the_interactive_reserve(clock: FakeClock) -> None:
    ledger = ledger_with(clock, cap=4, interactive_reserve=1)
    heavy = [ledger.admit(demand=HEAVY) for _ in range(4)]
    assert [isinstance(d, Slot) for d in heavy] == [True, True, True, False]
    refused = heavy[3]
    assert isinstance(refused, Refusal)
    assert refused.need_code == "lane_full"
    assert refused.promise is not None  # a place in line for the slots heavy work may take
    assert isinstance(ledger.admit(demand=INTERACTIVE), Slot)  # the reserved slot
    assert ledger.inflight == 4
    assert ledger.lane_inflight == {Lane.HEAVY: 3, Lane.INTERACTIVE: 1}


def test_interactive_work_may_use_every_slot(clock: FakeClock) -> None:
    ledger = ledger_with(clock, cap=3, interactive_reserve=1)
    assert all(isinstance(ledger.admit(demand=INTERACTIVE), Slot) for _ in range(3))
    refused = ledger.admit(demand=INTERACTIVE)
    assert isinstance(refused, Refusal)
    assert refused.need_code == "server_busy"


def test_lane_quota_and_its_hint(clock: FakeClock) -> None:
    ledger = ledger_with(
        clock, cap=4, interactive_reserve=0, lanes=lane_table(background=LaneSettings(slots=1))
    )
    first = ledger.admit(demand=BACKGROUND)
    assert isinstance(first, Slot)
    clock.now += 0.25
    refused = ledger.admit(demand=BACKGROUND)
    assert isinstance(refused, Refusal)
    assert refused.need_code == "lane_full"
    assert refused.retry_hint_ms == 750  # when the lane's running job is expected to end
    assert isinstance(ledger.admit(demand=HEAVY), Slot)  # other lanes are not held up
    first.release(done=Completed())
    assert isinstance(ledger.admit(demand=BACKGROUND), Slot)


def test_kv_budget_keeps_a_share_for_interactive_work(clock: FakeClock) -> None:
    ledger = ledger_with(
        clock,
        cap=8,
        interactive_reserve=0,
        kv_capacity=10_000,
        kv_danger=0.8,
        kv_interactive_share=0.3,
    )
    long_jobs = [ledger.admit(demand=Demand(Lane.BACKGROUND, 3000)) for _ in range(4)]
    assert [isinstance(d, Slot) for d in long_jobs] == [True, True, False, False]
    refused = long_jobs[2]
    assert isinstance(refused, Refusal)
    assert refused.need_code == "kv_pressure"
    assert ledger.kv_reserved == 6000  # never past 70 %: the interactive share is kept
    assert isinstance(ledger.admit(demand=Demand(Lane.INTERACTIVE, 3500)), Slot)
    assert ledger.kv_reserved == 9500
    too_big = ledger.admit(demand=Demand(Lane.INTERACTIVE, 600))
    assert isinstance(too_big, Refusal)
    assert too_big.need_code == "kv_pressure"  # never past the capacity itself
    for slot in long_jobs[:2]:
        assert isinstance(slot, Slot)
        slot.release(done=Completed())
    assert ledger.kv_reserved == 3500


def test_burst_of_long_jobs_never_overfills_kv_and_interactive_still_runs(clock: FakeClock) -> None:
    ledger = ledger_with(clock, cap=16, interactive_reserve=2, kv_capacity=20_000)
    admitted = []
    for _ in range(50):
        decision = ledger.admit(demand=Demand(Lane.BACKGROUND, 2500))
        if isinstance(decision, Slot):
            admitted.append(decision)
        assert ledger.kv_reserved <= 20_000 * 0.8
    assert len(admitted) == 6  # 6 x 2500 = 15000 <= 16000 (80 %); a 7th would pass it
    assert isinstance(ledger.admit(demand=Demand(Lane.INTERACTIVE, 400)), Slot)


def test_a_heavy_job_kept_off_the_reserve_is_told_when_a_running_job_ends(
    clock: FakeClock,
) -> None:
    ledger = ledger_with(clock, cap=2, interactive_reserve=1)
    assert isinstance(ledger.admit(demand=HEAVY), Slot)
    clock.now += 0.4
    refused = ledger.admit(demand=HEAVY)  # one slot is free, but it is the reserve
    assert isinstance(refused, Refusal)
    assert refused.need_code == "lane_full"
    assert refused.retry_hint_ms == 600  # the running job's expected end, not "now"


def test_heavy_clients_kept_off_the_reserve_wait_for_heavy_slots_not_for_chats(
    clock: FakeClock,
) -> None:
    """The reserve's free slot is not a heavy client's: it is told when the heavy job ends
    (not when the chat beside it does), and the heavy clients after it are spread over the
    heavy slot's later turns; a chat is not held behind them."""
    ledger = ledger_with(clock, cap=2, interactive_reserve=1)
    heavy = ledger.admit(demand=HEAVY)  # ends at 1.0 s
    chat = ledger.admit(demand=INTERACTIVE)  # in the reserve, ends at 1.0 s too
    assert isinstance(heavy, Slot)
    assert isinstance(chat, Slot)
    clock.now += 0.9
    chat.release()  # a chat ends first (cancelled: teaches nothing); the free slot: the reserve

    def refused(demand: Demand) -> Refusal:
        decision = ledger.admit(demand=demand)
        assert isinstance(decision, Refusal)
        return decision

    first, second = refused(HEAVY), refused(HEAVY)
    assert (first.need_code, second.need_code) == ("lane_full", "lane_full")
    # The heavy job's end, then one heavy turn (its lane's 1 s, and the 5 ms turnaround) on.
    assert [first.retry_hint_ms, second.retry_hint_ms] == [100, 100 + 1005]
    assert isinstance(ledger.admit(demand=INTERACTIVE), Slot)  # the reserve is for chats
    clock.now += 0.1
    heavy.release(done=Completed())
    # The freed heavy slot is held for the first heavy client in line, not for a newcomer.
    assert refused(HEAVY).need_code == "server_busy"
    assert isinstance(ledger.admit(first.promise, demand=HEAVY), Slot)
    assert refused(HEAVY).need_code == "server_busy"  # every slot busy
    assert ledger.lane_inflight == {Lane.HEAVY: 1, Lane.INTERACTIVE: 1}


def test_an_idle_reserve_does_not_count_as_a_slot_waiting_for_heavy_clients(
    clock: FakeClock,
) -> None:
    """The turnaround (how long a freed slot waits for the client promised it) is read from
    the slot the heavy client takes, freed a moment ago, not from the reserve, idle since the
    last chat: that would add a job's time to every later turn of every heavy promise."""
    ledger = ledger_with(clock, cap=2, interactive_reserve=1)
    chat, heavy = ledger.admit(demand=INTERACTIVE), ledger.admit(demand=HEAVY)
    refused = ledger.admit(demand=HEAVY)
    assert isinstance(chat, Slot)
    assert isinstance(refused, Refusal)
    due = clock.now + refused.retry_hint_ms / 1000
    clock.now += 0.5
    chat.release(done=Completed())  # the reserve is free from now on
    for _ in range(5):  # heavy jobs, one after the other, each next client back on time
        assert isinstance(heavy, Slot)
        clock.now = max(clock.now, due)
        heavy.release(done=Completed())
        clock.now += 0.01
        heavy = ledger.admit(refused.promise, demand=HEAVY)
        refused = ledger.admit(demand=HEAVY)
        assert isinstance(refused, Refusal)
        assert refused.need_code == "lane_full"
        due = clock.now + refused.retry_hint_ms / 1000
    assert ledger.turnaround_s < 0.02


def test_an_idle_reserve_is_lent_and_back_for_the_next_chat(clock: FakeClock) -> None:
    """With ``reserve_lend_after_s``, the reserve is kept while chats come; once none has for
    that long, heavy work may take it; the next chat takes it back: it is told when the first
    job ends, and heavy work keeps off the reserve again."""
    ledger = ledger_with(clock, cap=2, interactive_reserve=1, reserve_lend_after_s=10.0)
    first = ledger.admit(demand=HEAVY)
    assert isinstance(first, Slot)
    kept = ledger.admit(demand=HEAVY)
    assert isinstance(kept, Refusal)
    assert kept.need_code == "lane_full"  # kept from the start
    clock.now += 9.0
    chat = ledger.admit(demand=INTERACTIVE)
    assert isinstance(chat, Slot)
    clock.now += 0.5
    chat.release(done=Completed())
    clock.now += 9.0  # 9.5 s since the chat: still kept
    refused = ledger.admit(kept.promise, demand=HEAVY)
    assert isinstance(refused, Refusal)
    assert refused.need_code == "lane_full"
    clock.now += 0.5  # 10 s without a chat: lent
    lent = ledger.admit(refused.promise, demand=HEAVY)
    assert isinstance(lent, Slot)
    assert ledger.lane_inflight[Lane.HEAVY] == 2
    # A chat comes: every slot is busy, so it waits for the first end, and is first in line.
    waiting = ledger.admit(demand=INTERACTIVE)
    assert isinstance(waiting, Refusal)
    assert waiting.need_code == "server_busy"
    first.release(done=Completed())
    # The freed slot is the reserve again: a heavy newcomer may not take it, the chat may.
    assert ledger.admit(demand=HEAVY).need_code == "lane_full"  # type: ignore[union-attr]
    assert isinstance(ledger.admit(waiting.promise, demand=INTERACTIVE), Slot)


def test_a_reserve_is_never_lent_by_default(clock: FakeClock) -> None:
    ledger = ledger_with(clock, cap=2, interactive_reserve=1)
    assert isinstance(ledger.admit(demand=HEAVY), Slot)
    clock.now += 3600.0
    refused = ledger.admit(demand=HEAVY)
    assert isinstance(refused, Refusal)
    assert refused.need_code == "lane_full"


def test_each_lane_has_its_own_service_estimate(clock: FakeClock) -> None:
    """A chat refused while chats and a rewrite run is told when a chat ends, not when the
    pool's mean job (half chats, half rewrites) would."""
    ledger = ledger_with(clock, cap=2, interactive_reserve=0)
    for _ in range(10):  # the pool's estimate stays between the two
        for lane, seconds in ((Lane.HEAVY, 2.0), (Lane.INTERACTIVE, 0.1)):
            slot = ledger.admit(demand=Demand(lane, 100))
            assert isinstance(slot, Slot)
            clock.now += seconds
            slot.release(done=Completed())
    assert ledger.service_for(Lane.HEAVY) == pytest.approx(2.0)
    assert ledger.service_for(Lane.INTERACTIVE) == pytest.approx(0.1)
    assert 0.5 < ledger.service_s < 1.5
    assert ledger.service_for(Lane.BACKGROUND) == ledger.service_s  # none finished yet
    assert isinstance(ledger.admit(demand=HEAVY), Slot)
    assert isinstance(ledger.admit(demand=INTERACTIVE), Slot)
    clock.now += 0.02
    refused = ledger.admit(demand=INTERACTIVE)
    assert isinstance(refused, Refusal)
    assert refused.need_code == "server_busy"
    assert refused.retry_hint_ms == 80  # the running chat's end; the rewrite's is 1.98 s away
    # The next chat in line is told of the chat slot's next turn (one more chat and the 5 ms
    # turnaround), which comes long before the rewrite ends.
    second = ledger.admit(demand=INTERACTIVE)
    assert isinstance(second, Refusal)
    assert second.retry_hint_ms == 80 + 100 + 5


def test_a_newcomer_waits_only_behind_its_own_lane_or_a_higher_one(clock: FakeClock) -> None:
    ledger = ledger_with(clock, cap=1, interactive_reserve=0)
    assert isinstance(ledger.admit(demand=HEAVY), Slot)  # ends in 1 s; each turn after, 1.005 s

    def hint(demand: Demand) -> int:
        refused = ledger.admit(demand=demand)
        assert isinstance(refused, Refusal)
        assert refused.need_code == "server_busy"
        return refused.retry_hint_ms

    assert [hint(HEAVY) for _ in range(3)] == [1000, 2005, 3010]
    assert [hint(INTERACTIVE) for _ in range(2)] == [1000, 2005]  # the heavy ones do not count
    assert hint(BACKGROUND) == 1000 + 5 * 1005  # all five do
