"""The Prometheus collector: the server's state read at scrape time, on the event loop.

Labels are bounded: lanes, pools, wire codes and tenants from the config; never a job id.
Lane ``-`` is a job with lanes off.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from ..core.landing import ERROR_BUCKETS
from ..core.policy import LANES
from ..core.slo import OBJECTIVES, Attainment
from ..state import ServerState
from ..telemetry.logs import dropped_records
from ..telemetry.metrics import cumulative
from .health import Health

if TYPE_CHECKING:
    from ..fleetstore import Fleet


class GovernorCollector(Collector):
    """Each scrape: the families of :data:`FAMILIES`, in order."""

    def __init__(self, state: ServerState, health: Health) -> None:
        self.state = state
        self.health = health

    def collect(self) -> Iterator[Metric]:
        for build in FAMILIES:
            yield from build(self.state, self.health)


def _server_families(server: ServerState, health: Health) -> Iterator[Metric]:
    """The replica at a glance: slots, connections, buffers, the probes' verdicts, and the
    admission attempts' two totals."""
    ledger, pools = server.ledger, server.pools
    gauges = (
        ("governor_inflight", "Jobs executing now, in every pool.", server.inflight),
        (
            "governor_inflight_cap",
            "The hard cap on executing jobs (max_inflight, and the fallback pool's workers).",
            sum(pool.ledger.cap for pool in pools),
        ),
        (
            "governor_slots_taken",
            "Slots of the cap taken now, in every pool (a job of n sequences takes n).",
            sum(pool.ledger.taken for pool in pools),
        ),
        (
            "governor_inflight_peak",
            "The most slots taken at once since start.",
            ledger.peak_inflight,
        ),
        ("governor_health", "1 when a job would be admitted now, else 0.", int(ledger.ready)),
        ("governor_draining", "1 while shutting down.", int(ledger.draining)),
        ("governor_connections", "Open client connections.", len(server.connections)),
        (
            "governor_buffered_payload_bytes",
            "Payload bytes reserved by uploads in progress and payloads held after a yield.",
            server.connections.buffers.used,
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
        "governor_executed",
        "Jobs admitted to execute, in every pool.",
        value=sum(pool.ledger.executed_total for pool in pools),
    )
    yield CounterMetricFamily(
        "governor_yielded",
        "Admission attempts answered with yield.",
        value=ledger.yielded_total,
    )
    yield SummaryMetricFamily(
        "governor_handoff_idle_seconds",
        "How long each slot handed to a client back on its retry hint stood empty between its "
        "release and that client's admission, in every pool.",
        count_value=sum(pool.ledger.handoffs for pool in pools),
        sum_value=sum(pool.ledger.handoff_idle_s for pool in pools),
    )


# governor_unserved_*, by what each counts (UnservedDemand.counters).
UNSERVED_HELP = {
    "jobs": "Distinct jobs turned away (each once, however often its client retried), by lane "
    "and tenant: the demand this replica did not serve when asked.",
    "tokens": "The tokens those jobs asked for (prompt and the most they may generate), by lane "
    "and tenant.",
    "gave_up": "Jobs turned away and never served: their client left or cancelled, did not come "
    "back in time, or was refused for good; by lane and tenant.",
}


def _job_families(server: ServerState, health: Health) -> Iterator[Metric]:
    """Admission attempts refused, admitted jobs' ends, abort frames."""
    jobs = server.metrics
    yield _counter(
        "governor_yields",
        "Admission attempts answered with yield, by reason (need code), lane and tenant.",
        ["reason", "lane", "tenant"],
        server.admission.refusals.items(),
    )
    for what, counts in server.admission.unserved.counters():
        yield _counter(
            f"governor_unserved_{what}", UNSERVED_HELP[what], ["lane", "tenant"], counts.items()
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
        _by_one(jobs.aborts),
    )


def _slot_families(server: ServerState, health: Health) -> Iterator[Metric]:
    """What holds the slots: tenants, lanes (with lanes on), the KV budget."""
    ledger = server.ledger
    tenants = GaugeMetricFamily(
        "governor_tenant_inflight", "Slots its jobs hold now, by tenant.", labels=["tenant"]
    )
    for t in server.tenants.all():
        tenants.add_metric([t.name], t.inflight)
    yield tenants
    if ledger.policy is not None:
        lanes = GaugeMetricFamily(
            "governor_lane_inflight", "Slots its jobs hold now, by lane.", labels=["lane"]
        )
        for lane in LANES:
            lanes.add_metric([lane], ledger.lane_inflight[lane])
        yield lanes
        yield GaugeMetricFamily(
            "governor_suspended",
            "Jobs suspended now (a chat took their slot back; they resume when a slot frees).",
            value=ledger.suspended,
        )
        yield _counter(
            "governor_suspensions",
            "Jobs suspended for a chat's slot or memory, by lane.",
            ["lane"],
            (((lane,), ledger.suspensions[lane]) for lane in LANES[1:]),
        )
        yield _counter(
            "governor_resumes",
            "Suspended jobs resumed, by lane.",
            ["lane"],
            (((lane,), ledger.resumes[lane]) for lane in LANES[1:]),
        )
    yield GaugeMetricFamily(
        "governor_kv_reserved_tokens",
        "KV cache cells reserved by running jobs (prompt + max_new_tokens each).",
        value=ledger.kv_reserved,
    )
    yield GaugeMetricFamily(
        "governor_kv_used_tokens",
        "KV cache cells the runner's caches hold now (the reservations for a runner that "
        "reports none).",
        value=ledger.kv_in_use,
    )
    yield GaugeMetricFamily(
        "governor_kv_capacity_tokens",
        "The KV caches' capacity in cells (0: no KV budget).",
        value=ledger.kv.capacity if ledger.kv is not None else 0,
    )


def _overload_families(server: ServerState, health: Health) -> Iterator[Metric]:
    """The overload state (with lanes on) and the fallback ladder's steps."""
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
        _by_one(server.admission.ladder),
    )


