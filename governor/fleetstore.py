"""The fleet's store on Redis: one script call per admission, releases and renewals in batches,
one per busy yield's placement (:class:`Placements`).

The decisions are :mod:`governor.core.fleetgate`'s; this module only talks to Redis (redis-py's asyncio
client, hiredis parsing its replies). Its Lua scripts are loaded once and called by their
hash (``EVALSHA``; redis-py loads a script again if the server lost it). Times are the Redis
server's own (``TIME``), so the replicas' clocks never need to agree.

Keys (all in one hash slot, ``{NAME}``, so that a Redis Cluster keeps each script's keys on one
node)::

    gov{NAME}:leases              sorted set: lease id -> expiry (ms)
    gov{NAME}:ends                sorted set: lease id -> expected end (ms), for the hints
    gov{NAME}:replicas            sorted set: replica id -> heartbeat expiry (ms)
    gov{NAME}:promises            sorted set: refused lease id -> when it was told to come back
    gov{NAME}:t:TENANT:leases     sorted set: the tenant's lease ids -> expiry (ms)
    gov{NAME}:t:TENANT:bucket     hash: the tenant's token buckets (level and stamp of each)
    gov{NAME}:ready               hash: replica id -> when it could serve a newcomer (ms), and
                                  REPLICA@ -> where the fleet's clients reach it (HOST:PORT),
                                  REPLICA# -> the seq of its last write of the first
    gov{NAME}:unserved            hash: the fleet's unserved demand, ["jobs"|"tokens"|"gave_up",
                                  lane, tenant] -> count (each replica adds what it counted
                                  since its last renewal)
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .core.breaker import BreakerState
from .core.fleetgate import Answer, Ask, FleetGate, Lease
from .core.ledger import Refusal
from .core.tenants import TenantConfig
from .core.unserved import UnservedDemand
from .telemetry.logs import event
from .telemetry.metrics import Histogram

log = logging.getLogger("governor.core.fleetgate")

# Every script that hears from a replica: its heartbeat's set cleared of the dead (what they
# said forgotten), when it could next serve a newcomer written (``ready``: ms from now), and the
# soonest of the others alive returned (ms from now; -1: there is no other). A replica that
# stops says -1 and leaves the set. A replica's writes go over several connections, so one can
# overtake another: each is numbered (``seq``), and one older than the last written (kept under
# ``REPLICA#``) does not write its ``ready`` (a renewal reckoned before an admission, arriving
# after it, said "free now" of a replica whose last slot the admission took). (The ready hash
# also holds, under ``REPLICA@``, where the fleet's clients reach each replica: written by its
# renewals.)
HEARTBEAT = """
local function soonest(replicas_key, ready_key, replica, now)
  local best, sooner = nil, -1
  for _, r in ipairs(redis.call('ZRANGE', replicas_key, 0, -1)) do
    if r ~= replica then
      local wait = math.max(tonumber(redis.call('HGET', ready_key, r) or now) - now, 0)
      if sooner < 0 or wait < sooner then best, sooner = r, wait end
    end
  end
  return best, sooner
end
local function heartbeat(replicas_key, ready_key, replica, ready, seq, now)
  local dead = redis.call('ZRANGEBYSCORE', replicas_key, '-inf', now)
  if #dead > 0 then
    redis.call('ZREMRANGEBYSCORE', replicas_key, '-inf', now)
    for _, r in ipairs(dead) do redis.call('HDEL', ready_key, r, r .. '@', r .. '#') end
  end
  if tonumber(ready) < 0 then  -- it stops: gone from the fleet's view at once
    redis.call('ZREM', replicas_key, replica)
    redis.call('HDEL', ready_key, replica, replica .. '@', replica .. '#')
  elseif tonumber(seq) >= tonumber(redis.call('HGET', ready_key, replica .. '#') or 0) then
    redis.call('HSET', ready_key, replica, now + tonumber(ready), replica .. '#', seq)
  end
  local _, sooner = soonest(replicas_key, ready_key, replica, now)
  return redis.call('ZCARD', replicas_key), sooner
