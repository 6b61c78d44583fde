"""The options and the ending the traffic commands (burst, rate, mix, replay) share.

:func:`add_arguments` gives every such command the same target, client, objective and output
options; :func:`execute` runs the command's steps and writes what a run leaves behind: the
summary on stdout (with ``--json``, then the report as one line of JSON), and in ``--out``
``report.json``, the PNG plots and ``report.html``.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from clients import apikey
from clients.fleet import resolve_now
from governor.core.policy import Lane
from governor.core.slo import DEFAULT_OBJECTIVES

from .connections import (
    RETRY_MODES,
    StartError,
    add_key_arguments,
    add_tls_arguments,
    api_key_from,
    endpoints_from,
    retry_policy,
    run_loop,
)
from .driver import open_loop
from .options import (
    DEFAULT_ADDR,
    AddressList,
    non_negative_int,
    parse_addr,
    parse_addrs,
    positive_float,
    positive_int,
    print_json,
)
from .render import output_dir, write_outputs
from .report import Slo, build, parse_slo, step, summary_lines
from .targets import FleetTarget, GovernorTarget, OpenAITarget, Shape, Target
from .workload import ARRIVALS, ClassSpec, Request, arrivals, mixed

# Why a request was refused for its key: the protocol's need code, the front door's status.
UNAUTHORIZED = ("unauthorized", "http_401")

Steps = Callable[[Target, Slo], Coroutine[Any, Any, list[dict[str, Any]]]]


def add_arguments(
    parser: argparse.ArgumentParser, *, default_retry: str, default_max_wait: float = 30.0
) -> None:
    """The options every traffic command takes, with the same names and meanings."""
    _add_target_arguments(parser)
    _add_client_arguments(parser, default_retry=default_retry, default_max_wait=default_max_wait)
    _add_objective_arguments(parser)
    _add_limit_arguments(parser)


def _add_target_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument(
        "--addr",
        type=parse_addrs,
        action=AddressList,
        default=parse_addr(DEFAULT_ADDR),
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the governor to load; the only address connected to. Several (repeated or "
        "comma-separated), or a name that resolves to several addresses, are replicas of one "
        "service: each client is then a FleetClient over all of them (two random choices, "
        "moving on a yield), and the report counts the jobs each replica finished; there is "
        "no monitor",
    )
    target.add_argument(
        "--openai",
        metavar="URL",
        help="load an OpenAI-compatible server at URL instead (streamed /v1/completions), e.g. "
        "the queueing baseline `python -m loadtest baseline`, or the governor's own front door "
        "(`governor serve --http-listen`), whose refusals (429 or 503 with retry-after-ms) count "
        "as yields and are retried as --retry, --max-attempts and --fixed-ms say, after the "
        "hint's sleep; --addr is ignored",
    )
    target.add_argument("--model", help="--openai: the model name to send (default: none)")
    target.add_argument(
        "--metrics-addr",
        type=parse_addr,
        metavar="HOST:PORT",
        help="the governor's --metrics-listen (one governor): each step reads from its /metrics "
        "how its retry hints landed (governor_hint_*, before and after the step): the landing "
        "rate and the hints' errors",
    )
    add_key_arguments(target, openai=True)
    add_tls_arguments(parser.add_argument_group("TLS to the governor (default: plain TCP)"))


def _add_client_arguments(
    parser: argparse.ArgumentParser, *, default_retry: str, default_max_wait: float
) -> None:
    client = parser.add_argument_group("client behaviour")
    client.add_argument(
        "--max-wait",
        type=float,
        default=default_max_wait,
        metavar="SECONDS",
        help="governor (TCP): seconds each job may wait on the server for its turn when every "
        "slot is taken (max_wait_ms), instead of an immediate yield; 0: plain v0, a yield at "
        "once (what heptamini's daemon does). The front door's requests wait anyway.",
    )
    client.add_argument(
        "--retry",
        choices=RETRY_MODES,
        default=default_retry,
        help="on yield (--openai: a 429 or 503 with a hint): hint (sleep retry_hint_ms plus "
        "jitter, then resend), naive (resend at once), fixed (sleep --fixed-ms, ignoring the "
        "hint, as heptamini's client does with its daemon's constant 500 ms), none (one "
        "attempt)",
    )
    client.add_argument(
        "--max-attempts",
        type=positive_int,
        default=10,
        help="admission attempts per request in all, the retry budget",
    )
    client.add_argument(
        "--fixed-ms",
        type=non_negative_int,
        default=500,
        help="the sleep between attempts of --retry fixed",
    )
    client.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of the jobs; 0: greedy",
    )
    client.add_argument(
        "--no-lanes",
        action="store_true",
        help="governor: do not ask for the lane a class is named after (the policy decides)",
    )


def _add_objective_arguments(parser: argparse.ArgumentParser) -> None:
    objectives = parser.add_argument_group(
        "objectives (MS sets the default; CLASS=MS one class's; repeatable; TTFT and TPOT "
        "unset: the governor's lane defaults, a class named after a lane its lane's, any other "
        "the interactive lane's)"
    )
    for name, what in (
        ("ttft", "time to first token, from the first send"),
        ("tpot", "time per output token after the first"),
        ("e2e", "end to end, from the first send to the last byte"),
    ):
        objectives.add_argument(
            f"--slo-{name}-ms", action="append", default=[], metavar="[CLASS=]MS", help=what
        )


def _add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    limits = parser.add_argument_group("limits and output")
    limits.add_argument(
        "--timeout",
        type=positive_float,
        default=60.0,
        help="seconds for the whole run (each step), connecting included; requests still "
        "outstanding then are cancelled and counted as timed out",
    )
    limits.add_argument(
        "--sample-ms",
        type=positive_int,
        default=100,
        help="the inflight timeline's period: the monitor pings the governor this often",
    )
    limits.add_argument(
        "--interactive-reserve",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="governor: the slots its --interactive-reserve keeps, for the saturation figure "
        "(left out while no interactive request is outstanding)",
    )
    limits.add_argument(
        "--out",
        metavar="DIR",
        help="write report.json, the PNG plots and report.html here "
        "(default: loadtest-out/COMMAND-TIME)",
    )
    limits.add_argument(
        "--no-plots", action="store_true", help="write report.json only: no PNG, no HTML"
    )
    limits.add_argument(
        "--no-progress", action="store_true", help="no live progress bar on standard error"
    )


def add_payload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--payload-bytes",
        type=non_negative_int,
        default=256,
        help="bytes per job, an opaque upload",
    )
    parser.add_argument(
        "--chunk-bytes",
        type=positive_int,
        default=8192,
        help="bytes per upload chunk",
    )


def slo_from(args: argparse.Namespace) -> Slo:
    slo = Slo()
    for name in ("ttft", "tpot", "e2e"):
        given = getattr(args, f"slo_{name}_ms")
        if not given and name != "e2e":
            given = lane_defaults(f"{name}_ms")
        try:
            parse_slo(f"{name}_ms", given, slo)
        except ValueError as exc:
            raise SystemExit(f"loadtest: --slo-{name}-ms: {exc}") from None
    return slo


def lane_defaults(objective: str) -> list[str]:
    """The governor's default objective ``ttft_ms`` or ``tpot_ms`` per lane, as
    ``--slo-*-ms`` values: a class named after a lane gets its lane's, any other the
    interactive lane's (an objective of 0, none, is left unset)."""
    values = [f"{getattr(DEFAULT_OBJECTIVES[Lane.INTERACTIVE], objective):g}"]
    values += [
        f"{lane}={getattr(objectives, objective):g}"
        for lane, objectives in DEFAULT_OBJECTIVES.items()
        if getattr(objectives, objective)
    ]
    return values


