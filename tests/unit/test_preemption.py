"""Preemption in the slot ledger (``SlotLedger(preemptible=True)``), with an injected clock.

On a runner that suspends jobs the interactive reserve is lent at once; a chat owed it
suspends the newest running job of the lowest lane for its slot, or for its KV cells; a
suspended job holds no slot and no reserved cells, stays admitted, and resumes (in its own
cache) oldest first and before any newer non-interactive job starts. Examples first, then a
stateful property over random admissions, releases, waits and resumes.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from governor.core.kvbudget import KvBudget
from governor.core.ledger import Completed, Promise, Refusal, Slot, SlotLedger
from governor.core.policy import LANES, Demand, Lane, LanePolicy, LaneSettings, lane_table
from governor.core.preemption import slack_s
from governor.core.service import JobSize
from governor.runners.base import CacheShape
from protocol.codes import NeedCode
from tests.clock import FakeClock

CHAT, HEAVY, BACKGROUND = Lane.INTERACTIVE, Lane.HEAVY, Lane.BACKGROUND
STEP = 0.01  # between admissions, so that "newest" and "oldest" are told apart


def make(
    clock: FakeClock,
    cap: int,
    *,
    preemptible: bool = True,
    kv: KvBudget | None = None,
    reserve: int = 1,
    **policy: object,
) -> SlotLedger:
    return SlotLedger(
        cap,
        expected_service_s=1.0,
        clock=clock,
        policy=LanePolicy(interactive_reserve=reserve, **policy),  # type: ignore[arg-type]
        kv=kv,
        preemptible=preemptible,
    )


def ask(
    ledger: SlotLedger,
    lane: Lane,
    kv: int = 10,
    width: int = 1,
    promise: Promise | None = None,
    *,
    pausable: bool = True,
) -> Slot | Refusal:
    """A job of ``lane`` reserving ``kv`` KV cells, of ``width`` sequences; ``pausable``: its
    runner can suspend it."""
    size = JobSize(kv // 2, kv - kv // 2, width)
    return ledger.admit(promise, Demand(lane, kv), size, pausable=pausable)


def take(clock: FakeClock, ledger: SlotLedger, lane: Lane, kv: int = 10, width: int = 1) -> Slot:
    """Admit a job that must be admitted, then let a little time pass."""
    slot = ask(ledger, lane, kv, width)
    assert isinstance(slot, Slot), slot
    clock.now += STEP
    return slot


def refused(decision: Slot | Refusal, code: NeedCode = NeedCode.SERVER_BUSY) -> Refusal:
    assert isinstance(decision, Refusal), decision
    assert decision.need_code == code
    return decision


def listen(slot: Slot) -> list[bool]:
    """What the job's runner is told: each suspension (True) and resume (False)."""
    assert slot.pause is not None
    told: list[bool] = []
    slot.pause.listen(told.append)
    return told


# Lending ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [2, 4])
def test_heavy_jobs_take_every_slot_the_reserve_included(clock: FakeClock, cap: int) -> None:
    ledger = make(clock, cap)
    jobs = [take(clock, ledger, HEAVY) for _ in range(cap)]
    assert (ledger.taken, ledger.inflight, ledger.suspended) == (cap, cap, 0)
    assert ledger.lane_inflight[HEAVY] == cap
    assert ledger.saturated
    for slot in jobs:  # (each may be suspended: its runner is told through its pause)
        assert slot.pause is not None
        assert not slot.suspended
        assert not slot.pause.suspended
    refused(ask(ledger, HEAVY))  # full now
    refused(ask(ledger, BACKGROUND))
    assert ledger.suspended == 0


# A chat takes its slot back -----------------------------------------------------------------

# (cap, the lanes of the jobs filling it in the order admitted, the one a chat suspends)
VICTIMS = [
    (2, [HEAVY, HEAVY], 1),  # the newest
    (2, [BACKGROUND, HEAVY], 0),  # the lowest lane, though older
    (4, [HEAVY, HEAVY, HEAVY, HEAVY], 3),
    (4, [BACKGROUND, HEAVY, BACKGROUND, HEAVY], 2),  # the newest of the lowest lane
    (4, [HEAVY, BACKGROUND, HEAVY, HEAVY], 1),
]


@pytest.mark.parametrize(("cap", "lanes", "victim"), VICTIMS)
def test_a_chat_is_admitted_at_once_by_suspending_one_job(
    clock: FakeClock, cap: int, lanes: list[Lane], victim: int
) -> None:
    ledger = make(clock, cap)
    jobs = [take(clock, ledger, lane) for lane in lanes]
    told = [listen(slot) for slot in jobs]
    chat = ask(ledger, CHAT)
    assert isinstance(chat, Slot)
    assert chat.pause is None  # (a chat is never suspended)
    suspended = jobs[victim]
    assert suspended.suspended
    assert suspended.pause is not None
    assert suspended.pause.suspended
    assert suspended.pause.suspensions == 1
    assert told[victim] == [True]
    for i, slot in enumerate(jobs):
        if i != victim:
            assert not slot.suspended
            assert slot.pause is not None
            assert slot.pause.suspensions == 0
            assert told[i] == []
    # The slots of the running jobs only (the chat's included); the jobs, the suspended one too.
    assert ledger.taken == cap
    assert ledger.inflight == cap + 1
    assert ledger.suspended == 1
    assert ledger.suspensions == Counter({lanes[victim].value: 1})
    assert ledger.resumes == Counter()
    assert ledger.lane_inflight[CHAT] == 1
    assert ledger.lane_inflight[lanes[victim]] == lanes.count(lanes[victim]) - 1
    assert ledger.executed_total == cap + 1


