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
import asyncio
import collections
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clients.helptext import RawDescriptionDefaultsHelpFormatter, add_renamed

from ..support import baseline_server, llama_server
from ..support.connections import run_loop
from ..support.options import (
    non_negative_int,
    positive_float,
    positive_int,
    print_json,
)
from ..support.processes import REPO, free_port, stop, wait_http_ready
from ..support.stats import alternating, medians_by, percentile, ratio

if TYPE_CHECKING:
    import httpx2
    import openai

NAME = "sdk-bench"
SERVERS = ("governor", "baseline")
BASELINES = ("llama-cpp-python", "llama-server", "none")
RUNNERS = ("llama", "stub")
READY_TIMEOUT_S = 180.0
API_KEY = "sdk-bench"  # the governor runs open (no tenants) and llama_cpp.server checks none
RUN_TIMEOUT = "RunTimeout"  # a request still outstanding when --run-timeout ended the run
# Figures whose medians are compared, governor over baseline.
COMPARED = (
    "goodput_rps",
    "tokens_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
)
# Figures of each server's median run.
MEDIANS = ("ok", "failed", *COMPARED, "http_429", "absorbed_429", "sdk_retries")


def prompt(k: int) -> str:
    """Request ``k``'s question: its own, and as long as every other one (up to 10,000), so
    that no request is more work than another, and the governor's hints, which it predicts
    from a job's prompt length and the jobs before it, are not thrown off by the prompts."""
    return f"Client {k:04d} asks: in one sentence, what is the sea?"


# Servers ---------------------------------------------------------------------------------


def governor_command(args: argparse.Namespace, model: Path, http_port: int) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "governor",
        "serve",
        "--runner",
        args.runner,
        "--listen",  # (its protocol listener, unused here: any free port)
        "127.0.0.1:0",
        "--http-listen",
        f"127.0.0.1:{http_port}",
        "--max-inflight",
        str(args.max_inflight),
        "--max-connections",
        str(max(1024, 2 * args.clients)),
        "--probe-interval",  # no readiness probe during the run
        "600",
        "--log-level",
        "warning",
    ]
    if args.runner == "llama":
        argv += ["--model", str(model), "--threads", str(args.threads)]
        argv += ["--n-ctx", str(args.n_ctx)]
    else:
        argv += ["--stub-ms", str(args.stub_ms)]
    return argv + list(args.governor_arg)


@dataclass(slots=True)
class Started:
    """A server of one run: its process (stopped by PID) and its API's base URL."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str  # ending in /v1
    argv: list[str]


def baseline_command(args: argparse.Namespace, model: Path, port: int) -> list[str]:
    """``--baseline``'s server: llama-cpp-python's, or llama-server with the governor's slots
    (``-np K``), each of ``--n-ctx`` tokens (its ``-c`` is all the slots' together)."""
    if args.baseline == "llama-server":
        return llama_server.command(
            args.llama_server,
            model,
            port=port,
            slots=args.max_inflight,
            ctx=args.n_ctx * args.max_inflight,
            threads=args.threads,
        )
    return baseline_server.command(model, port, threads=args.threads, n_ctx=args.n_ctx)


def launch(name: str, args: argparse.Namespace, model: Path, log: Path) -> Started:
    """Start ``name`` on a free loopback port, its output to ``log``, and wait until it is ready:
    ``/v1/models`` answers (the governor answers once its runner is ready; llama-server,
    ``/health``). Blocking: nothing else runs meanwhile. Raises RuntimeError (with the process
    stopped)."""
    port = free_port()
    ready = "/v1/models"
    if name == "governor":
        argv = governor_command(args, model, port)
    else:
        argv = baseline_command(args, model, port)
        if args.baseline == "llama-server":
            ready = llama_server.READY_PATH
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
    root = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(proc, root + ready, name, READY_TIMEOUT_S)
    except BaseException:
        stop(proc)
        raise
    return Started(name, proc, root + "/v1", argv)


# Clients ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Record:
    """One request as its client saw it; times in seconds from the run's start."""

    sent_s: float
    first_s: float | None = None  # the first content delta
    end_s: float | None = None
    tokens: int = 0  # usage's completion_tokens, else content deltas
    usage: bool = False  # the server reported usage
    error: str | None = None  # the exception's type, when it failed
    # Each HTTP answer its attempts got: (seconds from the run's start, status, retry-after-ms).
    answers: list[tuple[float, int, str | None]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.end_s is not None and self.error is None


@dataclass(slots=True)
class Load:
    """What one run's clients saw."""

    records: list[Record] = field(default_factory=list)
    wall_s: float = 0.0
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)


async def chat(
    client: openai.AsyncOpenAI,
    model: str,
    text: str,
    seed: int,
    max_tokens: int,
    record: Record,
    t0: float,
) -> None:
    """One streamed chat completion, filling in ``record``: any exception the SDK raises (its
    retries spent, a timeout, a broken stream) fails the request, named by its type."""
    deltas = 0
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens,
            temperature=0,
            seed=seed,
            stream=True,
            stream_options={"include_usage": True},
        )
        async with stream:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if record.first_s is None:
                        record.first_s = time.monotonic() - t0
                    deltas += 1
                if chunk.usage is not None:
                    record.tokens, record.usage = chunk.usage.completion_tokens, True
    except Exception as exc:  # (what the user of the SDK would have to handle)
        record.error = type(exc).__name__
    if not record.usage:
        record.tokens = deltas
    record.end_s = time.monotonic() - t0


