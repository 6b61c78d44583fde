"""``loadtest bench fleet``: its verdicts on made-up samples, then one short run of both phases on
real ``governor serve`` processes and a real Redis (stopped by their PIDs).

The run's assertions are the command's own invariants and inequalities that hold by
construction (a caller ejects a replica after 5 failures in a row), never timings.
"""

from __future__ import annotations

import argparse
import json

import pytest

from loadtest.bench import fleet_faults
from loadtest.bench.fleet_faults import kill as kill_phase
from loadtest.bench.fleet_faults import leases as lease_store
from loadtest.bench.fleet_faults import storm
from loadtest.bench.fleet_faults.kill import JobRecord
from loadtest.bench.fleet_faults.leases import Leases, Round
from loadtest.cli import build_parser
from loadtest.support.connections import run_loop
from loadtest.support.replicas import Gauges, by_label, gauges_from, parse_metrics, total
from protocol.codes import Status, Verb
from protocol.frames import Reply

METRICS = """\
# HELP governor_inflight Jobs executing now, in every pool.
# TYPE governor_inflight gauge
governor_inflight 3.0
governor_fleet_leases 2.0
governor_fleet_inflight 7.0
governor_jobs_finished_total{outcome="done",lane="interactive",pool="primary"} 5.0
governor_jobs_finished_total{outcome="backend_error",lane="interactive",pool="primary"} 2.0
governor_jobs_finished_total{outcome="done",lane="heavy",pool="primary"} 1.0
"""


def test_metrics_text_is_read_by_name_and_label() -> None:
    samples = parse_metrics(METRICS)
    assert gauges_from(samples) == Gauges(fleet_leases=2, fleet_inflight=7, inflight=3)
    assert total(samples, "governor_jobs_finished_total") == 8
    assert total(samples, "governor_jobs_finished_total", outcome="done") == 6
    assert by_label(samples, "governor_jobs_finished_total", "outcome") == {
        "done": 6,
        "backend_error": 2,
    }


def test_live_leases_are_counted_by_their_replica_on_redis_clock() -> None:
    assert lease_store.lease_owner(b"r1/abc123:42") == "r1"
    assert lease_store.lease_owner("r0:7") == "r0"
    # Redis's clock at 10.000 s: an expiry at or before it is dead (RedisStore.inflight).
    read = lease_store.leases_from(
        1.0,
        (10, 0),
        [(b"r0/a:1", 10_500.0), (b"r0/a:2", 12_000.0), (b"r1/b:1", 10_000.0), (b"r2/c:9", 9.0)],
    )
    assert read.now_ms == 10_000
    assert read.live == {"r0": 2}
    assert read.expiry_ms == {"r0": 12_000}
    assert read.count == 2


def rounds(*sums: int, redis: int = 0, cap: int = 4) -> list[Round]:
    """Rounds whose replicas' leases add up to each of ``sums`` (all on r1)."""
    return [
        Round(Leases(float(i), i, {"r0": redis}, {}), {"r1": Gauges(s, min(s, cap), s)})
        for i, s in enumerate(sums)
    ]


def test_the_cap_is_judged_on_the_store_and_the_jobs_running_not_on_gauges_read_apart() -> None:
    apart = kill_phase.cap_verdict(rounds(4, 5, 5, 4), 4, {"r1": 8}, jobs_at_once=4)
    assert apart["max_replicas_sum"] == 5  # (reported: a hand-off caught between reads)
    assert apart["rounds_replicas_sum_over_cap"] == 2
    assert apart["held"]
    assert not kill_phase.cap_verdict(rounds(4), 4, {"r1": 8}, jobs_at_once=5)["held"]
    assert not kill_phase.cap_verdict(rounds(4, redis=5), 4, {"r1": 8}, jobs_at_once=4)["held"]
    assert not kill_phase.cap_verdict(rounds(4, 4), 4, {"r1": 3}, jobs_at_once=4)["held"]


def job_line(end: str, e2e_ms: float, event: str = "job") -> str:
    return json.dumps({"ts": end, "level": "info", "event": event, "e2e_ms": e2e_ms})


