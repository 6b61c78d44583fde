"""Inference job specs: what a verified payload asks a model to do.

A payload whose ``content_type`` is :data:`SPEC_CONTENT_TYPE` (or ``application/json``) is a JSON
job spec; any other payload is UTF-8 text, run as a prompt with the default parameters (so
heptamini's client uploading a text file gets a real generation). :func:`parse_spec` checks
every field and raises :class:`SpecInvalid` with a specific code; the runner then checks what
needs the model (the prompt's length in tokens against the context window).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from .codes import ErrorCode, NeedCode
from .errors import RemoteProtocolError

SPEC_CONTENT_TYPE = "application/vnd.governor.job+json"
JSON_CONTENT_TYPES = frozenset({SPEC_CONTENT_TYPE, "application/json"})
ROLES = frozenset({"system", "user", "assistant"})
MAX_STOPS = 8
MAX_STOP_CHARS = 64
MAX_LABEL_CHARS = 64
MAX_SEED = 2**31 - 1
MAX_TOP_K = 1000
MAX_SLO_MS = 3_600_000.0  # an hour: a request's own objectives are at most this

_FIELDS = frozenset(
    {
        "prompt",
        "messages",
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "ignore_eos",
        "stream",
        "tenant",
        "lane",
        "tool_risk",
        "ttft_slo_ms",
        "tpot_slo_ms",
    }
)


class SpecInvalid(RemoteProtocolError):
    """A job spec that cannot run; nothing was admitted."""

    error_code = ErrorCode.BAD_SPEC


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    max_new_tokens: int = 128
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    seed: int | None = None  # None: a random seed
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # generate max_new_tokens whatever the model says (benchmarks)
    stream: bool = False
    tenant: str | None = None  # for the policy layer
    lane: str | None = None  # for the policy layer
    tool_risk: float = 0.0  # how likely the job calls tools (0 to 1): weighs in its cost
    # Its own objectives in ms, over its lane's (an interactive job's only tightened); 0: none.
    ttft_slo_ms: float = 0.0
    tpot_slo_ms: float = 0.0

    def estimated_prompt_tokens(self) -> int:
        """The prompt's length in tokens for a runner without a tokenizer: about 4 characters each."""
        text = self.prompt or "".join(m.content for m in self.messages or ())
        return -(-len(text) // 4)

    def to_wire(self) -> dict[str, Any]:
        """The spec as a JSON object (what a client uploads)."""
        obj: dict[str, Any] = {}
        if self.prompt is not None:
            obj["prompt"] = self.prompt
        if self.messages is not None:
            obj["messages"] = [{"role": m.role, "content": m.content} for m in self.messages]
        obj.update(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p
        )
        if self.top_k:
            obj["top_k"] = self.top_k
        if self.min_p:
            obj["min_p"] = self.min_p
        if self.seed is not None:
            obj["seed"] = self.seed
        if self.stop:
            obj["stop"] = list(self.stop)
        if self.ignore_eos:
            obj["ignore_eos"] = True
        if self.stream:
            obj["stream"] = True
        for name in ("tenant", "lane"):
            if getattr(self, name) is not None:
                obj[name] = getattr(self, name)
        for name in ("tool_risk", "ttft_slo_ms", "tpot_slo_ms"):
            if getattr(self, name):
                obj[name] = getattr(self, name)
        return obj

    def encode(self) -> bytes:
        return orjson.dumps(self.to_wire())


def is_json_content_type(content_type: str) -> bool:
    """Whether a payload of ``content_type`` is a JSON job spec (parameters such as
    ``; charset=utf-8`` and case aside); any other payload is a text prompt."""
    return content_type.split(";")[0].strip().lower() in JSON_CONTENT_TYPES


def _invalid(detail: str) -> SpecInvalid:
    return SpecInvalid(NeedCode.SPEC_INVALID, detail)


def _number(obj: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = obj.get(name, default)
    if type(value) not in (int, float) or not low <= value <= high:
        raise _invalid(f"{name!r} must be a number from {low:g} to {high:g}")
    return float(value)


def parse_spec(payload: bytes, content_type: str, *, max_new_tokens_ceiling: int) -> JobSpec:
    """The job a payload asks for; raises :class:`SpecInvalid`."""
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        raise _invalid("the payload is neither a JSON job spec nor UTF-8 text") from None
    if not is_json_content_type(content_type):
        return text_spec(text, max_new_tokens_ceiling=max_new_tokens_ceiling)
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise _invalid(f"the job spec is not valid JSON: {exc}") from None
    return spec_from_object(obj, max_new_tokens_ceiling=max_new_tokens_ceiling)


def text_spec(text: str, *, max_new_tokens_ceiling: int) -> JobSpec:
    """A text payload's job: the text is the prompt, with the default parameters."""
    if not text.strip():
        raise _invalid("the prompt is empty")
    return JobSpec(prompt=text, max_new_tokens=min(128, max_new_tokens_ceiling))


def spec_from_object(obj: Any, *, max_new_tokens_ceiling: int) -> JobSpec:
    """The job a decoded JSON job spec asks for (as :func:`parse_spec`, for a caller that has
    the object already: no JSON text in between); raises :class:`SpecInvalid`."""
    if type(obj) is not dict:
        raise _invalid("the job spec must be a JSON object")
    unknown = obj.keys() - _FIELDS
    if unknown:
        raise _invalid(f"unknown job spec field {sorted(unknown)[0]!r}")

    prompt, messages = _prompt_or_messages(obj)
    max_new = obj.get("max_new_tokens", min(128, max_new_tokens_ceiling))
    if type(max_new) is not int or not 1 <= max_new <= max_new_tokens_ceiling:
        raise _max_new_tokens_invalid(max_new_tokens_ceiling)
    seed = obj.get("seed")
    if seed is not None and (type(seed) is not int or not 0 <= seed <= MAX_SEED):
        raise _invalid(f"'seed' must be an integer from 0 to {MAX_SEED}")
    stop = _stop(obj)
    stream, ignore_eos = obj.get("stream", False), obj.get("ignore_eos", False)
    if type(stream) is not bool or type(ignore_eos) is not bool:
        raise _invalid("'stream' and 'ignore_eos' must be true or false")
    tenant, lane = _label(obj, "tenant"), _label(obj, "lane")
    top_p = _number(obj, "top_p", 0.95, 0.0, 1.0)
    if top_p == 0:
        raise _invalid("'top_p' must be above 0")
    top_k = obj.get("top_k", 0)
    if type(top_k) is not int or not 0 <= top_k <= MAX_TOP_K:
        raise _invalid(f"'top_k' must be an integer from 0 to {MAX_TOP_K}")
    return JobSpec(
        prompt=prompt,
        messages=messages,
        max_new_tokens=max_new,
        temperature=_number(obj, "temperature", 0.8, 0.0, 2.0),
        top_p=top_p,
        top_k=top_k,
        min_p=_number(obj, "min_p", 0.0, 0.0, 1.0),
        seed=seed,
        stop=stop,
        ignore_eos=ignore_eos,
        stream=stream,
        tenant=tenant,
        lane=lane,
        tool_risk=_number(obj, "tool_risk", 0.0, 0.0, 1.0),
        ttft_slo_ms=_slo(obj, "ttft_slo_ms"),
        tpot_slo_ms=_slo(obj, "tpot_slo_ms"),
    )


def _prompt_or_messages(obj: dict[str, Any]) -> tuple[str | None, tuple[Message, ...] | None]:
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        raise _invalid("give exactly one of 'prompt' and 'messages'")
    if prompt is not None and (type(prompt) is not str or not prompt):
        raise _invalid("'prompt' must be a non-empty string")
    if messages is None:
        return prompt, None
    if type(messages) is not list or not messages:
        raise _invalid("'messages' must be a non-empty list")
    parsed = []
    for m in messages:
        if (
            type(m) is not dict
            or m.keys() != {"role", "content"}
            or type(m["role"]) is not str  # (before the set lookup: a list is unhashable)
            or m["role"] not in ROLES
            or type(m["content"]) is not str
        ):
            raise _invalid(
                "each message must be {'role': 'system'|'user'|'assistant', 'content': str}"
            )
        parsed.append(Message(m["role"], m["content"]))
    return None, tuple(parsed)


def _stop(obj: dict[str, Any]) -> tuple[str, ...]:
    stop = obj.get("stop", [])
    if type(stop) is str:
        stop = [stop]
    if (
        type(stop) is not list
        or len(stop) > MAX_STOPS
        or any(type(s) is not str or not 0 < len(s) <= MAX_STOP_CHARS for s in stop)
    ):
        raise _invalid(
            f"'stop' must be a string or a list of at most {MAX_STOPS} strings "
            f"of 1 to {MAX_STOP_CHARS} characters"
        )
    return tuple(stop)


def _label(obj: dict[str, Any], name: str) -> str | None:
    value = obj.get(name)
    if value is not None and (type(value) is not str or not 0 < len(value) <= MAX_LABEL_CHARS):
        raise _invalid(f"{name!r} must be a string of 1 to {MAX_LABEL_CHARS} characters")
    return value


def check_ceiling(spec: JobSpec, max_new_tokens_ceiling: int) -> JobSpec:
    """``spec`` (parsed against one runner's ceiling) if another runner may run it too."""
    if spec.max_new_tokens > max_new_tokens_ceiling:
        raise _max_new_tokens_invalid(max_new_tokens_ceiling)
    return spec


def _max_new_tokens_invalid(ceiling: int) -> SpecInvalid:
    return SpecInvalid(
        NeedCode.MAX_NEW_TOKENS_INVALID, f"'max_new_tokens' must be an integer from 1 to {ceiling}"
    )


def _slo(obj: dict[str, Any], name: str) -> float:
    value = _number(obj, name, 0.0, 0.0, MAX_SLO_MS)
    if name in obj and value == 0:
        raise _invalid(f"{name!r} must be above 0")
    return value
