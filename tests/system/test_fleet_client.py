"""The client for several replicas: its policy (pure, a fake clock), then real daemons.

The policy tests drive :class:`clients.fleet.Replicas` with replies made here and a clock
moved by hand; hypothesis checks the ejection and picking invariants over any sequence of
events. The process tests start real ``governor serve`` stubs (port 0, stopped by PID) and
assert where jobs went from what the daemons themselves count, never from timings.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import clients
from clients import (
    NO_RETRY,
    Address,
    Ejection,
    FleetClient,
    GovernorClient,
    NoReplicaAvailable,
    Replicas,
    ReplicaState,
    RetryPolicy,
)
from clients.fleet import Move, resolve, split_addresses, spread
from protocol.codes import ErrorCode, NeedCode, Receipt, Status, Verb
from protocol.frames import Reply
from tests.clock import FakeClock
from tests.conftest import Daemon

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")
DaemonFactory = Callable[..., Daemon]


class InOrder(random.Random):
    """Two "random" choices that are always the first two candidates, in address order: a
    test that needs the job to try a given replica first lists that one first."""

    def sample(
        self, population: Sequence[T], k: int, *, counts: Iterable[int] | None = None
    ) -> list[T]:
        return list(population)[:k]


A, B, C = (Address(f"10.0.0.{i}", 7777) for i in (1, 2, 3))


def reply(
    status: Status = Status.DONE,
    *,
    need_code: str | None = None,
    error_code: str | None = None,
    hint_ms: int | None = None,
    inflight: int | None = None,
    cap: int | None = None,
    health: int | None = None,
    draining: int | None = None,
) -> Reply:
    receipts = [
        (kind, value)
        for kind, value in (
            (Receipt.HEALTH, health),
            (Receipt.INFLIGHT, inflight),
            (Receipt.CAP, cap),
            (Receipt.DRAINING, draining),
        )
        if value is not None
    ]
    verb = Verb.CLARIFY if status in (Status.YIELD, Status.NEED) else Verb.CONFIRM
    return Reply(
        verb,
        "J_1",
        2,
        status,
        need_code=need_code,
        error_code=error_code,
        retry_hint_ms=hint_ms,
        receipts=tuple(receipts),
    )


def busy(hint_ms: int, code: str = NeedCode.SERVER_BUSY) -> Reply:
    return reply(Status.YIELD, need_code=code, hint_ms=hint_ms, health=0)


def ping(*, draining: int = 0, inflight: int = 0, cap: int = 1) -> Reply:
    return reply(Status.OK, inflight=inflight, cap=cap, health=1 - draining, draining=draining)


BACKEND_ERROR = reply(
    Status.ABORT, need_code=NeedCode.BACKEND_ERROR, error_code=ErrorCode.BACKEND_ERROR
)
BREAKER_OPEN = busy(2000, NeedCode.BREAKER_OPEN)


def fleet(*addresses: Address, clock: FakeClock, seed: int = 1, **kwargs: Any) -> Replicas:
    return Replicas(addresses, rng=random.Random(seed), clock=clock, **kwargs)


# Picking ---------------------------------------------------------------------------------


def test_two_choices_prefers_the_less_loaded() -> None:
    clock = FakeClock()
    r = fleet(A, B, C, clock=clock)
    r.observe(A.name, reply(inflight=4, cap=4, health=0))
    r.observe(B.name, reply(inflight=0, cap=4, health=1))
    r.observe(C.name, reply(inflight=2, cap=4, health=1))
    picks = [r.pick() for _ in range(300)]
    assert A not in picks  # the most loaded loses every draw it is in
    assert picks.count(B) > picks.count(C) > 0  # B wins both its draws, C only against A
    two = fleet(A, B, clock=clock)
    two.observe(A.name, reply(inflight=3, cap=4))
    two.observe(B.name, reply(inflight=1, cap=4))
    assert {two.pick() for _ in range(50)} == {B}


def test_jobs_sent_count_as_load_until_the_next_receipt() -> None:
    clock = FakeClock()
    r = fleet(A, B, clock=clock)
    first = r.pick()
    assert first is not None
    r.sent(first.name)
    second = r.pick()  # nothing known of either, but one has a job on its way
    assert second is not None
    assert second != first
    r.sent(second.name)
    r.observe(first.name, reply(inflight=0, cap=2, health=1))  # the receipt replaces the guess
    assert {r.pick() for _ in range(20)} == {first}


def test_a_stale_receipt_counts_as_no_load() -> None:
    clock = FakeClock()
    r = fleet(A, B, clock=clock, load_ttl_s=5.0)
    r.observe(A.name, reply(inflight=4, cap=4))
    r.observe(B.name, reply(inflight=1, cap=4))
    assert {r.pick() for _ in range(20)} == {B}
    clock.now += 6  # A's full house is old news; B's one job too, so they tie
    assert {r.pick() for _ in range(50)} == {A, B}


def test_a_busy_replica_is_picked_only_when_every_one_is() -> None:
    clock = FakeClock()
    r = fleet(A, B, C, clock=clock)
    r.observe(A.name, busy(500))
    r.observe(B.name, reply(inflight=3, cap=4))
    r.observe(C.name, reply(inflight=3, cap=4))
    assert A not in {r.pick() for _ in range(50)}  # less loaded, but its hint has not run out
    r.observe(B.name, busy(300))
    r.observe(C.name, busy(900))
    assert r.pick() == B  # all busy: the one whose hint ends first
    clock.now += 0.6  # A's and B's hints are over
    assert r.pick() in (A, B)
    assert r.state(C.name) == ReplicaState.BUSY
    assert r.state(A.name) == ReplicaState.OK


# After a yield -----------------------------------------------------------------------------


def test_a_yield_moves_at_once_to_a_replica_not_known_busy() -> None:
    clock = FakeClock()
    r = fleet(A, B, clock=clock)
    r.observe(A.name, busy(800))
    assert r.after_yield(A.name) == Move(B, 0.0)
    assert r.after_yield(A.name, exclude={B.name}) is None  # nowhere else: wait out the hint


def test_a_yield_moves_to_a_shorter_hint_and_stays_for_a_longer_one() -> None:
    clock = FakeClock()
    r = fleet(A, B, clock=clock)
    r.observe(B.name, busy(200))
    r.observe(A.name, busy(800))
    move = r.after_yield(A.name)
    assert move is not None
    assert move.address == B
    assert move.delay_s == pytest.approx(0.2)
    r.observe(B.name, busy(1000))
    assert r.after_yield(A.name) is None  # A's own hint is the shortest: sleep it there


def test_a_full_replica_is_no_place_to_move_to_at_once() -> None:
    clock = FakeClock()
    r = fleet(A, B, clock=clock)
    r.observe(B.name, reply(inflight=1, cap=1, health=0))
    r.observe(A.name, busy(800))
    assert r.after_yield(A.name) is None  # B would only answer another yield


def test_fleet_busy_speaks_for_every_replica() -> None:
    clock = FakeClock()
    r = fleet(A, B, C, clock=clock)
    r.observe(A.name, busy(300, "fleet_busy"))
    assert r.after_yield(A.name) is None  # the fleet's cap is full wherever the job goes
    assert {s.state for s in r.status()} == {ReplicaState.BUSY}


def test_a_yield_that_says_the_fleet_is_saturated_speaks_for_every_replica() -> None:
    """A busy yield whose replica says no other has a free slot (the store's view): the job
    waits its hint where it is, instead of being refused by each replica in turn."""
    clock = FakeClock()
    r = fleet(A, B, C, clock=clock)
    saturated = busy(300)
    saturated = Reply(
        saturated.verb,
        saturated.job,
        saturated.seq,
        saturated.status,
        need_code=saturated.need_code,
        retry_hint_ms=saturated.retry_hint_ms,
        receipts=(*saturated.receipts, (Receipt.FLEET_SATURATED, 1)),
    )
    r.observe(A.name, saturated)
    assert r.after_yield(A.name) is None
    assert {s.state for s in r.status()} == {ReplicaState.BUSY}
    plain = fleet(A, B, C, clock=clock)
    plain.observe(A.name, busy(300))  # this replica's slots only: another may have one
    assert plain.after_yield(A.name) is not None


def test_an_unknown_code_is_busy() -> None:
    clock = FakeClock()
    r = fleet(A, B, clock=clock)
    r.observe(A.name, busy(400, "fleet_unavailable"))
    assert r.state(A.name) == ReplicaState.BUSY
    assert r.after_yield(A.name) == Move(B, 0.0)
    assert r.status()[0].failures == 0  # busy, not failing


# Draining --------------------------------------------------------------------------------


def test_a_draining_replica_is_left_until_a_ping_says_it_is_ready() -> None:
    clock = FakeClock()
    r = fleet(A, B, clock=clock, recheck_s=30.0)
    r.observe(A.name, busy(60_000, NeedCode.DRAINING))
    assert r.state(A.name) == ReplicaState.DRAINING
    r.observe(B.name, reply(inflight=5, cap=1, health=0))  # B, even overloaded, over A
    assert {r.pick() for _ in range(20)} == {B}
    assert r.after_yield(B.name) is None  # nor is A a place to move to
    assert r.probes_due() == []
    clock.now += 31
    assert r.probes_due() == [A]
    assert r.probes_due() == []  # asked once per recheck_s
    r.observe(A.name, ping(draining=1))
    assert r.state(A.name) == ReplicaState.DRAINING
    clock.now += 31
    assert r.probes_due() == [A]
    r.observe(A.name, ping(draining=0))
    assert r.state(A.name) == ReplicaState.OK
    assert A in {r.pick() for _ in range(20)}


def test_only_a_ping_brings_a_left_replica_back() -> None:
    clock = FakeClock()
    r = fleet(A, B, clock=clock)
    r.observe(A.name, ping(draining=1))
    r.observe(A.name, reply(inflight=0, cap=1, health=1))  # a job's end carries no draining
    assert r.state(A.name) == ReplicaState.DRAINING
    assert r.probes_due(force=True) == [A]


def test_every_replica_left_picks_none() -> None:
    clock = FakeClock()
    r = fleet(A, B, clock=clock)
    r.leave(A.name)
    r.leave(B.name)
    assert r.pick() is None


# Outlier ejection --------------------------------------------------------------------------


def test_consecutive_failures_eject_and_the_replica_returns_after_the_ejection_time() -> None:
    clock = FakeClock()
    ejection = Ejection(consecutive_failures=3, base_ejection_s=30.0, max_ejection_percent=50)
    r = fleet(A, B, C, clock=clock, ejection=ejection)
    r.observe(A.name, BACKEND_ERROR)
    r.observe(A.name, BREAKER_OPEN)
    r.observe(A.name, reply(Status.DONE, inflight=0, cap=1))  # a success resets the count
    r.observe(A.name, BACKEND_ERROR)
    r.failure(A.name)  # a connection that broke
    assert r.state(A.name) != ReplicaState.EJECTED
    r.observe(A.name, BREAKER_OPEN)
    assert r.state(A.name) == ReplicaState.EJECTED
    assert A not in {r.pick() for _ in range(50)}
    assert r.after_yield(B.name) != Move(A, 0.0)
    clock.now += 29.9
    assert r.state(A.name) == ReplicaState.EJECTED
    clock.now += 0.2
    assert r.state(A.name) != ReplicaState.EJECTED
    assert A in {r.pick() for _ in range(50)}
    for _ in range(3):  # ejected again at once: twice as long
        r.failure(A.name)
    clock.now += 59.9
    assert r.state(A.name) == ReplicaState.EJECTED
    clock.now += 0.2
    assert r.state(A.name) != ReplicaState.EJECTED
    clock.now += 25  # two intervals back without an ejection: the multiplier drops to 0
    for _ in range(3):
        r.failure(A.name)
    clock.now += 30.1
    assert r.state(A.name) != ReplicaState.EJECTED  # 30 s again, not 90


def test_the_ejection_time_is_capped() -> None:
    ejection = Ejection(base_ejection_s=30.0, max_ejection_s=100.0)
    assert [ejection.duration_s(n) for n in (1, 2, 3, 4, 9)] == [30, 60, 90, 100, 100]


def test_busy_yields_and_other_ends_are_no_failures() -> None:
    clock = FakeClock()
    r = fleet(A, B, clock=clock, ejection=Ejection(consecutive_failures=1))
    for other in (
        busy(10),
        busy(10, NeedCode.TENANT_BUSY),
        reply(Status.ABORT, need_code=NeedCode.TTL_EXPIRED, error_code=ErrorCode.TIMEOUT),
        reply(Status.ABORT, need_code=NeedCode.CANCELLED, error_code=ErrorCode.CANCELLED),
        reply(Status.NEED, need_code=NeedCode.SPEC_INVALID, error_code=ErrorCode.BAD_SPEC),
    ):
        r.observe(A.name, other)
    assert r.state(A.name) != ReplicaState.EJECTED
    r.observe(A.name, BACKEND_ERROR)
    assert r.state(A.name) == ReplicaState.EJECTED


def test_max_ejection_keeps_one_replica() -> None:
    clock = FakeClock()
    everything = Ejection(consecutive_failures=1, max_ejection_percent=100)
    r = fleet(A, B, clock=clock, ejection=everything)
    r.failure(A.name)
    r.failure(B.name)
    r.failure(B.name)
    assert r.state(A.name) == ReplicaState.EJECTED
    assert r.state(B.name) != ReplicaState.EJECTED  # the last one is never ejected
    assert {r.pick() for _ in range(20)} == {B}
    # Envoy's 10 %: one replica of three at a time (at least one may always be).
    three = fleet(A, B, C, clock=clock, ejection=Ejection(consecutive_failures=1))
    for address in (A, B, C):
        three.failure(address.name)
    assert [s.state for s in three.status()].count(ReplicaState.EJECTED) == 1
    one = fleet(A, clock=clock, ejection=everything)
    one.failure(A.name)
    assert one.state(A.name) != ReplicaState.EJECTED
    off = fleet(
        A, B, clock=clock, ejection=Ejection(consecutive_failures=1, max_ejection_percent=0)
    )
    off.failure(A.name)
    assert off.state(A.name) != ReplicaState.EJECTED


def test_an_ejected_replica_is_tried_when_nothing_else_is_left() -> None:
    clock = FakeClock()
    r = fleet(A, B, clock=clock, ejection=Ejection(consecutive_failures=1))
    r.failure(A.name)
    r.leave(B.name)  # B drains after A was ejected
    assert r.state(A.name) == ReplicaState.EJECTED
    assert r.pick() == A  # panic: a try on A beats refusing the job here


def test_ejection_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="consecutive_failures"):
        Ejection(consecutive_failures=0)
    with pytest.raises(ValueError, match="max_ejection_percent"):
        Ejection(max_ejection_percent=101)
    assert Ejection().allowed(3) == 1
    assert Ejection().allowed(25) == 2


# Invariants over any sequence of events --------------------------------------------------

EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("fail"), st.integers(0, 4)),
        st.tuples(st.just("abort"), st.integers(0, 4)),
        st.tuples(st.just("done"), st.integers(0, 4)),
        st.tuples(st.just("busy"), st.integers(0, 4), st.integers(1, 60_000)),
        st.tuples(st.just("drain"), st.integers(0, 4)),
        st.tuples(st.just("ready"), st.integers(0, 4)),
        st.tuples(st.just("probe"), st.booleans()),
        st.tuples(st.just("wait"), st.floats(0, 400)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 5),
    events=EVENTS,
    failures=st.integers(1, 4),
    percent=st.sampled_from([0.0, 10.0, 34.0, 50.0, 100.0]),
    seed=st.integers(0, 2**32),
)
def test_ejection_and_picking_invariants(
    n: int, events: list[tuple[Any, ...]], failures: int, percent: float, seed: int
) -> None:
    clock = FakeClock()
    addresses = [Address(f"10.0.0.{i}", 7777) for i in range(n)]
    ejection = Ejection(consecutive_failures=failures, max_ejection_percent=percent)
    r = Replicas(addresses, ejection=ejection, rng=random.Random(seed), clock=clock)
    for event in events:
        kind = event[0]
        if kind == "wait":
            clock.now += event[1]
        elif kind == "probe":
            for address in r.probes_due(force=event[1]):
                assert r.state(address.name) == ReplicaState.DRAINING
        else:
            name = addresses[event[1] % n].name
            if kind == "fail":
                r.failure(name)
            elif kind == "abort":
                r.observe(name, BACKEND_ERROR)
            elif kind == "done":
                r.observe(name, reply(Status.DONE, inflight=0, cap=2, health=1))
            elif kind == "busy":
                r.observe(name, busy(event[2]))
            elif kind == "drain":
                r.observe(name, ping(draining=1))
            else:
                r.observe(name, ping(draining=0))

        status = r.status()
        states = {s.name: s.state for s in status}
        ejected = [s.name for s in status if s.ejected_for_s > 0]
        available = {a for a, s in states.items() if s in (ReplicaState.OK, ReplicaState.BUSY)}
        not_left = {a for a, s in states.items() if s != ReplicaState.DRAINING}
        # At most the allowed share is ejected, and never every replica.
        assert len(ejected) <= ejection.allowed(n)
        assert len(ejected) < n
        # An ejected (or left) replica is never picked while another is eligible.
        picked = r.pick()
        if available:
            assert picked is not None
            assert picked.name in available
        elif not_left:
            assert picked is not None
            assert picked.name in not_left
        else:
            assert picked is None
        # Nor is it a place to move to after a yield.
        for name in available:
            move = r.after_yield(name)
            assert move is None or (move.address.name in available and move.address.name != name)
            assert move is None or move.delay_s >= 0


# Addresses -------------------------------------------------------------------------------


def _info(family: socket.AddressFamily, ip: str) -> tuple[Any, Any, Any, Any, tuple[Any, ...]]:
    return (family, socket.SOCK_STREAM, 6, "", (ip, 7777))


def test_a_name_with_several_addresses_of_one_family_is_several_replicas() -> None:
    v4, v6 = socket.AF_INET, socket.AF_INET6
    infos = [_info(v4, "10.1.0.1"), _info(v4, "10.1.0.2"), _info(v4, "10.1.0.1")]
    assert spread("gov.svc", 7777, infos) == [
        Address("10.1.0.1", 7777, "gov.svc"),
        Address("10.1.0.2", 7777, "gov.svc"),
    ]
    # localhost: one host reachable two ways stays one replica, connected to by name.
    assert spread("localhost", 7777, [_info(v6, "::1"), _info(v4, "127.0.0.1")]) == [
        Address("localhost", 7777)
    ]
    assert spread("x", 1, []) == [Address("x", 1)]
    assert Address("::1", 7777).name == "[::1]:7777"


def test_addresses_split_on_commas_and_are_checked() -> None:
    assert split_addresses("a:1, b:2,,") == ["a:1", "b:2"]
    assert split_addresses(["a:1", "b:2,c:3"]) == ["a:1", "b:2", "c:3"]
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_addresses("a:1,b")
    with pytest.raises(ValueError, match="no address"):
        split_addresses(" , ")


async def test_resolution_uses_the_resolver_given_and_drops_duplicates() -> None:
    async def resolver(host: str, port: int) -> list[Address]:
        if host == "gov.test":
            return [Address("10.2.0.1", port, host), Address("10.2.0.2", port, host)]
        return [Address(host, port)]

    found = await resolve("gov.test:9000,10.2.0.1:9000,other:1", resolver=resolver)
    assert [a.name for a in found] == ["10.2.0.1:9000", "10.2.0.2:9000", "other:1"]
    assert await resolve("127.0.0.1:5") == [Address("127.0.0.1", 5)]


def test_the_package_exports_the_fleet_client() -> None:
    for name in ("FleetClient", "FleetResult", "Ejection", "Replicas", "NoReplicaAvailable"):
        assert name in clients.__all__
        assert getattr(clients, name) is not None


# Real daemons ------------------------------------------------------------------------------

ROUNDS = RetryPolicy(max_attempts=50)


async def executed(address: str) -> tuple[int, int]:
    """(executed_total, inflight) of the daemon at ``address``, from a ping of its own."""
    host, _, port = address.rpartition(":")
    async with await GovernorClient.connect(host, int(port)) as probe:
        answer = await probe.ping()
    total, inflight = answer.receipt(Receipt.EXECUTED_TOTAL), answer.receipt(Receipt.INFLIGHT)
    assert total is not None
    assert inflight is not None
    return total, inflight


async def until_inflight(address: str, n: int) -> None:
    """Poll the daemon (another process: no event to wait on) until ``n`` jobs run there."""
    for _ in range(1500):
        if (await executed(address))[1] >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{address} never ran {n} job(s) at once")


def test_jobs_spread_over_the_replicas_a_name_stands_for(daemon: DaemonFactory) -> None:
    ds = [daemon("--max-inflight", "1", "--stub-ms", "200") for _ in range(3)]

    async def replicas_of(host: str, port: int) -> list[Address]:
        assert (host, port) == ("governors.test", 7777)
        return [Address(d.host, d.port, host) for d in ds]

    async def scenario() -> list[int]:
        async with (
            asyncio.timeout(60),
            await FleetClient.connect("governors.test:7777", resolver=replicas_of) as fleet,
        ):
            assert len(fleet.replicas) == 3
            results = await asyncio.gather(*(fleet.upload(b"job", retry=ROUNDS) for _ in range(9)))
            assert all(r.done for r in results), [r.reply for r in results]
            return [(await executed(d.addr))[0] for d in ds]

    counts = asyncio.run(scenario())
    assert sum(counts) == 9
    assert all(n >= 1 for n in counts), counts  # every replica ran some of them


def test_a_job_refused_by_a_full_replica_runs_on_another_at_once(daemon: DaemonFactory) -> None:
    a, b = (daemon("--max-inflight", "1", "--stub-ms", "1500") for _ in range(2))

    async def scenario() -> None:
        async with asyncio.timeout(60), await GovernorClient.connect(a.host, a.port) as holder:
            held = asyncio.ensure_future(holder.upload(b"holds a's only slot", retry=NO_RETRY))
            await until_inflight(a.addr, 1)
            # InOrder: the job tries a first, where it is refused.
            async with await FleetClient.connect([a.addr, b.addr], rng=InOrder()) as fleet:
                result = await fleet.upload(b"x" * 20_000, chunk_bytes=4096, retry=ROUNDS)
            assert result.done, result.reply
            assert result.tried == (a.addr, b.addr)
            assert [y.need_code for y in result.yields] == [NeedCode.SERVER_BUSY]
            assert result.attempts == 2
            assert result.replica == b.addr
            assert (await held).done
        # a never ran it: it moved instead of waiting for a's slot.
        assert (await executed(a.addr))[0] == 1
        assert (await executed(b.addr))[0] == 1

    asyncio.run(scenario())


def test_attempts_are_bounded_over_every_replica_and_the_result_names_who_answered(
    daemon: DaemonFactory,
) -> None:
    a = daemon("--max-inflight", "1", "--stub-ms", "3000")
    dead = "127.0.0.1:1"  # nothing listens there

    async def scenario() -> None:
        async with asyncio.timeout(60), await GovernorClient.connect(a.host, a.port) as holder:
            held = asyncio.ensure_future(holder.upload(b"holds a's only slot", retry=NO_RETRY))
            await until_inflight(a.addr, 1)
            async with await FleetClient.connect([a.addr, dead], rng=InOrder()) as fleet:
                result = await fleet.upload(b"job", retry=RetryPolicy(max_attempts=2))
                # Refused by a, moved to the other at once, which could not be reached: two
                # attempts in all, and the answer is still a's.
                assert result.tried == (a.addr, dead)
                assert result.attempts == 2
                assert result.status == Status.YIELD
                assert result.replica == a.addr
                assert [s.failures for s in fleet.replicas.status()] == [0, 1]
            held.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await held

    asyncio.run(scenario())


def test_a_killed_replica_is_ejected_and_its_jobs_finish_elsewhere(daemon: DaemonFactory) -> None:
    # The victim's jobs take long enough that the one running there is cut off by the kill.
    victim = daemon("--max-inflight", "1", "--stub-ms", "5000")
    ds = [victim, *(daemon("--max-inflight", "1", "--stub-ms", "300") for _ in range(2))]

    async def scenario() -> None:
        ejection = Ejection(consecutive_failures=1, base_ejection_s=600)
        async with (
            asyncio.timeout(60),
            await FleetClient.connect([d.addr for d in ds], ejection=ejection) as fleet,
        ):
            jobs = [asyncio.ensure_future(fleet.upload(b"job", retry=ROUNDS)) for _ in range(6)]
            await until_inflight(victim.addr, 1)  # one of the fleet's jobs runs there
            victim.proc.kill()
            results = await asyncio.gather(*jobs)
            assert all(r.done for r in results), [r.reply for r in results]
            assert all(r.replica != victim.addr for r in results)
            assert any(victim.addr in r.tried for r in results)  # the one cut off went on
            assert fleet.replicas.state(victim.addr) == ReplicaState.EJECTED
            later = await asyncio.gather(*(fleet.upload(b"job", retry=ROUNDS) for _ in range(4)))
            assert all(r.done and victim.addr not in r.tried for r in later)

    asyncio.run(scenario())


def test_a_failing_replica_is_ejected_and_the_jobs_finish_on_the_others(
    daemon: DaemonFactory,
) -> None:
    failing = daemon("--max-inflight", "2", "--stub-ms", "10", "--stub-fail-rate", "1")
    healthy = [daemon("--max-inflight", "2", "--stub-ms", "50") for _ in range(2)]

    async def scenario() -> None:
        ejection = Ejection(consecutive_failures=3, base_ejection_s=600)
        addrs = [failing.addr, *(d.addr for d in healthy)]
        async with (
            asyncio.timeout(90),
            await FleetClient.connect(addrs, ejection=ejection) as fleet,
        ):
            for _ in range(100):  # the failing replica answers fast, so it is picked often
                result = await fleet.upload(b"job", retry=ROUNDS)
                assert result.done, result.reply  # a job it aborted went on elsewhere
                if fleet.replicas.state(failing.addr) == ReplicaState.EJECTED:
                    break
            assert fleet.replicas.state(failing.addr) == ReplicaState.EJECTED
            after = [await fleet.upload(b"job", retry=ROUNDS) for _ in range(6)]
            assert all(r.done and failing.addr not in r.tried for r in after)

    asyncio.run(scenario())


def test_a_draining_replica_is_left(daemon: DaemonFactory) -> None:
    a = daemon("--max-inflight", "1", "--stub-ms", "3000", "--shutdown-grace", "30")
    b = daemon("--max-inflight", "1", "--stub-ms", "50")

    async def scenario() -> None:
        async with asyncio.timeout(60), await GovernorClient.connect(a.host, a.port) as holder:
            # A job in flight keeps a draining (not gone) while the fleet's jobs come.
            held = asyncio.ensure_future(holder.upload(b"keeps a draining", retry=NO_RETRY))
            await until_inflight(a.addr, 1)
            a.signal(signal.SIGTERM)
            async with await GovernorClient.connect(a.host, a.port) as probe:
                for _ in range(1500):
                    if (await probe.ping()).receipt(Receipt.DRAINING) == 1:
                        break
                    await asyncio.sleep(0.02)
            async with await FleetClient.connect([a.addr, b.addr], rng=InOrder()) as fleet:
                first = await fleet.upload(b"job", retry=ROUNDS)
                assert first.done, first.reply
                assert first.tried == (a.addr, b.addr)
                assert [y.need_code for y in first.yields] == [NeedCode.DRAINING]
                assert fleet.replicas.state(a.addr) == ReplicaState.DRAINING
                second = await fleet.upload(b"job", retry=ROUNDS)
                assert second.tried == (b.addr,)  # a is not picked again
            assert (await held).done  # the drain let a's own job finish

    asyncio.run(scenario())
    code, _ = a.wait()
    assert code == 0


def test_no_replica_reachable_raises() -> None:
    async def scenario() -> None:
        async with await FleetClient.connect(["127.0.0.1:1", "127.0.0.1:2"]) as fleet:
            with pytest.raises(NoReplicaAvailable, match="could be reached"):
                await fleet.upload(b"job", retry=ROUNDS)
            with pytest.raises(NoReplicaAvailable):
                await fleet.open()

    asyncio.run(scenario())


async def test_jobs_waiting_on_a_connection_that_fails_do_not_each_wait_again() -> None:
    """A replica that accepts and then says nothing (a TLS handshake never answered): the
    jobs queued behind the first connection attempt fail with it, not one timeout each."""
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    try:
        async with await FleetClient.connect(
            f"{host}:{port}", timeout=0.5, ssl=clients.client_context()
        ) as fleet:
            results = await asyncio.gather(
                *(fleet.upload(b"job", retry=ROUNDS) for _ in range(5)), return_exceptions=True
            )
        assert all(isinstance(r, NoReplicaAvailable) for r in results), results
        assert len(accepted) == 1
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


# governor-cli and the load test ------------------------------------------------------------


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_governor_cli_takes_several_addresses(daemon: DaemonFactory, tmp_path: Path) -> None:
    a, b = (daemon("--max-inflight", "1", "--stub-ms", "10") for _ in range(2))
    payload = tmp_path / "job.bin"
    payload.write_bytes(b"y" * 10_000)
    pinged = run("-m", "clients", "--addr", a.addr, "--addr", b.addr, "ping")
    assert pinged.returncode == 0, pinged.stderr
    assert len(pinged.stdout.splitlines()) == 2  # one reply per replica
    # A replica that cannot be reached is passed over (and named on stderr by ping).
    dead = "127.0.0.1:1"
    done = run("-m", "clients", "--addr", f"{dead},{a.addr},{b.addr}", "upload", str(payload))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "done"
    partly = run("-m", "clients", "--addr", f"{dead},{a.addr}", "ping")
    assert partly.returncode == 0
    assert dead in partly.stderr
    nothing = run("-m", "clients", "--addr", f"{dead},127.0.0.1:2", "--timeout", "5", "ping")
    assert nothing.returncode == 1


@pytest.mark.slow
def test_loadtest_burst_spreads_over_several_addresses(
    daemon: DaemonFactory, tmp_path: Path
) -> None:
    a, b = (daemon("--max-inflight", "2", "--stub-ms", "200") for _ in range(2))
    out = tmp_path / "out"
    proc = run(
        *("-m", "loadtest", "burst", "--addr", f"{a.addr},{b.addr}", "--clients", "8"),
        *("--retry", "hint", "--max-attempts", "50", "--timeout", "60"),
        *("--no-plots", "--no-progress", "--out", str(out)),
    )
    assert proc.returncode == 0, proc.stderr
    (step,) = json.loads((out / "report.json").read_text())["steps"]
    assert step["all"]["done"] == step["all"]["offered"] == 8
    assert set(step["replicas"]) == {a.addr, b.addr}
    assert sum(step["replicas"].values()) == 8
    assert all(n >= 1 for n in step["replicas"].values()), step["replicas"]
    # The daemons' own counts agree.
    assert sum(asyncio.run(executed(d.addr))[0] for d in (a, b)) == 8
