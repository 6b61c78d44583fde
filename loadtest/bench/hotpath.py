"""``hotpath``: where the governor's CPU goes on the admitted path, step by step, per job.

Starts the governor's stub daemon (0 ms jobs, ``--max-inflight 64``, its defaults otherwise,
``--governor-arg`` for more) on a free loopback port, loads it with heptamini's ``admitted``
scenario (burst.py: 64 clients on reused connections, a 64-byte payload uploaded in one chunk
a job), and meanwhile samples it with py-spy (``--gil``: only the thread holding the GIL, so
only the process's own work, never its idle waits). Each sample goes to one step of the path:
that of the innermost frame of its stack that :data:`STEPS` names (by function or by module); a
sample in none (uvloop's own loop, its socket reads) to ``event loop``. The table gives each
step's share of the samples, and the CPU time a job that share stands for: the daemon's
(``/proc/PID/stat``) over the jobs finished in a run of the same load just before the sampled
one, since sampling costs the daemon some. Then the busiest functions.

The table is the pure build's (``deploy/compile.py --clean`` first): a module compiled with mypyc
runs as C, with no Python frame for py-spy to see, so its time goes to the step that called it.
The command says which build it measured.

py-spy comes with the ``loadtest`` extra. It reads the process from outside (ptrace): as root,
or where ``kernel.yama.ptrace_scope`` lets a user trace its own children.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from governor import compiled

from ..support.heptamini import DEFAULT_BURST, SCENARIOS, governor_command, load
from ..support.options import positive_float, positive_int, print_json
from ..support.processes import free_port, stop, wait_listening

NAME = "hotpath"

# A frame's function or file, and the step of the path it does (the first that matches).
STEPS: tuple[tuple[str, str], ...] = (
    ("GovernorProtocol.write (", "socket writes (transport.write)"),
    ("protocol/lines.py", "line reader: bytes to lines"),
    ("protocol/upload.py", "upload: manifest, base64, sha256"),
    ("protocol/", "frames: decode requests, encode replies"),
    ("governor/listeners/tcp.py", "tcp listener: reads, turns, timers"),
    ("governor/listeners/session.py", "session rules"),
    ("governor/listeners/jobs.py", "job table: upload bookkeeping"),
    ("governor/listeners/wire.py", "wire: replies, receipts"),
    ("governor/intake.py", "intake: prepare, start"),
    ("governor/core/", "admission: decision, ledger, tenants"),
    ("governor/execution.py", "execution: task, terminal frame, record"),
    ("governor/runners/", "runner (stub)"),
    ("governor/telemetry/logs.py", "the job's log line"),
    ("/logging/", "the job's log line"),
    ("governor/telemetry/metrics.py", "metrics"),
    ("prometheus_client/", "metrics"),
    ("governor/state.py", "server state"),
)
LOOP = "event loop: uvloop, socket reads"
ROOTS = ("governor/cli.py", "governor/__main__.py")  # (every stack passes through them)
_FILE = re.compile(r"\(([^()]*):\d+\)$")


def step_of(frame: str) -> str | None:
    """The step of one py-spy frame (``function (path:line)``); None: a frame of no step."""
    match = _FILE.search(frame)
    if match is None or any(root in match.group(1) for root in ROOTS):
        return None
    return next((name for key, name in STEPS if key in frame), None)


def attribute(folded: Iterable[str]) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """py-spy's raw output (``frame;frame;... count`` a line, the innermost frame last): the
    samples of each step, and of each innermost frame."""
    steps: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    for line in folded:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        n = int(count)
        step = next((s for f in reversed(frames) if (s := step_of(f)) is not None), LOOP)
        steps[step] += n
        leaves[frames[-1]] += n
    return steps, leaves


def table(steps: collections.Counter[str], cpu_us: float | None) -> list[dict[str, Any]]:
    """Each step's share of the samples and the CPU per job it stands for, busiest first."""
    total = sum(steps.values())
    return [
        {
            "step": name,
            "share": round(n / total, 4),
            "us_per_job": None if cpu_us is None else round(cpu_us * n / total, 1),
        }
        for name, n in steps.most_common()
    ]


