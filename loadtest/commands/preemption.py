"""``preemption``: heavy work lent every slot, and chats that take slots back by suspending it.

Each part starts a governor of its own (``governor serve --lanes true`` on the embedded model,
one thread, ``--max-inflight --slots``), so no part finds another's prompts in the KV cache, and
stops it by its PID. Every job is greedy (temperature 0, ``ignore_eos``), streamed, on its own
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
import asyncio
import collections
import contextlib
import functools
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from clients import ClientError, GovernorClient, RetryPolicy
from clients.helptext import RawDescriptionDefaultsHelpFormatter
from protocol.spec import JobSpec

from ..support.connections import run_loop
from ..support.options import positive_float, positive_int, print_json
from ..support.processes import REPO, free_port, stop, wait_http_ready, wait_listening
from ..support.replicas import Replica, Sample, by_label, total
from ..support.stats import percentile, ratio

NAME = "preemption"
HOST = "127.0.0.1"
PARAGRAPH = (
    "The committee met on Tuesday to review the quarterly budget, the hiring plan and the new "
    "office lease. After a long discussion, the members agreed to postpone the decision on the "
    "lease until the landlord answers their questions about repairs, and asked the finance team "
    "to prepare two versions of the budget, one with the new hires and one without. "
)
PARAGRAPH_TOKENS = 69  # in the embedded model's tokenizer
QUESTIONS = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Why is the sky blue?",
    "Who wrote Hamlet?",
    "What is the boiling point of water?",
    "How far away is the Moon?",
    "What do bees make?",
    "Which planet is the largest?",
    "What is photosynthesis?",
    "How many days are in a leap year?",
    "What language is spoken in Brazil?",
    "What is the speed of light?",
)
CHAT_TOKENS = 16
RETRY = RetryPolicy(max_attempts=100_000)  # the hints honoured; bounded by --timeout
SAMPLE_S = 0.1
POLL_S = 0.02
READY_TIMEOUT_S = 180.0
WARMUP = JobSpec(prompt="Hello", max_new_tokens=4, temperature=0.0, ignore_eos=True)
# Targets (the burst's are what lending every slot means; the chats' and the heavy jobs' the
# design's).
CHAT_P99_OVER_IDLE = 2.0
HEAVY_WALL_RATIO = 1.15
FULL_SHARE = 0.95

T = TypeVar("T")


# Pure parts ----------------------------------------------------------------------------------


def rewrite_prompt(index: int, tokens: int) -> str:
    """A rewrite of about ``tokens`` prompt tokens, its first words its own (no two rewrites
    share a cached prefix)."""
    repeats = max(1, round((tokens - 12) / PARAGRAPH_TOKENS))
    return f"Rewrite document number {index} in plain words.\n\n" + PARAGRAPH * repeats


def chat_prompt(index: int) -> str:
    return f"Question: {QUESTIONS[index % len(QUESTIONS)]}\nAnswer:"


def greedy(prompt: str, max_new_tokens: int, lane: str | None = None) -> JobSpec:
    return JobSpec(
        prompt=prompt,
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        ignore_eos=True,
        stream=True,
        lane=lane,
    )


@dataclass(frozen=True, slots=True)
class Tick:
    """One read of ``/metrics`` in the burst, with the jobs waiting to be admitted then."""

    t_s: float
    taken: int
    waiting: int
    overload: int


def saturation(ticks: Sequence[Tick], slots: int) -> dict[str, Any]:
    """The peak of slots taken, and among the ticks where a job waited to be admitted the share
    with every slot taken; the highest overload state."""
    waited = [t for t in ticks if t.waiting > 0]
    full = sum(1 for t in waited if t.taken >= slots)
    return {
        "samples": len(ticks),
        "peak_slots_taken": max((t.taken for t in ticks), default=0),
        "samples_with_waiting": len(waited),
        "full_while_waiting": full,
        "full_share": round(full / len(waited), 3) if waited else None,
        "overload_max": max((t.overload for t in ticks), default=0),
    }


def first_difference(a: str, b: str) -> int | None:
    """The first character where ``a`` and ``b`` differ (None: equal)."""
    if a == b:
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def ttft_summary(ttfts_s: Sequence[float]) -> dict[str, float | int | None]:
    """p50 and p99 (nearest rank) in ms."""
    if not ttfts_s:
        return {"n": 0, "p50_ms": None, "p99_ms": None}
    return {
        "n": len(ttfts_s),
        "p50_ms": round(percentile(ttfts_s, 50) * 1000, 1),
        "p99_ms": round(percentile(ttfts_s, 99) * 1000, 1),
    }


def compare_heavy(
    beside: Sequence[dict[str, Any]], alone: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """Each heavy job with chats against without: text equal, where it turned (and, when the
    run with chats says how much each had said before the first chat, whether it turned after
    that), wall-time ratio; and the ratio of the heavy work's makespans."""
    jobs = []
    for a, b in zip(beside, alone, strict=True):
        turned = first_difference(a.get("text", ""), b.get("text", ""))
        said = a.get("chars_before_chats")
        jobs.append(
            {
                "job": a["name"],
                "same_text": turned is None,
                "first_difference": turned,
                "turned_after_chats": None
                if said is None
                else turned is not None and turned >= said,
                "wall_ratio": ratio(a.get("wall_s"), b.get("wall_s")),
            }
        )
    walls = [j["wall_ratio"] for j in jobs if j["wall_ratio"] is not None]
    return {
        "jobs": jobs,
        "all_same_text": all(j["same_text"] for j in jobs),
        "turned_after_chats": sum(1 for j in jobs if j["turned_after_chats"]),
        "makespan_ratio": ratio(makespan(beside), makespan(alone)),
        "max_job_wall_ratio": max(walls, default=None),
    }


