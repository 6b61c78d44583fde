"""``replay``: a request trace's arrivals and lengths, scaled to this model and machine.

A trace is CSV ``TIMESTAMP,ContextTokens,GeneratedTokens`` (Azure) or JSONL
``timestamp,input_length,output_length`` (Mooncake), as those providers publish them. Gaps
between arrivals are multiplied by ``--time-scale`` and lengths by ``--token-scale``, then
capped; prompts are synthesised to the right token counts. Every scaling is recorded in the
report: say so with any figure.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..support import traffic
from ..support.options import non_negative_int, positive_float, positive_int
from ..support.workload import Request, Scaling, load_trace, replay

NAME = "replay"


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME,
        help="replay a trace file (CSV or JSONL), scaled in time and tokens",
        description=__doc__,
    )
    parser.add_argument("trace", type=Path, help="the trace file")
    d = Scaling()
    parser.add_argument(
        "--start-s",
        type=float,
        default=d.start_s,
        help="skip the trace's first seconds",
    )
    parser.add_argument(
        "--time-scale",
        type=positive_float,
        default=d.time_scale,
        help="multiply the gaps between arrivals (2: half the rate)",
    )
    parser.add_argument(
        "--token-scale",
        type=positive_float,
        default=d.token_scale,
        help="multiply prompt and output lengths",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        default=d.max_prompt_tokens,
        help="cap on each request's prompt tokens, after --token-scale",
    )
    parser.add_argument(
        "--max-output-tokens",
        type=positive_int,
        default=d.max_output_tokens,
        help="cap on each request's output tokens, after --token-scale",
    )
    parser.add_argument(
        "--max-duration",
        type=positive_float,
        default=d.max_duration_s,
        help="seconds of (scaled) trace to replay",
    )
    parser.add_argument(
        "--max-requests",
        type=positive_int,
        default=d.max_requests,
        help="cap on the requests replayed",
    )
    parser.add_argument(
        "--heavy-above",
        type=non_negative_int,
        default=0,
        help="requests with more (scaled) prompt tokens than this are class heavy, the others "
        "interactive; 0: one class, trace",
    )
    traffic.add_open_loop_arguments(parser)
    traffic.add_arguments(parser, default_retry="hint")


def classify(requests: list[Request], heavy_above: int) -> list[Request]:
    if not heavy_above:
        return requests
    return [
        Request(
            r.at_s,
            "heavy" if r.prompt_tokens > heavy_above else "interactive",
            r.prompt_tokens,
            r.output_tokens,
        )
        for r in requests
    ]


def run(args: argparse.Namespace) -> int:
    try:
        rows = load_trace(args.trace)
    except (OSError, ValueError) as exc:
        print(f"loadtest replay: {exc}")
        return 2
    scaling = Scaling(
        start_s=args.start_s,
        time_scale=args.time_scale,
        token_scale=args.token_scale,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        max_duration_s=args.max_duration,
        max_requests=args.max_requests,
    )
    requests = classify(replay(rows, scaling), args.heavy_above)
    if not requests:
        print("loadtest replay: no request of the trace falls within --start-s and --max-duration")
        return 2
    span = requests[-1].at_s - requests[0].at_s
    offered = len(requests) / span if span > 0 else None
    label = f"{args.trace.name} x{args.time_scale:g} time, x{args.token_scale:g} tokens"
    target = traffic.target_from(args)
    return traffic.execute(
        NAME, args, target, traffic.open_steps(args, [(label, requests, offered)])
    )
