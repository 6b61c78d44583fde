"""The OpenAI HTTP API as the governor speaks it, with no IO: a request body to a job spec, a
job's result to an answer, a refusal to a status and its headers; and the places in line kept
for a refused request's retry.

:mod:`governor.listeners.http` serves it. The mapping (``docs/PROTOCOL.md`` has the table):

* ``prompt`` (one string) or ``messages`` (roles ``system``, ``developer`` as system, ``user``,
  ``assistant``; content a string or text parts) become the spec's ``prompt`` or ``messages``;
* ``max_completion_tokens`` (else ``max_tokens``) is ``max_new_tokens``; ``temperature``,
  ``top_p``, ``seed``, ``stop`` and ``stream`` keep their names, with OpenAI's defaults
  (temperature 1, top_p 1); ``stream_options.include_usage`` adds the usage chunk;
* the governor's own fields ride along as extra body fields: ``lane`` (or the
  ``x-governor-lane`` header), ``top_k``, ``min_p``, ``ignore_eos``, ``tool_risk``,
  ``ttft_slo_ms``, ``tpot_slo_ms``;
* fields that change nothing here (``model``, ``user``, ``metadata``, ``store``, ...) are
  accepted, and so are the others at their defaults (``n`` 1, ``logprobs`` false, no
  ``tools``, penalties 0, ...); any other value is refused (400, ``spec_invalid``, with the
  field as ``param``) rather than silently not honoured.

Every error is OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, its ``code``
the governor's need code.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import orjson

from protocol.codes import ErrorCode, NeedCode
from protocol.spec import MAX_SEED

from ..core.admission import Attempt

LANE_HEADER = "x-governor-lane"
# Passed on to the job spec as they are (the governor's own parameters).
EXTRA_FIELDS = (
    "lane",
    "top_k",
    "min_p",
    "ignore_eos",
    "tool_risk",
    "ttft_slo_ms",
    "tpot_slo_ms",
)
# Accepted whatever their value: they change nothing about the generation.
NO_EFFECT = frozenset(
    {"model", "user", "metadata", "store", "service_tier", "stream_options", "prompt_cache_key"}
)
# Accepted at these values (OpenAI's defaults, or what the governor does anyway); refused at
# any other, since the answer would silently not honour them.
DEFAULTS: Mapping[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False, None),
    "top_logprobs": (0, None),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "parallel_tool_calls": (True, False),
    "response_format": ({"type": "text"},),
    "suffix": ("",),
    "modalities": (["text"],),
}
MAPPED = frozenset(
    {"prompt", "messages", "max_tokens", "max_completion_tokens"}
    | {"temperature", "top_p", "seed", "stop", "stream", *EXTRA_FIELDS}
)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# A request's own wait budget at the door, in whole milliseconds (0: refuse it at once); the
# server's http_max_wait bounds it.
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
    """A request for a job: the job spec it maps to, and how the answer is to be shaped."""

    chat: bool
    fields: dict[str, Any]  # a governor job spec's (protocol.spec) fields, checked at the intake
    stream: bool
    include_usage: bool


def parse_call(body: bytes, *, chat: bool, lane_header: str | None) -> Call:
    """The job a ``/v1/completions`` (``chat`` False) or ``/v1/chat/completions`` body asks for;
    raises :class:`ApiError` (400). What the runner checks (ranges, the prompt's length) it
    checks when it prepares the spec."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    if type(obj) is not dict:
        raise bad_request("the body must be a JSON object")
    _check_supported(obj)
    spec: dict[str, Any] = {}
    if chat:
        if "prompt" in obj:
            raise bad_request("a chat completion takes 'messages', not 'prompt'", "prompt")
        spec["messages"] = _messages(obj.get("messages"))
    else:
        if "messages" in obj:
            raise bad_request("a completion takes 'prompt', not 'messages'", "messages")
        spec["prompt"] = _prompt(obj.get("prompt"))
    _sampling(obj, spec)
    stream, include_usage = _streaming(obj)
    for name in EXTRA_FIELDS:
        if obj.get(name) is not None:
            spec[name] = obj[name]
    if "lane" not in spec and lane_header:
        spec["lane"] = lane_header
    spec["stream"] = stream
    return Call(chat, spec, stream, include_usage)


def _check_supported(obj: dict[str, Any]) -> None:
    """Refuse a field the governor does not map, unless it is unset or at the only value it
    serves (``n`` 1, say)."""
    for name, value in obj.items():
        if name in MAPPED or name in NO_EFFECT or value is None:
            continue
        allowed = DEFAULTS.get(name)
        if allowed is None:
            raise bad_request(f"the governor does not support {name!r}", name)
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise bad_request(
                f"the governor supports {name!r} only as {' or '.join(map(_json, allowed))}", name
            )


def _sampling(obj: dict[str, Any], spec: dict[str, Any]) -> None:
    """The length, sampling and stop fields, into ``spec``."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = obj.get(name)
        if value is not None:
            if type(value) is not int:
                raise bad_request(f"{name!r} must be an integer", name)
            spec["max_new_tokens"] = value
            break
    spec["temperature"] = _number(obj, "temperature", 1.0)
    spec["top_p"] = _number(obj, "top_p", 1.0)
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


def _number(obj: dict[str, Any], name: str, default: float) -> Any:
    value = obj.get(name)
    return default if value is None else value  # (checked with the spec)


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
                "a message's role must be system, developer, user or assistant", "messages"
            )
        out.append({"role": ROLES[role], "content": _content(m.get("content"))})
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


def usage(result: Mapping[str, Any]) -> dict[str, int]:
    prompt, completion = result.get("prompt_tokens"), result.get("completion_tokens")
    prompt = prompt if isinstance(prompt, int) else 0
    completion = completion if isinstance(completion, int) else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def finish_reason(result: Mapping[str, Any]) -> str:
    return "length" if result.get("finish_reason") == "length" else "stop"


@dataclass(frozen=True, slots=True)
class Answers:
    """One job's answer, whole or as server-sent events, in OpenAI's objects."""

    call: Call
    id: str
    created: int
    model: str

    def whole(self, result: Mapping[str, Any]) -> bytes:
        text = result.get("text")
        text = text if isinstance(text, str) else ""
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": finish_reason(result),
        }
        if self.call.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return orjson.dumps(
            {
                **self._head("chat.completion" if self.call.chat else "text_completion"),
                "choices": [choice],
                "usage": usage(result),
            }
        )

    def first(self) -> bytes:
        """A chat stream's first event: the assistant's role (completions have none)."""
        return self._event(self._choice({"role": "assistant", "content": ""}, None))

    def delta(self, text: str) -> bytes:
        return self._event(self._choice(text, None))

    def last(self, result: Mapping[str, Any]) -> bytes:
        """The finish reason; then the usage (asked for with ``include_usage``); then
        ``[DONE]``."""
        events = self._event(self._choice({} if self.call.chat else "", finish_reason(result)))
        if self.call.include_usage:
            events += self._event({"choices": [], "usage": usage(result)})
        return events + b"data: [DONE]\n\n"

    def _choice(self, delta: dict[str, str] | str, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
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


def refusal(need_code: str, error_code: str, retry_hint_ms: int) -> ApiError:
    """A yield's answer: 429 or 503, the need code, the hint in both headers."""
    if need_code == NeedCode.DRAINING:
        # (The answer closes its connection: behind a load balancer, the retry's new one
        # reaches a ready replica.)
        message = (
            "draining: this replica is draining and admits no new request again; "
            f"retry on another replica in {retry_hint_ms} ms"
        )
    else:
        message = f"{need_code}: no slot for this request now; retry in {retry_hint_ms} ms"
    return ApiError(
        yield_status(error_code), need_code, message, headers=retry_headers(retry_hint_ms)
    )


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
    first_refusal: float
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

    def keep(self, key: Key, attempt: Attempt, first_refusal: float, retry_hint_ms: int) -> bool:
        """Keep the place; False (nothing kept) at the limit."""
        now = self.clock()
        self.expire(now)
        if self.count >= self.limit:
            return False
        if len(self._expiry) > 2 * self.limit:  # (mostly places taken early: drop them)
            self._expiry = [e for e in self._expiry if not e[2].taken]
            heapq.heapify(self._expiry)
        kept = Kept(key, attempt, first_refusal, now + retry_hint_ms / 1000 + self.grace_s)
        self._by_key.setdefault(key, deque()).append(kept)
        heapq.heappush(self._expiry, (kept.until, next(self._order), kept))
        self.count += 1
        attempt.tenant.waiting += 1
        return True

    def take(self, key: Key) -> Kept | None:
        """The oldest place kept for ``key``, no longer kept."""
        self.expire(self.clock())
        line = self._by_key.get(key)
        if not line:
            return None
        kept = line.popleft()
        self._drop(kept)
        return kept

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
