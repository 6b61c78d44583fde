"""Prometheus metrics: what the daemon measures, and the collector that exports it.

Gauges and counters are read from the server's own state at scrape time, so admission pays
nothing for them. What is measured per job (times and sizes) goes into :class:`Histogram`,
a few integer increments on the event loop: prometheus-client's own histogram takes a lock
per observation, for threads this daemon does not have on its hot path. A scrape runs on the
event loop too (:mod:`governor.admin` schedules it there), so it reads consistent state.

Labels are bounded: lanes, pools, wire codes and tenants from the config; never a job id.
Lane ``-`` is a job with lanes off.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .logs import dropped_records
from .policy import LANES

if TYPE_CHECKING:
    from .server import Server

NO_LANE = "-"

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
DECISION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3)
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PROBE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """Counts per bucket (each value in the first bucket whose bound it does not exceed)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative, as Prometheus wants them."""
        out: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        return out


class LaneHistograms:
    """One histogram per lane, made on the lane's first observation."""

    def __init__(self, name: str, documentation: str, bounds: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = bounds
        self.by_lane: dict[str, Histogram] = {}

    def observe(self, lane: str, value: float) -> None:
        histogram = self.by_lane.get(lane)
        if histogram is None:
            histogram = self.by_lane[lane] = Histogram(self.bounds)
        histogram.observe(value)

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["lane"])
        for lane, h in sorted(self.by_lane.items()):
            family.add_metric([lane], h.buckets(), h.sum)
        return family


class JobMetrics:
    """What the daemon measures of each job and admission attempt."""

    def __init__(self) -> None:
        self.ttft = LaneHistograms(
            "governor_time_to_first_token_seconds",
            "From admission to the job's first generated text.",
            TTFT_BUCKETS,
        )
        self.tpot = LaneHistograms(
            "governor_time_per_output_token_seconds",
            "Time per output token after the first, per finished job.",
            TPOT_BUCKETS,
        )
        self.e2e = LaneHistograms(
            "governor_e2e_job_latency_seconds",
            "From admission to the job's terminal frame, for every admitted job.",
            E2E_BUCKETS,
        )
        self.decision = LaneHistograms(
            "governor_admission_decision_seconds",
            "Time to decide an admission attempt (admit or yield).",
            DECISION_BUCKETS,
        )
        self.wait = LaneHistograms(
            "governor_admission_wait_seconds",
            "From a job's first yield to its admission: the wait its client did instead of "
            "a queue (0 when admitted at once).",
            WAIT_BUCKETS,
        )
        self.prompt_tokens = LaneHistograms(
            "governor_job_prompt_tokens", "Prompt tokens of jobs that finished.", TOKEN_BUCKETS
        )
        self.output_tokens = LaneHistograms(
            "governor_job_output_tokens", "Generated tokens of jobs that finished.", TOKEN_BUCKETS
        )
        self.probe = Histogram(PROBE_BUCKETS)
        # Admitted jobs' ends, by outcome (done, an abort's need code, client_gone), lane, pool.
        self.finished: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.aborts: collections.Counter[str] = collections.Counter()  # abort frames, by code
        self.probes: collections.Counter[str] = collections.Counter()  # by result

    def lane_families(self) -> Iterator[HistogramMetricFamily]:
        for h in (
            self.ttft,
            self.tpot,
            self.e2e,
            self.decision,
            self.wait,
            self.prompt_tokens,
            self.output_tokens,
        ):
            yield h.family()


