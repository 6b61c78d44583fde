"""The sidecar's continuation of a paused answer (``governor.runners.sidecar.continuation``), pure.

Against a model of llama-server's ``/completion`` stream: each generated token's event carries
its id and the text released with it; a token whose text is held back (a possible stop string)
releases nothing until a later one releases the run; a token that ends within a character sends
no event at all, and the next one's event carries the text of both and its own id alone. For
any answer and any pauses, the client gets the unpaused text exactly once, and each resume asks
for the prompt and the kept tokens with ``n_predict`` less what was kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.runners.sidecar.continuation import (
    CHAT_PATH,
    COMPLETION_PATH,
    Ask,
    Continuation,
    OpenAiShape,
    Pace,
    Upstream,
    ask_of_body,
    upstream_of,
)
from governor.runners.sidecar.prompts import UpstreamPrompts
from governor.runners.sidecar.runner import HttpRunner, HttpSettings
from protocol.spec import JobSpec, Message

PROMPT = [1, 2, 3]
NATIVE = Upstream(model="m", fingerprint="b1", n_ctx=2048, slots=2)


@dataclass(frozen=True)
class Tok:
    id: int
    text: str
    held: bool = False  # its text waits for a later token's event
    silent: bool = False  # no event of its own (a character not yet whole)


tokens = st.lists(
    st.builds(
        Tok,
        id=st.integers(10, 99),
        text=st.text("abcxyz ", min_size=0, max_size=3),
        held=st.booleans(),
        silent=st.sampled_from([False, False, False, True]),
    ),
    min_size=1,
    max_size=30,
)


def events(answer: list[Tok], start: int, limit: int) -> list[dict[str, Any]]:
    """llama-server's events for an attempt that generates ``answer[start:]`` (at most
    ``limit`` tokens), each partial one token's, then the last."""
    out: list[dict[str, Any]] = []
    pending = ""
    count = 0
    for tok in answer[start : start + limit]:
        count += 1
        pending += tok.text
        if tok.silent:
            continue
        release = not tok.held
        out.append(
            {
                "content": pending if release else "",
                "tokens": [tok.id],
                "stop": False,
                "tokens_predicted": count,
                "tokens_evaluated": len(PROMPT) + start,
            }
        )
        if release:
            pending = ""
    # (the end releases what is held; a real stop would have cut it: its text is the model's)
    last: dict[str, Any] = {
        "content": pending,
        "tokens": [],
        "stop": True,
        "stop_type": "limit" if start + count >= len(answer) else "eos",
        "tokens_predicted": count,
        "tokens_evaluated": len(PROMPT) + start,
        "timings": {"prompt_n": 1 if start else len(PROMPT)},
    }
    out.append(last)
    return out


@given(answer=tokens, pauses=st.lists(st.integers(0, 40), max_size=4))
def test_any_pauses_give_the_unpaused_text_once(answer: list[Tok], pauses: list[int]) -> None:
    ask = ask_of_body({"prompt": "p", "temperature": 0}, COMPLETION_PATH, shaped=False)
    assert ask is not None
    continuation = Continuation(ask, len(answer))
    passed: list[str] = []
    pauses = sorted(pauses)
    attempt = 0
    while True:
        body = continuation.body(None)
        if attempt == 0:
            assert body["prompt"] == "p"
        else:
            kept = continuation.kept
            assert body["prompt"] == PROMPT + [t.id for t in answer[:kept]]
            assert body["n_predict"] == len(answer) - kept
        start = continuation.kept
        stream = events(answer, start, body["n_predict"])
        cut = pauses[attempt] if attempt < len(pauses) else None
        for i, event in enumerate(stream):
            if cut is not None and i == cut:
                break
            text = continuation.feed(event)
            if text is not None:
                passed.append(text)
        if continuation.finish is not None:
            break
        continuation.prompt = PROMPT  # (what /tokenize gave at the pause)
        continuation.paused()
        attempt += 1
        if continuation.remaining <= 0:
            break
    assert "".join(passed) == "".join(t.text for t in answer)
    assert "".join(continuation.text) == "".join(passed)
    if continuation.finish is not None:
        assert continuation.completion_tokens == len(answer)
    assert continuation.prompt_tokens == len(PROMPT)
    assert len(continuation.resumes) == attempt


