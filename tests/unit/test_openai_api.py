"""The OpenAI mapping, with no IO: request bodies to job specs, results to answers the official
SDK parses, refusals to statuses and hints, and the places in line kept for retries."""

from __future__ import annotations

import math
from http import HTTPStatus
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from governor.core.admission import Attempt, Yielded
from governor.core.hints import HintParts
from governor.core.ledger import DRAINING_HINT_MS
from governor.core.tenants import TenantConfig, Tenants
from governor.listeners import openai_api as api
from governor.runners import Token
from protocol.codes import ErrorCode, NeedCode
from protocol.spec import SpecInvalid, spec_from_object


def spec_of(body: dict[str, Any], *, chat: bool = True, lane: str | None = None) -> dict[str, Any]:
    call = api.parse_call(orjson.dumps(body), kind=kind_of(chat), lane_header=lane)
    return call.fields


def kind_of(chat: bool) -> str:
    return api.CHAT if chat else api.COMPLETION


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "any", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_openai_parameters_map_to_the_job_spec() -> None:
    spec = spec_of(
        chat(max_tokens=7, temperature=0.2, top_p=0.5, seed=3, stop=["\n"], stream=True, user="u")
    )
    assert spec == {
        "messages": [{"role": "user", "content": "hi"}],
        "max_new_tokens": 7,
        "temperature": 0.2,
        "top_p": 0.5,
        "seed": 3,
        "stop": ["\n"],
        "stream": True,
    }
    # max_completion_tokens (the newer name) wins over max_tokens; llama-server's sampling
    # defaults apply (the job spec's), not OpenAI's.
    spec = spec_of(chat(max_tokens=7, max_completion_tokens=9))
    assert spec["max_new_tokens"] == 9
    assert "temperature" not in spec
    assert "top_p" not in spec
    job = spec_from_object(spec, max_new_tokens_ceiling=64)
    assert (job.temperature, job.top_p, job.top_k, job.min_p) == (0.8, 0.95, 40, 0.05)
    assert "max_new_tokens" not in spec_of(chat())
    assert spec_of({"prompt": ["one"], "model": "m"}, chat=False)["prompt"] == "one"