class GovernorCollector(Collector):
    def __init__(self, server: Server) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        server, ledger, jobs = self.server, self.server.ledger, self.server.metrics
        health = server.health
        gauges = (
            ("governor_inflight", "Jobs executing now.", ledger.inflight),
            ("governor_inflight_cap", "The hard cap on executing jobs (max_inflight).", ledger.cap),
            ("governor_inflight_peak", "Highest inflight since start.", ledger.peak_inflight),
            ("governor_health", "1 when a job would be admitted now, else 0.", int(ledger.ready)),
            ("governor_draining", "1 while shutting down.", int(ledger.draining)),
            ("governor_connections", "Open client connections.", len(server.connections)),
            (
                "governor_buffered_payload_bytes",
                "Payload bytes reserved by uploads in progress and payloads held after a yield.",
                server.buffered_bytes,
            ),
            (
                "governor_expected_service_seconds",
                "The service-time estimate behind retry hints.",
                ledger.service_s,
            ),
            ("governor_ready", "1 when /healthz/ready passes.", int(health.readiness().ok)),
            ("governor_live", "1 when /healthz/live passes.", int(health.liveness().ok)),
        )
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(name, documentation, value=value)
        yield CounterMetricFamily(
            "governor_executed", "Jobs admitted to execute.", value=ledger.executed_total
        )
        yield CounterMetricFamily(
            "governor_yielded",
            "Admission attempts answered with yield.",
            value=ledger.yielded_total,
        )
        yield _counter(
            "governor_yields",
            "Admission attempts answered with yield, by reason (need code), lane and tenant.",
            ["reason", "lane", "tenant"],
            server.refusals.items(),
        )
        yield _counter(
            "governor_jobs_finished",
            "Admitted jobs that ended, by outcome (done, the abort's need code, or client_gone), "
            "lane and pool.",
            ["outcome", "lane", "pool"],
            jobs.finished.items(),
        )
        yield _counter(
            "governor_aborts",
            "Abort frames sent, by reason (need code): admitted jobs that failed, jobs refused "
            "for good, and connections closed.",
            ["reason"],
            (((k,), v) for k, v in jobs.aborts.items()),
        )
        tenants = GaugeMetricFamily(
            "governor_tenant_inflight", "Jobs executing now, by tenant.", labels=["tenant"]
        )
        for t in server.tenants.all():
            tenants.add_metric([t.name], t.inflight)
        yield tenants
        if ledger.policy is not None:
            lanes = GaugeMetricFamily(
                "governor_lane_inflight", "Jobs executing now, by lane.", labels=["lane"]
            )
            for lane in LANES:
                lanes.add_metric([lane], ledger.lane_inflight[lane])
            yield lanes
            yield GaugeMetricFamily(
                "governor_kv_reserved_tokens",
                "KV cache tokens reserved by running jobs (prompt + max_new_tokens).",
                value=ledger.kv_reserved,
            )
            yield GaugeMetricFamily(
                "governor_kv_capacity_tokens",
                "The KV budget's capacity (0: no budget).",
                value=ledger.policy.kv_capacity,
            )
        if server.overload is not None:
            yield GaugeMetricFamily(
                "governor_overload_state",
                "0 normal, 1 degraded, 2 batch_paused, 3 interactive_only.",
                value=int(server.overload.state),
            )
            yield _counter(
                "governor_overload_transitions",
                "Overload state changes.",
                ["from", "to"],
                server.overload.transitions.items(),
            )
        yield _counter(
            "governor_fallback_activations",
            "Fallback ladder steps taken, by step.",
            ["step"],
            (((k,), v) for k, v in server.ladder.items()),
        )
        breaker = GaugeMetricFamily(
            "governor_breaker_state",
            "The runner pool's circuit breaker: 0 closed, 1 half_open, 2 open.",
            labels=["pool"],
        )
        moves = CounterMetricFamily(
            "governor_breaker_transitions",
            "Circuit breaker state changes, by pool.",
            labels=["pool", "from", "to"],
        )
        restarts = CounterMetricFamily(
            "governor_worker_restarts", "Worker processes started again, by pool.", labels=["pool"]
        )
        workers = GaugeMetricFamily(
            "governor_workers_live",
            "Worker processes loaded and able to take a job, by pool.",
            labels=["pool"],
        )
        for pool in server.pools:
            breaker.add_metric([pool.name], int(pool.breaker.state))
            for (before, after), count in sorted(pool.breaker.transitions.items()):
                moves.add_metric([pool.name, before, after], count)
            state = pool.runner.health()
            restarts.add_metric([pool.name], state.restarts)
            workers.add_metric([pool.name], state.workers_live)
        yield from (breaker, moves, restarts, workers)
        yield _counter(
            "governor_probes",
            "Readiness probes, by result (ok, failed, timeout, skipped: every worker busy).",
            ["result"],
            (((k,), v) for k, v in jobs.probes.items()),
        )
        probe = HistogramMetricFamily(
            "governor_probe_duration_seconds", "Readiness probes that succeeded, by duration."
        )
        probe.add_metric([], jobs.probe.buckets(), jobs.probe.sum)
        yield probe
        yield from jobs.lane_families()
        yield CounterMetricFamily(
            "governor_log_records_dropped",
            "Log records dropped because the log writer fell behind (a slow stderr reader).",
            value=dropped_records(),
        )
        yield _counter(
            "governor_bad_frames",
            "Lines refused before any upload, by need code.",
            ["code"],
            (((k,), v) for k, v in server.bad_frames.items()),
        )


def _counter(
    name: str,
    documentation: str,
    labels: list[str],
    counts: Iterable[tuple[tuple[str, ...], int]],
) -> CounterMetricFamily:
    """A labelled counter family from ``(label values, count)`` pairs."""
    family = CounterMetricFamily(name, documentation, labels=labels)
    for values, count in sorted(counts):
        family.add_metric(list(values), count)
    return family


def registry_for(server: Server) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(GovernorCollector(server))
    return registry