def makespan(reports: Sequence[dict[str, Any]]) -> float | None:
    """The longest wall time of the jobs (None: one has none: it failed)."""
    walls = [r.get("wall_s") for r in reports]
    return None if None in walls or not walls else max(w for w in walls if w is not None)


# A job and the daemon --------------------------------------------------------------------------


class Job:
    """One generate call on a connection of its own: when it started, its first token, its end."""

    def __init__(self, name: str, spec: JobSpec) -> None:
        self.name = name
        self.spec = spec
        self.started: float | None = None
        self.first_token: float | None = None
        self.ended: float | None = None
        self.chars = 0  # of its text streamed so far
        self.report: dict[str, Any] = {"name": name}

    def on_delta(self, text: str) -> None:
        if self.first_token is None:
            self.first_token = time.monotonic()
        self.chars += len(text)

    async def run(self, port: int, deadline: float) -> dict[str, Any]:
        try:
            async with await GovernorClient.connect(HOST, port, timeout=left(deadline)) as client:
                self.started = time.monotonic()
                got = await client.generate(
                    self.spec, retry=RETRY, timeout=left(deadline), on_delta=self.on_delta
                )
        except (ClientError, OSError, TimeoutError) as exc:
            self.ended = time.monotonic()
            self.report["error"] = f"{type(exc).__name__}: {exc}"
            return self.report
        self.ended = time.monotonic()
        result = got.reply.result or {}
        self.report.update(
            status=str(got.reply.status),
            need_code=got.reply.need_code,
            wall_s=round(self.ended - self.started, 3),
            ttft_s=None if self.first_token is None else round(self.first_token - self.started, 3),
            server_ttft_ms=result.get("ttft_ms"),
            prompt_tokens=result.get("prompt_tokens"),
            completion_tokens=result.get("completion_tokens"),
            degraded=result.get("degraded"),
            yields=len(got.yields),
            yield_codes=dict(collections.Counter(str(y.need_code) for y in got.yields)),
            yield_hints_ms=[y.retry_hint_ms for y in got.yields],
            text=str(result.get("text", "")),
        )
        if not got.done:
            self.report["error"] = f"{got.reply.status} {got.reply.need_code}"
        return self.report


