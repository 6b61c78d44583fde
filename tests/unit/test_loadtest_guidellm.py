"""``loadtest bench guidellm-bench``: guidellm's reports read into rows, the summary and the front door's
targets, and the command line each server and guidellm get, with no process started.

The reports are real ones (guidellm 0.8.1, 32 requests, 16 streams, 128 prompt and 64 output
tokens on the embedded model) trimmed to what the command reads: the governor's, from before
its front door waited for a slot (28 of 32 requests refused with 429), and llama-server's
(``-np 4``)."""

from __future__ import annotations

import argparse
import itertools
import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from loadtest.bench import guidellm_bench
from loadtest.bench.guidellm_bench import argv as command_lines
from loadtest.bench.guidellm_bench import rows
from loadtest.cli import build_parser
from loadtest.support import llama_server
from loadtest.support.stats import alternating

ROOT = Path(__file__).resolve().parents[2]
MODEL = Path("/models/SmolLM2-135M-Instruct.Q4_1.gguf")
# Each of the 28 refused requests recorded this (the port aside).
ERROR_429 = (
    "HTTPStatusError(\"Client error '429 Too Many Requests' for url "
    "'http://127.0.0.1:10932/v1/chat/completions'\\nFor more information check: "
    'https://developer.mozilla.org/en-US/docs/Web/HTTP/Status/429")'
)


def successful(count: int, p50: float, p99: float) -> dict[str, Any]:
    return {"successful": {"count": count, "percentiles": {"p50": p50, "p99": p99}}}


def report(
    *,
    duration: float,
    totals: tuple[int, int, int],
    tokens: float,
    tok_s: float,
    ttft: tuple[int, float, float],
    itl: tuple[int, float, float],
    tpot: tuple[int, float, float],
    latency: tuple[int, float, float],
    errors: list[str],
    served: list[tuple[float | None, float | None]] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    """A guidellm 0.8.1 JSON report, cut down to the fields the command reads."""
    ok, errored, incomplete = totals
    metrics = {
        "request_totals": {
            "successful": ok,
            "errored": errored,
            "incomplete": incomplete,
            "total": ok + errored + incomplete,
        },
        "output_token_count": {"successful": {"total_sum": tokens}},
        "output_tokens_per_second": {"successful": {"mean": tok_s}},
        "time_to_first_token_ms": successful(*ttft),
        "inter_token_latency_ms": successful(*itl),
        "time_per_output_token_ms": successful(*tpot),
        "request_latency": successful(*latency),  # (seconds)
    }
    requests = {
        "errored": [{"info": {"status": "errored", "error": e}} for e in errors],
        "successful": [
            {"time_to_first_token_ms": ttft_ms, "inter_token_latency_ms": itl_ms}
            for ttft_ms, itl_ms in served
        ],
    }
    return {
        "metadata": {"guidellm_version": "0.8.1"},
        "benchmarks": [{"duration": duration, "metrics": metrics, "requests": requests}],
    }


GOVERNOR = report(
    duration=5.6561195850372314,
    totals=(4, 28, 0),
    tokens=256.0,
    tok_s=45.26071207497549,
    ttft=(4, 1746.07253074646, 2734.6489429473877),
    itl=(252, 51.84927440824963, 63.36866484747993),
    tpot=(256, 85.17063036561012, 88.15044537186623),
    latency=(4, 5.451478958129883, 5.6420063972473145),
    errors=[ERROR_429] * 28,
    # Each successful request's TTFT and mean gap between tokens: within 2 s and 100 ms, one
    # whose TTFT is over, one whose gaps are, and one of a single token (no gap: within).
    served=[(1746.1, 51.8), (2734.6, 50.0), (1500.0, 120.0), (1200.0, None)],
)
LLAMA_SERVER = report(
    duration=31.671704292297363,
    totals=(32, 0, 0),
    tokens=2048.0,
    tok_s=64.66339736880148,
    ttft=(32, 10717.00406074524, 18400.489807128906),
    itl=(2016, 34.496769072517516, 90.08628224569654),
    tpot=(2048, 195.68686187267303, 318.18273663520813),
    latency=(32, 12.524614572525024, 20.36517333984375),
    errors=[],
)
# The end of guidellm's output when the governor had no GET /health on its API port.
HEALTH_404_LOG = """\
Traceback (most recent call last):
  File ".../guidellm/backends/openai/http.py", line 143, in validate
    response.raise_for_status()
httpx.HTTPStatusError: Client error '404 Not Found' for url 'http://127.0.0.1:11156/health'
For more information check: https://developer.mozilla.org/en-US/docs/Web/HTTP/Status/404

The above exception was the direct cause of the following exception:

    raise RuntimeError(
RuntimeError: Backend validation request failed. Could not connect to the server or validate the backend configuration.
"""


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "guidellm-bench", *argv])


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# Reading guidellm's report -----------------------------------------------------------------


