"""The pure summaries of ``bench generation``'s measures: a row of figures per round, the
burst's ratios, the memory of a target's process tree."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...support.processes import (
    process_tree,
    tree_rollup_kib,
)
from ...support.stats import percentile, ratio
from ...support.targets import ABORTED, DONE, Outcome


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
    """The ratios the targets are set on (see the package's docstring)."""
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


def memory_row(slots: int, memory: Memory) -> dict[str, Any]:
    """A target's PSS with ``slots`` slots (MiB), and its anonymous part."""

    def mib(kib: int | None) -> float | None:
        return _r(None if kib is None else kib / 1024)

    return {
        "slots": slots,
        "pss_mib": mib(memory.pss_kib),
        "pss_anon_mib": mib(memory.anon_kib),
        "processes": memory.processes,
    }