@pytest.mark.parametrize(("cap", "lanes", "victim"), VICTIMS)
def test_a_second_chat_while_the_first_holds_the_reserve_is_refused(
    clock: FakeClock, cap: int, lanes: list[Lane], victim: int
) -> None:
    """... once every job left running has generated a token (see the next test)."""
    ledger = make(clock, cap)
    jobs = [take(clock, ledger, lane) for lane in lanes]
    assert isinstance(ask(ledger, CHAT), Slot)
    for slot in jobs:
        slot.first_token = clock.now
    clock.now += STEP
    assert ledger.lane_inflight[CHAT] == ledger.policy.interactive_reserve  # type: ignore[union-attr]
    refusal = refused(ask(ledger, CHAT))
    assert refusal.promise is not None
    assert ledger.suspended == 1  # nothing more suspended
    assert sum(ledger.suspensions.values()) == 1
    assert [slot.suspended for slot in jobs] == [i == victim for i in range(cap)]
    assert (ledger.taken, ledger.inflight) == (cap, cap + 1)


def test_beyond_the_reserve_chats_take_slots_from_fresh_jobs_once_each(clock: FakeClock) -> None:
    """Four heavy jobs, the first two with a token generated: the first chat takes the reserve
    back from the newest; the next from the newest job still fresh (none of its tokens yet,
    never suspended); a third finds none. The job suspended for the reserve, resumed, is no
    longer fresh: a chat beyond the reserve leaves it be."""
    ledger = make(clock, 4)
    jobs = [take(clock, ledger, HEAVY) for _ in range(4)]
    jobs[0].first_token = jobs[1].first_token = clock.now
    first = take(clock, ledger, CHAT)
    assert [slot.suspended for slot in jobs] == [False, False, False, True]
    second = take(clock, ledger, CHAT)
    assert [slot.suspended for slot in jobs] == [False, False, True, True]
    third = refused(ask(ledger, CHAT))
    assert (ledger.taken, ledger.suspended, ledger.lane_inflight[CHAT]) == (4, 2, 2)
    assert third.promise is not None
    ledger.withdraw(third.promise)  # (its client went elsewhere: no chat in line)
    first.release()
    second.release()  # (both suspended jobs resume, the older first)
    assert not any(slot.suspended for slot in jobs)
    take(clock, ledger, CHAT)  # (the reserve: owed again)
    assert [slot.suspended for slot in jobs] == [False, False, False, True]
    refused(ask(ledger, CHAT))  # (jobs[2] was suspended once already)
    assert [slot.pause.suspensions for slot in jobs if slot.pause] == [0, 0, 1, 2]


def test_slack_is_what_a_mean_tpot_objective_leaves_after_the_expected_end() -> None:
    # 5 tokens, the first at 10 s: 4 gaps of at most 1 s on average, an end by 14 s.
    assert slack_s(10.0, 5, 1.0, 12.0) == 2.0
    assert slack_s(10.0, 5, 1.0, 14.5) == 0.0  # (late already: none)
    assert slack_s(10.0, 5, 0.1, 12.0) == 0.0
    assert slack_s(10.0, 1, 1.0, 10.0) == 0.0  # (one token: no gap to stretch)


def test_beyond_the_reserve_a_chat_takes_a_slot_from_a_job_with_slack_until_it_is_spent(
    clock: FakeClock,
) -> None:
    """Two heavy jobs with tokens out, 5 tokens each expected in 1 s: at 1 s a token on average
    (their TPOT objective) they may end 3 s later; at 0.1 s they may not. The first chat takes
    the reserve back from the newer; the second takes the older's slot only where it has that
    slack for the chat's expected second, and once suspended 2.5 s it has no more."""
    ledger = make(clock, 2)
    jobs = [take(clock, ledger, HEAVY) for _ in range(2)]
    for slot in jobs:
        slot.first_token = clock.now
        slot.tpot_s = 1.0
    jobs[0].tpot_s = 0.1
    assert jobs[0].slack_s(clock.now) == 0.0
    assert jobs[1].slack_s(clock.now) == pytest.approx(3.0, abs=2 * STEP)
    first = take(clock, ledger, CHAT)
    assert [slot.suspended for slot in jobs] == [False, True]
    waiting = refused(ask(ledger, CHAT))  # (jobs[0]: no slack)
    assert waiting.promise is not None
    ledger.withdraw(waiting.promise)  # (its client went elsewhere: no chat in line)
    first.release()
    assert not jobs[1].suspended
    jobs[0].tpot_s = 1.0
    second = take(clock, ledger, CHAT)  # (the reserve again, from the newest)
    third = take(clock, ledger, CHAT)  # (beyond it, from the job with slack)
    assert [slot.suspended for slot in jobs] == [True, True]
    clock.now += 2.5
    second.release()
    third.release()
    assert not any(slot.suspended for slot in jobs)
    assert jobs[0].slack_s(clock.now) < 1.0  # (2.5 s of its 3 spent)
    take(clock, ledger, CHAT)
    refused(ask(ledger, CHAT))
    assert [slot.pause.suspensions for slot in jobs if slot.pause] == [1, 3]


