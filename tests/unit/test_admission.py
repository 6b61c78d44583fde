"""The admission decision, without sockets: its order, what a refusal leaves unchanged, and the
ticket's release, on an injected clock; then a property over random decide/release sequences."""

from __future__ import annotations

import hashlib

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from governor.core.admission import (
    Admission,
    Admitted,
    Attempt,
    Budget,
    Pool,
    Rejected,
    Reservation,
    Ticket,
    Yielded,
)
from governor.core.breaker import BreakerSettings, BreakerState, CircuitBreaker
from governor.core.ledger import DRAINING_HINT_MS, SlotLedger
from governor.core.overload import OverloadController, OverloadSettings, State
from governor.core.policy import Lane, LanePolicy
from governor.core.slo import Objectives, SloPolicy
from governor.core.tenants import TenantConfig, Tenants
from governor.runners import Job, StubRunner
from protocol.codes import BOUNDS, Bound, NeedCode
from protocol.spec import SPEC_CONTENT_TYPE, SpecInvalid, parse_spec
from tests.clock import FakeClock

RUNNER = StubRunner(1.0)


def key_sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def make(
    clock: FakeClock,
    *,
    cap: int = 2,
    lanes: bool = False,
    tenants: tuple[TenantConfig, ...] = (),
    overload: bool = False,
    fallback: bool = False,
    preemptible: bool = False,
    runner: StubRunner = RUNNER,
) -> Admission:
    policy = LanePolicy(interactive_reserve=1) if lanes else None

    def pool(name: str, slots: int) -> Pool:
        ledger = SlotLedger(
            slots,
            expected_service_s=1.0,
            clock=clock,
            policy=policy,
            preemptible=preemptible and name == "primary",
        )
        breaker = CircuitBreaker(
            BreakerSettings(window_s=10, min_failures=2, error_rate=0.5, cooldown_s=5), clock
        )
        return Pool(name, runner, ledger, breaker)

    controller = OverloadController(OverloadSettings(min_dwell_s=10), clock) if overload else None
    return Admission(
        pool("primary", cap),
        Tenants(tenants, clock),
        fallback=pool("fallback", 1) if fallback else None,
        overload=controller,
    )


def job(max_new_tokens: int = 16, prompt: str = "hello", **fields: object) -> Job:
    payload = orjson.dumps({"prompt": prompt, "max_new_tokens": max_new_tokens, **fields})
    spec = parse_spec(payload, SPEC_CONTENT_TYPE, max_new_tokens_ceiling=RUNNER.max_new_tokens)
    return RUNNER.prepare("j", spec, payload)


def attempt(admission: Admission, key: str | None = None, **spec: object) -> Attempt:
    tenant = admission.tenants.find(key)
    assert tenant is not None
    return Attempt(tenant, job(**spec))  # type: ignore[arg-type]


def admitted(decision: object) -> Ticket:
    assert isinstance(decision, Admitted), decision
    return decision.ticket


NOISY = TenantConfig(name="noisy", key_sha256=key_sha("k-noisy"), max_inflight=1)


# The order -------------------------------------------------------------------------------


def test_draining_comes_before_a_tenant_at_its_cap(clock: FakeClock) -> None:
    admission = make(clock, tenants=(NOISY,))
    admitted(admission.decide(attempt(admission, "k-noisy")))
    assert admission.decide(attempt(admission, "k-noisy")).need_code == "tenant_busy"  # type: ignore[union-attr]
    admission.ledger.draining = True
    decision = admission.decide(attempt(admission, "k-noisy"))
    assert isinstance(decision, Yielded)
    assert decision.need_code == "draining"
    assert decision.retry_hint_ms == DRAINING_HINT_MS  # (go elsewhere: the same on every door)


