"""The llama runner's OpenAI features on the real embedded model (SmolLM2-135M) in a real worker
process: JSON mode and JSON schemas held by a grammar, several choices of one prompt, tool calls
for each tool choice, log probabilities that add up to the text, penalties and logit biases,
embeddings, and what is refused before admission.

One runner serves the whole module (its worker loads once), on a uvloop loop of its own (the
daemon's loop): each job is prepared and run as an admitted one is, several at once where a test
says so. A 135M model rambles: the prompts here are ones it answers briefly, and each test says
what it relies on of the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import json
import os
import random
from collections.abc import Iterator
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # (no type information: only tests use it)
import numpy as np
import orjson
import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from governor.runners import Finished, Token
from governor.runners.llama.runner import LlamaRunner, LlamaSettings, embedded_model_path
from governor.runners.llama.structured import calls_grammar, parse_tool_call, schema_grammar
from protocol.spec import SpecInvalid, spec_from_object

pytestmark = pytest.mark.real_model

# On a machine with a GPU and llama-cpp-python built for it, GOVERNOR_TEST_N_GPU_LAYERS=-1
# runs these tests with the model on the GPU (CI has none: 0, the CPU).
N_GPU_LAYERS = int(os.environ.get("GOVERNOR_TEST_N_GPU_LAYERS", "0"))
SLOTS = 4

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 24}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]

# Schemas whose every value is bounded (strings, lists, integers of at most 16 digits), so that
# a grammar-held output must end within MAX_SCHEMA_TOKENS: what a test can rely on of any model.
SCHEMAS: list[tuple[dict[str, Any], list[str]]] = [
    (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 16},
                "age": {"type": "integer"},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        ["Invent a person.", "Who wrote Hamlet?", "Describe your best friend.", "Name a pilot."],
    ),
    (
        {
            "type": "object",
            "properties": {"colour": {"enum": ["red", "green", "blue", "yellow"]}},
            "required": ["colour"],
        },
        ["What colour is grass?", "What colour is the sky?", "Pick a colour.", "Is a lemon red?"],
    ),
    (
        {
            "type": "object",
            "properties": {"answer": {"type": "integer"}, "sure": {"type": "boolean"}},
            "required": ["answer", "sure"],
        },
        ["What is 2 + 2?", "How many legs has a cat?", "What is 10 times 3?", "Count to three."],
    ),
    (
        {
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 10},
                    "minItems": 1,
                    "maxItems": 3,
                }
            },
            "required": ["tags"],
        },
        ["Tag a photo of a beach.", "Tag a cooking blog.", "Tag a song.", "Tag this: cats."],
    ),
    (
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "country": {"type": "string", "maxLength": 20},
                "big": {"type": "boolean"},
            },
            "required": ["city", "country", "big"],
        },
        ["Where is the Eiffel Tower?", "Name a city.", "Where do you live?", "Capital of Italy?"],
    ),
]
MAX_SCHEMA_TOKENS = 160


@dataclasses.dataclass
class Outcome:
    tokens: list[Token]
    result: dict[str, Any]

    def streamed(self, index: int = 0) -> str:
        return "".join(t.text for t in self.tokens if t.index == index)

    @property
    def choices(self) -> list[dict[str, Any]]:
        return list(self.result["choices"])


class Model:
    """The module's runner, and a loop to run jobs on it from synchronous tests."""

    def __init__(self, loop: asyncio.AbstractEventLoop, runner: LlamaRunner) -> None:
        self.loop = loop
        self.runner = runner
        self._ids = 0

    def spec(self, fields: dict[str, Any]) -> Any:
        return spec_from_object(fields, max_new_tokens_ceiling=1024)

    def prepare(self, fields: dict[str, Any]) -> Any:
        self._ids += 1
        return self.runner.prepare(f"J_{self._ids}", self.spec(fields))

    async def _run(self, fields: dict[str, Any]) -> Outcome:
        tokens: list[Token] = []
        async with contextlib.aclosing(self.runner.run(self.prepare(fields))) as events:
            async for event in events:
                if isinstance(event, Token):
                    tokens.append(event)
                elif isinstance(event, Finished):
                    return Outcome(tokens, dict(event.result))
        raise AssertionError("the job ended with no Finished")

    def run(self, **fields: Any) -> Outcome:
        return self.loop.run_until_complete(self._run(fields))

    def runs(self, many: list[dict[str, Any]]) -> list[Outcome]:
        """Run jobs ``SLOTS`` at a time (as admission would let them in), batched together."""

        async def all_of() -> list[Outcome]:
            gate = asyncio.Semaphore(SLOTS)

            async def one(fields: dict[str, Any]) -> Outcome:
                async with gate:
                    return await self._run(fields)

            return list(await asyncio.gather(*(one(f) for f in many)))

        return self.loop.run_until_complete(all_of())