end
"""

# Expire what has lapsed, then check the fleet's cap, the tenant's cap and its buckets in that
# order; only an admission charges the buckets and writes the lease.
ACQUIRE = (
    HEARTBEAT
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease, ttl, expected = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local cap, tcap = tonumber(ARGV[4]), tonumber(ARGV[5])
local rrate, rburst = tonumber(ARGV[6]), tonumber(ARGV[7])
local trate, tburst, tokens = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local replica, ready, seq = ARGV[11], ARGV[12], ARGV[13]
-- This replica's releases not yet written go first, so that the job taking a slot its last
-- job left never finds that job's lease still counted.
for i = 14, #ARGV do
  redis.call('ZREM', KEYS[1], ARGV[i])
  redis.call('ZREM', KEYS[2], ARGV[i])
  redis.call('ZREM', KEYS[i - 6], ARGV[i])
end
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 512)
if #dead > 0 then
  redis.call('ZREM', KEYS[1], unpack(dead))
  redis.call('ZREM', KEYS[2], unpack(dead))
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
redis.call('ZADD', KEYS[5], now + ttl, replica)
local replicas, sooner = heartbeat(KEYS[5], KEYS[7], replica, ready, seq, now)
local inflight = redis.call('ZCARD', KEYS[1])
local function soonest(members)
  local best = nil
  for _, m in ipairs(members) do
    local e = redis.call('ZSCORE', KEYS[2], m)
    if e and (best == nil or tonumber(e) < best) then best = tonumber(e) end
  end
  if best == nil then return 0 end
  return math.max(best - now, 0)
end
if cap > 0 and inflight >= cap then
  -- Spread the refused over the coming ends, in line: the k-th client still waiting is told
  -- the (k mod n)-th soonest end, k div n turns of a job like its own later.
  redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now)
  local waiting = redis.call('ZCARD', KEYS[6])
  local turn = math.max(expected, 1)
  local n = math.max(redis.call('ZCARD', KEYS[2]), 1)
  local at = now + turn / 4
  local nth = redis.call('ZRANGE', KEYS[2], waiting % n, waiting % n, 'WITHSCORES')
  if nth[2] then at = math.max(tonumber(nth[2]), at) end
  at = math.ceil(at + math.floor(waiting / n) * turn)
  redis.call('ZADD', KEYS[6], at, lease)
  redis.call('PEXPIRE', KEYS[6], at - now + ttl)
  return {0, 'fleet_busy', at - now, replicas, inflight, sooner}
end
if tcap > 0 and redis.call('ZCARD', KEYS[3]) >= tcap then
  local wait = soonest(redis.call('ZRANGE', KEYS[3], 0, -1))
  return {0, 'tenant_busy', math.ceil(wait), replicas, inflight, sooner}
end
local b = redis.call('HMGET', KEYS[4], 'rl', 'rs', 'tl', 'ts')
local function level(l, s, rate, burst)
  if not l then return burst end
  return math.min(burst, tonumber(l) + (now - tonumber(s)) * rate / 1000)
end
local wait, rl, tl = 0, 0, 0
if rrate > 0 then
  rl = level(b[1], b[2], rrate, rburst)
  if rl < 1 then wait = math.max(wait, (1 - rl) * 1000 / rrate) end
end
if trate > 0 then
  tl = level(b[3], b[4], trate, tburst)
  local need = math.min(tokens, tburst)
  if tl < need then wait = math.max(wait, (need - tl) * 1000 / trate) end
end
if wait > 0 then
  return {0, 'rate_limited', math.ceil(wait), replicas, inflight, sooner}
end
if rrate > 0 or trate > 0 then
  local refill = 0
  if rrate > 0 then
    redis.call('HSET', KEYS[4], 'rl', tostring(rl - 1), 'rs', now)
    refill = math.max(refill, rburst * 1000 / rrate)
  end
  if trate > 0 then
    redis.call('HSET', KEYS[4], 'tl', tostring(tl - tokens), 'ts', now)
    refill = math.max(refill, (tburst + tokens) * 1000 / trate)
  end
  redis.call('PEXPIRE', KEYS[4], math.ceil(refill) + ttl)
end
redis.call('ZADD', KEYS[1], now + ttl, lease)
redis.call('ZADD', KEYS[2], now + expected, lease)
if tcap > 0 then
  redis.call('ZADD', KEYS[3], now + ttl, lease)
  redis.call('PEXPIRE', KEYS[3], ttl * 2)
end
return {1, '', 0, replicas, inflight + 1, sooner}
"""
)

