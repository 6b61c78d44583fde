"""The rounds of ``bench preemption``: the burst that lends heavy work every slot, the heavy
jobs alone, the chats alone and beside them."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from ...support.replicas import Replica, total
from ...support.stats import ratio
from .figures import Tick, chat_prompt, greedy, rewrite_prompt, saturation, ttft_summary
from .jobs import SAMPLE_S, Job, counters, left, metrics, since, until, warm

CHAT_TOKENS = 16


async def burst(args: argparse.Namespace, d: Replica, deadline: float) -> dict[str, Any]:
    await warm(d, deadline)
    jobs = [
        Job(
            f"rewrite {i}",
            greedy(rewrite_prompt(i, args.prompt_tokens), args.max_new_tokens, "heavy"),
        )
        for i in range(args.rewrites)
    ]
    ticks: list[Tick] = []
    misses = 0
    started = time.monotonic()

    async def sample() -> None:
        nonlocal misses
        while True:
            at = time.monotonic()
            m = await d.metrics()
            if m is None:
                misses += 1
            else:
                unfinished = sum(1 for j in jobs if j.ended is None)
                admitted = total(m, "governor_inflight") + total(m, "governor_suspended")
                ticks.append(
                    Tick(
                        round(at - started, 3),
                        int(total(m, "governor_slots_taken")),
                        max(0, unfinished - int(admitted)),
                        int(total(m, "governor_overload_state")),
                    )
                )
            await asyncio.sleep(max(0.0, at + SAMPLE_S - time.monotonic()))

    sampler = asyncio.create_task(sample())
    try:
        reports = await asyncio.gather(*(j.run(d.port, deadline) for j in jobs))
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    return {
        "seconds": round(time.monotonic() - started, 1),
        **saturation(ticks, args.slots),
        "metrics_misses": misses,
        "jobs": reports,
    }


def heavy_jobs(args: argparse.Namespace) -> list[Job]:
    return [
        Job(
            f"heavy {i}",
            greedy(rewrite_prompt(i, args.prompt_tokens), args.heavy_new_tokens, "heavy"),
        )
        for i in range(args.slots)
    ]


async def chats(
    args: argparse.Namespace, d: Replica, deadline: float, stop_when: Callable[[], bool]
) -> list[dict[str, Any]]:
    """``--chats`` chats one at a time, ``--chat-gap`` apart, none sent once ``stop_when``."""
    reports = []
    for i in range(args.chats):
        if stop_when():
            break
        if i:
            await asyncio.sleep(min(args.chat_gap, left(deadline)))
            if stop_when():
                break
        reports.append(
            await Job(f"chat {i}", greedy(chat_prompt(i), CHAT_TOKENS)).run(d.port, deadline)
        )
    return reports


async def heavy_alone(args: argparse.Namespace, d: Replica, deadline: float) -> dict[str, Any]:
    """The heavy jobs together, without chats."""
    before = counters(await metrics(d))
    started = time.monotonic()
    heavy = await asyncio.gather(*(j.run(d.port, deadline) for j in heavy_jobs(args)))
    return {
        "heavy": list(heavy),
        "heavy_seconds": round(time.monotonic() - started, 1),
        "metrics": since(before, counters(await metrics(d))),
    }


async def alone(args: argparse.Namespace, d: Replica, deadline: float) -> dict[str, Any]:
    """Chats on the idle daemon, then the heavy jobs without chats."""
    await warm(d, deadline)
    idle = await chats(args, d, deadline, lambda: False)
    return {"chats": idle, **await heavy_alone(args, d, deadline)}


async def control(args: argparse.Namespace, d: Replica, deadline: float) -> dict[str, Any]:
    await warm(d, deadline)
    return await heavy_alone(args, d, deadline)


async def beside(args: argparse.Namespace, d: Replica, deadline: float) -> dict[str, Any]:
    """The heavy jobs; once each has its first token, the chats beside them."""
    await warm(d, deadline)
    before = counters(await metrics(d))
    jobs = heavy_jobs(args)
    started = time.monotonic()
    running = [asyncio.create_task(j.run(d.port, deadline)) for j in jobs]
    try:
        await until(lambda: all(j.first_token or j.ended for j in jobs), deadline)
        waited = time.monotonic() - started
        said = [j.chars for j in jobs]  # (a text that turns before this is not the chats' doing)
        sent = await chats(args, d, deadline, lambda: any(j.ended for j in jobs))
        heavy = await asyncio.gather(*running)
    finally:
        for task in running:
            task.cancel()
    for report, chars in zip(heavy, said, strict=True):
        report["chars_before_chats"] = chars
    return {
        "chats": sent,
        "chats_from_s": round(waited, 1),
        "heavy": list(heavy),
        "heavy_seconds": round(time.monotonic() - started, 1),
        "metrics": since(before, counters(await metrics(d))),
    }


def chat_figures(idle: dict[str, Any], loaded: dict[str, Any]) -> dict[str, Any]:
    def ttfts(reports: list[dict[str, Any]]) -> list[float]:
        return [r["ttft_s"] for r in reports if r.get("ttft_s") is not None]

    a, b = ttft_summary(ttfts(idle["chats"])), ttft_summary(ttfts(loaded["chats"]))
    return {
        "idle": a,
        "beside_heavy": b,
        "p50_over_idle": ratio(b["p50_ms"], a["p50_ms"]),
        "p99_over_idle": ratio(b["p99_ms"], a["p99_ms"]),
        "yields_beside_heavy": sum(r.get("yields", 0) for r in loaded["chats"]),
    }
