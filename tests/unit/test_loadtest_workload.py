"""The load tester's pure parts on known inputs: arrivals, classes, traces and their scaling,
synthesised prompts (counted by the embedded model's own tokenizer), and the report's numbers:
latencies, goodput against objectives, wasted work, plots and the HTML page."""

from __future__ import annotations

import itertools
import random
import statistics
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from governor.runners.llama.runner import embedded_model_path
from loadtest.support.driver import Run
from loadtest.support.render import write_outputs
from loadtest.support.report import Slo, parse_slo, stats, step
from loadtest.support.targets import ABORTED, DONE, TIMED_OUT, YIELDED, Outcome
from loadtest.support.workload import (
    DEFAULT_MIX,
    Request,
    Scaling,
    TraceRow,
    arrivals,
    load_trace,
    mixed,
    parse_class,
    parse_mix,
    replay,
    synth_prompt,
)
from protocol.spec import JobSpec

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"


# Arrivals and classes ----------------------------------------------------------------------


def test_poisson_arrivals_have_the_rate_and_exponential_gaps() -> None:
    times = arrivals("poisson", 4.0, 4000, random.Random(3))
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] == 0.0
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)
    # An exponential's standard deviation equals its mean (a constant process has none).
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.1)


def test_constant_and_burst_arrivals() -> None:
    assert arrivals("constant", 4.0, 4, random.Random()) == [0.0, 0.25, 0.5, 0.75]
    assert arrivals("burst", 0.0, 3, random.Random()) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="positive"):
        arrivals("poisson", 0.0, 3, random.Random())
    with pytest.raises(ValueError, match="unknown"):
        arrivals("uniform", 1.0, 3, random.Random())


def test_class_parsing_keeps_defaults_and_refuses_nonsense() -> None:
    heavy = parse_class("heavy:prompt=10..20")
    default_heavy = next(c for c in DEFAULT_MIX if c.name == "heavy")
    assert heavy.prompt == (10, 20)
    assert heavy.output == default_heavy.output
    assert parse_class("chat:share=2,output=5").output == (5, 5)
    for bad, why in (
        ("heavy:prompt=20..10", "MIN..MAX"),
        ("heavy:prompt=0..3", "MIN..MAX"),
        ("heavy:colour=red", "expected share="),
        (":share=1", "needs a name"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_class(bad)
    with pytest.raises(ValueError, match="share 0"):
        parse_mix([f"{c.name}:share=0" for c in DEFAULT_MIX])
    assert [c.name for c in parse_mix(["background:share=0"])] == ["interactive", "heavy"]


def test_mixed_draws_classes_by_share_and_lengths_in_range() -> None:
    mix = parse_mix(
        ["interactive:share=3,prompt=5..9,output=2", "heavy:share=1", "background:share=0"]
    )
    requests = mixed([0.0] * 4000, mix, random.Random(5))
    interactive = [r for r in requests if r.cls == "interactive"]
    assert len(interactive) / len(requests) == pytest.approx(0.75, abs=0.03)
    assert {r.prompt_tokens for r in interactive} == {5, 6, 7, 8, 9}
    assert {r.output_tokens for r in interactive} == {2}


@pytest.mark.parametrize("tokens", [3, 40, 700])
def test_synthesised_prompts_have_their_length_in_real_tokens(tokens: int) -> None:
    from llama_cpp import Llama

    vocab = Llama(str(embedded_model_path()), vocab_only=True, verbose=False)
    prompt = synth_prompt(tokens, "r17")
    counted = len(vocab.tokenize(prompt.encode(), add_bos=False))
    assert abs(counted - tokens) <= 3  # the tag "r17:" may take a few tokens
    # The governor's estimate for runners without a tokenizer agrees too.
    assert abs(JobSpec(prompt=prompt).estimated_prompt_tokens() - tokens) <= 3
    assert synth_prompt(tokens, "r18") != prompt  # no shared cached prefix between requests


# Traces ------------------------------------------------------------------------------------


def test_load_the_azure_trace() -> None:
    rows = load_trace(TRACES / "AzureLLMInferenceTrace_conv.csv")
    assert len(rows) == 19_366
    assert rows[0] == TraceRow(0.0, 374, 44)
    assert rows[1].at_s == pytest.approx(4.3145788, abs=1e-6)  # 18:15:50.9951690 - 46.6805900
    assert rows[-1].at_s == pytest.approx(58.4 * 60, rel=0.01)


def test_load_the_mooncake_trace() -> None:
    rows = load_trace(TRACES / "synthetic_trace.jsonl")
    assert len(rows) == 3993
    assert rows[0].at_s == 0.0
    assert (rows[2].at_s, rows[2].prompt_tokens, rows[2].output_tokens) == (0.04, 23769, 3)


def test_a_bad_trace_line_is_named(tmp_path: Path) -> None:
    csv = tmp_path / "t.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,3,4\nx,y,z\n")
    with pytest.raises(ValueError, match=r"t.csv:3"):
        load_trace(csv)
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1}\n{"timestamp": 5}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2"):
        load_trace(jsonl)
    empty = tmp_path / "e.csv"
    empty.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(ValueError, match="no rows"):
        load_trace(empty)