def test_draining_comes_before_an_open_breaker_and_a_bad_spec(clock: FakeClock) -> None:
    admission = make(clock)
    breaker = admission.primary.breaker
    for _ in range(3):
        breaker.started()
        breaker.record(True)
    assert breaker.state == BreakerState.OPEN
    assert admission.decide(attempt(admission)).need_code == "breaker_open"  # type: ignore[union-attr]
    admission.ledger.draining = True
    assert admission.decide(attempt(admission)).need_code == "draining"  # type: ignore[union-attr]
    bad = Attempt(attempt(admission).tenant, None, SpecInvalid(NeedCode.SPEC_INVALID, "no prompt"))
    assert admission.decide(bad).need_code == "draining"  # type: ignore[union-attr]
    admission.ledger.draining = False
    rejected = admission.decide(bad)
    assert isinstance(rejected, Rejected)
    assert rejected.error is not None


def test_a_lane_the_tenant_may_not_use_is_rejected_before_any_limit(clock: FakeClock) -> None:
    pinned = TenantConfig(name="pinned", key_sha256=key_sha("k-pinned"), lanes=("interactive",))
    admission = make(clock, lanes=True, tenants=(pinned,))
    decision = admission.decide(attempt(admission, "k-pinned", max_new_tokens=900))
    assert isinstance(decision, Rejected)
    assert decision.need_code == "lane_not_allowed"


# A refusal changes nothing the job would hold --------------------------------------------


def test_a_refused_job_keeps_its_max_new_tokens_and_counts_no_ladder_step(
    clock: FakeClock,
) -> None:
    admission = make(clock, cap=2, lanes=True, overload=True)
    assert admission.overload is not None
    admission.overload.state = State.DEGRADED  # the ladder lowers interactive max_new_tokens
    running = [admitted(admission.decide(attempt(admission))) for _ in range(2)]
    assert running[0].job.spec is not None
    assert running[0].job.spec.max_new_tokens == 16  # under the degraded cap of 128: as asked
    asks_much = attempt(admission, max_new_tokens=200)
    before = dict(admission.ladder)
    decision = admission.decide(asks_much)
    assert isinstance(decision, Yielded)
    assert admission.ladder == before  # refused: no activation counted
    assert asks_much.job is not None
    assert asks_much.job.spec is not None
    assert asks_much.job.spec.max_new_tokens == 200  # and the job as it was
    running[0].release("done")
    ticket = admitted(admission.decide(asks_much))
    assert ticket.job.spec is not None
    assert ticket.job.spec.max_new_tokens == 128
    assert ticket.degraded == ("interactive_max_new_tokens",)
    assert admission.ladder["interactive_max_new_tokens"] == 1


def test_a_refused_job_is_not_charged_to_its_tenants_rate(clock: FakeClock) -> None:
    rated = TenantConfig(
        name="rated", key_sha256=key_sha("k-rated"), requests_per_s=1.0, request_burst=2
    )
    admission = make(clock, cap=1, tenants=(rated,))
    admitted(admission.decide(attempt(admission, "k-rated")))
    tenant = admission.tenants.find("k-rated")
    assert tenant is not None
    level = tenant.requests.level
    for _ in range(5):
        assert isinstance(admission.decide(attempt(admission, "k-rated")), Yielded)
    assert tenant.requests.level == level


def test_a_pause_counts_one_activation_per_job_and_its_hint_is_its_place(clock: FakeClock) -> None:
    admission = make(clock, cap=4, lanes=True, overload=True)
    overload = admission.overload
    assert overload is not None
    # Interactive clients wait in line: four running interactive jobs, two refused (one more
    # than the reserve serves).
    running = [admitted(admission.decide(attempt(admission))) for _ in range(4)]
    for _ in range(2):
        waiting = admission.decide(attempt(admission))
        assert isinstance(waiting, Yielded)
        assert waiting.need_code == "server_busy"
    overload.state = State.INTERACTIVE_ONLY
    heavy = attempt(admission, max_new_tokens=900)
    hints = []
    for _ in range(4):
        decision = admission.decide(heavy)
        assert isinstance(decision, Yielded)
        assert decision.need_code == "lane_paused"
        hints.append(decision.retry_hint_ms)
    assert admission.ladder["interactive_only"] == 1
    # Told when its place in line comes, however often it was paused: no blind doubling.
    assert len(set(hints)) == 1
    del running


