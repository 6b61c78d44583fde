"""``bench fleet``'s seed phase, the retry storm: callers of a fleet with one failing replica,
retrying naively or behind a breaker, and their tallies."""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clients.client import ClientError, GovernorClient, RetryBudget
from clients.fleet import (
    Address,
    Ejection,
    FleetClient,
    Replicas,
)
from governor.fleetstore import RedisStore
from protocol.codes import ErrorCode, Status
from protocol.frames import Reply
from protocol.spec import JobSpec

from ...support.redisserver import RedisServer
from ...support.replicas import by_label, replica_set
from .leases import ERROR_PAUSE_S, YIELD_RETRY, sampling, store_cap_verdict

POLICIES = ("naive", "breaker", "breaker-shared")
SEED_SAMPLE_S = 0.05  # the seed phase only watches the cap in Redis: a lighter sampler
SEED_SPEC = JobSpec(prompt="retry storm", max_new_tokens=1, temperature=0.0)
FAILING = "r0"  # the seed phase's failing replica


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
            *("--fleet-timeout", f"{args.fleet_timeout:g}"),
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
