"""``guidellm-bench``: guidellm, a client that never retries, against the governor's front door
and llama.cpp's ``llama-server`` on the same model, side by side in one run.

Why guidellm: it is the benchmark people already point at OpenAI-compatible servers (the vLLM
project's, kept up and widely used), and like most clients (curl scripts, LangChain's defaults)
it never retries a 429: a refused request is an error in its report. Its figures are the ones a
user of the governor will get from it; a client written here would measure what we chose to
measure. It is an optional tool in a virtualenv of its own (it pins click below the version the
project has, and pulls in torch): see :data:`SETUP_VENV`, printed when it is missing.

Servers, each started here on a free loopback port for its run and stopped by its PID after it:

* ``governor``: ``governor serve --runner llama --model M --max-inflight S --lanes true
  --threads T --kv-layout slots --n-ctx C/S --http-listen 127.0.0.1:PORT --listen 127.0.0.1:0``
  (``--kv-capacity C`` with ``--kv-layout pool``) and ``--extra-governor-args``; ready once its
  front door answers ``/v1/models``;
* ``llama-server``: ``llama-server -m M -np S -c C -t T`` (``deploy/build-llama-server.sh``),
  ``C`` enough for S slots of the run's requests; ready once ``/health`` answers.

Both get the same KV cache, ``C`` cells (``--server-ctx``), each request the same context
(``C/S`` a slot): a larger cache costs memory and, in a pool, every decode step, so the two are
compared on equal memory.

Runs alternate (governor, llama-server, llama-server, governor, ...), ``--rounds`` of each, so
that a drift of this shared machine falls on both. Each run sends one chat first (not counted:
neither server's first-request costs fall in a run), then runs ``guidellm run`` with its
concurrent profile: ``--concurrency`` streams, ``--requests`` requests in all, synthetic prompts
of ``--prompt-tokens`` tokens (after a prefix of ``--prefix-tokens`` that all share, where
asked: a repeated system prompt), each asking for ``--output-tokens`` tokens (guidellm sends
``ignore_eos``, which both servers honour), streamed chat completions. guidellm first GETs
``/health`` and refuses a server that does not answer 200 (``--no-health-check`` turns that off).

guidellm makes its synthetic prompts with a Hugging Face tokenizer, which it would fetch from
the hub by the model's name; this machine has no network. transformers reads the tokenizer out
of the GGUF file itself (``gguf_file``, with the ``gguf`` package), so guidellm is pointed at the
model's folder and file, and runs with the hub's offline switches set.

Each run's row is read from guidellm's JSON report: requests successful, errored (by what
guidellm recorded, e.g. an HTTP 429) and incomplete, output tokens per second (of the successful
requests, over the run: guidellm's own figure), TTFT, ITL and TPOT p50 and p99 in ms, and request
latency p50 and p99 in ms (guidellm's percentiles, of the successful requests). The summary gives
each server's medians, the governor's ratios to llama-server, and the front door's targets (no
request errored, output tokens/s at least 0.9x llama-server's, TTFT p99 no worse). With
``--json``, the last line of stdout is the whole report as JSON (also written to ``--out DIR``,
with guidellm's reports and every log). The exit status is 1 when a run left no report (guidellm refused to
start, failed or ran past ``--run-timeout``: the row says why), whatever the figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from clients.helptext import RawDescriptionDefaultsHelpFormatter

from ...support import llama_server
from ...support.arguments import add_llama_server, add_model, add_threads
from ...support.options import non_negative_int, positive_float, positive_int, print_json
from ...support.processes import REPO, stop
from ...support.stats import alternating
from .argv import guidellm_command, guidellm_env, mix_rows, server_ctx
from .rows import SERVERS, failed_row, failure_reason, line, run_row, summarize
from .servers import launch, run_guidellm, warm_up

NAME = "guidellm-bench"

# What the bench venv holds: pyproject.toml's `bench` extra, checked against it by a test.
BENCH_REQUIREMENTS = ("guidellm==0.8.1", "gguf>=0.10")

# torch 2.13.0: on these machines pip takes it from a CPU build on disk; an unpinned torch is a
# CUDA build of several GB (guidellm imports torch for its data loader, so it cannot be left out).
SETUP_VENV = "python3 -m venv .venv-bench && .venv-bench/bin/pip install torch==2.13.0 " + " ".join(
    f"'{r}'" for r in BENCH_REQUIREMENTS
)
DEFAULT_GUIDELLM = REPO / ".venv-bench" / "bin" / "guidellm"


def default_guidellm() -> str:
    """The bench venv's guidellm where it exists, else ``guidellm`` on PATH."""
    return str(DEFAULT_GUIDELLM) if DEFAULT_GUIDELLM.exists() else "guidellm"


