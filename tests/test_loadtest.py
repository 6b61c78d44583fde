"""The load-test tool: nearest-rank percentiles, and ``burst`` against a real daemon.

The burst tests run both the daemon and the tool as subprocesses, as a person would: the daemon
listens on port 0, and its address is read from its log line (under a deadline, no sleeps).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loadtest.stats import Summary, percentile, summarize

from .conftest import Daemon

ROOT = Path(__file__).resolve().parent.parent


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


# burst against a real daemon ------------------------------------------------------------


def _burst(addr: str, *flags: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """Run ``python -m loadtest burst`` to its end; return its last stdout line, parsed."""
    done = subprocess.run(
        [sys.executable, "-m", "loadtest", "burst", "--addr", addr, *flags],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=timeout_s,
        check=False,
    )
    stdout = done.stdout.decode()
    assert done.returncode == 0, f"exit {done.returncode}\n{stdout}\n{done.stderr.decode()}"
    report: dict[str, Any] = json.loads(stdout.splitlines()[-1])
    return report


@pytest.mark.slow
def test_burst_reproduces_seed_003(daemon: Callable[..., Daemon]) -> None:
    addr = daemon("--max-inflight", "1", "--stub-ms", "1500", "--runner", "stub").addr
    report = _burst(addr, "--clients", "20", "--timeout", "30")
    assert report["offered"] == 20
    assert report["executed"] == 1
    assert report["yielded"] == 19
    assert report["yielded_by"] == {"server_busy": 19}
    assert report["aborted"] == report["timed_out"] == report["errors"] == 0
    assert report["max_inflight_observed"] <= 1
    assert report["inflight_peak"] == 1
    assert report["cap"] == 1
    assert report["retries"] == 0
    assert report["yield_latency_ms"]["n"] == 19
    assert report["e2e_ms"]["n"] == 1
    assert report["e2e_ms"]["max"] >= 1500


@pytest.mark.slow
def test_burst_with_hint_retries_executes_everything(daemon: Callable[..., Daemon]) -> None:
    addr = daemon("--max-inflight", "2", "--stub-ms", "200", "--runner", "stub").addr
    report = _burst(addr, "--clients", "6", "--retry", "hint", "--timeout", "30")
    assert report["offered"] == 6
    assert report["executed"] == 6
    assert report["yielded"] == report["aborted"] == report["timed_out"] == report["errors"] == 0
    assert report["retries"] > 0
    # Each retry was sent after a yield, so there are at least as many yields as retries.
    assert report["yield_latency_ms"]["n"] >= report["retries"]
    assert report["max_inflight_observed"] <= 2
    assert report["inflight_peak"] <= 2


def test_burst_exits_1_when_the_daemon_is_unreachable() -> None:
    # A port that was free a moment ago: bound, noted, closed; nothing listens there now.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest",
            "burst",
            "--addr",
            f"127.0.0.1:{port}",
            "--timeout",
            "5",
        ],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 1, done.stdout.decode()
    assert b"cannot reach the governor" in done.stderr
    assert done.stdout == b""


def test_admission_timing_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loadtest", "admission", "--iterations", "2000", "--waiting", "50"],
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
