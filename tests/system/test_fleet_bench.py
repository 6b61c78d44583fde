"""``loadtest bench fleet-bench`` on small settings: real replicas, a real Redis, the invariants
held."""

from __future__ import annotations

import argparse
from pathlib import Path

import uvloop

from loadtest.bench import fleet_bench


def settings(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    fleet_bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["fleet-bench"])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_the_fleet_cap_holds_under_racing_clients(tmp_path: Path) -> None:
    # (a generous fleet_timeout: on a loaded machine a slow store would fail open, on shares)
    args = settings(
        duration=2.0, clients=60, fleet_cap=6, max_inflight=4, stub_ms=30, fleet_timeout=1.0
    )
    report = uvloop.run(fleet_bench.measure_cap(tmp_path, args))
    assert report["max_leases_in_store"] <= 6, report
    # No replica holds more than the cap itself, whether the store granted its leases or (found
    # slower than fleet_timeout on a loaded machine) its share did. (Their sum is read one
    # replica after the other, over HTTP: on a loaded machine a lease moving between two reads
    # is counted twice; the store's count above is the exact one.)
    assert report["max_leases_of_one_replica"] <= 6, report
    assert report["held"], report
    assert report["max_leases_in_store"] == 6  # it was reached: the cap bound
    assert report["jobs_done"] > 0
    assert report["yields"].get("fleet_busy", 0) > 0


def test_a_noisy_tenant_is_held_to_its_fleet_wide_rate(tmp_path: Path) -> None:
    args = settings(duration=2.0, noisy_rate=10.0, fleet_timeout=1.0)
    report = uvloop.run(fleet_bench.measure_tenants(tmp_path, args))
    # At most its rate over the run and one burst, over all three replicas together (each
    # holding it to 10/s on its own would let through three times as much).
    assert report["noisy_held"], report
    assert report["noisy_yields"].get("rate_limited", 0) > 0
    assert report["quiet_done"] >= 5  # 5 a second for 2 s, none refused for the noisy one