@pytest.fixture(scope="module")
def model() -> Iterator[Model]:
    loop = uvloop.new_event_loop()
    settings_ = LlamaSettings(
        model=embedded_model_path(), n_ctx=512, slots=SLOTS, threads=1, n_gpu_layers=N_GPU_LAYERS
    )
    runner = LlamaRunner(settings_)
    loop.run_until_complete(runner.start())
    try:
        yield Model(loop, runner)
    finally:
        loop.run_until_complete(runner.close())
        loop.close()


def is_json_object(text: str) -> bool:
    try:
        return type(orjson.loads(text)) is dict
    except orjson.JSONDecodeError:
        return False


# Structured output ---------------------------------------------------------------------------

THINGS = ["cat", "dog", "car", "book", "tree", "lemon", "river", "house", "chair", "phone"]
THINGS += ["planet", "flower", "bird", "shoe", "lamp", "cake", "boat", "train", "horse", "apple"]
THINGS += ["guitar", "mountain", "computer", "cloud", "pencil"]
SUMS = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": '{"answer": 4}'},
    {"role": "user", "content": "What is 3 + 5?"},
    {"role": "assistant", "content": '{"answer": 8}'},
]


def test_fifty_json_mode_requests_all_answer_json_objects(model: Model) -> None:
    """Half the questions this model answers in prose, the other half after two answers in JSON
    (so it says more than ``{}``): in JSON mode all fifty end (``stop``) as JSON objects."""
    prose = [[{"role": "user", "content": f"What colour is a {thing}?"}] for thing in THINGS]
    primed = [
        [*SUMS, {"role": "user", "content": f"What is {i} + {i % 7 + 3}?"}] for i in range(25)
    ]
    common = {"max_new_tokens": 48, "temperature": 0.0}
    without = model.runs([{"messages": m, **common} for m in prose[:2]])
    assert not any(is_json_object(o.result["text"]) for o in without)  # (the grammar's work)
    json_mode = {"type": "json_object"}
    outcomes = model.runs(
        [{"messages": m, "response_format": json_mode, **common} for m in prose + primed]
    )
    texts = [o.result["text"] for o in outcomes]
    assert all(is_json_object(text) for text in texts), texts
    assert [o.result["finish_reason"] for o in outcomes] == ["stop"] * 50
    assert all(o.streamed() == o.result["text"] for o in outcomes)
    assert len({text for text in texts[25:]}) > 5  # (not one answer fifty times)


# (the same answers, written as llama-server's JSON mode may write them: indented)
INDENTED_SUMS = [
    {**m, "content": json.dumps(json.loads(m["content"]), indent=4)}
    if m["role"] == "assistant"
    else m
    for m in SUMS
]


def test_json_mode_answers_with_the_whitespace_llama_server_allows(model: Model) -> None:
    """JSON mode's grammar is llama.cpp's: whitespace (newlines, an indent) after an opening
    bracket and before a closing one. After two answers written so, the model indents its own,
    and each is a closed object (held to one space at most after each value, as before, it
    could not write the newline it wants)."""
    outcomes = model.runs(
        [
            {
                "messages": [*INDENTED_SUMS, {"role": "user", "content": f"What is {i} + 2?"}],
                "response_format": {"type": "json_object"},
                "max_new_tokens": 48,
                "temperature": 0.0,
            }
            for i in range(8)
        ]
    )
    texts = [o.result["text"] for o in outcomes]
    assert [o.result["finish_reason"] for o in outcomes] == ["stop"] * 8, texts
    assert all(is_json_object(text) for text in texts), texts
    assert all(text.startswith('{\n    "') for text in texts), texts


