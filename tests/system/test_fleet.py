"""The fleet: tenant quotas and a fleet-wide cap held in a real Redis, across replicas.

The gate's decisions (the store's breaker, failing open or closed, the local share) are tested
on a fake clock; the store's script against a real Redis, with generated interleavings of
admissions and releases from several replicas; the daemon's fleet step with servers sharing
one Redis, the store stopped, frozen and brought back; and a replica killed with SIGKILL, as a
real process, whose leases must free within ``lease_ttl``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import signal
import socket
import time
from collections.abc import Callable
from typing import Any, ClassVar

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from clients.client import GovernorClient, RetryPolicy, connect
from governor.config import Config, ConfigError
from governor.core.breaker import BreakerState
from governor.core.fleetgate import Answer, FleetGate, FleetSettings, Lease
from governor.fleetstore import RedisStore
from governor.listeners.openai_api import SATURATED_HEADER
from governor.server import Server
from loadtest.support.redisserver import RedisServer
from protocol.codes import ErrorCode, NeedCode, Receipt, Status
from protocol.spec import SPEC_CONTENT_TYPE, JobSpec
from tests.clock import FakeClock
from tests.conftest import Daemon, ServerFactory, receipt, wait_until
from tests.inprocess.door_tcp import cancel, encode, inline_frame
from tests.inprocess.test_invariants import inline


def tenant(name: str = "t", **limits: Any) -> Any:
    from governor.core.tenants import TenantConfig

    return TenantConfig(name=name, key_sha256="0" * 64, **limits)


def placeable(job: str) -> bytes:
    """An inline job whose client goes where a yield's ``elsewhere`` says (FleetClient's)."""
    return encode(inline_frame(job, 1, "hello") | {"fleet_wide": True})


def gate(clock: FakeClock, **settings: Any) -> FleetGate:
    settings.setdefault("replica_id", "r1")
    return FleetGate(FleetSettings(**settings), clock)


# The gate, on a fake clock ------------------------------------------------------------------


def test_the_store_answer_grants_the_lease_or_gives_its_code_and_hint() -> None:
    clock = FakeClock()
    g = gate(clock, max_inflight=4)
    lease = g.lease("t", "interactive")
    assert (
        g.answered(
            lease,
            Answer(True, replicas=3, inflight=1),
            trial=False,
            tenant=tenant(),
            next_end_ms=lambda: 0,
        )
        is None
    )
    assert lease.id in g.leases
    assert g.replicas == 3
    busy = g.answered(
        g.lease("t", "heavy"),
        Answer(False, "fleet_busy", 1234),
        trial=False,
        tenant=tenant(),
        next_end_ms=lambda: 0,
    )
    assert busy is not None
    assert busy.need_code == NeedCode.FLEET_BUSY
    assert busy.retry_hint_ms == 1234
    rate = g.answered(
        g.lease("t", "heavy"),
        Answer(False, "rate_limited", 0),
        trial=False,
        tenant=tenant(),
        next_end_ms=lambda: 0,
    )
    assert rate is not None
    assert rate.need_code == NeedCode.RATE_LIMITED
    assert rate.retry_hint_ms == g.settings.min_hint_ms  # never below the floor
    g.released(lease)
    assert not g.leases


def test_a_store_grant_never_takes_a_replica_over_the_caps_it_holds_on_its_share() -> None:
    """A store slower than ``fleet_timeout`` for one job: another is admitted on the share
    meanwhile; the store's late grant for a third would make this replica alone hold more than
    the fleet's cap (or the tenant's), so it is refused, and its lease is not held."""
    clock = FakeClock()
    g = gate(clock, max_inflight=1)
    assert g.on_share(g.lease("t", "interactive"), tenant(), 10, next_end_ms=lambda: 40) is None
    late = g.lease("t", "interactive")
    busy = g.answered(
        late, Answer(True, inflight=1), trial=False, tenant=tenant(), next_end_ms=lambda: 40
    )
    assert busy is not None
    assert (busy.need_code, busy.retry_hint_ms) == (NeedCode.FLEET_BUSY, 40)
    assert late.id not in g.leases
    assert len(g.leases) == 1
    # The tenant's cap alike, under a fleet cap that has room.
    g = gate(clock, max_inflight=8)
    two = tenant("two", max_inflight=2)
    for _ in range(2):
        assert g.on_share(g.lease("two", "interactive"), two, 1, next_end_ms=lambda: 9) is None
    third = g.answered(
        g.lease("two", "interactive"), Answer(True), trial=False, tenant=two, next_end_ms=lambda: 9
    )
    assert third is not None
    assert third.need_code == NeedCode.TENANT_BUSY
    assert len(g.leases) == 2


def test_store_failures_open_its_breaker_and_a_trial_closes_it() -> None:
    clock = FakeClock()
    g = gate(clock)
    for _ in range(3):
        trial = g.ask()
        assert trial is False
        g.failed(trial=trial)
    assert g.store_state == BreakerState.OPEN
    assert g.ask() is None  # not asked while open
    clock.now += 2.5
    assert g.ask() is True  # the trial
    assert g.ask() is None  # one at a time
    g.reached(trial=True, sooner_ms=500, told=g.told(0), replicas=2)
    assert g.store_state == BreakerState.CLOSED  # type: ignore[comparison-overlap]
    assert g.replicas == 2


def test_a_busy_yield_is_the_fleets_unless_another_replica_would_serve_it_sooner() -> None:
    clock = FakeClock()
    g = gate(clock)
    assert not g.saturated(100)  # the store has said nothing yet
    # The other replica would serve a newcomer in 500 ms; this one, when it told, in 600.
    g.reached(trial=False, sooner_ms=500, told=g.told(600))
    assert g.saturated(500)
    assert not g.saturated(510)
    # A newcomer (its place is at the back): the other was 100 ms ahead, within half a turn.
    assert g.saturated(900, turn_s=0.2)
    assert not g.saturated(900, turn_s=0.19)  # ahead by more: it goes there, ...
    assert g.saturated(900, turn_s=0.19)  # ... and the next newcomer finds it a turn behind
    clock.now += 0.3  # what the store said ages; this line has grown since, the other's too
    assert g.saturated(2000, turn_s=0.19)
    g.reached(trial=False, sooner_ms=0, told=g.told(300))  # a slot free elsewhere
    assert not g.saturated(300, turn_s=0.1)
    g.reached(trial=False, sooner_ms=-1, told=g.told(0))  # no other replica: all the fleet's
    assert g.saturated(10**9)
    for _ in range(3):
        g.failed(trial=False)
    assert g.store_state == BreakerState.OPEN
    assert not g.saturated(0)  # the store's view is not known while it is unreachable


def test_an_answer_to_an_older_write_says_nothing_newer() -> None:
    """Writes go on several connections: an answer may come after a newer write's."""
    clock = FakeClock()
    g = gate(clock)
    older = g.told(0)  # (told before this replica's job took its slot)
    clock.now += 0.01
    g.reached(trial=False, sooner_ms=500, told=g.told(600))
    g.reached(trial=False, sooner_ms=0, told=older)  # come last
    assert g.ready_at == pytest.approx(clock.now + 0.6)
    assert g.saturated(500)


