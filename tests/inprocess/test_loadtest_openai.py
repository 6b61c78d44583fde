"""The load tests through the governor's OpenAI-compatible front door: ``--openai`` honouring its
refusals (429 with ``retry-after-ms``) as yields, on an in-process governor with the stub runner;
and ``loadtest bench sdk-bench``, the official SDK's clients against a governor it starts itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from clients.client import NO_RETRY, RetryPolicy
from governor.core.tenants import TenantConfig, key_sha256
from loadtest.bench.sdk_bench import clients as sdk_clients
from loadtest.bench.sdk_bench import rows
from loadtest.cli import build_parser
from loadtest.support.connections import retry_policy
from loadtest.support.driver import Run, open_loop
from loadtest.support.stats import alternating
from loadtest.support.targets import (
    ABORTED,
    DONE,
    YIELDED,
    OpenAITarget,
    Shape,
    Target,
    error_code,
    retry_hint_ms,
)
from loadtest.support.traffic import target_from
from loadtest.support.workload import Request
from tests.conftest import ServerFactory

ROOT = Path(__file__).resolve().parents[2]
STUB_MS = 200


async def _front_door(make_server: ServerFactory) -> str:
    """A governor with one slot, its jobs STUB_MS long, no wait at its front door (a request
    that finds the slot taken is answered 429 at once); its front door's base URL."""
    server = await make_server(
        http_listen="127.0.0.1:0", max_inflight=1, stub_ms=STUB_MS, max_wait=0
    )
    assert server.http_address is not None
    host, port = server.http_address
    return f"http://{host}:{port}"


async def _drive(target: Target, count: int) -> Run:
    """``count`` chats at once, each on its own connection."""
    return await open_loop(
        target,
        [Request(0.0, "chat", 0, 4) for _ in range(count)],
        connections=count,
        timeout_s=20,
        sample_s=0.1,
        label="openai",
        progress_out=None,
    )


# Reading a refusal ------------------------------------------------------------------------


def test_the_hint_is_read_as_the_sdks_read_it() -> None:
    assert retry_hint_ms({"retry-after-ms": "250", "retry-after": "1"}) == 250
    assert retry_hint_ms({"retry-after-ms": "12.2"}) == 13  # (never earlier than told)
    assert retry_hint_ms({"retry-after": "2"}) == 2000
    assert retry_hint_ms({"retry-after-ms": "soon", "retry-after": "1"}) == 1000
    assert retry_hint_ms({"retry-after": "Thu, 01 Jan 1970 00:00:00 GMT"}) == 0  # (past)
    assert retry_hint_ms({"retry-after": "whenever"}) is None
    assert retry_hint_ms({"retry-after-ms": "-5"}) is None
    assert retry_hint_ms({}) is None


def test_the_need_code_is_the_error_bodys_code() -> None:
    assert error_code(b'{"error": {"message": "m", "code": "server_busy"}}') == "server_busy"
    assert error_code(b'{"error": {"message": "m", "code": null}}') is None
    assert error_code(b'{"detail": "no"}') is None
    assert error_code(b"<html>") is None


def test_openai_targets_take_the_runs_retry_policy() -> None:
    args = build_parser().parse_args(
        [
            "burst",
            "--openai",
            "http://127.0.0.1:9/",
            "--retry",
            "fixed",
            "--fixed-ms",
            "30",
            "--max-attempts",
            "3",
            "--prompt-tokens",
            "8",
        ]
    )
    target = target_from(args)
    assert isinstance(target, OpenAITarget)
    assert target.retry == RetryPolicy(max_attempts=3, fixed_delay_s=0.03)
    args = build_parser().parse_args(["burst", "--openai", "http://127.0.0.1:9", "--retry", "none"])
    target = target_from(args)
    assert isinstance(target, OpenAITarget)
    assert target.retry == NO_RETRY


# Against the front door ---------------------------------------------------------------------