async def model_of(url: str, args: argparse.Namespace) -> str:
    """The server's model (the first ``/v1/models`` lists), after one warm-up request, not
    counted, so that neither server's first-request costs fall in a run. It is one of the
    run's kind (a :func:`prompt` as long, the run's ``max_tokens``): the governor learns a
    job's expected time from the jobs before it, and its hints follow."""
    import openai

    async with openai.AsyncOpenAI(
        base_url=url, api_key=API_KEY, **_timeout(args.request_timeout)
    ) as probe:
        model = (await probe.models.list()).data[0].id
        record = Record(0.0)
        warmup = args.clients * args.requests_per_client  # (a question no request asks)
        await chat(probe, model, prompt(warmup), warmup, args.max_tokens, record, time.monotonic())
    if record.error is not None:
        raise RuntimeError(f"the warm-up request failed: {record.error}")
    return model


def max_retries(args: argparse.Namespace) -> int:
    """``--max-retries``, else the SDK's own default."""
    import openai

    return openai.DEFAULT_MAX_RETRIES if args.max_retries is None else int(args.max_retries)


def _timeout(seconds: float | None) -> dict[str, Any]:
    """The SDK's ``timeout`` argument: left out (its default) unless given."""
    return {} if seconds is None else {"timeout": seconds}


async def load(url: str, args: argparse.Namespace) -> Load:
    """``args.clients`` SDK clients with ``args.max_retries`` retries (None: the SDK's
    default), started together, each sending
    ``args.requests_per_client`` requests one after the other; bounded by ``args.run_timeout``
    (requests outstanding then fail as ``RunTimeout``, and those not yet sent are not)."""
    import openai

    model = await model_of(url, args)
    run = Load()

    current: dict[int, Record] = {}  # each client's request in flight

    def seen(index: int) -> Callable[[httpx2.Response], Awaitable[None]]:
        async def hook(response: httpx2.Response) -> None:
            if response.request.method == "POST":
                run.statuses[response.status_code] += 1
                hint = response.headers.get("retry-after-ms")
                current[index].answers.append(
                    (round(time.monotonic() - t0, 3), response.status_code, hint)
                )

        return hook

    clients = [
        openai.AsyncOpenAI(
            base_url=url,
            api_key=API_KEY,
            http_client=openai.DefaultAsyncHttpxClient(event_hooks={"response": [seen(i)]}),
            max_retries=max_retries(args),
            **_timeout(args.request_timeout),
        )
        for i in range(args.clients)
    ]
    per_client = args.requests_per_client
    t0 = time.monotonic()

    async def one_client(index: int) -> None:
        for r in range(per_client):
            k = index * per_client + r
            record = current[index] = Record(time.monotonic() - t0)
            run.records.append(record)
            await chat(clients[index], model, prompt(k), k, args.max_tokens, record, t0)

    try:
        async with asyncio.timeout(args.run_timeout):
            await asyncio.gather(*(one_client(i) for i in range(args.clients)))
    except TimeoutError:
        pass
    finally:
        run.wall_s = time.monotonic() - t0
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
    for record in run.records:
        if record.end_s is None:
            record.error, record.end_s = RUN_TIMEOUT, run.wall_s
    return run