def test_a_paused_lane_takes_a_slot_that_would_sit_idle(clock: FakeClock) -> None:
    admission = make(clock, cap=2, lanes=True, overload=True)
    assert admission.overload is not None
    admission.overload.state = State.INTERACTIVE_ONLY
    # Nobody of a higher lane waits: the heavy job runs, within the interactive reserve.
    ticket = admitted(admission.decide(attempt(admission, max_new_tokens=900)))
    assert ticket.lane == Lane.HEAVY
    second = admission.decide(attempt(admission, max_new_tokens=900))
    assert isinstance(second, Yielded)
    assert second.need_code == "lane_full"  # the reserve keeps the last slot for interactive
    assert admission.ladder["interactive_only"] == 0


def test_a_pause_leaves_to_the_reserve_the_chats_it_serves(clock: FakeClock) -> None:
    """A chat waiting for the reserve's slot does not need the heavy slot: a paused heavy job
    takes it rather than leave it idle; a second chat in line would need it."""
    admission = make(clock, cap=2, lanes=True, overload=True)
    assert admission.overload is not None
    chat = admitted(admission.decide(attempt(admission)))
    heavy = admitted(admission.decide(attempt(admission, max_new_tokens=900)))
    waiting = attempt(admission)
    refused = admission.decide(waiting)
    assert isinstance(refused, Yielded)
    assert refused.retry_hint_ms == 1000  # when a running job ends
    admission.overload.state = State.INTERACTIVE_ONLY
    clock.now += 0.5
    heavy.release("done")  # the heavy slot frees early; the waiting chat is told 1 s
    second = admitted(admission.decide(attempt(admission, max_new_tokens=900)))
    assert second.lane == Lane.HEAVY
    clock.now += 0.5
    chat.release("done")  # the reserve frees as the waiting chat comes back, and serves it
    assert admitted(admission.decide(waiting)).lane == Lane.INTERACTIVE
    # Two chats in line, one more than the reserve serves: heavy work is paused.
    for _ in range(2):
        assert isinstance(admission.decide(attempt(admission)), Yielded)
    paused = admission.decide(attempt(admission, max_new_tokens=900))
    assert isinstance(paused, Yielded)
    assert paused.need_code == "lane_paused"


def test_a_paused_client_keeps_its_place_in_line(clock: FakeClock) -> None:
    """Paused, a heavy client is told when its place in line comes (the chat it was paused for
    served), not when the pause can end; a heavy client paused after it is told later, and
    does not take the slot held for it by coming back first."""
    admission = make(clock, cap=2, lanes=True, overload=True)
    overload = admission.overload
    assert overload is not None
    running = [
        admitted(admission.decide(attempt(admission))),
        admitted(admission.decide(attempt(admission, max_new_tokens=900))),
    ]
    chats = [attempt(admission) for _ in range(2)]  # one more than the reserve serves
    for chat in chats:
        assert isinstance(admission.decide(chat), Yielded)
    overload.state = State.INTERACTIVE_ONLY
    first, second = (attempt(admission, max_new_tokens=900) for _ in range(2))
    start, hints = clock.now, []
    for heavy in (first, second):
        paused = admission.decide(heavy)
        assert isinstance(paused, Yielded)
        assert paused.need_code == "lane_paused"
        hints.append(paused.retry_hint_ms)
    # Both slots free in 1 s; the extra chat holds the heavy slot one job (1 s) more.
    assert 2000 <= hints[0] < hints[1]
    clock.now += 1.0
    for ticket in running:
        ticket.release("done")
    running = [admitted(admission.decide(chat)) for chat in chats]
    clock.now = start + hints[0] / 1000
    for ticket in running:
        ticket.release("done")
    # No chat waits now. The second heavy client, back first, finds the slot held for the first.
    early = admission.decide(second)
    assert isinstance(early, Yielded)
    assert early.need_code == "server_busy"
    assert admitted(admission.decide(first)).lane == Lane.HEAVY
    assert admission.ladder["interactive_only"] == 2


