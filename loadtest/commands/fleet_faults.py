"""``fleet``: a retry storm against a circuit breaker, then a replica killed with SIGKILL, on
real processes: ``governor serve --runner stub`` replicas sharing a real Redis.

Two phases, each on fresh replicas and a Redis of its own (``--phase`` picks one, or both):

**seed** (the retry storm). ``--replicas`` replicas of ``--max-inflight`` slots share a fleet
cap (``--fleet-max-inflight``; by default the healthy replicas' slots, so that a doomed call
holds a lease that good work could have had: a hard fleet-wide ceiling on GPU slots). Replica
r0 fails every job (``--stub-fail-rate 1``) after ``--stub-ms``, as a sick GPU does: the call
took a slot and produced nothing. ``--clients`` callers run jobs back to back for
``--duration`` seconds under each of ``--policies`` in turn, each on fresh replicas:

- ``naive``: a replica drawn uniformly at random; a call aborted with ``backend_error`` is tried
  again at once on a fresh draw, up to ``--tries`` calls per job; nothing remembered.
- ``breaker``: each caller a :class:`~clients.fleet.FleetClient` of its own (two random choices
  by load, a failed job goes on elsewhere while the retry budget allows, a replica failing 5
  times in a row is ejected for 30 s): ``--clients`` independent callers, each learning alone.
- ``breaker-shared``: the same, the callers sharing one view of the replicas and one retry
  budget (one process's callers behind one client library, as behind one sidecar).

Every caller honours busy yields' hints on the replica that gave them (flow control costs no
slot). Per policy: calls (jobs a replica ran to a terminal frame), wasted calls (of which aborted
with ``backend_error``), yields, goodput (jobs done per second), failed jobs (given up), and the
calls as the replicas' own ``/metrics`` count them. Checks: the live leases in Redis (read every
50 ms) never above the cap, and no call timed out (``--job-timeout``: a call whose terminal frame
never came). The daemons' own runner breaker is off
(``--breaker-failures 0``), so that the failing replica keeps taking calls and the client's
policy alone decides how many it gets; ``--server-breaker`` leaves it on.

**kill**. ``--kill-replicas`` replicas under a fleet cap below the sum of their slots
(``--kill-fleet-max-inflight``, by default all but one replica's slots), leases living
``--lease-ttl`` seconds, jobs of about ``--kill-job-ms`` that stream a first token as they start
(so that a caller knows its job was admitted). ``--kill-clients`` FleetClients keep the fleet
full. Every ``--sample-ms`` a sampler reads Redis (in one MULTI: its clock and every lease with
its expiry; a lease is live while its expiry is ahead, as ``RedisStore.inflight`` counts them,
and its id names its replica) and each live replica's ``/metrics`` (``governor_fleet_leases``,
``governor_fleet_inflight``, ``governor_inflight``). After ``--kill-at`` seconds the replica
holding the most leases gets SIGKILL, by its PID; the run goes on until Redis holds none of its
leases, then ``--after-kill`` seconds more. The checks (any one failing: exit status 1):

- the cap: the live leases in Redis never above it; no replica's ``governor_fleet_inflight``
  (the store's count at its latest answer) above it; and the jobs running at once never above
  it, counted from the replicas' own job log lines (each job's end and how long it held its
  slot, on one machine's clock; each job's interval shortened by :data:`LOG_SLACK_S` at both
  ends, the precision of a log line's time and of a measured length). A replica's
  ``governor_inflight`` also counts jobs still asking the store, so only its own slots bound it.
  The live replicas' ``governor_fleet_leases`` added up are reported, not judged: the replicas
  are read apart (concurrently, but on a loaded machine tens of milliseconds apart), so a lease
  handed from one replica to another between two reads is counted twice, in one round or in
  several running (sums of 9 to 11 under a cap of 8 with two cores busy, while the job logs
  showed never more than 8 jobs running at once).
- the leases: none of the killed replica's seen live in Redis later than ``--lease-ttl`` after the
  kill (Redis's own clock, give or take one sampling interval), and none left at the end.
- the jobs: none timed out (an admitted job that never got its terminal frame would); jobs lost
  with the killed replica (output begun, then the connection broke) no more than its slots, all
  admitted before the kill; jobs done on the survivors after the kill (its callers moved).

With ``--json``, the last line of stdout is the report as JSON (``--report`` writes it to a
file too). Exit status
0 when every check held, 1 when one failed, 2 when the processes could not be started. Traffic
goes to 127.0.0.1 only; every process started here is stopped by its own PID.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import itertools
import json
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clients.client import ClientError, GovernorClient, RetryBudget, RetryPolicy
from clients.fleet import (
    Address,
    Ejection,
    FleetClient,
    NoReplicaAvailable,
    Replicas,
    ReplicaState,
)
from clients.helptext import RawDescriptionDefaultsHelpFormatter
from governor.fleetstore import RedisStore
from protocol.codes import ErrorCode, Status
from protocol.frames import Reply
from protocol.spec import JobSpec

from ..support.connections import run_loop
from ..support.options import positive_float, positive_int, print_json
from ..support.redisserver import RedisServer
from ..support.replicas import Gauges, Replica, by_label, replica_set

NAME = "fleet"
PHASES = ("seed", "kill")
POLICIES = ("naive", "breaker", "breaker-shared")
SEED_SAMPLE_S = 0.05  # the seed phase only watches the cap in Redis: a lighter sampler
ERROR_PAUSE_S = 0.05  # after a job that reached no replica, before the next: no busy loop
KILL_PROMPT_MS = 10  # the kill phase's jobs: the first token after this, the rest streamed
KILL_TOKENS = 8
# A job log line's time and a job's measured length are each good to a few ms (two clocks).
LOG_SLACK_S = 0.01
# Flow control is paced by the hints and bounded by the job's timeout, not by a count: a caller
# of a full fleet may be told to wait many times.
YIELD_RETRY = RetryPolicy(max_attempts=100_000, max_sleep_s=1.0)
SEED_SPEC = JobSpec(prompt="retry storm", max_new_tokens=1, temperature=0.0)
FAILING = "r0"  # the seed phase's failing replica
KILL_SPEC = JobSpec(prompt="kill -9", max_new_tokens=KILL_TOKENS, temperature=0.0, stream=True)


# Pure: parsing --------------------------------------------------------------------------------


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


# Pure: the seed phase ------------------------------------------------------------------------


def call_failed(reply: Reply) -> bool:
    """Whether a call ended in a failure of the replica's backend: a wasted call."""
    return reply.status == Status.ABORT and reply.error_code == ErrorCode.BACKEND_ERROR