def _us(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}"


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME, help="the admitted path's CPU per job, step by step (py-spy)", description=__doc__
    )
    parser.add_argument(
        "--burst", type=Path, default=DEFAULT_BURST, help="heptamini's load generator, burst.py"
    )
    parser.add_argument("--duration", type=positive_float, default=6.0, help="seconds of load")
    parser.add_argument("--rate", type=positive_int, default=1000, help="py-spy samples a second")
    parser.add_argument("--top", type=int, default=15, help="busiest functions to list")
    parser.add_argument(
        "--governor-arg",
        action="append",
        default=[],
        help="one more argument for governor serve (repeat it), e.g. --log-level=warning",
    )


def run(args: argparse.Namespace) -> int:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        print("loadtest bench hotpath: py-spy is not installed (pip install -e '.[loadtest]')")
        return 2
    if not args.burst.exists():
        print(f"loadtest bench hotpath: no {args.burst}")
        return 2
    pure = set(compiled.status().values()) == {"pure"}
    build = "pure Python" if pure else "compiled: its compiled steps count as their callers'"
    scenario = SCENARIOS["admitted"]
    port = free_port()
    daemon = subprocess.Popen(
        governor_command(scenario, port, args.governor_arg),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with tempfile.TemporaryDirectory(prefix="hotpath-") as tmp:
        samples = Path(tmp) / "samples.txt"
        try:
            wait_listening(port, daemon)
            time.sleep(0.5)  # (start-up work settles)
            # The CPU a job, unsampled (sampling costs the daemon some), then the shares.
            summary, cpu = load(args.burst, scenario, port, args.duration, daemon.pid)
            record = [spy, "record", "--pid", str(daemon.pid), "--gil", "--nonblocking"]
            record += ["--rate", str(args.rate), "--format", "raw", "--output", str(samples)]
            record += ["--duration", str(round(args.duration))]
            profiler = subprocess.Popen(record, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            sampled, sampled_cpu = load(args.burst, scenario, port, args.duration, daemon.pid)
            _, err = profiler.communicate(timeout=60)
        finally:
            stop(daemon)
        if profiler.returncode != 0 or not samples.exists():
            print(f"loadtest bench hotpath: py-spy failed: {err.decode(errors='replace').strip()}")
            return 1
        steps, leaves = attribute(samples.read_text().splitlines())
    done, rate = summary["done"], summary["done_per_s"]
    cpu_us = cpu / done * 1e6 if done else None
    sampled_us = sampled_cpu / sampled["done"] * 1e6 if sampled["done"] else None
    rows = table(steps, cpu_us)
    total = sum(steps.values())
    print(f"the hot path: {build}")
    print(f"{done} jobs, {rate} a second, {_us(cpu_us)} µs of CPU a job (unsampled)")
    print(f"then {total} samples, {_us(sampled_us)} µs of CPU a job while sampled")
    print(f"{'step':<45} {'share':>6} {'µs/job':>7}")
    for row in rows:
        us = "" if row["us_per_job"] is None else f"{row['us_per_job']:.1f}"
        print(f"{row['step']:<45} {row['share']:>6.1%} {us:>7}")
    print("busiest functions (innermost frame):")
    for frame, n in leaves.most_common(args.top):
        print(f"  {n / total:>6.1%}  {frame}")
    print_json(
        args,
        {
            "daemon_pid": daemon.pid,  # (sampled, then stopped by this PID)
            "pure": pure,
            "jobs": done,
            "jobs_per_s": rate,
            "sampled_cpu_us_per_job": None if sampled_us is None else round(sampled_us, 1),
            "cpu_us_per_job": None if cpu_us is None else round(cpu_us, 1),
            "samples": total,
            "steps": rows,
        },
    )
    return 0