# Pure summaries ----------------------------------------------------------------------------


def _ms(values: Sequence[float], p: float) -> float | None:
    return round(percentile(values, p) * 1000, 1) if values else None


def run_row(server: str, run: Load) -> dict[str, Any]:
    """One run's figures (times in ms; rates per second of the run's wall time)."""
    ok = [r for r in run.records if r.ok]
    failed = collections.Counter(r.error for r in run.records if r.error is not None)
    ttfts = [r.first_s - r.sent_s for r in ok if r.first_s is not None]
    e2es = [r.end_s - r.sent_s for r in ok if r.end_s is not None]
    tokens = sum(r.tokens for r in ok)
    wall = run.wall_s
    posts = sum(run.statuses.values())
    return {
        "server": server,
        "sent": len(run.records),
        "ok": len(ok),
        "failed": sum(failed.values()),
        "failed_by": dict(sorted(failed.items())),
        "wall_s": round(wall, 3),
        "goodput_rps": round(len(ok) / wall, 3) if wall > 0 else None,
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1) if wall > 0 else None,
        "tokens_from_usage": sum(r.usage for r in ok),
        "ttft_p50_ms": _ms(ttfts, 50),
        "ttft_p99_ms": _ms(ttfts, 99),
        "e2e_p50_ms": _ms(e2es, 50),
        "e2e_p99_ms": _ms(e2es, 99),
        "http_statuses": {str(k): v for k, v in sorted(run.statuses.items())},
        "http_429": run.statuses[429],
        # 429s the SDK retried past; the rest it raised (RateLimitError), its retries spent.
        "absorbed_429": run.statuses[429] - failed["RateLimitError"],
        "sdk_retries": max(posts - len(run.records), 0),
        # What each failed request was answered, attempt by attempt: why it failed.
        "failures": [
            {"error": r.error, "sent_s": round(r.sent_s, 3), "answers": r.answers}
            for r in run.records
            if r.error is not None
        ],
    }


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians per server and, with both, the governor's over the baseline's."""
    by_server = medians_by(runs, SERVERS, MEDIANS)
    out: dict[str, Any] = {"median": by_server}
    if len(by_server) == 2:
        ours, theirs = by_server["governor"], by_server["baseline"]
        out["governor_over_baseline"] = {k: ratio(ours[k], theirs[k]) for k in COMPARED}
    return out


def line(row: dict[str, Any]) -> str:
    failed = ", ".join(f"{k} {v}" for k, v in row["failed_by"].items())
    return (
        f"{row['server']:>9}: ok {row['ok']}/{row['sent']}"
        + (f" (failed: {failed})" if failed else "")
        + f"  {row['goodput_rps']} req/s  {row['tokens_per_s']} tok/s"
        f"  TTFT p50 {row['ttft_p50_ms']} p99 {row['ttft_p99_ms']} ms"
        f"  e2e p50 {row['e2e_p50_ms']} p99 {row['e2e_p99_ms']} ms"
        f"  429s {row['http_429']} (absorbed {row['absorbed_429']})"
        f"  in {row['wall_s']} s"
    )


# The command -------------------------------------------------------------------------------


async def bench(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    import openai

    from governor.runners.llama import embedded_model_path

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
    parser.add_argument("--threads", type=positive_int, default=2, help="both servers' threads")
    parser.add_argument("--n-ctx", type=positive_int, default=2048, help="both servers' n_ctx")
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
    parser.add_argument(
        "--llama-server",
        type=Path,
        default=llama_server.default_binary(),
        help=f"--baseline llama-server: its binary (where {llama_server.BUILD_SCRIPT} puts it)",
    )
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the embedded model)")
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