def test_twenty_json_schema_requests_all_answer_valid_json(model: Model) -> None:
    requests: list[dict[str, Any]] = [
        {
            "messages": [{"role": "user", "content": prompt}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
            "max_new_tokens": MAX_SCHEMA_TOKENS,
            "temperature": 0.0,
        }
        for schema, prompts in SCHEMAS
        for prompt in prompts
    ]
    outcomes = model.runs(requests)
    for request, outcome in zip(requests, outcomes, strict=True):
        schema = request["response_format"]["json_schema"]["schema"]
        assert outcome.result["finish_reason"] == "stop"
        jsonschema.validate(json.loads(outcome.result["text"]), schema)


# Several choices -----------------------------------------------------------------------------


def test_two_choices_at_temperature_one_differ_and_stream_by_index(model: Model) -> None:
    out = model.run(prompt="Once upon a time", n=2, temperature=1.0, seed=11, max_new_tokens=24)
    first, second = out.choices
    assert (first["index"], second["index"]) == (0, 1)
    assert first["text"] != second["text"]
    assert out.result["text"] == first["text"]
    assert out.result["finish_reason"] == first["finish_reason"]
    assert [out.streamed(0), out.streamed(1)] == [first["text"], second["text"]]
    # Both generated, counted together; the prompt counted once.
    assert 24 < out.result["completion_tokens"] <= 48
    assert out.result["prompt_tokens"] == len(model.prepare({"prompt": "Once upon a time"}).tokens)
    generated = [t.generated for t in out.tokens if t.generated is not None]
    assert generated == sorted(generated)
    assert generated[-1] == out.result["completion_tokens"]


def test_many_choices_beside_other_jobs_all_finish(model: Model) -> None:
    """Sixteen choices of one job, beside three other jobs: every choice has its own text, and
    the greedy jobs beside them say what they say alone."""
    alone = model.run(prompt="The capital of France is", temperature=0.0, max_new_tokens=4)
    outcomes = model.runs(
        [
            {"prompt": "My favourite food is", "n": 16, "temperature": 1.0, "max_new_tokens": 8},
            *[{"prompt": "The capital of France is", "temperature": 0.0, "max_new_tokens": 4}] * 3,
        ]
    )
    many = outcomes[0].choices
    assert [c["index"] for c in many] == list(range(16))
    assert all(c["text"] for c in many)
    assert len({c["text"] for c in many}) > 8
    assert [o.result["text"] for o in outcomes[1:]] == [alone.result["text"]] * 3


def test_more_choices_than_the_slots_share_ids_for_wait_for_them_and_all_finish(
    model: Model,
) -> None:
    """Two jobs of 16 greedy choices at once: 30 forks, more than the 15 sequence ids the slots
    share for further choices. Those that find none wait for one, and every choice of both
    says what one greedy run says alone."""
    alone = model.run(prompt="The capital of France is", temperature=0.0, max_new_tokens=4)
    spec = {"prompt": "The capital of France is", "n": 16, "temperature": 0.0, "max_new_tokens": 4}
    for outcome in model.runs([spec, spec]):
        assert [c["index"] for c in outcome.choices] == list(range(16))
        assert {c["text"] for c in outcome.choices} == {alone.result["text"]}


# Tools ---------------------------------------------------------------------------------------


def test_a_named_function_is_called_with_arguments_for_its_parameters(model: Model) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = model.run(
        messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice, temperature=0.0, max_new_tokens=64
    )
    (only,) = out.choices
    assert out.result["finish_reason"] == only["finish_reason"] == "tool_calls"
    assert out.result["text"] == only["text"] == ""
    (call,) = only["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert call["type"] == "function"
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS["get_weather"])
    # Streamed as the function's arguments, piece by piece.
    assert {t.tool for t in out.tokens} == {"get_weather"}
    assert out.streamed() == call["function"]["arguments"]


def test_required_calls_one_of_the_tools_and_sends_it_whole(model: Model) -> None:
    out = model.run(
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice="required",
        temperature=0.0,
        max_new_tokens=96,
    )
    (only,) = out.choices
    assert only["finish_reason"] == "tool_calls"
    (call,) = only["tool_calls"]
    name, arguments = call["function"]["name"], call["function"]["arguments"]
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])
    assert [(t.text, t.tool) for t in out.tokens] == [(arguments, name)]


