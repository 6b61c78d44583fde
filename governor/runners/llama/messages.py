"""What the daemon and a llama.cpp worker say to each other: one dataclass a message, and their
codec, the one place either end reads or writes the pipe.

The daemon writes requests to the worker's stdin and reads events from its stdout, one JSON
object a line (the shapes in :mod:`governor.runners.llama.worker`'s docstring): a request's
``op`` and an event's ``ev`` name its class. A line that is no message of the kind expected (an
unknown ``op`` or ``ev``, a field missing or unknown) raises :class:`MessageInvalid`: the two
ends are one version, so that is a bug, never input to carry on with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson


class MessageInvalid(ValueError):
    """A line that is no message of the kind expected."""


# Requests: the daemon to the worker -----------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Run:
    """Run a job: its prompt's tokens, its ``n`` sequences sampled as asked; ``priority`` 0 is
    the most urgent (the interactive lane); ``alone``: stepped in steps of its own (the health
    probe); its objectives (``ttft_ms``, ``tpot_ms``, ``gap_ms``) and ``expect``, the tokens it
    is expected to generate, for the step budget."""

    id: str
    tokens: list[int]
    max_new_tokens: int
    priority: int = 0
    alone: bool = False
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    gap_ms: float = 0.0
    expect: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    grammar: str | None = None
    op: str = field(default="run", init=False)


@dataclass(slots=True)
class Cancel:
    """Drop a job, finished or not; its cells free before the next step."""

    id: str
    op: str = field(default="cancel", init=False)


@dataclass(slots=True)
class Suspend:
    """Step the job no more until it is resumed (admission took its slot back for a chat)."""

    id: str
    op: str = field(default="suspend", init=False)


@dataclass(slots=True)
class Resume:
    id: str
    op: str = field(default="resume", init=False)


@dataclass(slots=True)
class Embed:
    """Embed these texts (tokenised) between two steps."""

    id: str
    texts: list[list[int]]
    op: str = field(default="embed", init=False)


@dataclass(slots=True)
class Waiting:
    """Jobs wait at the daemon's doors for a slot (or none does): a step that frees slots waits
    a moment for them to be offered (see the worker's refill)."""

    jobs: bool
    op: str = field(default="waiting", init=False)


@dataclass(slots=True)
class Offered:
    """The slot of a job the worker ended has been offered to the jobs waiting."""

    id: str
    op: str = field(default="offered", init=False)


@dataclass(slots=True)
class Exit:
    """The daemon closed the worker's stdin (the reader's own message: never on the pipe)."""

    op: str = field(default="exit", init=False)


Request = Run | Cancel | Suspend | Resume | Embed | Waiting | Offered | Exit


# Events: the worker to the daemon -------------------------------------------------------------


@dataclass(slots=True)
class Ready:
    """Loaded and warmed up: its cache's cells, its slots, the context the model was trained
    for, and what a prompt token, a generated token and a cell more cost now (seconds)."""

    cells: int
    slots: int
    n_ctx_train: int
    rates: tuple[float, float, float]
    ev: str = field(default="ready", init=False)


@dataclass(slots=True)
class Refused:
    """It cannot serve as started (an ``--n-ctx`` the model was not trained for); it exits 2."""

    error: str
    ev: str = field(default="refused", init=False)


@dataclass(slots=True)
class Out:
    """A sequence's text let out in a step: the job, the sequence's index ``i`` among its
    ``n``, and ``n`` the tokens the job has generated so far; ``lp`` its tokens' log
    probabilities, where asked for (OpenAI's entries)."""

    id: str
    i: int
    text: str
    n: int
    lp: list[dict[str, Any]] | None = None


@dataclass(slots=True)
class Ended:
    """One sequence's whole text and why it stopped."""

    text: str
    finish_reason: str  # "stop" | "length"


@dataclass(slots=True)
class Done:
    """A job done: each sequence's end (by index), the tokens generated over all of them and how
    much of its prompt was found in the cache; or an ``error``."""

    id: str
    choices: list[Ended] = field(default_factory=list)
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class Step:
    """After each decode step: the cells held (``kv``), the cancels handled since the last
    event (``acks``), the prompt tokens each feeding job has in the cache (``f``), the text let
    out and the jobs done; every so often the rates (as :class:`Ready`'s)."""

    kv: int
    acks: int
    f: dict[str, int]
    out: list[Out]
    done: list[Done]
    rates: tuple[float, float, float] | None = None
    ev: str = field(default="step", init=False)


@dataclass(slots=True)
class Embedded:
    """The answer to an :class:`Embed`: a vector a text, or an ``error``."""

    id: str
    vectors: list[list[float]] | None = None
    error: str | None = None
    ev: str = field(default="embedded", init=False)


Event = Ready | Refused | Step | Embedded

_REQUESTS: dict[str, type[Request]] = {
    "run": Run,
    "cancel": Cancel,
    "suspend": Suspend,
    "resume": Resume,
    "embed": Embed,
    "waiting": Waiting,
    "offered": Offered,
}


# The codec -------------------------------------------------------------------------------------


def encode(message: Request | Event) -> bytes:
    """A message as its line (orjson writes a dataclass's fields as an object)."""
    return orjson.dumps(message) + b"\n"


def decode_request(line: bytes) -> Request:
    """A request line, as the worker reads it."""
    fields = _object(line)
    kind = _REQUESTS.get(fields.pop("op", None))
    if kind is None:
        raise MessageInvalid(f"no request: {line[:80]!r}")
    request: Request = _made(kind, fields, line)
    return request


def decode_event(line: bytes) -> Event:
    """An event line, as the daemon reads it."""
    fields = _object(line)
    ev = fields.pop("ev", None)
    if ev == "step":
        try:
            fields["out"] = [Out(**out) for out in fields["out"]]
            fields["done"] = [_done(done) for done in fields["done"]]
        except (KeyError, TypeError) as exc:
            raise MessageInvalid(f"a step event that is not one ({exc}): {line[:80]!r}") from None
        step: Step = _made(Step, fields, line)
        return step
    kind = {"ready": Ready, "refused": Refused, "embedded": Embedded}.get(ev)
    if kind is None:
        raise MessageInvalid(f"no event: {line[:80]!r}")
    event: Event = _made(kind, fields, line)
    return event


def _done(fields: dict[str, Any]) -> Done:
    choices = [Ended(**ended) for ended in fields.pop("choices", ())]
    return Done(choices=choices, **fields)


def _object(line: bytes) -> dict[str, Any]:
    try:
        fields = orjson.loads(line)
    except orjson.JSONDecodeError:
        raise MessageInvalid(f"not JSON: {line[:80]!r}") from None
    if type(fields) is not dict:
        raise MessageInvalid(f"not an object: {line[:80]!r}")
    return fields


def _made(kind: type[Any], fields: dict[str, Any], line: bytes) -> Any:
    if fields.get("rates") is not None:
        fields["rates"] = tuple(fields["rates"])
    try:
        return kind(**fields)
    except TypeError as exc:  # a field missing or unknown
        raise MessageInvalid(f"{kind.__name__}: {exc}: {line[:80]!r}") from None
