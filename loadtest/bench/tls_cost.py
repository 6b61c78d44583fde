"""``tls-cost``: what TLS costs the daemon, plain TCP against TLS, in alternating runs.

Each run starts ``governor serve --runner stub`` on a free loopback port (with a throwaway
certificate for TLS, made by ``trustme``: the test extra), loads it from this process and reads
the daemon's CPU time from ``/proc/PID/stat`` before and after. Scenarios:

- ``admitted``: ``--max-inflight 64 --stub-ms 0``; 32 connections, 500 uploads each in a row;
- ``yield``: ``--max-inflight 1 --stub-ms 60000``; one job holds the slot, then 32
  connections, 500 uploads each, never retried: every one answered ``yield``;
- ``new-conn``: as ``admitted``, but 16 workers each connect, upload once and close, 100
  times (a handshake per job).

Runs alternate plain, TLS, TLS, plain, ...; the report gives each mode's medians and TLS over
plain, per pair too (a shared machine is noisy: read the ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from clients import NO_RETRY, client_context
from protocol.codes import Receipt

from ..support.connections import Endpoint, run_loop
from ..support.options import positive_int, print_json
from ..support.processes import cpu_s, free_port, stop, wait_listening

NAME = "tls-cost"
SCENARIOS = {
    # name: (daemon flags, connections, jobs per connection, a new connection per job)
    "admitted": (("--max-inflight", "64", "--stub-ms", "0"), 32, 500, False),
    "yield": (("--max-inflight", "1", "--stub-ms", "60000"), 32, 500, False),
    "new-conn": (("--max-inflight", "64", "--stub-ms", "0"), 16, 100, True),
}
PAYLOAD = b"x" * 256


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME, help="plain TCP against TLS: the daemon's CPU per job", description=__doc__
    )
    parser.add_argument("--runs", type=positive_int, default=5, help="of each mode")
    parser.add_argument(
        "--scenarios",
        default="admitted,yield,new-conn",
        help=f"comma-separated, among {','.join(SCENARIOS)}",
    )
    parser.add_argument(
        "--key-type",
        choices=("ECDSA", "RSA"),
        default="ECDSA",
        help="the throwaway certificate's key",
    )
    parser.add_argument(
        "--jobs", type=positive_int, help="per connection or worker (default: the scenario's)"
    )


async def load(
    endpoint: Endpoint, scenario: str, jobs: int | None
) -> tuple[float, int, dict[str, int]]:
    _, conns, default_jobs, reconnect = SCENARIOS[scenario]
    jobs = jobs or default_jobs
    statuses: dict[str, int] = {}
    holder = hold = None
    if scenario == "yield":  # one job takes the only slot
        holder = await endpoint.connect(timeout=10)
        hold = asyncio.ensure_future(holder.upload(PAYLOAD, retry=NO_RETRY))
        async with await endpoint.connect(timeout=10) as probe:
            for _ in range(1000):  # (polling the daemon's own count: no event to wait on)
                if (await probe.ping()).receipt(Receipt.INFLIGHT) == 1:
                    break
                await asyncio.sleep(0.01)
    start = asyncio.Event()

    async def worker() -> None:
        kept = None if reconnect else await endpoint.connect(timeout=10)
        await start.wait()
        for _ in range(jobs):
            client = kept if kept is not None else await endpoint.connect(timeout=10)
            result = await client.upload(PAYLOAD, retry=NO_RETRY)
            statuses[str(result.status)] = statuses.get(str(result.status), 0) + 1
            if kept is None:
                await client.close()
        if kept is not None:
            await kept.close()

    tasks = [asyncio.ensure_future(worker()) for _ in range(conns)]
    await asyncio.sleep(0.3)  # the kept connections are made before the clock starts
    started = time.perf_counter()
    start.set()
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - started
    if holder is not None and hold is not None:
        hold.cancel()
        await holder.close()
    return wall, conns * jobs, statuses


def one_run(scenario: str, mode: str, pki: dict[str, str], jobs: int | None) -> dict[str, Any]:
    port = free_port()
    command = [
        *(sys.executable, "-m", "governor", "serve", "--runner", "stub"),
        *("--listen", f"127.0.0.1:{port}", "--log-level", "warning"),
        *("--max-connections", "4096", "--max-connections-per-source", "0"),
        *SCENARIOS[scenario][0],
    ]
    if mode == "tls":
        command += ["--tls-cert", pki["cert"], "--tls-key", pki["key"]]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_listening(port, proc)
        context = client_context(ca=pki["ca"]) if mode == "tls" else None
        before = cpu_s(proc.pid)
        endpoint = Endpoint("127.0.0.1", port, context)
        wall, done, statuses = run_loop(load(endpoint, scenario, jobs))
        cpu = cpu_s(proc.pid) - before
    finally:
        stop(proc)
    return {
        "scenario": scenario,
        "mode": mode,
        "rate": round(done / wall, 1),
        "cpu_us_per_job": round(cpu / done * 1e6, 1),
        "statuses": statuses,
    }


def certificates(directory: Path, key_type: str) -> dict[str, str]:
    import trustme  # the test extra: only this command needs it

    ca = trustme.CA(key_type=getattr(trustme.KeyType, key_type))
    issued = ca.issue_cert("127.0.0.1")
    pki = {name: str(directory / f"{name}.pem") for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(pki["ca"])
    issued.private_key_pem.write_to_path(pki["key"])
    for i, blob in enumerate(issued.cert_chain_pems):
        blob.write_to_path(pki["cert"], append=i > 0)
    return pki


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    plain = [r for r in runs if r["mode"] == "plain"]
    tls = [r for r in runs if r["mode"] == "tls"]
    median = {
        mode: {k: statistics.median(r[k] for r in mine) for k in ("rate", "cpu_us_per_job")}
        for mode, mine in (("plain", plain), ("tls", tls))
    }
    statuses: dict[str, dict[str, int]] = {"plain": {}, "tls": {}}
    for r in runs:
        for status, n in r["statuses"].items():
            statuses[r["mode"]][status] = statuses[r["mode"]].get(status, 0) + n
    return {
        "median": median,
        "statuses": statuses,
        "tls_over_plain_cpu": round(
            median["tls"]["cpu_us_per_job"] / median["plain"]["cpu_us_per_job"], 3
        ),
        "tls_over_plain_rate": round(median["tls"]["rate"] / median["plain"]["rate"], 3),
        "per_pair_cpu": [
            round(t["cpu_us_per_job"] / p["cpu_us_per_job"], 3)
            for p, t in zip(plain, tls, strict=True)
        ],
    }


def run(args: argparse.Namespace) -> int:
    summary: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as directory:
        pki = certificates(Path(directory), args.key_type)
        for scenario in args.scenarios.split(","):
            if scenario not in SCENARIOS:
                print(f"loadtest bench tls-cost: no scenario {scenario!r}", file=sys.stderr)
                return 2
            order = (["plain", "tls", "tls", "plain"] * args.runs)[: 2 * args.runs]
            runs = []
            for mode in order:
                runs.append(one_run(scenario, mode, pki, args.jobs))
                print_json(args, runs[-1])
            summary[scenario] = summarise(runs)
            median = summary[scenario]["median"]
            print(
                f"{scenario}: {median['plain']['cpu_us_per_job']:.1f} µs/job plain, "
                f"{median['tls']['cpu_us_per_job']:.1f} with TLS "
                f"(x{summary[scenario]['tls_over_plain_cpu']:.2f})",
                flush=True,
            )
    print_json(args, {"command": NAME, **summary})
    return 0