def test_roles_content_parts_and_the_lane() -> None:
    body = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": "c", "name": "bot"},
        ]
    )
    assert spec_of(body)["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "c"},
    ]
    assert spec_of(chat(), lane="heavy")["lane"] == "heavy"
    assert spec_of(chat(lane="background"), lane="heavy")["lane"] == "background"  # body wins
    extra = spec_of(
        chat(top_k=5, min_p=0.1, ignore_eos=True, tool_risk=0.5, ttft_slo_ms=500, tpot_slo_ms=40)
    )
    assert (extra["top_k"], extra["min_p"], extra["ignore_eos"], extra["tool_risk"]) == (
        5,
        0.1,
        True,
        0.5,
    )
    assert (extra["ttft_slo_ms"], extra["tpot_slo_ms"]) == (500, 40)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(best_of=2), "best_of"),
        (chat(functions=[{"name": "f"}]), "functions"),
        (chat(echo=True), "echo"),
        (chat(surprise=1), "surprise"),
        (chat(messages=[{"role": "function", "content": "x"}]), "messages"),
        (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages"),
        (chat(messages=[]), "messages"),
        (chat(max_tokens="7"), "max_tokens"),
        (chat(seed=-1), "seed"),
        (chat(stream="yes"), "stream"),
        (chat(stream=True, stream_options=[]), "stream_options"),
        ({"prompt": "hi"}, "prompt"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(body: dict[str, Any], param: str) -> None:
    with pytest.raises(api.ApiError) as caught:
        spec_of(body)
    error = caught.value
    assert (error.status, error.param, error.code) == (
        HTTPStatus.BAD_REQUEST,
        param,
        "spec_invalid",
    )
    assert orjson.loads(error.body())["error"]["type"] == "invalid_request_error"


def test_defaults_that_change_nothing_are_accepted() -> None:
    body = chat(n=1, logprobs=False, presence_penalty=0, tools=[], tool_choice="none", echo=False)
    assert spec_of(body)["messages"] == [{"role": "user", "content": "hi"}]
    assert "stream_options" not in spec_of(chat(stream_options={"include_usage": True}))


def test_include_usage_only_with_a_stream() -> None:
    def call(**fields: Any) -> api.Call:
        return api.parse_call(orjson.dumps(chat(**fields)), kind=api.CHAT, lane_header=None)

    assert call(stream=True, stream_options={"include_usage": True}).include_usage
    assert not call(stream=False, stream_options={"include_usage": True}).include_usage
    assert not call(stream=True).include_usage


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)  # (what a JSON parser gives: orjson reads larger as floats)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
FIELDS = st.sampled_from(
    [*sorted(api.MAPPED | api.NO_EFFECT | set(api.DEFAULTS)), "other", "messages", "prompt"]
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(FIELDS, JSON_VALUES, max_size=6), st.booleans(), st.binary(max_size=20))
def test_any_body_is_a_job_spec_or_a_400(body: dict[str, Any], is_chat: bool, noise: bytes) -> None:
    """Whatever a client sends: a spec the job codec then accepts or refuses with its own code,
    or a 400 naming a need code; never another exception."""
    for raw in (orjson.dumps(body), noise):
        refused: api.ApiError | None = None
        try:
            call = api.parse_call(raw, kind=kind_of(is_chat), lane_header=None)
        except api.ApiError as exc:
            refused = exc
        if refused is not None:
            assert (refused.status, refused.code) == (HTTPStatus.BAD_REQUEST, "spec_invalid")
            continue
        try:
            spec = call.spec(64)
        except SpecInvalid:
            continue
        assert spec.stream == call.stream
        assert (spec.messages is not None) == is_chat


@given(st.integers(1, 10**7))
def test_retry_after_never_says_sooner_than_the_hint(hint_ms: int) -> None:
    headers = dict(api.retry_headers(hint_ms))
    assert int(headers["retry-after-ms"]) == hint_ms
    seconds = int(headers["retry-after"])
    assert seconds * 1000 >= hint_ms
    assert seconds == max(1, math.ceil(hint_ms / 1000))


def test_statuses() -> None:
    assert api.yield_status(ErrorCode.BUSY) == HTTPStatus.TOO_MANY_REQUESTS
    assert api.yield_status(ErrorCode.UNAVAILABLE) == HTTPStatus.SERVICE_UNAVAILABLE
    assert api.abort_status(NeedCode.BACKEND_ERROR) == HTTPStatus.BAD_GATEWAY
    assert api.abort_status(NeedCode.RUNNER_CRASHED) == HTTPStatus.BAD_GATEWAY
    assert api.abort_status(NeedCode.UPSTREAM_TIMEOUT) == HTTPStatus.GATEWAY_TIMEOUT
    assert api.abort_status(NeedCode.SHUTDOWN) == HTTPStatus.SERVICE_UNAVAILABLE


RESULT = {
    "text": "Hello there",
    "prompt_tokens": 9,
    "completion_tokens": 3,
    "finish_reason": "length",
}


def answers(*, chat: bool, stream: bool, include_usage: bool = False) -> api.Answers:
    return api.Answers(
        api.Call(kind_of(chat), {}, stream, include_usage), "id-1", 1700000000, "smol"
    )


def events(data: bytes) -> list[Any]:
    parts = [p.removeprefix(b"data: ") for p in data.split(b"\n\n") if p]
    assert parts[-1] == b"[DONE]"
    return [orjson.loads(p) for p in parts[:-1]]


def test_whole_answers_are_what_the_sdk_parses() -> None:
    completion = ChatCompletion.model_validate_json(answers(chat=True, stream=False).whole(RESULT))
    assert completion.choices[0].message.content == "Hello there"
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.total_tokens) == (9, 12)
    text = Completion.model_validate_json(answers(chat=False, stream=False).whole(RESULT))
    assert (text.choices[0].text, text.model, text.object) == (
        "Hello there",
        "smol",
        "text_completion",
    )
    assert text.usage is not None


