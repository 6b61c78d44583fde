"""The load-test tool: nearest-rank percentiles, and every command against real targets.

The command tests run both the daemon and the tool as subprocesses, as a person would: the
daemon listens on port 0, and its address is read from its log line (under a deadline, no
sleeps); each run is short and bounded by its --timeout, and its report.json is read back.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loadtest.support.monitor import Sample
from loadtest.support.report import Slo, paused, saturation
from loadtest.support.report import stats as class_stats
from loadtest.support.stats import Summary, percentile, summarize
from loadtest.support.targets import DONE, YIELDED, Outcome
from loadtest.support.workload import Request
from tests.conftest import Daemon

ROOT = Path(__file__).resolve().parents[2]


# stats ------------------------------------------------------------------------------------


def test_percentile_nearest_rank_on_1_to_100() -> None:
    values = list(range(1, 101))
    assert percentile(values, 50) == 50
    assert percentile(values, 90) == 90
    assert percentile(values, 99) == 99
    assert percentile(values, 100) == 100
    assert percentile(values, 0) == 1
    assert percentile(values, 7) == 7  # 7 / 100 * 100 is 7.000000000000001 in floating point


def test_percentile_is_always_an_observed_value() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2  # rank ceil(2.0) = 2: no interpolation to 2.5
    assert percentile([1, 2, 3, 4], 51) == 3
    assert percentile([10.0, 20.0], 99.9) == 20.0


def test_percentile_ignores_input_order() -> None:
    assert percentile([5, 1, 4, 2, 3], 60) == 3


def test_percentile_of_one_value() -> None:
    for p in (0, 1, 50, 99, 100):
        assert percentile([42.5], p) == 42.5


def test_percentile_of_nothing_raises() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


@pytest.mark.parametrize("p", [-1, 100.5, float("nan")])
def test_percentile_out_of_range_raises(p: float) -> None:
    with pytest.raises(ValueError, match="within"):
        percentile([1, 2, 3], p)


def test_summarize() -> None:
    assert summarize([float(v) for v in range(100, 0, -1)]) == Summary(100, 50, 90, 99, 100)
    assert summarize([3.0]) == Summary(1, 3.0, 3.0, 3.0, 3.0)


def test_summarize_nothing() -> None:
    empty = summarize([])
    assert empty == Summary(0, None, None, None, None)
    assert empty.as_dict() == {"n": 0, "p50": None, "p90": None, "p99": None, "max": None}


# report: the overload figures ---------------------------------------------------------------


def test_saturation_counts_the_samples_where_twice_the_cap_waited() -> None:
    outstanding = [(0.0, 0), (0.1, 6), (0.2, 6), (0.3, 3), (0.4, 9)]
    samples = [  # the monitor's, a little after the client's own
        Sample(1, 0, 0, 0),  # 0 waiting
        Sample(102, 2, 0, 0),  # 6 outstanding, 2 running: 4 wait, every slot busy
        Sample(199, 1, 0, 0),  # 6 - 1 = 5 wait, a slot idle
        Sample(310, 2, 0, 0),  # 1 waits
        Sample(420, 2, 0, 0),  # 7 wait, busy
    ]
    assert saturation(outstanding, samples, cap=2) == {
        "waiting_at_least": 4,
        "samples": 3,
        "all_busy_share": round(2 / 3, 4),
        "reserve": 0,
        "usable_busy_share": round(2 / 3, 4),
        "mean_busy": round(5 / 3, 3),
    }
    assert saturation(outstanding, samples, cap=8)["samples"] == 0
    assert saturation([], samples, cap=2)["all_busy_share"] is None
    # With one slot reserved for interactive work, the idle slot at 0.199 s is the reserve's
    # while no chat is outstanding; once one is (from 0.15 s), every slot counts again.
    no_chat = saturation(outstanding, samples, cap=2, reserve=1, interactive=[(0.3, 0.35)])
    assert (no_chat["all_busy_share"], no_chat["usable_busy_share"]) == (round(2 / 3, 4), 1.0)
    chat = saturation(outstanding, samples, cap=2, reserve=1, interactive=[(0.15, 0.25)])
    assert chat["usable_busy_share"] == round(2 / 3, 4)


def test_paused_counts_the_yields_of_the_jobs_a_pause_refused() -> None:
    def outcome(status: str, reasons: list[str]) -> Outcome:
        o = Outcome(Request(0.0, "heavy", 10, 10), 0.0, status=status)
        o.yields = [(0.1 * i, reason, 5.0) for i, reason in enumerate(reasons)]
        return o

    outcomes = [
        outcome(DONE, ["server_busy", "lane_paused", "lane_paused"]),
        outcome(YIELDED, ["lane_paused"]),
        outcome(DONE, ["server_busy"] * 7),  # never paused: not counted
        outcome(DONE, []),
    ]
    assert paused(outcomes) == {
        "jobs": 2,
        "done": 1,
        "yields_per_job": 2.0,
        "paused_yields_per_job": 1.5,
    }
    assert paused(outcomes[2:])["yields_per_job"] is None


# The traffic commands against a real daemon ------------------------------------------------


def _loadtest(*args: str, out: Path, timeout_s: float = 90.0) -> tuple[dict[str, Any], str]:
    """Run ``python -m loadtest ARGS --out OUT`` to its end (exit 0): its report.json, parsed,
    and its stdout. (Standard error is not a terminal here: no progress bar is drawn.)"""
    done = subprocess.run(
        [sys.executable, "-m", "loadtest", *args, "--out", str(out), "--json"],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=timeout_s,
        check=False,
    )
    stdout = done.stdout.decode()
    assert done.returncode == 0, f"exit {done.returncode}\n{stdout}\n{done.stderr.decode()}"
    # The last stdout line is the report without its raw rows: the same numbers as the file.
    brief = json.loads(stdout.splitlines()[-1])
    name = "compare.json" if args[0] == "compare" else "report.json"
    report: dict[str, Any] = json.loads((out / name).read_text())
    if args[0] != "compare":
        assert [s["all"] for s in brief["steps"]] == [s["all"] for s in report["steps"]]
    return report, stdout


def _only(report: dict[str, Any]) -> dict[str, Any]:
    """The single step of a one-step report."""
    (step,) = report["steps"]
    assert isinstance(step, dict)
    return step


def _assert_accounted(stats: dict[str, Any]) -> None:
    """Every offered request ended in exactly one status."""
    ends = ("done", "yielded", "aborted", "timed_out", "error")
    assert stats["offered"] == sum(stats[k] for k in ends)


def _assert_rendered(out: Path) -> None:
    """The plots are PNG files and the HTML page holds them inline."""
    for name in ("latency_cdf.png", "timeline.png", "goodput.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n"), name
    page = (out / "report.html").read_text()
    assert page.count("src='data:image/png;base64,") == 3


@pytest.mark.slow
def test_burst_reproduces_seed_003(daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    addr = daemon("--max-inflight", "1", "--stub-ms", "1500").addr
    report, stdout = _loadtest("burst", "--addr", addr, "--clients", "20", out=tmp_path)
    step = _only(report)
    stats = step["all"]
    _assert_accounted(stats)
    assert (stats["offered"], stats["done"], stats["yielded"]) == (20, 1, 19)
    assert stats["yielded_by"] == {"server_busy": 19}
    assert stats["retries"] == 0
    assert stats["yield_latency_ms"]["n"] == 19
    assert stats["e2e_ms"]["n"] == 1
    assert stats["e2e_ms"]["max"] >= 1500
    assert step["max_inflight_observed"] <= 1
    assert step["inflight_peak"] == step["cap"] == 1
    # The monitor printed each change of state.
    assert "inflight=1 executed_total=1 yielded_total=19" in stdout
    assert len(step["requests"]) == 20
    _assert_rendered(tmp_path)


@pytest.mark.slow
def test_burst_with_hint_retries_executes_everything(
    daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    addr = daemon("--max-inflight", "2", "--stub-ms", "200").addr
    report, _ = _loadtest(
        "burst", "--addr", addr, "--clients", "6", "--retry", "hint", "--no-plots", out=tmp_path
    )
    step = _only(report)
    stats = step["all"]
    assert stats["done"] == stats["offered"] == 6
    assert stats["retries"] > 0
    # Each retry was sent after a yield, so there are at least as many yields as retries.
    assert stats["yields"] >= stats["retries"]
    assert step["inflight_peak"] <= 2
    assert not (tmp_path / "report.html").exists()


def test_burst_pings_and_new_connections(daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    addr = daemon("--max-inflight", "4", "--stub-ms", "0").addr
    pings, _ = _loadtest(
        "burst",
        "--addr",
        addr,
        "--clients",
        "3",
        "--rounds",
        "20",
        "--ping",
        "--no-plots",
        out=tmp_path / "ping",
    )
    fresh, _ = _loadtest(
        "burst",
        "--addr",
        addr,
        "--clients",
        "3",
        "--rounds",
        "10",
        "--reconnect",
        "--no-plots",
        out=tmp_path / "reconnect",
    )
    assert _only(pings)["all"]["done"] == 60
    assert _only(pings)["inflight_peak"] == 0  # a ping runs nothing
    assert _only(fresh)["all"]["done"] == 30
    assert _only(fresh)["inflight_peak"] >= 1


@pytest.mark.slow
def test_burst_deadline_counts_outstanding_jobs_as_timed_out(
    daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    addr = daemon("--max-inflight", "2", "--stub-ms", "30000").addr
    report, _ = _loadtest(
        "burst", "--addr", addr, "--clients", "3", "--timeout", "2", "--no-plots", out=tmp_path
    )
    stats = _only(report)["all"]
    _assert_accounted(stats)
    assert (stats["timed_out"], stats["yielded"]) == (2, 1)


@pytest.mark.slow
def test_rate_sweep_measures_ttft_tpot_and_goodput(
    daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    # 20 ms to the first token, then 5 ms per further token of 11: TPOT is 5 ms and more.
    addr = daemon("--max-inflight", "8", "--stub-ms", "20", "--stub-output-ms", "5").addr
    report, stdout = _loadtest(
        "rate",
        "--addr",
        addr,
        "--rate",
        "10,20",
        "--duration",
        "1",
        "--arrival",
        "constant",
        "--prompt-tokens",
        "8",
        "--output-tokens",
        "11",
        "--slo-ttft-ms",
        "5000",
        "--slo-tpot-ms",
        "1000",
        out=tmp_path,
    )
    assert [s["offered"] for s in report["steps"]] == [10, 20]
    assert [s["offered_rps"] for s in report["steps"]] == [10, 20]
    for step in report["steps"]:
        stats = step["all"]
        assert stats["done"] == stats["good"] == stats["offered"]
        assert stats["tokens"] == 11 * stats["offered"]
        assert stats["wasted_tokens"] == 0
        assert stats["ttft_ms"]["p50"] >= 20
        # The stub spaces the tokens at least 5 ms apart; the client sees each when its loop
        # reads it, and a first token read late shortens the ten intervals it is measured
        # over (a busy machine gave 4.98 ms): at least 4 leaves it 10 ms of lateness.
        assert stats["tpot_ms"]["p50"] >= 4
        assert stats["goodput_rps"] == pytest.approx(
            stats["offered"] / step["duration_s"], rel=0.01
        )
        assert step["timeline"]["server_inflight"]
    assert "goodput" in stdout
    _assert_rendered(tmp_path)


@pytest.mark.slow
def test_rate_objectives_split_good_from_wasted(
    daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    # Each job needs 300 ms to its first token; an objective of 100 ms makes every one late.
    addr = daemon("--max-inflight", "4", "--stub-ms", "300").addr
    report, _ = _loadtest(
        "rate",
        "--addr",
        addr,
        "--rate",
        "10",
        "--duration",
        "0.5",
        "--output-tokens",
        "4",
        "--slo-ttft-ms",
        "100",
        "--no-plots",
        out=tmp_path,
    )
    stats = _only(report)["all"]
    assert stats["done"] == 5
    assert stats["good"] == 0
    assert stats["goodput_rps"] == 0
    assert stats["wasted_tokens"] == stats["tokens"] == 20
    # TPOT unset: the governor's interactive default (100 ms), which 4 stub tokens meet.
    assert stats["met"] == {"ttft": 0.0, "tpot": 1.0, "both": 0.0}
    assert report["slo"]["default"] == {"ttft_ms": 100.0, "tpot_ms": 100.0}
    assert report["slo"]["by_class"]["heavy"] == {"tpot_ms": 1000.0}


@pytest.mark.slow
@pytest.mark.parametrize("max_wait", ["0", "30"])
def test_mix_reports_each_class_and_asks_for_its_lane(
    daemon: Callable[..., Daemon], tmp_path: Path, max_wait: str
) -> None:
    """30 jobs at once on 4 slots, of two lanes: the clients that come back on hints
    (``--max-wait 0``) are refused by reasons that name them; those that ask to wait for their
    turn (the default) are never refused."""
    addr = daemon("--max-inflight", "4", "--stub-ms", "10", "--lanes", "true").addr
    report, stdout = _loadtest(
        "mix",
        "--addr",
        addr,
        "--arrival",
        "burst",
        "--rate",
        "30",
        "--duration",
        "1",
        "--class",
        "interactive:share=2,prompt=10..20,output=2..4",
        "--class",
        "heavy:share=1,prompt=300..400,output=8",
        "--class",
        "background:share=0",
        "--max-attempts",
        "100",
        "--max-wait",
        max_wait,
        out=tmp_path,
    )
    step = _only(report)
    assert set(step["classes"]) == {"interactive", "heavy"}
    assert step["offered"] == 30
    for stats in step["classes"].values():
        _assert_accounted(stats)
        assert stats["done"] == stats["offered"] > 0
    if max_wait == "0":  # some came back for their turn, refused by a reason that names it
        assert step["all"]["yields"] > 0
        assert set(step["all"]["yields_by"]) <= {"server_busy", "lane_full"}
    else:  # each waited for its turn on the server
        assert step["all"]["yields"] == 0
    rows = step["requests"]
    heavy_tokens = {r[6] for r in rows if r[0] == "heavy"}
    assert heavy_tokens == {8}
    assert "interactive" in stdout
    assert "heavy" in stdout
    _assert_rendered(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_replay_sends_the_trace_scaled(
    kind: str, daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    trace = tmp_path / f"trace.{kind}"
    rows = [(0.0, 50, 5), (0.2, 2000, 900), (0.4, 10, 1), (0.6, 70, 3), (5.0, 10, 1)]
    if kind == "csv":
        lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [
            f"2023-11-16 18:15:{46 + t:010.7f},{p},{o}" for t, p, o in rows
        ]
    else:
        lines = [
            json.dumps({"timestamp": int(t * 1000), "input_length": p, "output_length": o})
            for t, p, o in rows
        ]
    trace.write_text("\n".join(lines) + "\n")
    addr = daemon("--max-inflight", "4", "--stub-ms", "5").addr
    out = tmp_path / "out"
    report, _ = _loadtest(
        "replay",
        str(trace),
        "--addr",
        addr,
        "--time-scale",
        "0.5",
        "--token-scale",
        "0.5",
        "--max-prompt-tokens",
        "600",
        "--max-output-tokens",
        "64",
        "--max-duration",
        "1",
        "--heavy-above",
        "30",
        "--no-plots",
        out=out,
    )
    step = _only(report)
    # The row at 5 s is 2.5 s scaled: past --max-duration, not sent.
    assert step["offered"] == step["all"]["done"] == 4
    assert {k: v["offered"] for k, v in step["classes"].items()} == {"heavy": 2, "interactive": 2}
    sent = [r[1] for r in step["requests"]]
    assert sent[-1] >= 0.3 - 0.05  # the 4th row at 0.6 s, halved
    tokens = sorted(r[6] for r in step["requests"])
    assert tokens == [1, 2, 3, 64]  # output halved (rounded up), the 900 capped at 64


@pytest.mark.slow
def test_compare_puts_reports_side_by_side(daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    addr = daemon("--max-inflight", "2", "--stub-ms", "10").addr
    for name, retry in (("hint", "hint"), ("none", "none")):
        _loadtest(
            "burst",
            "--addr",
            addr,
            "--clients",
            "6",
            "--retry",
            retry,
            "--no-plots",
            out=tmp_path / name,
        )
    out = tmp_path / "both"
    combined, stdout = _loadtest(
        "compare",
        str(tmp_path / "hint" / "report.json"),
        str(tmp_path / "none" / "report.json"),
        out=out,
    )
    assert [r["name"] for r in combined["reports"]] == ["hint", "none"]
    assert stdout.count("burst 6 x 1") == 2
    _assert_rendered(out)


def test_compare_refuses_a_file_that_is_not_a_report(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    done = subprocess.run(
        [sys.executable, "-m", "loadtest", "compare", str(bad), "--out", str(tmp_path / "o")],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert b"not a load-test report" in done.stderr


@pytest.mark.parametrize("command", ["burst", "rate", "mix"])
def test_traffic_commands_exit_1_when_the_target_is_unreachable(
    command: str, tmp_path: Path
) -> None:
    # A port that was free a moment ago: bound, noted, closed; nothing listens there now.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest",
            command,
            "--addr",
            f"127.0.0.1:{port}",
            "--timeout",
            "5",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 1, done.stdout.decode()
    assert b"cannot reach the target" in done.stderr
    assert b"{" not in done.stdout  # no report
    assert not (tmp_path / "report.json").exists()


def test_idle_connections_cost_and_responsiveness(daemon: Callable[..., Daemon]) -> None:
    d = daemon("--max-connections", "400", "--max-connections-per-source", "0")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest",
            "idle",
            "--addr",
            d.addr,
            "--connections",
            "300",
            "--hold",
            "0.5",
            "--pid",
            str(d.proc.pid),
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
        check=True,
    )
    report = json.loads(done.stdout.decode().splitlines()[-1])
    assert report["connections"] == 300
    assert report["closed_by_server"] == 0
    assert report["ping_status"] == "ok"
    assert report["rss_with_connections_kib"] > 0
    assert report["bytes_per_connection"] is not None


@pytest.mark.slow
def test_rate_against_the_queueing_baseline(tmp_path: Path) -> None:
    """The OpenAI target on llama-cpp-python's own server and the embedded model: it queues."""
    from governor.runners.llama.runner import embedded_model_path
    from loadtest.support import baseline_server
    from loadtest.support.processes import stop

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc, url = baseline_server.start(embedded_model_path(), port, threads=1, n_ctx=512)
    try:
        report, _ = _loadtest(
            "rate",
            "--openai",
            url,
            "--rate",
            "4",
            "--duration",
            "1",
            "--arrival",
            "burst",
            "--prompt-tokens",
            "16",
            "--output-tokens",
            "8",
            "--slo-ttft-ms",
            "60000",
            out=tmp_path,
        )
    finally:
        stop(proc)
    assert report["target"] == "openai"
    step = _only(report)
    stats = step["all"]
    assert stats["done"] == stats["good"] == 4
    assert stats["yields"] == 0  # it never refuses: it queues
    assert 4 <= stats["tokens"] <= 32
    assert stats["ttft_ms"]["n"] == 4
    # Queued one after the other: the last first token comes well after the first one's.
    assert stats["ttft_ms"]["max"] > stats["ttft_ms"]["p50"]
    assert step["max_outstanding"] == 4
    _assert_rendered(tmp_path)


