"""``peer``: the governor against heptamini's Go daemon, side by side, on one load generator.

Starts each daemon itself (the governor's stub runner, and ``heptaminid`` from ``--heptaminid``:
built from heptamini's public source, outside this repository) on a free loopback port, with
the flags of one of heptamini's benchmark scenarios (``--scenario``), and loads it with that
scenario's command of heptamini's load generator, burst.py (``--burst PATH``); the governor runs
on its defaults but for the scenario's cap and stub.
Runs alternate (governor, heptaminid, heptaminid, governor, ...) so that a drift of this shared
machine falls on both. Each run reports burst.py's finished jobs (yields, for the yield
scenario; pings) per second, how its jobs ended, and the daemon's CPU time per job, read from
``/proc/PID/stat`` before and after the load; the summary gives the medians and the governor's
ratios to heptaminid's. Every daemon is stopped by its own PID.

With ``--floor`` (the admitted scenarios), a third server joins the rotation: the bare uvloop
server of :mod:`loadtest.support.floor`, the least a Python server on uvloop spends on the same
two frames.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..support.heptamini import DEFAULT_BURST, SCENARIOS, Scenario, governor_command, load
from ..support.options import positive_float, positive_int, print_json
from ..support.processes import free_port, stop, wait_listening

NAME = "peer"


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME, help="the governor against heptaminid, alternating runs", description=__doc__
    )
    parser.add_argument("--heptaminid", type=Path, required=True, help="heptaminid's binary")
    parser.add_argument(
        "--burst", type=Path, default=DEFAULT_BURST, help="heptamini's load generator, burst.py"
    )
    parser.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default="admitted",
        help="heptamini's benchmark scenario: both daemons' cap and job time, and burst.py's "
        "arguments",
    )
    parser.add_argument("--runs", type=positive_int, default=3, help="runs of each daemon")
    parser.add_argument(
        "--duration", type=positive_float, default=8.0, help="seconds a run (not for yield)"
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also run loadtest.support.floor, the bare uvloop server (admitted and new-conn only)",
    )
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="another checkout of this repository (an earlier commit, say): its governor joins "
        "the rotation as 'baseline', on the same flags, for a before-and-after in one run",
    )
    parser.add_argument(
        "--governor-arg",
        action="append",
        default=[],
        help="one more argument for governor serve (repeat it), e.g. --log-level=warning",
    )


def daemon_command(
    which: str, args: argparse.Namespace, scenario: Scenario, port: int
) -> list[str]:
    if which == "floor":
        return [sys.executable, "-m", "loadtest.support.floor", "--listen", f"127.0.0.1:{port}"]
    if which == "heptaminid":
        return [
            str(args.heptaminid),
            "--listen",
            f"127.0.0.1:{port}",
            "--max_inflight",
            str(scenario.cap),
            "--stub_ms",
            str(scenario.stub_ms),
        ]
    return governor_command(scenario, port, args.governor_arg)


def one_run(which: str, args: argparse.Namespace, scenario: Scenario) -> dict[str, Any]:
    port = free_port()
    baseline = which == "baseline"  # (the governor of --baseline-tree: run from that checkout)
    proc = subprocess.Popen(
        daemon_command("governor" if baseline else which, args, scenario, port),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=args.baseline_tree if baseline else None,
    )
    try:
        wait_listening(port, proc)
        time.sleep(0.5)  # let start-up work (the runner's, the probes') settle
        summary, cpu = load(args.burst, scenario, port, args.duration, proc.pid)
    finally:
        stop(proc)
    if scenario.rate_key == "yield_per_s":
        rate = round(summary["yield"] / summary["wall_s"], 1)
    else:
        rate = summary[scenario.rate_key]
    count = rate * summary["wall_s"] if "wall_s" in summary else None
    return {
        "daemon": which,
        "rate": rate,
        "ends": {k: summary[k] for k in ("done", "yield", "abort", "need") if summary.get(k)},
        "need_codes": summary.get("need_codes", {}),
        "errors": summary["errors"],
        "cpu_us_per_job": round(cpu / count * 1e6, 1) if count else None,
        "summary": summary,
    }


def ratios(mine: dict[str, float | None], theirs: dict[str, float | None]) -> dict[str, Any]:
    """``mine`` over ``theirs``: rates and CPU times per job (None where one is missing)."""

    def over(key: str) -> float | None:
        a, b = mine[key], theirs[key]
        return round(a / b, 3) if a and b else None

    return {"rate": over("rate"), "cpu": over("cpu_us_per_job")}


def run(args: argparse.Namespace) -> int:
    missing = [str(path) for path in (args.heptaminid, args.burst) if not path.exists()]
    if missing:
        print(f"loadtest bench peer: no {' and no '.join(missing)}")
        return 2
    scenario = SCENARIOS[args.scenario]
    daemons = ["governor", "heptaminid"]
    if args.baseline_tree is not None:
        if not (args.baseline_tree / "governor" / "__main__.py").exists():
            print(f"loadtest bench peer: {args.baseline_tree} is not a checkout of the governor")
            return 2
        daemons.append("baseline")
    if args.floor:
        if scenario.rate_key != "done_per_s":
            print("loadtest bench peer: --floor answers the admitted scenarios only")
            return 2
        daemons.append("floor")
    order = (daemons + daemons[::-1]) * ((args.runs + 1) // 2)
    runs = []
    for which in order[: len(daemons) * args.runs]:
        result = one_run(which, args, scenario)
        runs.append(result)
        print(
            f"{which:>10}: {result['rate']:>9} /s  {result['cpu_us_per_job']} µs CPU per job"
            f"  {result['errors']} errors  ends {result['ends']}  {result['need_codes']}"
        )
    medians: dict[str, dict[str, float | None]] = {}
    for which in daemons:
        mine = [r for r in runs if r["daemon"] == which]
        cpus = [r["cpu_us_per_job"] for r in mine if r["cpu_us_per_job"] is not None]
        medians[which] = {
            "rate": round(statistics.median(r["rate"] for r in mine), 1),
            "cpu_us_per_job": round(statistics.median(cpus), 1) if cpus else None,
        }
    summary: dict[str, Any] = {"scenario": args.scenario, "median": medians}
    for which in daemons:
        if which != "heptaminid":
            summary[f"{which}_over_heptaminid"] = ratios(medians[which], medians["heptaminid"])
    if "baseline" in daemons:  # (this tree's governor over the other's: below 1, slower now)
        summary["governor_over_baseline"] = ratios(medians["governor"], medians["baseline"])
    summary["runs"] = [{k: v for k, v in r.items() if k != "summary"} for r in runs]
    print_json(args, summary)
    return 0