def test_a_run_with_429s_reads_as_errored_by_status() -> None:
    row = rows.run_row("governor", GOVERNOR)
    assert row == {
        "server": "governor",
        "requests": 32,
        "successful": 4,
        "errored": 28,
        "incomplete": 0,
        "errored_by": {"HTTP 429": 28},
        "duration_s": 5.656,
        "good": 2,
        "goodput_rps": round(2 / 5.6561195850372314, 4),
        "output_tokens": 256,
        "output_tok_s": 45.3,
        "ttft_p50_ms": 1746.1,
        "ttft_p99_ms": 2734.6,
        "itl_p50_ms": 51.8,
        "itl_p99_ms": 63.4,
        "tpot_p50_ms": 85.2,
        "tpot_p99_ms": 88.2,
        "latency_p50_ms": 5451.5,
        "latency_p99_ms": 5642.0,
    }
    # guidellm's output rate is the successful requests' tokens over the run.
    assert row["output_tok_s"] == round(
        row["output_tokens"] / GOVERNOR["benchmarks"][0]["duration"], 1
    )


def test_a_clean_run_and_one_with_nothing_done() -> None:
    row = rows.run_row("llama-server", LLAMA_SERVER)
    assert (row["successful"], row["errored"], row["errored_by"]) == (32, 0, {})
    assert (row["ttft_p99_ms"], row["latency_p50_ms"]) == (18400.5, 12524.6)
    refused = report(
        duration=0.5,
        totals=(0, 16, 0),
        tokens=0.0,
        tok_s=0.0,
        ttft=(0, 0.0, 0.0),
        itl=(0, 0.0, 0.0),
        tpot=(0, 0.0, 0.0),
        latency=(0, 0.0, 0.0),
        errors=[ERROR_429] * 16,
    )
    row = rows.run_row("governor", refused)
    assert row["output_tok_s"] == 0.0  # a real zero, not a missing figure
    assert row["ttft_p99_ms"] is None
    assert row["latency_p50_ms"] is None


def test_errors_get_short_names() -> None:
    assert rows.error_kind(ERROR_429) == "HTTP 429"
    assert rows.error_kind("ReadTimeout('timed out')\nmore") == "ReadTimeout('timed out')"
    assert rows.error_kind(None) == "unknown"
    assert len(rows.error_kind("x" * 500)) == 60


def test_a_refused_start_names_its_cause() -> None:
    reason = rows.failure_reason(HEALTH_404_LOG)
    assert reason is not None
    assert reason.startswith("httpx.HTTPStatusError: Client error '404 Not Found'")
    assert reason.endswith(
        "RuntimeError: Backend validation request failed. Could not connect "
        "to the server or validate the backend configuration."
    )
    assert rows.failure_reason("no exception here\n") is None


# Summary -----------------------------------------------------------------------------------