def test_the_jobs_running_at_once_are_read_from_the_job_log_lines() -> None:
    lines = [
        "governor: serving",  # (not a JSON line)
        job_line("2026-11-27T18:00:01.000+00:00", 1000),  # 0 to 1 s
        job_line("2026-11-27T18:00:01.500+00:00", 1000),  # 0.5 to 1.5 s
        job_line("2026-11-27T18:00:01.995+00:00", 1000),  # 0.995 to 1.995: a hand-off, 5 ms
        job_line("2026-11-27T18:00:03.000+00:00", 100, event="drain"),
    ]
    intervals = kill_phase.job_intervals(lines)
    assert len(intervals) == 3
    assert intervals[0][1] - intervals[0][0] == pytest.approx(1.0)
    assert kill_phase.most_at_once(intervals, 0.0) == 3  # the hand-off overlaps by 5 ms
    assert kill_phase.most_at_once(intervals, 0.01) == 2  # within the log's precision
    assert kill_phase.most_at_once([(0.0, 1.0), (0.2, 0.8), (0.3, 0.9)], 0.01) == 3


def lease_reads(*reads: tuple[int, int, int]) -> list[Round]:
    """Rounds from ``(redis_now_ms, victim's live leases, their latest expiry)``."""
    return [
        Round(Leases(0.0, now, {"r0": n} if n else {}, {"r0": e} if n else {}), {})
        for now, n, e in reads
    ]


def test_the_killed_replicas_leases_must_leave_within_the_ttl() -> None:
    kill = 100_000
    freed = kill_phase.freed_verdict(
        lease_reads((99_990, 3, 101_500), (100_010, 3, 101_500), (101_490, 1, 101_500),
                    (101_510, 0, 0)),
        "r0", kill, 2.0, 0.02,
    )  # fmt: skip
    assert freed["leases_at_kill"] == 3
    assert freed["expired_after_s"] == 1.5
    assert freed["last_seen_live_after_s"] == 1.49
    assert freed["first_seen_free_after_s"] == 1.51
    assert freed["held"]
    late = kill_phase.freed_verdict(lease_reads((100_010, 2, 103_000), (102_500, 2, 103_000),
                                           (103_010, 0, 0)), "r0", kill, 2.0, 0.02)  # fmt: skip
    assert not late["held"]
    never = kill_phase.freed_verdict(lease_reads((100_010, 2, 103_000)), "r0", kill, 2.0, 0.02)
    assert not never["gone_at_end"]
    assert not never["held"]


def job(
    outcome: str, *, admitted: float | None = 1.0, ended: float = 3.0, **kw: object
) -> JobRecord:
    record = JobRecord(0, 0.5, admitted, ended, outcome)
    for k, v in kw.items():
        setattr(record, k, v)
    return record


def test_every_admitted_job_ends_with_a_terminal_frame_or_with_the_killed_replica() -> None:
    kill_t = 2.0
    good = [
        job("done", replica="r1", tried=("r1",)),
        job("lost"),
        job("done", replica="r2", tried=("r0", "r2"), admitted=2.5),
        job("abort:cancelled", replica="r1"),
        job("no_replica", admitted=None),
    ]
    verdict = kill_phase.jobs_verdict(good, "r0", kill_t, victim_slots=2)
    assert verdict["held"]
    assert verdict["admitted"] == 4
    assert verdict["terminal"] == 3
    assert verdict["lost_with_killed"] == 1
    assert verdict["moved_off_killed"] == 1
    assert verdict["done_after_kill_by_replica"] == {"r1": 1, "r2": 1}
    hung = kill_phase.jobs_verdict([*good, job("timeout")], "r0", kill_t, 2)
    assert hung["timed_out"] == 1
    assert not hung["held"]
    lost_late = kill_phase.jobs_verdict([*good, job("lost", admitted=2.5)], "r0", kill_t, 2)
    assert not lost_late["held"]  # admitted after the kill: it ran on a survivor
    too_many = kill_phase.jobs_verdict([*good, job("lost"), job("lost")], "r0", kill_t, 2)
    assert not too_many["held"]
    nobody_moved = kill_phase.jobs_verdict([job("done", replica="r1", ended=1.0)], "r0", kill_t, 2)
    assert not nobody_moved["held"]