# KEYS: leases, ends, replicas, ready, then each lease's tenant set; ARGV: the replica, how soon
# it could serve a newcomer, the write's seq, then the lease ids, in the tenant sets' order.
# Returns how soon another could (HEARTBEAT).
RELEASE = (
    HEARTBEAT
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 4, #ARGV do
  redis.call('ZREM', KEYS[1], ARGV[i])
  redis.call('ZREM', KEYS[2], ARGV[i])
  redis.call('ZREM', KEYS[i + 1], ARGV[i])
end
local _, sooner = heartbeat(KEYS[3], KEYS[4], ARGV[1], ARGV[2], ARGV[3], now)
return sooner
"""
)

# KEYS: leases, replicas, ready, then each lease's tenant set; ARGV: ttl, replica, how soon it
# could serve a newcomer, the write's seq, where its clients reach it, then the lease ids. A
# lease the store lost (it expired while the store was unreachable, or the store restarted) is
# written again: the fleet counts the jobs that run, not only those it remembers. Returns the
# replicas alive and how soon another could serve a newcomer (HEARTBEAT).
RENEW = (
    HEARTBEAT
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
redis.call('ZADD', KEYS[2], now + ttl, ARGV[2])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[3], ARGV[2] .. '@', ARGV[5]) end
for i = 6, #ARGV do
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[i])
  redis.call('ZADD', KEYS[i - 2], now + ttl, ARGV[i])
  redis.call('PEXPIRE', KEYS[i - 2], ttl * 2)
end
local replicas, sooner = heartbeat(KEYS[2], KEYS[3], ARGV[2], ARGV[3], ARGV[4], now)
return {replicas, sooner}
"""
)