def test_while_the_store_is_unreachable_lanes_fail_open_on_the_share_or_closed() -> None:
    clock = FakeClock()
    g = gate(clock, max_inflight=6, fail_open=frozenset({"interactive"}))
    g.replicas = 3
    for _ in range(3):
        g.failed(trial=False)
    closed = g.on_share(g.lease("t", "heavy"), tenant(), 10, next_end_ms=lambda: 50)
    assert closed is not None
    assert closed.need_code == NeedCode.FLEET_UNAVAILABLE
    assert 1500 <= closed.retry_hint_ms <= 2000  # the breaker's cooldown left
    # Interactive work (and a job with lanes off) runs within 6 / 3 = 2 leases here.
    assert g.on_share(g.lease("t", "interactive"), tenant(), 10, next_end_ms=lambda: 50) is None
    assert g.on_share(g.lease("t", "-"), tenant(), 10, next_end_ms=lambda: 50) is None
    full = g.on_share(g.lease("t", "interactive"), tenant(), 10, next_end_ms=lambda: 70)
    assert full is not None
    assert full.need_code == NeedCode.FLEET_BUSY
    assert full.retry_hint_ms == 70


def test_the_share_divides_a_tenants_limits_by_the_replicas_alive() -> None:
    clock = FakeClock()
    g = gate(clock, fail_open=frozenset({"interactive", "heavy", "background"}))
    g.replicas = 2
    noisy = tenant("noisy", max_inflight=4, requests_per_s=10.0, request_burst=10.0)
    admitted = [
        g.on_share(g.lease("noisy", "heavy"), noisy, 1, next_end_ms=lambda: 9) for _ in range(3)
    ]
    assert admitted[:2] == [None, None]
    assert admitted[2] is not None
    assert admitted[2].need_code == NeedCode.TENANT_BUSY
    # The rate: 10/s with a burst of 10 is 5/s with a burst of 5 on each of two replicas.
    for lease in list(g.leases.values()):
        g.released(lease)
    quick = tenant("quick", requests_per_s=10.0, request_burst=10.0)
    answers = [
        g.on_share(g.lease("quick", "heavy"), quick, 1, next_end_ms=lambda: 9) for _ in range(6)
    ]
    assert answers[:5] == [None] * 5
    refused = answers[5]
    assert refused is not None
    assert refused.need_code == NeedCode.RATE_LIMITED
    assert refused.retry_hint_ms == 200  # one request at 5 per second


def test_a_replica_is_named_to_clients_by_its_listen_address_or_its_host_name() -> None:
    from governor.server import reachable_at

    assert reachable_at("127.0.0.1", 7700) == "127.0.0.1:7700"
    assert reachable_at("::1", 7700) == "[::1]:7700"
    for everywhere in ("0.0.0.0", "::", ""):
        assert reachable_at(everywhere, 7700) == f"{socket.gethostname()}:7700"


def test_fleet_settings_are_checked() -> None:
    both = Config(fleet_fail_open="interactive, heavy").fleet_fail_lanes
    assert both == frozenset({"interactive", "heavy"})
    assert Config(fleet_fail_open="none").fleet_fail_lanes == frozenset()
    for bad in (
        {"fleet_fail_open": "chat"},
        {"redis_url": "http://x"},
        {"fleet_max_inflight": -1},
        {"lease_ttl": 0.0},
        {"fleet_timeout": 10.0, "lease_ttl": 5.0},
    ):
        with pytest.raises(ConfigError):
            Config(**bad)


