"""Percentiles and latency summaries: pure functions, no IO.

Percentiles use the **nearest-rank** method: for ``n`` values sorted ascending, the ``p``-th
percentile is the value at 1-based rank ``ceil(p / 100 * n)`` (rank 1 for ``p = 0``). It always
returns one of the observed values, never an interpolation between two, so a reported p99 is a
latency some request really had; for 1..100 it gives p50 = 50, p90 = 90, p99 = 99, p100 = 100.
A percentile of no values is undefined: :func:`percentile` raises, :func:`summarize` reports
``None`` for each statistic.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Summary", "percentile", "ratio", "summarize"]

# p / 100 * n in floating point can land a hair above an integer (7 / 100 * 100 is
# 7.000000000000001), which ceil() would push to the next rank; rounding first removes that noise.
_RANK_DIGITS = 9


def _rank(p: float, n: int) -> int:
    """The 1-based nearest rank of the ``p``-th percentile among ``n`` values."""
    return max(1, math.ceil(round(p / 100 * n, _RANK_DIGITS)))


def percentile(values: Iterable[float], p: float) -> float:
    """The ``p``-th percentile (0 <= p <= 100) of ``values`` by nearest rank.

    ``values`` need not be sorted. Raises :class:`ValueError` when ``values`` is empty or ``p``
    is outside [0, 100].
    """
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be within [0, 100], not {p}")
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    return ordered[_rank(p, len(ordered)) - 1]


@dataclass(frozen=True, slots=True)
class Summary:
    """Nearest-rank percentiles of a sample; every statistic is ``None`` when ``n`` is 0."""

    n: int
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    def as_dict(self, digits: int = 3) -> dict[str, float | int | None]:
        """JSON-ready, with values rounded to ``digits`` decimals."""

        def r(value: float | None) -> float | None:
            return None if value is None else round(value, digits)

        return {
            "n": self.n,
            "p50": r(self.p50),
            "p90": r(self.p90),
            "p99": r(self.p99),
            "max": r(self.max),
        }


def summarize(values: Sequence[float]) -> Summary:
    """p50, p90, p99 and max of ``values`` by nearest rank (see the module docstring)."""
    if not values:
        return Summary(0, None, None, None, None)
    ordered = sorted(values)
    n = len(ordered)
    return Summary(
        n,
        ordered[_rank(50, n) - 1],
        ordered[_rank(90, n) - 1],
        ordered[_rank(99, n) - 1],
        ordered[-1],
    )


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` to 3 decimals; None where either is missing or ``b`` is 0."""
    return round(a / b, 3) if a is not None and b else None


def alternating(names: Sequence[str], rounds: int) -> list[str]:
    """Runs alternating A, B, B, A, ...: ``rounds`` of each, so that a drift of the machine
    falls on every one of them."""
    return ((list(names) + list(names)[::-1]) * ((rounds + 1) // 2))[: len(names) * rounds]


def medians_by(
    runs: Sequence[Mapping[str, Any]], names: Sequence[str], keys: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """Each named server's runs (``run["server"]``) as the median of every figure in ``keys``
    (None where no run had it), with how many runs; servers with no run are left out."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        rows = [r for r in runs if r["server"] == name]
        if not rows:
            continue
        figures: dict[str, Any] = {"runs": len(rows)}
        for key in keys:
            values = [r[key] for r in rows if r.get(key) is not None]
            figures[key] = round(statistics.median(values), 3) if values else None
        out[name] = figures
    return out
