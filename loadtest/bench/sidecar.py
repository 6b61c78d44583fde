"""``sidecar``: the governor as a sidecar is transparent. Each of OpenAI's request features is
asked of the upstream server directly and through the governor in front of it (``governor
serve --runner http --http-listen``), with the official SDK (``max_retries=0``), and each
answer is judged the same way: the table says what kind of answer each side gave. Then what
the sidecar adds to a streamed chat's wall time below the cap: ``--rounds`` chats, one at a
time, alternating direct and through the sidecar (greedy, so both generate the same tokens).

The upstream is llama.cpp's ``llama-server --jinja -np SLOTS`` on the embedded model
(``deploy/build-llama-server.sh`` builds it), with a second one started with ``--embeddings``
for the embeddings row; or ``--baseline llama-cpp-python``, llama-cpp-python's server. Every
server is started here on a free loopback port and stopped by its own PID.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # ships no type information
import openai
import orjson

from governor.runners.llama.runner import embedded_model_path

from ..support import baseline_server, llama_server
from ..support.arguments import add_llama_server, add_threads
from ..support.options import positive_int, print_json
from ..support.processes import free_port, stop, wait_http_ready

NAME = "sidecar"
CHAT = [{"role": "user", "content": "What is the weather like in Oslo today?"}]
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


class Wrong(Exception):
    """An answer that is not the kind its row asks for; the message says what it was."""


def _chat(client: openai.OpenAI, **fields: Any) -> Any:
    fields = {"messages": CHAT, "max_tokens": 160, "temperature": 0, "seed": 1, **fields}
    return client.chat.completions.create(model="m", **fields)


def json_object(client: openai.OpenAI) -> str:
    asked = [{"role": "user", "content": "The Eiffel tower's city and country, as JSON."}]
    fmt = {"type": "json_object"}
    content = _chat(client, messages=asked, response_format=fmt).choices[0].message.content
    if type(orjson.loads(content or "")) is not dict:
        raise Wrong("JSON, not an object")
    return "a JSON object"


def json_schema(client: openai.OpenAI) -> str:
    asked = [{"role": "user", "content": "Invent a person: a name and an age."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    content = _chat(client, messages=asked, response_format=fmt).choices[0].message.content
    jsonschema.validate(orjson.loads(content or ""), PERSON)
    return "JSON valid against the schema"


def logprobs(client: openai.OpenAI) -> str:
    choice = _chat(client, logprobs=True, top_logprobs=2).choices[0]
    entries = choice.logprobs.content if choice.logprobs else None
    if not entries:
        raise Wrong("no logprobs")
    if any(len(e.top_logprobs) != 2 for e in entries):
        raise Wrong("not 2 top_logprobs a token")
    return f"logprobs, {len(entries)} tokens with 2 alternatives each"


def named_tool(client: openai.OpenAI) -> str:
    calls = _chat(client, tools=[WEATHER], tool_choice=NAMED).choices[0].message.tool_calls
    if not calls or calls[0].function.name != "get_weather":
        raise Wrong(f"no call of get_weather: {calls!r}"[:200])
    return f"tool_calls: get_weather({calls[0].function.arguments})"


def named_tool_streamed(client: openai.OpenAI) -> str:
    stream = _chat(client, tools=[WEATHER], tool_choice=NAMED, stream=True)
    names, arguments = set(), ""
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                if call.function is not None:
                    names.add(call.function.name)
                    arguments += call.function.arguments or ""
    if "get_weather" not in names:
        raise Wrong("no streamed call of get_weather")
    orjson.loads(arguments)
    return "tool_calls deltas: get_weather, arguments parse"


def auto_tools(client: openai.OpenAI) -> str:
    message = _chat(client, tools=[WEATHER]).choices[0].message
    return "a tool call" if message.tool_calls else "text"


def penalties(client: openai.OpenAI) -> str:
    choice = _chat(client, frequency_penalty=0.5, presence_penalty=0.5).choices[0]
    return f"answered ({choice.finish_reason})"


def two_choices(client: openai.OpenAI) -> str:
    answer = _chat(client, n=2, temperature=1.0)
    if len(answer.choices) != 2:
        raise Wrong(f"{len(answer.choices)} choices")
    return "2 choices"


def embeddings(client: openai.OpenAI) -> str:
    data = client.embeddings.create(model="m", input=["one", "two"]).data
    return f"{len(data)} embeddings of dimension {len(data[0].embedding)}"


def models(client: openai.OpenAI) -> str:
    return f"models: {[m.id for m in client.models.list().data]}"


ROWS: dict[str, Callable[[openai.OpenAI], str]] = {
    "response_format json_object": json_object,
    "response_format json_schema": json_schema,
    "logprobs, top_logprobs 2": logprobs,
    "tools, tool_choice named": named_tool,
    "tools, tool_choice named, streamed": named_tool_streamed,
    "tools, tool_choice auto": auto_tools,
    "frequency/presence_penalty 0.5": penalties,
    "n 2": two_choices,
    "/v1/embeddings": embeddings,
    "/v1/models": models,
}


def answer(row: str, url: str) -> str:
    """The kind of answer ``row`` gets from the server at ``url``: what it was, or the error
    (its status and message)."""
    try:
        with client(url) as sdk:
            return ROWS[row](sdk)
    except openai.APIStatusError as exc:
        return f"{exc.status_code}: {exc.message}"[:160]
    except (Wrong, jsonschema.ValidationError, orjson.JSONDecodeError) as exc:
        return f"wrong: {exc}"[:160]


def same_kind(direct: str, sidecar: str) -> bool:
    """Whether two answers are of one kind: both of the row's kind (generated text may differ
    in its details: a tool call's arguments, say) or the same error status."""
    return direct.split(":")[0].split("(")[0] == sidecar.split(":")[0].split("(")[0]


