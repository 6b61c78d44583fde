"""The OpenAI HTTP API as the governor speaks it, with no IO: a request body to a job spec, a
job's result to an answer, a refusal to a status and its headers; and the places in line kept
for a refused request's retry.

:mod:`governor.listeners.http` serves it. What each field becomes depends on the runner
(``docs/PROTOCOL.md`` has the table, per runner):

* a runner that generates (the embedded ``llama``, the ``stub``) is given a job spec:
  ``prompt`` or ``messages`` (roles ``system``, ``developer`` as system, ``user``,
  ``assistant``, ``tool``; content a string or text parts), ``max_completion_tokens`` (else
  ``max_tokens``) as ``max_new_tokens``, the sampling fields with OpenAI's defaults, and OpenAI's
  features (``n``, ``logprobs``, penalties, ``logit_bias``, ``response_format``, ``tools``)
  as the spec's fields, which checks them; a completion's ``echo`` is this module's; the
  governor's own fields ride along as extra body fields (``lane``, ``ttft_slo_ms``, ...); fields
  that change nothing are accepted, a few others only at their defaults, and any other is
  refused (400, ``spec_invalid``, with the field as ``param``) rather than silently not
  honoured (:func:`parse_call`);
* a runner that forwards (the ``http`` runner, a sidecar) is given the request as it came:
  only what admission needs is read (:func:`parse_forward`), and its answer goes back as the
  upstream gave it (:mod:`governor.listeners.http` relays it).

Every error is OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, its ``code``
the governor's need code.
"""

from __future__ import annotations

import binascii
import heapq
import itertools
import math
import secrets
import struct
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import orjson

from protocol.codes import ErrorCode, NeedCode
from protocol.spec import (
    GOVERNOR_FIELDS,
    MAX_SEED,
    Forward,
    JobSpec,
    forwarded_spec,
    spec_from_object,
)

from ..core.admission import Attempt, Yielded
from ..runners import Token

LANE_HEADER = "x-governor-lane"
# Passed on to the job spec as they are: the governor's own parameters, llama.cpp's sampling
# parameters beyond OpenAI's, and OpenAI's whose values the spec checks.
EXTRA_FIELDS = (
    "lane",
    "top_k",
    "min_p",
    "repeat_penalty",
    "ignore_eos",
    "tool_risk",
    "ttft_slo_ms",
    "tpot_slo_ms",
    "n",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "response_format",
    "tools",
    "tool_choice",
)
# Accepted whatever their value: they change nothing about the generation. (There is at most
# one tool call a choice: parallel_tool_calls asks for no more.)
NO_EFFECT = frozenset(
    {
        "model",
        "user",
        "metadata",
        "store",
        "service_tier",
        "stream_options",
        "prompt_cache_key",
        "parallel_tool_calls",
    }
)
# Accepted at these values (OpenAI's defaults, or what the governor does anyway); refused at
# any other, since the answer would silently not honour them.
DEFAULTS: Mapping[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "echo": (False,),  # (a chat's: a completion's is honoured)
    "functions": ([],),  # (OpenAI's older form of tools)
    "function_call": ("none",),
    "suffix": ("",),
    "modalities": (["text"],),
}
MAPPED = frozenset(
    {"prompt", "messages", "max_tokens", "max_completion_tokens", "logprobs"}
    | {"temperature", "top_p", "seed", "stop", "stream", *EXTRA_FIELDS}
)
ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
CHAT, COMPLETION, EMBEDDING = "chat", "completion", "embedding"
CHAT_ONLY = frozenset({"tools", "tool_choice", "top_logprobs"})
# A forwarded request's fields that may carry its text (their strings make its size).
TEXT_FIELDS = ("messages", "prompt", "input", "tools", "functions", "suffix")
# A request's own wait budget at the door, in whole milliseconds (0: refuse it at once); the
# server's max_wait bounds it.
MAX_WAIT_HEADER = "x-governor-max-wait-ms"
# Ends of a job that the runner (or the upstream) caused and a retry may get past: 502, or 504
# for those that ran out of time.
TIMEOUTS = frozenset({NeedCode.RUNNER_TIMEOUT, NeedCode.UPSTREAM_TIMEOUT})


