"""guidellm's reports read into rows, and the rows summarized against the targets (pure)."""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ...support.stats import medians_by, ratio

SERVERS = ("governor", "llama-server")

# Figures whose medians are compared, governor over llama-server.
COMPARED = (
    "output_tok_s",
    "goodput_rps",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "latency_p50_ms",
    "latency_p99_ms",
)
COUNTS = ("successful", "errored", "incomplete")

# The targets: the governor over llama-server (docs/BENCHMARKS.md, "The batched runner against
# llama-server"): output at least as fast, the slowest first tokens no later, and with a mix of chats
# and rewrites half again as many requests within a chat's objectives.
MIN_OUTPUT_RATIO = 1.0
MAX_TTFT_P99_RATIO = 1.0
MIN_GOODPUT_RATIO = 1.5

# Goodput: requests with their first token within this and a mean gap between tokens within
# GOOD_ITL_MS, per second of the run (an errored request is a miss).
GOOD_TTFT_MS = 2000.0
GOOD_ITL_MS = 100.0


def error_kind(message: str | None) -> str:
    """A short, bounded name for what an errored request recorded: ``HTTP 429`` for a status
    error, else the exception's first words."""
    if not message:
        return "unknown"
    status = re.search(r"\b([1-5]\d\d) [A-Z][A-Za-z ]+", message)
    if status:
        return f"HTTP {status.group(1)}"
    return message.strip().splitlines()[0][:60]


def _percentile(metrics: Mapping[str, Any], name: str, p: str, scale: float = 1.0) -> float | None:
    """guidellm's ``p`` (``p50``, ``p99``) of ``name`` over the successful requests (None: there
    were none)."""
    stats = metrics[name]["successful"]
    if not stats["count"]:
        return None
    return round(float(stats["percentiles"][p]) * scale, 1)


def run_row(server: str, report: Mapping[str, Any]) -> dict[str, Any]:
    """One run's figures from guidellm's JSON report (its one benchmark: the concurrent
    profile at one stream count)."""
    (benchmark,) = report["benchmarks"]
    metrics = benchmark["metrics"]
    totals = metrics["request_totals"]
    errors = collections.Counter(
        error_kind(r["info"].get("error")) for r in benchmark["requests"]["errored"]
    )
    good = sum(
        (r.get("time_to_first_token_ms") or math.inf) <= GOOD_TTFT_MS
        and (r.get("inter_token_latency_ms") or 0.0) <= GOOD_ITL_MS
        for r in benchmark["requests"]["successful"]
    )
    return {
        "server": server,
        "requests": totals["total"],
        **{name: totals[name] for name in COUNTS},
        "errored_by": dict(sorted(errors.items())),
        "duration_s": round(benchmark["duration"], 3),
        "good": good,
        "goodput_rps": round(good / benchmark["duration"], 4),
        "output_tokens": int(metrics["output_token_count"]["successful"]["total_sum"]),
        "output_tok_s": round(metrics["output_tokens_per_second"]["successful"]["mean"], 1),
        "ttft_p50_ms": _percentile(metrics, "time_to_first_token_ms", "p50"),
        "ttft_p99_ms": _percentile(metrics, "time_to_first_token_ms", "p99"),
        "itl_p50_ms": _percentile(metrics, "inter_token_latency_ms", "p50"),
        "itl_p99_ms": _percentile(metrics, "inter_token_latency_ms", "p99"),
        "tpot_p50_ms": _percentile(metrics, "time_per_output_token_ms", "p50"),
        "tpot_p99_ms": _percentile(metrics, "time_per_output_token_ms", "p99"),
        "latency_p50_ms": _percentile(metrics, "request_latency", "p50", 1000),
        "latency_p99_ms": _percentile(metrics, "request_latency", "p99", 1000),
    }


EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception): .+")


def failure_reason(log: str) -> str | None:
    """What a failed guidellm run's output says went wrong: its first exception line (the
    cause, e.g. ``httpx.HTTPStatusError: Client error '404 Not Found' for url ...``) and its
    last (what guidellm gave up with), each at most 200 characters; None: no such line."""
    found = [ln.strip()[:200] for ln in log.splitlines() if EXCEPTION_LINE.match(ln.strip())]
    if not found:
        return None
    return found[0] if found[0] == found[-1] else f"{found[0]} ... {found[-1]}"


def failed_row(server: str, why: str) -> dict[str, Any]:
    """A run that left no report: guidellm refused to start, failed or timed out."""
    return {
        "server": server,
        "requests": None,
        **dict.fromkeys(COUNTS),
        "good": None,
        "errored_by": {},
        "guidellm_failed": why,
        **dict.fromkeys(COMPARED),
    }


def targets(
    runs: Sequence[dict[str, Any]], ratios: Mapping[str, float | None], *, mix: bool = False
) -> dict[str, Any]:
    """The targets, and whether all are met (None: a figure missing): every governor run left a
    report with none errored, its median output tokens/s at least llama-server's, and its median
    TTFT p99 no worse; with a mix of chats and rewrites, its output and its goodput at least
    1.5x llama-server's instead (an errored request counts as a miss there)."""
    ours = [r for r in runs if r["server"] == "governor"]

    def at_least(name: str, floor: float) -> bool | None:
        value = ratios.get(name)
        return None if value is None else value >= floor

    found: dict[str, bool | None] = {
        "output_tok_s_ratio_ge_1": at_least("output_tok_s", MIN_OUTPUT_RATIO)
    }
    if mix:
        found["goodput_ratio_ge_1_5"] = at_least("goodput_rps", MIN_GOODPUT_RATIO)
    else:
        ttft = ratios.get("ttft_p99_ms")
        found["errored_0"] = bool(ours) and all(r["errored"] == 0 for r in ours)
        found["ttft_p99_ratio_le_1"] = None if ttft is None else ttft <= MAX_TTFT_P99_RATIO
    # (A TTFT of the few requests a refusing server let through is no win: all of them or none.)
    return {**found, "met": all(v is True for v in found.values())}


def summarize(runs: Sequence[dict[str, Any]], *, mix: bool = False) -> dict[str, Any]:
    """Medians per server and, with both, the governor's over llama-server's and the targets."""
    by_server = medians_by(runs, SERVERS, (*COUNTS, *COMPARED))
    out: dict[str, Any] = {"median": by_server}
    if len(by_server) == 2:
        ours, theirs = by_server["governor"], by_server["llama-server"]
        ratios = {k: ratio(ours[k], theirs[k]) for k in COMPARED}
        out["governor_over_llama_server"] = ratios
        out["targets"] = targets(runs, ratios, mix=mix)
    return out


def line(row: dict[str, Any]) -> str:
    if row.get("guidellm_failed"):
        return f"{row['server']:>12}: no report: {row['guidellm_failed']}"
    errors = ", ".join(f"{k} {v}" for k, v in row["errored_by"].items())
    return (
        f"{row['server']:>12}: ok {row['successful']}/{row['requests']}"
        f" (errored {row['errored']}{': ' + errors if errors else ''},"
        f" incomplete {row['incomplete']})"
        f"  {row['output_tok_s']} tok/s  good {row['good']} ({row['goodput_rps']}/s)"
        f"  TTFT p50 {row['ttft_p50_ms']} p99 {row['ttft_p99_ms']} ms"
        f"  ITL p50 {row['itl_p50_ms']} p99 {row['itl_p99_ms']} ms"
        f"  latency p50 {row['latency_p50_ms']} p99 {row['latency_p99_ms']} ms"
        f"  in {row['duration_s']} s"
    )