# The servers -----------------------------------------------------------------------------


@dataclass
class Servers:
    """Each upstream's URL, and the governor's in front of it: the generating server's and,
    for llama-server (started with ``--embeddings`` it serves nothing else), a second pair for
    embeddings."""

    direct: str
    sidecar: str
    embed_direct: str
    embed_sidecar: str


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


class Started:
    """Servers started here, each stopped by its own PID at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def server(self, command: list[str], ready: str, what: str) -> None:
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.procs.append(proc)
        wait_http_ready(proc, ready, what, 180)

    def llama_server(self, binary: Path, slots: int, threads: int, *more: str) -> str:
        port = free_port()
        model = embedded_model_path()
        base = llama_server.command(
            binary, model, port=port, slots=slots, ctx=slots * 2048, threads=threads
        )
        url = f"http://127.0.0.1:{port}"
        self.server([*base, "--jinja", *more], url + "/health", "llama-server")
        return url

    def governor(self, upstream: str, slots: int) -> str:
        """A sidecar in front of ``upstream``; its front door's URL."""
        return self.daemon("--runner", "http", "--upstream", upstream, "--max-inflight", str(slots))

    def daemon(self, *flags: str) -> str:
        """``governor serve FLAGS`` with its front door; the front door's URL, once ready."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = [
            *(sys.executable, "-m", "governor", "serve", *flags, "--log-level", "warning"),
            *("--listen", f"127.0.0.1:{free_port()}", "--http-listen", f"127.0.0.1:{port}"),
        ]
        self.server(command, url + "/health", "governor")
        return url

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)


@contextlib.contextmanager
def servers(baseline: str, slots: int, threads: int, binary: Path) -> Iterator[Servers]:
    """The upstreams and the governors in front of them (``--max-inflight`` their slots)."""
    started = Started()
    try:
        if baseline == "llama-server":
            direct = started.llama_server(binary, slots, threads)
            embed = started.llama_server(binary, 1, 1, "--embeddings", "--pooling", "mean")
        else:
            proc, direct = baseline_server.start(
                embedded_model_path(), free_port(), threads=threads, n_ctx=2048
            )
            started.procs.append(proc)
            embed = direct
        sidecar = started.governor(direct, slots)
        embed_sidecar = sidecar if embed == direct else started.governor(embed, 1)
        yield Servers(direct, sidecar, embed, embed_sidecar)
    finally:
        started.stop()


def table(found: Servers, rows: list[str] | None = None) -> list[dict[str, Any]]:
    """Each row's answers, directly and through the sidecar (``rows``: these only)."""
    out = []
    for row in ROWS if rows is None else rows:
        pair = (found.direct, found.sidecar)
        if row == "/v1/embeddings":
            pair = (found.embed_direct, found.embed_sidecar)
        a, b = (answer(row, url) for url in pair)
        out.append({"row": row, "direct": a, "sidecar": b, "same": same_kind(a, b)})
    return out


