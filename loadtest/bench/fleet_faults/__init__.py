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
import json
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from clients.helptext import RawDescriptionDefaultsHelpFormatter

from ...support.connections import run_loop
from ...support.options import positive_float, positive_int, print_json
from .kill import kill_phase
from .storm import FAILING, POLICIES, seed_phase, seed_table

NAME = "fleet"
PHASES = ("seed", "kill")


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
    parser.add_argument(
        "--fleet-timeout",
        type=positive_float,
        default=0.05,
        help="the replicas' fleet_timeout: a store slower than this fails open on a replica's "
        "share, and the cap checks then measure the share, not the store",
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