# KEYS: replicas, ready; ARGV: the replica, how soon it could serve a newcomer, the slack and
# the turn (ms), the hint of a job a busy yield there refused, and the write's seq. A
# heartbeat (HEARTBEAT), then where the job should go: nowhere else (it is the fleet's: no other
# replica would serve it the slack sooner than its hint), or to the soonest other, whose line
# is then a turn longer. Every replica's refusals pass through here one at a time, interleaved
# as they come: a burst refused at once on every replica is spread over the fleet as a list
# scheduler would, each job to the replica that can serve it first (of those whose address is
# known: a replica that has not yet renewed is never named). Returns how soon another
# could serve a newcomer (as HEARTBEAT, after the job), and where the job's client reaches the
# replica it goes to ('': nowhere else).
PLACE = (
    HEARTBEAT
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local replica, slack, turn = ARGV[1], tonumber(ARGV[3]), tonumber(ARGV[4])
heartbeat(KEYS[1], KEYS[2], replica, ARGV[2], ARGV[6], now)
local other, wait, elsewhere = nil, -1, ''
for _, r in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local address = redis.call('HGET', KEYS[2], r .. '@')
  if r ~= replica and address then
    local w = math.max(tonumber(redis.call('HGET', KEYS[2], r) or now) - now, 0)
    if wait < 0 or w < wait then other, wait, elsewhere = r, w, address end
  end
end
if other ~= nil and wait + slack < tonumber(ARGV[5]) then
  redis.call('HSET', KEYS[2], other, now + wait + turn)
else
  elsewhere = ''
end
local _, sooner = soonest(KEYS[1], KEYS[2], replica, now)
return {sooner, elsewhere}
"""
)

# Leases and tenants per script call, so that no call holds Redis (single-threaded) for long.
BATCH = 256


class RedisStore:
    """The store's IO: a bounded pool of connections to one Redis."""

    def __init__(self, url: str, *, name: str = "fleet", connections: int = 16) -> None:
        self.prefix = f"gov{{{name}}}"
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=connections, timeout=None
        )
        self.redis = aioredis.Redis(connection_pool=pool)
        self._acquire = self.redis.register_script(ACQUIRE)
        self._release = self.redis.register_script(RELEASE)
        self._renew = self.redis.register_script(RENEW)
        self._place = self.redis.register_script(PLACE)
        self.leases_key = f"{self.prefix}:leases"
        self.ends_key = f"{self.prefix}:ends"
        self.replicas_key = f"{self.prefix}:replicas"
        self.promises_key = f"{self.prefix}:promises"
        self.unserved_key = f"{self.prefix}:unserved"
        self.ready_key = f"{self.prefix}:ready"

    def tenant_key(self, tenant: str, what: str) -> str:
        return f"{self.prefix}:t:{tenant}:{what}"

    async def acquire(
        self,
        ask: Ask,
        *,
        ttl_ms: int,
        cap: int,
        replica: str,
        ready_ms: int = 0,
        seq: int = 0,
        released: Sequence[Lease] = (),
    ) -> Answer:
        """The admission's one step; ``ready_ms``: how soon this replica could serve a
        newcomer, as of its write numbered ``seq`` (:data:`HEARTBEAT`: an older write's is not
        written); ``released``: leases to free first (at most :data:`BATCH`)."""
        tenant = ask.tenant
        reply = await self._acquire(
            keys=[
                self.leases_key,
                self.ends_key,
                self.tenant_key(tenant.name, "leases"),
                self.tenant_key(tenant.name, "bucket"),
                self.replicas_key,
                self.promises_key,
                self.ready_key,
                *(self.tenant_key(lease.tenant, "leases") for lease in released),
            ],
            args=[
                ask.lease.id,
                ttl_ms,
                ask.expected_ms,
                cap,
                tenant.max_inflight,
                tenant.requests_per_s,
                tenant.request_burst or max(tenant.requests_per_s, 1.0),
                tenant.tokens_per_s,
                tenant.token_burst or max(tenant.tokens_per_s, 1.0),
                ask.tokens,
                replica,
                ready_ms,
                seq,
                *(lease.id for lease in released),
            ],
        )
        allowed, code, wait_ms, replicas, inflight, sooner = reply
        code = code.decode() if isinstance(code, bytes) else str(code)
        return Answer(bool(allowed), code, int(wait_ms), int(replicas), int(inflight), int(sooner))

    async def release(
        self, leases: Sequence[Lease], *, replica: str, ready_ms: int, seq: int = 0
    ) -> int:
        """Free ``leases`` (none: a heartbeat), and tell the store how soon this replica could
        serve a newcomer (as :meth:`acquire`); returns how soon another could (ms; -1: there is
        no other)."""
        sooner = -1
        for start in range(0, max(len(leases), 1), BATCH):
            batch = leases[start : start + BATCH]
            sooner = await self._release(
                keys=[
                    self.leases_key,
                    self.ends_key,
                    self.replicas_key,
                    self.ready_key,
                    *(self.tenant_key(lease.tenant, "leases") for lease in batch),
                ],
                args=[replica, ready_ms, seq, *(lease.id for lease in batch)],
            )
        return int(sooner)

    async def renew(
        self,
        leases: Sequence[Lease],
        *,
        ttl_ms: int,
        replica: str,
        ready_ms: int = 0,
        seq: int = 0,
        address: str = "",
    ) -> tuple[int, int]:
        """Renew ``leases`` and this replica's heartbeat (and how soon it could serve a
        newcomer, and where its clients reach it: ``address``, HOST:PORT); returns the replicas
        alive and how soon another could serve a newcomer (as :meth:`release`)."""
        replicas, sooner = 1, -1
        for start in range(0, max(len(leases), 1), BATCH):
            batch = leases[start : start + BATCH]
            replicas, sooner = await self._renew(
                keys=[
                    self.leases_key,
                    self.replicas_key,
                    self.ready_key,
                    *(self.tenant_key(lease.tenant, "leases") for lease in batch),
                ],
                args=[ttl_ms, replica, ready_ms, seq, address, *(lease.id for lease in batch)],
            )
        return int(replicas), int(sooner)

    async def place(
        self,
        hint_ms: int,
        *,
        replica: str,
        ready_ms: int,
        turn_ms: int,
        slack_ms: int,
        seq: int = 0,
    ) -> tuple[int, str]:
        """Where the job a busy yield here refused (its hint: ``hint_ms``) should go
        (:data:`PLACE`): nowhere else (''), or the address of a replica that would serve it
        ``slack_ms`` sooner; the heartbeat as :meth:`release`. Returns how soon another could
        serve a newcomer, and that address."""
        sooner, elsewhere = await self._place(
            keys=[self.replicas_key, self.ready_key],
            args=[replica, ready_ms, slack_ms, turn_ms, hint_ms, seq],
        )
        if isinstance(elsewhere, bytes):
            elsewhere = elsewhere.decode()
        return int(sooner), str(elsewhere)

    async def add_unserved(self, counts: UnservedCounts) -> UnservedCounts:
        """Add this replica's unserved demand counted since it last did (``counts``); returns
        the fleet's, every replica's added up."""
        async with self.redis.pipeline(transaction=True) as pipe:
            for field, n in counts.items():
                pipe.hincrby(self.unserved_key, orjson.dumps(field), n)
            pipe.hgetall(self.unserved_key)
            *_, totals = await pipe.execute()
        return {tuple(orjson.loads(k)): int(v) for k, v in totals.items()}

    async def inflight(self) -> int:
        """Leases not expired over the fleet (for samplers and tests)."""
        t = await self.redis.time()
        now = t[0] * 1000 + t[1] // 1000
        return int(await self.redis.zcount(self.leases_key, f"({now}", "+inf"))

    async def close(self) -> None:
        await self.redis.aclose(close_connection_pool=True)


