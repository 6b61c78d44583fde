"""Every wire name of the protocol, in one place.

The v0 names come from heptamini's wire protocol (``shared/HEPTAMINI_V0.md``); the
governor's extensions are marked as such. Clients key on these strings, so a value here
never changes once released: add a new member rather than rename one.
"""

from __future__ import annotations

from enum import StrEnum

PROTOCOL_VERSION = 0
UNKNOWN_JOB = "J_?"


class Verb(StrEnum):
    SHARE = "share"  # client: upload a manifest or a chunk
    PING = "ping"  # client: health probe
    CANCEL = "cancel"  # client, extension: stop a job
    CLARIFY = "clarify"  # server: an answer that keeps the exchange going (ok, need, yield)
    CONFIRM = "confirm"  # server: a closing answer (ok to a ping, done, abort)


CLIENT_VERBS = frozenset({Verb.SHARE, Verb.PING, Verb.CANCEL})


class Status(StrEnum):
    OK = "ok"
    NEED = "need"
    YIELD = "yield"
    DONE = "done"
    ABORT = "abort"


class NeedCode(StrEnum):
    # A line that is not a JSON object (the bad-line classifier's verdicts).
    HTTP_REQUEST = "http_request"
    HTML_DOCUMENT = "html_document"
    XML_DOCUMENT = "xml_document"
    BINARY_GIF = "binary_gif"
    JSON_ARRAY = "json_array"
    JSON_MALFORMED = "json_malformed"
    NOT_JSON = "not_json"
    # A JSON object that breaks an envelope rule.
    ENVELOPE_INVALID = "envelope_invalid"
    # Upload problems, answered with clarify/need; the connection stays open. (heptamini's
    # list also names chunk_missing; no check here answers it, so it has no member.)
    MANIFEST_INVALID = "manifest_invalid"
    MANIFEST_MISSING = "manifest_missing"
    PAYLOAD_ID_MISMATCH = "payload_id_mismatch"
    CHUNK_EXPECTED_INDEX = "chunk_expected_index"
    CHUNK_B64_INVALID = "chunk_b64_invalid"
    CHUNK_TOO_LARGE = "chunk_too_large"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    CHUNK_HASH_MISMATCH = "chunk_hash_mismatch"
    PAYLOAD_SIZE_MISMATCH = "payload_size_mismatch"
    PAYLOAD_HASH_MISMATCH = "payload_hash_mismatch"
    # Extension: a payload_chunk object of the wrong shape (missing or mistyped field).
    CHUNK_INVALID = "chunk_invalid"
    # Extension: a payload_inline object of the wrong shape.
    INLINE_INVALID = "inline_invalid"
    # Extension: the chunk's offset is not the number of bytes received so far.
    CHUNK_OFFSET_MISMATCH = "chunk_offset_mismatch"
    # Extension: a frame for a job that is running now.
    JOB_RUNNING = "job_running"
    # Extension: a cancel for a job this connection does not have.
    JOB_UNKNOWN = "job_unknown"
    # Extension: the verified payload is not a job the runner can run (nothing was admitted).
    SPEC_INVALID = "spec_invalid"
    MAX_NEW_TOKENS_INVALID = "max_new_tokens_invalid"
    PROMPT_TOO_LONG = "prompt_too_long"
    # Admission.
    SERVER_BUSY = "server_busy"  # yield: every execution slot is taken
    DRAINING = "draining"  # extension, yield: the daemon is shutting down
    LANE_FULL = "lane_full"  # extension, yield: the job's lane has no slot it may take now
    LANE_PAUSED = "lane_paused"  # extension, yield: the overload state pauses the job's lane
    TENANT_BUSY = "tenant_busy"  # extension, yield: the tenant is at its concurrency cap
    TENANT_SHARE = "tenant_share"  # extension, yield: at its weighted share while others wait
    RATE_LIMITED = "rate_limited"  # extension, yield: the tenant's request or token rate
    KV_PRESSURE = "kv_pressure"  # extension, yield: the KV budget cannot take the job now
    BREAKER_OPEN = "breaker_open"  # extension, yield: the runner pool's circuit breaker is open
    BUFFERS_FULL = "buffers_full"  # extension, yield: the server's payload buffers are full
    FLEET_BUSY = "fleet_busy"  # extension, yield: fleet_max_inflight jobs run over the fleet
    FLEET_UNAVAILABLE = "fleet_unavailable"  # extension, yield: the fleet's store is unreachable
    # Extension, abort: the policy will never run this job.
    PROMPT_OVER_CEILING = "prompt_over_ceiling"
    KV_OVER_CAPACITY = "kv_over_capacity"
    LANE_NOT_ALLOWED = "lane_not_allowed"
    UNAUTHORIZED = "unauthorized"  # extension, abort: a missing or unknown api_key
    UPLOAD_TIMEOUT = "upload_timeout"  # extension, abort: no chunk for upload_timeout seconds
    # Outcomes of an admitted job.
    BACKEND_ERROR = "backend_error"
    TTL_EXPIRED = "ttl_expired"  # extension: ttl_ms ran out while the job ran
    SHUTDOWN = "shutdown"  # extension: still running when the drain grace period ended
    CANCELLED = "cancelled"  # extension: the client cancelled it
    RUNNER_CRASHED = "runner_crashed"  # extension: the worker process died under the job
    RUNNER_TIMEOUT = "runner_timeout"  # extension: the worker hung past the job's deadline
    RUNNER_UNAVAILABLE = "runner_unavailable"  # extension: no worker came up in time
    UPSTREAM_ERROR = "upstream_error"  # extension: the sidecar's server answered an error
    UPSTREAM_TIMEOUT = "upstream_timeout"  # extension: ... or did not answer in time
    # Extension: the sidecar's server refused the request (its 4xx, passed on to the client).
    UPSTREAM_REJECTED = "upstream_rejected"
    # Connection-fatal: answered with confirm/abort, then the connection is closed.
    LINE_TOO_LARGE = "line_too_large"
    IDLE_TIMEOUT = "idle_timeout"
    TOO_MANY_JOBS = "too_many_jobs"
    TOO_MANY_CONNECTIONS = "too_many_connections"  # extension
    DISPLACED = "displaced"  # extension: an idle connection made way for a new one at a limit