def test_a_stream_is_what_the_sdk_parses() -> None:
    a = answers(chat=True, stream=True, include_usage=True)
    chunks = [
        ChatCompletionChunk.model_validate(e)
        for e in events(a.first() + a.delta(Token("Hel")) + a.delta(Token("lo")) + a.last(RESULT))
    ]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 3
    plain = answers(chat=False, stream=True)
    texts = events(
        plain.delta(Token("Hi")) + plain.last(RESULT)
    )  # (the SDK reads them unvalidated)
    assert [t["choices"][0]["text"] for t in texts] == ["Hi", ""]
    assert [t["choices"][0]["finish_reason"] for t in texts] == [None, "length"]
    assert {t["object"] for t in texts} == {"text_completion"}
    assert all("usage" not in t for t in texts)  # no usage chunk unless asked for


# Places kept for retries: a model of keep / take / the clock -----------------------------


class Places(RuleBasedStateMachine):
    """Against a plain model: take() gives the oldest live place of its key; places expire at
    their hint plus the grace and are forgotten exactly once; at most ``limit`` are kept; each
    tenant's ``waiting`` counts its places."""

    LIMIT = 4

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.forgotten: list[Attempt] = []
        self.places = api.KeptPlaces(
            lambda: self.now, self.forgotten.append, grace_s=1.0, limit=self.LIMIT
        )
        tenants = Tenants(
            [TenantConfig(name=n, key_sha256=f"{i:064x}") for i, n in enumerate("ab")],
            clock=lambda: self.now,
        )
        self.tenants = {t.name: t for t in tenants.all()}
        self.model: list[tuple[api.Key, Attempt, float]] = []  # in order of keeping
        self.expected_forgotten: list[Attempt] = []

    def _expire_model(self) -> None:
        live = [m for m in self.model if m[2] > self.now]
        gone = [m[1] for m in self.model if m[2] <= self.now]
        self.model = live
        self.expected_forgotten.extend(gone)

    @rule(
        tenant=st.sampled_from("ab"), body=st.sampled_from([b"x", b"y"]), hint=st.integers(1, 3000)
    )
    def keep(self, tenant: str, body: bytes, hint: int) -> None:
        self._expire_model()
        attempt = Attempt(self.tenants[tenant], None)
        kept = self.places.keep((tenant, body), attempt, hint)
        assert kept == (len(self.model) < self.LIMIT)
        if kept:
            self.model.append(((tenant, body), attempt, self.now + hint / 1000 + 1.0))

    @rule(tenant=st.sampled_from("ab"), body=st.sampled_from([b"x", b"y"]))
    def take(self, tenant: str, body: bytes) -> None:
        self._expire_model()
        got = self.places.take((tenant, body))
        match = next((m for m in self.model if m[0] == (tenant, body)), None)
        if match is None:
            assert got is None
        else:
            assert got is match[1]
            self.model.remove(match)

    @rule(seconds=st.floats(0.0, 2.5))
    def tick(self, seconds: float) -> None:
        self.now += seconds
        self._expire_model()
        self.places.expire(self.now)

    @invariant()
    def agrees(self) -> None:
        assert self.places.count == len(self.model)
        for name, tenant in self.tenants.items():
            assert tenant.waiting == sum(1 for m in self.model if m[0][0] == name)
        # Forgotten when their time is up, each once; never one that was taken.
        assert sorted(map(id, self.forgotten)) == sorted(map(id, self.expected_forgotten))


Places.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_places_kept_for_retries() -> None:
    Places.TestCase().runTest()


@pytest.mark.parametrize(
    ("value", "asked"), [(None, None), ("0", 0), (" 250 ", 250), ("999999999", 999_999_999)]
)
def test_a_request_asks_for_its_wait_in_whole_milliseconds(
    value: str | None, asked: int | None
) -> None:
    assert api.max_wait_ms(value) == asked