# Unserved demand by (what: jobs, tokens or gave_up; lane; tenant).
UnservedCounts = dict[tuple[str, ...], int]


def unserved_counts(demand: UnservedDemand) -> UnservedCounts:
    """``demand``'s counters as one mapping, the store's fields."""
    return {(what, *key): n for what, counter in demand.counters() for key, n in counter.items()}


# The seconds the store took to answer an admission (loopback: about 0.2 ms).
STORE_BUCKETS = (0.0001, 0.0002, 0.0003, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)
# Releases kept for a store that cannot take them now; past this the oldest are left to expire.
MAX_PENDING_RELEASES = 65536
STORE_ERRORS = (TimeoutError, RedisError, OSError)


# A busy yield's verdict from the store: where its job should go, '' nowhere else (it is the
# fleet's), else the HOST:PORT of the replica that would serve it sooner; None: the store did not
# say in time (the yield's own verdict, from what the store last said, stands).
Verdict = Callable[[str | None], None]
# Busy yields waiting for the store's verdict; past this a yield goes with its own at once.
MAX_PLACEMENTS = 4096


def _reraise_cancel() -> None:
    """Raise the cancel the client hid: redis-py can turn a cancel that lands while it connects
    into a ConnectionError, or finish the command and return its answer, and the task that was
    cancelled (its client gone) would go on."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class Fleet:
    """The fleet step of an admission (:meth:`admit`), and :meth:`run`: the one writer of
    releases and renewals, in order, so that a renewal never writes back a released lease."""

    def __init__(self, gate: FleetGate, store: RedisStore) -> None:
        self.gate = gate
        self.store = store
        s = gate.settings
        self.ttl_ms = round(s.lease_ttl_s * 1000)
        self.renew_s = s.lease_ttl_s / 3
        self.seconds = Histogram(STORE_BUCKETS)  # the store's answers to admissions
        self._pending: dict[str, Lease] = {}  # released, not yet written, oldest first
        # This replica's unserved demand (the server's admission's), what of it the store has,
        # and the fleet's as the store last said.
        self.unserved: UnservedDemand | None = None
        # How soon this replica could serve a newcomer (ms; the server's ledger's), told to the
        # store with each admission, release, renewal and (after a busy yield) heartbeat.
        self.ready_ms: Callable[[], int] = lambda: 0
        self.turn_s: Callable[[], float] = lambda: 0.0  # how often a slot here turns over
        self._heartbeat = False  # one is due (a busy yield here changed the answer)
        self.placements = Placements(self)  # (the door's busy yields ask it where jobs go)
        self.address = ""  # HOST:PORT: where the fleet's clients reach this replica's TCP door
        self._unserved_written: UnservedCounts = {}
        self.fleet_unserved: UnservedCounts = {}
        self._wake = asyncio.Event()
        self._closed = False
        gate.breaker.on_change = self._changed

    async def admit(
        self,
        lease: Lease,
        tenant: TenantConfig,
        tokens: int,
        expected_s: float,
        next_end_ms: Callable[[], int],
    ) -> Refusal | None:
        """Ask the store for ``lease`` (or, while it is unreachable, decide on this replica's
        share): None, the job may run and holds the lease until :meth:`release`; else the
        refusal to send. ``next_end_ms()``: the share's hint, asked for only on the share."""
        gate = self.gate
        trial = gate.ask()
        if trial is not None:
            ask = gate.question(lease, tenant, tokens, expected_s)
            released = list(itertools.islice(self._pending.values(), BATCH))
            told = gate.told(self.ready_ms())
            started = time.perf_counter()
            try:
                async with asyncio.timeout(gate.settings.timeout_s):
                    answer = await self.store.acquire(
                        ask,
                        ttl_ms=self.ttl_ms,
                        cap=gate.settings.max_inflight,
                        replica=gate.settings.replica_id,
                        ready_ms=told.ms,
                        seq=told.seq,
                        released=released,
                    )
            except STORE_ERRORS as exc:
                _reraise_cancel()
                gate.failed(trial=trial)
                self._forget(lease)  # (the store may have written it before the answer was lost)
                log.debug("fleet store failed an admission: %r", exc)
            else:
                self.seconds.observe(time.perf_counter() - started)
                self._written(released)
                refusal = gate.answered(
                    lease,
                    answer,
                    trial=trial,
                    tenant=tenant,
                    next_end_ms=next_end_ms,
                    told=told,
                )
                if refusal is not None and answer.allowed:  # (over what this replica holds)
                    self._forget(lease)
                _reraise_cancel()  # (the caller releases the lease it may have been granted)
                return refusal
        return gate.on_share(lease, tenant, tokens, next_end_ms)

    def release(self, lease: Lease) -> None:
        """The lease's job ended: free it here now, in the store with the next batch."""
        self.gate.released(lease)
        self._forget(lease)

    def _forget(self, lease: Lease) -> None:
        pending = self._pending
        pending[lease.id] = lease
        if len(pending) > MAX_PENDING_RELEASES:  # (the store has been away: they expire there)
            del pending[next(iter(pending))]
        self._wake.set()

    def _written(self, leases: list[Lease]) -> None:
        for lease in leases:
            self._pending.pop(lease.id, None)

    def busy(self, hint_ms: int) -> bool:
        """A busy yield here, with ``hint_ms``: whether it speaks for the fleet (no other
        replica could serve the job sooner: :meth:`FleetGate.saturated`). How soon this
        replica could serve a newcomer has changed: the store is told with the next write (a
        heartbeat; the yields that come while one is due share it)."""
        if not self._heartbeat:
            self._heartbeat = True
            self._wake.set()
        return self.gate.saturated(hint_ms, self.turn_s())

    async def run(self) -> None:
        """Write releases as they come (a batch per turn) and heartbeats when due, and renew
        this replica's leases and heartbeat every third of ``lease_ttl``; while the store is
        unreachable, only the breaker's trials try."""
        loop = asyncio.get_running_loop()
        renew_at = 0.0
        while True:
            now = loop.time()
            if renew_at > now and not self._pending and not self._heartbeat:
                try:
                    async with asyncio.timeout(renew_at - now):
                        await self._wake.wait()
                except TimeoutError:
                    _reraise_cancel()
            self._wake.clear()
            batch = list(self._pending.values())
            written = True
            if batch or self._heartbeat:
                self._heartbeat = False  # (each write is a heartbeat)
                written = await self._write(batch, renew=False)
            if written:
                self._written(batch)  # (not those released while it was written)
            if loop.time() >= renew_at:
                await self._write(list(self.gate.leases.values()), renew=True)
                renew_at = loop.time() + self.renew_s
            elif not written:
                # The store did not take the batch: try again at the next renewal, not in a loop.
                await asyncio.sleep(max(renew_at - loop.time(), 0))

    async def _write(self, leases: list[Lease], *, renew: bool) -> bool:
        gate = self.gate
        trial = gate.ask()
        if trial is None:
            return False
        s = gate.settings
        try:
            async with asyncio.timeout(self.renew_s):
                told, replicas = gate.told(self.ready_ms()), None
                if renew:
                    replicas, sooner = await self.store.renew(
                        leases,
                        ttl_ms=self.ttl_ms,
                        replica=s.replica_id,
                        ready_ms=told.ms,
                        seq=told.seq,
                        address=self.address,
                    )
                    await self._add_unserved()
                else:
                    sooner = await self.store.release(
                        leases, replica=s.replica_id, ready_ms=told.ms, seq=told.seq
                    )
        except STORE_ERRORS as exc:
            _reraise_cancel()
            gate.failed(trial=trial)
            log.debug("fleet store failed a %s: %r", "renewal" if renew else "release", exc)
            return False
        gate.reached(trial=trial, sooner_ms=sooner, told=told, replicas=replicas)
        # A cancel that redis-py hid by finishing the command: stop now, not when the wait
        # for the next renewal (lease_ttl / 3) runs out and finds it (a server's close waited
        # that long).
        _reraise_cancel()
        return True

    async def _add_unserved(self) -> None:
        """Add what this replica counted since its last renewal to the fleet's unserved demand,
        and keep the fleet's sum for ``/metrics``."""
        if self.unserved is None:
            return
        counts = unserved_counts(self.unserved)
        written = self._unserved_written
        deltas = {k: n - written.get(k, 0) for k, n in counts.items() if n != written.get(k, 0)}
        self.fleet_unserved = await self.store.add_unserved(deltas)
        self._unserved_written = counts

    def _changed(self, before: BreakerState, after: BreakerState, why: str) -> None:
        lanes = ", ".join(sorted(self.gate.settings.fail_open)) or "none"
        if after == BreakerState.OPEN:
            message = (
                f"fleet store unreachable ({why}): {lanes} admitted within this replica's "
                f"share of the fleet's limits (1/{self.gate.replicas}), other lanes yield "
                "fleet_unavailable"
            )
            level = logging.WARNING
        elif after == BreakerState.CLOSED:
            message, level = f"fleet store reachable again ({why})", logging.INFO
        else:
            message, level = f"fleet store: trying it again ({why})", logging.INFO
        event(
            log,
            level,
            message,
            event="fleet_store",
            before=before.label,
            after=after.label,
            why=why,
        )

    async def close(self) -> None:
        """Free this replica's leases (a clean stop does not wait out their time-to-live)."""
        if self._closed:
            return
        self._closed = True
        leases = [*self.gate.leases.values(), *self._pending.values()]
        self._pending = {}
        try:
            async with asyncio.timeout(1.0):
                # (with no lease too: the replica leaves the fleet's count now, not at its
                # heartbeat's end, and the others' shares grow back at once)
                replica = self.gate.settings.replica_id
                await self.store.release(leases, replica=replica, ready_ms=-1)
                await self._add_unserved()  # (what it counted since its last renewal)
        except STORE_ERRORS:
            pass
        await self.store.close()


