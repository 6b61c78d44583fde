"""OpenAI's features through the front door on the embedded runner, as the official SDK asks for
them: JSON mode and schemas, several choices, tool calls (whole and streamed), log
probabilities, echo, penalties. One server on the real model for the module; the runner's own
tests (``test_llama_features.py``) hold the counts the targets name."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # (no type information: only tests use it)
import openai
import orjson
import pytest

from loadtest.bench.sidecar import NAMED, WEATHER, Started

OSLO: Any = [{"role": "user", "content": "What is the weather in Oslo?"}]
PERSON: Any = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def sdk() -> Iterator[openai.OpenAI]:
    """``governor serve`` on the embedded model with its front door, a process of its own
    (stopped by its PID), and an SDK client of it."""
    started = Started()
    try:
        url = started.daemon("--runner", "llama", "--max-inflight", "2", "--n-ctx", "1024")
        with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
            yield client
    finally:
        started.stop()


pytestmark = [pytest.mark.slow, pytest.mark.real_model]


def test_json_mode_answers_json_objects(sdk: openai.OpenAI) -> None:
    for thing in ("banana", "cloud", "frog"):
        answer = sdk.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": f"What colour is a {thing}?"}],
            response_format={"type": "json_object"},
            max_tokens=64,
            temperature=0,
        )
        assert answer.choices[0].finish_reason == "stop"
        assert type(orjson.loads(answer.choices[0].message.content or "")) is dict


def test_a_json_schema_is_followed(sdk: openai.OpenAI) -> None:
    answer = sdk.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        max_tokens=96,
        temperature=0,
    )
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(orjson.loads(answer.choices[0].message.content or ""), PERSON)


def test_two_choices_differ_at_temperature_one(sdk: openai.OpenAI) -> None:
    answer = sdk.completions.create(
        model="m", prompt="Once upon a time", n=2, temperature=1.0, max_tokens=24, seed=3
    )
    texts = [c.text for c in answer.choices]
    assert [c.index for c in answer.choices] == [0, 1]
    assert texts[0] != texts[1]
    assert answer.usage is not None
    assert answer.usage.completion_tokens > 24  # (both choices' tokens)


def test_a_named_tool_is_called(sdk: openai.OpenAI) -> None:
    answer = sdk.chat.completions.create(
        model="m", messages=OSLO, tools=[WEATHER], tool_choice=NAMED, max_tokens=96, temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(orjson.loads(call.function.arguments), WEATHER["function"]["parameters"])  # type: ignore[union-attr]


def test_a_named_tool_call_streams_as_deltas(sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(
        model="m",
        messages=OSLO,
        tools=[WEATHER],
        tool_choice=NAMED,
        max_tokens=96,
        temperature=0,
        stream=True,
    )
    names, arguments, finishes = [], "", []
    for chunk in stream:
        for choice in chunk.choices:
            finishes.append(choice.finish_reason)
            for call in choice.delta.tool_calls or ():
                if call.function is not None:
                    names.append(call.function.name)
                    arguments += call.function.arguments or ""
    assert names[0] == "get_weather"
    assert type(orjson.loads(arguments)) is dict
    assert "tool_calls" in finishes


def test_logprobs_tokens_make_the_text(sdk: openai.OpenAI) -> None:
    answer = sdk.chat.completions.create(
        model="m", messages=OSLO, logprobs=True, top_logprobs=3, max_tokens=24, temperature=0
    )
    choice = answer.choices[0]
    assert choice.logprobs is not None
    assert choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert "".join(e.token for e in entries) == choice.message.content
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6
    legacy = sdk.completions.create(model="m", prompt="One, two,", logprobs=2, max_tokens=8)
    assert legacy.choices[0].logprobs is not None
    assert "".join(legacy.choices[0].logprobs.tokens or []) == legacy.choices[0].text


def test_echo_and_penalties(sdk: openai.OpenAI) -> None:
    plain = sdk.completions.create(
        model="m", prompt="The sea is", max_tokens=16, temperature=0, echo=True
    )
    assert plain.choices[0].text.startswith("The sea is")
    penalised = sdk.completions.create(
        model="m",
        prompt="The sea is",
        max_tokens=16,
        temperature=0,
        frequency_penalty=2.0,
        presence_penalty=2.0,
    )
    assert "The sea is" + penalised.choices[0].text != plain.choices[0].text


def test_a_repeated_system_prompt_is_reported_cached(sdk: openai.OpenAI) -> None:
    """OpenAI's ``usage.prompt_tokens_details.cached_tokens``: the second of two chats with the
    same long system prompt finds it in the cache (the first found none of it)."""
    system: Any = {"role": "system", "content": "You are a terse assistant for sailors. " * 20}
    cached = []
    for question in ("Name a knot.", "Name a sail."):
        answer = sdk.chat.completions.create(
            model="m",
            messages=[system, {"role": "user", "content": question}],
            max_tokens=4,
            temperature=0,
        )
        assert answer.usage is not None
        assert answer.usage.prompt_tokens_details is not None
        cached.append(
            (answer.usage.prompt_tokens_details.cached_tokens, answer.usage.prompt_tokens)
        )
    (first, _), (second, prompt) = cached
    assert first is not None
    assert second is not None
    assert first < 100 < second < prompt, cached


def test_embeddings_are_jobs_of_the_loaded_model(sdk: openai.OpenAI) -> None:
    """The SDK asks for base64 (and decodes it); a client that asks for floats gets floats:
    the same unit vectors, one a text, and the texts' tokens in the usage."""
    answer = sdk.embeddings.create(model="m", input=["a red apple", "a green pear"])
    vectors = [e.embedding for e in answer.data]
    assert [len(v) for v in vectors] == [576, 576]
    assert all(abs(sum(x * x for x in v) - 1.0) < 1e-3 for v in vectors)
    assert answer.usage.prompt_tokens > 0
    floats = (
        sdk.embeddings.create(model="m", input="a red apple", encoding_format="float")
        .data[0]
        .embedding
    )
    assert max(abs(a - b) for a, b in zip(floats, vectors[0], strict=True)) < 1e-4
    with pytest.raises(openai.BadRequestError, match="token arrays"):
        sdk.embeddings.create(model="m", input=[[1, 2, 3]])