# Buffers and the ticket --------------------------------------------------------------------


def test_declared_bytes_bound_the_connection_and_held_bytes_the_server() -> None:
    connection, server = Budget(100), Budget(50)
    promise = Reservation(connection, server, 100)  # declared, not sent: the server holds none
    assert (connection.used, server.used) == (100, 0)
    assert not connection.fits(1)
    assert promise.hold(50)
    assert not promise.hold(51)  # refused, and nothing changed
    assert (promise.held, server.used) == (50, 50)
    assert promise.hold(10)  # holding less always succeeds
    assert server.used == 10
    promise.release()
    promise.release()
    assert (connection.used, server.used) == (0, 0)


def test_a_ticket_gives_everything_back_exactly_once(clock: FakeClock) -> None:
    admission = make(clock, cap=1, tenants=(NOISY,))
    connection, server = Budget(100), Budget(1000)
    reservation = Reservation(connection, server, 80)  # declared: the connection's budget
    assert reservation.hold(60)  # held: the server's
    assert (connection.used, server.used) == (80, 60)
    ticket = admitted(admission.decide(attempt(admission, "k-noisy")))
    ticket.reservation = reservation
    tenant = ticket.tenant
    assert (admission.inflight, tenant.inflight, server.used) == (1, 1, 60)
    clock.now += 2.0
    assert ticket.release("backend_error") == 2.0
    for outcome in ("done", "backend_error", "client_gone"):
        assert ticket.release(outcome) == 0.0
    assert (admission.inflight, tenant.inflight, connection.used, server.used) == (0, 0, 0, 0)
    assert tenant.running == []
    # The breaker heard one failure, not four (two more and it would open: min_failures 2).
    assert admission.primary.breaker._failures == 1


def test_a_failure_teaches_the_service_estimate_nothing(clock: FakeClock) -> None:
    admission = make(clock, cap=1)
    ledger = admission.ledger
    before = ledger.service_s
    ticket = admitted(admission.decide(attempt(admission)))
    clock.now += 30.0
    ticket.release("backend_error")
    assert ledger.service_s == before


# Every sequence --------------------------------------------------------------------------

