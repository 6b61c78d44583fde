"""``fleet-bench``: what the fleet's store costs and what it holds, on real processes and Redis.

Five measures, each on its own fresh replicas (``governor serve --runner stub``, stopped by
their PIDs) and a Redis of its own:

- ``latency``: what a Redis call adds to an admission. The store's script alone (as the daemon
  calls it), then one client's sequential jobs (``--stub-ms 0``) on a replica with and without
  ``--redis-url``, in alternating blocks so that the machine's noise falls on both.
- ``cap``: three replicas, 300 clients racing for a fleet cap below the replicas' own; the
  store's count of leases is sampled every 2 ms and each replica's ``governor_fleet_leases``
  every 50 ms: neither may ever exceed the cap.
- ``tenants``: a noisy tenant spread over three replicas, held to its fleet-wide rate, while a
  quiet one runs beside it.
- ``throughput``: jobs per second of three replicas sharing Redis against three independent
  governors, with the same clients.
- ``backoff``: three replicas sharing Redis with no fleet cap, saturated by a burst of
  ``--backoff-jobs`` jobs at once, each from its own multi-replica client (or from
  ``--backoff-clients`` of them); clients that back off as one when a yield says the fleet is
  saturated, against clients that try each replica on its own
  (``Replicas(fleet_wide=False)``), in turn for ``--rounds``: attempts per job, when the last
  job ended, and the jobs' times.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import uvloop

from clients.client import GovernorClient, RetryPolicy
from clients.fleet import FleetClient, Replicas
from clients.fleet.addresses import Address
from clients.helptext import RawDescriptionDefaultsHelpFormatter
from governor.core.fleetgate import FleetGate, FleetSettings
from governor.core.tenants import TenantConfig
from governor.fleetstore import RedisStore

from ..support.options import print_json
from ..support.redisserver import RedisServer
from ..support.replicas import Replica, by_label, replica_set
from ..support.stats import percentile

NAME = "fleet-bench"
MEASURES = ("latency", "cap", "tenants", "throughput", "backoff")


# Replicas -----------------------------------------------------------------------------------


def replicas(folder: Path, n: int, slots: int, *flags: str) -> Any:
    """``async with replicas(...) as started``: n stub replicas with the same flags
    (:func:`loadtest.support.replicas.replica_set`: started together, stopped by their PIDs)."""
    return replica_set(folder, [(f"r{i}", slots, flags) for i in range(n)])


# Clients ------------------------------------------------------------------------------------


@dataclass
class Tally:
    done: int = 0
    latencies: list[float] = field(default_factory=list)
    yields: collections.Counter[str] = field(default_factory=collections.Counter)


async def closed_loop(
    addr: str,
    tally: Tally,
    until: float,
    *,
    api_key: str | None = None,
    attempts: int = 50,
    pace_s: float = 0.0,
) -> None:
    """One connection: jobs one after the other until ``until`` (monotonic), each retried on
    yield as its hints say."""
    host, port = addr.rsplit(":", 1)
    async with await GovernorClient.connect(host, int(port), api_key=api_key) as client:
        while time.monotonic() < until:
            started = time.monotonic()
            result = await client.upload(
                b"x", inline=True, retry=RetryPolicy(max_attempts=attempts, max_sleep_s=1.0)
            )
            for y in result.yields:
                tally.yields[str(y.need_code)] += 1
            if result.done:
                tally.done += 1
                tally.latencies.append(time.monotonic() - started)
            if pace_s:
                await asyncio.sleep(max(0.0, started + pace_s - time.monotonic()))


def _ms(values: Sequence[float], p: float) -> float | None:
    return round(percentile(values, p) * 1000, 3) if values else None


# The measures -------------------------------------------------------------------------------


async def measure_latency(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    with RedisServer() as redis:
        store = RedisStore(redis.url)
        gate = FleetGate(FleetSettings(replica_id="bench"), time.monotonic)
        tenant = TenantConfig(name="t", key_sha256="0" * 64, requests_per_s=1e6)
        script: list[float] = []
        try:
            for _ in range(args.latency_jobs):
                lease = gate.lease("t", "-")
                ask = gate.question(lease, tenant, 10, 1.0)
                started = time.perf_counter()
                await store.acquire(ask, ttl_ms=10_000, cap=1_000_000, replica="bench")
                script.append(time.perf_counter() - started)
                await store.release([lease], replica="bench", ready_ms=0)
        finally:
            await store.close()
        times: dict[str, list[float]] = {"without": [], "with": []}
        async with (
            replicas(folder, 1, 4, "--stub-ms", "0") as plain,
            replicas(folder, 1, 4, "--stub-ms", "0", "--redis-url", redis.url) as fleet,
        ):
            clients = {}
            for name, started in (("without", plain), ("with", fleet)):
                host, port = started[0].addr.rsplit(":", 1)
                clients[name] = await GovernorClient.connect(host, int(port))
            block = 100
            for _ in range(max(1, args.latency_jobs // block)):
                for name, client in clients.items():
                    for _ in range(block):
                        started_at = time.perf_counter()
                        result = await client.upload(b"x", inline=True)
                        assert result.done, result.reply
                        times[name].append(time.perf_counter() - started_at)
            for client in clients.values():
                await client.close()
    out: dict[str, Any] = {
        "store_script_ms": {"p50": _ms(script, 50), "p99": _ms(script, 99), "n": len(script)}
    }
    for name, values in times.items():
        out[f"job_{name}_redis_ms"] = {
            "p50": _ms(values, 50),
            "p99": _ms(values, 99),
            "n": len(values),
        }
    out["added_ms"] = {
        p: round(out["job_with_redis_ms"][p] - out["job_without_redis_ms"][p], 3)
        for p in ("p50", "p99")
    }
    return out


async def sample_cap(
    redis_url: str, fleet: Sequence[Replica], until: float
) -> tuple[int, int, int, int, float]:
    """(max leases in the store, max leases one replica held, max sum of the replicas' leases
    in two rounds running, samples, mean leases in the store) until ``until``. The store's
    count is exact; the replicas' sum is not (below)."""
    store = RedisStore(redis_url)
    most = most_one = most_replicas = samples = total = 0
    next_replicas, last_sum = 0.0, 0
    try:
        while time.monotonic() < until:
            count = await store.inflight()
            most, total, samples = max(most, count), total + count, samples + 1
            if time.monotonic() >= next_replicas:
                read = await asyncio.gather(*(r.gauges() for r in fleet))
                counts = [g.fleet_leases for g in read if g is not None]
                most_one = max(most_one, *counts, 0)
                # The replicas are read one after the other: a lease freed on one and taken
                # on the next between two reads is counted twice in one round, so a round
                # over the cap counts only when the next one is too (on a loaded machine,
                # with reads slower than a job, two rounds running may still count one twice:
                # the store's own count is the measure of the cap).
                most_replicas = max(most_replicas, min(sum(counts), last_sum))
                last_sum = sum(counts)
                next_replicas = time.monotonic() + 0.05
            await asyncio.sleep(0.002)
    finally:
        await store.close()
    return most, most_one, most_replicas, samples, total / max(samples, 1)