def test_a_resume_after_held_text_starts_at_the_last_token_passed_on() -> None:
    fields = {"prompt": "p", "temperature": 0, "stop": ["\n\n"]}
    ask = ask_of_body(fields, COMPLETION_PATH, shaped=False)
    assert ask is not None
    c = Continuation(ask, 10)
    c.body(None)
    assert c.feed({"content": "Hi", "tokens": [5], "tokens_predicted": 1}) == "Hi"
    assert c.feed({"content": "", "tokens": [6], "tokens_predicted": 2}) is None  # held: "\n"
    c.prompt = PROMPT
    c.paused()
    body = c.body(None)
    assert body["prompt"] == [*PROMPT, 5]  # not 6: its text never reached the client
    assert body["n_predict"] == 9
    assert body["stop"] == ["\n\n"]
    assert body["cache_prompt"] is True
    # The resume's first event: the prompt it computed (its cache held the rest).
    assert c.feed({"content": "", "tokens": [6], "timings": {"prompt_n": 2}}) is None
    assert c.resumes[0].recomputed == 2


def test_usage_counts_the_prompt_once_and_every_attempts_tokens() -> None:
    ask = ask_of_body(
        {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "stream": True},
        CHAT_PATH,
    )
    assert ask is not None
    c = Continuation(ask, 8)
    c.body("<template>")
    c.feed({"content": "a", "tokens": [7], "tokens_predicted": 1, "tokens_evaluated": 30})
    c.feed({"content": "b", "tokens": [8], "tokens_predicted": 2, "tokens_evaluated": 30})
    c.prompt = [0] * 30
    c.paused()
    c.body("<template>")
    c.feed({"content": "c", "tokens": [9], "tokens_predicted": 1, "tokens_evaluated": 32})
    c.feed({"content": "", "tokens": [], "stop": True, "stop_type": "eos", "tokens_predicted": 1})
    assert c.finish == "stop"
    assert c.usage() == {"completion_tokens": 3, "prompt_tokens": 30, "total_tokens": 33}


def test_the_chunks_are_llama_servers_with_one_id_over_every_attempt() -> None:
    ask = ask_of_body(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        CHAT_PATH,
    )
    assert ask is not None
    shape = ask.openai
    assert shape is not None
    shape.begin(NATIVE)
    role, piece = shape.role(), shape.piece("x")
    assert role is not None
    first, second = (orjson.loads(c[len(b"data: ") :]) for c in (role, piece))
    assert list(first) == ["choices", "created", "id", "model", "system_fingerprint", "object"]
    assert first["choices"][0] == {
        "finish_reason": None,
        "index": 0,
        "delta": {"role": "assistant", "content": None},
    }
    assert second["choices"][0]["delta"] == {"content": "x"}
    assert first["id"] == second["id"]
    assert first["id"].startswith("chatcmpl-")
    assert (first["model"], first["system_fingerprint"]) == ("m", "b1")
    c = Continuation(ask, 4)
    c.finish = "length"
    end = shape.end(c).split(b"\n\n")
    assert orjson.loads(end[0][6:])["choices"][0]["finish_reason"] == "length"
    assert "usage" in orjson.loads(end[1][6:])
    assert end[2] == b"data: [DONE]"


@pytest.mark.parametrize(
    ("fields", "path", "pausable"),
    [
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 0}, CHAT_PATH, True),
        ({"prompt": "hi", "max_tokens": 5, "stop": ["\n"]}, COMPLETION_PATH, True),
        ({"prompt": "hi", "temperature": 0.7}, COMPLETION_PATH, True),  # no seed: no stream
        ({"prompt": "hi", "temperature": 0.7, "seed": 3}, COMPLETION_PATH, False),
        ({"prompt": "hi", "temperature": 0, "seed": 3}, COMPLETION_PATH, True),  # greedy
        ({"prompt": "hi", "n": 2}, COMPLETION_PATH, False),
        ({"prompt": "hi", "logprobs": 2}, COMPLETION_PATH, False),
        ({"prompt": ["hi", "ho"]}, COMPLETION_PATH, False),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": []}, CHAT_PATH, False),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {}}, CHAT_PATH, False),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, CHAT_PATH, False),
        ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 1}, CHAT_PATH, False),
        ({"input": "x"}, "/v1/embeddings", False),
        ({"prompt": "hi", "temperature": "hot"}, COMPLETION_PATH, False),  # (upstream's 400)
        ({"prompt": "hi", "temperature": 0.5, "seed": [1]}, COMPLETION_PATH, False),
    ],
)
def test_which_forwarded_requests_can_be_paused(
    fields: dict[str, Any], path: str, pausable: bool
) -> None:
    assert (ask_of_body(fields, path) is not None) == pausable