class SlowStore:
    """A store whose writes wait for the test to let them through, recording what they wrote."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.writing = 0  # writes begun, waiting for the gate
        self.released: list[str] = []
        self.renewals = 0

    async def release(self, leases: list[Lease], **_: object) -> int:
        self.writing += 1
        await self.gate.wait()
        self.released += [lease.id for lease in leases]
        return -1

    async def renew(self, leases: list[Lease], **_: object) -> tuple[int, int]:
        self.renewals += 1
        return 1, 0

    async def close(self) -> None:
        pass


async def test_releases_that_come_while_a_batch_is_written_are_written_next() -> None:
    from governor.fleetstore import Fleet

    store = SlowStore()
    fleet = Fleet(gate(FakeClock(), lease_ttl_s=30.0), store)  # type: ignore[arg-type]
    writer = asyncio.create_task(fleet.run())
    try:
        await wait_until(lambda: store.renewals == 1)
        first, second = fleet.gate.lease("t", "-"), fleet.gate.lease("t", "-")
        fleet.release(first)
        await wait_until(lambda: store.writing == 1)  # the first batch's write, waiting
        fleet.release(second)
        store.gate.set()
        # Not left for the next renewal, ten seconds away.
        await wait_until(lambda: store.released == [first.id, second.id], timeout=2)
    finally:
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)


class ReadyStore(SlowStore):
    """A store that lets writes through at once and records the ready times it was told."""

    def __init__(self) -> None:
        super().__init__()
        self.gate.set()
        self.told: list[int] = []

    def _told(self, fields: dict[str, object]) -> None:
        ready_ms = fields["ready_ms"]
        assert isinstance(ready_ms, int)
        self.told.append(ready_ms)

    async def release(self, leases: list[Lease], **fields: object) -> int:
        self._told(fields)
        return await super().release(leases)

    async def renew(self, leases: list[Lease], **fields: object) -> tuple[int, int]:
        self._told(fields)
        return await super().renew(leases)


async def test_a_busy_yield_tells_the_store_how_soon_this_replica_could_serve() -> None:
    """After a busy yield the store hears this replica's new readiness at once (a heartbeat),
    not at the next renewal, ten seconds away; yields that come while one is due share it."""
    from governor.fleetstore import Fleet

    store = ReadyStore()
    fleet = Fleet(gate(FakeClock(), lease_ttl_s=30.0), store)  # type: ignore[arg-type]
    ready = 0
    fleet.ready_ms = lambda: ready
    writer = asyncio.create_task(fleet.run())
    try:
        await wait_until(lambda: store.renewals == 1)
        assert store.told == [0]
        ready = 700
        fleet.busy(700)
        fleet.busy(700)  # (before the writer ran: the same heartbeat)
        await wait_until(lambda: len(store.told) == 2)
        assert store.told == [0, 700]
        assert store.released == []
        await asyncio.sleep(0.05)
        assert len(store.told) == 2  # no yield since: nothing more to say
    finally:
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)


class FrozenPlaceStore(SlowStore):
    """A store that never answers a placement."""

    def __init__(self) -> None:
        super().__init__()
        self.placing = 0

    async def place(self, hint_ms: int, **fields: Any) -> tuple[int, str]:
        self.placing += 1
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_the_placer_stopped_answers_every_yield_still_waiting() -> None:
    """The placer stopped (its server closing) while the store is asked: that yield and those
    queued behind it are answered with their own verdicts; none is left owed."""
    from governor.fleetstore import Fleet

    store = FrozenPlaceStore()
    fleet = Fleet(gate(FakeClock(), timeout_s=60.0), store)  # type: ignore[arg-type]
    fleet.gate.elsewhere_at = 0.0  # (another replica is alive, as the store last said)
    told: list[str | None] = []
    assert fleet.placements.ask(300, told.append)
    assert fleet.placements.ask(600, told.append)
    placer = asyncio.create_task(fleet.placements.run())
    await wait_until(lambda: store.placing == 1)
    assert fleet.placements.waiting == 2
    placer.cancel()
    await asyncio.gather(placer, return_exceptions=True)
    assert told == [None, None]
    assert fleet.placements.waiting == 0


class CancelHidingStore(SlowStore):
    """A store whose renewal, once begun, finishes and answers even if its task is cancelled
    meanwhile, as redis-py may."""

    def __init__(self) -> None:
        super().__init__()
        self.renewing = asyncio.Event()

    async def renew(self, leases: list[Lease], **_: object) -> tuple[int, int]:
        self.renewals += 1
        self.renewing.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self.gate.wait()
        return 1, 0


async def test_a_cancel_the_store_hides_still_stops_the_writer_at_once() -> None:
    """The writer cancelled (the server closing) while redis-py finishes a renewal and hides the
    cancel: it stops then, not when its wait for the next renewal runs out."""
    from governor.fleetstore import Fleet

    store = CancelHidingStore()
    fleet = Fleet(gate(FakeClock(), lease_ttl_s=30.0), store)  # type: ignore[arg-type]
    writer = asyncio.create_task(fleet.run())
    await store.renewing.wait()
    writer.cancel()
    done, _ = await asyncio.wait([writer], timeout=5)  # (the next renewal: 10 s away)
    assert done == {writer}
    assert writer.cancelled()
    assert store.renewals == 1


# The store's script, against a real Redis ----------------------------------------------------


async def test_the_store_holds_a_tenants_bucket_over_replicas(redis_server: RedisServer) -> None:
    """Two replicas, one tenant of 5 requests a second with a burst of 5: five in all pass,
    whichever replica asks, and the sixth is told when the bucket has one again."""
    stores = [RedisStore(redis_server.url) for _ in range(2)]
    noisy = tenant("noisy", requests_per_s=5.0, request_burst=5.0)
    g = gate(FakeClock())
    try:
        answers = []
        started = time.monotonic()
        for i in range(6):
            ask = g.question(g.lease("noisy", "heavy"), noisy, 1, 1.0)
            answers.append(await stores[i % 2].acquire(ask, ttl_ms=10_000, cap=0, replica="r"))
        took_ms = (time.monotonic() - started) * 1000
        assert [a.allowed for a in answers] == [True] * 5 + [False]
        assert answers[5].code == "rate_limited"
        # A token every 200 ms, from the first ask (however slow the machine made the six).
        assert 200 - took_ms - 1 <= answers[5].wait_ms <= 200
    finally:
        for store in stores:
            await store.close()


async def test_an_unrenewed_lease_expires_and_a_renewed_one_lives(
    redis_server: RedisServer,
) -> None:
    store = RedisStore(redis_server.url)
    g = gate(FakeClock())
    t = tenant()
    try:
        kept, dropped = g.lease("t", "-"), g.lease("t", "-")
        for lease in (kept, dropped):
            answer = await store.acquire(
                g.question(lease, t, 1, 5.0), ttl_ms=400, cap=2, replica="r"
            )
            assert answer.allowed
        refused = await store.acquire(
            g.question(g.lease("t", "-"), t, 1, 5.0), ttl_ms=400, cap=2, replica="r"
        )
        assert not refused.allowed
        assert refused.code == "fleet_busy"
        assert 4000 <= refused.wait_ms <= 5000  # the first expected end
        deadline = time.monotonic() + 1.2
        while time.monotonic() < deadline:
            await store.renew([kept], ttl_ms=400, replica="r")
            await asyncio.sleep(0.1)
        assert await store.inflight() == 1  # the renewed one
        again = await store.acquire(
            g.question(g.lease("t", "-"), t, 1, 5.0), ttl_ms=400, cap=2, replica="r"
        )
        assert again.allowed
    finally:
        await store.close()


async def test_each_replica_hears_how_soon_the_others_could_serve_a_newcomer(
    redis_server: RedisServer,
) -> None:
    """Every write tells the store when its replica could serve a newcomer; the answer is the
    soonest of the others alive (-1: none). A replica that stops, or whose heartbeat lapses,
    is no longer counted. (Releases and heartbeats tell it; admissions and renewals also keep
    the replica alive.)"""
    store = RedisStore(redis_server.url, name="ready")
    g = gate(FakeClock())
    try:
        assert await store.renew([], ttl_ms=10_000, replica="a", ready_ms=900) == (1, -1)
        replicas, sooner = await store.renew([], ttl_ms=400, replica="b", ready_ms=300)
        assert replicas == 2
        assert sooner in range(850, 901)
        assert await store.release([], replica="a", ready_ms=900) in range(250, 301)
        answer = await store.acquire(
            g.question(g.lease("t", "-"), tenant(), 1, 5.0),
            ttl_ms=10_000,
            cap=0,
            replica="c",
            ready_ms=0,
        )
        assert answer.allowed
        assert answer.sooner_ms in range(250, 301)
        assert await store.release([], replica="a", ready_ms=900) == 0  # c has a free slot
        assert await store.release([], replica="c", ready_ms=-1) in range(250, 301)  # c stops
        assert await store.release([], replica="a", ready_ms=900) in range(250, 301)
        await asyncio.sleep(0.5)  # b's heartbeat lapses (ttl 400 ms)
        assert await store.release([], replica="a", ready_ms=900) == -1
    finally:
        await store.close()


async def test_a_replicas_write_overtaken_by_a_newer_one_does_not_say_its_ready_time(
    redis_server: RedisServer,
) -> None:
    """A replica's writes go over several connections and can arrive out of order: one
    numbered before the last written (its ``seq``) keeps the replica alive but does not write
    how soon it could serve, in any of the four scripts (a renewal reckoned before an admission
    that took the last slot, arriving after it, said "free now")."""
    store = RedisStore(redis_server.url, name="overtaken")
    g = gate(FakeClock())

    async def sooner_seen_by_a() -> int:
        return await store.release([], replica="a", ready_ms=0)

    try:
        await store.renew([], ttl_ms=10_000, replica="a", ready_ms=0, address="a:1")
        await store.renew([], ttl_ms=10_000, replica="b", ready_ms=5000, seq=5, address="b:2")
        assert await sooner_seen_by_a() in range(4900, 5001)
        await store.release([], replica="b", ready_ms=0, seq=4)
        await store.renew([], ttl_ms=10_000, replica="b", ready_ms=0, seq=3, address="b:2")
        await store.acquire(
            g.question(g.lease("t", "-"), tenant(), 1, 5.0),
            ttl_ms=10_000,
            cap=0,
            replica="b",
            ready_ms=0,
            seq=2,
        )
        await store.place(9000, replica="b", ready_ms=0, turn_ms=300, slack_ms=150, seq=1)
        assert await sooner_seen_by_a() in range(4800, 5001)  # (still the fifth's word)
        await store.release([], replica="b", ready_ms=0, seq=6)
        assert await sooner_seen_by_a() == 0
    finally:
        await store.close()


async def test_the_store_sends_each_refused_job_to_the_replica_that_would_serve_it_first(
    redis_server: RedisServer,
) -> None:
    """Each busy yield's job goes to the replica alive that would serve it first, by its slack
    (half a turn) sooner than the hint here, whose line is then a turn longer; else it is the
    fleet's (''). Jobs sent one after the other are spread as a list scheduler spreads them. A
    replica whose address is not known is never named; a dead one's is forgotten."""
    store = RedisStore(redis_server.url, name="place")
    try:
        for replica, ready, address in (("a", 1000, "a:1"), ("b", 200, "b:2"), ("c", 650, "c:3")):
            await store.renew([], ttl_ms=10_000, replica=replica, ready_ms=ready, address=address)
        await store.renew([], ttl_ms=400, replica="d", ready_ms=0)  # (no address: never named)

        async def place(hint_ms: int) -> str:
            return (
                await store.place(hint_ms, replica="a", ready_ms=1000, turn_ms=300, slack_ms=150)
            )[1]

        # b (200 ms), b (500), c (650), b (800), c (950): each time the soonest, then a turn on.
        assert [await place(1200) for _ in range(5)] == ["b:2", "b:2", "c:3", "b:2", "c:3"]
        assert await place(1200) == ""  # b at 1100 ms: not half a turn sooner than 1200
        assert await place(500) == ""  # a returning client's place here comes first
        await asyncio.sleep(0.5)  # d's heartbeat lapses: its entries go
        _, elsewhere = await store.place(
            5000, replica="a", ready_ms=1000, turn_ms=300, slack_ms=150
        )
        assert elsewhere in {"b:2", "c:3"}
        assert await store.redis.hget(store.ready_key, "d") is None
    finally:
        await store.close()


