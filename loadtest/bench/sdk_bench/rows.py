"""``bench sdk-bench``'s runs as rows, their medians, and a row as a line (pure)."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from ...support.stats import medians_by, percentile, ratio
from .clients import Load

SERVERS = ("governor", "baseline")

# Figures whose medians are compared, governor over baseline.
COMPARED = (
    "goodput_rps",
    "tokens_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
)

# Figures of each server's median run.
MEDIANS = ("ok", "failed", *COMPARED, "http_429", "absorbed_429", "sdk_retries")


def _ms(values: Sequence[float], p: float) -> float | None:
    return round(percentile(values, p) * 1000, 1) if values else None


def run_row(server: str, run: Load) -> dict[str, Any]:
    """One run's figures (times in ms; rates per second of the run's wall time)."""
    ok = [r for r in run.records if r.ok]
    failed = collections.Counter(r.error for r in run.records if r.error is not None)
    ttfts = [r.first_s - r.sent_s for r in ok if r.first_s is not None]
    e2es = [r.end_s - r.sent_s for r in ok if r.end_s is not None]
    tokens = sum(r.tokens for r in ok)
    wall = run.wall_s
    posts = sum(run.statuses.values())
    return {
        "server": server,
        "sent": len(run.records),
        "ok": len(ok),
        "failed": sum(failed.values()),
        "failed_by": dict(sorted(failed.items())),
        "wall_s": round(wall, 3),
        "goodput_rps": round(len(ok) / wall, 3) if wall > 0 else None,
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1) if wall > 0 else None,
        "tokens_from_usage": sum(r.usage for r in ok),
        "ttft_p50_ms": _ms(ttfts, 50),
        "ttft_p99_ms": _ms(ttfts, 99),
        "e2e_p50_ms": _ms(e2es, 50),
        "e2e_p99_ms": _ms(e2es, 99),
        "http_statuses": {str(k): v for k, v in sorted(run.statuses.items())},
        "http_429": run.statuses[429],
        # 429s the SDK retried past; the rest it raised (RateLimitError), its retries spent.
        "absorbed_429": run.statuses[429] - failed["RateLimitError"],
        "sdk_retries": max(posts - len(run.records), 0),
        # What each failed request was answered, attempt by attempt: why it failed.
        "failures": [
            {"error": r.error, "sent_s": round(r.sent_s, 3), "answers": r.answers}
            for r in run.records
            if r.error is not None
        ],
    }


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians per server and, with both, the governor's over the baseline's."""
    by_server = medians_by(runs, SERVERS, MEDIANS)
    out: dict[str, Any] = {"median": by_server}
    if len(by_server) == 2:
        ours, theirs = by_server["governor"], by_server["baseline"]
        out["governor_over_baseline"] = {k: ratio(ours[k], theirs[k]) for k in COMPARED}
    return out


def line(row: dict[str, Any]) -> str:
    failed = ", ".join(f"{k} {v}" for k, v in row["failed_by"].items())
    return (
        f"{row['server']:>9}: ok {row['ok']}/{row['sent']}"
        + (f" (failed: {failed})" if failed else "")
        + f"  {row['goodput_rps']} req/s  {row['tokens_per_s']} tok/s"
        f"  TTFT p50 {row['ttft_p50_ms']} p99 {row['ttft_p99_ms']} ms"
        f"  e2e p50 {row['e2e_p50_ms']} p99 {row['e2e_p99_ms']} ms"
        f"  429s {row['http_429']} (absorbed {row['absorbed_429']})"
        f"  in {row['wall_s']} s"
    )
