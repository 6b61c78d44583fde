"""``loadtest soak`` against a real daemon process (the stub runner) for about 20 seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from loadtest.commands.soak.load import FAULTS


@pytest.mark.slow
def test_a_short_soak_injects_every_fault_and_leaks_nothing() -> None:
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "loadtest", "soak", "--minutes", "0.33"),
            *("--sample-s", "2", "--slow-hold-s", "3", "--fault-every-ms", "40"),
            "--serve-arg=--write-timeout=1",
            "--json",
        ],
        capture_output=True,
        timeout=120,
        check=False,
    )
    out = proc.stdout.decode()
    assert proc.stdout, proc.stderr.decode()
    report: dict[str, Any] = json.loads(out.splitlines()[-1])
    assert proc.returncode == 0, out

    # What must hold: nothing leaked, nothing raised, the daemon lived through it.
    assert report["leaked_slots"] == 0
    assert report["tracebacks"] == 0, report["first_traceback"]
    assert report["daemon_died"] is False
    assert report["daemon_exit_status"] == 0
    # The load ran, and every fault was injected, each as it was meant to land.
    assert report["jobs_total"]["done"] > 0
    assert set(report["faults"]) == set(FAULTS)
    for kind in FAULTS:
        assert sum(report["faults"][kind].values()) > 0, kind
    assert report["faults"]["cancel_mid_run"].get("abort:cancelled", 0) > 0
    assert report["faults"]["disconnect_mid_run"].get("reset_running", 0) > 0
    assert report["faults"]["garbage"].get("answered", 0) > 0
    # The figures are computed.
    memory = report["memory"]
    assert memory["rss_kib"]["first"] > 0
    assert memory["rss_kib"]["max"] >= memory["rss_kib"]["last"] > 0
    assert isinstance(memory["flat"], bool)
    assert len(report["samples"]) >= 5
    assert all(s["inflight"] is not None for s in report["samples"])
    # Slow readers are cut off write_timeout (1 s) after they stop reading, before their own
    # 3 s are up; nothing is left open.
    slow = report["faults"]["slow_reader"]
    assert set(slow) == {"cut_off"}, slow
    assert report["connections_after_settle"] == 0


def test_memory_is_flat_when_it_swings_and_growing_when_it_trends() -> None:
    from loadtest.commands.soak.samples import Sample, memory_verdict

    def samples(rss: list[int]) -> list[Sample]:
        return [Sample(10.0 * i, kib, 0, 0, 0) for i, kib in enumerate(rss)]

    # A sawtooth of +-12 % around 80 MiB whose ends fall low, then high: flat.
    swing = [80_000 + (-9_000, 0, 9_000)[i % 3] for i in range(60)]
    swing[6:9] = [71_000] * 3
    swing[-3:] = [89_000] * 3
    flat = memory_verdict(samples(swing), warmup_s=60.0)
    assert flat["flat"] is True  # (the three samples at either end: 89 / 71 MiB, "growing")
    # A steady climb of 1 MiB a minute for half an hour, however small each step: growing.
    climb = memory_verdict(samples([60_000 + 170 * i for i in range(180)]), warmup_s=60.0)
    assert climb["flat"] is False
    assert climb["rss_slope_kib_per_min"] == pytest.approx(1020, rel=0.01)
