"""Structured output and tools for the embedded runner, with no IO: JSON schemas made grammars,
tools put in the prompt and read from the output, and each sequence's output shaped for the
job's tool choice.

A job's output is held to a grammar (GBNF, made here from JSON schemas by llama-cpp-python's
converter) when it asks for JSON (``json_schema``) or for a call of a tool ("required", or a
function's name); :class:`Choice` reads each sequence's output for the job's tool choice.
:mod:`governor.runners.llama.runner` prepares and runs the jobs.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from collections.abc import Collection, Iterator
from typing import Any

import orjson

from protocol.codes import NeedCode
from protocol.spec import ANY_OBJECT, JobSpec, SpecInvalid

from ..base import Finished, Job, Token
from .messages import Done

MAX_REPEAT = 1000


# The keywords of JSON Schema that constrain a value (annotations, "format" among them, and
# unknown keywords constrain nothing). The converter reads each schema one way (see
# :func:`_reading`) and ignores the constraints of any other: a schema with one is refused,
# since its output could fail it.
ASSERTIONS = frozenset(
    {
        *("type", "enum", "const", "$ref", "allOf", "anyOf", "oneOf", "not"),
        *("if", "then", "else", "multipleOf", "maximum", "exclusiveMaximum", "minimum"),
        *("exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems", "minItems"),
        *("uniqueItems", "maxContains", "minContains", "contains", "items", "prefixItems"),
        *("additionalItems", "unevaluatedItems", "maxProperties", "minProperties", "required"),
        *("properties", "patternProperties", "additionalProperties", "propertyNames"),
        *("dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties"),
    }
)
OBJECT = frozenset({"type", "properties", "required", "additionalProperties"})
REPEATS = frozenset({"minItems", "maxItems", "minLength", "maxLength"})
SUBSCHEMA = frozenset({"items", "additionalProperties", "additionalItems"})
SUBSCHEMAS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
NAMED_SUBSCHEMAS = frozenset({"properties", "$defs", "definitions"})
QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
MODES = ("text", "auto", "required")  # how output is read (:func:`tool_mode`), but a named call
CALL_OPENERS = ("{", "```", "<tool_call>")  # how a model's call may begin (auto reads it)
# The converter's rules for a string's characters let a control character through, which JSON
# does not allow unescaped (llama.cpp's own converter keeps them out as these do), and escapes
# of UTF-16 surrogates, which strict parsers refuse alone (orjson's) and are no characters; nor
# may a pattern's "." be a quote or a backslash, which would end or break the string.
JSON_CHARACTERS = (
    (
        re.compile(r"^char ::= .*$", re.MULTILINE),
        r'char ::= [^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" ([0-9a-cA-Ce-fE-F] [0-9a-fA-F] | [dD] [0-7]) [0-9a-fA-F] [0-9a-fA-F])',
    ),
    (re.compile(r"^dot ::= .*$", re.MULTILINE), r'dot ::= [^"\\\x00-\x1F]'),
)
# Any JSON object, as llama.cpp's own converter writes it (llama-server's JSON mode, its schema
# ``{"type": "object"}``): the whitespace before a closing bracket and after an opening one, a
# colon or a comma, where llama-cpp-python's converter puts one space at most after each value.
# The same prompt then has the same paths open to the model: greedy, the embedded model that
# llama-server answers with an indented, closed object otherwise nests objects to the token
# limit. (Its strings' characters are JSON's, :data:`JSON_CHARACTERS`.)
JSON_OBJECT_GRAMMAR = r"""root ::= object
object ::= "{" space ( string ":" space value ("," space string ":" space value)* )? space "}"
value ::= object | array | string | number | boolean | null
array ::= "[" space ( value ("," space value)* )? space "]"
string ::= "\"" char* "\""
char ::= .
number ::= ("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)?
integral-part ::= [0] | [1-9] [0-9]{0,15}
decimal-part ::= [0-9]{1,16}
boolean ::= "true" | "false"
null ::= "null"
space ::= | " " | "\n"{1,2} [ \t]{0,20}
"""
FENCED = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)
TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def refused(detail: str) -> SpecInvalid:
    return SpecInvalid(NeedCode.SPEC_INVALID, detail)


def schema_problem(schema: Any) -> str | None:
    """Why the converter's grammar for ``schema`` could let out JSON that fails it, or cost
    too much to make; None when it cannot. (The schema's own nesting is bounded by the spec.)"""
    stack = [schema]
    while stack:
        node = stack.pop()
        if type(node) is bool:
            continue
        if type(node) is not dict:
            return f"{orjson.dumps(node).decode()[:40]} is not a schema (an object)"
        problem = _node_problem(node, schema)
        if problem is not None:
            return problem
        for key, value in node.items():
            stack.extend(_subschemas(key, value))
    return None


def _node_problem(node: dict[str, Any], root: Any) -> str | None:
    reading, honoured = _reading(node)
    ignored = sorted((node.keys() & ASSERTIONS) - honoured)
    if ignored:
        return f"{ignored[0]!r} is not enforced here (beside {reading}); take it out"
    for key in REPEATS & node.keys():
        if type(node[key]) is not int or not 0 <= node[key] <= MAX_REPEAT:
            return f"{key!r} must be a whole number from 0 to {MAX_REPEAT}"
    pattern = node.get("pattern")
    if type(pattern) is str and _repeats(pattern) > MAX_REPEAT:
        return f"a 'pattern' may repeat at most {MAX_REPEAT} times"
    required = node.get("required")
    if reading == "'properties'" and type(required) is list:
        missing = set(map(str, required)) - set(node.get("properties") or ())
        if missing:
            return f"required property {sorted(missing)[0]!r} has no schema in 'properties'"
    if reading == "'allOf'" and type(node["allOf"]) is list:
        for part in node["allOf"]:
            target = _target(root, part["$ref"]) if type(part) is dict and "$ref" in part else part
            if (
                type(target) is not dict
                or "properties" not in target
                or target.keys() & ASSERTIONS - OBJECT
            ):
                return "each of an 'allOf' must be an object's 'properties' (or a '$ref' to one)"
    return None


def _reading(node: dict[str, Any]) -> tuple[str, frozenset[str]]:
    """How the converter reads ``node`` (the first of these that applies, as it tries them),
    and the keywords it honours in that reading."""
    kind = node.get("type")
    for key in ("$ref", "oneOf", "anyOf"):
        if key in node:
            return repr(key), frozenset({key})
    if type(kind) is list:
        return "a list of types", frozenset({"type"})
    for key in ("const", "enum"):
        if key in node:
            return repr(key), frozenset({key, "type"})
    if kind in (None, "object"):
        if "properties" in node or node.get("additionalProperties", True) is not True:
            return "'properties'", OBJECT
        if "allOf" in node:
            return "'allOf'", frozenset({"type", "allOf"})
    if kind in (None, "array") and (node.get("items") or "prefixItems" in node):
        key = "items" if node.get("items") else "prefixItems"
        counts = {"minItems", "maxItems"} if type(node[key]) is dict else set()
        return repr(key), frozenset({"type", key, *counts})
    if kind in (None, "string") and "pattern" in node:
        return "'pattern'", frozenset({"type", "pattern"})
    if kind == "string" and ("minLength" in node or "maxLength" in node):
        return "a string's length", frozenset({"type", "minLength", "maxLength"})
    return "'type'", frozenset({"type"})


def _target(root: Any, ref: Any) -> Any:
    """What a local ``$ref`` (``#/...``) of ``root`` points at; None if it points nowhere."""
    if type(ref) is not str or not ref.startswith("#"):
        return None
    target = root
    for step in ref[1:].split("/")[1:]:
        if type(target) is not dict or step not in target:
            return None
        target = target[step]
    return target


def _subschemas(key: str, value: Any) -> list[Any]:
    if key in SUBSCHEMA:
        return value if key == "items" and type(value) is list else [value]
    if key in SUBSCHEMAS and type(value) is list:
        return list(value)
    if key in NAMED_SUBSCHEMAS and type(value) is dict:
        return list(value.values())
    return []


def _repeats(pattern: str) -> int:
    """The largest count in ``pattern``'s ``{m}`` and ``{m,n}`` quantifiers (0: none)."""
    return max((int(n or m) for m, n in QUANTIFIER.findall(pattern)), default=0)


def _converter(**prop_order: int) -> Any:
    from llama_cpp.llama_grammar import SchemaConverter

    return SchemaConverter(  # type: ignore[no-untyped-call]  # (llama-cpp-python: untyped)
        prop_order=prop_order, allow_fetch=False, dotall=False, raw_pattern=False
    )


def schema_grammar(schema: Any, what: str) -> str:
    """GBNF for JSON valid against ``schema`` (``what`` names it in a refusal); raises
    :class:`SpecInvalid`."""
    problem = schema_problem(schema)
    if problem is not None:
        raise refused(f"{what} cannot be held to: {problem}")
    converter = _converter()
    try:
        converter.visit(converter.resolve_refs(schema, "schema"), "")
    # The converter's errors are of every kind (assertions, KeyError, TypeError, ValueError):
    # any of them means this schema cannot be converted.
    except Exception as exc:
        raise refused(f"{what} cannot be made a grammar: {exc}") from None
    return json_strings(str(converter.format_grammar()))


def json_strings(grammar: str) -> str:
    """The converter's ``grammar`` with strings JSON allows (see :data:`JSON_CHARACTERS`)."""
    for rule, fixed in JSON_CHARACTERS:
        if (found := rule.search(grammar)) is not None:
            grammar = grammar[: found.start()] + fixed + grammar[found.end() :]
    return grammar


def calls_grammar(functions: list[dict[str, Any]]) -> str:
    """GBNF for a call of any of ``functions``: ``{"name": NAME, "arguments": {...}}``, the
    arguments valid against that function's parameters (its name first, so that it is known
    early)."""
    converter = _converter(name=0, arguments=1)
    calls = []
    for i, function in enumerate(functions):
        name, parameters = function["name"], parameters_of(function)
        problem = schema_problem(parameters)
        if problem is not None:
            raise refused(f"the parameters of {name!r} cannot be held to: {problem}")
        try:
            arguments = converter.resolve_refs(parameters, f"tool-{i}")
            call = {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": arguments},
                "required": ["name", "arguments"],
            }
            calls.append(converter.visit(call, f"call-{i}"))
        except Exception as exc:  # (as in schema_grammar)
            raise refused(f"the parameters of {name!r} cannot be made a grammar: {exc}") from None
    return json_strings(f"{converter.format_grammar()}\nroot ::= {' | '.join(calls)}")


def parameters_of(function: dict[str, Any]) -> Any:
    """A function's parameters schema: none (or ``{}``) is no arguments at all, as OpenAI's."""
    return function.get("parameters") or {"type": "object", "properties": {}}


def tool_mode(spec: JobSpec) -> str:
    """How a job's output is read: "text" (no tools, or "none": they are left out), "auto",
    "required", or the name of the function it calls."""
    return "text" if spec.tools is None or spec.tool_choice == "none" else spec.tool_choice


def job_grammar(spec: JobSpec) -> str | None:
    """The grammar a job's output is held to, or None; raises :class:`SpecInvalid`. A call
    it must make ("required", a named function) is held to the call's shape, whatever its
    ``response_format`` (it answers with no text); else a ``json_schema`` holds (with tools
    "auto" too: the model may then call one only in the schema's shape)."""
    mode = tool_mode(spec)
    if mode not in MODES:
        (function,) = (f for f in functions_of(spec) if f["name"] == mode)
        return schema_grammar(parameters_of(function), f"the parameters of {mode!r}")
    if mode == "required":
        return calls_grammar(functions_of(spec))
    if spec.json_schema == ANY_OBJECT:
        return json_strings(JSON_OBJECT_GRAMMAR)
    if spec.json_schema is not None:
        return schema_grammar(orjson.loads(spec.json_schema), "the response_format's schema")
    return None


def functions_of(spec: JobSpec) -> list[dict[str, Any]]:
    """The functions of the job's tools (each ``{"name", "description"?, "parameters"?}``)."""
    return [tool["function"] for tool in orjson.loads(spec.tools or "[]")]


def tools_message(functions: list[dict[str, Any]], mode: str) -> str:
    """What tells a model with no tool template of its tools, as a system message."""
    if mode not in MODES:
        (function,) = (f for f in functions if f["name"] == mode)
        return (
            f"Call the function {mode}.\n{_described(function)}\n\n"
            "Reply with only its arguments: a JSON object."
        )
    listed = "\n".join(_described(f) for f in functions)
    how = (
        'To call one, reply with only a JSON object: {"name": the function\'s name, '
        '"arguments": its arguments, a JSON object}.'
    )
    if mode == "required":
        return f"Call one of these functions:\n{listed}\n\n{how}"
    return f"You can call these functions:\n{listed}\n\n{how} Otherwise, reply as usual."


def _described(function: dict[str, Any]) -> str:
    line = f"- {function['name']}"
    if function.get("description"):
        line += f": {function['description']}"
    parameters = orjson.dumps(parameters_of(function)).decode()
    return f"{line}\n  Its parameters (a JSON schema): {parameters}"


def with_system(messages: list[dict[str, str]], text: str) -> list[dict[str, str]]:
    """``messages`` with ``text`` in their system message (one put first where none is)."""
    if messages and messages[0]["role"] == "system":
        first = {"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def parse_tool_call(text: str, names: Collection[str]) -> tuple[str, str] | None:
    """The call ``text`` makes, as (name, arguments as JSON text): one JSON object
    ``{"name", "arguments"}`` (or ``"parameters"``, as some models write it) naming one of
    ``names``, alone or in a ```json fence or ``<tool_call>`` tags; None when it is not one."""
    body = text.strip()
    for wrapper in (FENCED, TAGGED):
        if (found := wrapper.fullmatch(body)) is not None:
            body = found.group(1)
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if type(value) is not dict:
        return None
    name = value.get("name")
    arguments = value.get("arguments", value.get("parameters"))
    if type(arguments) is str:  # (OpenAI's own form: the arguments as JSON text)
        try:
            arguments = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return None
    if type(name) is not str or name not in names or type(arguments) is not dict:
        return None
    return name, orjson.dumps(arguments).decode()


def may_be_call(text: str) -> bool:
    """Whether ``text`` could be the start of a call (as far as it has come)."""
    start = text.lstrip()
    return any(start.startswith(o) or o.startswith(start) for o in CALL_OPENERS)


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """A call in OpenAI's shape."""
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class Choice:
    """One sequence's output as the client gets it, for the job's tool ``mode``
    (:func:`tool_mode`).

    "text": as it comes. A function's name: as it comes, as that function's arguments (the
    grammar makes it nothing else). "required": held, and read as a call at the end. "auto":
    held while it could still begin a call (:func:`may_be_call`); from the first piece that
    cannot, let out as text as it comes; held to the end, read as a call if it is one, else
    let out then as text."""

    def __init__(self, index: int, mode: str, names: frozenset[str]) -> None:
        self.index = index
        self.mode = mode
        self.names = names
        self.flowing = mode not in ("auto", "required")
        self.calling = mode == "required"  # held to the end, to be read as a call
        self.held: list[Token] = []
        self.entries: list[dict[str, Any]] = []  # its log probabilities

    def feed(self, token: Token) -> Token | None:
        """What to send of a piece of output now (None: nothing yet)."""
        self.entries += token.logprobs
        if self.flowing:
            return token if self.mode in MODES else dataclasses.replace(token, tool=self.mode)
        self.held.append(token)
        if self.calling:
            return None
        start = "".join(t.text for t in self.held).lstrip()
        if may_be_call(start):
            self.calling = len(start) >= max(map(len, CALL_OPENERS))  # (no longer in doubt)
            return None
        self.flowing = True
        return self._release(token.generated)

    def _release(self, generated: int | None) -> Token:
        held, self.held = self.held, []
        logprobs = tuple(entry for t in held for entry in t.logprobs)
        return Token("".join(t.text for t in held), generated, self.index, logprobs)

    def end(self, text: str, finish: str, generated: int) -> tuple[list[Token], dict[str, Any]]:
        """What to send at the end, and the choice for the result (``text``: all the output)."""
        choice: dict[str, Any] = {"index": self.index, "text": text, "finish_reason": finish}
        if self.mode not in MODES:
            call = tool_call(self.mode, text)
            finish = "tool_calls" if finish == "stop" else finish
            return [], {**choice, "text": "", "finish_reason": finish, "tool_calls": [call]}
        if self.flowing:
            return [], choice
        read = parse_tool_call(text, self.names)
        if read is None:
            return ([self._release(generated)] if self.held else []), choice
        name, arguments = read
        sent = Token(arguments, generated, self.index, tool=name)
        calls = [tool_call(name, arguments)]
        return [sent], {**choice, "text": "", "finish_reason": "tool_calls", "tool_calls": calls}


def finish(
    job: Job, spec: JobSpec, done: Done, choices: list[Choice]
) -> Iterator[Token | Finished]:
    """The end of a job the worker has done: what its choices still have to send, then its
    result (``choices`` in it with several, log probabilities or tools)."""
    generated = done.completion_tokens
    results = []
    for choice, ended in zip(choices, done.choices, strict=True):
        tokens, result = choice.end(ended.text, ended.finish_reason, generated)
        yield from tokens
        if spec.logprobs is not None:
            result["logprobs"] = choice.entries
        results.append(result)
    # (ttft_ms and tpot_ms are the governor's, measured from admission.)
    result = {
        "text": results[0]["text"],
        "prompt_tokens": len(job.tokens),
        "completion_tokens": generated,
        "cached_tokens": done.cached_tokens,
        "finish_reason": results[0]["finish_reason"],
    }
    if spec.n > 1 or spec.logprobs is not None or tool_mode(spec) != "text":
        result["choices"] = results
    yield Finished(result)
