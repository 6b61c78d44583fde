"""How the governor's retry hints landed over a step: its ``/metrics`` (``governor_hint_*``)
read before and after, the difference summed over lanes and pools.

* ``returns``: clients back at their hint; ``landed``, admitted; ``landing_rate``, the share;
* ``errors``: the hints whose error is known (each return's, once a slot was its client's), and
  of them the share within a tenth of the hint either side (``within_10pct``: a median absolute
  error of at most 10 % is a share of at least one half), the share early, and the median's
  bucket (``median_abs_le``: the least bound ``b`` of the histogram with half the errors within
  ``b`` of the hint).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .replicas import Sample, http_get, parse_metrics, total

RETURNS = "governor_hint_returns_total"
BUCKET = "governor_hint_error_ratio_bucket"


async def read(host: str, port: int) -> list[Sample]:
    """The hint families of the governor's ``/metrics`` (empty when it does not answer)."""
    try:
        body = await http_get(host, port, "/metrics")
    except (OSError, TimeoutError, ValueError):
        return []
    return [s for s in parse_metrics(body.decode(errors="replace")) if s[0] in (RETURNS, BUCKET)]


def summary(before: Sequence[Sample], after: Sequence[Sample]) -> dict[str, Any]:
    """The step's figures (see the module docstring) from two reads."""

    def grown(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    landed, early = grown(RETURNS, outcome="landed"), grown(RETURNS, outcome="early")
    bounds = sorted({float(s[1]["le"]) for s in after if s[0] == BUCKET})
    below = {b: grown(BUCKET, le=_le(b)) for b in bounds}  # errors <= b (cumulative)
    errors = below.get(float("inf"), 0.0)
    finite = [b for b in bounds if 0 < b < float("inf") and -b in below]
    within = {b: below[b] - below[-b] for b in finite}  # errors in (-b, b]
    return {
        "returns": int(landed + early),
        "landed": int(landed),
        "landing_rate": round(landed / (landed + early), 4) if landed + early else None,
        "errors": int(errors),
        "within_10pct": round(within[0.1] / errors, 4) if errors and 0.1 in within else None,
        "early_share": round(below[0.0] / errors, 4) if errors and 0.0 in below else None,
        "median_abs_le": next((b for b in finite if errors and within[b] >= errors / 2), None),
    }


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