@pytest.mark.parametrize("value", ["", "-1", "1.5", "1e3", "abc", "1000000000", "٣"])
def test_a_wait_asked_for_that_is_not_a_whole_number_of_milliseconds_is_400(value: str) -> None:
    with pytest.raises(api.ApiError) as refused:
        api.max_wait_ms(value)
    assert refused.value.status == HTTPStatus.BAD_REQUEST
    assert (refused.value.code, refused.value.param) == ("spec_invalid", api.MAX_WAIT_HEADER)


def test_a_draining_replica_says_retry_soon_elsewhere() -> None:
    draining = api.refusal(Yielded(NeedCode.DRAINING, DRAINING_HINT_MS))
    assert draining.status == HTTPStatus.SERVICE_UNAVAILABLE
    assert dict(draining.headers) == {
        "retry-after-ms": "1000",
        "retry-after": "1",
        "x-governor-bound": "drain",
    }
    # It says why: this replica drains, the retry is for another (not "no slot free").
    assert "this replica is draining" in draining.message
    assert "another replica" in draining.message
    assert "slot" not in draining.message
    busy = api.refusal(Yielded(NeedCode.SERVER_BUSY, 2_500, None, HintParts(900, 1_600, 3)))
    assert (busy.status, busy.code) == (HTTPStatus.TOO_MANY_REQUESTS, "server_busy")
    assert dict(busy.headers) == {
        "retry-after-ms": "2500",
        "retry-after": "3",
        "x-governor-bound": "max_inflight",
        "x-governor-hint-release-ms": "900",
        "x-governor-hint-turns-ms": "1600",
        "x-governor-hint-ahead": "3",
    }


# OpenAI's features on a runner that generates (the embedded one) ---------------------------


def test_the_features_map_to_the_job_spec() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    fields = spec_of(
        chat(
            n=2,
            logprobs=True,
            top_logprobs=3,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            logit_bias={"7": -100},
            response_format={"type": "json_object"},
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
        )
    )
    spec = spec_from_object(fields, max_new_tokens_ceiling=64)
    assert (spec.n, spec.logprobs, spec.presence_penalty, spec.frequency_penalty) == (
        2,
        3,
        0.5,
        -0.5,
    )
    assert (spec.logit_bias, spec.json_schema, spec.tool_choice) == (
        ((7, -100.0),),
        '{"type":"object"}',
        "required",
    )
    assert orjson.loads(spec.tools or "") == tools
    completion = spec_from_object(
        spec_of({"prompt": "x", "logprobs": 2}, chat=False), max_new_tokens_ceiling=64
    )
    assert completion.logprobs == 2


def test_a_conversation_with_tool_calls_maps_to_messages() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    fields = spec_of(
        chat(
            messages=[
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ]
        )
    )
    assert fields["messages"] == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": orjson.dumps(calls).decode()},
        {"role": "tool", "content": "42"},
    ]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": "x", "echo": True, "logprobs": 1}, "'echo' with 'logprobs'"),
        ({"prompt": "x", "logprobs": 9}, "from 0 to 5"),
        ({"prompt": "x", "echo": "yes"}, "'echo' must be"),
        ({"prompt": "x", "tools": [{"type": "function"}]}, "'tools' is for chat completions"),
    ],
)
def test_completion_options_that_cannot_be_honoured(body: dict[str, Any], message: str) -> None:
    with pytest.raises(api.ApiError, match=message):
        spec_of(body, chat=False)