def test_medians_ratios_and_the_issue_targets() -> None:
    ours = rows.run_row("governor", GOVERNOR)
    theirs = rows.run_row("llama-server", LLAMA_SERVER)
    summary = rows.summarize([ours, theirs, dict(theirs, output_tok_s=70.0), ours])
    assert summary["median"]["governor"]["runs"] == 2
    assert summary["median"]["llama-server"]["output_tok_s"] == 67.35  # (64.7 + 70.0) / 2
    ratios = summary["governor_over_llama_server"]
    assert ratios["ttft_p99_ms"] == round(2734.6 / 18400.5, 3)
    assert summary["targets"] == {
        "errored_0": False,
        "output_tok_s_ratio_ge_1": False,  # 45.3 / 67.35
        "ttft_p99_ratio_le_1": True,  # (of the 4 requests it let through)
        "met": False,
    }
    met = dict(ours, errored=0, errored_by={}, output_tok_s=64.7)
    assert rows.summarize([met, theirs])["targets"] == {
        "errored_0": True,
        "output_tok_s_ratio_ge_1": True,
        "ttft_p99_ratio_le_1": True,
        "met": True,
    }
    # A mix of chats and rewrites: output, and goodput half again llama-server's (whose
    # requests, all past 2 s, were none of them good here).
    assert rows.summarize([met, dict(theirs, goodput_rps=0.2)], mix=True)["targets"] == {
        "output_tok_s_ratio_ge_1": True,
        "goodput_ratio_ge_1_5": True,
        "met": True,
    }
    assert (
        rows.summarize([met, dict(theirs, goodput_rps=0.3)], mix=True)["targets"][
            "goodput_ratio_ge_1_5"
        ]
        is False
    )
    assert "targets" not in rows.summarize([theirs])


def test_a_run_without_a_report_fails_the_target_and_counts_in_no_median() -> None:
    failed = rows.failed_row("governor", "guidellm exited 1: ...")
    theirs = rows.run_row("llama-server", LLAMA_SERVER)
    summary = rows.summarize([failed, theirs])
    assert summary["median"]["governor"]["output_tok_s"] is None
    assert summary["governor_over_llama_server"]["output_tok_s"] is None
    assert summary["targets"]["errored_0"] is False
    assert summary["targets"]["output_tok_s_ratio_ge_1"] is None
    assert "no report: guidellm exited 1" in rows.line(failed)
    assert "HTTP 429 28" in rows.line(rows.run_row("governor", GOVERNOR))


def test_runs_alternate() -> None:
    assert alternating(["g", "l"], 3) == ["g", "l", "l", "g", "g", "l"]


# Command lines -----------------------------------------------------------------------------


