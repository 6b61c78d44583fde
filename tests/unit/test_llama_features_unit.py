"""The llama runner's OpenAI features, without a model: how output text is cut into tokens for
their log probabilities, how several choices fork from one prompt in the scheduler, how schemas
and tools become grammars (or are refused), and how a sequence's output is read as a call."""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.runners import Finished, Job, Token
from governor.runners.llama.batching import Scheduler, Sequence
from governor.runners.llama.messages import Done, Ended
from governor.runners.llama.structured import (
    MAX_REPEAT,
    Choice,
    calls_grammar,
    finish,
    job_grammar,
    may_be_call,
    parse_tool_call,
    schema_grammar,
    schema_problem,
    tools_message,
    with_system,
)
from governor.runners.llama.worker import Text
from protocol.spec import JobSpec, SpecInvalid, spec_from_object

# Text and its tokens -----------------------------------------------------------------------


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` cut at ``cuts`` (positions, any order): tokens, some ending inside a character."""
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


@given(
    text=st.text(alphabet="ab é€😀<|>", max_size=16),
    cuts=st.lists(st.integers(0, 64), max_size=12),
    stops=st.lists(st.text(alphabet="ab<|>é", min_size=1, max_size=3), max_size=2),
)
def test_whole_token_deltas_are_their_tokens_and_add_up_to_the_text(
    text: str, cuts: list[int], stops: list[str]
) -> None:
    """With ``whole`` (a job with log probabilities), every piece let out is exactly the text of
    the tokens let out with it, a character split over tokens counted in the one that completes
    it; the tokens' texts and bytes add up to the text, whatever the stop strings cut."""
    out, pieces = Text(stops), split(text.encode(), cuts)
    sent: list[str] = []
    stopped = False
    for piece in pieces:
        stopped = out.add(piece)
        delta = out.delta(final=stopped, whole=True)
        assert delta == "".join(out.token(i) for i in out.fresh)
        sent.append(delta)
        if stopped:
            break
    if not stopped:
        delta = out.delta(final=True, whole=True)
        assert delta == "".join(out.token(i) for i in out.fresh)
        sent.append(delta)
    assert "".join(sent) == out.text
    assert "".join(out.token(i) for i in range(len(out.pieces))) == out.text
    assert b"".join(out.pieces) == out.text.encode()
    assert text.startswith(out.text)
    assert not any(s in out.text for s in stops)


def test_a_character_split_over_two_tokens_belongs_to_the_second() -> None:
    euro = "€".encode()
    out = Text([])
    out.add(b"a" + euro[:2])
    assert out.delta(final=False, whole=True) == "a"
    out.add(euro[2:] + b"b")
    assert out.delta(final=True, whole=True) == "€b"
    assert [out.token(0), out.token(1)] == ["a", "€b"]
    assert out.pieces == [b"a" + euro[:2], euro[2:] + b"b"]


def test_a_token_cut_by_a_stop_string_keeps_what_comes_before_it() -> None:
    out = Text(["."])
    out.add(b" Par")
    assert out.add(b"is. And", note="scores")
    assert out.delta(final=True, whole=True) == " Paris"
    assert out.pieces == [b" Par", b"is"]
    assert out.notes == [None, "scores"]
    out = Text(["."])
    out.add(b" Paris")
    assert out.add(b". And")
    assert out.pieces == [b" Paris"]  # (a token all after the stop is not the text's)


def test_without_whole_tokens_only_a_stop_strings_start_is_held() -> None:
    out = Text(["STOP"])
    out.add(b"abcST")
    assert out.delta(final=False) == "abc"
    out.add(b"X")
    assert out.delta(final=False) == "STX"


# Several choices from one prompt --------------------------------------------------------


class Cells:
    """The cache operations, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int, int]] = []

    def forget(self, slot: int, start: int) -> None:
        self.calls.append(("forget", slot, start, 0))

    def share(self, source: int, slot: int, length: int) -> None:
        self.calls.append(("share", source, slot, length))

    def stash(self, slot: int) -> object:
        raise AssertionError("no sequence is suspended here")

    def unstash(self, slot: int, saved: object) -> bool:
        raise AssertionError("no sequence is suspended here")


def test_a_fork_shares_the_whole_prompt_and_samples_beside_its_first() -> None:
    cells = Cells()
    s = Scheduler(4, 64, 1024, cells)
    first, other = Sequence("j", (1, 2, 3), 4), Sequence("j/1", (1, 2, 3), 4)
    s.submit(first)
    assert not s.fork(first, other)  # (its prompt is not in the cache yet)
    entries = s.plan()
    s.advance(entries)
    assert s.fork(first, other)
    assert ("share", first.slot, other.slot, 3) in cells.calls
    assert (other.fed, other.reused, other.prefilling) == (3, 3, False)
    first.pending = other.pending = 9
    step = s.plan()
    assert sorted((e.seq.key, e.tokens, e.start) for e in step) == [
        ("j", (9,), 3),
        ("j/1", (9,), 3),
    ]


def test_a_fork_with_no_free_slot_is_refused() -> None:
    s = Scheduler(1, 64, 1024, Cells())
    first = Sequence("j", (1, 2), 4)
    s.submit(first)
    s.advance(s.plan())
    assert not s.fork(first, Sequence("j/1", (1, 2), 4))


# Grammars ------------------------------------------------------------------------------


WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
        },
    },
}
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time"}}


def spec(**fields: Any) -> JobSpec:
    return spec_from_object({"prompt": "Hi", **fields}, max_new_tokens_ceiling=1024)


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ({"type": "integer", "minimum": 0}, "'minimum' is not enforced"),
        ({"properties": {"a": {"not": {}}}}, "'not' is not enforced"),
        (
            {"type": "array", "items": {"type": "null"}, "maxItems": MAX_REPEAT + 1},
            "'maxItems' must be",
        ),
        ({"type": "string", "pattern": "^a{5000}$"}, "'pattern' may repeat"),
        ({"type": "object", "properties": {}, "required": ["a"]}, "required property 'a'"),
        ({"type": "object", "required": ["a"]}, "'required' is not enforced here (beside 'type')"),
        ({"anyOf": [3]}, "is not a schema"),
        (
            {"type": ["string", "null"], "maxLength": 8},
            "'maxLength' is not enforced here (beside a list of types)",
        ),
        (
            {"anyOf": [{"type": "object"}], "properties": {"a": {}}},
            "'properties' is not enforced here (beside 'anyOf')",
        ),
        ({"allOf": [{"type": "string", "maxLength": 3}]}, "each of an 'allOf'"),
        ({"type": "array", "prefixItems": [{}], "minItems": 2}, "'minItems' is not enforced"),
    ],
)
def test_a_schema_the_grammar_could_not_hold_to_is_refused(
    schema: dict[str, Any], problem: str
) -> None:
    assert problem in (schema_problem(schema) or "")
    with pytest.raises(SpecInvalid, match="cannot be held to"):
        schema_grammar(schema, "the schema")


def test_keywords_are_told_from_property_names_and_annotations_pass() -> None:
    schema = {"type": "object", "properties": {"minimum": {"type": "integer"}}}
    assert schema_problem(schema) is None
    annotated = {"title": "A", "description": "B", "type": "string", "format": "email"}
    assert schema_problem(annotated) is None
    parts = {
        "$defs": {"A": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        "allOf": [{"$ref": "#/$defs/A"}, {"properties": {"b": {"type": "string"}}}],
    }
    assert schema_problem(parts) is None
    grammar = schema_grammar(parts, "the schema")
    assert '"\\"a\\""' in grammar
    assert '"\\"b\\""' in grammar


def test_a_schema_the_converter_cannot_read_is_refused_with_its_reason() -> None:
    with pytest.raises(SpecInvalid, match="cannot be made a grammar"):
        schema_grammar({"type": "string", "pattern": "no anchors"}, "the schema")
    with pytest.raises(SpecInvalid, match="cannot be made a grammar"):
        schema_grammar({"$ref": "https://example.com/schema.json"}, "the schema")


def test_each_tool_choice_has_its_grammar() -> None:
    tools = [WEATHER, TIME]
    assert job_grammar(spec()) is None
    assert job_grammar(spec(tools=tools)) is None  # ("auto": free text)
    assert job_grammar(spec(tools=tools, tool_choice="none")) is None
    json_mode = job_grammar(spec(response_format={"type": "json_object"}))
    assert json_mode is not None
    # (llama.cpp's own JSON mode: whitespace after an opening bracket and before a closing one)
    assert json_mode.startswith("root ::= object\n")
    assert 'space "}"' in json_mode
    assert 'space ::= | " " | "\\n"{1,2} [ \\t]{0,20}' in json_mode
    named = job_grammar(spec(tools=tools, tool_choice=WEATHER))
    assert named is not None
    assert '"\\"city\\""' in named
    assert "get_weather" not in named  # (only the arguments: the name is known)
    required = job_grammar(spec(tools=tools, tool_choice="required"))
    assert required == calls_grammar([WEATHER["function"], TIME["function"]])
    root = required.splitlines()[-1]
    assert root == "root ::= call-0 | call-1"
    assert '"\\"get_weather\\""' in required
    assert '"\\"get_time\\""' in required


def test_the_tools_message_says_what_to_call_and_how() -> None:
    functions = [WEATHER["function"], TIME["function"]]
    auto = tools_message(functions, "auto")
    assert "get_weather: The weather in a city" in auto
    assert '"maxLength":30' in auto
    assert "Otherwise" in auto
    assert "Otherwise" not in tools_message(functions, "required")
    named = tools_message(functions, "get_time")
    assert "get_weather" not in named
    assert "only its arguments" in named
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert with_system(system, "Tools.")[0]["content"] == "Be brief.\n\nTools."
    assert with_system(system[1:], "Tools.") == [{"role": "system", "content": "Tools."}, system[1]]


# Reading a call ------------------------------------------------------------------------

NAMES = frozenset({"get_weather", "get_time"})
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(
    name=st.sampled_from(sorted(NAMES)),
    arguments=st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4),
    indent=st.sampled_from([None, 2]),
    key=st.sampled_from(["arguments", "parameters"]),
    as_text=st.booleans(),
    wrap=st.sampled_from(["{}", " {}\n", "```json\n{}\n```", "<tool_call>\n{}\n</tool_call>"]),
)
def test_any_call_of_a_tool_reads_as_that_call(
    name: str, arguments: dict[str, Any], indent: int | None, key: str, as_text: bool, wrap: str
) -> None:
    """Whatever the spacing, the key the arguments come under, whether they come as an object
    or as JSON text, and a fence or tags around: a call of a tool reads as that call, its
    arguments the same object."""
    value = json.dumps(arguments) if as_text else arguments
    text = wrap.replace("{}", json.dumps({"name": name, key: value}, indent=indent))
    assert may_be_call(text[:1])
    read = parse_tool_call(text, NAMES)
    assert read is not None
    assert read[0] == name
    assert orjson.loads(read[1]) == arguments


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is sunny.",
        '{"name": "get_news", "arguments": {}}',  # (no such tool)
        '{"name": "get_weather"}',
        '{"name": "get_weather", "arguments": [1]}',
        '{"name": ["get_weather"], "arguments": {}}',
        '{"name": "get_weather", "arguments": "not json"}',
        '[{"name": "get_weather", "arguments": {}}]',
        '{"name": "get_weather", "arguments": {}',
    ],
)
def test_what_is_not_one_call_of_a_tool_reads_as_none(text: str) -> None:
    assert parse_tool_call(text, NAMES) is None


@given(st.text(max_size=12))
def test_text_that_begins_a_call_is_held_and_other_text_is_not(text: str) -> None:
    start = text.lstrip()
    held = start == "" or start[0] == "{" or start.startswith(("```", "<tool_call>"))
    held = held or "```".startswith(start) or "<tool_call>".startswith(start)
    assert may_be_call(text) == held