@dataclass
class Tally:
    """One policy's calls and jobs, from what its callers saw."""

    jobs: int = 0
    done: int = 0
    failed: int = 0  # given up: no try left, the retry budget spent, or no replica
    calls: int = 0  # attempts a replica ran to a terminal frame
    wasted: int = 0  # of those, aborted by its backend
    yields: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)

    def seen(self, sent_at: float, reply: Reply) -> None:
        """``on_attempt``: every attempt's answer, on whichever replica."""
        if reply.status == Status.YIELD:
            self.yields[reply.need_code or "yield"] += 1
        elif reply.terminal:
            self.calls += 1
            self.wasted += call_failed(reply)

    def ended(self, done: bool) -> None:
        self.jobs += 1
        if done:
            self.done += 1
        else:
            self.failed += 1

    def as_dict(self, seconds: float) -> dict[str, Any]:
        return {
            "jobs": self.jobs,
            "done": self.done,
            "failed": self.failed,
            "calls": self.calls,
            "wasted_calls": self.wasted,
            "wasted_share": round(self.wasted / self.calls, 4) if self.calls else None,
            "yields": sum(self.yields.values()),
            "yields_by_code": dict(sorted(self.yields.items())),
            "errors": dict(sorted(self.errors.items())),
            "goodput_per_s": round(self.done / seconds, 2) if seconds > 0 else None,
        }


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    if b == 0:
        return None if a == 0 else float("inf")
    return round(a / b, 2)