def test_which_tcp_jobs_can_be_paused_in_front_of_llama_server() -> None:
    """The request the http runner sends for a TCP job, read the same way."""
    runner = HttpRunner(HttpSettings(upstream="http://127.0.0.1:1"))
    greedy = JobSpec(messages=(Message("user", "x"),), temperature=0)
    assert runner.prepare("j", greedy).plan is None  # (not llama-server: nothing paused)
    runner.native = NATIVE
    job = runner.prepare("j", greedy)
    assert isinstance(job.plan, Ask)
    assert job.plan.messages == ({"role": "user", "content": "x"},)
    assert job.plan.openai is None  # (its client takes tokens, not OpenAI's chunks)
    assert runner.pausable(job)
    assert runner.pausable(runner.prepare("j", JobSpec(prompt="x")))  # (unseeded)
    assert not runner.pausable(runner.prepare("j", JobSpec(prompt="x", temperature=0.5, seed=1)))


def test_only_llama_servers_props_are_read_as_one() -> None:
    props = {
        "default_generation_settings": {"n_ctx": 4096},
        "total_slots": 4,
        "model_alias": "m",
        "build_info": "b1",
    }
    assert upstream_of(props) == Upstream("m", "b1", 4096, 4)
    assert upstream_of({**props, "model_path": "/m.gguf"}) == Upstream(
        "m", "b1", 4096, 4, "/m.gguf"
    )
    assert upstream_of({"total_slots": 4}) is None
    assert upstream_of({"detail": "Not Found"}) is None
    assert upstream_of([]) is None


def test_prompts_are_not_counted_where_the_upstreams_model_cannot_be_read_here(
    tmp_path: Path,
) -> None:
    """(A sidecar on another host than its server: llama-server counts, and refuses.)"""
    assert UpstreamPrompts.load(Upstream("m", "b1", 4096, 4)) is None  # (no path said)
    assert UpstreamPrompts.load(Upstream("m", "b1", 4096, 4, str(tmp_path / "no.gguf"))) is None
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a model")
    assert UpstreamPrompts.load(Upstream("m", "b1", 4096, 4, str(garbage))) is None


def test_a_whole_answer_carries_its_text_and_usage() -> None:
    shape = OpenAiShape(chat=False, stream=False)
    shape.begin(NATIVE)
    ask = ask_of_body({"prompt": "p"}, COMPLETION_PATH)
    assert ask is not None
    c = Continuation(ask, 4)
    c.text, c.finish, c.prompt_tokens, c.attempt_generated = ["a", "b"], "stop", 2, 2
    answer = orjson.loads(shape.whole(c))
    assert list(answer) == [
        "choices",
        "created",
        "model",
        "system_fingerprint",
        "object",
        "usage",
        "id",
    ]
    assert answer["choices"][0] == {
        "text": "ab",
        "index": 0,
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert answer["usage"]["total_tokens"] == 4


def test_a_long_prompts_pieces_fit_the_tightest_chats_pace() -> None:
    pace = Pace()
    assert pace.piece() is None  # (no chat: the prompt at once)
    with pace.running(1, 100.0):  # (a heavy job is no chat)
        assert pace.piece() is None
    with pace.running(0, 100.0), pace.running(0, 40.0):
        assert pace.piece() == Pace.FIRST  # (the upstream's pace not known yet)
        pace.learn({"prompt_n": 8, "prompt_ms": 800.0})  # (too few to learn from)
        assert pace.token_s is None
        pace.learn({"prompt_n": 200, "prompt_ms": 200.0})  # 1 ms a token
        assert pace.piece() == 20  # half of the tightest objective, 40 ms, in tokens
        pace.learn({"prompt_n": 100, "prompt_ms": 1000.0})  # 10 ms, weighed in
        assert pace.token_s == pytest.approx(0.001 + Pace.WEIGHT * 0.009)
        assert pace.piece() == Pace.LEAST
    with pace.running(0, 0.0):  # (a chat without an objective sets no pace)
        assert pace.piece() is None
    with pace.running(0, 10_000.0):
        assert pace.piece() == Pace.MOST


def test_with_no_chat_running_a_pieces_wait_fits_a_share_of_a_chats_ttft_objective() -> None:
    """A chat that comes while a long prompt is computed waits for its step: with a chat's TTFT
    objective known, a piece is a share of it even when no chat runs (and a running chat's
    pace comes first)."""
    pace = Pace(ttft_s=1.0)
    assert pace.piece() == Pace.FIRST
    pace.learn({"prompt_n": 500, "prompt_ms": 1000.0})  # 2 ms a token
    assert pace.piece() == int(Pace.ARRIVAL_SHARE * 1.0 / 0.002)  # 125
    with pace.running(0, 100.0):
        assert pace.piece() == 25  # (half of 100 ms: the running chat's)
    assert Pace(ttft_s=0.0).piece() is None
