"""The /metrics exposition of a populated server, without sockets: every family the collector
exports, with its labels and a value of each kind, read from a server built but not started."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from governor.config import Config
from governor.core.breaker import BreakerState
from governor.core.slo import Verdict
from governor.core.tenants import TenantConfig
from governor.ops.exporter import registry_for
from governor.server import Server


class Waiting:
    """A job in line, as the exporter sees it (it is never offered a slot here)."""

    def decide(self) -> str | None:
        raise AssertionError("not offered")


def populated_server() -> Server:
    """A server with lanes, a fallback pool, an overload controller, two tenants and a fleet,
    not started (the Redis client is never asked anything), each counter the exporter reads
    given a value."""
    server = Server(
        Config(
            listen="127.0.0.1:0",
            runner="stub",
            lanes=True,
            fallback_model="embedded",
            redis_url="redis://127.0.0.1:1",
            tenants=(
                TenantConfig(name="alpha", key_sha256="a" * 64),
                TenantConfig(name="beta", key_sha256="b" * 64),
            ),
        )
    )
    state = server.state
    admission = state.admission
    admission.refusals[("lane_full", "heavy", "alpha")] += 2
    admission.refusals[("rate_limited", "interactive", "beta")] += 1
    admission.unserved.turned_away(("heavy", "alpha"), 900)
    admission.unserved.turned_away(("heavy", "alpha"), 100)
    admission.unserved.gave_up(("heavy", "alpha"))
    admission.ladder["degraded"] += 3
    jobs = state.metrics
    jobs.finished[("done", "interactive", "primary")] += 5
    jobs.finished[("cancelled", "heavy", "fallback")] += 1
    jobs.aborts["cancelled"] += 1
    jobs.aborts["shutdown"] += 2
    jobs.probes["ok"] += 4
    jobs.probes["timeout"] += 1
    jobs.probe.observe(0.02)
    jobs.probe.observe(0.3)
    jobs.ttft.observe("interactive", 0.2)
    jobs.tpot.observe("interactive", 0.01)
    jobs.e2e.observe("heavy", 3.0)
    jobs.decision.observe("interactive", 2e-6)
    jobs.wait.observe("interactive", 0.0)
    jobs.prompt_tokens.observe("interactive", 40)
    jobs.output_tokens.observe("interactive", 8)
    jobs.resumes.observe("heavy", 0.05, 1)
    jobs.prompt_pieces.observe("heavy", 0.06)
    state.line.join(Waiting(), rank=0, tenant="alpha", since=0.0)
    jobs.door_wait.observe("interactive", 0.5)
    jobs.door_waits[("interactive", "admitted")] += 2
    jobs.not_waited["line_full"] += 1
    state.slo.record("interactive", Verdict(ttft=True, tpot=False))
    state.slo.record("interactive", Verdict(ttft=True, tpot=True))
    state.slo.record("heavy", Verdict(ttft=False, tpot=True))
    assert state.overload is not None
    state.overload.transitions[("normal", "degraded")] += 1
    for pool in state.pools:
        pool.breaker.transitions[(BreakerState.CLOSED.label, BreakerState.OPEN.label)] += 1
    landings = state.pools[0].ledger.landings
    landings.returns[("heavy", "landed")] += 9
    landings.returns[("heavy", "early")] += 1
    landings.observe("heavy", -0.04)
    landings.observe("heavy", 0.03)
    state.metrics.bad_frames["bad_json"] += 2
    state.connections.refused["too_many_connections"] += 1
    state.connections.refused["slow_reader"] += 3
    state.metrics.http_responses[("/v1/completions", "200")] += 6
    state.metrics.http_responses[("other", "404")] += 1
    state.connections.displaced = 2
    state.connections.buffers.used = 1234
    assert state.fleet is not None
    gate = state.fleet.gate
    gate.answers["allowed"] += 7
    gate.answers["fleet_busy"] += 1
    gate.replicas = 3
    gate.fleet_inflight = 5
    state.fleet.seconds.observe(0.004)
    state.fleet.fleet_unserved = {("jobs", "heavy", "alpha"): 7, ("tokens", "heavy", "alpha"): 70}
    state.fleet.fleet_unserved[("gave_up", "heavy", "alpha")] = 1
    return server


def exposition(server: Server) -> str:
    return generate_latest(registry_for(server.state, server.health)).decode()


# Each family: its type and its label names (a histogram's ``le`` left out).
FAMILIES = {
    "governor_inflight": ("gauge", ()),
    "governor_inflight_cap": ("gauge", ()),
    "governor_slots_taken": ("gauge", ()),
    "governor_inflight_peak": ("gauge", ()),
    "governor_health": ("gauge", ()),
    "governor_draining": ("gauge", ()),
    "governor_connections": ("gauge", ()),
    "governor_buffered_payload_bytes": ("gauge", ()),
    "governor_expected_service_seconds": ("gauge", ()),
    "governor_ready": ("gauge", ()),
    "governor_live": ("gauge", ()),
    "governor_executed": ("counter", ()),
    "governor_yielded": ("counter", ()),
    "governor_handoff_idle_seconds": ("summary", ()),
    "governor_yields": ("counter", ("lane", "reason", "tenant")),
    "governor_unserved_jobs": ("counter", ("lane", "tenant")),
    "governor_unserved_tokens": ("counter", ("lane", "tenant")),
    "governor_unserved_gave_up": ("counter", ("lane", "tenant")),
    "governor_jobs_finished": ("counter", ("lane", "outcome", "pool")),
    "governor_aborts": ("counter", ("reason",)),
    "governor_tenant_inflight": ("gauge", ("tenant",)),
    "governor_lane_inflight": ("gauge", ("lane",)),
    "governor_suspended": ("gauge", ()),
    "governor_suspensions": ("counter", ("lane",)),
    "governor_resumes": ("counter", ("lane",)),
    "governor_kv_reserved_tokens": ("gauge", ()),
    "governor_kv_used_tokens": ("gauge", ()),
    "governor_kv_capacity_tokens": ("gauge", ()),
    "governor_overload_state": ("gauge", ()),
    "governor_overload_transitions": ("counter", ("from", "to")),
    "governor_fallback_activations": ("counter", ("step",)),
    "governor_breaker_state": ("gauge", ("pool",)),
    "governor_breaker_transitions": ("counter", ("from", "pool", "to")),
    "governor_worker_restarts": ("counter", ("pool",)),
    "governor_workers_live": ("gauge", ("pool",)),
    "governor_hint_returns": ("counter", ("lane", "outcome", "pool")),
    "governor_hint_error_ratio": ("histogram", ("lane", "pool")),
    "governor_probes": ("counter", ("result",)),
    "governor_probe_duration_seconds": ("histogram", ()),
    "governor_time_to_first_token_seconds": ("histogram", ("lane",)),
    "governor_time_per_output_token_seconds": ("histogram", ("lane",)),
    "governor_e2e_job_latency_seconds": ("histogram", ("lane",)),
    "governor_admission_decision_seconds": ("histogram", ("lane",)),
    "governor_admission_wait_seconds": ("histogram", ("lane",)),
    "governor_job_prompt_tokens": ("histogram", ("lane",)),
    "governor_job_output_tokens": ("histogram", ("lane",)),
    "governor_resume_seconds": ("histogram", ("lane",)),
    "governor_resume_recomputed_tokens": ("histogram", ("lane",)),
    "governor_prompt_piece_seconds": ("histogram", ("lane",)),
    "governor_slo_jobs": ("counter", ("lane",)),
    "governor_slo_met": ("counter", ("lane", "objective")),
    "governor_slo_attainment": ("gauge", ("lane", "objective")),
    "governor_log_records_dropped": ("counter", ()),
    "governor_bad_frames": ("counter", ("code",)),
    "governor_connections_refused": ("counter", ("reason",)),
    "governor_http_responses": ("counter", ("path", "status")),
    "governor_waiting": ("gauge", ()),
    "governor_wait_seconds": ("histogram", ("lane",)),
    "governor_waits": ("counter", ("lane", "outcome")),
    "governor_not_waited": ("counter", ("reason",)),
    "governor_fleet_store_state": ("gauge", ()),
    "governor_fleet_replicas": ("gauge", ()),
    "governor_fleet_inflight": ("gauge", ()),
    "governor_fleet_leases": ("gauge", ()),
    "governor_fleet_unserved_jobs": ("counter", ("lane", "tenant")),
    "governor_fleet_unserved_tokens": ("counter", ("lane", "tenant")),
    "governor_fleet_unserved_gave_up": ("counter", ("lane", "tenant")),
    "governor_fleet_answers": ("counter", ("answer",)),
    "governor_fleet_store_seconds": ("histogram", ()),
    "governor_connections_displaced": ("counter", ()),
    "governor_sources_waiting": ("gauge", ()),
}


def families(text: str) -> Iterator[tuple[str, str, tuple[str, ...]]]:
    """Each family's name, type and label names over all its samples."""
    for family in text_string_to_metric_families(text):
        labels = {k for s in family.samples for k in s.labels if k != "le"}
        yield family.name, family.type, tuple(sorted(labels))


def samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


@pytest.fixture(scope="module")
def text() -> str:
    return exposition(populated_server())


def test_every_family_with_its_type_and_labels(text: str) -> None:
    found = {name: (kind, labels) for name, kind, labels in families(text)}
    assert found == FAMILIES
    names = [name for name, _, _ in families(text)]
    assert names == list(FAMILIES)  # in the order the collector yields them


def test_the_family_check_fails_on_a_missing_family(text: str) -> None:
    # Without one family's lines, the comparison above would not hold.
    cut = "\n".join(line for line in text.splitlines() if "governor_sources_waiting" not in line)
    found = {name: (kind, labels) for name, kind, labels in families(cut + "\n")}
    assert found != FAMILIES
    assert set(FAMILIES) - set(found) == {"governor_sources_waiting"}


def test_the_values_are_the_state_s(text: str) -> None:
    m = samples(text)
    assert m['governor_yields_total{lane="heavy",reason="lane_full",tenant="alpha"}'] == 2
    assert m['governor_unserved_jobs_total{lane="heavy",tenant="alpha"}'] == 2
    assert m['governor_unserved_tokens_total{lane="heavy",tenant="alpha"}'] == 1000
    assert m['governor_unserved_gave_up_total{lane="heavy",tenant="alpha"}'] == 1
    assert m['governor_fleet_unserved_jobs_total{lane="heavy",tenant="alpha"}'] == 7
    assert m['governor_fleet_unserved_tokens_total{lane="heavy",tenant="alpha"}'] == 70
    assert m['governor_jobs_finished_total{lane="heavy",outcome="cancelled",pool="fallback"}'] == 1
    assert m['governor_aborts_total{reason="shutdown"}'] == 2
    assert m['governor_tenant_inflight{tenant="beta"}'] == 0
    assert m['governor_lane_inflight{lane="background"}'] == 0
    assert m['governor_overload_transitions_total{from="normal",to="degraded"}'] == 1
    assert m['governor_fallback_activations_total{step="degraded"}'] == 3
    moved = 'governor_breaker_transitions_total{from="closed",pool="fallback",to="open"}'
    assert m[moved] == 1
    assert m['governor_breaker_state{pool="primary"}'] == 0
    assert m['governor_probes_total{result="timeout"}'] == 1
    assert m["governor_probe_duration_seconds_count"] == 2
    assert m['governor_hint_returns_total{lane="heavy",outcome="landed",pool="primary"}'] == 9
    within = m['governor_hint_error_ratio_bucket{lane="heavy",le="0.05",pool="primary"}']
    early = m['governor_hint_error_ratio_bucket{lane="heavy",le="-0.02",pool="primary"}']
    assert (early, within) == (1, 2)
    assert m['governor_slo_jobs_total{lane="interactive"}'] == 2
    assert m['governor_slo_met_total{lane="interactive",objective="both"}'] == 1
    assert m['governor_slo_attainment{lane="heavy",objective="tpot"}'] == 1.0
    assert m['governor_bad_frames_total{code="bad_json"}'] == 2
    assert m['governor_connections_refused_total{reason="slow_reader"}'] == 3
    assert m['governor_http_responses_total{path="/v1/completions",status="200"}'] == 6
    assert m["governor_buffered_payload_bytes"] == 1234
    assert m["governor_connections_displaced_total"] == 2
    assert m["governor_fleet_replicas"] == 3
    assert m["governor_fleet_inflight"] == 5
    assert m['governor_fleet_answers_total{answer="fleet_busy"}'] == 1
    assert m["governor_fleet_store_seconds_count"] == 1
    assert m["governor_overload_state"] == 0
    assert m["governor_ready"] == 0  # never started
    assert m['governor_resume_seconds_count{lane="heavy"}'] == 1
    assert m['governor_resume_recomputed_tokens_sum{lane="heavy"}'] == 1
    assert m['governor_prompt_piece_seconds_sum{lane="heavy"}'] == 0.06


def test_without_lanes_overload_or_fleet_those_families_are_absent() -> None:
    server = Server(Config(listen="127.0.0.1:0", runner="stub"))
    names = {name for name, _, _ in families(exposition(server))}
    absent = {
        "governor_lane_inflight",
        "governor_suspended",
        "governor_suspensions",
        "governor_resumes",
        "governor_overload_state",
        "governor_overload_transitions",
        *(n for n in FAMILIES if n.startswith("governor_fleet_")),
    }
    assert names == set(FAMILIES) - absent
