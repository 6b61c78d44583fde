"""``doors``: both doors of a sidecar against its upstream called directly, past the cap.

llama.cpp's ``llama-server -np SLOTS`` on the embedded model, and the governor in front of it
(``governor serve --runner http --max-inflight SLOTS --http-listen``). Each round sends N greedy
streams of ``--max-new-tokens`` tokens at once (``ignore_eos``) to each way in, one after the
other, in turn:

- ``direct``: llama-server's own ``/v1/completions`` (it queues what its slots cannot take);
- ``http``: the governor's front door (a request waits in line for its turn, bounded);
- ``tcp-wait``: the governor's protocol, the bundled client asking to wait for its turn
  (``max_wait_ms``, ``--max-wait`` seconds: governor-cli's default);
- ``tcp-hint``: the protocol with no wait: an immediate ``yield``, the client back on its hint.

Reported per way in and N: completion tokens over the round's wall time (median of the
``--rounds``), TTFT p50 and max, and the ratio to ``direct``: the median over the rounds of each
round's tokens/s over ``direct``'s in the same round (this machine's speed drifts between
rounds). With ``--lane heavy`` the governor has lanes on and every stream through it asks for
that lane: a job that may be paused for a chat, which runs on llama-server's ``/completion``
endpoint, its answer shaped by the governor. Every server is started here on a free loopback
port and stopped by its own PID.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from clients.client import DEFAULT_MAX_WAIT_S, RetryPolicy
from clients.helptext import RawDescriptionDefaultsHelpFormatter
from governor.runners.llama.runner import embedded_model_path

from ..support import llama_server
from ..support.arguments import add_llama_server, add_round_timeout
from ..support.connections import Endpoint
from ..support.driver import open_loop
from ..support.options import positive_ints, print_json
from ..support.processes import REPO, free_port, stop, wait_http_ready, wait_listening
from ..support.stats import percentile
from ..support.targets import GovernorTarget, OpenAITarget, Outcome, Shape, Target
from ..support.workload import Request

NAME = "doors"
WAYS = ("direct", "http", "tcp-wait", "tcp-hint")
RETRY = RetryPolicy(max_attempts=10_000, max_sleep_s=2.0)  # bounded by --timeout
READY_TIMEOUT_S = 120.0
EXTRA = {"ignore_eos": True, "cache_prompt": False}  # llama-server's own fields


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME,
        help="a sidecar's two doors against its upstream called directly, past the cap",
        description=__doc__,
        formatter_class=RawDescriptionDefaultsHelpFormatter,
    )
    parser.add_argument("--slots", type=int, default=8, help="llama-server -np, the cap")
    parser.add_argument(
        "--streams", type=positive_ints, default=(8, 24), help="N streams per round"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each way in, in turn")
    parser.add_argument(
        "--max-new-tokens", type=int, default=128, help="tokens each stream generates"
    )
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t")
    parser.add_argument(
        "--max-wait", type=float, default=DEFAULT_MAX_WAIT_S, help="tcp-wait's max_wait, seconds"
    )
    add_round_timeout(parser)
    parser.add_argument(
        "--lane",
        choices=("heavy", "background"),
        help="the governor with --lanes true, and every stream through it asks for this lane: "
        "in front of llama-server such a job may be paused for a chat, and runs on its "
        "/completion endpoint (what that path costs below and at the cap)",
    )
    add_llama_server(parser, text="its binary")


@contextmanager
def _servers(args: argparse.Namespace, logs: Path) -> Iterator[dict[str, int]]:
    """llama-server and the governor in front of it: their ports."""
    upstream, tcp, http = free_port(), free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with (logs / "llama-server.log").open("ab") as out:
            argv = llama_server.command(
                args.llama_server,
                embedded_model_path(),
                port=upstream,
                slots=args.slots,
                ctx=2048 * args.slots,
                threads=args.threads,
                unified_kv=True,
            )
            procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT))
        url = f"http://127.0.0.1:{upstream}"
        wait_http_ready(procs[0], url + llama_server.READY_PATH, "llama-server", READY_TIMEOUT_S)
        with (logs / "governor.log").open("ab") as out:
            argv = [sys.executable, "-m", "governor", "serve", "--runner", "http"]
            argv += ["--upstream", url, "--max-inflight", str(args.slots)]
            argv += ["--listen", f"127.0.0.1:{tcp}", "--http-listen", f"127.0.0.1:{http}"]
            argv += ["--log-level", "warning", *(["--lanes", "true"] if args.lane else [])]
            procs.append(subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT))
        wait_listening(tcp, procs[1], READY_TIMEOUT_S)
        wait_http_ready(procs[1], f"http://127.0.0.1:{http}/health", "governor", READY_TIMEOUT_S)
        yield {"upstream": upstream, "tcp": tcp, "http": http}
    finally:
        for proc in reversed(procs):
            stop(proc)


def _target(
    way: str, ports: dict[str, int], shape: Shape, max_wait: float, lane: str | None
) -> Target:
    if way == "direct":
        return OpenAITarget(f"http://127.0.0.1:{ports['upstream']}", shape, extra=EXTRA)
    if way == "http":
        extra = {**EXTRA, "lane": lane} if lane else EXTRA
        return OpenAITarget(f"http://127.0.0.1:{ports['http']}", shape, extra=extra)
    wait = max_wait if way == "tcp-wait" else None
    shaped = Shape(temperature=0.0, ignore_eos=True, prompts=shape.prompts, max_wait=wait)
    return GovernorTarget(Endpoint("127.0.0.1", ports["tcp"]), shaped, RETRY)


def row(outcomes: list[Outcome], seconds: float) -> dict[str, Any]:
    ttfts = [t for o in outcomes if (t := o.ttft_ms) is not None]
    tokens = sum(o.tokens for o in outcomes)
    return {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else 0.0,
        "ttft_p50_ms": round(percentile(ttfts, 50), 1) if ttfts else None,
        "ttft_max_ms": round(max(ttfts), 1) if ttfts else None,
        "done": sum(1 for o in outcomes if o.status == "done"),
        "yields": sum(len(o.yields) for o in outcomes),
    }


async def _rounds(args: argparse.Namespace, ports: dict[str, int]) -> dict[str, Any]:
    report: dict[str, Any] = {}
    first = 0
    for n in args.streams:
        runs: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
        for r in range(args.rounds):
            for way in WAYS:
                prompts = tuple(
                    f"Story {first + i}: Once upon a time, by the sea," for i in range(n)
                )
                first += n
                shape = Shape(temperature=0.0, ignore_eos=True, prompts=prompts)
                run = await open_loop(
                    _target(way, ports, shape, args.max_wait, args.lane),
                    [Request(0.0, args.lane or "stream", 0, args.max_new_tokens)] * n,
                    connections=n,
                    timeout_s=args.round_timeout,
                    sample_s=1.0,
                    label=f"{way} x{n} round {r + 1}",
                )
                runs[way].append(row(run.outcomes, run.duration_s))
                print(f"  {way:8} x{n:<3} round {r + 1}: {runs[way][-1]}", flush=True)
        direct = [x["tokens_per_s"] for x in runs["direct"]]
        report[str(n)] = {
            way: {
                "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rows),
                # Each round against direct in the same round: this machine's speed drifts.
                "ratio": round(
                    statistics.median(
                        x["tokens_per_s"] / d for x, d in zip(rows, direct, strict=True)
                    ),
                    3,
                ),
                "rounds": rows,
            }
            for way, rows in runs.items()
        }
        for way, summary in report[str(n)].items():
            print(f"{n} streams, {way:8}: {summary['tokens_per_s']} tok/s, {summary['ratio']}x")
    return report


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="doors-") as logs, _servers(args, Path(logs)) as ports:
        report = asyncio.run(_rounds(args, ports))
    print_json(args, {"command": NAME, "slots": args.slots, "streams": report})
    return 0
