"""``generation``: the generation benchmarks, every target side by side in one run.

Targets (``--targets``), each started here on a free loopback port, one after another, and
stopped by its PID before the next starts:

* ``governor``: ``governor serve --runner llama --max-inflight S --workers 1 --threads T``:
  the batched runner, one worker process running S sequences;
* ``per-process``: the same with ``--workers S --threads 0`` (one sequence per worker process,
  the cores shared out among them: the governor's runner before it batched);
* ``llama-server``: llama.cpp's own server (``deploy/build-llama-server.sh``), ``-np S -kvu``
  (one KV cache shared by the slots, so that a long prompt fits any slot), ``-t T``;
* ``llama-cpp-python``: :mod:`loadtest.support.baseline_server`'s server (one request at a time).

Each governor is started with ``--probe-interval 600``, so that no readiness probe runs
during the measures. Measures (``--measures``):

* ``throughput``: aggregate tokens/s of N concurrent greedy streams of ``--max-new-tokens`` for
  each N of ``--streams``: completion tokens received over the round's wall time. Prompts are
  distinct story openings, which SmolLM2 does not end early, and every target gets
  ``ignore_eos``. The target is started once with S = ``--slots`` (default: the largest N),
  after a warm-up round of S short jobs.
* ``idle``: time to first token of ``--chats`` chats sent one after another (distinct
  questions through the chat template, ``--chat-tokens`` new tokens, streamed), from the
  client's send to the first non-empty delta; p50 and p90.
* ``burst``: chats beside long rewrites, for each S of ``--burst-slots``, on a target started
  with S slots (llama-server also gets ``cache_prompt`` false; governors get ``--lanes true``):
  3 chats one after another (the idle reference), then four rounds, each of distinct chats
  (distinct questions through the chat template, ``--chat-tokens`` new tokens, streamed) and
  rewrites of about ``--rewrite-tokens`` prompt tokens (distinct, sharing no prefix, through
  the chat template, ``--max-new-tokens`` new tokens):

  - ``alone``: S - 2 chats at once;
  - ``beside``: 2 rewrites, and ``--burst-delay`` seconds later the S - 2 chats of ``alone``'s
    size (every job has a slot);
  - ``alone_all``: S chats at once;
  - ``over``: 2 rewrites, and ``--burst-delay`` seconds later S chats (two more than there
    are slots: two chats wait for a slot).

  Chat TTFT counts from each chat's first send, yields and retries included (the governor's
  client asks to wait for its turn, as governor-cli does, and honours ``retry_hint_ms`` past
  it); TPOT is over the tokens after the first. Reported per round: chat
  TTFT and TPOT p50 and p99, e2e p99, yields, each rewrite's end from the round's start, and
  lost requests (no terminal answer: timed out, broken, retries spent); and the ratios the
  targets are set on: ``beside`` over ``alone`` (TTFT p99, TPOT p99), ``over``'s TPOT p99 over
  ``alone_all``'s, and ``over``'s TTFT p99 over ``alone_all``'s TTFT p99 + e2e p99 (a waiting
  chat starts within about one chat's run).
* ``memory``: proportional set size (``Pss`` of ``/proc/PID/smaps_rollup``) of the target and
  every process below it, after the warm-up round, with S slots; then on a fresh target with
  1 slot after one job; and their ratio.

Every round is bounded by ``--timeout``. On a machine shared with other work, each measure
first waits (``--wait-quiet`` seconds at most) until other processes leave the CPUs below 3 %
busy, and records the share of the CPUs they used while it ran (``others_cpu``; the tables'
"others"); a throughput round they disturbed is run again, ``--attempts`` in all, and the least
disturbed kept. Figures print as one table per measure, and with ``--json`` the last line of
stdout is the whole report as JSON (also written to ``--report FILE``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clients.client import DEFAULT_MAX_WAIT_S, ClientError, RetryPolicy
from clients.helptext import RawDescriptionDefaultsHelpFormatter, add_renamed

from ..support import baseline_server, llama_server
from ..support.connections import Endpoint, StartError, run_loop
from ..support.driver import closed_loop, open_loop
from ..support.machine import QUIET_SHARE, CpuWindow, wait_quiet
from ..support.options import (
    positive_float,
    positive_int,
    positive_ints,
    print_json,
)
from ..support.processes import (
    REPO,
    free_port,
    process_tree,
    stop,
    tree_rollup_kib,
    wait_http_ready,
    wait_listening,
)
from ..support.stats import percentile, ratio
from ..support.targets import ABORTED, DONE, GovernorTarget, OpenAITarget, Outcome, Shape, Target
from ..support.workload import Request

NAME = "generation"
TARGETS = ("governor", "per-process", "llama-server", "llama-cpp-python")
DEFAULT_TARGETS = ("governor", "per-process", "llama-server")
MEASURES = ("throughput", "idle", "burst", "memory")
GOVERNORS = ("governor", "per-process")
READY_TIMEOUT_S = 180.0
RETRY = RetryPolicy(max_attempts=10_000, max_sleep_s=2.0)  # bounded by --timeout
SAMPLE_S = 1.0
IDLE_IN_BURST = 3  # chats one after another before the burst: its idle reference
REWRITES = 2
# The burst's rounds: (name, rewrites in it, chats as slots less this).
ROUNDS = (
    ("alone", 0, REWRITES),
    ("beside", REWRITES, REWRITES),
    ("alone_all", 0, 0),
    ("over", REWRITES, 0),
)
WARMUP_TOKENS = 8

# llama-server: the fields every request carries; burst requests also skip its prompt cache.
LLAMA_SERVER_EXTRA: dict[str, Any] = {
    "ignore_eos": True,
    "stream_options": {"include_usage": True},
}
COLD_EXTRA: dict[str, Any] = {"cache_prompt": False}

TOPICS = (
    "rain",
    "a volcano",
    "photosynthesis",
    "a comet",
    "gravity",
    "an eclipse",
    "a glacier",
    "inflation",
    "a rainbow",
    "a tsunami",
    "democracy",
    "a vaccine",
    "the tide",
    "a black hole",
    "a coral reef",
    "an atom",
    "a desert",
    "a hurricane",
    "erosion",
    "a neuron",
    "a galaxy",
    "a monsoon",
    "a fossil",
    "an earthquake",
    "a forest fire",
    "a magnet",
    "an enzyme",
    "a bridge",
    "a compass",
    "a lighthouse",
    "a windmill",
    "a microscope",
)

# Original prose for the rewrites: a report with enough distinct content that a rewrite of it
# runs past max_new_tokens. Paragraphs are rotated per rewrite, so that no two share a prefix.
# ("paragraph by paragraph": without it, greedy SmolLM2 ends some of these rewrites within 30
# tokens; the burst's jobs are real ones, without ignore_eos.)
PARAGRAPHS = (
    "The harbour committee met on the first Tuesday of the month in the old customs house. "
    "Twelve members attended, together with the harbour master and two representatives of the "
    "fishing cooperative. The chair opened the meeting by thanking the volunteers who had "
    "repainted the railings along the north quay, a job that had been postponed for three "
    "winters because of the weather and the cost of scaffolding.",
    "The harbour master reported that the dredging of the inner basin had been completed two "
    "weeks ahead of schedule. The contractor removed about four thousand cubic metres of silt, "
    "which was tested for heavy metals before being spread on the reclaimed land behind the "
    "boatyard. The depth at low water is now close to three metres across the whole basin, "
    "which means that the larger trawlers will no longer need to wait for the tide.",
    "The treasurer presented the accounts for the first half of the year. Mooring fees brought "
    "in slightly more than expected, mainly because of visiting yachts during the festival, "
    "but the repair of the slipway winch cost almost twice the estimate once the old gearbox "
    "was opened. She proposed that the reserve fund be used to cover the difference and that "
    "the committee review its insurance, which has not been renegotiated for six years.",
    "Several members raised the question of parking on the quay during the summer. Delivery "
    "vans for the fish market regularly find the loading bay blocked by visitors' cars, and on "
    "two occasions an ambulance had difficulty reaching the lifeboat station. After a long "
    "discussion the committee agreed to ask the council for permission to paint a yellow line "
    "along the seaward edge and to install a barrier that opens only for permit holders.",
    "The fishing cooperative thanked the committee for its support during the storm in March, "
    "when three boats broke their moorings and one was driven onto the rocks below the "
    "lighthouse. The cooperative has since replaced the worn chains with heavier ones and asked "
    "whether the harbour could lend its workboat for the annual inspection of the buoys, "
    "which would save the members the cost of hiring a vessel from the neighbouring town.",
    "Finally, the chair reminded everyone that nominations for the committee's elections close "
    "at the end of next month. Two long-serving members have announced that they will not "
    "stand again, and the committee would welcome candidates from the newer residents of the "
    "waterfront flats, who have so far been under-represented. The meeting closed at half past "
    "nine, and the next one will be held in the lifeboat station while the customs house is "
    "being rewired.",
)
REWRITE_INSTRUCTION = (
    "Rewrite the following report in plain, simple English, paragraph by paragraph, keeping "
    "every point:"
)


def story(k: int) -> str:
    """A distinct completion prompt that the embedded model continues past 128 tokens."""
    return f"Story {k}: Once upon a time, in a small village by the sea,"


def question(k: int) -> str:
    """A distinct short chat question."""
    topic = TOPICS[k % len(TOPICS)]
    return f"In one sentence, what is {topic}?" + (f" ({k})" if k >= len(TOPICS) else "")


def rewrite_prompts(
    count: int, tokens: int, tokenize: Callable[[str], int]
) -> list[tuple[str, int]]:
    """``count`` rewrite prompts of at least ``tokens`` tokens by ``tokenize`` (a text's length
    in tokens), each starting at another paragraph; with their lengths."""
    out = []
    for k in range(count):
        text = REWRITE_INSTRUCTION
        i = k
        while (n := tokenize(text)) < tokens:
            text += "\n\n" + PARAGRAPHS[i % len(PARAGRAPHS)]
            i += 1
        out.append((text, n))
    return out


def parse_choices(allowed: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: a comma-separated list of ``allowed`` names, in the order given."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(name.strip() for name in text.split(",") if name.strip())
        unknown = [name for name in names if name not in allowed]
        if not names or unknown or len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(
                f"{text!r}: a list of distinct names among {','.join(allowed)}"
            )
        return names

    return parse


# Targets ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """What every target is started with, from the options."""

    model: Path
    threads: int
    n_ctx: int
    server_ctx: int
    n_gpu_layers: int
    llama_server: Path
    governor_args: tuple[str, ...] = ()


def command(name: str, settings: Settings, *, slots: int, lanes: bool, port: int) -> list[str]:
    """The command line that starts target ``name`` with ``slots`` slots on ``port``."""
    if name == "llama-server":
        return llama_server.command(
            settings.llama_server,
            settings.model,
            port=port,
            slots=slots,
            ctx=settings.server_ctx,
            threads=settings.threads,
            n_gpu_layers=settings.n_gpu_layers,
            unified_kv=True,
        )
    if name == "llama-cpp-python":
        return baseline_server.command(
            settings.model, port, threads=settings.threads, n_ctx=settings.n_ctx
        )
    if name not in GOVERNORS:
        raise ValueError(f"no target {name!r}")
    # per-process: one worker per slot, --threads 0 (the governor's default: the cores shared
    # out among its workers), the runner that ran one sequence per worker process.
    workers, threads = (1, settings.threads) if name == "governor" else (slots, 0)
    return [
        sys.executable,
        "-m",
        "governor",
        "serve",
        "--runner",
        "llama",
        "--model",
        str(settings.model),
        "--listen",
        f"127.0.0.1:{port}",
        "--max-inflight",
        str(slots),
        "--workers",
        str(workers),
        "--threads",
        str(threads),
        "--n-ctx",
        str(settings.n_ctx),
        "--n-gpu-layers",
        str(settings.n_gpu_layers),
        "--lanes",
        "on" if lanes else "off",
        "--probe-interval",
        "600",
        "--log-level",
        "warning",
        *settings.governor_args,
    ]


@dataclass(slots=True)
class Instance:
    """One started target: its process (stopped by PID) and how to load it."""

    name: str
    proc: subprocess.Popen[bytes]
    argv: list[str]
    endpoint: Endpoint | None = None  # a governor
    url: str | None = None  # an OpenAI-compatible server
    extra: dict[str, Any] = field(default_factory=dict)  # in every request's body
    cold_extra: dict[str, Any] = field(default_factory=dict)  # ... and in the burst's

    def target(self, shape: Shape, cold: bool = False) -> Target:
        if self.endpoint is not None:
            return GovernorTarget(self.endpoint, shape, RETRY)
        assert self.url is not None
        extra = {**self.extra, **self.cold_extra} if cold else self.extra
        return OpenAITarget(self.url, shape, extra=extra)


def launch(name: str, settings: Settings, *, slots: int, lanes: bool, log: Path) -> Instance:
    """Start a target, its output to ``log``; wait until an HTTP server answers, or a governor
    listens. Blocking: nothing else runs meanwhile. Raises RuntimeError (with it stopped)."""
    port = free_port()
    argv = command(name, settings, slots=slots, lanes=lanes, port=port)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    if name == "llama-server":
        wait_http_ready(proc, url + llama_server.READY_PATH, name, READY_TIMEOUT_S)
        return Instance(name, proc, argv, url=url, extra=LLAMA_SERVER_EXTRA, cold_extra=COLD_EXTRA)
    if name == "llama-cpp-python":
        wait_http_ready(proc, url + "/v1/models", name, READY_TIMEOUT_S)
        return Instance(name, proc, argv, url=url)
    try:
        wait_listening(port, proc, READY_TIMEOUT_S)
    except BaseException:
        stop(proc)
        raise
    return Instance(name, proc, argv, endpoint=Endpoint("127.0.0.1", port))


async def start(name: str, settings: Settings, *, slots: int, lanes: bool, log: Path) -> Instance:
    """:func:`launch`, and for a governor its first ping answered: the port is bound before
    the workers load, and connections are served once they have."""
    inst = launch(name, settings, slots=slots, lanes=lanes, log=log)
    if inst.endpoint is None:
        return inst
    try:
        async with await inst.endpoint.connect(timeout=READY_TIMEOUT_S) as client:
            await client.ping(timeout=READY_TIMEOUT_S)
    except BaseException:
        stop(inst.proc)
        raise
    return inst


# Pure summaries ----------------------------------------------------------------------------


def _r(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def lost(outcomes: Sequence[Outcome]) -> int:
    """Requests that got no terminal answer (neither done nor aborted)."""
    return sum(1 for o in outcomes if o.status not in (DONE, ABORTED))


def throughput_row(streams: int, outcomes: Sequence[Outcome], seconds: float) -> dict[str, Any]:
    """One round: completion tokens received over the round's wall time."""
    tokens = [o.tokens for o in outcomes]
    total = sum(tokens)
    ttfts = [t for o in outcomes if (t := o.ttft_ms) is not None]
    return {
        "streams": streams,
        "done": sum(1 for o in outcomes if o.status == DONE),
        "lost": lost(outcomes),
        "tokens": total,
        "tokens_min": min(tokens, default=0),
        "tokens_max": max(tokens, default=0),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(total / seconds, 1) if seconds > 0 else None,
        "ttft_max_ms": _r(max(ttfts, default=None)),
    }