async def test_clients_the_full_fleet_refuses_are_spread_over_its_coming_ends(
    redis_server: RedisServer,
) -> None:
    """Two leases end in about 1 s and 2 s: the first client refused is told 1 s, the second
    2 s, the third a turn of its own job (500 ms) after the first end, and so on, instead of
    all coming back at the first end."""
    store = RedisStore(redis_server.url)
    g = gate(FakeClock())
    t = tenant()
    try:
        for expected in (1.0, 2.0):
            ask = g.question(g.lease("t", "-"), t, 1, expected)
            assert (await store.acquire(ask, ttl_ms=10_000, cap=2, replica="r")).allowed
        hints = []
        for _ in range(4):
            ask = g.question(g.lease("t", "-"), t, 1, 0.5)
            answer = await store.acquire(ask, ttl_ms=10_000, cap=2, replica="r")
            assert answer.code == "fleet_busy"
            hints.append(answer.wait_ms)
        for hint, want in zip(hints, (1000, 2000, 1500, 2500), strict=True):
            assert want - 200 <= hint <= want, hints
    finally:
        await store.close()


class StoreRace(RuleBasedStateMachine):
    """Replicas admit and release jobs of two tenants in any order: the store's count of leases
    is never above the fleet's cap or a tenant's, and it admits exactly when a model says
    there is room (the script is atomic: there is no interleaving inside one step)."""

    CAP = 5
    TENANT_CAPS: ClassVar[dict[str, int]] = {"a": 3, "b": 0}

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.stores: list[RedisStore] = []
        self.held: dict[str, Lease] = {}
        self.gate = gate(FakeClock())

    @initialize()
    def connect(self) -> None:
        self.stores = [RedisStore(REDIS_URL[0]) for _ in range(3)]
        self.loop.run_until_complete(self.stores[0].redis.flushall())

    def by_tenant(self, name: str) -> int:
        return sum(1 for lease in self.held.values() if lease.tenant == name)

    @rule(replica=st.integers(0, 2), name=st.sampled_from(["a", "b"]))
    def admit(self, replica: int, name: str) -> None:
        lease = self.gate.lease(name, "-")
        cap = self.TENANT_CAPS[name]
        ask = self.gate.question(lease, tenant(name, max_inflight=cap), 1, 1.0)
        answer = self.loop.run_until_complete(
            self.stores[replica].acquire(ask, ttl_ms=60_000, cap=self.CAP, replica=str(replica))
        )
        fleet_room = len(self.held) < self.CAP
        tenant_room = not cap or self.by_tenant(name) < cap
        assert answer.allowed == (fleet_room and tenant_room), answer
        if answer.allowed:
            self.held[lease.id] = lease
        else:
            assert answer.code == ("fleet_busy" if not fleet_room else "tenant_busy")

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data(), replica=st.integers(0, 2))
    def release(self, data: st.DataObject, replica: int) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, unique=True))
        leases = [self.held.pop(i) for i in ids]
        self.loop.run_until_complete(
            self.stores[replica].release(leases, replica=f"r{replica}", ready_ms=0)
        )

    @invariant()
    def counted(self) -> None:
        if self.stores:
            assert self.loop.run_until_complete(self.stores[0].inflight()) == len(self.held)

    def teardown(self) -> None:
        for store in self.stores:
            self.loop.run_until_complete(store.close())
        self.loop.close()


REDIS_URL: list[str] = []