def target_from(
    args: argparse.Namespace,
    *,
    payload_bytes: int | None = None,
    ping: bool = False,
    reconnect: bool = False,
) -> Target:
    shape = Shape(
        payload_bytes=payload_bytes,
        ping=ping,
        reconnect=reconnect,
        chunk_bytes=getattr(args, "chunk_bytes", 8192),
        temperature=args.temperature,
        send_lane=not args.no_lanes,
        max_wait=args.max_wait or None,
    )
    retry = retry_policy(args.retry, args.max_attempts, args.fixed_ms)
    if args.openai:
        if payload_bytes is not None or ping or reconnect:
            raise SystemExit("loadtest: --openai sends inference jobs only: give --prompt-tokens")
        return OpenAITarget(args.openai, shape, args.model, retry=retry, api_key=api_key_from(args))
    endpoints = endpoints_from(args)
    if len(endpoints) == 1 and len(resolve_now([endpoints[0].addr])) == 1:
        return GovernorTarget(endpoints[0], shape, retry, getattr(args, "metrics_addr", None))
    return FleetTarget(endpoints, shape, retry)


def with_replicas(target: Target, step_report: dict[str, Any]) -> dict[str, Any]:
    """A step of a run over several replicas, with the jobs each one finished."""
    if isinstance(target, FleetTarget):
        step_report["replicas"] = target.replica_counts()
    return step_report


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The run's options as given (JSON-ready), for the report; never the API key."""
    skip = {"command", "out", "no_plots", "no_progress", "api_key"}
    return {
        k: list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v
        for k, v in vars(args).items()
        if k not in skip
    }