def _pool_families(server: ServerState, health: Health) -> Iterator[Metric]:
    """Each runner pool's circuit breaker and workers."""
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


def _hint_families(server: ServerState, health: Health) -> Iterator[Metric]:
    """How the retry hints land (:mod:`governor.core.landing`), by lane and pool."""
    returns = CounterMetricFamily(
        "governor_hint_returns",
        "Clients back at their retry hint, by lane, pool and outcome: landed (admitted) or "
        "early (refused again). The landing rate is the landed share.",
        labels=["lane", "pool", "outcome"],
    )
    errors = HistogramMetricFamily(
        "governor_hint_error_ratio",
        "Each retry hint a client came back at: when it told the client to come back less when "
        "a slot was in fact available to it, as a share of the hint (negative: early; positive: "
        "the slot stood idle for the time told), by lane and pool.",
        labels=["lane", "pool"],
    )
    for pool in server.pools:
        landings = pool.ledger.landings
        for (lane, outcome), count in sorted(landings.returns.items()):
            returns.add_metric([lane, pool.name, outcome], count)
        for lane, (counts, total) in sorted(landings.errors.items()):
            errors.add_metric([lane, pool.name], cumulative(ERROR_BUCKETS, counts), total)
    yield from (returns, errors)


def _probe_families(server: ServerState, health: Health) -> Iterator[Metric]:
    """The readiness probes' results and durations."""
    jobs = server.metrics
    yield _counter(
        "governor_probes",
        "Readiness probes, by result (ok, failed, timeout, skipped: every worker busy).",
        ["result"],
        _by_one(jobs.probes),
    )
    probe = HistogramMetricFamily(
        "governor_probe_duration_seconds", "Readiness probes that succeeded, by duration."
    )
    probe.add_metric([], jobs.probe.buckets(), jobs.probe.sum)
    yield probe


def _latency_families(server: ServerState, health: Health) -> Iterator[Metric]:
    """Per-job times and sizes by lane, then the objectives met."""
    yield from server.metrics.lane_families()
    yield from _slo_families(server.slo)


def _front_families(server: ServerState, health: Health) -> Iterator[Metric]:
    """What the listeners refused or answered before any job: dropped log records, bad lines,
    connections refused, the HTTP front door's answers."""
    yield CounterMetricFamily(
        "governor_log_records_dropped",
        "Log records dropped because the log writer fell behind (a slow stderr reader).",
        value=dropped_records(),
    )
    yield _counter(
        "governor_bad_frames",
        "Lines refused before any upload, by need code.",
        ["code"],
        _by_one(server.metrics.bad_frames),
    )
    yield _counter(
        "governor_connections_refused",
        "Connections refused at once (too_many_connections) or cut off without a frame "
        "(slow_reader, write_timeout), by reason.",
        ["reason"],
        _by_one(server.connections.refused),
    )
    yield _counter(
        "governor_http_responses",
        "The OpenAI-compatible front door's answers, by path (other: any other, and "
        "answers before a request was read) and HTTP status.",
        ["path", "status"],
        server.metrics.http_responses.items(),
    )
    yield from _line_families(server)


def _line_families(server: ServerState) -> Iterator[Metric]:
    """The line both doors' jobs wait in for their turn."""
    metrics = server.metrics
    yield GaugeMetricFamily(
        "governor_waiting", "Jobs waiting in line for their turn now.", value=len(server.line)
    )
    yield metrics.door_wait.family()
    yield _counter(
        "governor_waits",
        "Waits in line, by lane and how they ended (admitted; refused: a yield, 429 on HTTP, "
        "once the turn moved past the job's budget; unavailable: a drain's, 503 on HTTP; "
        "rejected: 400; left: the client went).",
        ["lane", "outcome"],
        metrics.door_waits.items(),
    )
    yield _counter(
        "governor_not_waited",
        "Busy jobs that could have waited and were refused at once, by why they did not wait "
        "(beyond_budget: their turn later than their wait budget; line_full: max_waiting or "
        "the tenant's bound).",
        ["reason"],
        _by_one(metrics.not_waited),
    )


