"""heptamini's benchmark scenarios (``../shared/bench/README.md``): each daemon's cap and job time
and the arguments of heptamini's load generator, burst.py, for ``peer`` and ``hotpath``."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .processes import REPO, cpu_s

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


def governor_command(scenario: Scenario, port: int, extra: list[str]) -> list[str]:
    """The governor's stub daemon on ``port`` with the scenario's cap and job time."""
    return [
        *(sys.executable, "-m", "governor", "serve", "--runner", "stub"),
        *("--listen", f"127.0.0.1:{port}"),
        *("--max-inflight", str(scenario.cap), "--stub-ms", str(scenario.stub_ms)),
        *extra,
    ]


def load(
    burst: Path, scenario: Scenario, port: int, duration: float, pid: int
) -> tuple[dict[str, Any], float]:
    """burst.py's run of the scenario against ``port`` (for ``duration`` seconds, unless the
    scenario counts rounds): its summary, and the CPU seconds the daemon ``pid`` spent."""
    command = [sys.executable, str(burst), "--addr", f"127.0.0.1:{port}", "--quiet"]
    command += scenario.burst
    if "--rounds" not in scenario.burst:
        command += ["--duration", str(duration)]
    before = cpu_s(pid)
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    cpu = cpu_s(pid) - before
    return json.loads(out.stdout.strip().splitlines()[-1]), cpu