def test_the_defaults_are_the_issues_run() -> None:
    args = parse()
    assert (args.concurrency, args.requests, args.output_tokens) == (16, 64, 64)
    assert (args.slots, args.threads, args.rounds) == (4, 2, 2)
    assert args.servers == ("governor", "llama-server")
    assert parse("--servers", "llama-server").servers == ("llama-server",)
    for bad in ("vllm", "governor,governor", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            guidellm_bench.parse_servers(bad)


def test_the_governor_gets_its_slots_lanes_and_front_door() -> None:
    args = parse("--extra-governor-args=--max-wait 30 --log-format json")
    argv = command_lines.governor_command(args, MODEL, 7001)
    assert argv[1:4] == ["-m", "governor", "serve"]
    assert flag(argv, "--runner") == "llama"
    assert flag(argv, "--model") == str(MODEL)
    assert flag(argv, "--max-inflight") == "4"
    assert flag(argv, "--lanes") == "true"
    assert flag(argv, "--threads") == "2"
    # llama-server's KV cache (its -c, below): a stream of a slot's context for each slot, or
    # with --kv-layout pool as many cells in one pool.
    assert (flag(argv, "--kv-layout"), flag(argv, "--n-ctx")) == ("slots", "512")
    pooled = command_lines.governor_command(parse("--kv-layout", "pool"), MODEL, 7001)
    assert (flag(pooled, "--kv-capacity"), flag(pooled, "--n-ctx")) == ("2048", "512")
    assert flag(argv, "--http-listen") == "127.0.0.1:7001"
    assert flag(argv, "--listen") == "127.0.0.1:0"
    assert argv[-4:] == ["--max-wait", "30", "--log-format", "json"]


def test_llama_server_gets_the_same_slots_and_room_for_each_request() -> None:
    args = parse("--llama-server", "/bin/llama-server")
    argv = command_lines.llama_server_command(args, MODEL, 7002)
    assert argv == llama_server.command(
        Path("/bin/llama-server"), MODEL, port=7002, slots=4, ctx=2048, threads=2
    )
    assert flag(argv, "-np") == "4"
    assert flag(argv, "--host") == "127.0.0.1"
    # Each slot: 128 prompt + 64 output + the template, in whole 256s.
    assert command_lines.server_ctx(parse("--prompt-tokens", "400")) == 4 * 768
    assert command_lines.server_ctx(parse("--server-ctx", "8192")) == 8192
    args = parse("--llama-server", "/bin/llama-server", "--extra-llama-server-args", "-fa on")
    assert command_lines.llama_server_command(args, MODEL, 7002)[-2:] == ["-fa", "on"]


def test_guidellm_runs_the_concurrent_profile_offline() -> None:
    args = parse("--guidellm", "/venv/bin/guidellm", "--requests", "32")
    out = Path("/out/0-governor-guidellm.json")
    argv = command_lines.guidellm_command(args, "http://127.0.0.1:7001", MODEL, out)
    assert argv[:2] == ["/venv/bin/guidellm", "run"]
    assert argv[-1] == "--disable-console-interactive"  # (its tables go to the run's log)
    pairs = argv[2:-1]
    specs = dict(zip(pairs[::2], map(json.loads, pairs[1::2]), strict=True))
    assert specs["--backend"] == {
        "kind": "openai_http",
        "target": "http://127.0.0.1:7001",
        "validate_backend": True,  # guidellm's GET /health first
    }
    assert specs["--profile"] == {"kind": "concurrent", "streams": 16}
    assert specs["--constraint"] == {"kind": "max_requests", "count": 32}
    assert specs["--data"] == {"kind": "synthetic_text", "prompt_tokens": 128, "output_tokens": 64}
    # The tokenizer comes out of the GGUF file: nothing to fetch.
    assert specs["--tokenizer"] == {
        "kind": "huggingface_auto",
        "model": "/models",
        "load_kwargs": {"gguf_file": MODEL.name},
    }
    assert specs["--output"] == {"kind": "json", "path": str(out)}
    unchecked = command_lines.guidellm_command(parse("--no-health-check"), "http://h:1", MODEL, out)
    assert json.loads(flag(unchecked, "--backend"))["validate_backend"] is False
    # A system prompt every request shares, and room for it in llama-server's slots.
    shared = parse("--prefix-tokens", "512", "--slots", "4")
    assert json.loads(
        flag(command_lines.guidellm_command(shared, "http://h:1", MODEL, out), "--data")
    ) == {
        "kind": "synthetic_text",
        "prompt_tokens": 128,
        "output_tokens": 64,
        "prefix_tokens": 512,
        "prefix_count": 1,
    }
    assert command_lines.server_ctx(shared) == 4 * 1024
    env = command_lines.guidellm_env(parse("--client-processes", "2"))
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == env["HF_DATASETS_OFFLINE"] == "1"
    assert env["GUIDELLM__MAX_WORKER_PROCESSES"] == "2"


def test_the_bench_venv_installs_the_bench_extra_and_the_tests_do_not() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["bench"] == list(guidellm_bench.BENCH_REQUIREMENTS)
    assert all(f"'{r}'" in guidellm_bench.SETUP_VENV for r in extras["bench"])
    assert ".venv-bench" in guidellm_bench.SETUP_VENV
    assert guidellm_bench.SETUP_VENV in (ROOT / "docs" / "LOADTEST.md").read_text()
    assert not any("guidellm" in r or "bench" in r for r in extras["test"] + extras["loadtest"])


def test_a_mix_is_chats_and_rewrites_of_200_to_300_words_spread_evenly() -> None:
    rows = command_lines.mix_rows(96, 0.25, 128)
    rewrites = [i for i, row in enumerate(rows) if row["prompt"].startswith("Rewrite")]
    assert len(rewrites) == 24
    assert max(b - a for a, b in itertools.pairwise(rewrites)) == 4
    for i, row in enumerate(rows):
        words = len(row["prompt"].split()) - 4  # ("Rewrite this more formally:")
        assert row["output_tokens_count"] == 128
        assert 200 <= words <= 300 + 20 if i in rewrites else len(row["prompt"]) < 60
    assert len({row["prompt"] for row in rows}) == 96  # (no prompt cached from another)
    assert command_lines.mix_rows(96, 0.25, 128) == rows  # (the same every run)
    args = parse("--rewrite-share", "0.25", "--slots", "8", "--output-tokens", "128")
    assert command_lines.server_ctx(args) == 8 * 768  # 448 + 128 + 128 a slot, in 256s
    with pytest.raises(SystemExit):
        parse("--rewrite-share", "1.5")