def seed_table(runs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The seed phase's policies side by side."""
    names = list(runs)
    first = names[0] if names else ""
    rows: list[tuple[str, list[Any]]] = [
        ("calls", [runs[p]["calls"] for p in names]),
        ("wasted calls", [runs[p]["wasted_calls"] for p in names]),
        ("  (failing replica's count)", [runs[p]["server"]["failing_calls"] for p in names]),
        ("wasted share", [runs[p]["wasted_share"] for p in names]),
        ("yields", [runs[p]["yields"] for p in names]),
        ("jobs done", [runs[p]["done"] for p in names]),
        ("goodput (jobs/s)", [runs[p]["goodput_per_s"] for p in names]),
        ("failed jobs", [runs[p]["failed"] for p in names]),
        (
            f"wasted: {first} / this",
            [ratio(runs[first]["wasted_calls"], runs[p]["wasted_calls"]) for p in names],
        ),
    ]
    width = max(16, *(len(p) for p in names)) if names else 16
    lines = [f"{'':30}" + "".join(f"{p:>{width}}" for p in names)]
    for label, values in rows:
        lines.append(f"{label:30}" + "".join(f"{_cell(v):>{width}}" for v in values))
    return lines


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# Pure: the kill phase's verdicts -------------------------------------------------------------


@dataclass
class JobRecord:
    """One kill-phase job, as its caller saw it."""

    caller: int
    started: float
    admitted: float | None = None  # its first token came (it runs on a lease)
    ended: float | None = None
    outcome: str = "running"  # done, abort:CODE, yield, lost, timeout, no_replica, error
    replica: str | None = None  # the replica that gave its last reply
    tried: tuple[str, ...] = ()

    @property
    def terminal(self) -> bool:
        return self.outcome == "done" or self.outcome.startswith("abort")


def job_intervals(lines: Iterable[str]) -> list[tuple[float, float]]:
    """Each finished job's slot-holding interval (start, end; seconds on the wall clock), from
    a replica's JSON log: its job line's time and ``e2e_ms``."""
    found = []
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") != "job" or record.get("e2e_ms") is None:
            continue
        end = datetime.datetime.fromisoformat(record["ts"]).timestamp()
        found.append((end - record["e2e_ms"] / 1000, end))
    return found


def most_at_once(intervals: Iterable[tuple[float, float]], slack_s: float) -> int:
    """The most intervals open at one instant, each shortened by ``slack_s`` at both ends."""
    edges = sorted(
        edge
        for start, end in intervals
        if end - start > 2 * slack_s
        for edge in ((start + slack_s, 1), (end - slack_s, -1))
    )  # (an end sorts before a start at the same instant)
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def cap_verdict(
    rounds: Sequence[Round], cap: int, slots: Mapping[str, int], jobs_at_once: int
) -> dict[str, Any]:
    """The fleet cap as the store, the replicas' job logs and their gauges saw it (module
    docstring)."""
    redis_max = max((r.leases.count for r in rounds), default=0)
    sums = [sum(g.fleet_leases for g in r.replicas.values() if g) for r in rounds]
    held = [min(a, b) for a, b in itertools.pairwise(sums)]  # two rounds running
    fleet_inflight = max(
        (g.fleet_inflight for r in rounds for g in r.replicas.values() if g), default=0
    )
    inflight = {
        name: max((g.inflight for r in rounds if (g := r.replicas.get(name))), default=0)
        for name in slots
    }
    leases = {
        name: max((g.fleet_leases for r in rounds if (g := r.replicas.get(name))), default=0)
        for name in slots
    }
    return {
        "cap": cap,
        "rounds": len(rounds),
        "max_redis": redis_max,
        "max_replicas_sum": max(sums, default=0),
        "max_replicas_sum_two_rounds": max(held, default=0),
        "rounds_replicas_sum_over_cap": sum(1 for s in sums if s > cap),
        "max_fleet_inflight_reported": fleet_inflight,
        "max_leases_by_replica": leases,
        "max_inflight_by_replica": inflight,
        "max_jobs_at_once": jobs_at_once,
        "held": redis_max <= cap
        and jobs_at_once <= cap
        and fleet_inflight <= cap
        and all(inflight[n] <= slots[n] for n in slots),
    }


def store_cap_verdict(rounds: Sequence[Round], cap: int) -> dict[str, Any]:
    """The fleet cap as the store alone saw it (the seed phase scrapes no replica)."""
    most = max((r.leases.count for r in rounds), default=0)
    return {"cap": cap, "rounds": len(rounds), "max_redis": most, "held": most <= cap}


def freed_verdict(
    rounds: Sequence[Round], victim: str, kill_ms: int, ttl_s: float, slack_s: float
) -> dict[str, Any]:
    """When the killed replica's leases left the store, on Redis's clock from the kill."""
    after = [r.leases for r in rounds if r.leases.now_ms >= kill_ms]
    live = [s for s in after if s.live.get(victim)]
    free = [s for s in after if not s.live.get(victim)]
    at_kill = after[0].live.get(victim, 0) if after else None
    expiry = max((s.expiry_ms.get(victim, 0) for s in live), default=None)
    last_live = (live[-1].now_ms - kill_ms) / 1000 if live else None
    first_free = (free[0].now_ms - kill_ms) / 1000 if free else None
    gone = bool(after) and not after[-1].live.get(victim)
    return {
        "lease_ttl_s": ttl_s,
        "leases_at_kill": at_kill,
        "expired_after_s": None if expiry is None else round((expiry - kill_ms) / 1000, 3),
        "last_seen_live_after_s": None if last_live is None else round(last_live, 3),
        "first_seen_free_after_s": None if first_free is None else round(first_free, 3),
        "gone_at_end": gone,
        "held": gone and (last_live is None or last_live <= ttl_s + slack_s),
    }


def jobs_verdict(
    jobs: Sequence[JobRecord], victim: str, kill_t: float, victim_slots: int
) -> dict[str, Any]:
    """Where the jobs ended, around the kill (module docstring)."""
    admitted = [j for j in jobs if j.admitted is not None]
    lost = [j for j in jobs if j.outcome == "lost"]
    hung = [j for j in jobs if j.outcome == "timeout"]
    unanswered = [j for j in admitted if not j.terminal and j.outcome not in ("lost", "timeout")]
    after = [j for j in jobs if j.ended is not None and j.ended > kill_t]
    done_after: dict[str, int] = collections.Counter(
        j.replica for j in after if j.outcome == "done" and j.replica
    )
    terminal_by_replica: dict[str, int] = collections.Counter(
        j.replica for j in jobs if j.terminal and j.replica
    )
    moved = [j for j in after if victim in j.tried and j.replica != victim and j.terminal]
    survivors_done = sum(n for r, n in done_after.items() if r != victim)
    lost_ok = len(lost) <= victim_slots and all(
        j.admitted is not None and j.admitted <= kill_t for j in lost
    )
    return {
        "jobs": len(jobs),
        "admitted": len(admitted),
        "terminal": sum(1 for j in jobs if j.terminal),
        "terminal_by_replica": dict(sorted(terminal_by_replica.items())),
        "lost_with_killed": len(lost),
        "timed_out": len(hung),
        "admitted_without_terminal": len(unanswered),
        "outcomes": dict(sorted(collections.Counter(j.outcome for j in jobs).items())),
        "done_after_kill_by_replica": dict(sorted(done_after.items())),
        "moved_off_killed": len(moved),
        "held": not hung and not unanswered and lost_ok and survivors_done > 0,
    }


def failures(report: Mapping[str, Any]) -> list[str]:
    """The checks that failed, in words (none: exit status 0)."""
    out: list[str] = []
    for policy, run in report.get("seed", {}).get("policies", {}).items():
        if not run["cap"]["held"]:
            out.append(
                f"seed {policy}: {run['cap']['max_redis']} leases over cap {run['cap']['cap']}"
            )
        if hung := run["errors"].get("TimeoutError", 0):
            out.append(f"seed {policy}: {hung} call(s) timed out, no terminal frame in time")
    kill = report.get("kill")
    if kill:
        if not kill["cap"]["held"]:
            out.append(f"kill: the fleet cap {kill['cap']['cap']} did not hold: {kill['cap']}")
        if not kill["leases"]["held"]:
            out.append(
                f"kill: the killed replica's leases were not freed in time: {kill['leases']}"
            )
        if not kill["jobs"]["held"]:
            out.append(f"kill: an admitted job did not end, or none moved: {kill['jobs']}")
    return out


# IO: the store -------------------------------------------------------------------------------


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


# IO: the seed phase's callers ----------------------------------------------------------------


class NaiveCaller:
    """A replica drawn at random for each call; a failed call tried again at once elsewhere at
    random, ``tries`` calls per job at most. One connection per replica, opened as needed."""

    def __init__(self, addresses: Sequence[Address], tries: int, rng: random.Random) -> None:
        self.addresses = addresses
        self.tries = tries
        self.rng = rng
        self.clients: dict[int, GovernorClient] = {}

    async def job(self, spec: JobSpec, tally: Tally, timeout: float) -> bool:
        for _ in range(self.tries):
            i = self.rng.randrange(len(self.addresses))
            try:
                client = await self._client(i)
                result = await client.generate(
                    spec, retry=YIELD_RETRY, timeout=timeout, on_attempt=tally.seen
                )
            except (ClientError, OSError, TimeoutError) as exc:
                tally.errors[type(exc).__name__] += 1
                await self._drop(i)
                continue
            if result.done:
                return True
        return False

    async def _client(self, i: int) -> GovernorClient:
        client = self.clients.get(i)
        if client is None or client.closed:
            await self._drop(i)
            a = self.addresses[i]
            client = self.clients[i] = await GovernorClient.connect(a.host, a.port, timeout=5.0)
        return client

    async def _drop(self, i: int) -> None:
        client = self.clients.pop(i, None)
        if client is not None:
            await client.close()

    async def close(self) -> None:
        for i in list(self.clients):
            await self._drop(i)


class BreakerCaller:
    """A :class:`FleetClient`: its own view of the replicas, or one shared with others."""

    def __init__(self, fleet: FleetClient) -> None:
        self.fleet = fleet

    async def job(self, spec: JobSpec, tally: Tally, timeout: float) -> bool:
        try:
            result = await self.fleet.generate(
                spec, retry=YIELD_RETRY, timeout=timeout, on_attempt=tally.seen
            )
        except (ClientError, OSError, TimeoutError) as exc:  # NoReplicaAvailable included
            tally.errors[type(exc).__name__] += 1
            await asyncio.sleep(ERROR_PAUSE_S)
            return False
        return result.done

    async def close(self) -> None:
        await self.fleet.close()


Caller = NaiveCaller | BreakerCaller


def callers_for(
    policy: str, addresses: Sequence[Address], count: int, tries: int, seed: int
) -> list[Caller]:
    rngs = [random.Random(f"{seed}:{policy}:{i}") for i in range(count)]
    if policy == "naive":
        return [NaiveCaller(addresses, tries, rng) for rng in rngs]
    if policy == "breaker":
        return [
            BreakerCaller(FleetClient(Replicas(addresses, rng=rng), retry_budget=RetryBudget()))
            for rng in rngs
        ]
    if policy == "breaker-shared":
        shared = Replicas(addresses, ejection=Ejection(), rng=random.Random(f"{seed}:shared"))
        budget = RetryBudget()
        return [BreakerCaller(FleetClient(shared, retry_budget=budget, rng=rng)) for rng in rngs]
    raise ValueError(f"unknown policy {policy!r}")


async def seed_policy(args: argparse.Namespace, policy: str, folder: Path) -> dict[str, Any]:
    """One policy on fresh replicas and a fresh Redis."""
    cap = args.fleet_max_inflight or (args.replicas - 1) * args.max_inflight
    with RedisServer() as redis:
        common = [
            *("--redis-url", redis.url, "--fleet-max-inflight", str(cap)),
            *("--stub-ms", str(args.stub_ms)),
            *(() if args.server_breaker else ("--breaker-failures", "0")),
        ]
        specs = [
            (f"r{i}", args.max_inflight, [*common, *(("--stub-fail-rate", "1") if i == 0 else ())])
            for i in range(args.replicas)
        ]
        async with replica_set(folder, specs) as replicas:
            store = RedisStore(redis.url)
            addresses = [r.address for r in replicas]
            callers = callers_for(policy, addresses, args.clients, args.tries, args.seed)
            tally = Tally()
            try:
                async with sampling(store, replicas, SEED_SAMPLE_S, scrape=False) as rounds:
                    started = time.monotonic()
                    deadline = started + args.duration

                    async def keep_busy(caller: Caller) -> None:
                        while time.monotonic() < deadline:
                            tally.ended(await caller.job(SEED_SPEC, tally, args.job_timeout))

                    await asyncio.gather(*(keep_busy(c) for c in callers))
                    seconds = time.monotonic() - started
            finally:
                await asyncio.gather(*(c.close() for c in callers), return_exceptions=True)
                await store.close()
            scraped = await asyncio.gather(*(r.metrics() for r in replicas))
    finished = {
        r.name: by_label(s or [], "governor_jobs_finished_total", "outcome")
        for r, s in zip(replicas, scraped, strict=True)
    }
    out = tally.as_dict(seconds)
    out["seconds"] = round(seconds, 2)
    out["cap"] = store_cap_verdict(rounds, cap)
    out["server"] = {
        "calls": int(sum(sum(f.values()) for f in finished.values())),
        "failing_calls": int(sum(finished.get(FAILING, {}).values())),
        "finished_by_replica": {n: {k: int(v) for k, v in f.items()} for n, f in finished.items()},
    }
    return out


async def seed_phase(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    runs: dict[str, dict[str, Any]] = {}
    for policy in args.policies:
        print(f"fleet seed: {policy} ...", file=sys.stderr, flush=True)
        runs[policy] = await seed_policy(args, policy, folder)
    naive = runs.get("naive")
    return {
        "replicas": args.replicas,
        "failing": FAILING,
        "max_inflight": args.max_inflight,
        "fleet_max_inflight": args.fleet_max_inflight or (args.replicas - 1) * args.max_inflight,
        "stub_ms": args.stub_ms,
        "clients": args.clients,
        "duration_s": args.duration,
        "tries": args.tries,
        "server_breaker": args.server_breaker,
        "policies": runs,
        "wasted_ratio_naive_over": {
            p: ratio(naive["wasted_calls"], r["wasted_calls"])
            for p, r in runs.items()
            if naive is not None and p != "naive"
        },
    }


# IO: the kill phase --------------------------------------------------------------------------


async def kill_phase(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    n, slots, ttl = args.kill_replicas, args.kill_max_inflight, args.lease_ttl
    cap = args.kill_fleet_max_inflight or (n - 1) * slots
    output_ms = max(args.kill_job_ms - KILL_PROMPT_MS, 0) / (KILL_TOKENS - 1)
    interval = args.sample_ms / 1000
    with RedisServer() as redis:
        flags = [
            *("--redis-url", redis.url, "--fleet-max-inflight", str(cap)),
            *("--lease-ttl", f"{ttl:g}", "--stub-ms", str(KILL_PROMPT_MS)),
            *("--stub-output-ms", f"{output_ms:g}"),
            *("--log-level", "info", "--log-format", "json"),  # (each job's line: the cap)
        ]
        specs = [(f"r{i}", slots, flags) for i in range(n)]
        async with replica_set(folder, specs) as replicas:
            names = {r.address.name: r.name for r in replicas}
            store = RedisStore(redis.url)
            fleets = [
                FleetClient(
                    Replicas([r.address for r in replicas], rng=random.Random(f"{args.seed}:{i}")),
                    retry_budget=RetryBudget(),
                )
                for i in range(args.kill_clients)
            ]
            jobs: list[JobRecord] = []
            try:
                async with (
                    sampling(store, replicas, interval, scrape=True) as rounds,
                    callers_running(fleets, names, args.job_timeout, jobs),
                ):
                    victim, kill_t, kill_ms = await kill_busiest(args, replicas, rounds, store)
                ejected = sum(
                    1
                    for f in fleets
                    if f.replicas.state(victim.address.name) == ReplicaState.EJECTED
                )
            finally:
                await asyncio.gather(*(f.close() for f in fleets), return_exceptions=True)
                await store.close()
    return {
        "replicas": n,
        "max_inflight": slots,
        "fleet_max_inflight": cap,
        "lease_ttl_s": ttl,
        "job_ms": args.kill_job_ms,
        "clients": args.kill_clients,
        "sample_ms": args.sample_ms,
        "killed": victim.name,
        "killed_at_s": round(kill_t - rounds[0].leases.t, 3) if rounds else None,
        "cap": cap_verdict(
            rounds,
            cap,
            {r.name: r.slots for r in replicas},
            most_at_once(
                (
                    i
                    for r in replicas
                    for i in job_intervals(r.log.read_text(errors="replace").splitlines())
                ),
                LOG_SLACK_S,
            ),
        ),
        "leases": freed_verdict(rounds, victim.name, kill_ms, ttl, interval),
        "jobs": jobs_verdict(jobs, victim.name, kill_t, victim.slots)
        | {"callers_that_ejected_killed": ejected},
    }


async def kill_busiest(
    args: argparse.Namespace, replicas: Sequence[Replica], rounds: list[Round], store: RedisStore
) -> tuple[Replica, float, int]:
    """After ``--kill-at`` seconds, SIGKILL the replica holding the most leases; go on until the
    store holds none of its leases (or well past their time), then ``--after-kill`` seconds
    more. The replica killed, and when: on this loop's clock and on Redis's (ms)."""
    loop = asyncio.get_running_loop()
    ttl, interval = args.lease_ttl, args.sample_ms / 1000
    await asyncio.sleep(args.kill_at)
    latest = rounds[-1].leases.live if rounds else {}
    victim = max(replicas, key=lambda r: (latest.get(r.name, 0), r.name))
    print(
        f"fleet kill: SIGKILL {victim.name} (pid {victim.proc.pid}) holding "
        f"{latest.get(victim.name, 0)} lease(s)",
        file=sys.stderr,
        flush=True,
    )
    victim.kill()
    kill_t = loop.time()
    kill_ms = await redis_now_ms(store)
    give_up = kill_t + ttl + max(5.0, 2 * ttl)
    while loop.time() < give_up:
        await asyncio.sleep(interval)
        last = rounds[-1].leases
        if last.now_ms > kill_ms and not last.live.get(victim.name):
            break
    await asyncio.sleep(args.after_kill)
    return victim, kill_t, kill_ms


@contextlib.asynccontextmanager
async def callers_running(
    fleets: Sequence[FleetClient], names: Mapping[str, str], timeout: float, jobs: list[JobRecord]
) -> AsyncIterator[None]:
    """Each of ``fleets`` sending kill-phase jobs back to back, each job recorded in ``jobs``;
    on leaving, no new job starts and those running get ``timeout`` and a margin to end."""
    stopping = asyncio.Event()
    tasks = [
        asyncio.create_task(keep_calling(i, fleet, names, timeout, jobs, stopping))
        for i, fleet in enumerate(fleets)
    ]
    try:
        yield
    finally:
        stopping.set()
        _, pending = await asyncio.wait(tasks, timeout=timeout + 5)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def keep_calling(
    i: int,
    fleet: FleetClient,
    names: Mapping[str, str],
    timeout: float,
    jobs: list[JobRecord],
    stopping: asyncio.Event,
) -> None:
    """Caller ``i``: one job after another until ``stopping``, each ending as its
    :class:`JobRecord` says (an admitted job whose connection broke is ``lost``)."""
    loop = asyncio.get_running_loop()
    while not stopping.is_set():
        job = JobRecord(i, loop.time())

        def first(_: str, job: JobRecord = job) -> None:
            if job.admitted is None:
                job.admitted = loop.time()

        try:
            result = await fleet.generate(
                KILL_SPEC, retry=YIELD_RETRY, timeout=timeout, on_delta=first
            )
        except TimeoutError:
            job.outcome = "timeout"
        except NoReplicaAvailable:
            job.outcome = "no_replica"
        except (ClientError, OSError):
            job.outcome = "lost" if job.admitted is not None else "error"
        else:
            reply = result.reply
            job.outcome = (
                f"{reply.status}:{reply.need_code}"
                if reply.status == Status.ABORT
                else str(reply.status)
            )
            job.replica = names.get(result.replica, result.replica)
            job.tried = tuple(names.get(t, t) for t in result.tried)
        job.ended = loop.time()
        jobs.append(job)
        if job.outcome in ("no_replica", "error"):
            await asyncio.sleep(ERROR_PAUSE_S)


# The command ---------------------------------------------------------------------------------


def policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"policies are among {', '.join(POLICIES)}")
    return names


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME,
        help="a retry storm on real replicas and Redis: naive retries vs a breaker; kill -9 one",
        description=__doc__,
        formatter_class=RawDescriptionDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--phase", choices=(*PHASES, "both"), default="both", help="the phases to run"
    )
    parser.add_argument("--seed", type=int, default=0, help="of the callers' draws")
    parser.add_argument("--report", type=Path, help="write the JSON report here too")
    parser.add_argument(
        "--job-timeout", type=positive_float, default=30.0, help="seconds a job may take"
    )
    seed = parser.add_argument_group("seed phase")
    seed.add_argument(
        "--replicas", type=positive_int, default=4, help=f"replicas, {FAILING} failing every job"
    )
    seed.add_argument("--max-inflight", type=positive_int, default=4, help="each replica's slots")
    seed.add_argument(
        "--fleet-max-inflight",
        type=positive_int,
        help="the fleet cap (default: the healthy replicas' slots)",
    )
    seed.add_argument("--stub-ms", type=positive_int, default=100, help="each call's length")
    seed.add_argument(
        "--clients", type=positive_int, default=32, help="callers running jobs back to back"
    )
    seed.add_argument("--duration", type=positive_float, default=15.0, help="seconds per policy")
    seed.add_argument("--tries", type=positive_int, default=5, help="naive: calls per job")
    seed.add_argument(
        "--policies",
        type=policies,
        default=list(POLICIES),
        help="comma-separated, run in turn",
    )
    seed.add_argument(
        "--server-breaker",
        action="store_true",
        help="leave the daemons' own runner breaker on (default: --breaker-failures 0)",
    )
    kill = parser.add_argument_group("kill phase")
    kill.add_argument("--kill-replicas", type=positive_int, default=3, help="replicas")
    kill.add_argument(
        "--kill-max-inflight", type=positive_int, default=4, help="each replica's slots"
    )
    kill.add_argument(
        "--kill-fleet-max-inflight",
        type=positive_int,
        help="the fleet cap (default: all but one replica's slots)",
    )
    kill.add_argument(
        "--lease-ttl", type=positive_float, default=2.0, help="seconds a lease lives unrenewed"
    )
    kill.add_argument(
        "--kill-clients", type=positive_int, default=16, help="FleetClients keeping the fleet full"
    )
    kill.add_argument("--kill-job-ms", type=positive_int, default=500, help="each job's length")
    kill.add_argument("--kill-at", type=positive_float, default=4.0, help="seconds into the run")
    kill.add_argument(
        "--after-kill",
        type=positive_float,
        default=3.0,
        help="seconds on after its leases are gone",
    )
    kill.add_argument("--sample-ms", type=positive_int, default=20, help="sampling interval")


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"command": NAME}
    with tempfile.TemporaryDirectory(prefix="loadtest-fleet-") as tmp:
        folder = Path(tmp)
        if args.phase in ("seed", "both"):
            report["seed"] = await seed_phase(args, folder)
        if args.phase in ("kill", "both"):
            print("fleet kill: ...", file=sys.stderr, flush=True)
            report["kill"] = await kill_phase(args, folder)
    report["failures"] = failures(report)
    return report