LOGPROB = {
    "token": "Hi",
    "logprob": -0.5,
    "bytes": [72, 105],
    "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}],
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
CHOICES: dict[str, Any] = {
    **RESULT,
    "choices": [
        {"index": 0, "text": "Hi", "finish_reason": "stop", "logprobs": [LOGPROB]},
        {
            "index": 1,
            "text": "",
            "finish_reason": "tool_calls",
            "logprobs": [],
            "tool_calls": [CALL],
        },
    ],
}


def features(chat: bool, stream: bool, **fields: Any) -> api.Answers:
    call = api.Call(kind_of(chat), {"n": 2, **fields}, stream, False, echo=fields.pop("echo", ""))
    return api.Answers(call, "id-1", 1700000000, "smol")


def test_choices_logprobs_and_tool_calls_are_what_the_sdk_parses() -> None:
    completion = ChatCompletion.model_validate_json(features(True, False).whole(CHOICES))
    first, second = completion.choices
    assert first.message.content == "Hi"
    assert first.logprobs is not None
    assert first.logprobs.content is not None
    assert [t.token for t in first.logprobs.content] == ["Hi"]
    assert (second.finish_reason, second.message.content) == ("tool_calls", None)
    assert second.message.tool_calls is not None
    assert second.message.tool_calls[0].function.name == "f"  # type: ignore[union-attr]
    text = Completion.model_validate_json(
        features(False, False).whole(RESULT | {"choices": CHOICES["choices"][:1]})
    )
    assert text.choices[0].logprobs is not None
    assert text.choices[0].logprobs.tokens == ["Hi"]
    assert text.choices[0].logprobs.text_offset == [0]


def test_a_stream_of_choices_tool_calls_and_logprobs() -> None:
    a = features(True, True)
    data = (
        a.first()
        + a.delta(Token("Hi", logprobs=(LOGPROB,)))
        + a.delta(Token('{"a"', index=1, tool="f"))
        + a.delta(Token(":1}", index=1, tool="f"))
        + a.last(CHOICES)
    )
    chunks = [ChatCompletionChunk.model_validate(e) for e in events(data)]
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    calls = [
        tc for c in chunks for tc in c.choices[0].delta.tool_calls or () if c.choices[0].index == 1
    ]
    assert calls[0].id is not None
    assert calls[0].function is not None
    assert calls[0].function.name == "f"
    assert calls[1].id is None  # (only the first piece names the call)
    assert "".join(tc.function.arguments or "" for tc in calls if tc.function) == '{"a":1}'
    finishes = {
        c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason
    }
    assert finishes == {0: "stop", 1: "tool_calls"}


def test_echo_puts_the_prompt_first() -> None:
    whole = orjson.loads(features(False, False, echo="Once ").whole(RESULT))
    assert whole["choices"][0]["text"] == "Once Hello there"
    a = features(False, True, echo="Once ")
    texts = [
        e["choices"][0]["text"] for e in events(a.first() + a.delta(Token("up")) + a.last(RESULT))
    ]
    assert texts[:3] == ["Once ", "Once ", "up"]
    legacy = a.delta(Token("on", logprobs=(dict(LOGPROB, token="on"),)))
    logprobs = orjson.loads(legacy.removeprefix(b"data: "))["choices"][0]["logprobs"]
    assert logprobs["text_offset"] == [len("Once up")]  # (from the echoed prompt's start)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [[1, 2]]}, "input"),
        ({"model": "m"}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 64}, "dimensions"),
    ],
)
def test_an_embeddings_request_it_cannot_honour_is_refused(
    body: dict[str, Any], param: str
) -> None:
    with pytest.raises(api.ApiError) as caught:
        api.parse_call(orjson.dumps(body), kind=api.EMBEDDING, lane_header=None)
    assert caught.value.param == param


def test_an_embeddings_request_is_a_job_of_texts() -> None:
    call = api.parse_call(
        orjson.dumps({"input": ["a", "b"], "model": "m", "encoding_format": "base64"}),
        kind=api.EMBEDDING,
        lane_header="background",
    )
    spec = call.spec(64)
    assert (spec.input, spec.output_tokens, spec.lane, call.base64) == (
        ("a", "b"),
        0,
        "background",
        True,
    )
    with pytest.raises(SpecInvalid):
        spec_from_object({"input": [""]}, max_new_tokens_ceiling=64)
    with pytest.raises(SpecInvalid):
        spec_from_object({"input": "a", "prompt": "b"}, max_new_tokens_ceiling=64)
    answer = orjson.loads(
        api.Answers(call, "id", 1, "smol").whole({"embeddings": [[1.0, 0.5]], "prompt_tokens": 2})
    )
    assert answer["data"][0]["embedding"] == "AACAPwAAAD8="  # (float32 1.0, 0.5)
    assert answer["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
