"""What ``soak`` samples of the daemon as it runs (memory, connections, slots), and whether its
memory stayed flat."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clients.client import ClientError, GovernorClient
from protocol.codes import Receipt

from ...support.processes import rss_kib

FLAT_RATIO = 1.10  # memory is flat when the late samples are within 10 % of the early ones


@dataclass(frozen=True, slots=True)
class Sample:
    t_s: float
    rss_kib: int | None
    connections: int | None  # the monitor's own not counted
    inflight: int | None
    tracebacks: int | None


async def take_sample(
    monitor: GovernorClient, pid: int | None, t0: float, tracebacks: Callable[[], int | None]
) -> Sample:
    connections = inflight = None
    with contextlib.suppress(ClientError, OSError, TimeoutError):
        reply = await monitor.ping(timeout=10.0)
        conns = reply.receipt(Receipt.CONNECTIONS)
        connections = None if conns is None else conns - 1
        inflight = reply.receipt(Receipt.INFLIGHT)
    return Sample(
        round(time.monotonic() - t0, 1),
        rss_kib(pid) if pid else None,
        connections,
        inflight,
        tracebacks(),
    )


def memory_verdict(samples: list[Sample], warmup_s: float) -> dict[str, Any]:
    """Flat when the median of the last third of the samples after the warm-up is within 10 %
    of the median of their first third (at least three samples each). Thirds, not the three
    samples at either end: the resident size goes up and down by tens of MiB with the buffers
    in flight, and three samples say where in that swing each end fell, not where it trends.
    The least-squares slope after the warm-up is reported beside it."""
    rss = [(s.t_s, s.rss_kib) for s in samples if s.rss_kib is not None]
    if not rss:
        return {"rss_kib": None, "flat": None}
    values = [v for _, v in rss]
    after = [(t, v) for t, v in rss if t >= warmup_s] or rss
    third = max(3, len(after) // 3)
    early = statistics.median(v for _, v in after[:third])
    late = statistics.median(v for _, v in after[-third:])
    return {
        "rss_kib": {"first": values[0], "last": values[-1], "max": max(values)},
        "rss_after_warmup_kib": early,
        "rss_final_kib": late,
        "rss_growth_ratio": round(late / early, 3) if early else None,
        "rss_slope_kib_per_min": round(_slope(after) * 60, 1),
        "flat": late <= early * FLAT_RATIO,
        "warmup_s": warmup_s,
    }


def _slope(points: list[tuple[float, int]]) -> float:
    """Least squares, per second (0 for fewer than two distinct times)."""
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / spread if spread else 0.0
