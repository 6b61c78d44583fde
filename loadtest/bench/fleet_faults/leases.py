"""What both phases of ``bench fleet`` share: the fleet's leases as read from Redis (whose each
one is, sampled through a run, the cap as the store saw it) and the callers' pacing."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from clients.client import RetryPolicy
from governor.fleetstore import RedisStore

from ...support.replicas import Gauges, Replica

ERROR_PAUSE_S = 0.05  # after a job that reached no replica, before the next: no busy loop
# Flow control is paced by the hints and bounded by the job's timeout, not by a count: a caller
# of a full fleet may be told to wait many times.
YIELD_RETRY = RetryPolicy(max_attempts=100_000, max_sleep_s=1.0)


def lease_owner(lease: str | bytes) -> str:
    """The replica a lease belongs to: its id is ``REPLICA_ID:N``, and a replica id given as
    ``--replica-id rI`` is ``rI/SUFFIX`` in the store (the process's own mark)."""
    text = lease.decode() if isinstance(lease, bytes) else lease
    return text.rpartition(":")[0].partition("/")[0]


@dataclass(frozen=True, slots=True)
class Leases:
    """One read of the store: its clock, and the live leases (expiry ahead of that clock)."""

    t: float  # this process's clock (time.monotonic) when the read was answered
    now_ms: int  # Redis's clock
    live: Mapping[str, int]  # replica -> live leases
    expiry_ms: Mapping[str, int]  # replica -> the latest expiry among its live leases

    @property
    def count(self) -> int:
        return sum(self.live.values())


def leases_from(
    t: float, redis_time: tuple[int, int], entries: Iterable[tuple[str | bytes, float]]
) -> Leases:
    """:class:`Leases` from ``TIME`` and ``ZRANGE leases 0 -1 WITHSCORES`` read together."""
    now_ms = redis_time[0] * 1000 + redis_time[1] // 1000
    live: dict[str, int] = collections.Counter()
    expiry: dict[str, int] = {}
    for lease, score in entries:
        if score > now_ms:  # (RedisStore.inflight's ZCOUNT from "(now")
            owner = lease_owner(lease)
            live[owner] += 1
            expiry[owner] = max(expiry.get(owner, 0), int(score))
    return Leases(t, now_ms, dict(live), expiry)


@dataclass(frozen=True, slots=True)
class Round:
    """One sampling round: the store and every live replica, read at once."""

    leases: Leases
    replicas: Mapping[str, Gauges | None]  # None: it did not answer


def store_cap_verdict(rounds: Sequence[Round], cap: int) -> dict[str, Any]:
    """The fleet cap as the store alone saw it (the seed phase scrapes no replica)."""
    most = max((r.leases.count for r in rounds), default=0)
    return {"cap": cap, "rounds": len(rounds), "max_redis": most, "held": most <= cap}


async def read_leases(store: RedisStore) -> Leases:
    """The store's clock and every lease, in one transaction (one instant of Redis)."""
    async with store.redis.pipeline(transaction=True) as pipe:
        pipe.time()
        pipe.zrange(store.leases_key, 0, -1, withscores=True)
        now, entries = await pipe.execute()
    return leases_from(time.monotonic(), (int(now[0]), int(now[1])), entries)


async def redis_now_ms(store: RedisStore) -> int:
    seconds, micros = await store.redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def sample(
    store: RedisStore,
    replicas: Sequence[Replica],
    rounds: list[Round],
    interval_s: float,
    *,
    scrape: bool,
) -> None:
    """A round every ``interval_s`` (or at once after a slow one) until cancelled: the store,
    and with ``scrape`` every replica not killed, all read concurrently."""
    while True:
        begun = time.monotonic()
        live = [r for r in replicas if not r.killed] if scrape else []
        leases, gauges = await asyncio.gather(
            read_leases(store), asyncio.gather(*(r.gauges() for r in live))
        )
        rounds.append(Round(leases, {r.name: g for r, g in zip(live, gauges, strict=True)}))
        await asyncio.sleep(max(interval_s - (time.monotonic() - begun), 0.0))


@contextlib.asynccontextmanager
async def sampling(
    store: RedisStore, replicas: Sequence[Replica], interval_s: float, *, scrape: bool
) -> AsyncIterator[list[Round]]:
    rounds: list[Round] = []
    task = asyncio.create_task(sample(store, replicas, rounds, interval_s, scrape=scrape))
    try:
        yield rounds
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # (a sampler that failed raises its error here)