async def test_with_hints_every_request_is_done_after_its_yields(
    make_server: ServerFactory,
) -> None:
    url = await _front_door(make_server)
    usage = {"stream_options": {"include_usage": True}}
    target = OpenAITarget(url, Shape(chat=True), extra=usage, retry=retry_policy("hint", 10))
    run = await _drive(target, 3)

    assert [o.status for o in run.outcomes] == [DONE] * 3
    assert all(o.tokens == 4 for o in run.outcomes)  # usage (the stub's: max_tokens)
    waited = [o for o in run.outcomes if o.yields]
    assert len(waited) >= 2  # one slot: two of the three were refused at first
    for o in waited:
        assert {code for _, code, _ in o.yields} == {"server_busy"}
        assert o.attempts == len(o.yields) + 1
        assert all(0 <= ms < STUB_MS for _, _, ms in o.yields)  # refusals are quick
        assert o.ttft_ms is not None
        assert o.ttft_ms >= STUB_MS
    # Paced by the hints, not by a busy loop: a handful of attempts in all. (Whether a first
    # retry is admitted is a race of a few milliseconds: a hint names the expected release, and
    # a retry that comes a moment before it gets another, short, hint.)
    assert sum(o.attempts for o in run.outcomes) <= 3 + 6


async def test_without_retries_the_second_request_ends_yielded(
    make_server: ServerFactory,
) -> None:
    url = await _front_door(make_server)
    target = OpenAITarget(url, Shape(chat=True), retry=retry_policy("none", 10))
    run = await _drive(target, 2)

    by_status = sorted(run.outcomes, key=lambda o: o.status)
    done, refused = by_status
    assert (done.status, refused.status) == (DONE, YIELDED)
    assert refused.reason == "server_busy"
    assert refused.attempts == 1
    assert len(refused.yields) == 1
    assert refused.tokens == 0
    assert refused.first_token_s is None
    assert done.attempts == 1
    assert not done.yields


async def test_a_request_the_front_door_refuses_for_good_is_aborted(
    make_server: ServerFactory,
) -> None:
    url = await _front_door(make_server)
    target = OpenAITarget(
        url, Shape(chat=True), extra={"best_of": 2}, retry=retry_policy("hint", 10)
    )
    run = await _drive(target, 1)

    (outcome,) = run.outcomes
    assert (outcome.status, outcome.reason) == (ABORTED, "http_400")
    assert outcome.attempts == 1
    assert not outcome.yields


