"""``soak``: mixed load with faults for minutes on end, watching the daemon for leaks.

Starts a governor (``--runner stub``, a few ms per job, by default; ``--runner llama`` for the
embedded model in worker processes) on 127.0.0.1, or drives the one at ``--addr`` (give its
``--pid`` to read its memory and find its workers, and ``--daemon-log`` to count its
tracebacks). For ``--minutes`` it runs, at once:

* ``--clients`` clients sending jobs back to back (raw uploads and job specs, retrying on
  yield as the hints say);
* one fault every ``--fault-every-ms``, in turn: a job cancelled while it runs, a connection
  dropped (RST) mid-upload and one mid-run, a slow reader (a tiny receive buffer, pings
  pipelined until the kernel's buffers are full, nothing read; held ``--slow-hold-s``), a
  connection sending garbage lines; with the llama runner, every ``--kill-every-s``, a
  worker process SIGKILLed (a child of the daemon, from ``/proc/PID/task/*/children``).

Every ``--sample-s`` it records the daemon's resident memory (``VmRSS``), its open connections
and running jobs (a ping's ``server.connections`` and ``backend.inflight``, the monitor's own
connection not counted) and the tracebacks in its stderr so far. Then it stops the load, waits
up to ``--settle-s`` for the daemon to settle and reports: memory first, last and peak, and
whether it stayed flat (the last third of the samples within 10 % of the first third after the warm-up), slots
still held after settling (leaked), connections still open, tracebacks, and jobs by kind and
outcome. Exit status 1 if a slot leaked, a traceback appeared, or the daemon died; 2 if it could
not be started or reached. Connects to 127.0.0.1 (or ``--addr``) only; stops only the daemon it
started, by its PID; every run ends within ``--minutes`` plus the settling and a margin.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clients.client import ClientError, GovernorClient

from ...support.connections import run_loop
from ...support.options import parse_addr, positive_float, positive_int, print_json
from .daemon import Daemon, LogFileWatch, start_daemon
from .load import FAULT_TIMEOUT_S, Load
from .samples import Sample, memory_verdict, take_sample

NAME = "soak"


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME,
        help="mixed load with faults for minutes: memory, slots, tracebacks",
        description=__doc__,
    )
    parser.add_argument(
        "--minutes", type=positive_float, default=5.0, help="how long the load and faults run"
    )
    parser.add_argument(
        "--runner",
        choices=("stub", "llama"),
        default="stub",
        help="the runner of the daemon started here",
    )
    parser.add_argument("--stub-ms", type=int, default=5, help="stub: milliseconds per job")
    parser.add_argument("--max-inflight", type=positive_int, default=4, help="the daemon's slots")
    parser.add_argument(
        "--addr", type=parse_addr, metavar="HOST:PORT", help="drive this daemon, start none"
    )
    parser.add_argument("--pid", type=int, help="with --addr: the daemon's PID (memory, workers)")
    parser.add_argument(
        "--daemon-log", type=Path, help="with --addr: the daemon's stderr, to count tracebacks"
    )
    parser.add_argument(
        "--clients", type=positive_int, default=4, help="clients sending jobs back to back"
    )
    parser.add_argument(
        "--fault-every-ms", type=positive_int, default=50, help="one fault this often"
    )
    parser.add_argument(
        "--slow-readers", type=positive_int, default=4, help="slow readers at once, at most"
    )
    parser.add_argument(
        "--slow-hold-s", type=positive_float, default=5.0, help="seconds each slow reader is held"
    )
    parser.add_argument(
        "--kill-every-s",
        type=positive_float,
        default=20.0,
        help="llama: SIGKILL a worker this often",
    )
    parser.add_argument(
        "--sample-s", type=positive_float, default=5.0, help="seconds between samples"
    )
    parser.add_argument(
        "--warmup-s",
        type=float,
        help="samples before this are warm-up (default: a quarter of the run, at most 60 s)",
    )
    parser.add_argument(
        "--settle-s",
        type=positive_float,
        default=15.0,
        help="seconds to wait at most, after the load, for the daemon to settle",
    )
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag for the daemon's 'governor serve' (repeat: --serve-arg=--write-timeout=2)",
    )
    parser.add_argument("--seed", type=int, default=0, help="of the load's random draws")


async def soak(
    args: argparse.Namespace,
    host: str,
    port: int,
    pid: int | None,
    tracebacks: Callable[[], int | None],
) -> dict[str, Any]:
    duration = args.minutes * 60
    warmup = args.warmup_s if args.warmup_s is not None else min(duration / 4, 60.0)
    load = Load(args, host, port, pid)
    stop = asyncio.Event()
    samples: list[Sample] = []
    async with await GovernorClient.connect(host, port) as monitor:
        t0 = time.monotonic()
        samples.append(await take_sample(monitor, pid, t0, tracebacks))
        for _ in range(args.clients):
            load.spawn(load.client(stop))
        load.spawn(load.faults_loop(stop))
        if args.runner == "llama" and pid is not None:
            load.spawn(load.worker_kills(stop))
        while (left := duration - (time.monotonic() - t0)) > 0:
            await asyncio.sleep(min(args.sample_s, left))
            samples.append(await take_sample(monitor, pid, t0, tracebacks))
        # Stop: no new work; what is in flight ends (or is cut off) on its own timeouts.
        stop.set()
        load_ended = time.monotonic()
        tasks = set(load.tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=FAULT_TIMEOUT_S + args.slow_hold_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if not task.cancelled() and (exc := task.exception()) is not None:
                raise exc  # a bug in the soak itself, not an outcome
        # Settle: the daemon ends its jobs and closes the connections of clients gone.
        settled = await take_sample(monitor, pid, t0, tracebacks)
        deadline = time.monotonic() + args.settle_s
        while (settled.inflight != 0 or settled.connections != 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            settled = await take_sample(monitor, pid, t0, tracebacks)
        settle_s = time.monotonic() - load_ended
    jobs = load.jobs.as_dict()
    totals: collections.Counter[str] = collections.Counter()
    for kind in ("spec", "upload"):
        for outcome, n in jobs.get(kind, {}).items():
            bucket = outcome if outcome in ("done", "yielded") else "errored"
            totals[bucket] += n
    return {
        "command": NAME,
        "runner": args.runner,
        "minutes": args.minutes,
        "samples": [dataclasses.asdict(s) for s in samples],
        "memory": memory_verdict(samples, warmup),
        "settled": dataclasses.asdict(settled),
        "settle_s": round(settle_s, 1),
        "leaked_slots": settled.inflight,
        "connections_after_settle": settled.connections,
        "tracebacks": tracebacks(),
        "jobs_total": {k: totals.get(k, 0) for k in ("done", "yielded", "errored")},
        "jobs": jobs,
        "faults": load.faults.as_dict(),
    }


def run(args: argparse.Namespace) -> int:
    if args.addr is not None and args.runner == "llama" and args.pid is None:
        print("loadtest soak: --runner llama with --addr needs --pid to find the workers")
        return 2
    daemon: Daemon | None = None
    log_watch: LogFileWatch | None = None
    try:
        if args.addr is None:
            daemon = start_daemon(args)
            host, port, pid = daemon.host, daemon.port, daemon.proc.pid
            watch = daemon.stderr

            def tracebacks() -> int | None:
                return watch.tracebacks
        else:
            (host, port), pid = args.addr, args.pid
            if args.daemon_log is not None:
                log_watch = LogFileWatch(args.daemon_log)
            watch_file = log_watch

            def tracebacks() -> int | None:
                if watch_file is None:
                    return None
                watch_file.poll()
                return watch_file.tracebacks
    except OSError as exc:
        print(f"loadtest soak: {exc}")
        return 2
    try:
        report = run_loop(soak(args, host, port, pid, tracebacks))
    except (OSError, ClientError) as exc:
        print(f"loadtest soak: cannot drive the daemon at {host}:{port}: {exc}")
        return 2
    finally:
        died = daemon is not None and daemon.proc.poll() is not None
        exit_status = daemon.stop() if daemon is not None else None
    report["daemon_died"] = died
    report["daemon_exit_status"] = exit_status
    first = (
        daemon.stderr.first_traceback
        if daemon
        else (log_watch.first_traceback if log_watch else [])
    )
    report["first_traceback"] = first or None
    if daemon is not None:
        report["tracebacks"] = daemon.stderr.tracebacks  # through the drain too
    mem = report["memory"]
    rss = mem["rss_kib"]
    print(
        f"soak {args.minutes:g} min ({args.runner}): jobs {report['jobs_total']}, faults "
        + ", ".join(f"{k} {sum(v.values())}" for k, v in report["faults"].items())
    )
    if rss is not None:
        print(
            f"daemon RSS first {rss['first'] / 1024:.1f} MiB, last {rss['last'] / 1024:.1f} MiB, "
            f"max {rss['max'] / 1024:.1f} MiB; after warm-up {mem['rss_after_warmup_kib'] / 1024:.1f}"
            f" -> {mem['rss_final_kib'] / 1024:.1f} MiB: {'flat' if mem['flat'] else 'GROWING'}"
        )
    print(
        f"after {report['settle_s']} s settling: {report['leaked_slots']} slot(s) held, "
        f"{report['connections_after_settle']} connection(s) open; "
        f"{report['tracebacks']} traceback(s); daemon died: {died}"
    )
    print_json(args, report)
    leaked = report["leaked_slots"] != 0
    return 1 if leaked or bool(report["tracebacks"]) or died else 0
