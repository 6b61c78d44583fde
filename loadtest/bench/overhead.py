"""``overhead``: what the governor costs a generation, against llama-cpp-python called directly.

Same model, prompt, greedy settings and threads on both paths; the runs alternate (direct, then
through the governor) so that both see the same machine. Direct: ``Llama.generate`` in this
process, timed from the call. Governor: a daemon on 127.0.0.1 with one llama worker, timed by
a client from sending the job (one inline frame, streamed) to each delta. Reported: the median
time to first token and decode rate of each, and their ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from clients import NO_RETRY, GovernorClient
from governor.config import Config
from governor.runners.llama.runner import embedded_model_path
from governor.server import Server
from protocol.spec import JobSpec

from ..support.arguments import add_model, add_n_ctx, add_threads
from ..support.connections import run_loop
from ..support.options import positive_int, print_json

NAME = "overhead"
PROMPT = "Once upon a time, in a small village by the sea,"


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        NAME, help="generation through the governor against llama-cpp-python directly"
    )
    add_model(parser, "GGUF file (default: the embedded model)")
    parser.add_argument("--prompt", default=PROMPT, help="the prompt of every run")
    parser.add_argument(
        "--max-new-tokens", type=positive_int, default=128, help="new tokens of every run"
    )
    parser.add_argument("--runs", type=positive_int, default=5, help="runs of each path")
    add_threads(parser, default=1, text="llama.cpp's threads")
    add_n_ctx(parser, text="the context size")


def _rates(start: float, first: float, last: float, tokens: int) -> tuple[float, float]:
    """(ttft ms, decode tokens/s after the first token)."""
    decode = (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0
    return (first - start) * 1000, decode


def direct_run(llm: Any, tokens: list[int], max_new: int) -> tuple[float, float, int]:
    start = time.perf_counter()
    first = last = 0.0
    n = 0
    for token in llm.generate(tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        if llm.token_eos() == token:
            break
        last = time.perf_counter()
        first = first or last
        n += 1
        if n >= max_new:
            break
    return (*_rates(start, first, last, n), n)


async def governed_run(client: GovernorClient, spec: JobSpec) -> tuple[float, float, int]:
    times: list[float] = []
    start = time.perf_counter()
    result = await client.generate(
        spec, retry=NO_RETRY, on_delta=lambda _: times.append(time.perf_counter())
    )
    if not result.done or result.reply.result is None or not times:
        raise RuntimeError(f"the governed run did not stream a generation: {result.reply}")
    n = int(result.reply.result["completion_tokens"])
    return (*_rates(start, times[0], times[-1], n), n)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from llama_cpp import Llama

    model = args.model or embedded_model_path()
    llm = Llama(
        model_path=str(model),
        n_ctx=args.n_ctx,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )
    tokens = llm.tokenize(args.prompt.encode(), add_bos=False)
    direct_run(llm, tokens, 4)  # warm-up, as the governor's workers do before "ready"
    config = Config(
        listen="127.0.0.1:0",
        runner="llama",
        model=str(model),
        max_inflight=1,
        threads=args.threads,
        n_ctx=args.n_ctx,
    )
    server = Server(config)
    await server.start()
    spec = JobSpec(
        prompt=args.prompt, max_new_tokens=args.max_new_tokens, temperature=0.0, stream=True
    )
    direct: list[tuple[float, float, int]] = []
    governed: list[tuple[float, float, int]] = []
    try:
        host, port = server.address
        async with await GovernorClient.connect(host, port) as client:
            await governed_run(client, spec)  # warm-up of the path
            for _ in range(args.runs):
                direct.append(direct_run(llm, tokens, args.max_new_tokens))
                governed.append(await governed_run(client, spec))
    finally:
        await server.close()

    def median(runs: list[tuple[float, float, int]], i: int) -> float:
        return round(statistics.median(r[i] for r in runs), 3)

    report = {
        "command": NAME,
        "model": model.name,
        "prompt_tokens": len(tokens),
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "runs": args.runs,
        "direct": {"ttft_ms": median(direct, 0), "decode_tok_s": median(direct, 1)},
        "governor": {"ttft_ms": median(governed, 0), "decode_tok_s": median(governed, 1)},
        "completion_tokens": [r[2] for r in governed],
    }
    report["decode_ratio"] = round(
        report["governor"]["decode_tok_s"] / report["direct"]["decode_tok_s"], 4
    )
    report["ttft_ratio"] = round(report["governor"]["ttft_ms"] / report["direct"]["ttft_ms"], 4)
    return report


def run(args: argparse.Namespace) -> int:
    report = run_loop(measure(args))
    d, g = report["direct"], report["governor"]
    print(
        f"model {report['model']}, {report['prompt_tokens']} prompt tokens, greedy, "
        f"{report['max_new_tokens']} new tokens, {report['threads']} thread(s), "
        f"median of {report['runs']} alternating runs"
    )
    print(f"direct    ttft {d['ttft_ms']:8.1f} ms   decode {d['decode_tok_s']:6.1f} tok/s")
    print(f"governor  ttft {g['ttft_ms']:8.1f} ms   decode {g['decode_tok_s']:6.1f} tok/s")
    print(
        f"governor / direct: decode rate x{report['decode_ratio']:.3f}, "
        f"time to first token x{report['ttft_ratio']:.3f}"
    )
    print_json(args, report)
    return 0