class ApiError(Exception):
    """An answer other than the job's: its status, need code and message, OpenAI-shaped."""

    def __init__(
        self,
        status: HTTPStatus,
        code: str,
        message: str,
        *,
        param: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.headers = headers

    def body(self) -> bytes:
        return error_body(self.status, self.code, self.message, self.param)


def error_body(status: HTTPStatus, code: str, message: str, param: str | None = None) -> bytes:
    return orjson.dumps({"error": _error(status, code, message, param)})


def closing_error(
    status: HTTPStatus, code: str, message: str, headers: tuple[tuple[str, str], ...] = ()
) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection, written by hand: for what
    h11 cannot answer (a request it has not parsed: a deadline, a head too large, a bad one)."""
    body = error_body(status, code, message)
    lines = [
        f"HTTP/1.1 {status.value} {status.phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{name}: {value}" for name, value in headers),
    ]
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + body


def _error(status: HTTPStatus, code: str, message: str, param: str | None) -> dict[str, Any]:
    return {"message": message, "type": error_type(status), "param": param, "code": code}


def error_type(status: HTTPStatus) -> str:
    if status == HTTPStatus.UNAUTHORIZED:
        return "authentication_error"
    if status == HTTPStatus.TOO_MANY_REQUESTS:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def bad_request(
    message: str, param: str | None = None, code: str = NeedCode.SPEC_INVALID
) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, code, message, param=param)


# Requests ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Call:
    """A request for a job: the job spec it maps to (``fields``, or ``forward`` for a runner
    that forwards requests as they came), and how the answer is to be shaped."""

    kind: str  # CHAT, COMPLETION or EMBEDDING
    fields: dict[str, Any]  # a governor job spec's (protocol.spec) fields, checked at the intake
    stream: bool
    include_usage: bool
    forward: Forward | None = None
    echo: str = ""  # a completion's prompt, before each choice's text (``echo``)
    base64: bool = False  # embeddings: each vector as base64 of its float32s (the SDK's ask)

    @property
    def chat(self) -> bool:
        return self.kind == CHAT

    def spec(self, max_new_tokens_ceiling: int) -> JobSpec:
        """The job spec, checked against the runner's ceiling; raises ``SpecInvalid``."""
        if self.forward is not None:
            return forwarded_spec(
                self.forward,
                self.fields,
                n=self.fields.get("n", 1),
                max_new_tokens_ceiling=max_new_tokens_ceiling,
            )
        return spec_from_object(dict(self.fields), max_new_tokens_ceiling=max_new_tokens_ceiling)


def parse_call(
    body: bytes, *, kind: str, lane_header: str | None, path: str = "", forwards: bool = False
) -> Call:
    """The job a ``/v1/completions``, ``/v1/chat/completions`` (or, forwarded,
    ``/v1/embeddings``) body asks for; raises :class:`ApiError` (400). What the runner checks
    (ranges, the prompt's length) it checks when it prepares the spec. ``forwards``: the
    runner forwards the request to ``path`` upstream as it came (:func:`parse_forward`)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    if type(obj) is not dict:
        raise bad_request("the body must be a JSON object")
    if forwards:
        return parse_forward(obj, body, kind=kind, path=path, lane_header=lane_header)
    if kind == EMBEDDING:
        return parse_embeddings(obj, lane_header)
    _check_supported(obj, kind)
    spec: dict[str, Any] = {}
    echo = ""
    if kind == CHAT:
        if "prompt" in obj:
            raise bad_request("a chat completion takes 'messages', not 'prompt'", "prompt")
        spec["messages"] = _messages(obj.get("messages"))
    else:
        if "messages" in obj:
            raise bad_request("a completion takes 'prompt', not 'messages'", "messages")
        spec["prompt"] = _prompt(obj.get("prompt"))
        echo = _echo(obj, spec["prompt"])
    _sampling(obj, spec)
    stream, include_usage = _streaming(obj)
    for name in EXTRA_FIELDS:
        if obj.get(name) is not None:
            spec[name] = obj[name]
    _logprobs(obj, spec, kind)
    if "lane" not in spec and lane_header:
        spec["lane"] = lane_header
    spec["stream"] = stream
    return Call(kind, spec, stream, include_usage, echo=echo)


def parse_forward(
    obj: dict[str, Any], body: bytes, *, kind: str, path: str, lane_header: str | None
) -> Call:
    """A request for a runner that forwards it: only what admission needs is read (its
    length, ``n``, ``stream``, its text's size, the governor's own fields); every other field
    is the upstream's, passed on as it came, and so is the body when it has none of the
    governor's fields."""
    governor = {name: obj[name] for name in GOVERNOR_FIELDS if obj.get(name) is not None}
    if "lane" not in governor and lane_header:
        governor["lane"] = lane_header
    asked, length_field = None, "" if kind == EMBEDDING else "max_tokens"
    if kind != EMBEDDING:
        for name in ("max_completion_tokens", "max_tokens"):
            value = obj.get(name)
            if value is not None:
                if type(value) is not int:
                    raise bad_request(f"{name!r} must be an integer", name)
                asked, length_field = value, name
                break
    n = obj.get("n", 1)
    if n is None:
        n = 1
    if type(n) is not int:
        raise bad_request("'n' must be an integer", "n")
    stream, include_usage = _streaming(obj)
    upstream_fields = None
    if governor.keys() & obj.keys():
        upstream_fields = {k: v for k, v in obj.items() if k not in GOVERNOR_FIELDS}
    forward = Forward(
        path=path,
        body=body,
        fields=upstream_fields,
        chars=text_chars([obj.get(name) for name in TEXT_FIELDS]),
        stream=stream,
        asked=asked,
        length_field=length_field,
    )
    return Call(kind, {**governor, "n": n}, stream, include_usage, forward)


def parse_embeddings(obj: dict[str, Any], lane_header: str | None) -> Call:
    """An embeddings request, for a runner that embeds: its texts (a string or a list of them:
    token arrays are refused), the encoding of its vectors, the governor's own fields."""
    fields: dict[str, Any] = {}
    for name, value in obj.items():
        if value is None or name in ("model", "user"):
            continue
        if name == "input":
            if type(value) is list and value and type(value[0]) is not str:
                raise bad_request("'input' must be text: token arrays are not embedded", name)
            fields["input"] = value
        elif name in GOVERNOR_FIELDS:
            fields[name] = value
        elif name != "encoding_format":
            raise bad_request(f"the governor does not support {name!r} for embeddings", name)
    encoding = obj.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise bad_request("'encoding_format' must be float or base64", "encoding_format")
    if "input" not in fields:
        raise bad_request("'input' is missing", "input")
    if "lane" not in fields and lane_header:
        fields["lane"] = lane_header
    return Call(EMBEDDING, fields, False, False, base64=encoding == "base64")


def text_chars(values: list[Any]) -> int:
    """The characters of the strings in ``values`` (lists and objects walked; a token id in a
    list of them counts as four: one token)."""
    total, stack = 0, list(values)
    while stack:
        item = stack.pop()
        if type(item) is str:
            total += len(item)
        elif type(item) is int:
            total += 4
        elif type(item) is dict:
            stack.extend(item.values())
        elif type(item) is list:
            stack.extend(item)
    return total


def _check_supported(obj: dict[str, Any], kind: str) -> None:
    """Refuse a field the governor does not map, unless it is unset or at the only value it
    serves (``best_of`` 1, say)."""
    for name, value in obj.items():
        if value is None:
            continue
        if name in CHAT_ONLY and kind != CHAT:
            raise bad_request(f"{name!r} is for chat completions", name)
        if name in MAPPED or name in NO_EFFECT or (name == "echo" and kind == COMPLETION):
            continue
        allowed = DEFAULTS.get(name)
        if allowed is None:
            raise bad_request(f"the governor does not support {name!r}", name)
        if not any(type(value) is type(a) and value == a for a in allowed):
            hint = "; use 'tools'" if name in ("functions", "function_call") else ""
            raise bad_request(
                f"the governor supports {name!r} only as {' or '.join(map(_json, allowed))}{hint}",
                name,
            )


def _echo(obj: dict[str, Any], prompt: str) -> str:
    """A completion's ``echo``: the prompt to put before the text ("" without it)."""
    echo = obj.get("echo")
    if echo is None or echo is False:
        return ""
    if echo is not True:
        raise bad_request("'echo' must be true or false", "echo")
    if obj.get("logprobs") is not None:
        raise bad_request(
            "'echo' with 'logprobs' would need the prompt's log probabilities, which the "
            "governor does not compute: ask for one of them",
            "echo",
        )
    return prompt


def _logprobs(obj: dict[str, Any], spec: dict[str, Any], kind: str) -> None:
    """``logprobs`` into ``spec``: a chat's is true or false (its alternatives in
    ``top_logprobs``), a completion's the number of alternatives, 0 to 5."""
    value = obj.get("logprobs")
    if value is None:
        return
    if kind == CHAT:
        spec["logprobs"] = value  # (the spec checks it is a boolean)
        return
    if type(value) is not int or not 0 <= value <= 5:
        raise bad_request("a completion's 'logprobs' must be an integer from 0 to 5", "logprobs")
    spec["logprobs"], spec["top_logprobs"] = True, value


def _sampling(obj: dict[str, Any], spec: dict[str, Any]) -> None:
    """The length, sampling and stop fields, into ``spec``."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = obj.get(name)
        if value is not None:
            if type(value) is not int:
                raise bad_request(f"{name!r} must be an integer", name)
            spec["max_new_tokens"] = value
            break
    for name in ("temperature", "top_p"):  # (absent: the spec's, llama-server's defaults)
        if obj.get(name) is not None:
            spec[name] = obj[name]
    seed = obj.get("seed")
    if seed is not None:
        if type(seed) is not int or not 0 <= seed <= MAX_SEED:
            raise bad_request(f"'seed' must be an integer from 0 to {MAX_SEED}", "seed")
        spec["seed"] = seed
    if obj.get("stop") is not None:
        spec["stop"] = obj["stop"]


def _streaming(obj: dict[str, Any]) -> tuple[bool, bool]:
    """Whether to stream, and whether the stream ends with the usage."""
    stream = obj.get("stream")
    if stream is None:
        stream = False
    if type(stream) is not bool:
        raise bad_request("'stream' must be true or false", "stream")
    options = obj.get("stream_options")
    if options is None:
        return stream, False
    if type(options) is not dict or type(options.get("include_usage", False)) is not bool:
        raise bad_request(
            "'stream_options' must be an object such as {\"include_usage\": true}",
            "stream_options",
        )
    return stream, stream and options.get("include_usage", False)


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


def _prompt(prompt: Any) -> str:
    if type(prompt) is list and len(prompt) == 1:
        prompt = prompt[0]
    if type(prompt) is not str:
        raise bad_request("'prompt' must be a string (one prompt per request)", "prompt")
    return prompt


def _messages(messages: Any) -> list[dict[str, str]]:
    if type(messages) is not list or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    out = []
    for m in messages:
        if type(m) is not dict:
            raise bad_request("each message must be an object", "messages")
        role = m.get("role")
        if type(role) is not str or role not in ROLES:
            raise bad_request(
                "a message's role must be system, developer, user, assistant or tool", "messages"
            )
        content = m.get("content")
        calls = m.get("tool_calls") if role == "assistant" else None
        text = "" if content is None and calls else _content(content)
        if calls:  # (the calls it made, as the model would have written them)
            text += _json(calls)
        out.append({"role": ROLES[role], "content": text})
    return out


def _content(content: Any) -> str:
    """A message's text: a string, or a list of text parts (joined)."""
    if type(content) is str:
        return content
    if type(content) is list and all(
        type(p) is dict and p.get("type") == "text" and type(p.get("text")) is str for p in content
    ):
        return "".join(p["text"] for p in content)
    raise bad_request("a message's content must be a string or a list of text parts", "messages")


# Answers -------------------------------------------------------------------------------------


def usage(result: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI's usage: the counts, and the prompt tokens found in the cache where the runner
    said (``prompt_tokens_details.cached_tokens``, as OpenAI reports its prompt caching)."""
    prompt, completion = result.get("prompt_tokens"), result.get("completion_tokens")
    prompt = prompt if isinstance(prompt, int) else 0
    completion = completion if isinstance(completion, int) else 0
    answer: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if isinstance(cached := result.get("cached_tokens"), int):
        answer["prompt_tokens_details"] = {"cached_tokens": cached}
    return answer


def finish_reason(choice: Mapping[str, Any]) -> str:
    reason = choice.get("finish_reason")
    return reason if reason in ("length", "tool_calls") else "stop"


def choices(result: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """A result's choices: its ``choices`` (``n`` above 1, logprobs, tools), else the one its
    ``text`` and ``finish_reason`` make."""
    listed = result.get("choices")
    if isinstance(listed, list) and listed:
        return listed
    return [{"index": 0, "text": result.get("text"), "finish_reason": result.get("finish_reason")}]


def legacy_logprobs(entries: Sequence[Mapping[str, Any]], offset: int) -> dict[str, Any]:
    """Chat-shaped log probabilities in the completions API's shape, the text's first
    character at ``offset``."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


class Answers:
    """One job's answer, whole or as server-sent events, in OpenAI's objects (a stream keeps
    what it has said of each choice: its tool call's id, its text's length)."""

    __slots__ = ("_calls", "_sent", "call", "created", "id", "model")

    def __init__(self, call: Call, id: str, created: int, model: str) -> None:
        self.call = call
        self.id = id
        self.created = created
        self.model = model
        self._calls: dict[int, str] = {}  # a choice's streamed tool call: its id
        self._sent: dict[int, int] = {}  # a completion choice's characters streamed

    @property
    def n(self) -> int:
        n = self.call.fields.get("n", 1)
        return n if isinstance(n, int) else 1

    def whole(self, result: Mapping[str, Any]) -> bytes:
        if self.call.kind == EMBEDDING:
            return self._embeddings(result)
        rendered = [self._whole_choice(i, c) for i, c in enumerate(choices(result))]
        return orjson.dumps(
            {
                **self._head("chat.completion" if self.call.chat else "text_completion"),
                "choices": rendered,
                "usage": usage(result),
            }
        )

    def _embeddings(self, result: Mapping[str, Any]) -> bytes:
        vectors = result.get("embeddings")
        data = [
            {"object": "embedding", "index": i, "embedding": _vector(v, self.call.base64)}
            for i, v in enumerate(vectors if isinstance(vectors, list) else ())
        ]
        tokens = usage(result)["prompt_tokens"]
        return orjson.dumps(
            {
                "object": "list",
                "data": data,
                "model": self.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    def _whole_choice(self, index: int, choice: Mapping[str, Any]) -> dict[str, Any]:
        text = choice.get("text")
        text = text if isinstance(text, str) else ""
        entries = choice.get("logprobs")
        out: dict[str, Any] = {"index": choice.get("index", index)}
        if self.call.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if choice.get("tool_calls"):
                message.update(content=text or None, tool_calls=choice["tool_calls"])
            out["message"] = message
            out["logprobs"] = None if entries is None else {"content": entries, "refusal": None}
        else:
            echo = self.call.echo
            out["text"] = echo + text
            out["logprobs"] = None if entries is None else legacy_logprobs(entries, len(echo))
        out["finish_reason"] = finish_reason(choice)
        return out

    def first(self) -> bytes:
        """A stream's first events: a chat's role, a completion's echoed prompt, for each
        choice (a completion without ``echo`` has none)."""
        if self.call.chat:
            delta = {"role": "assistant", "content": ""}
            return b"".join(self._event(self._choice(i, delta, None)) for i in range(self.n))
        if not self.call.echo:
            return b""
        return b"".join(self._text(i, self.call.echo, None) for i in range(self.n))

    def delta(self, token: Token) -> bytes:
        index = token.index
        entries = list(token.logprobs) if token.logprobs else None
        if not self.call.chat:
            return self._text(index, token.text, entries)
        delta: dict[str, Any]
        if token.tool is not None:
            function: dict[str, Any] = {"arguments": token.text}
            call: dict[str, Any] = {"index": 0, "function": function}
            if index not in self._calls:
                self._calls[index] = f"call_{secrets.token_hex(12)}"
                call.update(id=self._calls[index], type="function")
                function["name"] = token.tool
            delta = {"tool_calls": [call]}
        else:
            delta = {"content": token.text}
        logprobs = None if entries is None else {"content": entries, "refusal": None}
        return self._event(self._choice(index, delta, None, logprobs))

    def _text(self, index: int, text: str, entries: list[dict[str, Any]] | None) -> bytes:
        """A completion's piece of text (its log probabilities' offsets from the choice's
        start)."""
        sent = self._sent.get(index, 0)
        self._sent[index] = sent + len(text)
        logprobs = None if entries is None else legacy_logprobs(entries, sent)
        return self._event(self._choice(index, text, None, logprobs))

    def last(self, result: Mapping[str, Any]) -> bytes:
        """Each choice's finish reason; then the usage (asked for with ``include_usage``);
        then ``[DONE]``."""
        events = b"".join(
            self._event(
                self._choice(c.get("index", i), {} if self.call.chat else "", finish_reason(c))
            )
            for i, c in enumerate(choices(result))
        )
        if self.call.include_usage:
            events += self._event({"choices": [], "usage": usage(result)})
        return events + b"data: [DONE]\n\n"

    def _choice(
        self,
        index: int,
        delta: dict[str, Any] | str,
        finish: str | None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        if self.call.chat:
            choice["delta"] = delta if isinstance(delta, dict) else {"content": delta}
        else:
            choice["text"] = delta
        return {"choices": [choice]}

    def _head(self, object_: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    def _event(self, fields: dict[str, Any]) -> bytes:
        obj = self._head("chat.completion.chunk" if self.call.chat else "text_completion")
        return b"data: " + orjson.dumps({**obj, **fields}) + b"\n\n"


def _vector(vector: list[float], base64: bool) -> list[float] | str:
    """An embedding as OpenAI sends it: a list of floats, or base64 of their float32s."""
    if not base64:
        return vector
    return binascii.b2a_base64(struct.pack(f"<{len(vector)}f", *vector), newline=False).decode()


def error_event(status: HTTPStatus, code: str, message: str) -> bytes:
    """A stream's end when the job fails after its first token (the status was sent already):
    an ``error`` event, which the SDKs raise as an ``APIError``."""
    return b"data: " + error_body(status, code, message) + b"\n\n"


def models(model: str, created: int) -> bytes:
    entry = {"id": model, "object": "model", "created": created, "owned_by": "governor"}
    return orjson.dumps({"object": "list", "data": [entry]})


# Refusals and failures -----------------------------------------------------------------------


def yield_status(error_code: str) -> HTTPStatus:
    """A yield: 503 when the server is unavailable (draining, breaker open, the fleet's store
    unreachable), else 429."""
    if error_code == ErrorCode.UNAVAILABLE:
        return HTTPStatus.SERVICE_UNAVAILABLE
    return HTTPStatus.TOO_MANY_REQUESTS


def retry_headers(retry_hint_ms: int) -> tuple[tuple[str, str], ...]:
    """The hint, as the SDKs read it: ``retry-after-ms`` first, else ``Retry-After`` in whole
    seconds (rounded up, so that a client reading only it never comes back early)."""
    return (
        ("retry-after-ms", str(retry_hint_ms)),
        ("retry-after", str(max(1, math.ceil(retry_hint_ms / 1000)))),
    )


def abort_status(need_code: str) -> HTTPStatus:
    """A job that ended without its answer: the runner or the upstream failed (502), ran out of
    time (504), or the governor is shutting down (503)."""
    if need_code in TIMEOUTS:
        return HTTPStatus.GATEWAY_TIMEOUT
    if need_code == NeedCode.SHUTDOWN:
        return HTTPStatus.SERVICE_UNAVAILABLE
    return HTTPStatus.BAD_GATEWAY


# A yield's bound and its hint's parts, as response headers (the receipts' names on the TCP
# door, with dashes).
BOUND_HEADER = "x-governor-bound"
SATURATED_HEADER = "x-governor-fleet-saturated"  # "1": no other replica would serve it sooner
PART_HEADERS = (
    "x-governor-hint-release-ms",
    "x-governor-hint-turns-ms",
    "x-governor-hint-ahead",
)


def refusal(decision: Yielded) -> ApiError:
    """A yield's answer: 429 or 503, the need code, the hint in both headers, what bound
    refused it and, when it waits on a slot, the hint's parts."""
    need_code, retry_hint_ms = decision.need_code, decision.retry_hint_ms
    if need_code == NeedCode.DRAINING:
        # (The answer closes its connection: behind a load balancer, the retry's new one
        # reaches a ready replica.)
        message = (
            "draining: this replica is draining and admits no new request again; "
            f"retry on another replica in {retry_hint_ms} ms"
        )
    elif need_code == NeedCode.BUFFERS_FULL:
        message = (
            "buffers_full: the server's payload buffers are full; send the request again in "
            f"{retry_hint_ms} ms"
        )
    else:
        message = f"{need_code}: no slot for this request now; retry in {retry_hint_ms} ms"
    headers = (*retry_headers(retry_hint_ms), (BOUND_HEADER, decision.what_bound))
    if decision.fleet_saturated:
        headers += ((SATURATED_HEADER, "1"),)
    parts = decision.parts
    if parts is not None:
        values = (parts.release_ms, parts.turns_ms, parts.ahead)
        headers += tuple((name, str(v)) for name, v in zip(PART_HEADERS, values, strict=True))
    return ApiError(yield_status(decision.error_code), need_code, message, headers=headers)


def not_found(path: str, forwards: bool) -> ApiError:
    paths = "/v1/completions, /v1/chat/completions, /v1/models or /health"
    if forwards:
        paths = "/v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models, /tokenize, /detokenize or /health"
    elif path == "/v1/embeddings":
        return ApiError(
            HTTPStatus.NOT_FOUND,
            "not_found",
            "this runner serves no embeddings: the llama runner makes them, the http runner "
            "passes them to its upstream",
        )
    return ApiError(HTTPStatus.NOT_FOUND, "not_found", f"no such path: try {paths}")


def not_allowed(allow: str) -> ApiError:
    return ApiError(
        HTTPStatus.METHOD_NOT_ALLOWED,
        "method_not_allowed",
        f"use {allow}",
        headers=(("allow", allow),),
    )


def max_wait_ms(value: str | None) -> int | None:
    """The wait a request asks for (:data:`MAX_WAIT_HEADER`), or None (the server's)."""
    if value is None:
        return None
    text = value.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 9):
        raise ApiError(
            HTTPStatus.BAD_REQUEST,
            NeedCode.SPEC_INVALID,
            f"{MAX_WAIT_HEADER} must be a whole number of milliseconds, 0 to 999999999",
            param=MAX_WAIT_HEADER,
        )
    return int(text)


# Places in line kept for retries --------------------------------------------------------------

Key = tuple[str, bytes]  # the tenant's name, the body's digest


@dataclass(slots=True, eq=False)
class Kept:
    key: Key
    attempt: Attempt
    until: float
    taken: bool = False


class KeptPlaces:
    """A refused request's place in line, kept for its retry.

    HTTP has no held payload: a client told 429 sends the same request again, perhaps on
    another connection. Its :class:`~governor.core.admission.Attempt` (its promise in the ledger's
    line, its count of refusals) is kept under its tenant and its body's digest until its hint
    and ``grace_s`` more have passed, so that the retry is re-timed to its place, as a TCP
    client's resent final chunk is, rather than joining the back of the line (where the slot
    held for its own promise would refuse it). Identical requests of one tenant are
    interchangeable: each retry takes the oldest place. At most ``limit`` are kept; past that
    a refusal keeps none (its client is still told when to come back). A place whose time is
    up is handed to ``forget`` (admission withdraws its promise).
    """

    def __init__(
        self,
        clock: Callable[[], float],
        forget: Callable[[Attempt], None],
        *,
        grace_s: float,
        limit: int,
    ) -> None:
        self.clock = clock
        self.forget = forget
        self.grace_s = grace_s
        self.limit = limit
        self.count = 0
        self._by_key: dict[Key, deque[Kept]] = {}
        self._expiry: list[tuple[float, int, Kept]] = []  # a heap; taken places stay until popped
        self._order = itertools.count()

    def keep(self, key: Key, attempt: Attempt, retry_hint_ms: int) -> bool:
        """Keep the place; False (nothing kept) at the limit."""
        now = self.clock()
        self.expire(now)
        if self.count >= self.limit:
            return False
        if len(self._expiry) > 2 * self.limit:  # (mostly places taken early: drop them)
            self._expiry = [e for e in self._expiry if not e[2].taken]
            heapq.heapify(self._expiry)
        kept = Kept(key, attempt, now + retry_hint_ms / 1000 + self.grace_s)
        self._by_key.setdefault(key, deque()).append(kept)
        heapq.heappush(self._expiry, (kept.until, next(self._order), kept))
        self.count += 1
        attempt.tenant.waiting += 1
        return True

    def take(self, key: Key) -> Attempt | None:
        """The attempt of the oldest place kept for ``key``, no longer kept."""
        self.expire(self.clock())
        line = self._by_key.get(key)
        if not line:
            return None
        kept = line.popleft()
        self._drop(kept)
        return kept.attempt

    def expire(self, now: float) -> None:
        """Forget the places whose time is up."""
        expiry = self._expiry
        while expiry and (expiry[0][2].taken or expiry[0][0] <= now):
            kept = heapq.heappop(expiry)[2]
            if not kept.taken:
                self._by_key[kept.key].remove(kept)
                self._drop(kept)
                self.forget(kept.attempt)

    def next_expiry(self) -> float | None:
        """When the soonest place kept is up (None: none is kept)."""
        while self._expiry and self._expiry[0][2].taken:
            heapq.heappop(self._expiry)
        return self._expiry[0][0] if self._expiry else None

    def _drop(self, kept: Kept) -> None:
        kept.taken = True
        self.count -= 1
        kept.attempt.tenant.waiting -= 1
        if not self._by_key[kept.key]:
            del self._by_key[kept.key]