def test_auto_puts_the_tools_in_the_prompt_and_reads_the_answer(model: Model) -> None:
    """On this model "auto" gets an answer in prose (it calls nothing): it streams as text. With
    "none" the tools are left out of the prompt altogether."""
    plain = model.prepare({"messages": ASK_WEATHER}).tokens
    none = model.prepare({"messages": ASK_WEATHER, "tools": TOOLS, "tool_choice": "none"}).tokens
    assert none == plain
    auto = model.run(messages=ASK_WEATHER, tools=TOOLS, temperature=0.0, max_new_tokens=32)
    assert auto.result["prompt_tokens"] > len(plain) + 50
    (only,) = auto.choices
    if "tool_calls" in only:  # (a model that calls: sent whole, once read)
        (call,) = only["tool_calls"]
        assert [t.tool for t in auto.tokens] == [call["function"]["name"]]
    else:
        assert auto.streamed() == only["text"] == auto.result["text"]
        assert parse_tool_call(only["text"], PARAMETERS) is None
        assert {t.tool for t in auto.tokens} == {None}


# Log probabilities ---------------------------------------------------------------------------


def check_entries(entries: list[dict[str, Any]], text: str, top: int) -> None:
    """Entries that add up to ``text``, each with its ``top`` alternatives, likeliest first."""
    assert "".join(e["token"] for e in entries) == text
    if "\ufffd" not in text:  # (a character cut short at the end is U+FFFD in the text)
        assert bytes(b for e in entries for b in e["bytes"]).decode() == text
    for entry in entries:
        alternatives = [a["logprob"] for a in entry["top_logprobs"]]
        assert len(alternatives) == top
        assert alternatives == sorted(alternatives, reverse=True)
        assert entry["logprob"] <= alternatives[0] <= 0
        assert sum(np.exp(alternatives)) <= 1 + 1e-6


@pytest.mark.parametrize(
    "fields",
    [
        {
            "messages": [{"role": "user", "content": "Say « café » and « €5 » in a sentence."}],
            "stop": ["."],
        },
        # (Each of its characters comes in two tokens: the first completes none.)
        {"prompt": "日本の首都は", "stop": ["ル", "\n"]},
    ],
)
def test_log_probabilities_add_up_to_the_text_piece_by_piece(
    model: Model, fields: dict[str, Any]
) -> None:
    """Greedy, so each token is the likeliest; a stop string cuts the text (and a token); the
    answers have characters of several bytes."""
    out = model.run(**fields, logprobs=True, top_logprobs=5, temperature=0.0, max_new_tokens=40)
    (only,) = out.choices
    text = out.result["text"]
    assert any(len(c.encode()) > 1 for c in text)
    check_entries(only["logprobs"], text, 5)
    for entry in only["logprobs"]:
        assert entry["logprob"] == entry["top_logprobs"][0]["logprob"]
    for token in out.tokens:  # (each piece with its own tokens' entries)
        assert "".join(e["token"] for e in token.logprobs) == token.text
    assert [e for t in out.tokens for e in t.logprobs] == only["logprobs"]
    if "prompt" in fields:
        assert any(e["token"] == "" for e in only["logprobs"])


def test_log_probabilities_of_sampled_choices(model: Model) -> None:
    out = model.run(
        prompt="The weather today is", n=2, logprobs=True, top_logprobs=2, seed=3, max_new_tokens=16
    )
    for choice in out.choices:
        check_entries(choice["logprobs"], choice["text"], 2)
    zero = model.run(prompt="Hi", logprobs=True, max_new_tokens=3, temperature=0.0)
    assert all(e["top_logprobs"] == [] for e in zero.choices[0]["logprobs"])


# Penalties and biases ------------------------------------------------------------------------


