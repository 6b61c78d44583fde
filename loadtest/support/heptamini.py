"""heptamini's benchmark scenarios (``../shared/bench/README.md``): each daemon's cap and job time
and the arguments of heptamini's load generator, burst.py, for ``peer`` and ``hotpath``."""

from __future__ import annotations

from dataclasses import dataclass

from .processes import REPO

DEFAULT_BURST = REPO.parent / "shared" / "bench" / "burst.py"


@dataclass(frozen=True)
class Scenario:
    cap: int
    stub_ms: int
    burst: tuple[str, ...]  # burst.py's arguments, --addr and --duration aside
    rate_key: str = "done_per_s"  # (burst.py's jobs_per_s counts failed jobs too)


SCENARIOS = {
    "admitted": Scenario(64, 0, ("--clients", "64", "--reuse-conn", "--procs", "2")),
    "new-conn": Scenario(64, 0, ("--clients", "64", "--procs", "2")),
    "pings": Scenario(4, 0, ("--clients", "100", "--ping", "--procs", "2"), "pings_per_s"),
    "yield": Scenario(
        1,
        60_000,
        ("--clients", "1000", "--rounds", "5", "--saturate", "1", "--procs", "2"),
        "yield_per_s",  # each job should end in a yield: any other end is not counted
    ),
}