def test_replay_scales_caps_and_bounds() -> None:
    rows = [TraceRow(t, p, o) for t, p, o in [(0, 100, 10), (1, 3000, 900), (2, 7, 1), (9, 5, 5)]]
    scaled = replay(
        rows,
        Scaling(
            start_s=1,
            time_scale=2,
            token_scale=0.5,
            max_prompt_tokens=1000,
            max_output_tokens=300,
            max_duration_s=10,
        ),
    )
    assert scaled == [Request(0.0, "trace", 1000, 300), Request(2.0, "trace", 4, 1)]  # 9 s: 16 s
    assert len(replay(rows, Scaling(max_requests=2, max_duration_s=100))) == 2


def test_replay_from_a_start_in_a_gap_begins_at_the_next_request() -> None:
    rows = [TraceRow(t, 10, 10) for t in (0, 1, 100, 101.5, 103)]
    scaled = replay(rows, Scaling(start_s=50, time_scale=2, max_duration_s=4))
    # 100 s is t=0; 103 s is 6 s of scaled time, past max_duration_s.
    assert scaled == [Request(0.0, "trace", 10, 10), Request(3.0, "trace", 10, 10)]
    assert replay(rows, Scaling(start_s=100)) == replay(rows, Scaling(start_s=1.5))
    assert replay(rows, Scaling(start_s=104)) == []  # past the last request: nothing


# The report's numbers ----------------------------------------------------------------------


def _done(cls: str, sent: float, first: float, end: float, tokens: int, **kw: object) -> Outcome:
    o = Outcome(Request(sent, cls, 10, tokens), sent, status=DONE, end_s=end, tokens=tokens)
    o.first_token_s = first
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def test_ttft_tpot_e2e_of_one_outcome() -> None:
    o = _done("a", 1.0, 1.2, 2.2, 11)
    assert o.ttft_ms == pytest.approx(200)
    assert o.tpot_ms == pytest.approx(100)  # 1 s over the 10 tokens after the first
    assert o.e2e_ms == pytest.approx(1200)
    late = Outcome(Request(0, "a", 1, 1), 0.0)  # never answered: timed out
    assert (late.status, late.ttft_ms, late.tpot_ms, late.e2e_ms) == (TIMED_OUT, None, None, None)


def test_goodput_counts_requests_meeting_every_objective() -> None:
    outcomes = [
        _done("chat", 0.0, 0.1, 0.2, 2),  # ttft 100, tpot 100: good
        _done("chat", 0.0, 0.6, 0.7, 2),  # ttft 600: late
        _done("chat", 0.0, 0.1, 0.6, 2),  # tpot 500: slow
        _done("bulk", 0.0, 0.9, 1.0, 2),  # ttft 900: within bulk's own objective
        Outcome(Request(0, "chat", 1, 1), 0.0, status=YIELDED, reason="server_busy", attempts=3),
        Outcome(Request(0, "chat", 1, 1), 0.0, status=ABORTED, reason="backend_error", tokens=4),
    ]
    slo = Slo()
    parse_slo("ttft_ms", ["500", "bulk=1000"], slo)
    parse_slo("tpot_ms", ["200"], slo)
    s = stats(outcomes, duration_s=2.0, slo=slo)
    assert s["offered"] == 6
    assert (s["done"], s["yielded"], s["aborted"], s["timed_out"], s["error"]) == (4, 1, 1, 0, 0)
    assert s["good"] == 2
    assert s["goodput_rps"] == 1.0
    assert s["throughput_rps"] == 2.0
    assert s["tokens"] == 12
    assert s["wasted_tokens"] == 8  # the late, the slow and the aborted one's
    assert s["retries"] == 2
    assert s["yielded_by"] == {"server_busy": 1}
    assert s["ttft_ms"] == {"n": 4, "p50": 100.0, "p90": 900.0, "p99": 900.0, "max": 900.0}
    with pytest.raises(ValueError, match="positive"):
        parse_slo("ttft_ms", ["-3"], Slo())


def test_a_step_report_renders_to_png_and_html(tmp_path: Path) -> None:
    outcomes = [
        _done(cls, i / 10, i / 10 + 0.05 * (i + 1), i / 10 + 1, 5)
        for i, cls in enumerate(["interactive", "heavy"] * 5)
    ]
    outcomes[0].yields.append((0.01, "server_busy", 0.5))
    run = Run(outcomes=outcomes, duration_s=2.0, outstanding=[(0.0, 0), (0.5, 3), (1.9, 0)])
    one = step(run, Slo(), label="s")
    assert set(one["classes"]) == {"interactive", "heavy"}
    assert one["timeline"]["yields_s"] == [0.01]
    report: dict[str, Any] = {
        "command": "mix",
        "target": "governor",
        "addr": "x",
        "date": "d",
        "machine": "m",
        "settings": {},
        "slo": Slo().as_dict(),
        "steps": [one],
    }
    write_outputs(tmp_path, "report.json", report, [("run", report)], plots=True, title="t")

    sources: list[str] = []

    class Images(HTMLParser):
        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            if tag == "img":
                sources.append(dict(attrs)["src"] or "")

    Images().feed((tmp_path / "report.html").read_text())
    assert len(sources) == 3
    assert all(src.startswith("data:image/png;base64,iVBOR") for src in sources)
    for name in ("latency_cdf.png", "timeline.png", "goodput.png"):
        assert (tmp_path / name).stat().st_size > 5000