def left(deadline: float) -> float:
    """Seconds to ``deadline``; TimeoutError when none are left."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("the run's --timeout passed")
    return remaining


async def until(done: Callable[[], bool], deadline: float) -> None:
    while not done():
        left(deadline)
        await asyncio.sleep(POLL_S)


async def metrics(d: Replica) -> list[Sample]:
    """Its /metrics, or ``RuntimeError`` when it does not answer."""
    samples = await d.metrics()
    if samples is None:
        raise RuntimeError(f"{d.name} did not answer /metrics: {d.log_tail(1500)}")
    return samples


@contextlib.contextmanager
def daemon(args: argparse.Namespace, folder: Path, deadline: float) -> Iterator[Replica]:
    """``governor serve --lanes true`` on the embedded model, ready; stopped by its PID."""
    port, metrics_port = free_port(), free_port()
    log = folder / f"governor-{port}.log"
    command = [
        *(sys.executable, "-m", "governor", "serve", "--lanes", "true"),
        *("--listen", f"{HOST}:{port}", "--metrics-listen", f"{HOST}:{metrics_port}"),
        *("--max-inflight", str(args.slots), "--threads", str(args.threads)),
        *("--log-level", "warning", "--shutdown-grace", "2"),
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
    found = Replica("governor", proc, port, metrics_port, log, args.slots)
    try:
        wait_for = min(READY_TIMEOUT_S, left(deadline))
        try:
            wait_listening(port, proc, wait_for)
            ready = f"http://{HOST}:{metrics_port}/healthz/ready"
            wait_http_ready(proc, ready, "governor", min(wait_for, left(deadline)))
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: {found.log_tail(1500)}") from None
        yield found
    finally:
        stop(proc)


async def bounded(work: Awaitable[T], deadline: float) -> T:
    async with asyncio.timeout(left(deadline)):
        return await work


def in_loop(work: Callable[[], Awaitable[T]], deadline: float) -> T:
    async def main() -> T:
        return await bounded(work(), deadline)

    return run_loop(main())


async def warm(d: Replica, deadline: float) -> None:
    """One tiny job first: the parts measured do not pay for the worker's first step."""
    report = await Job("warm-up", WARMUP).run(d.port, deadline)
    if "error" in report:
        raise RuntimeError(f"the warm-up job failed: {report['error']}")


def counters(samples: list[Sample]) -> dict[str, Any]:
    return {
        "suspensions": by_label(samples, "governor_suspensions_total", "lane"),
        "resumes": by_label(samples, "governor_resumes_total", "lane"),
        "overload_transitions": total(samples, "governor_overload_transitions_total"),
        "overload_state": total(samples, "governor_overload_state"),
    }


def since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The counters' growth (by lane for the labelled ones); the overload state at the end."""
    grown: dict[str, Any] = {"overload_state": after["overload_state"]}
    for key in ("suspensions", "resumes"):
        grown[key] = {k: int(v - before[key].get(k, 0)) for k, v in after[key].items()}
    grown["overload_transitions"] = int(
        after["overload_transitions"] - before["overload_transitions"]
    )
    return grown


# The parts ---------------------------------------------------------------------------------


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


# The command -------------------------------------------------------------------------------


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
    return {k: getattr(args, k) for k in (*keys, "chats", "chat_gap", "control")}