@pytest.mark.parametrize(("cap", "lanes", "victim"), VICTIMS)
def test_the_suspended_job_resumes_when_the_chat_ends(
    clock: FakeClock, cap: int, lanes: list[Lane], victim: int
) -> None:
    ledger = make(clock, cap)
    jobs = [take(clock, ledger, lane) for lane in lanes]
    told = listen(jobs[victim])
    chat = ask(ledger, CHAT)
    assert isinstance(chat, Slot)
    clock.now += STEP
    chat.release()
    suspended = jobs[victim]
    assert not suspended.suspended  # at once, at the release
    assert suspended.pause is not None
    assert not suspended.pause.suspended
    assert suspended.pause.suspensions == 1
    assert told == [True, False]
    assert ledger.resumes == Counter({lanes[victim].value: 1})
    assert (ledger.taken, ledger.inflight, ledger.suspended) == (cap, cap, 0)
    assert ledger.lane_inflight[CHAT] == 0
    assert ledger.lane_inflight[lanes[victim]] == lanes.count(lanes[victim])
    assert ledger.resume() == 0  # (nothing left to resume)
    refused(ask(ledger, HEAVY))  # its slot is its own again


def test_a_newer_heavy_job_is_refused_while_a_suspended_one_waits_even_with_a_free_slot(
    clock: FakeClock,
) -> None:
    ledger = make(clock, 4)
    first, second = take(clock, ledger, HEAVY), take(clock, ledger, HEAVY)
    pair = take(clock, ledger, HEAVY, width=2)  # the newest: two slots
    chat = ask(ledger, CHAT)
    assert isinstance(chat, Slot)
    clock.now += STEP
    assert pair.suspended
    assert not first.suspended
    assert not second.suspended
    assert ledger.taken == 3  # one slot free, too few for the pair to resume
    assert ledger.resume() == 0
    for lane in (HEAVY, BACKGROUND):
        refusal = refused(ask(ledger, lane))  # the free slot is not for a newer job
        assert refusal.promise is not None
        ledger.withdraw(refusal.promise)
    assert (ledger.taken, ledger.inflight, ledger.suspended) == (3, 4, 1)
    chat.release()
    assert not pair.suspended  # two slots free: the pair goes on first
    assert ledger.resumes == Counter({HEAVY.value: 1})
    assert (ledger.taken, ledger.inflight) == (4, 3)
    refused(ask(ledger, HEAVY))


def test_suspended_jobs_resume_oldest_first(clock: FakeClock) -> None:
    ledger = make(clock, 4, reserve=2)
    jobs = [take(clock, ledger, HEAVY) for _ in range(4)]
    chats = [ask(ledger, CHAT), ask(ledger, CHAT)]
    assert all(isinstance(chat, Slot) for chat in chats)
    # The newest first: the last, then the one before it.
    assert [slot.suspended for slot in jobs] == [False, False, True, True]
    clock.now += STEP
    jobs[0].release()  # one slot: for the older of the two (suspended second)
    assert [slot.suspended for slot in jobs[1:]] == [False, False, True]
    jobs[1].release()
    assert not jobs[3].suspended
    assert ledger.resumes == Counter({HEAVY.value: 2})
    assert (ledger.taken, ledger.inflight, ledger.suspended) == (4, 4, 0)


def test_a_younger_suspended_job_waits_behind_an_older_one_waiting_for_its_cells(
    clock: FakeClock,
) -> None:
    kv = KvBudget((CacheShape(100, 4), CacheShape(100, 4)))
    ledger = make(clock, 3, kv=kv, reserve=2)
    older = take(clock, ledger, HEAVY, kv=60)  # cache 0
    younger = take(clock, ledger, HEAVY, kv=60)  # cache 1
    first = ask(ledger, CHAT, kv=50)  # a slot; its cells: the younger's, in cache 1
    assert isinstance(first, Slot)
    assert younger.suspended
    second = ask(ledger, CHAT, kv=60)  # a slot; its cells: the older's, in cache 0
    assert isinstance(second, Slot)
    assert older.suspended
    assert (first.kv_cache, second.kv_cache) == (1, 0)
    clock.now += STEP
    first.release()  # cache 1 has room for the younger, cache 0 none for the older
    assert kv.free(1)[0] >= younger.kv_tokens > kv.free(0)[0]
    assert ledger.taken == 1
    assert older.suspended
    assert younger.suspended  # oldest first: it waits
    assert ledger.resume() == 0
    second.release()
    assert not older.suspended
    assert not younger.suspended
    assert ledger.resumes == Counter({HEAVY.value: 2})


