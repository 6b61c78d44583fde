"""``preemption``: heavy work lent every slot, and chats that take slots back by suspending it.

Each part starts a governor of its own (``governor serve --lanes true`` on the embedded model,
one thread, ``--max-inflight --slots``; with ``--sidecar``, ``--runner http`` in front of a
llama-server of its own, ``-np --slots``), so no part finds another's prompts in the KV cache,
and stops it by its PID. Every job is greedy (temperature 0, ``ignore_eos``), streamed, on its own
connection, and honours retry hints; its time to first token is the client's, from its first
send, refusals included.

1. **burst**: ``--rewrites`` rewrites (a prompt of about ``--prompt-tokens``, ``--max-new-tokens``,
   lane heavy) sent at once. ``/metrics`` is read every 100 ms: the peak of
   ``governor_slots_taken``, and among the samples where a job waited to be admitted (jobs
   unfinished at the client, less ``governor_inflight`` and ``governor_suspended``) the share
   with every slot taken; ``governor_overload_state``'s highest value; each job's refusals by
   need code, wall time and time to first token.
2. **chats beside lent work**: on an idle daemon, ``--chats`` short chats (16 tokens, the lane
   the governor gives them) one at a time, ``--chat-gap`` apart; then ``--slots`` heavy jobs
   (``--heavy-new-tokens``) together, without chats. On a second fresh daemon the same heavy
   jobs, and once each has its first token the same chats beside them (none sent once a heavy
   job has ended). Chat TTFT p50/p99 beside the heavy jobs against idle; each heavy job's text
   and wall time with chats against without; ``governor_suspensions_total`` and
   ``governor_resumes_total``. (The heavy jobs without chats run on a daemon of their own: on
   the one that ran them with chats they would find their prompts cached.) ``--control`` runs
   them without chats once more, on a third daemon: how far two runs differ with no chat
   between (llama.cpp's float results depend on a step's batch, and a greedy text can turn
   where two tokens are close).

The run ends with a table of each figure against its target. Exit status 1: a job failed, the
``--timeout`` passed, or a daemon did not start; else 0, whether or not the targets were met.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from clients.helptext import RawDescriptionDefaultsHelpFormatter

from ...support.arguments import add_llama_server, add_threads
from ...support.options import positive_float, positive_int, print_json
from ...support.replicas import Replica
from .figures import compare_heavy
from .jobs import daemon, in_loop
from .report import print_summary, verdicts, without_texts
from .rounds import alone, beside, burst, chat_figures, control

NAME = "preemption"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Each part on a fresh daemon, in turn; the report."""
    deadline = time.monotonic() + args.timeout
    parts: list[Callable[[argparse.Namespace, Replica, float], Awaitable[dict[str, Any]]]]
    parts = [burst, alone, beside, *([control] if args.control else [])]
    found = []
    with tempfile.TemporaryDirectory(prefix="loadtest-preemption-") as logs:
        for part in parts:
            with daemon(args, Path(logs), deadline) as d:
                found.append(in_loop(functools.partial(part, args, d, deadline), deadline))
    return assemble(args, *found)


def assemble(
    args: argparse.Namespace,
    rush: dict[str, Any],
    idle: dict[str, Any],
    loaded: dict[str, Any],
    again: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The parts' findings as one report (the figures compared, every job's error listed)."""
    heavy = {
        **compare_heavy(loaded["heavy"], idle["heavy"]),
        "with_chats": loaded["heavy"],
        "without_chats": idle["heavy"],
        "seconds_with_chats": loaded["heavy_seconds"],
        "seconds_without_chats": idle["heavy_seconds"],
        "chats_from_s": loaded["chats_from_s"],
        "metrics_with_chats": loaded["metrics"],
        "metrics_without_chats": idle["metrics"],
    }
    jobs = [*rush["jobs"], *idle["chats"], *loaded["chats"], *idle["heavy"], *loaded["heavy"]]
    if again is not None:
        # The heavy jobs without chats twice: how far two runs differ with nothing between.
        heavy["control"] = {
            **compare_heavy(again["heavy"], idle["heavy"]),
            "runs": again["heavy"],
            "seconds": again["heavy_seconds"],
        }
        jobs += again["heavy"]
    chats = {
        **chat_figures(idle, loaded),
        "idle_run": idle["chats"],
        "beside_run": loaded["chats"],
    }
    return {
        "command": NAME,
        "settings": settings(args),
        "burst": rush,
        "chats": chats,
        "heavy": heavy,
        "errors": [f"{r['name']}: {r['error']}" for r in jobs if "error" in r],
    }


def settings(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("slots", "threads", "rewrites", "prompt_tokens", "max_new_tokens", "heavy_new_tokens")
    more = ("chats", "chat_gap", "control", "sidecar", "upstream_slots")
    return {k: getattr(args, k) for k in (*keys, *more)}


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME,
        help="heavy work lent every slot; chats take slots back by suspending it",
        description=__doc__,
        formatter_class=RawDescriptionDefaultsHelpFormatter,
    )
    parser.add_argument("--slots", type=positive_int, default=4, help="the daemon's --max-inflight")
    add_threads(parser, default=1, text="the daemon's --threads")
    parser.add_argument("--rewrites", type=positive_int, default=6, help="burst: rewrites at once")
    parser.add_argument(
        "--prompt-tokens",
        type=positive_int,
        default=800,
        help="about, of each rewrite and heavy job",
    )
    parser.add_argument(
        "--max-new-tokens", type=positive_int, default=400, help="burst: of each rewrite"
    )
    parser.add_argument(
        "--heavy-new-tokens", type=positive_int, default=300, help="of each heavy job beside chats"
    )
    parser.add_argument("--chats", type=positive_int, default=10, help="idle and beside heavy work")
    parser.add_argument(
        "--chat-gap",
        type=positive_float,
        default=1.0,
        help="seconds between one chat's end and the next",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="run the heavy jobs without chats a second time, on a daemon of their own: how "
        "far their texts and wall times differ with no chat between",
    )
    parser.add_argument(
        "--sidecar",
        action="store_true",
        help="each governor a sidecar (--runner http) in front of a llama-server of --slots "
        "slots (-np, 2,048 tokens each, --threads) on the same model, started and stopped "
        "with it",
    )
    parser.add_argument(
        "--upstream-slots",
        type=positive_int,
        help="with --sidecar: llama-server's -np (default: --slots); one more than --slots "
        "gives a chat a slot at once while the job it paused frees its own",
    )
    add_llama_server(parser, text="the llama-server binary, with --sidecar")
    parser.add_argument(
        "--timeout", type=positive_float, default=900.0, help="seconds for the whole run"
    )


def run(args: argparse.Namespace) -> int:
    try:
        report = measure(args)
    except (RuntimeError, TimeoutError) as exc:
        print(f"loadtest {NAME}: {str(exc) or 'the --timeout passed'}", file=sys.stderr)
        return 1
    report["verdicts"] = verdicts(report)
    print_summary(report)
    for key in ("with_chats", "without_chats"):
        without_texts(report["heavy"][key])
    without_texts(report["heavy"].get("control", {}).get("runs", []))
    without_texts(report["burst"]["jobs"])
    without_texts(report["chats"]["idle_run"])
    without_texts(report["chats"]["beside_run"])
    print_json(args, report)
    return 1 if report["errors"] else 0