async def measure_cap(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    cap = args.fleet_cap
    with RedisServer() as redis:
        async with replicas(
            folder,
            3,
            args.max_inflight,
            *("--stub-ms", str(args.stub_ms)),
            *("--redis-url", redis.url, "--fleet-max-inflight", str(cap)),
            *("--fleet-timeout", str(args.fleet_timeout)),
            *("--max-connections", "1000", "--max-connections-per-source", "1000"),
        ) as fleet:
            tally = Tally()
            until = time.monotonic() + args.duration
            sampler = asyncio.create_task(sample_cap(redis.url, fleet, until))
            await asyncio.gather(
                *(closed_loop(fleet[i % 3].addr, tally, until) for i in range(args.clients))
            )
            most, most_one, most_replicas, samples, mean = await sampler
            answers: collections.Counter[str] = collections.Counter()
            for read in await asyncio.gather(*(r.metrics() for r in fleet)):
                answers.update(by_label(read or [], "governor_fleet_answers_total", "answer"))
    # A replica that found the store too slow (``fleet_timeout``) decides on its share of the
    # cap for a while, beside the others' leases in the store: the sum may pass the cap then,
    # by design (the lanes that fail open), and only then.
    on_share = int(answers["on_share"])
    return {
        "replicas": 3,
        "replica_max_inflight": args.max_inflight,
        "fleet_max_inflight": cap,
        "clients": args.clients,
        "max_leases_in_store": most,
        "max_leases_of_one_replica": most_one,
        "max_sum_of_replica_leases_two_rounds": most_replicas,
        "store_samples": samples,
        "mean_leases_in_store": round(mean, 2),
        "held": most <= cap and most_one <= cap,
        "fleet_answers": {k: int(v) for k, v in sorted(answers.items())},
        "admitted_on_share": on_share,
        "jobs_done": tally.done,
        "jobs_per_s": round(tally.done / args.duration, 1),
        "yields": dict(tally.yields),
    }


def _tenant(name: str, key: str, rate: float) -> str:
    digest = hashlib.sha256(key.encode()).hexdigest()
    return (
        f'[[tenants]]\nname = "{name}"\nkey_sha256 = "{digest}"\n'
        f"requests_per_s = {rate}\nrequest_burst = {rate}\n"
    )


async def measure_tenants(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    config = folder / "tenants.toml"
    config.write_text(
        _tenant("noisy", "noisy-key", args.noisy_rate) + _tenant("quiet", "quiet-key", 10.0)
    )
    with RedisServer() as redis:
        async with replicas(
            folder,
            3,
            8,
            *("--config", str(config), "--stub-ms", "20"),
            *("--redis-url", redis.url, "--fleet-timeout", str(args.fleet_timeout)),
        ) as fleet:
            noisy, quiet = Tally(), Tally()
            started = time.monotonic()
            until = started + args.duration
            await asyncio.gather(
                *(
                    closed_loop(fleet[i % 3].addr, noisy, until, api_key="noisy-key")
                    for i in range(30)
                ),
                closed_loop(fleet[0].addr, quiet, until, api_key="quiet-key", pace_s=0.2),
            )
            elapsed = time.monotonic() - started  # (the last jobs end after the duration)
    # The bucket starts full: its burst comes on top of the rate over the run.
    allowed = args.noisy_rate * elapsed + args.noisy_rate
    return {
        "noisy_rate_per_s": args.noisy_rate,
        "seconds_of_load": round(elapsed, 2),
        "noisy_done": noisy.done,
        "noisy_done_per_s": round(noisy.done / elapsed, 1),
        "noisy_allowed_at_most": round(allowed, 1),
        "noisy_held": noisy.done <= allowed,
        "noisy_yields": dict(noisy.yields),
        "quiet_sent_per_s": 5.0,
        "quiet_done": quiet.done,
        "quiet_p99_ms": _ms(quiet.latencies, 99),
        "quiet_yields": dict(quiet.yields),
    }


async def measure_throughput(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with RedisServer() as redis:
        for name, extra in (
            ("independent", ()),
            ("fleet", ("--redis-url", redis.url, "--fleet-max-inflight", "24")),
        ):
            async with replicas(
                folder, 3, 8, "--stub-ms", str(args.throughput_stub_ms), *extra
            ) as fleet:
                tally = Tally()
                until = time.monotonic() + args.duration
                await asyncio.gather(
                    *(closed_loop(fleet[i % 3].addr, tally, until) for i in range(48))
                )
            out[name] = {
                "jobs_per_s": round(tally.done / args.duration, 1),
                "p50_ms": _ms(tally.latencies, 50),
                "p99_ms": _ms(tally.latencies, 99),
                "yields": dict(tally.yields),
            }
    out["ratio"] = round(out["fleet"]["jobs_per_s"] / out["independent"]["jobs_per_s"], 3)
    return out


async def burst_over(
    addrs: list[str], jobs: int, fleet_wide: bool, clients: int = 0
) -> dict[str, Any]:
    """``jobs`` jobs at once from ``clients`` multi-replica clients (0: one each), the jobs of
    a client sharing what it learns of the replicas: their attempts and times (from the
    burst's start)."""
    addresses = [Address(host, int(port)) for host, port in (a.rsplit(":", 1) for a in addrs)]
    fleets = [
        FleetClient(Replicas(addresses, fleet_wide=fleet_wide)) for _ in range(clients or jobs)
    ]
    started = time.monotonic()

    async def one(i: int) -> tuple[int, float, bool]:
        result = await fleets[i % len(fleets)].upload(
            b"x",
            inline=True,
            retry=RetryPolicy(max_attempts=200),
            timeout=120,
        )
        return result.attempts, time.monotonic() - started, result.done

    try:
        results = await asyncio.gather(*(one(i) for i in range(jobs)))
    finally:
        for client in fleets:
            await client.close()
    ended = [t for _, t, done in results if done]
    return {
        "done": len(ended),
        "attempts_per_job": round(sum(a for a, _, _ in results) / jobs, 2),
        "last_done_s": round(max(ended, default=0.0), 3),
        "p50_s": round(percentile(ended, 50), 3) if ended else None,
        "p99_s": round(percentile(ended, 99), 3) if ended else None,
    }


async def measure_backoff(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"fleet": [], "per_replica": []}
    with RedisServer() as redis:
        async with replicas(
            folder,
            3,
            2,
            "--stub-ms",
            str(args.backoff_stub_ms),
            "--redis-url",
            redis.url,
            "--lease-ttl",
            "2",
        ) as fleet:
            addrs = [r.addr for r in fleet]
            for _ in range(args.rounds):
                for name, fleet_wide in (("fleet", True), ("per_replica", False)):
                    runs[name].append(
                        await burst_over(addrs, args.backoff_jobs, fleet_wide, args.backoff_clients)
                    )
    median = {
        name: {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in rows[0]}
        for name, rows in runs.items()
    }
    fleet_m, each_m = median["fleet"], median["per_replica"]
    return {
        "runs": runs,
        "median": median,
        "attempts_ratio": round(fleet_m["attempts_per_job"] / each_m["attempts_per_job"], 3),
        "last_done_ratio": round(fleet_m["last_done_s"] / each_m["last_done_s"], 3),
    }


RUNS: dict[str, Callable[[Path, argparse.Namespace], Awaitable[dict[str, Any]]]] = {
    "latency": measure_latency,
    "cap": measure_cap,
    "tenants": measure_tenants,
    "throughput": measure_throughput,
    "backoff": measure_backoff,
}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="governor-fleet-bench-") as tmp:
        for measure in args.measure:
            started = time.monotonic()
            report[measure] = await RUNS[measure](Path(tmp), args)
            report[measure]["seconds"] = round(time.monotonic() - started, 1)
            print(f"{measure}: {orjson.dumps(report[measure]).decode()}", file=sys.stderr)
    return report


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME,
        help="the fleet's store: admission latency, the cap, tenant quotas, throughput",
        description=__doc__,
        formatter_class=RawDescriptionDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--measure",
        action="append",
        choices=MEASURES,
        help="a measure to run (repeatable; default: all)",
    )
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per load phase")
    parser.add_argument("--clients", type=int, default=300, help="cap: racing clients")
    parser.add_argument("--fleet-cap", type=int, default=12, help="cap: fleet_max_inflight")
    parser.add_argument("--max-inflight", type=int, default=8, help="cap: each replica's")
    parser.add_argument("--stub-ms", type=int, default=50, help="cap: each job's time")
    parser.add_argument("--latency-jobs", type=int, default=3000, help="latency: jobs per side")
    parser.add_argument(
        "--throughput-stub-ms", type=int, default=20, help="throughput: each job's time"
    )
    parser.add_argument("--noisy-rate", type=float, default=30.0, help="tenants: requests/s")
    parser.add_argument(
        "--fleet-timeout",
        type=float,
        default=0.05,
        help="cap, tenants: the replicas' fleet_timeout (a store slower than this fails open)",
    )
    parser.add_argument("--backoff-jobs", type=int, default=60, help="backoff: the burst")
    parser.add_argument(
        "--backoff-clients",
        type=int,
        default=0,
        help="backoff: multi-replica clients sharing the burst (0: one a job)",
    )
    parser.add_argument("--backoff-stub-ms", type=int, default=300, help="backoff: a job's time")
    parser.add_argument("--rounds", type=int, default=5, help="backoff: bursts of each client")
    parser.add_argument("--report", type=Path, help="write the JSON report here too")


def run(args: argparse.Namespace) -> int:
    args.measure = args.measure or list(MEASURES)
    report = uvloop.run(bench(args))
    text = orjson.dumps(report).decode()
    if args.report is not None:
        args.report.write_text(text + "\n")
    print_json(args, report)
    held = [report[m]["held"] for m in ("cap",) if m in report]
    held += [report["tenants"]["noisy_held"]] if "tenants" in report else []
    return 0 if all(held) else 1