class Placements:
    """Where the jobs that busy yields refuse here should go, as the store says (:data:`PLACE`):
    one job a call, so that the refusals of every replica pass through it interleaved, and a
    burst refused at once on every replica is spread over the fleet. A yield waits for its
    verdict within ``fleet_timeout`` (queued or asked); :meth:`run` is the one caller."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        # (when asked, the job's hint, whether its place is withdrawn meanwhile, and whom to
        # tell: the first is the one being asked)
        self._asked: collections.deque[tuple[float, int, bool, Verdict]] = collections.deque()
        self._withdrawn = 0  # of those asked, the jobs whose places are withdrawn
        self._wake = asyncio.Event()

    @property
    def waiting(self) -> int:
        """Busy yields waiting for the store's word."""
        return len(self._asked)

    def ask(self, hint_ms: int, verdict: Verdict, *, withdrawn: bool = False) -> bool:
        """Ask whether the job of a busy yield with ``hint_ms`` is the fleet's: ``verdict`` is
        called with the answer. ``withdrawn``: its place in line is withdrawn meanwhile (a
        newcomer's), so it is asked about at the back of the line as it is then, and counted in
        this replica's line until answered. False: not asked (the store is unreachable, it last
        said no other replica is alive, or too many wait), the yield's own verdict stands."""
        fleet = self.fleet
        gate = fleet.gate
        if (
            gate.store_state != BreakerState.CLOSED
            or gate.elsewhere_at == math.inf
            or len(self._asked) >= MAX_PLACEMENTS
        ):
            return False
        self._asked.append((gate.clock(), hint_ms, withdrawn, verdict))
        self._withdrawn += withdrawn
        self._wake.set()
        return True

    async def run(self) -> None:
        """Ask the store about each yield in turn; stopped, answer those left with their own
        verdicts (their frames are owed an answer)."""
        asked, gate = self._asked, self.fleet.gate
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while asked:
                    at, hint_ms, withdrawn, verdict = asked[0]
                    elsewhere = None
                    if gate.clock() - at < gate.settings.timeout_s:  # (else too late: its own)
                        try:
                            elsewhere = await self._place(hint_ms, withdrawn)
                        except Exception:  # (a bug here must not leave every later yield owed)
                            log.exception("a busy yield's placement failed")
                    asked.popleft()
                    self._withdrawn -= withdrawn
                    _tell(verdict, elsewhere)
        finally:
            while asked:
                _, _, withdrawn, verdict = asked.popleft()
                self._withdrawn -= withdrawn
                _tell(verdict, None)

    async def _place(self, hint_ms: int, withdrawn: bool) -> str | None:
        """The store's word on one job (None: it did not say in time). This replica's line, as
        told, holds the jobs whose places are withdrawn while they are asked about."""
        fleet = self.fleet
        gate = fleet.gate
        ready_ms, turn_ms = fleet.ready_ms(), fleet.turn_s() * 1000
        if withdrawn:  # (at the back, behind the jobs before it that stayed)
            hint_ms = ready_ms
        told = gate.told(ready_ms + round(self._withdrawn * turn_ms))
        try:
            async with asyncio.timeout(gate.settings.timeout_s):
                sooner, elsewhere = await fleet.store.place(
                    hint_ms,
                    replica=gate.settings.replica_id,
                    ready_ms=told.ms,
                    seq=told.seq,
                    turn_ms=round(turn_ms),
                    slack_ms=round(turn_ms / 2),  # (as FleetGate.saturated)
                )
        except STORE_ERRORS as exc:
            _reraise_cancel()
            log.debug("fleet store failed a placement: %r", exc)
            return None
        gate.reached(trial=False, sooner_ms=sooner, told=told)
        return elsewhere


def _tell(verdict: Verdict, elsewhere: str | None) -> None:
    try:
        verdict(elsewhere)
    except Exception:  # (one connection's failure must not silence the others')
        log.exception("a busy yield's verdict failed")
