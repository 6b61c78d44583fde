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
  --threads T --kv-capacity C --n-ctx C/S --http-listen 127.0.0.1:PORT --listen 127.0.0.1:0``
  and ``--extra-governor-args``; ready once its front door answers ``/v1/models``;
* ``llama-server``: ``llama-server -m M -np S -c C -t T`` (``deploy/build-llama-server.sh``),
  ``C`` enough for S slots of the run's requests; ready once ``/health`` answers.

Both get the same KV cache, ``C`` cells (``--server-ctx``), each request the same context: a
larger cache costs every decode step (the governor's default, room for two jobs of ``n_ctx``
2048 and a quarter of that for each further slot, is 5,120 cells for 4 slots; llama-server's is
the model's training context), so the two are compared on equal memory.

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
import collections
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clients.helptext import RawDescriptionDefaultsHelpFormatter

from ..support import llama_server
from ..support.options import non_negative_int, positive_float, positive_int, print_json
from ..support.processes import REPO, free_port, stop, wait_http_ready
from ..support.stats import alternating, medians_by, ratio

NAME = "guidellm-bench"
SERVERS = ("governor", "llama-server")
READY_TIMEOUT_S = 180.0
# What the bench venv holds: pyproject.toml's `bench` extra, checked against it by a test.
BENCH_REQUIREMENTS = ("guidellm==0.8.1", "gguf>=0.10")
# torch 2.13.0: on these machines pip takes it from a CPU build on disk; an unpinned torch is a
# CUDA build of several GB (guidellm imports torch for its data loader, so it cannot be left out).
SETUP_VENV = "python3 -m venv .venv-bench && .venv-bench/bin/pip install torch==2.13.0 " + " ".join(
    f"'{r}'" for r in BENCH_REQUIREMENTS
)
DEFAULT_GUIDELLM = REPO / ".venv-bench" / "bin" / "guidellm"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# The chat template's tokens around a prompt, and some to spare, in each llama-server slot.
TEMPLATE_TOKENS = 128
# Figures whose medians are compared, governor over llama-server.
COMPARED = (
    "output_tok_s",
    "goodput_rps",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "latency_p50_ms",
    "latency_p99_ms",
)
COUNTS = ("successful", "errored", "incomplete")
# The targets: the governor over llama-server (docs/BENCHMARKS.md, "The batched runner against
# llama-server"): output at least as fast, the slowest first tokens no later, and with a mix of chats
# and rewrites half again as many requests within a chat's objectives.
MIN_OUTPUT_RATIO = 1.0
MAX_TTFT_P99_RATIO = 1.0
MIN_GOODPUT_RATIO = 1.5
# Goodput: requests with their first token within this and a mean gap between tokens within
# GOOD_ITL_MS, per second of the run (an errored request is a miss).
GOOD_TTFT_MS = 2000.0
GOOD_ITL_MS = 100.0
# A mix's rewrite: 200 to 300 words to rewrite (about 270 to 400 tokens), of sentences drawn
# from these; a chat is a one-line question.
REWRITE_WORDS = (200, 300)
MIX_PROMPT_TOKENS = 448  # the longest prompt of a mix, for the servers' contexts
SENTENCES = (
    "The harbour committee met on the first Tuesday of the month to review the ferry timetable.",
    "Several members asked whether the new pier could open before the summer season began.",
    "The treasurer noted that repairs to the lighthouse had cost more than was first planned.",
    "A local school offered to paint the waiting room if the council supplied the materials.",
    "Fishermen complained that the morning tide made the eastern slipway unsafe to use.",
    "The chair promised a written answer to every question raised before the next meeting.",
)
TOPICS = ("the sea", "a comet", "Rome", "a violin", "rain", "a volcano", "chess", "bread")


def default_guidellm() -> str:
    """The bench venv's guidellm where it exists, else ``guidellm`` on PATH."""
    return str(DEFAULT_GUIDELLM) if DEFAULT_GUIDELLM.exists() else "guidellm"


# Command lines -----------------------------------------------------------------------------


def synthetic(args: argparse.Namespace) -> dict[str, int]:
    """guidellm's synthetic prompts: --prompt-tokens each, after the --prefix-tokens that all
    share where asked (a system prompt every request repeats: what prefix reuse is for)."""
    fields = {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens}
    if args.prefix_tokens:
        fields |= {"prefix_tokens": args.prefix_tokens, "prefix_count": 1}
    return fields


def server_ctx(args: argparse.Namespace) -> int:
    """llama-server's ``-c``: ``--server-ctx``, else each of the slots room for a prompt of
    ``--prompt-tokens``, the chat template and ``--output-tokens``, in whole 256s."""
    if args.server_ctx is not None:
        return int(args.server_ctx)
    prompt = MIX_PROMPT_TOKENS if args.rewrite_share else args.prompt_tokens + args.prefix_tokens
    need: int = prompt + args.output_tokens + TEMPLATE_TOKENS
    slots: int = args.slots
    return slots * -(-need // 256) * 256


def governor_command(args: argparse.Namespace, model: Path, port: int) -> list[str]:
    """The governor with llama-server's KV cache: as many cells (its ``-c``), each job's
    context as long as a llama-server slot's (a larger cache costs every decode step, so the
    two are compared on equal memory); with ``--kv-layout slots``, as llama-server has them,
    a stream of that context for each slot (and one for the health probe)."""
    cells = server_ctx(args)
    cache = ["--kv-capacity", str(cells)] if args.kv_layout == "pool" else ["--kv-layout", "slots"]
    return [
        sys.executable,
        "-m",
        "governor",
        "serve",
        "--runner",
        "llama",
        "--model",
        str(model),
        "--max-inflight",
        str(args.slots),
        "--lanes",
        "true",
        "--threads",
        str(args.threads),
        *cache,
        "--n-ctx",
        str(cells // args.slots),
        "--http-listen",
        f"127.0.0.1:{port}",
        "--listen",  # (its protocol listener, unused here: any free port)
        "127.0.0.1:0",
        "--log-level",
        "warning",
        *shlex.split(args.extra_governor_args or ""),
    ]


def llama_server_command(args: argparse.Namespace, model: Path, port: int) -> list[str]:
    argv = llama_server.command(
        args.llama_server,
        model,
        port=port,
        slots=args.slots,
        ctx=server_ctx(args),
        threads=args.threads,
    )
    return argv + shlex.split(args.extra_llama_server_args or "")


def mix_rows(
    requests: int, share: float, output_tokens: int, seed: int = 0
) -> list[dict[str, Any]]:
    """A mix of ``requests`` prompts, ``share`` of them rewrites of 200 to 300 words spread
    evenly through it, the rest one-line chat questions; each asking for ``output_tokens``."""
    rng = random.Random(seed)
    rows = []
    for i in range(requests):
        if int((i + 1) * share) > int(i * share):
            words: list[str] = []
            while len(words) < rng.randint(*REWRITE_WORDS):
                words += rng.choice(SENTENCES).split()
            prompt = "Rewrite this more formally:\n" + " ".join(words)
        else:
            prompt = f"In one sentence, what is {rng.choice(TOPICS)}? ({i})"
        rows.append({"prompt": prompt, "output_tokens_count": output_tokens})
    return rows


def guidellm_command(
    args: argparse.Namespace, url: str, model: Path, report: Path, mix: Path | None = None
) -> list[str]:
    """``guidellm run`` for one run against ``url`` (no ``/v1``), its JSON report to ``report``.
    Each option is guidellm 0.8.1's ``--OPTION SPEC``, the spec written as JSON (a path with a
    comma in it would break its ``key=value,...`` form)."""

    def spec(**fields: Any) -> str:
        return json.dumps(fields)

    backend = spec(kind="openai_http", target=url, validate_backend=not args.no_health_check)
    return [
        args.guidellm,
        "run",
        "--backend",
        backend,
        "--profile",
        spec(kind="concurrent", streams=args.concurrency),
        "--constraint",
        spec(kind="max_requests", count=args.requests),
        "--data",
        spec(kind="json_file", path=str(mix))
        if mix is not None
        else spec(kind="synthetic_text", **synthetic(args)),
        "--tokenizer",
        spec(
            kind="huggingface_auto", model=str(model.parent), load_kwargs={"gguf_file": model.name}
        ),
        "--output",
        spec(kind="json", path=str(report)),
        "--disable-console-interactive",
    ]


def guidellm_env(args: argparse.Namespace) -> dict[str, str]:
    """This process's environment, offline for the hub, and guidellm's worker processes capped
    (by default it starts one per stream up to 10, each importing torch: on two cores they take
    the CPU the servers need)."""
    return {
        **os.environ,
        **OFFLINE_ENV,
        "GUIDELLM__MAX_WORKER_PROCESSES": str(args.client_processes),
    }


# Servers -----------------------------------------------------------------------------------


@dataclass(slots=True)
class Started:
    """A server of one run: its process (stopped by PID) and its base URL (no ``/v1``)."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str
    argv: list[str]


def launch(name: str, args: argparse.Namespace, model: Path, log: Path) -> Started:
    """Start ``name`` on a free loopback port, its output to ``log``, and wait until it is
    ready. Blocking. Raises RuntimeError (with the process stopped)."""
    port = free_port()
    if name == "governor":
        argv, ready = governor_command(args, model, port), "/v1/models"
    else:
        argv, ready = llama_server_command(args, model, port), llama_server.READY_PATH
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    wait_http_ready(proc, url + ready, name, READY_TIMEOUT_S)  # (stops it if it fails)
    return Started(name, proc, url, argv)


def warm_up(url: str, output_tokens: int) -> None:
    """One chat, not counted, so that neither server's first-request costs fall in a run."""
    body = {
        "messages": [{"role": "user", "content": "In one sentence, what is the sea?"}],
        "max_tokens": output_tokens,
        "temperature": 0,
    }
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()
    except OSError as exc:
        raise RuntimeError(f"the warm-up chat failed: {exc}") from None


def run_guidellm(argv: list[str], env: Mapping[str, str], log: Path, timeout: float) -> int | None:
    """Run guidellm, its output to ``log``; its exit status, None when ``timeout`` passed
    first. It runs in a session of its own, so that on a timeout its worker processes are
    stopped with it (by its process group, which is its PID)."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv,
            cwd=log.parent,  # (anything guidellm leaves behind lands beside its log)
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        end_group(proc)
        return None
    except BaseException:  # (Ctrl-C reaches this process only: guidellm is in its own session)
        end_group(proc)
        raise


def end_group(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM ``proc``'s process group (its own: started with ``start_new_session``), SIGKILL
    after ``grace_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    except ProcessLookupError:
        pass


# Reading guidellm's report (pure) ----------------------------------------------------------


def error_kind(message: str | None) -> str:
    """A short, bounded name for what an errored request recorded: ``HTTP 429`` for a status
    error, else the exception's first words."""
    if not message:
        return "unknown"
    status = re.search(r"\b([1-5]\d\d) [A-Z][A-Za-z ]+", message)
    if status:
        return f"HTTP {status.group(1)}"
    return message.strip().splitlines()[0][:60]


def _percentile(metrics: Mapping[str, Any], name: str, p: str, scale: float = 1.0) -> float | None:
    """guidellm's ``p`` (``p50``, ``p99``) of ``name`` over the successful requests (None: there
    were none)."""
    stats = metrics[name]["successful"]
    if not stats["count"]:
        return None
    return round(float(stats["percentiles"][p]) * scale, 1)


def run_row(server: str, report: Mapping[str, Any]) -> dict[str, Any]:
    """One run's figures from guidellm's JSON report (its one benchmark: the concurrent
    profile at one stream count)."""
    (benchmark,) = report["benchmarks"]
    metrics = benchmark["metrics"]
    totals = metrics["request_totals"]
    errors = collections.Counter(
        error_kind(r["info"].get("error")) for r in benchmark["requests"]["errored"]
    )
    good = sum(
        (r.get("time_to_first_token_ms") or math.inf) <= GOOD_TTFT_MS
        and (r.get("inter_token_latency_ms") or 0.0) <= GOOD_ITL_MS
        for r in benchmark["requests"]["successful"]
    )
    return {
        "server": server,
        "requests": totals["total"],
        **{name: totals[name] for name in COUNTS},
        "errored_by": dict(sorted(errors.items())),
        "duration_s": round(benchmark["duration"], 3),
        "good": good,
        "goodput_rps": round(good / benchmark["duration"], 4),
        "output_tokens": int(metrics["output_token_count"]["successful"]["total_sum"]),
        "output_tok_s": round(metrics["output_tokens_per_second"]["successful"]["mean"], 1),
        "ttft_p50_ms": _percentile(metrics, "time_to_first_token_ms", "p50"),
        "ttft_p99_ms": _percentile(metrics, "time_to_first_token_ms", "p99"),
        "itl_p50_ms": _percentile(metrics, "inter_token_latency_ms", "p50"),
        "itl_p99_ms": _percentile(metrics, "inter_token_latency_ms", "p99"),
        "tpot_p50_ms": _percentile(metrics, "time_per_output_token_ms", "p50"),
        "tpot_p99_ms": _percentile(metrics, "time_per_output_token_ms", "p99"),
        "latency_p50_ms": _percentile(metrics, "request_latency", "p50", 1000),
        "latency_p99_ms": _percentile(metrics, "request_latency", "p99", 1000),
    }


EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception): .+")


def failure_reason(log: str) -> str | None:
    """What a failed guidellm run's output says went wrong: its first exception line (the
    cause, e.g. ``httpx.HTTPStatusError: Client error '404 Not Found' for url ...``) and its
    last (what guidellm gave up with), each at most 200 characters; None: no such line."""
    found = [ln.strip()[:200] for ln in log.splitlines() if EXCEPTION_LINE.match(ln.strip())]
    if not found:
        return None
    return found[0] if found[0] == found[-1] else f"{found[0]} ... {found[-1]}"


def failed_row(server: str, why: str) -> dict[str, Any]:
    """A run that left no report: guidellm refused to start, failed or timed out."""
    return {
        "server": server,
        "requests": None,
        **dict.fromkeys(COUNTS),
        "good": None,
        "errored_by": {},
        "guidellm_failed": why,
        **dict.fromkeys(COMPARED),
    }


# Summaries (pure) --------------------------------------------------------------------------


def targets(
    runs: Sequence[dict[str, Any]], ratios: Mapping[str, float | None], *, mix: bool = False
) -> dict[str, Any]:
    """The targets, and whether all are met (None: a figure missing): every governor run left a
    report with none errored, its median output tokens/s at least llama-server's, and its median
    TTFT p99 no worse; with a mix of chats and rewrites, its output and its goodput at least
    1.5x llama-server's instead (an errored request counts as a miss there)."""
    ours = [r for r in runs if r["server"] == "governor"]

    def at_least(name: str, floor: float) -> bool | None:
        value = ratios.get(name)
        return None if value is None else value >= floor

    found: dict[str, bool | None] = {
        "output_tok_s_ratio_ge_1": at_least("output_tok_s", MIN_OUTPUT_RATIO)
    }
    if mix:
        found["goodput_ratio_ge_1_5"] = at_least("goodput_rps", MIN_GOODPUT_RATIO)
    else:
        ttft = ratios.get("ttft_p99_ms")
        found["errored_0"] = bool(ours) and all(r["errored"] == 0 for r in ours)
        found["ttft_p99_ratio_le_1"] = None if ttft is None else ttft <= MAX_TTFT_P99_RATIO
    # (A TTFT of the few requests a refusing server let through is no win: all of them or none.)
    return {**found, "met": all(v is True for v in found.values())}


def summarize(runs: Sequence[dict[str, Any]], *, mix: bool = False) -> dict[str, Any]:
    """Medians per server and, with both, the governor's over llama-server's and the targets."""
    by_server = medians_by(runs, SERVERS, (*COUNTS, *COMPARED))
    out: dict[str, Any] = {"median": by_server}
    if len(by_server) == 2:
        ours, theirs = by_server["governor"], by_server["llama-server"]
        ratios = {k: ratio(ours[k], theirs[k]) for k in COMPARED}
        out["governor_over_llama_server"] = ratios
        out["targets"] = targets(runs, ratios, mix=mix)
    return out


def line(row: dict[str, Any]) -> str:
    if row.get("guidellm_failed"):
        return f"{row['server']:>12}: no report: {row['guidellm_failed']}"
    errors = ", ".join(f"{k} {v}" for k, v in row["errored_by"].items())
    return (
        f"{row['server']:>12}: ok {row['successful']}/{row['requests']}"
        f" (errored {row['errored']}{': ' + errors if errors else ''},"
        f" incomplete {row['incomplete']})"
        f"  {row['output_tok_s']} tok/s  good {row['good']} ({row['goodput_rps']}/s)"
        f"  TTFT p50 {row['ttft_p50_ms']} p99 {row['ttft_p99_ms']} ms"
        f"  ITL p50 {row['itl_p50_ms']} p99 {row['itl_p99_ms']} ms"
        f"  latency p50 {row['latency_p50_ms']} p99 {row['latency_p99_ms']} ms"
        f"  in {row['duration_s']} s"
    )


# The command -------------------------------------------------------------------------------


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
    from governor.runners.llama import embedded_model_path

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
    parser.add_argument("--threads", type=positive_int, default=2, help="both servers' threads")
    parser.add_argument(
        "--kv-layout",
        choices=("pool", "slots"),
        default="pool",
        help="the governor's KV cache: one pool of llama-server's cells, or a stream of a "
        "slot's context for each slot, as llama-server has",
    )
    parser.add_argument(
        "--server-ctx",
        type=positive_int,
        help="llama-server's -c, all slots together (default: room in each slot for a prompt, "
        "the chat template and the output)",
    )
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the embedded model)")
    parser.add_argument(
        "--guidellm",
        default=default_guidellm(),
        help=f"guidellm's executable (made by: {SETUP_VENV})",
    )
    parser.add_argument(
        "--llama-server",
        type=Path,
        default=llama_server.default_binary(),
        help=f"llama-server binary (where {llama_server.BUILD_SCRIPT} puts it)",
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