def progress_stream(args: argparse.Namespace) -> Any:
    return None if args.no_progress else sys.stderr


def execute(command: str, args: argparse.Namespace, target: Target, steps: Steps) -> int:
    """Run the steps, print each step's summary and the JSON, write the files.

    Exit status: 0 when the run reached its end (whatever the target answered); 1 when the
    target could not be reached before the start, or the output could not be written.
    """
    slo = slo_from(args)
    try:
        results = run_loop(steps(target, slo))
    except StartError as exc:
        print(f"loadtest {command}: {exc}", file=sys.stderr)
        return 1
    report = build(command, target, settings_of(args), slo, results)
    for s in results:
        print("\n".join(summary_lines(s)))
    refused = sum(s["all"]["aborted_by"].get(r, 0) for s in results for r in UNAUTHORIZED)
    if refused:
        hint = apikey.unauthorized_hint(api_key_from(args) is not None)
        print(f"loadtest {command}: {refused} request(s) unauthorized: {hint}", file=sys.stderr)
    out = output_dir(args.out, command)
    try:
        write_outputs(
            out,
            "report.json",
            report,
            [("run", report)],
            plots=not args.no_plots,
            title=f"loadtest {command}",
        )
    except OSError as exc:
        print(f"loadtest {command}: cannot write {out}: {exc}", file=sys.stderr)
        return 1
    print(f"report: {out / 'report.json'}" + ("" if args.no_plots else f", {out / 'report.html'}"))
    print_json(
        args,
        {k: v for k, v in report.items() if k != "steps"} | {"steps": [_brief(s) for s in results]},
    )
    return 0


def _brief(step: dict[str, Any]) -> dict[str, Any]:
    """A step without its raw rows and timelines (the one-line JSON on stdout)."""
    return {k: v for k, v in step.items() if k not in ("requests", "timeline")}


# Open loops (rate, mix, replay) -----------------------------------------------------------


def add_open_loop_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--connections",
        type=positive_int,
        default=32,
        help="governor: connections the requests are spread over, round-robin; OpenAI: the "
        "HTTP connection pool",
    )
    parser.add_argument("--seed", type=int, default=1, help="of arrivals and lengths: runs repeat")


def open_steps(
    args: argparse.Namespace, workloads: list[tuple[str, list[Request], float | None]]
) -> Steps:
    """Steps that each send one workload ``(label, requests, offered_rps)`` in an open loop."""

    async def steps(target: Target, slo: Slo) -> list[dict[str, Any]]:
        out = []
        for label, requests, offered_rps in workloads:
            result = await open_loop(
                target,
                requests,
                connections=args.connections,
                timeout_s=args.timeout,
                sample_s=args.sample_ms / 1000,
                label=label,
                progress_out=progress_stream(args),
            )
            out.append(
                with_replicas(
                    target,
                    step(
                        result,
                        slo,
                        label=label,
                        offered_rps=offered_rps,
                        reserve=args.interactive_reserve,
                    ),
                )
            )
        return out

    return steps


def rates(text: str) -> list[float]:
    """``R[,R...]`` requests per second."""
    try:
        values = [positive_float(v) for v in text.split(",")]
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of positive rates") from None
    return values


def add_schedule_arguments(parser: argparse.ArgumentParser, *, default_rate: str) -> None:
    parser.add_argument(
        "--rate",
        type=rates,
        default=default_rate,
        metavar="R[,R...]",
        help="requests per second; a list runs one step per rate",
    )
    parser.add_argument(
        "--duration",
        type=positive_float,
        default=10.0,
        help="seconds of arrivals per step; --timeout bounds the step, its tail included",
    )
    parser.add_argument(
        "--arrival",
        choices=ARRIVALS,
        default="poisson",
        help="poisson (exponential gaps), constant (even gaps) or burst (all at once)",
    )
    parser.add_argument(
        "--max-requests",
        type=positive_int,
        default=10_000,
        help="at most this many requests per step: rate x duration, capped",
    )
    add_open_loop_arguments(parser)


def workloads(
    args: argparse.Namespace, classes: tuple[ClassSpec, ...]
) -> list[tuple[str, list[Request], float | None]]:
    """One workload per --rate: its label, its requests and its offered rate."""
    out: list[tuple[str, list[Request], float | None]] = []
    for rate in args.rate:
        rng = random.Random(args.seed)
        count = min(max(round(rate * args.duration), 1), args.max_requests)
        times = arrivals(args.arrival, rate, count, rng)
        label = f"{args.arrival} {rate:g}/s" if args.arrival != "burst" else f"burst of {count}"
        out.append((label, mixed(times, classes, rng), rate if args.arrival != "burst" else None))
    return out
