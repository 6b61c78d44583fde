"""``sdk-bench``: the official OpenAI SDK against the governor's front door and a baseline
server, side by side in one run.

N clients, each an ``openai.AsyncOpenAI`` with the SDK's defaults (two retries, which sleep a
429's ``retry-after-ms``, unless ``--max-retries``: 0 is a client that never retries, as most
scripts and tools are; its own timeout unless ``--request-timeout``), start together and each send
``--requests-per-client`` streamed chat completions one after the other: a short question that
differs per request (by its number only, so that each is as much work), ``--max-tokens`` new
tokens, temperature 0, a seed, ``include_usage``. Nothing here retries or paces them: what is
measured is what an unmodified SDK user gets.

Servers, each started here on a free loopback port for its run and stopped by its PID after it:

* ``governor``: ``governor serve --runner llama --max-inflight K --threads T --http-listen ...``
  on the embedded model (``--runner stub`` for a quick run without the model): when its K slots
  are taken a request waits at the door for its turn, within the daemon's ``max_wait`` (30 s);
  one whose turn is further off is answered 429 with its hint, which the SDK retries;
* ``baseline`` (``--baseline``): ``llama-cpp-python``'s own server on the same model
  (:mod:`loadtest.support.baseline_server`), which queues every request and runs one at a time;
  or ``llama-server``, llama.cpp's own (:mod:`loadtest.support.llama_server`) with
  ``-np K``, the governor's K slots, and ``--n-ctx`` in each, which queues what its slots do not
  take; or ``none`` (also ``--no-baseline``).

Runs alternate (governor, baseline, baseline, governor, ...), ``--rounds`` of each, so that a
drift of this shared machine falls on both. Each run reports requests ok and failed (by the
exception the SDK raised), goodput (ok requests and completion tokens per second of the run's
wall time; tokens from ``usage`` where the server reports it, else the content deltas
counted), TTFT (from the first send, the SDK's retries included, to the first content delta)
and end-to-end latency, p50 and p99 by nearest rank, and the HTTP statuses the SDK got (read
by an httpx event hook: every 429 it retried, or raised once its retries were spent). The
summary gives each server's medians and the governor's ratios to the baseline; with ``--json`` the
last line of stdout is the whole report as JSON (also written to ``--out DIR``). Latencies are of the
requests that succeeded: a request the SDK gave up on counts in ``failed`` only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from clients.helptext import RawDescriptionDefaultsHelpFormatter, add_renamed

from ...support import llama_server
from ...support.arguments import add_llama_server, add_model, add_n_ctx, add_threads
from ...support.connections import run_loop
from ...support.options import (
    non_negative_int,
    positive_float,
    positive_int,
    print_json,
)
from ...support.processes import stop
from ...support.stats import alternating
from .clients import load, max_retries
from .rows import SERVERS, line, run_row, summarize
from .servers import launch

NAME = "sdk-bench"
BASELINES = ("llama-cpp-python", "llama-server", "none")
RUNNERS = ("llama", "stub")


async def bench(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    import openai

    from governor.runners.llama.runner import embedded_model_path

    model = (args.model or embedded_model_path()).resolve()
    servers = ["governor"] if baseline(args) == "none" else list(SERVERS)
    report: dict[str, Any] = {
        "command": NAME,
        "model": model.name,
        "governor_runner": args.runner,
        "clients": args.clients,
        "requests_per_client": args.requests_per_client,
        "max_tokens": args.max_tokens,
        "max_inflight": args.max_inflight,
        "threads": args.threads,
        "n_ctx": args.n_ctx,
        "timeout": args.request_timeout,
        "sdk": f"openai {openai.__version__}",
        "sdk_max_retries": max_retries(args),
        "baseline": baseline(args),
        "logs": str(logs),
        "argv": {},
        "runs": [],
    }
    for k, name in enumerate(alternating(servers, args.rounds)):
        started = launch(name, args, model, logs / f"{k}-{name}.log")
        report["argv"][name] = started.argv
        try:
            run = await load(started.url, args)
        finally:
            stop(started.proc, 15.0)
        row = run_row(name, run)
        report["runs"].append(row)
        print(line(row), flush=True)
    report.update(summarize(report["runs"]))
    return report


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME,
        help="the OpenAI SDK's clients against the governor's front door and the baseline",
        description=__doc__,
        formatter_class=RawDescriptionDefaultsHelpFormatter,
    )
    parser.add_argument("--clients", type=positive_int, default=50, help="SDK clients at once")
    parser.add_argument(
        "--requests-per-client",
        type=positive_int,
        default=1,
        help="requests each client sends, one after the other",
    )
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="max_tokens a request")
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=2,
        help="runs of each server, alternating",
    )
    parser.add_argument(
        "--max-inflight",
        type=positive_int,
        default=4,
        help="the governor's slots, K",
    )
    add_threads(parser, default=2, text="both servers' threads")
    add_n_ctx(parser, text="both servers' n_ctx")
    add_renamed(
        parser,
        "--timeout",
        parser.add_argument(
            "--request-timeout",
            type=positive_float,
            help="seconds a request may take, the SDK's timeout (default: the SDK's own)",
        ),
    )
    parser.add_argument(
        "--run-timeout",
        type=positive_float,
        default=600.0,
        help="seconds a run may take; requests outstanding then fail as RunTimeout",
    )
    parser.add_argument(
        "--runner",
        choices=RUNNERS,
        default="llama",
        help="the governor's runner: llama (the model) or stub (only takes --stub-ms, for a "
        "quick run without the model)",
    )
    parser.add_argument(
        "--stub-ms", type=positive_int, default=300, help="--runner stub: a job's time"
    )
    parser.add_argument(
        "--max-retries",
        type=non_negative_int,
        help="the SDK's max_retries: 0 is a client that never retries (default: the SDK's own, "
        "openai.DEFAULT_MAX_RETRIES)",
    )
    parser.add_argument(
        "--baseline",
        choices=BASELINES,
        default=BASELINES[0],
        help="the server beside the governor: llama-cpp-python's (one request at a time), "
        "llama.cpp's llama-server with -np K (the governor's K slots), or none",
    )
    parser.add_argument("--no-baseline", action="store_true", help="the same as --baseline none")
    add_llama_server(
        parser,
        text=f"--baseline llama-server: its binary (where {llama_server.BUILD_SCRIPT} puts it)",
    )
    add_model(parser)
    parser.add_argument(
        "--governor-arg",
        action="append",
        default=[],
        help="one more argument for governor serve (repeat it), e.g. --lanes=true",
    )
    parser.add_argument(
        "--out", type=Path, metavar="DIR", help="write sdk-bench.json and the servers' logs here"
    )


def baseline(args: argparse.Namespace) -> str:
    """The baseline that runs: ``--baseline``, or none with ``--no-baseline``."""
    return "none" if args.no_baseline else str(args.baseline)


def run(args: argparse.Namespace) -> int:
    try:
        import openai  # noqa: F401  (a test dependency of the governor, not a runtime one)
    except ImportError:
        print(f"loadtest {NAME}: needs the openai package (pip install openai)", file=sys.stderr)
        return 2
    if baseline(args) == "llama-server" and not args.llama_server.is_file():
        print(
            f"loadtest {NAME}: no {args.llama_server}: build it with {llama_server.BUILD_SCRIPT}",
            file=sys.stderr,
        )
        return 2
    if args.out is not None:
        logs = args.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
    else:
        logs = Path(tempfile.mkdtemp(prefix="sdk-bench-"))
    try:
        report = run_loop(bench(args, logs))
    except RuntimeError as exc:  # a server that did not start
        print(f"loadtest {NAME}: {exc} (logs: {logs})", file=sys.stderr)
        return 1
    for name, m in report["median"].items():
        label = f"baseline ({report['baseline']})" if name == "baseline" else name
        print(f"median {label}: {json.dumps(m)}")
    if "governor_over_baseline" in report:
        print(f"governor / baseline: {json.dumps(report['governor_over_baseline'])}")
    if args.out is not None:
        (args.out / "sdk-bench.json").write_text(json.dumps(report, indent=2) + "\n")
    print_json(args, report)
    return 0
