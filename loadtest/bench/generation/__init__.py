"""``generation``: the generation benchmarks, every target side by side in one run.

Targets (``--targets``), each started here on a free loopback port, one after another, and
stopped by its PID before the next starts:

* ``governor``: ``governor serve --runner llama --max-inflight S --workers 1 --threads T``:
  the batched runner, one worker process running S sequences;
* ``governor-q8_0``: the same with ``--kv-cache-type q8_0`` (the KV cache's cells 8-bit);
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
* ``greedy``: on a governor target, the greedy texts (temperature 0, ``--chat-tokens`` x 4
  new tokens) of the README's prompts and of a rewrite of ``--rewrite-tokens`` tokens (a long
  context), one after another, with each one's time to first token; and for each text whether
  the first governor target said the same, or the characters they share.
* ``memory``: proportional set size (``Pss`` of ``/proc/PID/smaps_rollup``) of the target and
  every process below it, for each N of ``--memory-slots`` on a target started with N slots,
  after a warm-up round of N short jobs; llama-server then gets ``-c N x n_ctx``, the cells of
  N slots of the governor's ``n_ctx`` each (an equal context a slot); and each target's PSS
  over llama-server's at the same N.

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
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from clients.client import DEFAULT_MAX_WAIT_S, ClientError
from clients.helptext import RawDescriptionDefaultsHelpFormatter
from protocol.spec import JobSpec, Message

from ...support.connections import StartError, run_loop
from ...support.driver import closed_loop, open_loop
from ...support.machine import QUIET_SHARE, CpuWindow, wait_quiet
from ...support.options import print_json
from ...support.processes import stop
from ...support.targets import Outcome, Shape
from ...support.workload import Request
from .options import add_target_options, add_workload_options
from .prompts import question, rewrite_prompts, story
from .report import render
from .rows import Memory, burst_ratios, memory_row, round_row, throughput_row, ttft_row
from .servers import GOVERNORS, Instance, Settings, start

NAME = "generation"
MEASURES = ("throughput", "idle", "burst", "greedy", "memory")
# The README's prompts (chats but for the completion "The sea is"), for the greedy measure.
README_PROMPTS = (
    ("chat", "What is 2 + 2?"),
    ("chat", "Paris: which country?"),
    ("chat", "Hi"),
    ("prompt", "The sea is"),
)
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
    logs: Path = args.logs

    if want & {"throughput", "idle"}:
        inst = await start(name, settings, slots=slots, lanes=False, log=logs / f"{name}.log")
        result["argv"] = inst.argv
        _note(f"{name} up (pid {inst.proc.pid}, {slots} slots)")
        try:
            warm = Shape(temperature=0.0, prompts=tuple(story(10_000 + i) for i in range(slots)))
            await _round(
                inst, warm, _requests("warmup", slots, WARMUP_TOKENS), args.round_timeout, "warm"
            )
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

    if "greedy" in want and name in GOVERNORS:
        inst = await start(name, settings, slots=1, lanes=False, log=logs / f"{name}-greedy.log")
        try:
            result["greedy"] = await measure_greedy(inst, args, rewrites[:1])
        finally:
            stop(inst.proc, 15.0)
    if "memory" in want:
        result["memory"] = [
            await measure_memory(name, args, settings, n) for n in args.memory_slots or (1, slots)
        ]
    return result


async def measure_greedy(
    inst: Instance, args: argparse.Namespace, rewrites: list[tuple[str, int]]
) -> list[dict[str, Any]]:
    """Each README prompt's greedy text, and a rewrite's, with its time to first token."""
    assert inst.endpoint is not None
    jobs = [*README_PROMPTS, *(("chat", text) for text, _ in rewrites)]
    rows = []
    async with await inst.endpoint.connect(timeout=args.round_timeout) as client:
        for kind, text in jobs:
            spec = JobSpec(
                prompt=text if kind == "prompt" else None,
                messages=(Message("user", text),) if kind == "chat" else None,
                max_new_tokens=4 * args.chat_tokens,
                temperature=0.0,
            )
            done = await client.generate(spec, timeout=args.round_timeout)
            answer = done.reply.result or {}
            rows.append(
                {
                    "prompt": text[:40],
                    "prompt_tokens": answer.get("prompt_tokens"),
                    "text": answer.get("text"),
                    "ttft_ms": answer.get("ttft_ms"),
                }
            )
    return rows


async def measure_memory(
    name: str, args: argparse.Namespace, settings: Settings, slots: int
) -> dict[str, Any]:
    """PSS of a target started with ``slots`` slots (llama-server: ``slots`` x ``n_ctx``
    cells), after a warm-up round of a short job a slot."""
    equal = dataclasses.replace(settings, server_ctx=slots * settings.n_ctx)
    log = args.logs / f"{name}-memory-{slots}.log"
    inst = await start(name, equal, slots=slots, lanes=False, log=log)
    try:
        warm = Shape(temperature=0.0, prompts=tuple(story(20_000 + i) for i in range(slots)))
        await _round(
            inst, warm, _requests("warmup", slots, WARMUP_TOKENS), args.round_timeout, "warm"
        )
        row = memory_row(slots, Memory.of(inst.proc.pid))
    finally:
        stop(inst.proc, 15.0)
    _note(f"{name} memory {row}")
    return row


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
    from governor.runners.llama.runner import embedded_model_path

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
    if {"burst", "greedy"} & set(args.measures):
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


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME,
        help="the generation benchmarks: governor, per-process, llama-server side by side",
        description=__doc__,
        formatter_class=RawDescriptionDefaultsHelpFormatter,
    )
    add_target_options(parser, MEASURES)
    add_workload_options(parser)
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


def run(args: argparse.Namespace) -> int:
    if args.slots is not None and args.slots < max(args.streams):
        print("loadtest bench generation: --slots must be at least the most --streams")
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
