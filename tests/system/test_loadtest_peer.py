"""``loadtest bench peer`` end to end: real daemons, the real burst.py, every daemon stopped.

heptaminid itself is built outside this repository, so a stand-in takes its place: a script
that reads heptaminid's flags and becomes (``exec``) a governor with the same cap and stub.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from governor import compiled
from loadtest.support.heptamini import DEFAULT_BURST
from loadtest.support.processes import cpu_s

STAND_IN = """#!{python}
import os, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))  # heptaminid's --flag value pairs
with open({pids!r}, "a") as f:
    f.write(f"{{os.getpid()}}\\n")
os.execv(sys.executable, [sys.executable, "-m", "governor", "serve", "--runner", "stub",
    "--listen", args["--listen"], "--max-inflight", args["--max_inflight"],
    "--stub-ms", args["--stub_ms"], "--log-level", "warning"])
"""


def test_cpu_seconds_grow_with_work() -> None:
    before = cpu_s(os.getpid())
    sum(i * i for i in range(3_000_000))
    assert cpu_s(os.getpid()) > before


def peer(tmp_path: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``loadtest bench peer`` with the stand-in for heptaminid (it logs its PIDs to
    tmp_path/pids)."""
    stand_in = tmp_path / "heptaminid"
    stand_in.write_text(STAND_IN.format(python=sys.executable, pids=str(tmp_path / "pids")))
    stand_in.chmod(0o755)
    command = [
        sys.executable,
        "-m",
        "loadtest",
        "bench",
        "peer",
        "--heptaminid",
        str(stand_in),
        *args,
        "--json",
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=check)


@pytest.mark.skipif(not DEFAULT_BURST.exists(), reason="needs ../shared/bench/burst.py")
def test_peer_runs_both_daemons_alternately_and_stops_them(tmp_path: Path) -> None:
    out = peer(tmp_path, "--scenario", "pings", "--runs", "2", "--duration", "1")
    summary = orjson.loads(out.stdout.strip().splitlines()[-1])
    order = [run["daemon"] for run in summary["runs"]]
    assert order == ["governor", "heptaminid", "heptaminid", "governor"]
    for run in summary["runs"]:
        assert run["errors"] == 0
        assert run["rate"] > 0
        assert run["cpu_us_per_job"] > 0
    ratios = summary["governor_over_heptaminid"]
    assert ratios["rate"] > 0
    assert ratios["cpu"] > 0
    # Both stand-in daemons were started, and each is gone: stopped by its PID.
    started = [int(line) for line in (tmp_path / "pids").read_text().split()]
    assert len(started) == 2
    for pid in started:
        assert not Path(f"/proc/{pid}").exists()


@pytest.mark.skipif(not DEFAULT_BURST.exists(), reason="needs ../shared/bench/burst.py")
def test_the_floor_answers_burst_s_admitted_jobs_in_the_rotation(tmp_path: Path) -> None:
    """The bare uvloop server completes burst.py's admitted jobs (their chunks hashed), and
    joins the rotation with its own medians and ratios."""
    out = peer(tmp_path, "--floor", "--scenario", "admitted", "--runs", "1", "--duration", "1")
    summary = orjson.loads(out.stdout.strip().splitlines()[-1])
    assert [run["daemon"] for run in summary["runs"]] == ["governor", "heptaminid", "floor"]
    assert all(run["errors"] == 0 for run in summary["runs"])
    floor = summary["median"]["floor"]
    assert floor["rate"] > 0
    assert floor["cpu_us_per_job"] > 0
    assert summary["floor_over_heptaminid"]["rate"] > 0
    refused = peer(tmp_path, "--floor", "--scenario", "pings", "--runs", "1", check=False)
    assert refused.returncode == 2
    assert "admitted scenarios only" in refused.stdout


BASELINE_MAIN = """import os, sys
with open({marker!r}, "a") as f:
    f.write(f"{{os.getcwd()}}\\n")
os.chdir({root!r})  # (this tree is a stand-in: the governor it runs is this repository's)
os.execv(sys.executable, [sys.executable, "-m", "governor", *sys.argv[1:]])
"""


@pytest.mark.skipif(not DEFAULT_BURST.exists(), reason="needs ../shared/bench/burst.py")
def test_a_baseline_tree_s_governor_joins_the_rotation(tmp_path: Path) -> None:
    """``--baseline-tree``: the other checkout's governor is started from that checkout, in the
    rotation, with its ratio to this one's; a folder that is no checkout is refused."""
    tree = tmp_path / "before"
    (tree / "governor").mkdir(parents=True)
    (tree / "governor" / "__init__.py").write_text("")
    marker = tmp_path / "baseline-started"
    root = Path(__file__).resolve().parents[2]
    main = BASELINE_MAIN.format(marker=str(marker), root=str(root))
    (tree / "governor" / "__main__.py").write_text(main)
    out = peer(tmp_path, "--baseline-tree", str(tree), "--scenario", "pings", "--runs", "1")
    summary = orjson.loads(out.stdout.strip().splitlines()[-1])
    assert [run["daemon"] for run in summary["runs"]] == ["governor", "heptaminid", "baseline"]
    assert marker.read_text().split() == [str(tree)]  # started once, from that checkout
    assert summary["median"]["baseline"]["rate"] > 0
    assert summary["governor_over_baseline"]["rate"] > 0
    refused = peer(tmp_path, "--baseline-tree", str(tmp_path), "--runs", "1", check=False)
    assert refused.returncode == 2
    assert "not a checkout" in refused.stdout


@pytest.mark.skipif(not DEFAULT_BURST.exists(), reason="needs ../shared/bench/burst.py")
def test_hotpath_samples_the_admitted_path_step_by_step_and_stops_its_daemon() -> None:
    """``loadtest bench hotpath``: a real daemon under burst.py, sampled by py-spy; the steps of the
    path each get a share, and the table adds up to the CPU measured a job."""
    command = [sys.executable, "-m", "loadtest", "bench", "hotpath", "--duration", "2", "--json"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    summary = orjson.loads(out.stdout.strip().splitlines()[-1])
    assert summary["jobs"] > 0
    assert summary["samples"] > 0
    steps = {row["step"]: row for row in summary["steps"]}
    # The path's own steps are seen: a frame decoded, an upload hashed, a decision, a reply
    # written (where they run as Python: py-spy sees no frame of a compiled module).
    seen = ["runner (stub)", "the job's log line"]
    assert summary["pure"] == (set(compiled.status().values()) == {"pure"})
    if summary["pure"]:
        seen += ["frames:", "upload:", "admission:", "execution:", "socket writes"]
    for step in seen:
        assert any(name.startswith(step) for name in steps), (step, list(steps))
    assert sum(row["share"] for row in steps.values()) == pytest.approx(1, abs=0.01)
    total_us = sum(row["us_per_job"] for row in steps.values())
    assert total_us == pytest.approx(summary["cpu_us_per_job"], rel=0.01)
    assert not Path(f"/proc/{summary['daemon_pid']}").exists()