def one_run(
    k: int, name: str, args: argparse.Namespace, model: Path, logs: Path, mix: Path | None
) -> dict[str, Any]:
    """Start ``name``, warm it up, run guidellm against it, stop it; the run's row."""
    report_path, log = logs / f"{k}-{name}-guidellm.json", logs / f"{k}-{name}-guidellm.log"
    started = launch(name, args, model, logs / f"{k}-{name}.log")
    try:
        warm_up(started.url, args.output_tokens)
        argv = guidellm_command(args, started.url, model, report_path, mix)
        t0 = time.monotonic()
        status = run_guidellm(argv, guidellm_env(args), log, args.run_timeout)
        wall = time.monotonic() - t0
    finally:
        stop(started.proc, 15.0)
    if status is None:
        row = failed_row(name, f"timed out after {args.run_timeout:g} s")
    elif status != 0 or not report_path.exists():
        reason = failure_reason(log.read_text(errors="replace")) or f"see {log}"
        row = failed_row(name, f"guidellm exited {status}: {reason}")
    else:
        row = run_row(name, json.loads(report_path.read_text()))
    row.update(guidellm_exit=status, guidellm_wall_s=round(wall, 1), argv=started.argv)
    return row


def guidellm_version(exe: str) -> str | None:
    try:
        done = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def bench(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    from governor.runners.llama.runner import embedded_model_path

    model = (args.model or embedded_model_path()).resolve()
    report: dict[str, Any] = {
        "command": NAME,
        "model": model.name,
        "guidellm": guidellm_version(args.guidellm),
        "servers": list(args.servers),
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "requests": args.requests,
        "prompt_tokens": None if args.rewrite_share else args.prompt_tokens,
        "prefix_tokens": args.prefix_tokens,
        "rewrite_share": args.rewrite_share,
        "output_tokens": args.output_tokens,
        "slots": args.slots,
        "threads": args.threads,
        "server_ctx": server_ctx(args),
        "health_check": not args.no_health_check,
        "client_processes": args.client_processes,
        "logs": str(logs),
        "runs": [],
    }
    mix = None
    if args.rewrite_share:
        mix = logs / "mix.jsonl"
        rows = mix_rows(args.requests, args.rewrite_share, args.output_tokens)
        mix.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for k, name in enumerate(alternating(args.servers, args.rounds)):
        row = one_run(k, name, args, model, logs, mix)
        report["runs"].append(row)
        print(line(row), flush=True)
    report.update(summarize(report["runs"], mix=mix is not None))
    return report


def share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a share, from 0 to 1")
    return value


def parse_servers(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names or any(n not in SERVERS for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: distinct names among {','.join(SERVERS)}")
    return names


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME,
        help="guidellm (never retries) against the governor's front door and llama-server",
        description=__doc__,
        formatter_class=RawDescriptionDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--concurrency", type=positive_int, default=16, help="guidellm's concurrent streams"
    )
    parser.add_argument(
        "--requests", type=positive_int, default=64, help="requests in a run, in all"
    )
    parser.add_argument(
        "--prompt-tokens", type=positive_int, default=128, help="a synthetic prompt's tokens"
    )
    parser.add_argument(
        "--output-tokens", type=positive_int, default=64, help="tokens each request generates"
    )
    parser.add_argument(
        "--prefix-tokens",
        type=non_negative_int,
        default=0,
        help="a prefix of this many tokens before every synthetic prompt, the same for all "
        "(a shared system prompt; 0: none)",
    )
    parser.add_argument(
        "--rewrite-share",
        type=share,
        default=0.0,
        help="a mix: this share of the requests rewrites of 200-300 words, the rest one-line "
        "chat questions (0: guidellm's synthetic prompts of --prompt-tokens)",
    )
    parser.add_argument("--rounds", type=positive_int, default=2, help="runs of each server")
    parser.add_argument(
        "--servers",
        type=parse_servers,
        default=SERVERS,
        help="which servers run, comma-separated",
    )
    parser.add_argument(
        "--slots",
        type=positive_int,
        default=4,
        help="the governor's --max-inflight and llama-server's -np",
    )
    add_threads(parser, default=2, text="both servers' threads")
    parser.add_argument(
        "--kv-layout",
        choices=("pool", "slots"),
        default="slots",
        help="the governor's KV cache: a stream of a llama-server slot's context for each "
        "slot, as llama-server has (the governor's default), or one pool of llama-server's "
        "cells",
    )
    parser.add_argument(
        "--server-ctx",
        type=positive_int,
        help="llama-server's -c, all slots together (default: room in each slot for a prompt, "
        "the chat template and the output)",
    )
    add_model(parser)
    parser.add_argument(
        "--guidellm",
        default=default_guidellm(),
        help=f"guidellm's executable (made by: {SETUP_VENV})",
    )
    add_llama_server(
        parser, text=f"llama-server binary (where {llama_server.BUILD_SCRIPT} puts it)"
    )
    parser.add_argument(
        "--extra-governor-args",
        metavar="ARGS",
        help="more arguments for governor serve, one string split as the shell would, e.g. "
        "--extra-governor-args='--max-wait 30'",
    )
    parser.add_argument(
        "--extra-llama-server-args",
        metavar="ARGS",
        help="more arguments for llama-server, likewise",
    )
    parser.add_argument(
        "--no-health-check",
        action="store_true",
        help="guidellm skips its GET /health before a run (for a governor without one)",
    )
    parser.add_argument(
        "--client-processes",
        type=positive_int,
        default=1,
        help="guidellm's worker processes (GUIDELLM__MAX_WORKER_PROCESSES)",
    )
    parser.add_argument(
        "--run-timeout",
        type=positive_float,
        default=600.0,
        help="seconds guidellm may take for a run; then it is stopped and the run has no report",
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="write guidellm-bench.json, guidellm's reports and every log here",
    )


def missing(args: argparse.Namespace) -> str | None:
    """Why the run cannot start (a tool not installed), or None."""
    found = shutil.which(args.guidellm)
    if found is None:
        return f"no guidellm at {args.guidellm!r}; make the bench venv with: {SETUP_VENV}"
    args.guidellm = str(Path(found).resolve())  # the runs start in other directories
    if "llama-server" in args.servers and not args.llama_server.is_file():
        return f"no {args.llama_server}: build it with {llama_server.BUILD_SCRIPT}"
    return None


def run(args: argparse.Namespace) -> int:
    why = missing(args)
    if why is not None:
        print(f"loadtest {NAME}: {why}", file=sys.stderr)
        return 2
    if args.out is not None:
        logs = args.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
    else:
        logs = Path(tempfile.mkdtemp(prefix="guidellm-bench-"))
    try:
        report = bench(args, logs.resolve())
    except RuntimeError as exc:  # a server that did not start, or a failed warm-up
        print(f"loadtest {NAME}: {exc} (logs: {logs})", file=sys.stderr)
        return 1
    for name, m in report["median"].items():
        print(f"median {name}: {json.dumps(m)}")
    if "governor_over_llama_server" in report:
        print(f"governor / llama-server: {json.dumps(report['governor_over_llama_server'])}")
        print(f"targets: {json.dumps(report['targets'])}")
    if args.out is not None:
        (args.out / "guidellm-bench.json").write_text(json.dumps(report, indent=2) + "\n")
    print_json(args, report)
    return 1 if any(r.get("guidellm_failed") for r in report["runs"]) else 0