def test_the_store_never_admits_past_a_cap_in_any_interleaving(
    redis_server: RedisServer,
) -> None:
    REDIS_URL[:] = [redis_server.url]
    StoreRace.TestCase.settings = settings(
        max_examples=40,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    StoreRace.TestCase().runTest()


async def leases_until(store: RedisStore, holds: Callable[[int], bool], timeout: float) -> None:
    """Poll the store's count of live leases until ``holds(count)``."""
    deadline = time.monotonic() + timeout
    while True:
        if holds(await store.inflight()):
            return
        if time.monotonic() > deadline:
            raise AssertionError("the store's leases did not get there in time")
        await asyncio.sleep(0.02)


# The daemon's fleet step: servers sharing one Redis -----------------------------------------


def job(prompt: str = "hello", lane: str | None = None) -> bytes:
    return orjson.dumps(JobSpec(prompt=prompt, max_new_tokens=8, lane=lane).to_wire())


def reached_at(server: Server) -> str:
    host, port = server.address
    return f"{host}:{port}"


async def run_job(
    server: Server, name: str, payload: bytes, attempts: int = 1, *, fleet_wide: bool = False
) -> Any:
    host, port = server.address
    async with await connect(f"{host}:{port}") as client:
        return await client.upload(
            payload,
            job=name,
            content_type=SPEC_CONTENT_TYPE if payload.startswith(b"{") else "text/plain",
            retry=RetryPolicy(max_attempts=attempts),
            fleet_wide=fleet_wide,
        )


async def fleet_of(make_server: ServerFactory, url: str, n: int, **config: Any) -> list[Server]:
    """``n`` replicas on one store. Their store deadline is a second (a third of a shorter
    lease_ttl), not the 50 ms default: on a loaded machine a Redis round trip can take longer,
    and a test of the fleet's limits must not turn into one of its fail-open."""
    config.setdefault("stub_ms", 300)
    config.setdefault("max_inflight", 2)
    config.setdefault("fleet_timeout", min(1.0, config.get("lease_ttl", 10.0) / 3))
    return [await make_server(redis_url=url, **config) for _ in range(n)]


async def test_the_fleet_cap_holds_over_replicas_and_frees_when_jobs_end(
    make_server: ServerFactory, redis_server: RedisServer
) -> None:
    # lease_ttl 30: a renewal every 10 s, so a release left for the next one would show.
    servers = await fleet_of(make_server, redis_server.url, 2, fleet_max_inflight=3, lease_ttl=30.0)
    results = await asyncio.gather(
        *(run_job(servers[i % 2], f"J{i}", b"payload") for i in range(4))
    )
    codes = collections.Counter(r.reply.need_code or r.reply.status for r in results)
    assert codes == {Status.DONE: 3, NeedCode.FLEET_BUSY: 1}
    refused = next(r for r in results if r.reply.status == Status.YIELD)
    assert refused.reply.retry_hint_ms >= 5
    # It names the fleet's cap, and waits for the fleet's next lease end: all release.
    assert refused.reply.receipt("bound.fleet_max_inflight") == 1
    assert refused.reply.receipt("hint.release_ms") == refused.reply.retry_hint_ms
    # The refused job was admitted here and given back: nothing executed, nothing leaked.
    assert sum(s.ledger.executed_total for s in servers) == 3
    store = RedisStore(redis_server.url)
    try:
        await wait_until(lambda: all(not s.fleet.gate.leases for s in servers if s.fleet))
        # Written as they come: those released while a batch was written too.
        await leases_until(store, lambda n: n == 0, 3)
    finally:
        await store.close()
    assert all(s.inflight == 0 and s.live_jobs == 0 for s in servers)
    assert all(s.tenants.all()[0].inflight == 0 for s in servers)


async def test_a_replica_that_stops_leaves_the_fleet_at_once(
    make_server: ServerFactory, redis_server: RedisServer
) -> None:
    """A clean stop takes the replica out of the store's count at once, whether it held a
    lease or not: the other's next write hears it is alone (its share of the fleet's limits
    whole again, no other replica to send a client to), not a lease_ttl later."""
    first, second = await fleet_of(make_server, redis_server.url, 2, lease_ttl=30.0)
    assert first.fleet is not None
    store = RedisStore(redis_server.url)
    try:
        await run_job(first, "J1", b"payload")  # (each admission writes its heartbeat)
        await run_job(second, "J2", b"payload")
        assert await store.redis.zcard(store.replicas_key) == 2
        await second.close()
        assert await store.redis.zcard(store.replicas_key) == 1
        replica = first.fleet.gate.settings.replica_id
        assert await store.release([], replica=replica, ready_ms=0) == -1  # no other
    finally:
        await store.close()


async def test_a_job_longer_than_the_lease_ttl_keeps_its_lease(
    make_server: ServerFactory, redis_server: RedisServer
) -> None:
    """A 2.5 s job under a 0.6 s lease_ttl: its replica renews the lease every 0.2 s, so the
    store counts it the whole time, and a second job is refused by the fleet meanwhile."""
    servers = await fleet_of(
        make_server, redis_server.url, 2, fleet_max_inflight=1, lease_ttl=0.6, stub_ms=2500
    )
    long_job = asyncio.create_task(run_job(servers[0], "long", b"x"))
    store = RedisStore(redis_server.url)
    try:
        await leases_until(store, lambda n: n == 1, 5)
        seen = set()
        for _ in range(8):  # 1.6 s: well past the lease's own time to live
            seen.add(await store.inflight())
            await asyncio.sleep(0.2)
        assert seen == {1}
        refused = await run_job(servers[1], "other", b"x")
        assert refused.reply.need_code == NeedCode.FLEET_BUSY
        assert (await long_job).done
    finally:
        await store.close()


async def test_a_job_the_fleet_refused_keeps_its_payload_and_its_retry_runs(
    make_server: ServerFactory, redis_server: RedisServer
) -> None:
    servers = await fleet_of(make_server, redis_server.url, 2, fleet_max_inflight=1)
    results = await asyncio.gather(
        *(run_job(servers[i % 2], f"J{i}", b"x" * 100_000, attempts=40) for i in range(4))
    )
    assert all(r.done for r in results)
    assert any(y.need_code == NeedCode.FLEET_BUSY for r in results for y in r.yields)
    assert sum(s.ledger.executed_total for s in servers) == 4
    assert all(s.buffered_bytes == 0 for s in servers)


async def test_an_http_request_the_fleet_refused_keeps_its_place_and_counts_once(
    make_server: ServerFactory, redis_server: RedisServer
) -> None:
    """The fleet's one lease held on one replica: the same request sent three times to the
    other is one unserved job there (its place kept for every retry, as a TCP job is), and
    its retry runs once the lease is free, none given up."""
    servers = await fleet_of(
        make_server,
        redis_server.url,
        2,
        fleet_max_inflight=1,
        stub_ms=1500,
        http_listen="127.0.0.1:0",
        max_wait=0,
    )
    holder = asyncio.create_task(run_job(servers[0], "hold", b"x"))
    gate = servers[0].fleet.gate if servers[0].fleet is not None else None
    await wait_until(lambda: gate is not None and len(gate.leases) == 1)  # (the store has it)
    address = servers[1].http_address
    assert address is not None
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with httpx.AsyncClient(base_url=f"http://{address[0]}:{address[1]}") as http:
        for _ in range(3):
            refused = await http.post("/v1/chat/completions", json=body)
            assert refused.json()["error"]["code"] == NeedCode.FLEET_BUSY
        assert (await holder).done
        for _ in range(40):  # back on its hint (at most 0.25 s) until the lease is free
            answer = await http.post("/v1/chat/completions", json=body)
            if answer.status_code != 429:
                break
            await asyncio.sleep(min(int(answer.headers["retry-after-ms"]), 250) / 1000)
        assert answer.status_code == 200
    assert servers[1].admission.unserved.totals()[::2] == (1, 0)


async def test_a_client_gone_while_the_fleet_answers_leaves_nothing_held(
    make_server: ServerFactory, redis_server: RedisServer
) -> None:
    """Clients that send a job and close at once, while the fleet's one lease is taken: the
    store's refusal comes back after the connection is gone, and must not hold the payload
    for a retry that cannot come (found by the interleavings state machine)."""
    (server,) = await fleet_of(
        make_server, redis_server.url, 1, fleet_max_inflight=1, stub_ms=30_000
    )
    host, port = server.address
    holder = asyncio.create_task(run_job(server, "hold", b"x" * 5))
    await wait_until(lambda: server.fleet is not None and len(server.fleet.gate.leases) == 1)
    for i in range(40):
        _, writer = await asyncio.open_connection(host, port)
        writer.write(inline(f"J{i}", 1, data="hello"))
        writer.close()
        await asyncio.sleep(0.005)
    await wait_until(lambda: len(server.connections) == 1)  # the holder's
    await asyncio.sleep(0.1)
    assert server.buffered_bytes == 5  # the running job's, nothing of the gone clients'
    assert server.inflight == server.live_jobs == 1
    holder.cancel()
    await asyncio.gather(holder, return_exceptions=True)


async def test_the_fleet_holds_a_tenants_quota_over_replicas(
    make_server: ServerFactory, redis_server: RedisServer
) -> None:
    import hashlib

    keys = {"noisy": "noisy-key", "quiet": "quiet-key"}
    tenants = [
        {"name": n, "key_sha256": hashlib.sha256(k.encode()).hexdigest(), "max_inflight": 2}
        for n, k in keys.items()
    ]
    # A store deadline of a second: a replica that found the store slow would decide on its
    # share, and a test of the store's quota would become one of the share's.
    servers = [
        await make_server(
            redis_url=redis_server.url,
            stub_ms=1000,
            max_inflight=4,
            fleet_timeout=1.0,
            tenants=tuple(Config.from_mapping({"tenants": tenants}).tenants),
        )
        for _ in range(3)
    ]

    async def connect(server: Server, name: str) -> GovernorClient:
        host, port = server.address
        return await GovernorClient.connect(host, port, api_key=keys[name])

    async def as_tenant(server: Server, name: str, i: int) -> Any:
        async with await connect(server, name) as client:
            return await client.upload(b"x", job=f"{name}{i}", retry=RetryPolicy(max_attempts=1))

    # Connected first, so that the six jobs overlap (each runs a second) however slowly a
    # loaded machine opens connections.
    clients = await asyncio.gather(*(connect(servers[i % 3], "noisy") for i in range(6)))
    try:
        noisy = await asyncio.gather(
            *(
                c.upload(b"x", job=f"noisy{i}", retry=RetryPolicy(max_attempts=1))
                for i, c in enumerate(clients)
            )
        )
    finally:
        for c in clients:
            await c.close()
    done = [r for r in noisy if r.done]
    busy = [r for r in noisy if r.reply.need_code == NeedCode.TENANT_BUSY]
    assert len(done) == 2
    assert len(busy) == 4
    quiet = await as_tenant(servers[0], "quiet", 0)
    assert quiet.done


async def test_lanes_fail_open_or_closed_while_the_store_is_down_and_it_comes_back(
    make_server: ServerFactory, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    servers = await fleet_of(
        make_server,
        redis_server.url,
        2,
        fleet_max_inflight=4,
        max_inflight=4,
        lanes=True,
        interactive_reserve=1,
        lease_ttl=1.0,
        stub_ms=200,
    )
    caplog.set_level(logging.INFO, logger="governor.core.fleetgate")
    assert servers[0].fleet is not None
    gate = servers[0].fleet.gate
    # Until the store has answered that there are 2 replicas: the second's first heartbeat may
    # come after the first's first job on a loaded machine (a CI run under stress-ng saw 1).
    for i in range(50):
        first = await run_job(servers[0], f"warm{i}", job())
        assert first.done
        if gate.replicas == 2:
            break
        await asyncio.sleep(0.1)
    assert gate.replicas == 2
    redis_server.stop()
    try:
        # Interactive work fails open, within 4 / 2 = 2 jobs on this replica; heavy work
        # fails closed.
        chats = await asyncio.gather(*(run_job(servers[0], f"c{i}", job()) for i in range(3)))
        codes = sorted(str(r.reply.need_code or r.reply.status) for r in chats)
        assert codes == ["done", "done", "fleet_busy"]
        heavy = await run_job(servers[0], "h", job(lane="heavy"))
        assert heavy.reply.need_code == NeedCode.FLEET_UNAVAILABLE
        assert heavy.reply.error_code == ErrorCode.UNAVAILABLE
        assert heavy.reply.retry_hint_ms >= 5
        fleet = servers[0].fleet
        assert fleet.gate.store_state == BreakerState.OPEN
        assert "fleet store unreachable" in caplog.text
    finally:
        redis_server.start()
    # Back without a restart: a trial (a renewal, or an admission) closes the breaker.
    await wait_until(lambda: fleet.gate.store_state == BreakerState.CLOSED, timeout=10)
    again = await run_job(servers[0], "h2", job(lane="heavy"))
    assert again.done
    assert "fleet store reachable again" in caplog.text


async def test_a_frozen_store_costs_an_admission_fleet_timeout_not_a_hang(
    make_server: ServerFactory, redis_server: RedisServer
) -> None:
    (server,) = await fleet_of(make_server, redis_server.url, 1, fleet_timeout=0.05, stub_ms=10)
    assert (await run_job(server, "warm", b"x")).done
    redis_server.pause()
    try:
        started = time.monotonic()
        results = [await run_job(server, f"J{i}", b"x") for i in range(4)]
        took = time.monotonic() - started
    finally:
        redis_server.resume()
    assert all(r.done for r in results)  # lanes off: interactive, failing open
    assert took < 3.0  # four admissions, each bounded by fleet_timeout (not by Redis)
    assert server.fleet is not None
    assert server.fleet.gate.answers["store_error"] >= 3


async def test_the_fleet_metrics_are_exported(
    make_server: ServerFactory, redis_server: RedisServer
) -> None:
    import httpx

    (server,) = await fleet_of(
        make_server, redis_server.url, 1, metrics_listen="127.0.0.1:0", stub_ms=10
    )
    assert (await run_job(server, "J", b"x")).done
    assert server.metrics_address is not None
    host, port = server.metrics_address
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://{host}:{port}/metrics")).text
    assert "governor_fleet_store_state 0.0" in text
    assert "governor_fleet_replicas 1.0" in text
    assert 'governor_fleet_answers_total{answer="allowed"} 1.0' in text
    assert "governor_fleet_store_seconds_count 1.0" in text


# Real processes: a replica killed with SIGKILL ----------------------------------------------


async def test_a_killed_replicas_leases_free_within_the_lease_ttl(
    daemon: Any, redis_server: RedisServer
) -> None:
    flags = (
        "--redis-url", redis_server.url, "--fleet-max-inflight", "3", "--lease-ttl", "1.0",
        "--max-inflight", "3", "--stub-ms", "30000",
    )  # fmt: skip
    doomed: Daemon = daemon(*flags)
    other: Daemon = daemon(*flags)
    clients = []
    for _i in range(3):
        client = await connect(doomed.addr)
        clients.append(client)
    uploads = [
        asyncio.create_task(c.upload(b"x", job=f"J{i}", retry=RetryPolicy(max_attempts=1)))
        for i, c in enumerate(clients)
    ]
    store = RedisStore(redis_server.url)
    try:
        await leases_until(store, lambda n: n >= 3, 10)
        async with await connect(other.addr) as client:  # the fleet is full
            full = await client.upload(b"x", job="K", retry=RetryPolicy(max_attempts=1))
        assert full.reply.need_code == NeedCode.FLEET_BUSY
        doomed.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        await leases_until(store, lambda n: n == 0, 5)
        freed_s = time.monotonic() - killed
        assert freed_s < 1.0 + 0.5  # within lease_ttl (and the sampling)
        async with await connect(other.addr) as client:
            admitted = client.upload(b"x", job="K2", retry=RetryPolicy(max_attempts=1))
            task = asyncio.create_task(admitted)
            await leases_until(store, lambda n: n >= 1, 10)
            task.cancel()
    finally:
        for t in uploads:
            t.cancel()
        await asyncio.gather(*uploads, return_exceptions=True)
        for c in clients:
            await c.close()
        await store.close()


async def test_the_store_adds_up_every_replicas_unserved_demand(
    make_server: ServerFactory, redis_server: RedisServer
) -> None:
    """Two replicas, one slot over the fleet: each counts the jobs it turned away (each once,
    retried or not), and the store's sum, which every replica exports, is both of theirs."""
    servers = await fleet_of(
        make_server, redis_server.url, 2, fleet_max_inflight=1, lease_ttl=0.6, stub_ms=500
    )
    results = await asyncio.gather(
        *(run_job(servers[i % 2], f"J{i}", b"x", attempts=100) for i in range(6))
    )
    assert all(r.done for r in results)
    own = [s.admission.unserved for s in servers]
    assert sum(d.totals()[0] for d in own) == sum(1 for r in results if r.yields) >= 2
    expected = collections.Counter[tuple[str, ...]]()
    for demand in own:
        expected.update({("jobs", *k): n for k, n in demand.jobs.items()})
    fleets = [s.fleet for s in servers if s.fleet is not None]
    await wait_until(
        lambda: all(
            {k: n for k, n in f.fleet_unserved.items() if k[0] == "jobs"} == expected
            for f in fleets
        ),
        timeout=10,
    )


async def test_a_busy_yield_says_when_no_other_replica_would_serve_the_job_sooner(
    make_server: ServerFactory, redis_server: RedisServer
) -> None:
    """No fleet cap: three replicas of one slot each (a turn is a 3 s job). While one still has
    a free slot, a busy yield elsewhere does not speak for the fleet; once every slot is taken,
    one does (the store's view, told with each admission, release, renewal and heartbeat).
    A yield on a replica whose line is longer than another's does not."""
    servers = await fleet_of(
        make_server,
        redis_server.url,
        3,
        max_inflight=1,
        lease_ttl=0.6,
        stub_ms=3000,
        http_listen="127.0.0.1:0",
        max_wait=0,
    )
    gates = [s.fleet.gate for s in servers if s.fleet is not None]

    async def http_refusal(server: Server) -> httpx.Response:
        address = server.http_address
        assert address is not None
        async with httpx.AsyncClient(base_url=f"http://{address[0]}:{address[1]}") as http:
            return await http.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            )

    running = [asyncio.create_task(run_job(servers[i], f"long{i}", b"x")) for i in range(2)]
    await wait_until(lambda: servers[0].inflight == servers[1].inflight == 1)
    # (servers[0] has told the store of its job, and heard that servers[2] has a free slot)
    await wait_until(
        lambda: (
            gates[0].ready_at > gates[0].clock() + 2
            and (gates[0].elsewhere_at or math.inf) <= gates[0].clock()
        )
    )
    refused = await run_job(servers[0], "other", b"x", fleet_wide=True)
    assert refused.reply.status == Status.YIELD
    assert refused.reply.receipt("fleet.saturated") is None  # the third replica has a slot
    assert refused.reply.elsewhere == reached_at(servers[2])  # (the store names it)
    running.append(asyncio.create_task(run_job(servers[2], "long2", b"x")))
    await wait_until(lambda: servers[2].inflight == 1)
    await wait_until(lambda: (gates[0].elsewhere_at or 0) > gates[0].clock() + 2)
    refused = await run_job(servers[0], "another", b"x", fleet_wide=True)
    assert refused.reply.need_code == NeedCode.SERVER_BUSY
    assert refused.reply.receipt("fleet.saturated") == 1  # every replica's job runs on
    assert refused.reply.elsewhere is None
    answer = await http_refusal(servers[0])  # (the front door says it as a header)
    assert answer.status_code == 429
    assert answer.headers[SATURATED_HEADER] == "1"
    # A job waits in servers[2]'s line (its client still there): a newcomer there would wait
    # two turns, one elsewhere.
    host, port = servers[2].address
    async with await connect(f"{host}:{port}") as client:
        waiting = await client.upload(b"x", job="waiting", retry=RetryPolicy(max_attempts=1))
        assert waiting.reply.status == Status.YIELD
        await wait_until(lambda: gates[2].ready_at > gates[2].clock() + 4.5)  # (told the store)
        refused = await run_job(servers[2], "late", b"x", fleet_wide=True)
        # (that job was taken to make servers[1]'s line a turn longer, until the store says)
        await wait_until(lambda: (gates[2].elsewhere_at or 0) < gates[2].clock() + 4)
        answer = await http_refusal(servers[2])
    assert refused.reply.need_code == NeedCode.SERVER_BUSY
    assert refused.reply.receipt("hint.ahead") == 1
    assert refused.reply.receipt("fleet.saturated") is None
    assert refused.reply.elsewhere in {reached_at(servers[0]), reached_at(servers[1])}
    assert answer.status_code == 429
    assert SATURATED_HEADER not in answer.headers
    assert all(r.done for r in await asyncio.gather(*running))


async def test_a_busy_yield_waits_for_the_stores_word_and_a_cancel_meanwhile_is_the_answer(
    make_server: ServerFactory, redis_server: RedisServer
) -> None:
    """On a fleet a busy yield goes out once the store has said where its job should go; a
    newcomer's place in line is withdrawn meanwhile (so that a job sent elsewhere leaves no gap
    in it) and taken again when it stays. A job cancelled while its yield waits gets the
    cancel's answer at once, and then its frame's yield, its payload no longer held; a client
    that leaves meanwhile leaves nothing held. A job whose client does not say it goes where it
    is sent (``fleet_wide``) is not placed: its yield goes at once, its place kept here."""
    # lease_ttl 6: a renewal every 2 s, each bringing the store's word of the other replica (the
    # wait below needs the word written after both jobs began; with the default 10 s, a
    # renewal every 3.3 s, a late one left it past the wait's 5 s: a CI run failed so).
    first, second = await fleet_of(
        make_server,
        redis_server.url,
        2,
        max_inflight=1,
        stub_ms=20_000,
        fleet_timeout=5.0,
        lease_ttl=6.0,
    )
    fleet = first.fleet
    assert fleet is not None
    asked: list[int] = []
    release = asyncio.Event()
    place = fleet.store.place

    async def held_place(hint_ms: int, **fields: Any) -> tuple[int, str]:
        asked.append(hint_ms)
        await release.wait()
        return await place(hint_ms, **fields)

    fleet.store.place = held_place  # type: ignore[method-assign]
    running = [asyncio.create_task(run_job(s, "long", b"x")) for s in (first, second)]
    await wait_until(lambda: first.inflight == second.inflight == 1)
    # (the other is as busy, as the store says: no job refused here would be served there
    # half a turn sooner, so the jobs refused here stay)
    gate, ledger = fleet.gate, first.ledger
    await wait_until(
        lambda: (
            math.inf
            > (gate.elsewhere_at or 0) - gate.clock() + 10
            > ledger.ready_in_ms() / 1000 + 1
        )
    )
    buffered = first.buffered_bytes  # (the long job's payload)
    reader, writer = await asyncio.open_connection(*first.address)
    try:

        async def frame() -> dict[str, Any]:
            return orjson.loads(await asyncio.wait_for(reader.readline(), 5))  # type: ignore[no-any-return]

        turn_ms = ledger.service_s / ledger.cap * 1000
        before = ledger.ready_in_ms()
        writer.write(placeable("J_0"))
        await wait_until(lambda: len(asked) == 1)  # its yield waits for the store
        assert ledger.ready_in_ms() <= before  # its place withdrawn meanwhile (time only shortens)
        release.set()
        answer = await frame()
        assert (answer["job"], answer["status"], answer.get("elsewhere")) == ("J_0", "yield", None)
        assert before - 5000 <= answer["retry_hint_ms"] <= before  # (its place as the line was)
        assert ledger.ready_in_ms() >= before + turn_ms / 2  # taken again: it stays
        writer.write(cancel("J_0"))  # (its place given up: the line as it was)
        assert (await frame())["need_code"] == "cancelled"
        release.clear()
        asked.clear()
        writer.write(placeable("J_1"))
        await wait_until(lambda: len(asked) == 1)
        writer.write(cancel("J_1"))
        answer = await frame()
        assert (answer["job"], answer["status"], answer["need_code"]) == (
            "J_1",
            "abort",
            "cancelled",
        )
        writer.write(placeable("J_2"))
        await wait_until(lambda: len(asked) == 2)
        release.set()
        answers = [await frame(), await frame()]
        assert [(a["job"], a["status"]) for a in answers] == [("J_1", "yield"), ("J_2", "yield")]
        held = [
            next(r["value_u64"] for r in a["receipts"] if r["kind"] == Receipt.PAYLOAD_HELD)
            for a in answers
        ]
        assert held == [0, 1]  # (J_1's was dropped by its cancel)
        assert all(a.get("elsewhere") is None for a in answers)
        release.clear()
        writer.write(inline("J_4"))  # (no fleet_wide: the store is not asked)
        answer = await frame()
        assert (answer["job"], answer["status"]) == ("J_4", "yield")
        assert receipt(answer, Receipt.PAYLOAD_HELD) == 1
        assert len(asked) == 2
        writer.write(placeable("J_3"))
        await wait_until(lambda: len(asked) == 3)
        writer.close()
        await wait_until(lambda: len(first.connections) == 1)  # (its long job's)
        release.set()
        await wait_until(lambda: fleet.placements.waiting == 0)
        assert first.buffered_bytes == buffered
        assert all(t.waiting == 0 for t in first.tenants.all())
    finally:  # (a failure leaves no socket for a later test to trip on)
        writer.close()
    for task in running:  # (their clients leave: the jobs stop)
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
    await wait_until(lambda: first.inflight == first.live_jobs == 0)


@pytest.mark.parametrize("fleet_wide", [True, False])
async def test_a_fleet_client_backs_off_once_when_no_replica_would_serve_sooner(
    make_server: ServerFactory, redis_server: RedisServer, fleet_wide: bool
) -> None:
    """Every replica's one slot runs a job that ends at about the same time: the first replica
    the client tries says the fleet is saturated, and the job waits there for its turn instead
    of being refused by each replica in turn (as a client that treats each replica on its own
    is)."""
    from clients.fleet import FleetClient, Replicas
    from clients.fleet.addresses import Address

    # Jobs of 2 s: a replica's yield speaks for the fleet unless another's job ends half a turn
    # (1 s) sooner, however far apart a busy machine starts the three.
    servers = await fleet_of(
        make_server, redis_server.url, 3, max_inflight=1, lease_ttl=0.6, stub_ms=2000
    )
    running = [asyncio.create_task(run_job(servers[i], f"long{i}", b"x")) for i in range(3)]
    await wait_until(lambda: all(s.inflight == 1 for s in servers))
    gates = [s.fleet.gate for s in servers if s.fleet is not None]
    await wait_until(  # (each has told the store of its job and heard of the others')
        lambda: all(
            g.ready_at > g.clock() + 1 and (g.elsewhere_at or 0) > g.clock() + 1 for g in gates
        )
    )
    ends = [g.ready_at for g in gates]
    assert max(ends) - min(ends) < 0.9  # (the premise: the jobs end within half a turn)
    replicas = Replicas([Address(*s.address) for s in servers], fleet_wide=fleet_wide)
    async with FleetClient(replicas) as fleet:
        result = await fleet.upload(b"y", inline=True, retry=RetryPolicy(max_attempts=10))
    assert result.reply.status == Status.DONE
    if fleet_wide:
        assert len(set(result.tried)) == 1
        assert result.yields[0].receipt("fleet.saturated") == 1
    else:
        assert len(set(result.tried)) == 3  # refused by each before it waited
    assert all(r.done for r in await asyncio.gather(*running))