async def test_the_key_goes_as_the_bearer_key(
    make_server: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--api-key`` (or ``$GOVERNOR_API_KEY``) reaches a front door with tenants as
    ``Authorization: Bearer``; without it every request is a 401."""
    tenant = TenantConfig(name="ide", key_sha256=key_sha256("door-key"))
    server = await make_server(http_listen="127.0.0.1:0", stub_ms=0, tenants=(tenant,))
    assert server.http_address is not None
    url = "http://{}:{}".format(*server.http_address)
    argv = ["burst", "--openai", url, "--prompt-tokens", "4", "--retry", "none"]
    monkeypatch.delenv("GOVERNOR_API_KEY", raising=False)
    bare = await _drive(target_from(build_parser().parse_args(argv)), 2)
    assert [(o.status, o.reason) for o in bare.outcomes] == [(ABORTED, "http_401")] * 2
    flag = await _drive(target_from(build_parser().parse_args([*argv, "--api-key", "door-key"])), 2)
    assert [o.status for o in flag.outcomes] == [DONE] * 2
    monkeypatch.setenv("GOVERNOR_API_KEY", "door-key")
    env = await _drive(target_from(build_parser().parse_args(argv)), 2)
    assert [o.status for o in env.outcomes] == [DONE] * 2


# sdk-bench ----------------------------------------------------------------------------------


def test_runs_alternate() -> None:
    assert alternating(["g", "b"], 1) == ["g", "b"]
    assert alternating(["g", "b"], 2) == ["g", "b", "b", "g"]
    assert alternating(["g", "b"], 3) == ["g", "b", "b", "g", "g", "b"]
    assert alternating(["g"], 2) == ["g", "g"]


def test_prompts_differ_and_are_as_long() -> None:
    prompts = [sdk_clients.prompt(k) for k in range(50)]
    assert len(set(prompts)) == 50
    assert len({len(p) for p in prompts}) == 1


def test_a_runs_figures_and_the_ratios() -> None:
    run = sdk_clients.Load(wall_s=2.0)
    run.records = [
        sdk_clients.Record(0.0, first_s=0.1, end_s=0.5, tokens=8, usage=True),
        sdk_clients.Record(0.0, first_s=0.3, end_s=1.0, tokens=8, usage=True),
        sdk_clients.Record(0.0, end_s=0.2, error="RateLimitError"),
    ]
    run.statuses.update({200: 2, 429: 3})
    row = rows.run_row("governor", run)
    assert (row["sent"], row["ok"], row["failed"]) == (3, 2, 1)
    assert row["failed_by"] == {"RateLimitError": 1}
    assert row["goodput_rps"] == 1.0
    assert row["tokens_per_s"] == 8.0
    assert (row["ttft_p50_ms"], row["ttft_p99_ms"]) == (100.0, 300.0)
    assert (row["e2e_p50_ms"], row["e2e_p99_ms"]) == (500.0, 1000.0)
    assert (row["http_429"], row["absorbed_429"], row["sdk_retries"]) == (3, 2, 2)

    slower = {**row, "server": "baseline", "goodput_rps": 0.5, "ttft_p99_ms": 600.0}
    summary = rows.summarize([row, slower])
    assert summary["median"]["governor"]["goodput_rps"] == 1.0
    assert summary["governor_over_baseline"]["goodput_rps"] == 2.0
    assert summary["governor_over_baseline"]["ttft_p99_ms"] == 0.5
    assert "governor_over_baseline" not in rows.summarize([row])


def test_sdk_bench_on_the_stub_absorbs_429s(tmp_path: Path) -> None:
    """8 SDK clients at once on 4 slots, no wait at the door: half are refused, and the SDK's
    own two retries, paced by the hints, get every one of them done."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest",
            "bench",
            "sdk-bench",
            "--runner",
            "stub",
            "--no-baseline",
            "--clients",
            "8",
            "--max-inflight",
            "4",
            "--stub-ms",
            str(STUB_MS),
            "--rounds",
            "1",
            "--max-tokens",
            "4",
            "--run-timeout",
            "30",
            "--governor-arg=--max-wait=0",
            "--json",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        timeout=90,
        check=True,
    )
    report = json.loads(done.stdout.decode().splitlines()[-1])
    assert report == json.loads((tmp_path / "sdk-bench.json").read_text())
    assert report["sdk_max_retries"] == 2  # the SDK's default, untouched
    (row,) = report["runs"]
    assert row["server"] == "governor"
    assert (row["sent"], row["ok"], row["failed"]) == (8, 8, 0), row["failed_by"]
    assert row["http_429"] > 0
    assert row["absorbed_429"] == row["http_429"]
    assert row["http_statuses"]["200"] == 8
    assert row["tokens"] == 8 * 4
    assert row["tokens_from_usage"] == 8
    assert row["ttft_p99_ms"] >= 2 * STUB_MS * 0.9  # the refused waited a whole job
    assert set(report["median"]) == {"governor"}
    assert "governor_over_baseline" not in report


def test_door_refusal_measures_a_no_wait_429_against_the_cheapest_answer() -> None:
    """Every answer is checked as it comes (429 for the no-wait chats, 200 for /v1/models: the
    command fails otherwise), and each kind has its server time and round trips."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest",
            "bench",
            "door-refusal",
            "--requests",
            "50",
            "--rounds",
            "1",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        timeout=90,
        check=True,
    )
    report = json.loads(done.stdout.decode().splitlines()[-1])
    assert [(r["kind"], r["answers"]) for r in report["runs"]] == [("refusal", 50), ("models", 50)]
    for figures in report["median"].values():
        assert 0 < figures["rtt_p50_us"] <= figures["rtt_p99_us"]
        assert figures["server_cpu_us_per_answer"] >= 0
