"""What a load test sends, and when: requests with a class, token counts and an arrival time.

Pure functions, no IO but :func:`load_trace`'s read. A workload is a list of :class:`Request`,
sorted by ``at_s`` (seconds from the start):

* :func:`arrivals`: Poisson, constant or burst arrival times at a rate, for ``rate`` and ``mix``;
* :class:`ClassSpec` and :func:`parse_mix`: the request classes of ``mix`` (interactive, heavy,
  background), each with its share and prompt and output length ranges;
* :func:`load_trace` and :func:`replay`: a trace file's rows, scaled in time and tokens;
* :func:`synth_prompt`: a prompt of a given length in tokens.
"""

from __future__ import annotations

import csv
import datetime
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

ARRIVALS = ("poisson", "constant", "burst")

# Three-letter words, each one token (with its leading space) for SmolLM2's tokenizer and for
# GPT-style BPE vocabularies, and four characters: the governor's estimate for a runner without
# a tokenizer (4 characters a token) agrees with the real count.
_WORDS = [
    "the",
    "and",
    "for",
    "you",
    "are",
    "was",
    "not",
    "but",
    "all",
    "any",
    "can",
    "had",
    "her",
    "one",
    "our",
    "out",
    "day",
    "get",
    "has",
    "him",
    "his",
    "how",
    "man",
    "new",
    "now",
    "old",
    "see",
    "two",
    "way",
    "who",
    "boy",
    "did",
    "its",
    "let",
    "put",
    "say",
    "she",
    "too",
    "use",
]


@dataclass(frozen=True, slots=True)
class Request:
    at_s: float  # arrival, seconds from the start (0 for every request of a closed loop)
    cls: str  # the request's class: a lane name for mix, "default" otherwise
    prompt_tokens: int
    output_tokens: int  # max_new_tokens asked for


def synth_prompt(tokens: int, tag: str) -> str:
    """About ``tokens`` tokens of text, beginning with ``tag`` and different for each tag.

    The tag (a request id) comes first so that no two requests share a cached prompt prefix:
    a runner reusing its KV cache would otherwise skip the prefill a real prompt costs.
    """
    rng = random.Random(tag)
    words = [rng.choice(_WORDS) for _ in range(max(tokens - 2, 0))]
    return " ".join([f"{tag}:", *words])


# Arrivals ------------------------------------------------------------------------------


def arrivals(process: str, rate: float, count: int, rng: random.Random) -> list[float]:
    """``count`` arrival times (seconds) at ``rate`` per second.

    ``poisson``: exponential gaps (an open loop's textbook arrivals); ``constant``: one every
    ``1 / rate``; ``burst``: all at 0.
    """
    if process == "burst":
        return [0.0] * count
    if not rate > 0:
        raise ValueError(f"rate must be positive, not {rate}")
    if process == "constant":
        return [i / rate for i in range(count)]
    if process == "poisson":
        t, times = 0.0, []
        for _ in range(count):
            times.append(t)
            t += rng.expovariate(rate)
        return times
    raise ValueError(f"unknown arrival process {process!r}")


# Classes -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClassSpec:
    """A request class: its share of arrivals and uniform prompt and output length ranges."""

    name: str
    share: float
    prompt: tuple[int, int]
    output: tuple[int, int]

    def draw(self, at_s: float, rng: random.Random) -> Request:
        return Request(at_s, self.name, rng.randint(*self.prompt), rng.randint(*self.output))


# Shaped after the governor's lanes: short chats, long-context work, and bulk jobs that can wait.
DEFAULT_MIX = (
    ClassSpec("interactive", 0.6, (20, 120), (16, 48)),
    ClassSpec("heavy", 0.25, (600, 1200), (64, 128)),
    ClassSpec("background", 0.15, (200, 400), (128, 256)),
)


def parse_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition("..")
    lo, hi = int(low), int(high if sep else low)
    if not 1 <= lo <= hi:
        raise ValueError(f"{text!r} is not a range MIN..MAX of positive integers")
    return lo, hi


