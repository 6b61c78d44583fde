"""``loadtest bench generation`` and ``loadtest bench ceiling``: their options, target command
lines, the summaries they print, and the PSS reader, with no process started and no model loaded."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

from governor.runners.llama.messages import Run
from governor.runners.llama.sampling import plain
from loadtest.bench import ceiling, generation
from loadtest.bench.generation import options, rows, servers
from loadtest.bench.generation import prompts as texts
from loadtest.bench.generation import report as tables
from loadtest.cli import build_parser
from loadtest.support import baseline_server, llama_server
from loadtest.support.machine import others_share, parse_busy_s
from loadtest.support.options import positive_ints
from loadtest.support.processes import descendants, parse_rollup_kib, tree_rollup_kib
from loadtest.support.stats import ratio
from loadtest.support.targets import ABORTED, DONE, ERROR, TIMED_OUT, Outcome, Shape
from loadtest.support.workload import Request

SETTINGS = servers.Settings(
    model=Path("/models/m.gguf"),
    threads=2,
    n_ctx=2048,
    server_ctx=16384,
    n_gpu_layers=0,
    llama_server=Path("/bin/llama-server"),
    governor_args=("--log-format=json",),
)

SMAPS_ROLLUP = """\
55d0c0a00000-7ffd4b9f2000 ---p 00000000 00:00 0                          [rollup]
Rss:              262144 kB
Pss:              131072 kB
Pss_Dirty:         20480 kB
Pss_Anon:          18432 kB
Pss_File:         112640 kB
Pss_Shmem:             0 kB
Shared_Clean:     225280 kB
"""


def outcome(
    cls: str,
    status: str = DONE,
    *,
    sent: float = 0.0,
    first: float | None = None,
    end: float | None = None,
    tokens: int = 0,
    yields: int = 0,
) -> Outcome:
    o = Outcome(Request(0.0, cls, 0, 16), sent, status)
    o.first_token_s, o.end_s, o.tokens = first, end, tokens
    o.yields = [(sent, "server_busy", 1.0)] * yields
    return o


# options ----------------------------------------------------------------------------------


def test_positive_ints_keeps_order_and_refuses_zero_repeats_and_words() -> None:
    assert positive_ints("1,4,8,16") == (1, 4, 8, 16)
    assert positive_ints("8,1") == (8, 1)
    for bad in ("0,1", "1,1", "a", "", "1,-2"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_ints(bad)


def test_generation_defaults_and_choices() -> None:
    args = build_parser().parse_args(["bench", "generation"])
    assert args.targets == ("governor", "per-process", "llama-server")
    assert args.measures == generation.MEASURES
    assert args.streams == (1, 4, 8, 16)
    assert (args.max_new_tokens, args.chats, args.chat_tokens) == (128, 20, 16)
    assert (args.rewrite_tokens, args.burst_slots, args.burst_delay) == (1400, None, 0.2)
    assert args.slots is None
    assert args.threads == 2
    assert args.llama_server == llama_server.default_binary()
    args = build_parser().parse_args(
        [
            "bench",
            "generation",
            "--targets",
            "llama-server,governor",
            "--measures",
            "burst",
            "--slots",
            "4",
        ]
    )
    assert args.targets == ("llama-server", "governor")
    assert args.measures == ("burst",)
    assert args.slots == 4
    parse = options.parse_choices(servers.TARGETS)
    for bad in ("vllm", "governor,governor", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


def test_default_llama_server_follows_xdg_cache_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", "/cache")
    assert llama_server.default_binary() == Path("/cache/governor/llama-server/llama-server")


def test_ceiling_options() -> None:
    args = build_parser().parse_args(["bench", "ceiling"])
    assert (args.streams, args.steps, args.threads, args.prefill) == ((1, 4, 8, 16), 128, 2, False)
    args = build_parser().parse_args(["bench", "ceiling", "--prefill", "--chunks", "16,512"])
    assert args.prefill
    assert args.chunks == (16, 512)


def test_ceiling_sampling_times_the_chain_and_the_draws_on_the_real_model() -> None:
    args = build_parser().parse_args(
        ["bench", "ceiling", "--sampling", "--steps", "3", "--repeats", "2", "--wait-quiet", "0"]
    )
    report = ceiling.measure(args)
    assert [row["sampling"] for row in report["sampling"]] == [s[0] for s in ceiling.SAMPLINGS]
    for row, (name, settings) in zip(report["sampling"], ceiling.SAMPLINGS, strict=True):
        assert row["chain_ms"] > 0
        if plain(Run(id=name, tokens=[], max_new_tokens=1, **settings)):
            assert row["draws_ms"] > 0
        else:  # (top_k and top_p: the chain's alone)
            assert row["draws_ms"] is None
    assert "decode" not in report
    lines = ceiling.render(report)
    assert any("draws ms" in line for line in lines)
    assert any(line.startswith("llama-server's defaults") and " - " in line for line in lines)


def test_ceiling_context_fits_the_largest_round_and_the_prefill_runs() -> None:
    n_ctx = ceiling.context_size((1, 4, 8, 16), 128, ())
    assert n_ctx % 256 == 0
    assert n_ctx >= 16 * (4 * ceiling.PROMPT_TOKENS + 128 + 2)
    n_ctx = ceiling.context_size((), 128, (16, 512))
    assert n_ctx >= ceiling.RUNNING * (4 * ceiling.PROMPT_TOKENS + 2) + 512


# target command lines ---------------------------------------------------------------------


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_governor_runs_one_worker_with_every_slot() -> None:
    argv = servers.command("governor", SETTINGS, slots=16, lanes=False, port=7000)
    assert argv[:4] == [sys.executable, "-m", "governor", "serve"]
    assert flag(argv, "--max-inflight") == "16"
    assert flag(argv, "--workers") == "1"
    assert flag(argv, "--threads") == "2"
    assert flag(argv, "--n-ctx") == "2048"
    assert flag(argv, "--listen") == "127.0.0.1:7000"
    assert flag(argv, "--lanes") == "off"
    assert flag(argv, "--model") == "/models/m.gguf"
    assert argv[-1] == "--log-format=json"


def test_per_process_runs_a_worker_per_slot_and_lanes_when_asked() -> None:
    argv = servers.command("per-process", SETTINGS, slots=8, lanes=True, port=7000)
    assert flag(argv, "--max-inflight") == "8"
    assert flag(argv, "--workers") == "8"
    assert flag(argv, "--threads") == "0"  # the governor's own share of the cores
    assert flag(argv, "--lanes") == "on"


def test_llama_server_gets_its_slots_a_shared_cache_and_loopback() -> None:
    argv = servers.command("llama-server", SETTINGS, slots=16, lanes=True, port=7001)
    assert argv[0] == "/bin/llama-server"
    assert flag(argv, "-np") == "16"
    assert "-kvu" in argv
    assert flag(argv, "-c") == "16384"
    assert flag(argv, "-t") == "2"
    assert flag(argv, "--host") == "127.0.0.1"
    assert flag(argv, "--port") == "7001"


def test_llama_cpp_python_is_the_baseline_command() -> None:
    argv = servers.command("llama-cpp-python", SETTINGS, slots=4, lanes=False, port=7002)
    assert argv == baseline_server.command(SETTINGS.model, 7002, threads=2, n_ctx=2048)
    with pytest.raises(ValueError, match="vllm"):
        servers.command("vllm", SETTINGS, slots=4, lanes=False, port=7002)


# prompts ----------------------------------------------------------------------------------


def test_prompts_are_distinct() -> None:
    assert len({texts.question(k) for k in range(100)}) == 100
    assert len({texts.story(k) for k in range(100)}) == 100


def test_rewrite_prompts_reach_their_length_and_start_apart() -> None:
    def words(text: str) -> int:
        return len(text.split())

    prompts = texts.rewrite_prompts(2, 1400, words)
    assert [n for _, n in prompts] == [words(text) for text, _ in prompts]
    assert all(n >= 1400 for _, n in prompts)
    first, second = (text.split("\n\n")[1] for text, _ in prompts)
    assert first != second


def test_shape_prompts_cycle_and_fall_back_to_synthetic_ones() -> None:
    request = Request(0.0, "chat", 10, 16)
    shape = Shape(prompts=("a", "b"))
    assert [shape.prompt(request, i) for i in range(3)] == ["a", "b", "a"]
    assert Shape().prompt(request, 3).startswith("r3:")


# summaries --------------------------------------------------------------------------------


def test_throughput_is_tokens_over_wall_time() -> None:
    outcomes = [
        outcome("stream", tokens=128, first=0.5, end=4.0),
        outcome("stream", tokens=100, first=1.0, end=4.0),
        outcome("stream", TIMED_OUT, tokens=12, first=2.0),
    ]
    row = rows.throughput_row(3, outcomes, 4.0)
    assert row["tokens"] == 240
    assert row["tokens_per_s"] == 60.0
    assert (row["tokens_min"], row["tokens_max"]) == (12, 128)
    assert (row["done"], row["lost"]) == (2, 1)
    assert row["ttft_max_ms"] == 2000.0


def test_idle_ttft_percentiles_by_nearest_rank() -> None:
    outcomes = [outcome("chat", first=ms / 1000, end=1.0) for ms in range(10, 110, 10)]
    outcomes.append(outcome("chat", ERROR))
    row = rows.ttft_row(outcomes)
    assert row == {"n": 10, "p50_ms": 50.0, "p90_ms": 90.0, "lost": 1}


def test_round_row_and_the_ratios_the_targets_are_set_on() -> None:
    beside = [
        outcome("rewrite", first=0.9, end=6.5, tokens=128),
        outcome("rewrite", ABORTED, end=2.0),
        *(
            outcome("chat", sent=0.2, first=0.2 + t, end=0.2 + t + 1.5, tokens=16, yields=1)
            for t in (0.1, 0.2, 0.4)
        ),
        outcome("chat", TIMED_OUT, sent=0.2),
    ]
    row = rows.round_row(beside)
    assert row["chats"] == 4
    assert (row["ttft_p50_ms"], row["ttft_p99_ms"]) == (200.0, 400.0)
    assert (row["tpot_p50_ms"], row["tpot_p99_ms"]) == (100.0, 100.0)  # 1.5 s over 15 tokens
    assert row["e2e_p99_ms"] == 1900.0
    assert row["yields"] == 3
    assert row["rewrite_end_s"] == [6.5, None]
    assert row["rewrite_tokens"] == [128, 0]
    assert row["lost"] == 1  # the timed-out chat; an abort is an answer
    alone = rows.round_row([outcome("chat", first=0.1, end=0.85, tokens=16) for _ in range(3)])
    assert (alone["ttft_p99_ms"], alone["tpot_p99_ms"], alone["e2e_p99_ms"]) == (100, 50, 850)
    ratios = rows.burst_ratios({"alone": alone, "beside": row, "alone_all": alone, "over": row})
    assert ratios == {
        "beside_ttft": 4.0,
        "beside_tpot": 2.0,
        "over_tpot": 2.0,
        "over_ttft": round(400 / 950, 3),
    }
    assert rows.burst_ratios({})["over_ttft"] is None


def test_memory_rows_and_their_ratio_to_llama_server_at_the_same_slots() -> None:
    assert rows.memory_row(4, rows.Memory(4096 * 1024, 3072 * 1024, 3)) == {
        "slots": 4,
        "pss_mib": 4096.0,
        "pss_anon_mib": 3072.0,
        "processes": 3,
    }
    assert rows.memory_row(1, rows.Memory(None, None, 0))["pss_mib"] is None
    report = {
        "targets": {
            "governor": {"memory": [rows.memory_row(1, rows.Memory(300 * 1024, 100 * 1024, 2))]},
            "llama-server": {
                "memory": [
                    rows.memory_row(1, rows.Memory(200 * 1024, 80 * 1024, 1)),
                    rows.memory_row(8, rows.Memory(500 * 1024, 400 * 1024, 1)),
                ]
            },
        }
    }
    text = "\n".join(tables._memory_table(report, report["targets"], 12))
    assert "governor       1     300.0    100.0     2           1.5    1.25" in text
    assert "llama-server   8     500.0    400.0     1           1.0     1.0" in text
    assert ratio(1.0, 0.0) is None


def test_render_has_a_row_per_target_and_measure() -> None:
    beside = [
        outcome("rewrite", first=0.9, end=6.5, tokens=128),
        outcome("rewrite", ABORTED, end=2.0),
        outcome("chat", sent=0.2, first=0.3, end=1.8, tokens=16),
    ]
    report = {
        "model": "m.gguf",
        "threads": 2,
        "n_gpu_layers": 0,
        "slots": 4,
        "n_ctx": 2048,
        "server_ctx": 16384,
        "streams": [1, 4],
        "max_new_tokens": 128,
        "chat_tokens": 16,
        "notes": ["llama-server skipped"],
        "targets": {
            "governor": {
                "throughput": [rows.throughput_row(1, [outcome("s", tokens=128)], 2.0)],
                "idle": rows.ttft_row([outcome("chat", first=0.1)]),
            },
            "per-process": {
                "memory": [rows.memory_row(1, rows.Memory(2048, 1024, 5))],
                "bursts": [
                    {
                        "slots": 8,
                        "rounds": {"beside": rows.round_row(beside)},
                        "ratios": rows.burst_ratios({}),
                        "others_cpu": 0.02,
                    }
                ],
            },
        },
    }
    text = "\n".join(tables.render(report))
    assert "64.0 [128-128]" in text
    assert "   beside " in text  # the round
    assert "6.5, -" in text  # its rewrites' ends
    assert "governor" in text
    assert "per-process" in text
    assert "note: llama-server skipped" in text


def test_ceiling_render() -> None:
    report = {
        "model": "m.gguf",
        "threads": 2,
        "n_gpu_layers": 0,
        "n_ctx": 2816,
        "n_batch": 32,
        "decode": [
            {"streams": 4, "steps": 128, "step_ms": 20.0, "tokens_per_s": 200.0, "others_cpu": 0.02}
        ],
        "others_cpu": 0.01,
    }
    lines = ceiling.render(report)
    assert lines[-2].split() == ["4", "128", "20.00", "200.0", "2%"]
    assert "1%" in lines[-1]


# PSS --------------------------------------------------------------------------------------


def test_parse_smaps_rollup() -> None:
    fields = parse_rollup_kib(SMAPS_ROLLUP)
    assert fields["Pss"] == 131072
    assert fields["Pss_Anon"] == 18432
    assert fields["Rss"] == 262144
    assert len(fields) == 7  # not the heading line
    assert parse_rollup_kib("") == {}


def test_tree_rollup_of_this_process() -> None:
    fields = tree_rollup_kib(os.getpid())
    assert fields is not None
    assert 0 < fields["Pss_Anon"] <= fields["Pss"] <= fields["Rss"]


def test_descendants_of_a_process_tree() -> None:
    parents = {1: 0, 10: 1, 11: 10, 12: 10, 13: 11, 20: 1, 30: 99}
    assert sorted(descendants(parents, 10)) == [11, 12, 13]
    assert descendants(parents, 13) == []
    assert sorted(descendants(parents, 1)) == [10, 11, 12, 13, 20]


# CPU of other processes ------------------------------------------------------------------


def test_busy_seconds_of_proc_stat_leave_idle_and_iowait_out() -> None:
    text = "cpu  1000 10 200 5000 40 3 7 30 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"
    ticks = 1000 + 10 + 200 + 3 + 7 + 30
    assert parse_busy_s(text) == pytest.approx(ticks / os.sysconf("SC_CLK_TCK"))
    with pytest.raises(ValueError, match="cpu line"):
        parse_busy_s("intr 1 2 3\n")


def test_others_share_is_the_machine_less_ours_over_every_cpu() -> None:
    # 10 s on 2 CPUs: the machine busy 12 s, of which ours 7 s: others 5 of 20 CPU-seconds.
    assert others_share((0.0, 100.0, 50.0), (10.0, 112.0, 57.0), 2) == 0.25
    assert others_share((0.0, 100.0, 50.0), (10.0, 101.0, 52.0), 2) == 0.0  # never below 0
    assert others_share((5.0, 0.0, 0.0), (5.0, 1.0, 0.0), 2) == 0.0