def summary(report: Mapping[str, Any]) -> list[str]:
    lines: list[str] = []
    seed = report.get("seed")
    if seed:
        lines.append(
            f"seed (retry storm): {seed['replicas']} replicas x {seed['max_inflight']} slots, "
            f"fleet cap {seed['fleet_max_inflight']}, {seed['failing']} failing every call; "
            f"{seed['clients']} callers x {seed['duration_s']:g} s per policy, "
            f"{seed['stub_ms']} ms calls"
        )
        lines += seed_table(seed["policies"])
    kill = report.get("kill")
    if kill:
        cap, leases, jobs = kill["cap"], kill["leases"], kill["jobs"]
        lines += [
            f"kill -9: {kill['replicas']} replicas x {kill['max_inflight']} slots, fleet cap "
            f"{cap['cap']}, lease_ttl {kill['lease_ttl_s']:g} s, {kill['clients']} callers; "
            f"{kill['killed']} killed at {kill['killed_at_s']} s",
            f"  cap: max {cap['max_redis']} live leases in Redis, max {cap['max_jobs_at_once']} "
            f"jobs running at once by the replicas' logs ({cap['max_replicas_sum']} over their "
            f"governor_fleet_leases, read apart), {cap['rounds']} rounds: "
            + ("held" if cap["held"] else "EXCEEDED"),
            f"  leases: {leases['leases_at_kill']} held at the kill, expired "
            f"{leases['expired_after_s']} s after it, last seen live at "
            f"{leases['last_seen_live_after_s']} s, first seen gone at "
            f"{leases['first_seen_free_after_s']} s: "
            + ("freed" if leases["held"] else "NOT FREED"),
            f"  jobs: {jobs['admitted']} admitted, {jobs['terminal']} ended with a terminal frame, "
            f"{jobs['lost_with_killed']} lost with the killed replica, {jobs['timed_out']} timed "
            f"out; done after the kill {jobs['done_after_kill_by_replica']}, "
            f"{jobs['moved_off_killed']} moved off it, "
            f"{jobs['callers_that_ejected_killed']}/{kill['clients']} callers ejected it: "
            + ("ok" if jobs["held"] else "FAILED"),
        ]
    lines += [f"FAILED: {f}" for f in report.get("failures", [])]
    return lines


def run(args: argparse.Namespace) -> int:
    try:
        report = run_loop(measure(args))
    except (OSError, RuntimeError) as exc:  # a replica or Redis that would not start
        print(f"loadtest {NAME}: {exc}", file=sys.stderr)
        return 2
    print("\n".join(summary(report)))
    if args.report is not None:
        try:
            args.report.write_text(json.dumps(report, indent=2) + "\n")
        except OSError as exc:
            print(f"loadtest {NAME}: cannot write {args.report}: {exc}", file=sys.stderr)
            return 2
    print_json(args, report)
    return 1 if report["failures"] else 0