def test_penalties_change_what_greedy_decoding_says(model: Model) -> None:
    """Each penalty changes the story once it repeats a token, never its first token; a
    negative presence penalty makes it repeat itself more. (The prompt is run once first, so
    that every run reuses the same cells of it: a prompt's cells computed in another step can
    change a greedy answer on their own.)"""
    story = {"prompt": "Once upon a time, in a small village,", "temperature": 0.0}
    model.run(**story, max_new_tokens=1)
    base = model.run(**story, max_new_tokens=40).result["text"]
    for penalty in (
        {"repeat_penalty": 1.3},
        {"frequency_penalty": 1.0},
        {"presence_penalty": 1.0},
        {"presence_penalty": -1.0},
    ):
        text = model.run(**story, max_new_tokens=40, **penalty).result["text"]
        assert text != base, penalty
        assert text.split()[0] == base.split()[0]
        if penalty.get("presence_penalty", 0) < 0:
            assert len(set(text.split())) < len(set(base.split()))


def test_a_logit_bias_moves_greedy_decoding_off_its_first_choice(model: Model) -> None:
    ask = {"prompt": "The capital of France is", "temperature": 0.0, "max_new_tokens": 3}
    first = model.run(**ask, logprobs=True).choices[0]["logprobs"][0]
    vocab = model.runner._prompts.vocab
    (token,) = vocab.tokenize(bytes(first["bytes"]), add_bos=False, special=False)
    away = model.run(**ask, logprobs=True, logit_bias={str(token): -100}).choices[0]["logprobs"][0]
    assert away["token"] != first["token"]
    assert away["logprob"] < first["logprob"]  # (the raw logits': before the bias)
    (banana,) = vocab.tokenize(b" banana", add_bos=False, special=False)
    toward = model.run(**ask, logit_bias={str(banana): 100})
    assert toward.result["text"].startswith(" banana")


# Refused before admission --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"logit_bias": {"49152": 5}}, "names token 49152; this model's tokens are 0 to 49151"),
        ({"repeat_penalty": 0}, "'repeat_penalty' must be above 0"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"minimum": 1}}}},
            "'minimum' is not enforced here",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "string", "pattern": "[a-z]+"}},
                }
            },
            "cannot be made a grammar",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"uniqueItems": True}},
                    }
                ],
                "tool_choice": "required",
            },
            "the parameters of 'f' cannot be held to: 'uniqueItems'",
        ),
        ({"n": 16, "max_new_tokens": 400}, "a worker's cache has"),
    ],
)
def test_what_the_model_cannot_do_is_refused_at_prepare(
    model: Model, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(SpecInvalid, match=message.replace("(", r"\(")) as refused:
        model.prepare({"prompt": "Hi", **fields})
    assert refused.value.need_code == "spec_invalid"


# Embeddings ----------------------------------------------------------------------------------

PARAPHRASES = [
    "The cat sat on the mat.",
    "A cat was sitting on a rug.",
    "Quarterly tax revenue rose sharply.",
    "Government income from taxes grew fast this quarter.",
]


def test_embeddings_are_unit_vectors_and_paraphrases_are_nearest(model: Model) -> None:
    texts = [*PARAPHRASES, PARAPHRASES[0], "x " * 300, "x " * 300]  # (the last over two steps)
    vectors, tokens = model.loop.run_until_complete(model.runner.embed(texts))
    vocab = model.runner._prompts.vocab
    assert tokens == sum(
        len(vocab.tokenize(t.encode(), add_bos=False, special=False)) for t in texts
    )
    found = np.array(vectors)
    assert found.shape == (7, 576)  # (SmolLM2-135M's hidden size)
    assert np.allclose(np.linalg.norm(found, axis=1), 1.0)
    # The same text, the same vector (in another step, the same but for float rounding).
    assert found[0] @ found[4] > 0.9999
    assert found[5] @ found[6] > 0.9999
    similar = found[:4] @ found[:4].T
    for i, pair in ((0, 1), (1, 0), (2, 3), (3, 2)):
        others = [similar[i, j] for j in range(4) if j not in (i, pair)]
        assert similar[i, pair] > max(others)


def test_an_embedding_is_made_between_the_steps_of_a_running_job(model: Model) -> None:
    async def both() -> tuple[Outcome, tuple[list[list[float]], int]]:
        job = asyncio.ensure_future(
            model._run({"prompt": "Once upon a time", "temperature": 0.0, "max_new_tokens": 40})
        )
        embedded = await model.runner.embed(PARAPHRASES)
        return await job, embedded

    generated, (vectors, _) = model.loop.run_until_complete(both())
    assert generated.result["completion_tokens"] == 40
    assert len(vectors) == 4


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        ([], "give 1 to 2048 texts"),
        (["a", ""], "text 1 to embed is 0 tokens"),
        (["a " * 600], "text 0"),
    ],
)
def test_what_cannot_be_embedded_is_refused(model: Model, texts: list[str], message: str) -> None:
    with pytest.raises(SpecInvalid, match=message):
        model.loop.run_until_complete(model.runner.embed(texts))