def streamed_chat_s(url: str, tokens: int) -> float:
    with client(url) as sdk:
        started = time.perf_counter()
        for _ in _chat(sdk, max_tokens=tokens, stream=True):
            pass
        return time.perf_counter() - started


def overhead(found: Servers, rounds: int, tokens: int) -> dict[str, Any]:
    """Streamed chats one at a time (below the cap), alternating direct and sidecar."""
    streamed_chat_s(found.direct, tokens)  # (warm both: the first prompt's cache, connections)
    streamed_chat_s(found.sidecar, tokens)
    walls: dict[str, list[float]] = {"direct": [], "sidecar": []}
    for i in range(rounds):
        for side in ("direct", "sidecar") if i % 2 == 0 else ("sidecar", "direct"):
            walls[side].append(streamed_chat_s(getattr(found, side), tokens))
    median = {side: statistics.median(w) for side, w in walls.items()}
    # Each round's pair ran back to back: their ratio leaves out the machine's drift.
    pairs = sorted(s / d for s, d in zip(walls["sidecar"], walls["direct"], strict=True))
    return {
        "rounds": rounds,
        "max_tokens": tokens,
        "median_s": {k: round(v, 4) for k, v in median.items()},
        "sidecar_over_direct": round(median["sidecar"] / median["direct"], 4),
        "pair_ratio_median": round(statistics.median(pairs), 4),
        "pair_ratio_quartiles": [round(q, 4) for q in statistics.quantiles(pairs, n=4)[::2]],
    }


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME,
        help="OpenAI's features directly and through the sidecar, and its overhead",
        description=__doc__,
    )
    parser.add_argument(
        "--baseline",
        choices=("llama-server", "llama-cpp-python"),
        default="llama-server",
        help="the upstream",
    )
    add_llama_server(parser, text="its binary")
    parser.add_argument(
        "--slots",
        type=positive_int,
        default=2,
        help="the upstream's, and the governor's max-inflight",
    )
    add_threads(parser, default=2, text="the upstream's")
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=30,
        help="streamed chats on each side, alternating",
    )
    parser.add_argument("--max-tokens", type=positive_int, default=64, help="of each streamed chat")


def run(args: argparse.Namespace) -> int:
    if args.baseline == "llama-server" and not args.llama_server.exists():
        print(
            f"loadtest bench sidecar: no {args.llama_server}: run {llama_server.BUILD_SCRIPT}",
            file=sys.stderr,
        )
        return 2
    with servers(args.baseline, args.slots, args.threads, args.llama_server) as found:
        rows = table(found)
        for row in rows:
            mark = "same" if row["same"] else "DIFFERENT"
            print(
                f"{row['row']:36} {mark:9} direct: {row['direct']} | sidecar: {row['sidecar']}",
                flush=True,
            )
        cost = overhead(found, args.rounds, args.max_tokens)
    print(
        f"streamed chat, {cost['rounds']} rounds of {cost['max_tokens']} tokens: median "
        f"{cost['median_s']['direct']:.3f} s direct, {cost['median_s']['sidecar']:.3f} s through "
        f"the sidecar (x{cost['sidecar_over_direct']:.3f}; round by round x"
        f"{cost['pair_ratio_median']:.3f}, quartiles {cost['pair_ratio_quartiles']})"
    )
    print_json(args, {"command": NAME, "baseline": args.baseline, "rows": rows, "overhead": cost})
    return 0 if all(r["same"] for r in rows) else 1