def parse_class(text: str) -> ClassSpec:
    """``NAME:share=S,prompt=MIN..MAX,output=MIN..MAX``; omitted fields keep the default
    class of that name's (or ``interactive``'s for a new name)."""
    name, _, fields = text.partition(":")
    base = next((c for c in DEFAULT_MIX if c.name == name), DEFAULT_MIX[0])
    values = {"share": base.share, "prompt": base.prompt, "output": base.output}
    for item in filter(None, fields.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in values:
            raise ValueError(f"{item!r}: expected share=, prompt= or output=")
        values[key] = float(value) if key == "share" else parse_range(value)
    share = float(values["share"])  # type: ignore[arg-type]
    if not name or not share >= 0:
        raise ValueError(f"{text!r}: a class needs a name and a share >= 0")
    return ClassSpec(name, share, values["prompt"], values["output"])  # type: ignore[arg-type]


def parse_mix(classes: Sequence[str]) -> tuple[ClassSpec, ...]:
    """The classes given on the command line, replacing defaults of the same name."""
    mix = {c.name: c for c in DEFAULT_MIX}
    for text in classes:
        spec = parse_class(text)
        mix[spec.name] = spec
    chosen = tuple(c for c in mix.values() if c.share > 0)
    if not chosen:
        raise ValueError("every class has share 0")
    return chosen


def mixed(times: Iterable[float], mix: Sequence[ClassSpec], rng: random.Random) -> list[Request]:
    """One request per arrival time, its class drawn by share."""
    weights = [c.share for c in mix]
    return [rng.choices(mix, weights)[0].draw(t, rng) for t in times]


# Traces --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceRow:
    at_s: float  # from the trace's first row
    prompt_tokens: int
    output_tokens: int


def _csv_time(text: str) -> float:
    # Azure's stamps carry 7 fractional digits; fromisoformat takes at most 6.
    head, _, frac = text.strip().partition(".")
    stamp = datetime.datetime.fromisoformat(head)
    return stamp.timestamp() + (float(f"0.{frac}") if frac else 0.0)


def load_trace(path: Path) -> list[TraceRow]:
    """A trace file's rows, sorted by arrival, times from the first row.

    CSV with a header ``TIMESTAMP,ContextTokens,GeneratedTokens`` (Azure's wall-clock stamps),
    or JSONL with ``timestamp`` (milliseconds), ``input_length`` and ``output_length`` (Mooncake).
    Raises :class:`ValueError` naming the line that cannot be read.
    """
    rows: list[tuple[float, int, int]] = []
    with path.open(encoding="utf-8", newline="") as f:
        first = f.readline()
        f.seek(0)
        if first.lstrip().startswith("{"):
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = orjson.loads(line)
                    rows.append(
                        (
                            obj["timestamp"] / 1000,
                            int(obj["input_length"]),
                            int(obj["output_length"]),
                        )
                    )
                except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                    raise ValueError(f"{path}:{number}: not a trace row ({exc})") from None
        else:
            reader = csv.DictReader(f)
            for number, record in enumerate(reader, 2):
                try:
                    rows.append(
                        (
                            _csv_time(record["TIMESTAMP"]),
                            int(record["ContextTokens"]),
                            int(record["GeneratedTokens"]),
                        )
                    )
                except (KeyError, TypeError, ValueError) as exc:
                    raise ValueError(f"{path}:{number}: not a trace row ({exc})") from None
    if not rows:
        raise ValueError(f"{path}: no rows")
    rows.sort()
    t0 = rows[0][0]
    return [TraceRow(t - t0, p, o) for t, p, o in rows]


@dataclass(frozen=True, slots=True, kw_only=True)
class Scaling:
    """How a trace is fitted to a small model and machine; every field is reported with the run."""

    start_s: float = 0.0  # skip the trace's first seconds: its first request from then is t=0
    time_scale: float = 1.0  # arrival gaps are multiplied by this (2: half the rate)
    token_scale: float = 1.0  # prompt and output lengths are multiplied by this
    max_prompt_tokens: int = 1024
    max_output_tokens: int = 256
    max_duration_s: float = 60.0  # of replayed (scaled) time
    max_requests: int = 1000


def replay(rows: Sequence[TraceRow], scaling: Scaling) -> list[Request]:
    """The trace's requests from ``start_s`` on, scaled and capped, as one class ``trace``.

    Time starts at the first request at or after ``start_s``, not at ``start_s`` itself: a
    start in a gap of the trace would otherwise open with that gap's rest of silence, and
    replay nothing if the gap is longer than ``max_duration_s``.
    """
    out: list[Request] = []
    origin: float | None = None
    for row in rows:
        if row.at_s < scaling.start_s:
            continue
        if origin is None:
            origin = row.at_s
        at_s = (row.at_s - origin) * scaling.time_scale
        if at_s > scaling.max_duration_s or len(out) >= scaling.max_requests:
            break
        prompt = min(
            max(math.ceil(row.prompt_tokens * scaling.token_scale), 1), scaling.max_prompt_tokens
        )
        output = min(
            max(math.ceil(row.output_tokens * scaling.token_scale), 1), scaling.max_output_tokens
        )
        out.append(Request(at_s, "trace", prompt, output))
    return out