def ttft_row(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """p50 and p90 (nearest rank) of the chats' TTFT, and how many had none."""
    ttfts = [t for o in outcomes if (t := o.ttft_ms) is not None]
    return {
        "n": len(ttfts),
        "p50_ms": _r(percentile(ttfts, 50)) if ttfts else None,
        "p90_ms": _r(percentile(ttfts, 90)) if ttfts else None,
        "lost": lost(outcomes),
    }


def round_row(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """One round of the burst: its chats' TTFT, TPOT (ms) and e2e (s), its rewrites' ends (s
    from the round's start), told apart by their request class."""
    chats = [o for o in outcomes if o.request.cls == "chat"]
    rewrites = [o for o in outcomes if o.request.cls == "rewrite"]

    def pct(values: list[float], q: float, scale: float = 1.0) -> float | None:
        return _r(percentile(values, q) / scale) if values else None

    ttfts = [t for o in chats if (t := o.ttft_ms) is not None]
    tpots = [t for o in chats if (t := o.tpot_ms) is not None]
    e2es = [t for o in chats if (t := o.e2e_ms) is not None]
    return {
        "chats": len(chats),
        "ttft_p50_ms": pct(ttfts, 50),
        "ttft_p99_ms": pct(ttfts, 99),
        "tpot_p50_ms": pct(tpots, 50),
        "tpot_p99_ms": pct(tpots, 99),
        "e2e_p99_ms": pct(e2es, 99),
        "yields": sum(len(o.yields) for o in chats),
        "rewrite_end_s": [_r(o.end_s, 3) if o.status == DONE else None for o in rewrites],
        "rewrite_tokens": [o.tokens for o in rewrites],
        "lost": lost(outcomes),
    }


def burst_ratios(rounds: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """The ratios the targets are set on (see the module docstring)."""
    alone, beside = rounds.get("alone", {}), rounds.get("beside", {})
    alone_all, over = rounds.get("alone_all", {}), rounds.get("over", {})
    run_ms = None
    if alone_all.get("ttft_p99_ms") is not None and alone_all.get("e2e_p99_ms") is not None:
        run_ms = alone_all["ttft_p99_ms"] + alone_all["e2e_p99_ms"]
    return {
        "beside_ttft": ratio(beside.get("ttft_p99_ms"), alone.get("ttft_p99_ms")),
        "beside_tpot": ratio(beside.get("tpot_p99_ms"), alone.get("tpot_p99_ms")),
        "over_tpot": ratio(over.get("tpot_p99_ms"), alone_all.get("tpot_p99_ms")),
        "over_ttft": ratio(over.get("ttft_p99_ms"), run_ms),
    }


@dataclass(frozen=True, slots=True)
class Memory:
    """A target's process tree at one moment: its PSS, the anonymous part of it (the file pages
    of a model that other programs also map are shared with them too) and how many processes."""

    pss_kib: int | None
    anon_kib: int | None
    processes: int

    @classmethod
    def of(cls, pid: int) -> Memory:
        fields = tree_rollup_kib(pid) or {}
        return cls(fields.get("Pss"), fields.get("Pss_Anon"), len(process_tree(pid)))


def memory_row(slots: Memory, one: Memory) -> dict[str, Any]:
    """PSS with S slots and with 1 (MiB), and their ratios."""

    def mib(kib: int | None) -> float | None:
        return _r(None if kib is None else kib / 1024)

    return {
        "pss_slots_mib": mib(slots.pss_kib),
        "pss_anon_slots_mib": mib(slots.anon_kib),
        "processes_slots": slots.processes,
        "pss_one_mib": mib(one.pss_kib),
        "pss_anon_one_mib": mib(one.anon_kib),
        "processes_one": one.processes,
        "ratio": ratio(slots.pss_kib, one.pss_kib),
        "anon_ratio": ratio(slots.anon_kib, one.anon_kib),
    }


# Measures ----------------------------------------------------------------------------------


def _requests(cls: str, count: int, output_tokens: int, at_s: float = 0.0) -> list[Request]:
    return [Request(at_s, cls, 0, output_tokens) for _ in range(count)]


async def _round(
    inst: Instance, shape: Shape, requests: list[Request], timeout: float, label: str
) -> tuple[list[Outcome], float]:
    run = await open_loop(
        inst.target(shape),
        requests,
        connections=len(requests),
        timeout_s=timeout,
        sample_s=SAMPLE_S,
        label=label,
    )
    return run.outcomes, run.duration_s


async def _chats(
    inst: Instance, questions: list[str], tokens: int, timeout: float, cold: bool
) -> list[Outcome]:
    """Chats one after another, on one connection."""
    shape = Shape(temperature=0.0, chat=True, prompts=tuple(questions))
    count = len(questions)
    run = await closed_loop(
        inst.target(shape, cold=cold),
        1,
        lambda _client, r: Request(0.0, "chat", 0, tokens) if r < count else None,
        timeout_s=timeout,
        sample_s=SAMPLE_S,
        label=f"{inst.name} chats",
        total=count,
    )
    return run.outcomes


async def _quiet(args: argparse.Namespace, inst: Instance) -> None:
    """Wait (at most ``--wait-quiet`` seconds) for other processes to leave the CPUs."""
    if args.wait_quiet > 0:
        await asyncio.to_thread(wait_quiet, args.wait_quiet, inst.proc.pid)


def _note(text: str) -> None:
    print(f"generation: {text}", file=sys.stderr, flush=True)


async def measure_target(
    name: str, args: argparse.Namespace, settings: Settings, rewrites: list[tuple[str, int]]
) -> dict[str, Any]:
    slots = args.slots or max(args.streams)
    want = set(args.measures)
    result: dict[str, Any] = {"slots": slots}
    at_slots = Memory(None, None, 0)
    logs: Path = args.logs

    if want & {"throughput", "idle", "memory"}:
        inst = await start(name, settings, slots=slots, lanes=False, log=logs / f"{name}.log")
        result["argv"] = inst.argv
        _note(f"{name} up (pid {inst.proc.pid}, {slots} slots)")
        try:
            warm = Shape(temperature=0.0, prompts=tuple(story(10_000 + i) for i in range(slots)))
            await _round(
                inst, warm, _requests("warmup", slots, WARMUP_TOKENS), args.round_timeout, "warm"
            )
            at_slots = Memory.of(inst.proc.pid)
            if "throughput" in want:
                result["throughput"] = await measure_throughput(name, inst, args)
            if "idle" in want:
                await _quiet(args, inst)
                window = CpuWindow(inst.proc.pid)
                outcomes = await _chats(
                    inst,
                    [question(k) for k in range(args.chats)],
                    args.chat_tokens,
                    args.round_timeout,
                    cold=False,
                )
                result["idle"] = {**ttft_row(outcomes), "others_cpu": window.others()}
                _note(f"{name} idle chat TTFT {result['idle']}")
        finally:
            stop(inst.proc, 15.0)

    if "burst" in want:
        result["bursts"] = [
            await measure_burst(name, args, settings, rewrites, slots)
            for slots in args.burst_slots or (slots,)
        ]

    if "memory" in want:
        inst = await start(name, settings, slots=1, lanes=False, log=logs / f"{name}-one.log")
        try:
            warm = Shape(temperature=0.0, prompts=(story(20_000),))
            await _round(
                inst, warm, _requests("warmup", 1, WARMUP_TOKENS), args.round_timeout, "warm"
            )
            at_one = Memory.of(inst.proc.pid)
        finally:
            stop(inst.proc, 15.0)
        result["memory"] = memory_row(at_slots, at_one)
        _note(f"{name} memory {result['memory']}")
    return result


async def measure_throughput(
    name: str, inst: Instance, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """A round of N streams for each N of ``--streams``, each run up to ``--attempts`` times
    while other processes disturb it; the least disturbed is kept."""
    rows, first = [], 0
    for n in args.streams:
        best: dict[str, Any] | None = None
        for _ in range(args.attempts):
            shape = Shape(
                temperature=0.0,
                ignore_eos=True,
                prompts=tuple(story(first + i) for i in range(n)),
                max_wait=DEFAULT_MAX_WAIT_S,
            )
            first += n
            await _quiet(args, inst)
            window = CpuWindow(inst.proc.pid)
            outcomes, seconds = await _round(
                inst,
                shape,
                _requests("stream", n, args.max_new_tokens),
                args.round_timeout,
                f"{name} x{n}",
            )
            row = {**throughput_row(n, outcomes, seconds), "others_cpu": window.others()}
            if best is None or row["others_cpu"] < best["others_cpu"]:
                best = row
            if row["others_cpu"] < QUIET_SHARE:
                break
        assert best is not None, "attempts >= 1"
        rows.append(best)
        _note(f"{name} {n} stream(s): {best}")
    return rows


async def measure_burst(
    name: str,
    args: argparse.Namespace,
    settings: Settings,
    rewrites: list[tuple[str, int]],
    slots: int,
) -> dict[str, Any]:
    """The burst's rounds on a target started with ``slots`` slots (see the module docstring)."""
    lanes = name in GOVERNORS
    log = args.logs / f"{name}-burst-{slots}.log"
    inst = await start(name, settings, slots=slots, lanes=lanes, log=log)
    result: dict[str, Any] = {"slots": slots, "lanes": lanes, "argv": inst.argv, "rounds": {}}
    try:
        asked = args.chats
        await _quiet(args, inst)
        window = CpuWindow(inst.proc.pid)
        idle = await _chats(
            inst,
            [question(asked + k) for k in range(IDLE_IN_BURST)],
            args.chat_tokens,
            args.round_timeout,
            cold=True,
        )
        asked += IDLE_IN_BURST
        result["idle"] = ttft_row(idle)
        unused = list(rewrites)
        for label, heavy, fewer in ROUNDS:
            chats = max(slots - fewer, 1)
            prompts = [text for text, _ in unused[:heavy]]
            del unused[:heavy]
            prompts += [question(asked + k) for k in range(chats)]
            asked += chats
            delay = args.burst_delay if heavy else 0.0
            requests = _requests("rewrite", heavy, args.max_new_tokens)
            requests += _requests("chat", chats, args.chat_tokens, delay)
            shape = Shape(
                temperature=0.0, chat=True, prompts=tuple(prompts), max_wait=DEFAULT_MAX_WAIT_S
            )
            run = await open_loop(
                inst.target(shape, cold=True),
                requests,
                connections=len(requests),
                timeout_s=args.round_timeout,
                sample_s=SAMPLE_S,
                label=f"{name} {label} x{slots}",
            )
            result["rounds"][label] = round_row(run.outcomes)
            _note(f"{name} {slots} slots, {label}: {result['rounds'][label]}")
        result["ratios"] = burst_ratios(result["rounds"])
        result["rewrite_prompt_tokens"] = [n for _, n in rewrites]
        result["others_cpu"] = window.others()
    finally:
        stop(inst.proc, 15.0)
    return result


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from governor.runners.llama import embedded_model_path

    model = (args.model or embedded_model_path()).resolve()
    settings = Settings(
        model=model,
        threads=args.threads,
        n_ctx=args.n_ctx,
        server_ctx=args.server_ctx,
        n_gpu_layers=args.n_gpu_layers,
        llama_server=args.llama_server,
        governor_args=tuple(args.governor_arg),
    )
    report: dict[str, Any] = {
        "command": NAME,
        "model": model.name,
        "threads": args.threads,
        "n_ctx": args.n_ctx,
        "server_ctx": args.server_ctx,
        "n_gpu_layers": args.n_gpu_layers,
        "slots": args.slots or max(args.streams),
        "streams": list(args.streams),
        "max_new_tokens": args.max_new_tokens,
        "chat_tokens": args.chat_tokens,
        "measures": list(args.measures),
        "logs": str(args.logs),
        "targets": {},
        "notes": [],
    }
    rewrites: list[tuple[str, int]] = []
    if "burst" in args.measures:
        from llama_cpp import Llama

        vocab = Llama(model_path=str(model), vocab_only=True, verbose=False)
        rewrites = rewrite_prompts(
            REWRITES * sum(1 for _, heavy, _ in ROUNDS if heavy),
            args.rewrite_tokens,
            lambda text: len(vocab.tokenize(text.encode(), add_bos=False)),
        )
    for name in args.targets:
        if name == "llama-server" and not settings.llama_server.is_file():
            report["notes"].append(
                f"llama-server skipped: no {settings.llama_server} (deploy/build-llama-server.sh)"
            )
            continue
        try:
            report["targets"][name] = await measure_target(name, args, settings, rewrites)
        except (RuntimeError, StartError, ClientError, OSError, TimeoutError) as exc:
            report["notes"].append(f"{name} failed: {exc!r}")
    return report


# Output ------------------------------------------------------------------------------------


def _cell(value: Any, width: int) -> str:
    return f"{'-' if value is None else value:>{width}}"


def _share(*rows: dict[str, Any]) -> str:
    """The most that other processes kept the CPUs busy over ``rows``, as a percentage."""
    shares = [r["others_cpu"] for r in rows if r.get("others_cpu") is not None]
    return f"{max(shares) * 100:.0f}%" if shares else "-"


def render(report: dict[str, Any]) -> list[str]:
    """The report as one table per measure (the JSON line aside). "others": the share of the
    machine's CPUs that other processes used meanwhile (the most over a target's rounds)."""
    targets: dict[str, dict[str, Any]] = report["targets"]
    lines = [
        f"{report['model']}, {report['threads']} thread(s), n_gpu_layers "
        f"{report['n_gpu_layers']}, {report['slots']} slots (each target started once with "
        f"them), governor n_ctx {report['n_ctx']}, llama-server -c {report['server_ctx']}"
    ]
    width = max([12, *(len(name) for name in targets)])
    for key, table in (
        ("throughput", _throughput_table),
        ("idle", _idle_table),
        ("bursts", _burst_table),
        ("memory", _memory_table),
    ):
        if any(key in t for t in targets.values()):
            lines += ["", *table(report, targets, width)]
    lines += [f"note: {note}" for note in report["notes"]]
    return lines


def _throughput_table(
    report: dict[str, Any], targets: dict[str, dict[str, Any]], width: int
) -> list[str]:
    streams = report["streams"]
    lines = [
        f"a. aggregate tokens/s, N greedy streams of {report['max_new_tokens']} new tokens "
        "(completion tokens / round wall time; [fewest-most tokens a stream])",
        f"{'target':<{width}}" + "".join(f"{f'N={n}':>22}" for n in streams) + "  others",
    ]
    for name, t in targets.items():
        rows = {r["streams"]: r for r in t.get("throughput", [])}
        cells = []
        for n in streams:
            r = rows.get(n)
            text = (
                "-"
                if r is None
                else (
                    f"{r['tokens_per_s']} [{r['tokens_min']}-{r['tokens_max']}]"
                    + (f" lost {r['lost']}" if r["lost"] else "")
                )
            )
            cells.append(f"{text:>22}")
        share = _share(*t.get("throughput", []))
        lines.append(f"{name:<{width}}" + "".join(cells) + f"  {share:>6}")
    return lines


def _idle_table(
    report: dict[str, Any], targets: dict[str, dict[str, Any]], width: int
) -> list[str]:
    lines = [
        f"b. idle chat TTFT, sequential chats of {report['chat_tokens']} new tokens (ms)",
        f"{'target':<{width}} {'n':>4} {'p50':>8} {'p90':>8} {'lost':>5} {'others':>7}",
    ]
    for name, t in targets.items():
        if (r := t.get("idle")) is not None:
            lines.append(
                f"{name:<{width}} {r['n']:>4} {_cell(r['p50_ms'], 8)} "
                f"{_cell(r['p90_ms'], 8)} {r['lost']:>5} {_share(r):>7}"
            )
    return lines


def _burst_table(
    report: dict[str, Any], targets: dict[str, dict[str, Any]], width: int
) -> list[str]:
    lines = [
        "c. chats beside 2 rewrites, S slots: chats alone (S - 2, then S at once), beside "
        "(2 rewrites then S - 2 chats), over (2 rewrites then S chats); chat TTFT and TPOT "
        "ms (TTFT from first send), rewrite ends s from the round's start",
        f"{'target':<{width}} {'S':>3} {'round':>9} {'ttft p50':>9} {'p99':>8} "
        f"{'tpot p50':>9} {'p99':>7} {'e2e p99':>8} {'yields':>6} {'rewrite ends':>14} "
        f"{'lost':>5}",
    ]
    for name, t in targets.items():
        for burst in t.get("bursts", []):
            for label, r in burst["rounds"].items():
                ends = ", ".join("-" if e is None else f"{e:g}" for e in r["rewrite_end_s"])
                lines.append(
                    f"{name:<{width}} {burst['slots']:>3} {label:>9} "
                    f"{_cell(r['ttft_p50_ms'], 9)} {_cell(r['ttft_p99_ms'], 8)} "
                    f"{_cell(r['tpot_p50_ms'], 9)} {_cell(r['tpot_p99_ms'], 7)} "
                    f"{_cell(r['e2e_p99_ms'], 8)} {r['yields']:>6} {ends:>14} "
                    f"{r['lost']:>5}"
                )
            q = burst["ratios"]
            lines.append(
                f"{'':<{width}} {burst['slots']:>3} {'ratios':>9} beside/alone TTFT "
                f"{_cell(q['beside_ttft'], 5)} TPOT {_cell(q['beside_tpot'], 5)}; over TPOT "
                f"/alone_all {_cell(q['over_tpot'], 5)}, over TTFT/(alone_all TTFT+e2e) "
                f"{_cell(q['over_ttft'], 5)}; others {_share(burst)}"
            )
    return lines


def _memory_table(
    report: dict[str, Any], targets: dict[str, dict[str, Any]], width: int
) -> list[str]:
    lines = [
        f"d. memory: PSS of the target and its children (MiB), {report['slots']} slots "
        "and 1 slot (anon: without file pages, which other programs mapping the model share)",
        f"{'target':<{width}} {'S slots':>9} {'anon':>8} {'procs':>5} {'1 slot':>9} "
        f"{'anon':>8} {'procs':>5} {'ratio':>7} {'anon':>7}",
    ]
    for name, t in targets.items():
        if (r := t.get("memory")) is not None:
            lines.append(
                f"{name:<{width}} {_cell(r['pss_slots_mib'], 9)} "
                f"{_cell(r['pss_anon_slots_mib'], 8)} {r['processes_slots']:>5} "
                f"{_cell(r['pss_one_mib'], 9)} {_cell(r['pss_anon_one_mib'], 8)} "
                f"{r['processes_one']:>5} {_cell(r['ratio'], 7)} {_cell(r['anon_ratio'], 7)}"
            )
    return lines


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME,
        help="the generation benchmarks: governor, per-process, llama-server side by side",
        description=__doc__,
        formatter_class=RawDescriptionDefaultsHelpFormatter,
    )
    _add_target_options(parser)
    _add_workload_options(parser)
    parser.add_argument(
        "--governor-arg",
        action="append",
        default=[],
        help="one more argument for governor serve (repeat it), e.g. --kv-capacity=8192",
    )
    parser.add_argument(
        "--logs", type=Path, help="directory for the targets' output (default: a new temporary one)"
    )
    parser.add_argument("--report", type=Path, metavar="FILE", help="also write the report here")


def _add_target_options(parser: argparse.ArgumentParser) -> None:
    """Which targets and measures, and how each target is started."""
    parser.add_argument(
        "--targets",
        type=parse_choices(TARGETS),
        default=DEFAULT_TARGETS,
        help=f"comma-separated, among {','.join(TARGETS)}",
    )
    parser.add_argument(
        "--measures",
        type=parse_choices(MEASURES),
        default=MEASURES,
        help=f"comma-separated, among {','.join(MEASURES)}",
    )
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the embedded model)")
    parser.add_argument(
        "--streams",
        type=positive_ints,
        default=(1, 4, 8, 16),
        help="concurrent streams, a round each",
    )
    parser.add_argument(
        "--slots", type=positive_int, help="S: max_inflight, -np (default: the most --streams)"
    )
    parser.add_argument("--threads", type=positive_int, default=2, help="governor and servers")
    parser.add_argument("--n-ctx", type=positive_int, default=2048, help="governor --n-ctx")
    parser.add_argument("--server-ctx", type=positive_int, default=16384, help="llama-server -c")
    parser.add_argument("--n-gpu-layers", type=int, default=0, help="-1: all")
    parser.add_argument(
        "--llama-server",
        type=Path,
        default=llama_server.default_binary(),
        help="llama-server binary (where deploy/build-llama-server.sh puts it)",
    )


def _add_workload_options(parser: argparse.ArgumentParser) -> None:
    """What each measure sends, and how its rounds are timed."""
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=128,
        help="new tokens of each throughput stream and each rewrite",
    )
    parser.add_argument("--chats", type=positive_int, default=20, help="idle chats")
    parser.add_argument("--chat-tokens", type=positive_int, default=16, help="a chat's new tokens")
    parser.add_argument(
        "--rewrite-tokens",
        type=positive_int,
        default=1400,
        help="a rewrite's prompt, in tokens at least",
    )
    parser.add_argument(
        "--burst-slots",
        type=positive_ints,
        help="the burst's slot counts S, a target started for each (default: --slots)",
    )
    parser.add_argument(
        "--burst-delay",
        type=positive_float,
        default=0.2,
        help="seconds from the rewrites to the chats",
    )
    add_renamed(
        parser,
        "--timeout",
        parser.add_argument(
            "--round-timeout", type=positive_float, default=300.0, help="seconds a round may take"
        ),
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=120.0,
        help="seconds to wait at most, before each measure, for other processes to leave the "
        "CPUs below 3%% busy; 0: start at once",
    )
    parser.add_argument(
        "--attempts",
        type=positive_int,
        default=3,
        help="runs of a throughput round while others disturbed it; the least disturbed is kept",
    )


def run(args: argparse.Namespace) -> int:
    if args.slots is not None and args.slots < max(args.streams):
        print("loadtest generation: --slots must be at least the most --streams")
        return 2
    if args.logs is None:
        args.logs = Path(tempfile.mkdtemp(prefix="generation-"))
    args.logs.mkdir(parents=True, exist_ok=True)
    report = run_loop(measure(args))
    print("\n".join(render(report)))
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    print_json(args, report)
    return 0 if report["targets"] else 1
