"""Inference job specs: what a verified payload asks a model to do.

A payload whose ``content_type`` is :data:`SPEC_CONTENT_TYPE` (or ``application/json``) is a JSON
job spec; any other payload is UTF-8 text, run as a prompt with the default parameters (so
heptamini's client uploading a text file gets a real generation). :func:`parse_spec` checks
every field and raises :class:`SpecInvalid` with a specific code; the runner then checks what
needs the model (the prompt's length in tokens against the context window).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from .codes import ErrorCode, NeedCode
from .errors import RemoteProtocolError

SPEC_CONTENT_TYPE = "application/vnd.governor.job+json"
JSON_CONTENT_TYPES = frozenset({SPEC_CONTENT_TYPE, "application/json"})
ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_STOPS = 8
MAX_STOP_CHARS = 64
MAX_LABEL_CHARS = 64
MAX_SEED = 2**31 - 1
MAX_TOP_K = 1000
MAX_SLO_MS = 3_600_000.0  # an hour: a request's own objectives are at most this
MAX_N = 16  # sequences of one prompt a job may ask for
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries (OpenAI's bound)
MAX_TOOLS = 64
MAX_SCHEMA_DEPTH = 32  # nesting of a JSON schema or a tool's parameters
MAX_INPUTS = 2048  # texts one embeddings job may ask for
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# What a request leaves out of its sampling is drawn as llama-server draws it: its defaults
# (top_k 0 and min_p 0 are off).
TEMPERATURE, TOP_P, TOP_K, MIN_P = 0.8, 0.95, 40, 0.05
ANY_OBJECT = '{"type":"object"}'  # the schema of JSON mode (response_format json_object)
TOOL_CHOICES = frozenset({"none", "auto", "required"})

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
        "n",
        "logprobs",
        "top_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "repeat_penalty",
        "logit_bias",
        "response_format",
        "tools",
        "tool_choice",
        "input",
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
class Forward:
    """An OpenAI request for a runner that forwards it (the ``http`` runner: a sidecar), as the
    client sent it: the upstream's ``path`` and the ``body``; ``fields``, the object it decodes
    to less the governor's own fields, where it had some (None: the body goes as it came);
    ``chars``, the characters of its text (the prompt's size, for admission); ``stream``;
    ``asked``, the output length it asked for, in its field ``length_field`` (None: none)."""

    path: str
    body: bytes
    fields: dict[str, Any] | None
    chars: int
    stream: bool
    asked: int | None = None
    length_field: str = "max_tokens"


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    max_new_tokens: int = 128
    # Sampling: llama-server's defaults (:data:`TEMPERATURE` and the rest).
    temperature: float = TEMPERATURE
    top_p: float = TOP_P
    top_k: int = TOP_K
    min_p: float = MIN_P
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
    n: int = 1  # sequences generated from the prompt (OpenAI's choices)
    logprobs: int | None = None  # None: none; else each token's and this many alternatives'
    presence_penalty: float = 0.0  # -2 to 2, OpenAI's
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0  # llama.cpp's (1: off)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    json_schema: str | None = None  # the output is JSON valid against this schema (JSON text)
    tools: str | None = None  # the functions the model may call (JSON text, OpenAI's list)
    tool_choice: str = "none"  # "none", "auto", "required", or the name of one of the tools
    forward: Forward | None = None  # the request as it came, for a runner that forwards it
    # Texts to embed, instead of a prompt: a job that generates nothing (max_new_tokens 0).
    input: tuple[str, ...] | None = None

    @property
    def output_tokens(self) -> int:
        """The most tokens it may generate, all its sequences together."""
        return self.max_new_tokens * self.n

    def estimated_prompt_tokens(self) -> int:
        """The prompt's length in tokens for a runner without a tokenizer: about 4 characters each."""
        if self.forward is not None:
            return -(-self.forward.chars // 4)
        text = self.prompt or "".join(m.content for m in self.messages or ())
        text += "".join(self.input or ())
        return -(-len(text) // 4)

    def to_wire(self) -> dict[str, Any]:
        """The spec as a JSON object (what a client uploads)."""
        obj: dict[str, Any] = {}
        if self.prompt is not None:
            obj["prompt"] = self.prompt
        if self.messages is not None:
            obj["messages"] = [{"role": m.role, "content": m.content} for m in self.messages]
        if self.input is not None:
            obj["input"] = list(self.input)
        else:
            obj["max_new_tokens"] = self.max_new_tokens
        obj.update(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p
        )
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
        obj.update(self._features_wire())
        return obj

    def _features_wire(self) -> dict[str, Any]:
        """:func:`_features`' fields, where they are not their defaults."""
        obj: dict[str, Any] = {}
        for name, default in (
            ("n", 1),
            ("presence_penalty", 0.0),
            ("frequency_penalty", 0.0),
            ("repeat_penalty", 1.0),
        ):
            if getattr(self, name) != default:
                obj[name] = getattr(self, name)
        if self.logprobs is not None:
            obj.update(logprobs=True, top_logprobs=self.logprobs)
        if self.logit_bias:
            obj["logit_bias"] = {str(token): bias for token, bias in self.logit_bias}
        if self.json_schema is not None:
            schema = orjson.loads(self.json_schema)
            obj["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
        if self.tools is not None:
            obj["tools"] = orjson.loads(self.tools)
        if self.tool_choice != "none":
            choice = self.tool_choice
            named = {"type": "function", "function": {"name": choice}}
            obj["tool_choice"] = choice if choice in TOOL_CHOICES else named
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

    inputs = _inputs(obj)
    if inputs is not None:
        prompt, messages, max_new = None, None, 0
    else:
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
    top_p = _number(obj, "top_p", TOP_P, 0.0, 1.0)
    if top_p == 0:
        raise _invalid("'top_p' must be above 0")
    top_k = obj.get("top_k", TOP_K)
    if type(top_k) is not int or not 0 <= top_k <= MAX_TOP_K:
        raise _invalid(f"'top_k' must be an integer from 0 to {MAX_TOP_K}")
    return JobSpec(
        prompt=prompt,
        messages=messages,
        max_new_tokens=max_new,
        temperature=_number(obj, "temperature", TEMPERATURE, 0.0, 2.0),
        top_p=top_p,
        top_k=top_k,
        min_p=_number(obj, "min_p", MIN_P, 0.0, 1.0),
        seed=seed,
        stop=stop,
        ignore_eos=ignore_eos,
        stream=stream,
        tenant=tenant,
        lane=lane,
        tool_risk=_number(obj, "tool_risk", 0.0, 0.0, 1.0),
        ttft_slo_ms=_slo(obj, "ttft_slo_ms"),
        tpot_slo_ms=_slo(obj, "tpot_slo_ms"),
        input=inputs,
        **_features(obj),
    )


def _inputs(obj: dict[str, Any]) -> tuple[str, ...] | None:
    """An embeddings job's texts (None: a generating job's spec): a string, or a list of 1 to
    :data:`MAX_INPUTS` non-empty strings, with neither a prompt, messages, nor an output."""
    texts = obj.get("input")
    if texts is None:
        return None
    if {"prompt", "messages", "max_new_tokens", "stream"} & obj.keys():
        raise _invalid(
            "an embeddings job ('input') has no 'prompt', 'messages', 'max_new_tokens' or 'stream'"
        )
    if type(texts) is str:
        texts = [texts]
    if (
        type(texts) is not list
        or not 0 < len(texts) <= MAX_INPUTS
        or any(type(t) is not str or not t for t in texts)
    ):
        raise _invalid(f"'input' must be a non-empty string or a list of 1 to {MAX_INPUTS} of them")
    return tuple(texts)


def _features(obj: dict[str, Any]) -> dict[str, Any]:
    """The fields beyond sampling that OpenAI's API has: choices, log probabilities,
    penalties, biases, structured output and tools (checked in shape; what needs the model,
    token ids and schemas, its runner checks)."""
    n = obj.get("n", 1)
    if type(n) is not int or not 1 <= n <= MAX_N:
        raise _invalid(f"'n' must be an integer from 1 to {MAX_N}")
    tools, tool_choice = _tools(obj)
    return {
        "n": n,
        "logprobs": _logprobs(obj),
        "presence_penalty": _number(obj, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": _number(obj, "frequency_penalty", 0.0, -2.0, 2.0),
        "repeat_penalty": _repeat_penalty(obj),
        "logit_bias": _logit_bias(obj.get("logit_bias")),
        "json_schema": _response_format(obj.get("response_format")),
        "tools": tools,
        "tool_choice": tool_choice,
    }


def _repeat_penalty(obj: dict[str, Any]) -> float:
    penalty = _number(obj, "repeat_penalty", 1.0, 0.0, 10.0)
    if penalty == 0:
        raise _invalid("'repeat_penalty' must be above 0 (1: none)")
    return penalty


def _logprobs(obj: dict[str, Any]) -> int | None:
    wanted, top = obj.get("logprobs", False), obj.get("top_logprobs")
    if type(wanted) is not bool:
        raise _invalid("'logprobs' must be true or false")
    if top is not None and (type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise _invalid(f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}")
    if not wanted:
        if top:
            raise _invalid("'top_logprobs' needs 'logprobs': true")
        return None
    return top or 0


def _logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    if bias is None:
        return ()
    if type(bias) is not dict or len(bias) > MAX_LOGIT_BIAS:
        raise _invalid(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} entries")
    out = []
    for token, value in bias.items():
        if not (token.isascii() and token.isdigit() and len(token) <= 9):
            raise _invalid("'logit_bias' keys must be token ids (whole numbers, as strings)")
        if type(value) not in (int, float) or not -100 <= value <= 100:
            raise _invalid("'logit_bias' values must be numbers from -100 to 100")
        out.append((int(token), float(value)))
    return tuple(sorted(out))


def _response_format(fmt: Any) -> str | None:
    """JSON mode's schema, as JSON text: ``json_object`` is any object, ``json_schema`` its
    ``schema`` (any object where it gives none); ``text`` (or none): None."""
    if fmt is None:
        return None
    kind = fmt.get("type") if type(fmt) is dict else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", {"type": "object"}) if type(spec) is dict else None
        if type(schema) is not dict or _too_deep(schema):
            raise _invalid(
                "'response_format' json_schema must be {\"schema\": {...}}, a JSON schema "
                f"nested at most {MAX_SCHEMA_DEPTH} deep"
            )
        return orjson.dumps(schema).decode()
    raise _invalid(
        '\'response_format\' must be {"type": "text"}, {"type": "json_object"} or '
        '{"type": "json_schema", "json_schema": {"schema": {...}}}'
    )


def _tools(obj: dict[str, Any]) -> tuple[str | None, str]:
    """The tools (JSON text of OpenAI's list, each ``{"type": "function", "function": {name,
    description, parameters}}``) and the choice among them: ``none``, ``auto``, ``required``
    or one function's name."""
    tools, choice = obj.get("tools"), obj.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise _invalid("'tool_choice' needs 'tools'")
        return None, "none"
    if type(tools) is not list or len(tools) > MAX_TOOLS:
        raise _invalid(f"'tools' must be a list of at most {MAX_TOOLS} functions")
    names = [_tool_name(tool) for tool in tools]
    if len(set(names)) != len(names):
        raise _invalid("each tool's name must be different")
    if choice is None:
        choice = "auto"
    elif type(choice) is dict:
        function = choice.get("function")
        name = function.get("name") if type(function) is dict else None
        if choice.get("type") != "function" or name not in names:
            raise _invalid(
                'a named \'tool_choice\' is {"type": "function", "function": {"name": '
                "NAME}} with NAME one of the tools"
            )
        choice = name
    elif choice not in TOOL_CHOICES:
        raise _invalid("'tool_choice' must be none, auto, required or a named function")
    return orjson.dumps(tools).decode(), choice


def _tool_name(tool: Any) -> str:
    function = tool.get("function") if type(tool) is dict else None
    if type(function) is not dict or tool.get("type") != "function":
        raise _invalid('each tool must be {"type": "function", "function": {...}}')
    name, parameters = function.get("name"), function.get("parameters", {})
    if type(name) is not str or not TOOL_NAME.fullmatch(name):
        raise _invalid("a function's name must be 1 to 64 letters, digits, '_' or '-'")
    if type(parameters) is not dict or _too_deep(parameters):
        raise _invalid(
            f"a function's parameters must be a JSON schema nested at most {MAX_SCHEMA_DEPTH} deep"
        )
    if type(function.get("description", "")) is not str:
        raise _invalid("a function's description must be a string")
    return name


def _too_deep(value: Any) -> bool:
    """Whether ``value``'s lists and objects nest deeper than :data:`MAX_SCHEMA_DEPTH` (walked
    without recursion: a body may nest a thousand deep)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if type(item) is dict else item if type(item) is list else ()
        for child in children:
            if depth + 1 > MAX_SCHEMA_DEPTH:
                return True
            stack.append((child, depth + 1))
    return False


# The fields of a forwarded request that are the governor's, not its upstream's.
GOVERNOR_FIELDS = frozenset({"lane", "tool_risk", "ttft_slo_ms", "tpot_slo_ms"})


def forwarded_spec(
    forward: Forward, obj: dict[str, Any], *, n: int, max_new_tokens_ceiling: int
) -> JobSpec:
    """A forwarded request's job: what admission needs of it (its size, its lane, its
    objectives), from ``obj``, its :data:`GOVERNOR_FIELDS`; the rest is the upstream's to
    judge. Its ``max_new_tokens`` is what it asked for, else the ceiling (0 for a request
    that generates nothing: ``length_field`` empty)."""
    if not forward.length_field:
        max_new = 0
    else:
        max_new = max_new_tokens_ceiling if forward.asked is None else forward.asked
        if not 1 <= max_new <= max_new_tokens_ceiling:
            raise _max_new_tokens_invalid(max_new_tokens_ceiling)
    if not 1 <= n <= MAX_N:
        raise _invalid(f"'n' must be an integer from 1 to {MAX_N}")
    return JobSpec(
        max_new_tokens=max_new,
        n=n,
        stream=forward.stream,
        lane=_label(obj, "lane"),
        tool_risk=_number(obj, "tool_risk", 0.0, 0.0, 1.0),
        ttft_slo_ms=_slo(obj, "ttft_slo_ms"),
        tpot_slo_ms=_slo(obj, "tpot_slo_ms"),
        forward=forward,
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