class Bound(StrEnum):
    """Extension: what bound refused a job, on a yield (the ``bound.NAME`` receipt; on HTTP the
    ``x-governor-bound`` header). Named after the setting an operator would change."""

    MAX_INFLIGHT = "max_inflight"  # the cap on jobs executing (server_busy)
    INTERACTIVE_RESERVE = "interactive_reserve"  # the free slots are kept for chats (lane_full)
    LANE_QUOTA = "lane_quota"  # the job's lane holds its share of the slots (lane_full)
    LANE_PAUSE = "lane_pause"  # the overload state pauses the job's lane (lane_paused)
    TENANT_MAX_INFLIGHT = "tenant_max_inflight"  # the tenant's own cap (tenant_busy)
    TENANT_SHARE = "tenant_share"  # the tenant's weighted share (tenant_share)
    TENANT_RATE = "tenant_rate"  # the tenant's request or token rate (rate_limited)
    KV_BUDGET = "kv_budget"  # the KV cache cells (kv_pressure)
    BREAKER = "breaker"  # the runner pool's circuit breaker (breaker_open)
    BUFFERS = "buffers"  # the server's payload buffers (buffers_full)
    FLEET_MAX_INFLIGHT = "fleet_max_inflight"  # the fleet's cap (fleet_busy)
    FLEET_STORE = "fleet_store"  # the fleet's store is unreachable (fleet_unavailable)
    DRAIN = "drain"  # the replica is draining (draining)