# Every output a grammar allows ---------------------------------------------------------------


class Walker:
    """Random walks through what a grammar allows, on the model's own vocabulary (llama.cpp's
    grammar sampler, over a random draw of tokens that always holds every one-byte character
    and the end of generation): outputs as a model held to it could write them.

    The tokens drawn are whole UTF-8 characters: llama.cpp's grammar takes byte sequences
    that are not UTF-8 (overlong forms, surrogates), which the worker decodes as U+FFFD, so
    they never break the JSON, but they could break a ``maxLength``."""

    def __init__(self, runner: LlamaRunner) -> None:
        import llama_cpp

        self.ll, self.vocab = llama_cpp, runner._prompts.vocab
        n, buffer = self.vocab.n_vocab(), ctypes.create_string_buffer(256)
        pieces = []
        for t in range(n):
            size = llama_cpp.llama_token_to_piece(self.vocab.vocab, t, buffer, 256, 0, False)
            pieces.append(buffer.raw[:size])
        self.pieces = pieces
        self.ends = [t for t in range(n) if llama_cpp.llama_vocab_is_eog(self.vocab.vocab, t)]
        whole = [t for t in range(n) if utf8(pieces[t]) and t not in self.ends]
        self.bytes = [t for t in whole if len(pieces[t]) == 1]
        self.others = [t for t in whole if len(pieces[t]) > 1]

    def walk(self, grammar: str, seed: int, limit: int = 400) -> str:
        ll, rng = self.ll, random.Random(seed)
        sampler = ll.llama_sampler_init_grammar(self.vocab.vocab, grammar.encode(), b"root")
        assert sampler
        out = b""
        try:
            for _ in range(limit):
                ids = self.ends + self.bytes + rng.sample(self.others, 500)
                data = (ll.llama_token_data * len(ids))(
                    *(ll.llama_token_data(t, rng.random(), 0) for t in ids)
                )
                array = ll.llama_token_data_array(data, len(ids), -1, False)
                ll.llama_sampler_apply(sampler, ctypes.byref(array))
                allowed = [d for d in data[: array.size] if d.logit != -np.inf]
                token = max(allowed, key=lambda d: d.logit).id
                if token in self.ends:
                    return out.decode()
                ll.llama_sampler_accept(sampler, token)
                out += self.pieces[token]
        finally:
            ll.llama_sampler_free(sampler)
        raise AssertionError(f"no end after {limit} tokens: {out!r}")


def utf8(piece: bytes) -> bool:
    try:
        return bool(piece.decode())
    except UnicodeDecodeError:
        return False


@pytest.fixture(scope="module")
def walker(model: Model) -> Walker:
    return Walker(model.runner)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**32 - 1), which=st.integers(0, len(SCHEMAS) - 1))
def test_any_output_a_schemas_grammar_allows_is_valid_against_it(
    walker: Walker, seed: int, which: int
) -> None:
    schema = SCHEMAS[which][0]
    text = walker.walk(schema_grammar(schema, "schema"), seed)
    jsonschema.validate(json.loads(text), schema)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**32 - 1))
def test_any_call_the_required_grammar_allows_reads_as_a_valid_call(
    walker: Walker, seed: int
) -> None:
    text = walker.walk(calls_grammar([t["function"] for t in TOOLS]), seed)
    call = parse_tool_call(text, PARAMETERS)
    assert call is not None, text
    name, arguments = call
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])