def token(text: str, index: int = 0, generated: int = 1) -> Token:
    return Token(text, generated, index, ({"token": text},))


def test_a_named_function_streams_its_arguments_and_ends_in_its_call() -> None:
    choice = Choice(0, "get_weather", NAMES)
    assert choice.feed(token('{"city"')) == Token(
        '{"city"', 1, 0, ({"token": '{"city"'},), "get_weather"
    )
    sent, result = choice.end('{"city": "Paris"}', "stop", 5)
    assert sent == []
    assert result["text"] == ""
    assert result["finish_reason"] == "tool_calls"
    (call,) = result["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["type"] == "function"
    assert call["id"].startswith("call_")
    assert len(call["id"]) == 5 + 24
    assert choice.end("{", "length", 1)[1]["finish_reason"] == "length"


def test_auto_lets_text_flow_once_it_cannot_be_a_call() -> None:
    choice = Choice(1, "auto", NAMES)
    assert choice.feed(token(" ", 1)) is None
    first = choice.feed(token("The", 1))
    assert first is not None
    assert (first.text, first.index, first.tool) == (" The", 1, None)
    assert first.logprobs == ({"token": " "}, {"token": "The"})
    assert choice.feed(token(" sun", 1)) == token(" sun", 1)
    assert choice.end(" The sun", "stop", 3) == (
        [],
        {"index": 1, "text": " The sun", "finish_reason": "stop"},
    )
    assert choice.entries == [{"token": " "}, {"token": "The"}, {"token": " sun"}]


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_a_call_is_held_to_the_end_and_sent_as_one_piece(mode: str) -> None:
    choice = Choice(0, mode, NAMES)
    text = '{"name": "get_time", "arguments": {}}'
    assert choice.feed(token(text[:9])) is None
    assert choice.feed(token(text[9:])) is None
    sent, result = choice.end(text, "stop", 12)
    assert sent == [Token("{}", 12, 0, tool="get_time")]
    assert result["finish_reason"] == "tool_calls"
    assert result["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_held_output_that_is_no_call_goes_out_as_text_at_the_end() -> None:
    choice = Choice(0, "auto", NAMES)
    assert choice.feed(token('{"a": 1}')) is None
    sent, result = choice.end('{"a": 1}', "stop", 4)
    assert [t.text for t in sent] == ['{"a": 1}']
    assert sent[0].logprobs == ({"token": '{"a": 1}'},)
    assert result == {"index": 0, "text": '{"a": 1}', "finish_reason": "stop"}


def test_the_result_lists_choices_when_there_are_several_or_log_probabilities() -> None:
    done = Done("J", [Ended("a", "stop"), Ended("bc", "length")], 3, 1)
    two = spec(n=2)
    events = list(
        finish(
            Job("J", spec=two, tokens=(1, 2)),
            two,
            done,
            [Choice(i, "text", NAMES) for i in range(2)],
        )
    )
    (end,) = events
    assert isinstance(end, Finished)
    assert end.result == {
        "text": "a",
        "prompt_tokens": 2,
        "completion_tokens": 3,
        "cached_tokens": 1,
        "finish_reason": "stop",
        "choices": [
            {"index": 0, "text": "a", "finish_reason": "stop"},
            {"index": 1, "text": "bc", "finish_reason": "length"},
        ],
    }
    one = spec()
    (end,) = finish(
        Job("J", spec=one, tokens=(1,)),
        one,
        dataclasses.replace(done, choices=done.choices[:1]),
        [Choice(0, "text", NAMES)],
    )
    assert isinstance(end, Finished)
    assert "choices" not in end.result
