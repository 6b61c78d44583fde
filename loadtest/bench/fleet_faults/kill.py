"""``bench fleet``'s kill phase: ``kill -9`` of the busiest replica mid-run, and the verdicts on
the cap, its leases and every admitted job."""

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
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clients.client import ClientError, RetryBudget
from clients.fleet import (
    FleetClient,
    NoReplicaAvailable,
    Replicas,
    ReplicaState,
)
from governor.fleetstore import RedisStore
from protocol.codes import Status
from protocol.spec import JobSpec

from ...support.redisserver import RedisServer
from ...support.replicas import Replica, replica_set
from .leases import ERROR_PAUSE_S, YIELD_RETRY, Round, redis_now_ms, sampling

KILL_PROMPT_MS = 10  # the kill phase's jobs: the first token after this, the rest streamed
KILL_TOKENS = 8
# A job log line's time and a job's measured length are each good to a few ms (two clocks).
LOG_SLACK_S = 0.01
KILL_SPEC = JobSpec(prompt="kill -9", max_new_tokens=KILL_TOKENS, temperature=0.0, stream=True)


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
    """The fleet cap as the store, the replicas' job logs and their gauges saw it (the
    package's docstring)."""
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
    """Where the jobs ended, around the kill (the package's docstring)."""
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


async def kill_phase(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    n, slots, ttl = args.kill_replicas, args.kill_max_inflight, args.lease_ttl
    cap = args.kill_fleet_max_inflight or (n - 1) * slots
    output_ms = max(args.kill_job_ms - KILL_PROMPT_MS, 0) / (KILL_TOKENS - 1)
    interval = args.sample_ms / 1000
    with RedisServer() as redis:
        flags = [
            *("--redis-url", redis.url, "--fleet-max-inflight", str(cap)),
            *("--fleet-timeout", f"{args.fleet_timeout:g}"),
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