def test_a_suspended_jobs_client_leaving_frees_everything(clock: FakeClock) -> None:
    kv = KvBudget((CacheShape(100, 4),))
    ledger = make(clock, 2, kv=kv)
    running = take(clock, ledger, HEAVY, kv=40)
    gone = take(clock, ledger, HEAVY, kv=30)
    told = listen(gone)
    chat = ask(ledger, CHAT, kv=20)
    assert isinstance(chat, Slot)
    assert gone.suspended
    assert ledger.kv_reserved == 60  # (the suspended job's cells given back)
    clock.now += 1.0
    assert gone.release() == pytest.approx(1.0 + STEP)  # while suspended
    assert gone.released
    assert (ledger.taken, ledger.inflight, ledger.suspended) == (2, 2, 0)
    assert ledger.kv_reserved == 60
    assert ledger.lane_inflight[HEAVY] == 1
    chat.release()
    assert ledger.resumes == Counter()  # not resumed: it is gone
    assert told == [True]
    assert (ledger.taken, ledger.inflight, ledger.kv_reserved) == (1, 1, 40)
    running.release()
    assert (ledger.taken, ledger.inflight, ledger.suspended, ledger.kv_reserved) == (0, 0, 0, 0)
    assert kv.free(0) == (100, 4)
    assert ledger.lane_inflight == Counter({CHAT: 0, HEAVY: 0})
    assert gone.release() == 0.0  # (once)


# KV cells ---------------------------------------------------------------------------------


def test_a_suspended_job_gives_its_cells_back_and_takes_them_again_in_its_own_cache(
    clock: FakeClock,
) -> None:
    kv = KvBudget((CacheShape(100, 4), CacheShape(100, 4)))
    ledger = make(clock, 2, kv=kv)
    first = take(clock, ledger, HEAVY, kv=20)  # cache 0 (the first of equals)
    second = take(clock, ledger, HEAVY, kv=50)  # cache 1 (the most free)
    assert (first.kv_cache, second.kv_cache) == (0, 1)
    chat = ask(ledger, CHAT, kv=10)
    assert isinstance(chat, Slot)
    assert second.suspended
    assert chat.kv_cache == 1  # the most free, now the suspended job's cells are
    assert (kv.free(0), kv.free(1)) == ((80, 3), (90, 3))
    assert ledger.kv_reserved == 30
    first.release()  # a slot: the suspended job resumes, in cache 1 (cache 0 has more room)
    assert not second.suspended
    assert second.kv_cache == 1
    assert (kv.free(0), kv.free(1)) == ((100, 4), (40, 2))
    assert ledger.kv_reserved == 60
    assert ledger.resumes == Counter({HEAVY.value: 1})


# (the KV cells of the chat, the jobs it suspends in the order suspended)
KV_VICTIMS = [(20, ["new"]), (45, ["new", "old"]), (75, ["new", "old", "heavy"])]


@pytest.mark.parametrize(("cells", "victims"), KV_VICTIMS)
def test_a_chat_with_a_slot_but_no_room_suspends_jobs_for_its_cells(
    clock: FakeClock, cells: int, victims: list[str]
) -> None:
    kv = KvBudget((CacheShape(100, 8),))
    ledger = make(clock, 4, kv=kv)
    jobs = {
        "old": take(clock, ledger, BACKGROUND, kv=30),
        "heavy": take(clock, ledger, HEAVY, kv=30),
        "new": take(clock, ledger, BACKGROUND, kv=30),
    }
    assert ledger.taken == 3  # a slot free, 10 cells
    chat = ask(ledger, CHAT, kv=cells)
    assert isinstance(chat, Slot)
    assert {name for name, slot in jobs.items() if slot.suspended} == set(victims)
    assert ledger.taken == 4 - len(victims)
    assert ledger.kv_reserved == 30 * (3 - len(victims)) + cells
    assert ledger.suspensions == Counter(jobs[v].demand.lane.value for v in victims)  # type: ignore[union-attr]
    clock.now += STEP
    chat.release()  # all resume
    assert ledger.suspended == 0
    assert ledger.kv_reserved == 90
    assert ledger.taken == 3


def test_a_job_suspended_for_cells_waits_for_them_and_newer_jobs_wait_behind_it(
    clock: FakeClock,
) -> None:
    kv = KvBudget((CacheShape(100, 8),))
    ledger = make(clock, 4, kv=kv)
    take(clock, ledger, BACKGROUND, kv=30)
    take(clock, ledger, HEAVY, kv=30)
    newest = take(clock, ledger, BACKGROUND, kv=30)
    chat = ask(ledger, CHAT, kv=20)
    assert isinstance(chat, Slot)
    assert newest.suspended
    assert (ledger.taken, kv.free(0)[0]) == (3, 20)  # a slot, but not its 30 cells
    assert ledger.resume() == 0
    small = refused(ask(ledger, HEAVY, kv=5))  # it would fit: a newer job, it waits
    assert small.promise is not None
    ledger.withdraw(small.promise)
    chat.release()
    assert not newest.suspended
    assert ledger.resumes == Counter({BACKGROUND.value: 1})


