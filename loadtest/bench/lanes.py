"""``lanes``: chat users and long rewrites together on the real model, lanes on against off.

Each run starts a governor on 127.0.0.1 with the llama runner (one worker per slot, one thread
each) and, for ``--duration`` seconds, drives ``--rewriters`` clients sending long rewrites back
to back and ``--chatters`` clients sending short chats with a think time; every client honours
retry hints. Reported per run: chat time to first token (p50, p99, from the client's first send,
yields and retries included) and goodput (chats meeting ``--slo-ms`` per second), and rewrites
completed.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from typing import Any

from clients import GovernorClient, RetryPolicy
from governor.config import Config
from governor.server import Server
from protocol.spec import JobSpec, Message

from ..support.connections import run_loop
from ..support.options import positive_int, print_json
from ..support.stats import summarize

NAME = "lanes"
REWRITE = JobSpec(prompt="Rewrite this contract clause. " + "word " * 300, max_new_tokens=64)
CHAT = JobSpec(
    messages=(Message("user", "What is the capital of France?"),), max_new_tokens=16, stream=True
)


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(NAME, help="chats and rewrites on the real model, lanes on/off")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds per run")
    parser.add_argument("--slots", type=positive_int, default=2, help="max_inflight (workers)")
    parser.add_argument(
        "--rewriters", type=positive_int, default=2, help="clients sending long rewrites"
    )
    parser.add_argument(
        "--chatters", type=positive_int, default=1, help="clients sending short chats"
    )
    parser.add_argument(
        "--think-ms", type=positive_int, default=500, help="between a chatter's chats"
    )
    parser.add_argument("--slo-ms", type=positive_int, default=1000, help="chat TTFT objective")
    parser.add_argument(
        "--interactive-max-cost",
        type=float,
        default=200.0,
        help="lanes on: the highest interactive cost (the chat is ~70, the rewrite ~440)",
    )


def deltas_at(times: list[float]) -> Callable[[str], None]:
    """An on_delta that records when each delta arrives."""
    return lambda _: times.append(time.monotonic())


async def one_run(args: argparse.Namespace, lanes: bool) -> dict[str, Any]:
    config = Config(
        listen="127.0.0.1:0",
        runner="llama",
        max_inflight=args.slots,
        threads=1,
        lanes=lanes,
        interactive_reserve=1,
        interactive_max_cost=args.interactive_max_cost,
        max_connections=64,
    )
    server = Server(config)
    await server.start()
    host, port = server.address
    deadline = time.monotonic() + args.duration
    retry = RetryPolicy(max_attempts=10_000, max_sleep_s=2.0)
    ttft: list[float] = []
    rewrites = 0

    async def rewriter() -> None:
        nonlocal rewrites
        async with await GovernorClient.connect(host, port) as client:
            while time.monotonic() < deadline:
                # (Not ``rewrites += await ...``: that reads the count before the await, and
                # the rewriters would overwrite each other's finished jobs.)
                result = await client.generate(REWRITE, retry=retry)
                rewrites += result.done

    async def chatter() -> None:
        await asyncio.sleep(1.0)  # the rewrites arrive first
        async with await GovernorClient.connect(host, port) as client:
            while time.monotonic() < deadline:
                start = time.monotonic()
                deltas: list[float] = []
                result = await client.generate(CHAT, retry=retry, on_delta=deltas_at(deltas))
                if result.done and deltas:
                    ttft.append((deltas[0] - start) * 1000)
                await asyncio.sleep(args.think_ms / 1000)

    try:
        started = time.monotonic()
        await asyncio.gather(
            *(rewriter() for _ in range(args.rewriters)), *(chatter() for _ in range(args.chatters))
        )
        elapsed = time.monotonic() - started
    finally:
        await server.close()
    summary = summarize(ttft).as_dict()
    good = sum(1 for t in ttft if t <= args.slo_ms)
    return {
        "lanes": lanes,
        "chats": len(ttft),
        "chat_ttft_ms": summary,
        "chat_goodput_per_s": round(good / elapsed, 3),
        "chats_within_slo": good,
        "rewrites": rewrites,
        "seconds": round(elapsed, 1),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "command": NAME,
        "slots": args.slots,
        "rewriters": args.rewriters,
        "chatters": args.chatters,
        "slo_ms": args.slo_ms,
        "on": await one_run(args, lanes=True),
        "off": await one_run(args, lanes=False),
    }


def run(args: argparse.Namespace) -> int:
    report = run_loop(measure(args))
    print(
        f"{report['slots']} slot(s), {report['rewriters']} rewriter(s), "
        f"{report['chatters']} chatter(s), chat TTFT objective {report['slo_ms']} ms"
    )
    for key in ("on", "off"):
        r = report[key]
        t = r["chat_ttft_ms"]
        print(
            f"lanes {key:3}  chats {r['chats']:3}  ttft p50 {t['p50']} ms  p99 {t['p99']} ms  "
            f"goodput {r['chat_goodput_per_s']}/s ({r['chats_within_slo']} within)  "
            f"rewrites {r['rewrites']}  over {r['seconds']} s"
        )
    print_json(args, report)
    return 0