def test_a_call_is_wasted_when_its_backend_failed() -> None:
    tally = storm.Tally()
    for status, need, error in (
        (Status.DONE, None, None),
        (Status.ABORT, "backend_error", "backend_error"),
        (Status.YIELD, "fleet_busy", "busy"),
        (Status.ABORT, "cancelled", "cancelled"),
    ):
        tally.seen(0.0, Reply(Verb.SHARE, "J", 1, status, need_code=need, error_code=error))
    tally.ended(True)
    tally.ended(False)
    assert (tally.calls, tally.wasted, dict(tally.yields)) == (3, 1, {"fleet_busy": 1})
    report = tally.as_dict(2.0)
    assert report["goodput_per_s"] == 0.5
    assert report["failed"] == 1


def test_each_check_that_failed_is_named() -> None:
    fine = {"cap": {"held": True, "max_redis": 4, "cap": 4}, "errors": {}}
    hung = {"cap": {"held": True, "max_redis": 4, "cap": 4}, "errors": {"TimeoutError": 2}}
    kill = {"cap": {"held": True, "cap": 8}, "leases": {"held": False}, "jobs": {"held": True}}
    out = fleet_faults.failures(
        {"seed": {"policies": {"naive": fine, "breaker": hung}}, "kill": kill}
    )
    assert len(out) == 2
    assert out[0].startswith("seed breaker: 2 call(s) timed out")
    assert out[1].startswith("kill: the killed replica's leases were not freed")
    assert fleet_faults.failures({"seed": {"policies": {"naive": fine}}}) == []


def test_the_command_is_registered_with_its_defaults() -> None:
    args = build_parser().parse_args(["bench", "fleet"])
    assert args.phase == "both"
    assert args.policies == ["naive", "breaker", "breaker-shared"]
    assert (args.replicas, args.clients, args.tries, args.lease_ttl) == (4, 32, 5, 2.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "fleet", "--policies", "naive,hedged"])


def small_run() -> argparse.Namespace:
    return build_parser().parse_args(
        [
            "fleet",
            *("--replicas", "3", "--max-inflight", "2", "--stub-ms", "40"),
            *("--clients", "4", "--duration", "5", "--policies", "naive,breaker"),
            *("--kill-replicas", "3", "--kill-max-inflight", "2", "--kill-clients", "6"),
            *("--lease-ttl", "1", "--kill-job-ms", "300", "--kill-at", "1.5"),
            *("--after-kill", "1", "--job-timeout", "20"),
            # (a store slower than the default 50 ms on a loaded machine fails open on the
            # replicas' shares, by design: the cap checks here are of the store)
            *("--fleet-timeout", "0.3"),
        ]
    )


@pytest.mark.slow
def test_seed_002_and_a_kill_9_on_real_replicas() -> None:
    args = small_run()
    report = run_loop(fleet_faults.measure(args))
    assert report["failures"] == [], report["failures"]

    runs = report["seed"]["policies"]
    naive, breaker = runs["naive"], runs["breaker"]
    for run in (naive, breaker):
        assert run["cap"]["held"]
        # What the callers saw failing is what the failing replica counted.
        assert run["wasted_calls"] == run["server"]["failing_calls"]
    assert breaker["wasted_calls"] < naive["wasted_calls"]
    # Each caller ejects the failing replica after 5 failures in a row, for longer than the run.
    assert breaker["wasted_calls"] <= 5 * args.clients
    assert naive["done"] > 0
    assert breaker["done"] > 0

    kill = report["kill"]
    cap = kill["cap"]
    assert cap["held"]
    assert cap["max_redis"] <= cap["cap"]
    assert cap["max_fleet_inflight_reported"] <= cap["cap"]
    leases = kill["leases"]
    assert leases["held"]
    assert leases["gone_at_end"]
    assert leases["last_seen_live_after_s"] is None or (
        leases["last_seen_live_after_s"] <= args.lease_ttl + args.sample_ms / 1000
    )
    jobs = kill["jobs"]
    assert jobs["held"]
    assert jobs["timed_out"] == 0
    assert jobs["admitted_without_terminal"] == 0
    assert jobs["lost_with_killed"] <= args.kill_max_inflight
    survivors = {r for r in jobs["done_after_kill_by_replica"] if r != kill["killed"]}
    assert survivors