def test_a_chat_refused_for_its_cells_gives_back_what_it_suspended(clock: FakeClock) -> None:
    # (under the capacity of 200 it may ask for, in no cache of 100)
    kv = KvBudget((CacheShape(100, 4), CacheShape(100, 4)))
    ledger = make(clock, 3, kv=kv)
    jobs = [take(clock, ledger, HEAVY, kv=20), take(clock, ledger, BACKGROUND, kv=30)]
    refused(ask(ledger, CHAT, kv=150), NeedCode.KV_PRESSURE)
    assert not any(slot.suspended for slot in jobs)  # each suspended in turn, then resumed
    assert (ledger.taken, ledger.inflight, ledger.suspended, ledger.kv_reserved) == (2, 2, 0, 50)
    assert (kv.free(0), kv.free(1)) == ((80, 3), (70, 3))
    assert ledger.lane_inflight == Counter({HEAVY: 1, BACKGROUND: 1, CHAT: 0})
    assert isinstance(ask(ledger, HEAVY, kv=10), Slot)  # (nothing left suspended to wait for)


@pytest.mark.parametrize(
    ("first", "second", "hint_ms"),
    [
        (20, 70, 900),  # the first end frees too few cells: the second's
        (70, 20, 600),  # the first end frees enough
    ],
)
@pytest.mark.parametrize("preemptible", [True, False])
def test_a_kv_pressure_hint_is_when_enough_cells_free(
    clock: FakeClock, first: int, second: int, hint_ms: int, preemptible: bool
) -> None:
    kv = KvBudget((CacheShape(100, 8),))
    if preemptible:  # (a heavy job: it suspends nothing)
        ledger = make(clock, 4, kv=kv)
        a = ask(ledger, HEAVY, kv=first)
        clock.now += 0.3
        b = ask(ledger, HEAVY, kv=second)
        clock.now += 0.1
        decision = ask(ledger, HEAVY, kv=50)
    else:  # (no lane policy: only the budget's own check)
        ledger = SlotLedger(4, expected_service_s=1.0, clock=clock, kv=kv)
        a = ledger.admit(size=JobSize(first // 2, first - first // 2))
        clock.now += 0.3
        b = ledger.admit(size=JobSize(second // 2, second - second // 2))
        clock.now += 0.1
        decision = ledger.admit(size=JobSize(25, 25))
    assert isinstance(a, Slot)
    assert isinstance(b, Slot)
    # Expected to end in 0.6 s (a) and 0.9 s (b); 10 cells free, 50 wanted.
    assert ledger.hints.next_end(clock.now) == pytest.approx(clock.now + 0.6)
    refusal = refused(decision, NeedCode.KV_PRESSURE)
    assert refusal.retry_hint_ms == hint_ms
    assert ledger.suspended == 0
    assert ledger.taken == 2


# Not preemptible: the reserve kept ------------------------------------------------------------


@pytest.mark.parametrize("cap", [2, 4])
def test_without_preemption_the_reserve_is_kept(clock: FakeClock, cap: int) -> None:
    ledger = make(clock, cap, preemptible=False)
    jobs = [take(clock, ledger, HEAVY) for _ in range(cap - 1)]
    assert all(slot.pause is None for slot in jobs)
    refused(ask(ledger, HEAVY), NeedCode.LANE_FULL)  # the last slot is the reserve's
    chat = ask(ledger, CHAT)
    assert isinstance(chat, Slot)
    refused(ask(ledger, CHAT))
    assert ledger.suspended == 0
    assert ledger.suspensions == Counter()
    assert (ledger.taken, ledger.inflight) == (cap, cap)


@pytest.mark.parametrize("cap", [2, 4])
def test_without_preemption_a_chat_suspends_nothing(clock: FakeClock, cap: int) -> None:
    # The reserve lent after a while without chats: they then find it taken, and wait.
    ledger = make(clock, cap, preemptible=False, reserve_lend_after_s=5.0)
    clock.now += 10.0
    jobs = [take(clock, ledger, HEAVY) for _ in range(cap)]
    assert ledger.taken == cap
    assert all(slot.pause is None for slot in jobs)
    refusal = refused(ask(ledger, CHAT))
    assert refusal.promise is not None
    assert ledger.suspended == 0
    assert ledger.suspensions == Counter()
    assert not any(slot.suspended for slot in jobs)
    assert (ledger.taken, ledger.inflight) == (cap, cap)


# Found by the property below, and fixed.


def test_the_peak_counts_the_slots_a_resumed_job_takes(clock: FakeClock) -> None:
    ledger = make(clock, 4, kv=KvBudget((CacheShape(100, 8),)), reserve=2)
    first = take(clock, ledger, HEAVY, kv=50)
    pair = take(clock, ledger, HEAVY, kv=50, width=2)  # 3 slots: the peak
    take(clock, ledger, CHAT, kv=10)  # a slot, but no room: the pair suspended
    assert pair.suspended
    take(clock, ledger, CHAT, kv=10)  # (3 slots again)
    first.release()  # the pair resumes: 4 slots
    assert not pair.suspended
    assert ledger.taken == 4
    assert ledger.peak_inflight == 4


def test_a_chat_beyond_the_reserve_suspends_nothing_for_its_cells(clock: FakeClock) -> None:
    ledger = make(clock, 4, kv=KvBudget((CacheShape(100, 8),)))
    take(clock, ledger, CHAT, kv=10)  # the reserve's
    heavy = [take(clock, ledger, HEAVY, kv=40) for _ in range(2)]
    refused(ask(ledger, CHAT, kv=30), NeedCode.KV_PRESSURE)  # a slot, but not the reserve's
    assert not any(slot.suspended for slot in heavy)


def test_a_suspended_job_resumes_before_a_heavy_client_due_in_line(clock: FakeClock) -> None:
    """Only interactive clients due keep a slot from a suspended job: a heavy one due would
    wait for it anyway (no newer heavy job starts while a job is suspended)."""
    ledger = make(clock, 2)
    first = take(clock, ledger, BACKGROUND)
    second = take(clock, ledger, BACKGROUND)
    take(clock, ledger, CHAT)
    assert second.suspended
    heavy = refused(ask(ledger, HEAVY))
    clock.now += heavy.retry_hint_ms / 1000
    first.release()
    assert not second.suspended


def test_a_job_refused_for_a_suspended_one_waits_for_its_turn_too(clock: FakeClock) -> None:
    """Told to come back after the suspended job has had its slot back, not at once."""
    ledger = make(clock, 2)
    take(clock, ledger, HEAVY)
    take(clock, ledger, HEAVY)
    take(clock, ledger, CHAT)
    after = refused(ask(ledger, HEAVY)).retry_hint_ms
    # (the same, but for the chat: no job suspended, the first release is the heavy job's)
    clock.now -= 3 * STEP
    none = make(clock, 2)
    take(clock, none, HEAVY)
    take(clock, none, HEAVY)
    clock.now += STEP
    assert after > refused(ask(none, HEAVY)).retry_hint_ms


# The property ---------------------------------------------------------------------------------


def victim_order(slot: Slot) -> tuple[int, float]:
    """The order the ledger suspends jobs in: the lowest lane, then the newest, first."""
    assert slot.demand is not None
    return (-LANES.index(slot.demand.lane), -slot.started)


class Preemption(RuleBasedStateMachine):
    """A preemptible ledger under lanes and a KV budget, driven at random."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.jobs: list[Slot] = []  # admitted, not released (running or suspended)
        self.every: list[Slot] = []  # every job admitted
        self.cache: dict[int, int | None] = {}  # the cache each job's cells were placed in
        self.pausable: dict[int, bool] = {}  # whether its runner could suspend each job
        self.promises: list[tuple[Promise, int]] = []

    @initialize(
        cap=st.integers(1, 4),
        reserve=st.integers(0, 2),
        caches=st.lists(st.tuples(st.integers(20, 120), st.integers(1, 4)), min_size=1, max_size=2),
        heavy_quota=st.sampled_from([None, 1, 2, 3]),
    )
    def setup(
        self, cap: int, reserve: int, caches: list[tuple[int, int]], heavy_quota: int | None
    ) -> None:
        policy = LanePolicy(
            interactive_reserve=min(reserve, cap),
            lanes=lane_table(heavy=LaneSettings(max_cost=12000.0, slots=heavy_quota)),
        )
        self.kv = KvBudget(tuple(CacheShape(cells, seqs) for cells, seqs in caches))
        self.ledger = SlotLedger(
            cap,
            expected_service_s=0.5,
            clock=self.clock,
            policy=policy,
            kv=self.kv,
            preemptible=True,
        )

    # (the jobs by state)

    def running(self) -> list[Slot]:
        return [slot for slot in self.jobs if not slot.suspended]

    def suspended(self) -> list[Slot]:
        return [slot for slot in self.jobs if slot.suspended]

    def times_suspended(self) -> dict[int, int]:
        return {id(s): s.pause.suspensions for s in self.jobs if s.pause is not None}

    def check_resumed_oldest_first(self, before: list[Slot]) -> None:
        """After a release or a resume: none newly suspended, and those resumed older than
        any still suspended."""
        was = {id(s) for s in before}
        assert not any(s.suspended and id(s) not in was for s in self.jobs)
        resumed = [s for s in before if not s.suspended and not s.released]
        left = [s for s in before if s.suspended and not s.released]
        for slot in resumed:
            assert all(slot.started <= other.started for other in left)

    # Rules

    @rule(
        rank=st.integers(1, len(LANES) - 1),
        width=st.integers(1, 2),
        cells=st.integers(1, 60),
        back=st.booleans(),
        pausable=st.booleans(),
    )
    def admit_lower(self, rank: int, width: int, cells: int, back: bool, pausable: bool) -> None:
        """A heavy or background job (they fill the slots a chat then takes back), one its
        runner can suspend or not (a sidecar's request with tools, say)."""
        self.admit(rank, width, cells, back, pausable)

    @rule(
        jobs=st.lists(
            st.tuples(
                st.integers(1, len(LANES) - 1),
                st.integers(1, 2),
                st.integers(1, 40),
                st.sampled_from([True, True, False]),
            ),
            min_size=1,
            max_size=4,
        )
    )
    def fill(self, jobs: list[tuple[int, int, int, bool]]) -> None:
        """Heavy and background jobs one after another (they fill the slots, the reserve's
        included, that chats then take back)."""
        for rank, width, cells, pausable in jobs:
            self.admit(rank, width, cells, False, pausable)
            self.clock.now += 0.001

    @rule(cells=st.integers(1, 60), back=st.booleans())
    def admit_chat(self, cells: int, back: bool) -> None:
        self.admit(0, 1, cells, back)

    @rule(
        rank=st.integers(0, len(LANES) - 1),
        width=st.integers(1, 2),
        cells=st.integers(1, 130),
        back=st.booleans(),
        pausable=st.booleans(),
    )
    def admit(self, rank: int, width: int, cells: int, back: bool, pausable: bool = True) -> None:
        lane, ledger = LANES[rank], self.ledger
        # (a chat of one sequence; no job wider than its lane may ever hold: admission rejects
        # those before the ledger)
        width = 1 if lane == CHAT else min(width, ledger.lanes.most(lane, ledger.cap))
        returning = next((p for p, r in reversed(self.promises) if r == rank and p.queued), None)
        if not back:
            returning = None
        chats_before = ledger.lane_inflight[CHAT]
        counts = self.times_suspended()
        # (what a chat may suspend for a slot: any job below it while the reserve is owed,
        # else the fresh ones, no token generated and never suspended, and those whose TPOT
        # objective leaves them slack for the chat's expected service)
        owed = ledger.policy is not None and chats_before < ledger.policy.interactive_reserve
        spare = ledger.estimates.predict_s(JobSize(cells // 2, cells - cells // 2, 1), CHAT)
        costless = {
            id(s)
            for s in self.running()
            if (not s.begun and s.pause is not None and not s.pause.suspensions)
            or s.slack_s(self.clock.now) >= spare > 0
        }
        eligible = [
            s for s in self.running() if s.pause is not None and (owed or id(s) in costless)
        ]
        decision = ask(ledger, lane, cells, width, returning, pausable=pausable)
        victims = [
            s
            for s in self.jobs
            if s.suspended and s.pause is not None and s.pause.suspensions > counts[id(s)]
        ]
        if isinstance(decision, Slot):
            assert decision.width == width
            assert decision.demand == Demand(lane, cells)
            assert (decision.pause is None) == (lane == CHAT or not pausable)
            if lane != CHAT:
                # Never a newer non-interactive job while one waits suspended (it resumes first),
                # and only a chat suspends.
                assert ledger.suspended == 0
                assert not victims
            elif victims:
                # Owed the reserve (chats_before counts the chats before this one; a chat at
                # the reserve may still suspend for its cells), or every victim fresh; and the
                # victims are the first in the order of those it may suspend: the lowest
                # lanes, the newest.
                policy = ledger.policy
                assert policy is not None
                if chats_before > policy.interactive_reserve or not owed:
                    assert all(id(v) in costless for v in victims)
                later = max(victim_order(v) for v in victims)
                for other in self.running():
                    if other in eligible:
                        assert victim_order(other) >= later
            self.jobs.append(decision)
            self.every.append(decision)
            self.cache[id(decision)] = decision.kv_cache
            self.pausable[id(decision)] = pausable
        else:
            assert decision.retry_hint_ms >= ledger.min_hint_ms
            if lane != CHAT:
                assert not victims  # (only a chat suspends)
            if decision.need_code == NeedCode.SERVER_BUSY and lane == CHAT:
                # Refused a slot: a chat ahead of it is due, or due before it would end (a
                # free slot goes past the line only to a job that ends first), or too little it
                # may suspend (a refusal for a slot changes nothing: the state now is the one
                # it was decided on).
                hold = ledger.estimates.hold()
                now = self.clock.now
                assert (
                    ledger.line.due_ahead(now, decision.promise, 0, hold) > 0
                    or ledger.line.due_by(now - hold, math.inf, decision.promise, 0)
                    or ledger.cap - ledger.taken + sum(s.width for s in eligible) < 1
                )
            if decision.need_code == NeedCode.LANE_FULL and lane != CHAT:
                # The reserve is lent at once to a job that can be suspended: kept from it
                # only while a chat waits in line.
                assert (
                    not pausable or ledger.line.of_rank(0) or ledger.lanes.quota_full(lane, width)
                )
            if decision.promise is not None and decision.promise is not returning:
                self.promises.append((decision.promise, rank))

    @precondition(lambda self: bool(self.jobs))
    @rule(index=st.integers(0, 50), done=st.booleans())
    def release(self, index: int, done: bool) -> None:
        slot = self.jobs[index % len(self.jobs)]
        before = self.suspended()
        self.clock.now += 0.01
        held = slot.release(done=Completed(None, 5, 0.001) if done else None)
        assert held == pytest.approx(self.clock.now - slot.started)
        assert slot.release() == 0.0
        self.jobs.remove(slot)
        self.check_resumed_oldest_first(before)

    @precondition(lambda self: any(s.suspended for s in self.jobs))
    @rule(index=st.integers(0, 50))
    def release_suspended(self, index: int) -> None:
        """A suspended job's client leaves."""
        waiting = self.suspended()
        slot = waiting[index % len(waiting)]
        taken, reserved = self.ledger.taken, self.ledger.kv_reserved
        self.clock.now += 0.01
        slot.release()
        self.jobs.remove(slot)
        # (it held nothing: what changed is what resumed)
        resumed = [s for s in waiting if s is not slot and not s.suspended]
        assert self.ledger.taken == taken + sum(s.width for s in resumed)
        assert self.ledger.kv_reserved == reserved + sum(s.kv_tokens for s in resumed)
        self.check_resumed_oldest_first(waiting)

    @precondition(lambda self: bool(self.running()))
    @rule(index=st.integers(0, 50), tpot_s=st.sampled_from([0.0, 0.01, 1.0, 5.0]))
    def first_token(self, index: int, tpot_s: float) -> None:
        """A running job generates its first token (it is no longer fresh); its TPOT
        objective (0: none) may leave it slack for a chat beyond the reserve."""
        slot = self.running()[index % len(self.running())]
        if slot.first_token is None:
            slot.first_token = self.clock.now
        slot.tpot_s = tpot_s

    @rule(seconds=st.floats(0.0, 3.0))
    def wait(self, seconds: float) -> None:
        self.clock.now += seconds

    @rule()
    def resume(self) -> None:
        before = self.suspended()
        resumed = self.ledger.resume()
        assert resumed == sum(1 for s in before if not s.suspended)
        self.check_resumed_oldest_first(before)

    @precondition(lambda self: bool(self.promises))
    @rule(index=st.integers(0, 50))
    def withdraw(self, index: int) -> None:
        promise, _ = self.promises[index % len(self.promises)]
        self.ledger.withdraw(promise)

    # Invariants

    @invariant()
    def slots_cells_and_counts(self) -> None:
        ledger, kv = self.ledger, self.kv
        running, suspended = self.running(), self.suspended()
        assert ledger.taken == sum(s.width for s in running) <= ledger.cap
        for lane in LANES:
            assert ledger.lane_inflight[lane] == sum(
                s.width for s in running if s.demand is not None and s.demand.lane == lane
            )
        quota = ledger.policy.lanes[HEAVY].slots if ledger.policy is not None else None
        if quota is not None:
            assert ledger.lane_inflight[HEAVY] <= quota
        assert ledger.inflight == len(self.jobs)
        assert ledger.suspended == len(suspended)
        assert sum(s.width for s in suspended) <= ledger.cap
        # Cells: the running jobs' only, each in the cache it was first placed in.
        assert kv.reserved == sum(s.kv_tokens for s in running)
        for i, shape in enumerate(kv.caches):
            mine = [s for s in running if s.kv_cache == i]
            assert kv.free(i) == (
                shape.cells - sum(s.kv_tokens for s in mine),
                shape.sequences - len(mine),
            )
        for slot in self.jobs:
            assert slot.kv_cache == self.cache[id(slot)]
            assert slot.kv_cache is not None  # (every job here reserves cells)
        # Each job's runner is told its state.
        for slot in self.jobs:
            assert slot.demand is not None
            if slot.demand.lane == CHAT or not self.pausable[id(slot)]:
                assert slot.pause is None
                assert not slot.suspended
            else:
                assert slot.pause is not None
                assert slot.pause.suspended == slot.suspended
        # The counters, by lane: every suspension and resume its job was told.
        suspensions: Counter[str] = Counter()
        resumes: Counter[str] = Counter()
        for slot in self.every:
            if slot.pause is not None and slot.demand is not None:
                suspensions[slot.demand.lane.value] += slot.pause.suspensions
                resumes[slot.demand.lane.value] += slot.pause.suspensions - slot.pause.suspended
        assert +ledger.suspensions == +suspensions
        assert +ledger.resumes == +resumes
        # A job its runner cannot suspend is never lent the reserve: a chat could not take
        # that slot back.
        policy = ledger.policy
        assert policy is not None
        held = sum(
            s.width
            for s in running
            if s.demand is not None and s.demand.lane != CHAT and s.pause is None
        )
        assert held <= ledger.cap - min(policy.interactive_reserve, ledger.cap)

    def teardown(self) -> None:
        if not hasattr(self, "ledger"):
            return
        ledger = self.ledger
        # Every promise lapsed, then the running jobs end one by one: every suspended job
        # resumes.
        self.clock.now += 1000.0
        self.resume()  # (the server's periodic call)
        while self.running():
            before = self.suspended()
            slot = self.running()[0]
            slot.release()
            self.jobs.remove(slot)
            self.check_resumed_oldest_first(before)
            self.slots_cells_and_counts()
        assert ledger.suspended == 0, "a suspended job left with nothing running"
        assert not self.jobs
        assert (ledger.taken, ledger.inflight, ledger.suspended, ledger.kv_reserved) == (0, 0, 0, 0)
        assert all(v == 0 for v in ledger.lane_inflight.values())
        for i, shape in enumerate(self.kv.caches):
            assert self.kv.free(i) == (shape.cells, shape.sequences)


Preemption.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPreemption = Preemption.TestCase