ACTIONS = st.lists(
    st.one_of(
        st.tuples(
            st.just("decide"),
            st.sampled_from([None, "k-noisy"]),
            st.tuples(st.integers(1, 900), st.integers(1, 4)),  # max_new_tokens, n
        ),
        st.tuples(st.just("release"), st.integers(0, 7), st.sampled_from(["done", "x"])),
        st.tuples(st.just("tick"), st.floats(0.0, 3.0), st.just("")),
        st.tuples(st.just("state"), st.integers(0, 3), st.just("")),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(actions=ACTIONS, lanes=st.booleans())
def test_every_sequence_keeps_the_caps_and_gives_everything_back(
    actions: list[tuple[str, object, object]], lanes: bool
) -> None:
    clock = FakeClock()
    other = TenantConfig(name="other", key_sha256=key_sha("k-other"))
    admission = make(clock, cap=3, lanes=lanes, tenants=(NOISY, other), overload=lanes)
    tickets: list[Ticket] = []
    for kind, a, b in actions:
        if kind == "decide":
            key = a if a is not None else "k-other"
            tenant = admission.tenants.find(key)  # type: ignore[arg-type]
            assert tenant is not None
            assert isinstance(b, tuple)
            max_new, n = b
            decision = admission.decide(Attempt(tenant, job(max_new_tokens=max_new, n=n)))
            if isinstance(decision, Admitted):
                tickets.append(decision.ticket)
            elif isinstance(decision, Rejected):
                if "slots at once" in decision.detail:  # more than it could ever hold
                    assert n > (1 if key == "k-noisy" else 2 if lanes else 3)
            else:
                check_refusal(decision)
                admission.forget(Attempt(tenant, None, promise=getattr(decision, "promise", None)))
        elif kind == "release" and tickets:
            ticket = tickets.pop(int(a) % len(tickets))  # type: ignore[call-overload]
            ticket.release(str(b))
        elif kind == "tick":
            clock.now += float(a)  # type: ignore[arg-type]
        elif kind == "state" and admission.overload is not None:
            admission.overload.state = State(int(a))  # type: ignore[call-overload]
        noisy = admission.tenants.find("k-noisy")
        assert noisy is not None
        # Each sequence holds a slot: the cap bounds them all, the tenant's cap its own.
        ledger = admission.ledger
        assert admission.inflight == len(tickets) <= ledger.cap
        assert ledger.taken == sum(t.slot.width for t in tickets) <= ledger.cap
        assert sum(ledger.lane_inflight.values()) == (ledger.taken if lanes else 0)
        assert noisy.inflight == sum(t.slot.width for t in tickets if t.tenant is noisy) <= 1
    for ticket in tickets:
        ticket.release("done")
    assert admission.inflight == admission.ledger.taken == 0
    assert all(t.inflight == 0 and not t.running for t in admission.tenants.all())
    assert admission.ledger.kv_reserved == 0


# What refused a job, and what its hint is made of --------------------------------------------

# The refusals that wait on a slot (or on a lease of the fleet's): their hints come in parts.
WAIT_ON_A_SLOT = {
    NeedCode.SERVER_BUSY,
    NeedCode.LANE_FULL,
    NeedCode.LANE_PAUSED,
    NeedCode.TENANT_BUSY,
    NeedCode.TENANT_SHARE,
    NeedCode.KV_PRESSURE,
    NeedCode.FLEET_BUSY,
}


def check_refusal(decision: object) -> None:
    """A yield names the bound that refused it (its code's, or for lane_full the reserve's),
    and a hint that waits on a slot comes in parts that add up to it."""
    assert isinstance(decision, Yielded), decision
    code, bound, parts = decision.need_code, decision.what_bound, decision.parts
    assert bound == BOUNDS[code] or (code, bound) == (NeedCode.LANE_FULL, "interactive_reserve")
    if code in WAIT_ON_A_SLOT:
        assert parts is not None, code
        assert parts.ms == decision.retry_hint_ms
        assert min(parts.release_ms, parts.turns_ms, parts.ahead) >= 0
    else:
        assert parts is None, code


def test_a_busy_hint_is_the_running_jobs_end_and_the_turns_of_those_promised_ahead(
    clock: FakeClock,
) -> None:
    admission = make(clock, cap=1)
    admitted(admission.decide(attempt(admission)))  # expected to end in about a second
    first, second = (admission.decide(attempt(admission)) for _ in range(2))
    for refused in (first, second):
        check_refusal(refused)
    assert isinstance(first, Yielded)
    assert isinstance(second, Yielded)
    assert first.parts is not None
    assert second.parts is not None
    assert first.what_bound == second.what_bound == "max_inflight"
    assert (first.parts.turns_ms, first.parts.ahead) == (0, 0)  # next in line: the end only
    assert first.parts.release_ms == first.retry_hint_ms > 0
    # Behind it: the same end, then the first one's turn on that slot.
    assert second.parts.release_ms == first.parts.release_ms
    assert second.parts.ahead == 1
    assert second.parts.turns_ms > 0


def test_a_tenant_at_its_cap_waits_for_its_own_first_end_and_a_drain_for_nothing(
    clock: FakeClock,
) -> None:
    admission = make(clock, cap=4, tenants=(NOISY,))
    admitted(admission.decide(attempt(admission, "k-noisy")))
    busy = admission.decide(attempt(admission, "k-noisy"))
    check_refusal(busy)
    assert isinstance(busy, Yielded)
    assert busy.parts is not None
    assert (busy.what_bound, busy.parts.turns_ms) == ("tenant_max_inflight", 0)
    admission.ledger.draining = True
    draining = admission.decide(attempt(admission, "k-noisy"))
    check_refusal(draining)
    assert isinstance(draining, Yielded)
    assert (draining.what_bound, draining.parts) == ("drain", None)


# Objectives --------------------------------------------------------------------------------


def test_an_admitted_job_carries_its_objectives_to_the_runner(clock: FakeClock) -> None:
    """The lane's objectives, the tenant's over them, the request's over both (an interactive
    job's only tightened); the runner gets the TPOT objective and the interactive gap."""
    strict = TenantConfig(name="strict", key_sha256=key_sha("k-strict"), tpot_slo_ms=40.0)
    admission = make(clock, cap=4, lanes=True, tenants=(strict,))
    admission.slo = SloPolicy(interactive_gap_ms=400.0)
    ticket = admitted(admission.decide(attempt(admission, "k-strict")))
    assert ticket.objectives == Objectives(1000.0, 40.0)
    assert (ticket.job.tpot_ms, ticket.job.gap_ms, ticket.job.priority) == (40.0, 400.0, 0)
    looser = admitted(admission.decide(attempt(admission, "k-strict", tpot_slo_ms=500.0)))
    assert looser.objectives == Objectives(1000.0, 100.0)  # not looser than the lane's
    heavy = admitted(
        admission.decide(attempt(admission, "k-strict", lane="heavy", ttft_slo_ms=60000.0))
    )
    assert heavy.objectives == Objectives(60000.0, 40.0)
    assert (heavy.job.tpot_ms, heavy.job.gap_ms, heavy.job.priority) == (40.0, 0.0, 1)
    # And the share of max_new_tokens jobs use, as the pool has learnt it (1 until a job ends).
    assert heavy.job.ratio == 1.0
    admission.ledger.model.ratio = 0.25
    assert admitted(admission.decide(attempt(admission, "k-strict"))).job.ratio == 0.25


@pytest.mark.parametrize("lanes", [False, True])
def test_n_sequences_cost_n_times_the_output(lanes: bool) -> None:
    """A job's n sequences each may generate max_new_tokens: its tokens, its KV demand and its
    size for the lane policy count them all (the prompt once: they share it)."""
    clock = FakeClock()
    costs = []
    for n in (1, 2):
        admission = make(clock, lanes=lanes)
        decision = admission.decide(attempt(admission, max_new_tokens=40, n=n))
        assert isinstance(decision, Admitted)
        ticket = decision.ticket
        assert ticket.slot.size is not None
        demand = ticket.slot.demand
        kv = demand.kv_tokens if demand is not None else 0
        costs.append((ticket.tokens, ticket.slot.size.max_new_tokens, kv))
        ticket.release("done")
    prompt = costs[0][0] - 40
    assert costs[1][0] == prompt + 2 * 40
    assert costs[1][1] == 2 * costs[0][1]
    if lanes:
        assert costs[1][2] - prompt == 2 * (costs[0][2] - prompt)


def test_n_sequences_hold_n_slots_of_every_cap(clock: FakeClock) -> None:
    """A job of n sequences runs them at once: it holds n slots of the cap (and of its tenant's)
    until it ends, waits while fewer are free, and is refused for good beyond what it could
    ever hold."""
    wide = TenantConfig(name="wide", key_sha256=key_sha("k-wide"), max_inflight=3)
    free = TenantConfig(name="free", key_sha256=key_sha("k-free"))
    admission = make(clock, cap=3, tenants=(NOISY, wide, free))
    ledger = admission.ledger
    pair = admitted(admission.decide(attempt(admission, "k-free", n=2)))
    assert (ledger.inflight, ledger.taken, pair.slot.width) == (1, 2, 1 * 2)
    busy = admission.decide(attempt(admission, "k-free", n=2))  # one slot free: not enough
    assert isinstance(busy, Yielded)
    assert busy.need_code == NeedCode.SERVER_BUSY
    single = admitted(admission.decide(attempt(admission, "k-free")))  # the one free slot
    assert ledger.saturated
    assert ledger.taken == 3
    pair.release("done")
    again = admitted(admission.decide(attempt(admission, "k-free", n=2)))
    assert ledger.taken == 3
    again.release("done")
    single.release("done")
    assert ledger.taken == ledger.inflight == 0
    # More than the cap, or than the tenant's cap: never.
    for key, n, most in (("k-free", 4, 3), ("k-noisy", 2, 1)):
        never = admission.decide(attempt(admission, key, n=n))
        assert isinstance(never, Rejected)
        assert never.need_code == NeedCode.SPEC_INVALID
        assert f"at most {most}" in never.detail
    # Within the tenant's cap of 3: one running job leaves room for 2 sequences, not 3.
    first = admitted(admission.decide(attempt(admission, "k-wide")))
    tenant = admission.decide(attempt(admission, "k-wide", n=3))
    assert isinstance(tenant, Yielded)
    assert tenant.need_code == NeedCode.TENANT_BUSY
    admitted(admission.decide(attempt(admission, "k-wide", n=2))).release("done")
    first.release("done")
    assert all(t.inflight == 0 for t in admission.tenants.all())


def test_a_lower_lanes_sequences_leave_the_interactive_reserve(clock: FakeClock) -> None:
    """Under lanes, a heavy job may never hold the reserve's slot, so its n is bounded by the
    slots below it; an interactive job's n by the cap."""
    admission = make(clock, cap=3, lanes=True)
    heavy = admission.decide(attempt(admission, lane="heavy", n=3))
    assert isinstance(heavy, Rejected)
    assert "at most 2" in heavy.detail
    ticket = admitted(admission.decide(attempt(admission, lane="heavy", n=2)))
    assert admission.ledger.lane_inflight[Lane.HEAVY] == 2
    chat = admitted(admission.decide(attempt(admission)))  # the reserve's slot
    ticket.release("done")
    chat.release("done")
    admitted(admission.decide(attempt(admission, n=3))).release("done")


class PausingStub(StubRunner):
    """A stub that can suspend its generations (as the llama runner can), not an embedding."""

    def pausable(self, job: Job) -> bool:
        return job.spec is not None and job.spec.input is None


def test_a_lent_generation_is_suspended_for_a_chat_but_an_embedding_never_is(
    clock: FakeClock,
) -> None:
    admission = make(clock, cap=3, lanes=True, preemptible=True, runner=PausingStub(1.0))
    rewrite = admitted(admission.decide(attempt(admission, max_new_tokens=900)))
    payload = orjson.dumps({"input": ["x " * 800], "lane": "heavy"})
    spec = parse_spec(payload, SPEC_CONTENT_TYPE, max_new_tokens_ceiling=RUNNER.max_new_tokens)
    tenant = admission.tenants.find(None)
    assert tenant is not None

    def embedding() -> Attempt:
        return Attempt(tenant, RUNNER.prepare("e", spec, payload))

    clock.now += 0.01
    embedded = admitted(admission.decide(embedding()))
    clock.now += 0.01
    lent = admitted(admission.decide(attempt(admission, max_new_tokens=900)))
    assert rewrite.job.pause is not None
    assert lent.job.pause is not None
    assert embedded.job.pause is None  # (its runner could not pause it)
    chat = admitted(admission.decide(attempt(admission)))
    assert lent.slot.suspended  # (the newest it may suspend)
    assert not rewrite.slot.suspended
    assert not embedded.slot.suspended
    assert admission.ledger.taken == 3
    chat.release("done")
    lent.release("done")
    # The reserve is free again: never lent to an embedding (a chat could not take it back).
    refusal = admission.decide(embedding())
    assert isinstance(refusal, Yielded)
    assert refusal.need_code == NeedCode.LANE_FULL
    assert refusal.bound == Bound.INTERACTIVE_RESERVE