# Each yield's bound, by its need code, where the code alone says it (lane_full: the reserve
# or the lane's quota; tenant_busy and rate_limited: this replica's or the fleet's, the same
# settings).
BOUNDS: dict[str, Bound] = {
    NeedCode.SERVER_BUSY: Bound.MAX_INFLIGHT,
    NeedCode.LANE_FULL: Bound.LANE_QUOTA,
    NeedCode.LANE_PAUSED: Bound.LANE_PAUSE,
    NeedCode.TENANT_BUSY: Bound.TENANT_MAX_INFLIGHT,
    NeedCode.TENANT_SHARE: Bound.TENANT_SHARE,
    NeedCode.RATE_LIMITED: Bound.TENANT_RATE,
    NeedCode.KV_PRESSURE: Bound.KV_BUDGET,
    NeedCode.BREAKER_OPEN: Bound.BREAKER,
    NeedCode.BUFFERS_FULL: Bound.BUFFERS,
    NeedCode.FLEET_BUSY: Bound.FLEET_MAX_INFLIGHT,
    NeedCode.FLEET_UNAVAILABLE: Bound.FLEET_STORE,
    NeedCode.DRAINING: Bound.DRAIN,
}


class ErrorCode(StrEnum):
    BAD_FRAME = "bad_frame"
    BAD_ENVELOPE = "bad_envelope"
    NEED_MANIFEST_FIX = "need_manifest_fix"
    NEED_MORE = "need_more"
    BUSY = "busy"
    BACKEND_ERROR = "backend_error"
    TIMEOUT = "timeout"
    QUOTA = "quota"
    CONFLICT = "conflict"  # extension: JOB_RUNNING
    UNAVAILABLE = "unavailable"  # extension: DRAINING, SHUTDOWN
    BAD_SPEC = "bad_spec"  # extension: SPEC_INVALID, MAX_NEW_TOKENS_INVALID, PROMPT_TOO_LONG
    CANCELLED = "cancelled"  # extension
    POLICY = "policy"  # extension: PROMPT_OVER_CEILING, KV_OVER_CAPACITY, LANE_NOT_ALLOWED
    UNAUTHORIZED = "unauthorized"  # extension


class Receipt(StrEnum):
    """Receipt kinds. The first six are the core receipts carried by every reply."""

    HEALTH = "server.health"
    INFLIGHT = "backend.inflight"
    CAP = "backend.cap"
    EXECUTED_TOTAL = "server.executed_total"
    YIELDED_TOTAL = "server.yielded_total"
    BYTES_IN = "cdr.bytes_in"
    # Extensions.
    INFLIGHT_PEAK = "backend.inflight_peak"  # highest inflight since start
    DRAINING = "server.draining"  # 1 while shutting down
    CONNECTIONS = "server.connections"
    OVERLOAD_STATE = (
        "server.overload_state"  # 0 normal, 1 degraded, 2 batch_paused, 3 interactive_only
    )
    RETRY_HINT_MS = "conn.retry_hint_ms"  # on a yield: the hint, as heptamini sends it
    PAYLOAD_HELD = "conn.payload_held"  # on a yield: 1 if resending the final chunk will do
    BACKEND_MS = "cdr.backend.ms"  # on a terminal frame: time the job held its slot
    # On a yield that waits on a slot, the hint's parts (they add up to it): until the
    # predicted end of the job whose slot it waits for, and the turns of the jobs promised
    # ahead of it (how many: HINT_AHEAD) after that end.
    HINT_RELEASE_MS = "hint.release_ms"
    HINT_TURNS_MS = "hint.turns_ms"
    HINT_AHEAD = "hint.ahead"
    BOUND = "bound"  # on a yield: "bound.NAME", value 1, NAME a Bound
    # On a busy yield with redis_url: 1 when, as the fleet's store last said, no other replica
    # has a free slot either (trying another replica would only be refused there too).
    FLEET_SATURATED = "fleet.saturated"


# Fields only a server may set; a request carrying any of them breaks the envelope.
SERVER_ONLY_FIELDS = frozenset(
    {
        "status",
        "need_code",
        "error_code",
        "retry_hint_ms",
        "receipts",
        "detail",
        "result",
        "delta",
        "elsewhere",
    }
)