def verdicts(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each figure with its target and whether it was met (None: nothing to judge)."""
    b, c, h = report["burst"], report["chats"], report["heavy"]
    slots, peak, share = report["settings"]["slots"], b["peak_slots_taken"], b["full_share"]
    rows = [
        ("burst: peak slots taken", peak, f"= {slots}", peak == slots),
        (
            "burst: share of waiting samples with every slot taken",
            share,
            f">= {FULL_SHARE}",
            None if share is None else share >= FULL_SHARE,
        ),
        ("burst: highest overload state", b["overload_max"], "0", b["overload_max"] == 0),
        (
            "chats: TTFT p99 beside heavy / idle",
            c["p99_over_idle"],
            f"<= {CHAT_P99_OVER_IDLE}",
            _at_most(c["p99_over_idle"], CHAT_P99_OVER_IDLE),
        ),
        (
            "heavy: texts the same with chats as without",
            h["all_same_text"],
            "true",
            h["all_same_text"],
        ),
        (
            "heavy: texts that turned after the first chat",
            h["turned_after_chats"],
            "0",
            h["turned_after_chats"] == 0,
        ),
        (
            "heavy: makespan with chats / without",
            h["makespan_ratio"],
            f"<= {HEAVY_WALL_RATIO}",
            _at_most(h["makespan_ratio"], HEAVY_WALL_RATIO),
        ),
        (
            "heavy: worst job's wall time with chats / without",
            h["max_job_wall_ratio"],
            f"<= {HEAVY_WALL_RATIO}",
            _at_most(h["max_job_wall_ratio"], HEAVY_WALL_RATIO),
        ),
    ]
    return [{"figure": f, "value": v, "target": t, "met": m} for f, v, t, m in rows]


def _at_most(value: float | None, bound: float) -> bool | None:
    return None if value is None else value <= bound


def job_line(r: dict[str, Any]) -> str:
    if "wall_s" not in r:
        return f"  {r['name']:10} {r.get('error')}"
    codes = ", ".join(f"{k} x{n}" for k, n in r["yield_codes"].items())
    if r["yield_hints_ms"]:
        codes += f"; hints {', '.join(str(h) for h in r['yield_hints_ms'])} ms"
    return (
        f"  {r['name']:10} wall {r['wall_s']:7.2f} s  ttft {r['ttft_s']} s  "
        f"{r['completion_tokens']} tokens of a {r['prompt_tokens']}-token prompt  "
        f"{r['yields']} refusal(s){f' ({codes})' if codes else ''}"
        + (f"  ERROR {r['error']}" if "error" in r else "")
    )


def print_summary(report: dict[str, Any]) -> None:
    b, c, h = report["burst"], report["chats"], report["heavy"]
    print(f"burst: {len(b['jobs'])} rewrites at once, {b['seconds']} s")
    print(
        f"  /metrics every {SAMPLE_S * 1000:.0f} ms: {b['samples']} samples ({b['metrics_misses']} "
        f"missed), a job waiting in {b['samples_with_waiting']}, every slot taken in "
        f"{b['full_while_waiting']} of those"
    )
    for r in b["jobs"]:
        print(job_line(r))
    print("chats, one at a time:")
    for key, what in (("idle", "idle daemon"), ("beside_heavy", "beside the heavy jobs")):
        s = c[key]
        print(f"  {what:22} TTFT p50 {s['p50_ms']} ms  p99 {s['p99_ms']} ms  ({s['n']} chats)")
    print(
        f"  refusals beside the heavy jobs: {c['yields_beside_heavy']}; chats sent from "
        f"{h['chats_from_s']} s into the heavy jobs (each had its first token)"
    )
    print(
        f"heavy jobs: {h['seconds_with_chats']} s with chats, {h['seconds_without_chats']} s "
        f"without"
    )
    for j, a, w in zip(h["jobs"], h["with_chats"], h["without_chats"], strict=True):
        text = "same text"
        if not j["same_text"]:
            when = "after" if j["turned_after_chats"] else "before"
            text = (
                f"text differs at char {j['first_difference']} ({when} the first chat: "
                f"{a.get('chars_before_chats')} chars said by then)"
            )
        print(
            f"  {j['job']:10} {text}; wall {a.get('wall_s')} s with chats, {w.get('wall_s')} s "
            f"without (x{j['wall_ratio']})"
        )
    if "control" in h:
        k = h["control"]
        same = sum(j["same_text"] for j in k["jobs"])
        print(
            f"  control, without chats again: {same}/{len(k['jobs'])} texts the same, makespan "
            f"x{k['makespan_ratio']} ({k['seconds']} s)"
        )
    for key in ("metrics_with_chats", "metrics_without_chats"):
        m = h[key]
        print(
            f"  {key.removeprefix('metrics_').replace('_', ' ')}: suspensions {m['suspensions']}, "
            f"resumes {m['resumes']}, overload transitions {m['overload_transitions']}"
        )
    print("figures and targets:")
    for v in report["verdicts"]:
        mark = {True: "met", False: "MISSED", None: "n/a"}[v["met"]]
        print(f"  {v['figure']:54} {v['value']!s:>8}  target {v['target']:8} {mark}")
    for error in report["errors"]:
        print(f"error: {error}")


def without_texts(reports: list[dict[str, Any]]) -> None:
    """The texts left out of the report (compared already): their length and first words."""
    for r in reports:
        text = r.pop("text", None)
        if text is not None:
            r["text_chars"] = len(text)
            r["text_head"] = text[:60]


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME,
        help="heavy work lent every slot; chats take slots back by suspending it",
        description=__doc__,
        formatter_class=RawDescriptionDefaultsHelpFormatter,
    )
    parser.add_argument("--slots", type=positive_int, default=4, help="the daemon's --max-inflight")
    parser.add_argument("--threads", type=positive_int, default=1, help="the daemon's --threads")
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