def _fleet_step_families(server: ServerState, health: Health) -> Iterator[Metric]:
    """The fleet's gate and store, with ``redis_url`` only."""
    if server.fleet is not None:
        yield from _fleet_families(server.fleet)


def _source_families(server: ServerState, health: Health) -> Iterator[Metric]:
    """Connections displaced at the limits, and sources whose keys wait for a turn."""
    yield CounterMetricFamily(
        "governor_connections_displaced",
        "Idle connections (nothing in flight, no key shown) closed to make way for a new "
        "one at max_connections or max_connections_per_source.",
        value=server.connections.displaced,
    )
    yield GaugeMetricFamily(
        "governor_sources_waiting",
        "Source addresses whose new keys wait for a turn: their auth_guess_burst of failed "
        "keys is spent.",
        value=server.connections.sources.waiting,
    )


FamilyBuilder = Callable[[ServerState, Health], Iterator[Metric]]

# The scrape's families, in the order they are exposed.
FAMILIES: tuple[FamilyBuilder, ...] = (
    _server_families,
    _job_families,
    _slot_families,
    _overload_families,
    _pool_families,
    _hint_families,
    _probe_families,
    _latency_families,
    _front_families,
    _fleet_step_families,
    _source_families,
)


def _slo_families(slo: Attainment) -> Iterator[Metric]:
    yield _counter(
        "governor_slo_jobs",
        "Jobs judged against their objectives (done, failed in the backend or out of ttl_ms), "
        "by lane.",
        ["lane"],
        (((lane,), counts[0]) for lane, counts in slo.totals.items()),
    )
    yield _counter(
        "governor_slo_met",
        "Judged jobs that met their objectives, by lane and objective (ttft, tpot, both: goodput).",
        ["lane", "objective"],
        (
            ((lane, objective), counts[i + 1])
            for lane, counts in slo.totals.items()
            for i, objective in enumerate(OBJECTIVES)
        ),
    )
    shares = GaugeMetricFamily(
        "governor_slo_attainment",
        "The share of the jobs judged over the last overload_window that met their objectives, "
        "by lane and objective (ttft, tpot, both: goodput); absent for a lane with none.",
        labels=["lane", "objective"],
    )
    for lane, (_, *met) in sorted(slo.shares().items()):
        for objective, share in zip(OBJECTIVES, met, strict=True):
            shares.add_metric([lane, objective], share)
    yield shares


def _fleet_families(fleet: Fleet) -> Iterator[Metric]:
    gate = fleet.gate
    yield GaugeMetricFamily(
        "governor_fleet_store_state",
        "The fleet's store as this replica sees it: 0 reachable, 1 being tried again, "
        "2 unreachable (lanes that fail open run on this replica's share).",
        value=int(gate.store_state),
    )
    yield GaugeMetricFamily(
        "governor_fleet_replicas",
        "Replicas alive (heartbeats not expired), as the store last said.",
        value=gate.replicas,
    )
    yield GaugeMetricFamily(
        "governor_fleet_inflight",
        "Leases held over the fleet, as the store last said.",
        value=gate.fleet_inflight,
    )
    yield GaugeMetricFamily(
        "governor_fleet_leases", "This replica's leases: its jobs running.", value=len(gate.leases)
    )
    for what in UNSERVED_HELP:
        yield _counter(
            f"governor_fleet_unserved_{what}",
            f"governor_unserved_{what} added up over every replica of the fleet, as the store "
            "said at this replica's last renewal; by lane and tenant.",
            ["lane", "tenant"],
            ((key[1:], n) for key, n in fleet.fleet_unserved.items() if key[0] == what),
        )
    yield _counter(
        "governor_fleet_answers",
        "The fleet's step of admissions, by answer: allowed, fleet_busy, tenant_busy, "
        "rate_limited (the store's); store_error; on_share, share_* and fail_closed (the store "
        "unreachable).",
        ["answer"],
        _by_one(gate.answers),
    )
    seconds = HistogramMetricFamily(
        "governor_fleet_store_seconds", "The store's answers to admissions, by duration."
    )
    seconds.add_metric([], fleet.seconds.buckets(), fleet.seconds.sum)
    yield seconds


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


def _by_one(counts: Mapping[str, int]) -> Iterator[tuple[tuple[str], int]]:
    """A counter keyed by one label's value as ``(label values, count)`` pairs."""
    return (((k,), v) for k, v in counts.items())


def registry_for(state: ServerState, health: Health) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(GovernorCollector(state, health))
    return registry