def test_admission_timing_command() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest",
            "bench",
            "admission",
            "--iterations",
            "2000",
            "--waiting",
            "50",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
        check=True,
    )
    report = json.loads(done.stdout.decode().splitlines()[-1])
    assert report["command"] == "admission"
    assert report["waiting"] == 50
    assert 0 < report["admit_release_us"] < 10_000
    assert 0 < report["refuse_us"] < 10_000


def loadtest_json(*args: str, timeout: float = 120) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "loadtest", *args, "--json"],
        cwd=ROOT,
        capture_output=True,
        timeout=timeout,
        check=True,
    )
    report: dict[str, Any] = json.loads(done.stdout.decode().splitlines()[-1])
    return report


def test_attack_lockout_leaves_the_bystander_served(
    daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """The attackers hold every connection from the bystander's own address; the bystander's
    (which show a key) displace idle ones."""
    keys = tmp_path / "keys.toml"
    digest = hashlib.sha256(b"k-by").hexdigest()
    keys.write_text(f'[[tenants]]\nname = "by"\nkey_sha256 = "{digest}"\n')
    d = daemon("--max-connections", "64", "--config", str(keys))
    report = loadtest_json(
        *("attack", "lockout", "--addr", d.addr, "--pid", str(d.proc.pid)),
        *("--clients", "64", "--hold", "1", "--bystander", "127.0.0.1", "--api-key", "k-by"),
    )
    assert report["attack"]["attacker_connections"] == 64
    # The flood holds the limit (the bystander's among them), but for the attackers
    # reconnecting after a bystander's connection displaced them.
    assert 48 < report["connections_held_at_end"] <= 64
    assert report["bystander_job"].startswith("done in ")
    assert report["bystander_failures"] == 0
    assert report["bystander_pings"] > 0
    assert report["rss_peak_mib"] >= report["rss_before_mib"] > 0


def test_tls_cost_answers_every_job_of_both_modes() -> None:
    report = loadtest_json(
        "bench", "tls-cost", "--runs", "1", "--scenarios", "yield", "--jobs", "10"
    )
    yielded = report["yield"]
    assert yielded["median"]["plain"]["cpu_us_per_job"] > 0
    assert yielded["median"]["tls"]["cpu_us_per_job"] > 0
    assert len(yielded["per_pair_cpu"]) == 1
    assert yielded["statuses"] == {"plain": {"yield": 320}, "tls": {"yield": 320}}  # 32 x 10


def test_every_report_has_the_shares_that_met_each_objective() -> None:
    """Per class, over its offered requests: done within TTFT, within TPOT, within both (a
    request not done met none; a request with one token has no TPOT to miss)."""

    def outcome(status: str, first: float | None = None, end: float | None = None) -> Outcome:
        o = Outcome(Request(0.0, "interactive", 0, 8), 0.0, status)
        o.first_token_s, o.end_s, o.tokens = first, end, 8
        return o

    slo = Slo(by_class={"interactive": {"ttft_ms": 500.0, "tpot_ms": 100.0}})
    outcomes = [
        outcome(DONE, 0.1, 0.5),  # both
        outcome(DONE, 0.9, 1.2),  # TPOT only
        outcome(DONE, 0.1, 1.6),  # TTFT only (1.5 s over 7 tokens)
        outcome(YIELDED),  # neither
    ]
    assert class_stats(outcomes, 10.0, slo)["met"] == {"ttft": 0.5, "tpot": 0.5, "both": 0.25}
    assert class_stats([], 10.0, slo)["met"] == {"ttft": None, "tpot": None, "both": None}
