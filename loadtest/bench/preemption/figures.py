"""The pure parts of ``bench preemption``: its prompts and jobs, the burst's saturation, the
chats' TTFT figures and the heavy texts compared."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol.spec import JobSpec

from ...support.stats import percentile, ratio

PARAGRAPH = (
    "The committee met on Tuesday to review the quarterly budget, the hiring plan and the new "
    "office lease. After a long discussion, the members agreed to postpone the decision on the "
    "lease until the landlord answers their questions about repairs, and asked the finance team "
    "to prepare two versions of the budget, one with the new hires and one without. "
)
PARAGRAPH_TOKENS = 69  # in the embedded model's tokenizer
QUESTIONS = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Why is the sky blue?",
    "Who wrote Hamlet?",
    "What is the boiling point of water?",
    "How far away is the Moon?",
    "What do bees make?",
    "Which planet is the largest?",
    "What is photosynthesis?",
    "How many days are in a leap year?",
    "What language is spoken in Brazil?",
    "What is the speed of light?",
)


def rewrite_prompt(index: int, tokens: int) -> str:
    """A rewrite of about ``tokens`` prompt tokens, its first words its own (no two rewrites
    share a cached prefix)."""
    repeats = max(1, round((tokens - 12) / PARAGRAPH_TOKENS))
    return f"Rewrite document number {index} in plain words.\n\n" + PARAGRAPH * repeats


def chat_prompt(index: int) -> str:
    return f"Question: {QUESTIONS[index % len(QUESTIONS)]}\nAnswer:"


def greedy(prompt: str, max_new_tokens: int, lane: str | None = None) -> JobSpec:
    return JobSpec(
        prompt=prompt,
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        ignore_eos=True,
        stream=True,
        lane=lane,
    )


@dataclass(frozen=True, slots=True)
class Tick:
    """One read of ``/metrics`` in the burst, with the jobs waiting to be admitted then."""

    t_s: float
    taken: int
    waiting: int
    overload: int


def saturation(ticks: Sequence[Tick], slots: int) -> dict[str, Any]:
    """The peak of slots taken, and among the ticks where a job waited to be admitted the share
    with every slot taken; the highest overload state."""
    waited = [t for t in ticks if t.waiting > 0]
    full = sum(1 for t in waited if t.taken >= slots)
    return {
        "samples": len(ticks),
        "peak_slots_taken": max((t.taken for t in ticks), default=0),
        "samples_with_waiting": len(waited),
        "full_while_waiting": full,
        "full_share": round(full / len(waited), 3) if waited else None,
        "overload_max": max((t.overload for t in ticks), default=0),
    }


def first_difference(a: str, b: str) -> int | None:
    """The first character where ``a`` and ``b`` differ (None: equal)."""
    if a == b:
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def ttft_summary(ttfts_s: Sequence[float]) -> dict[str, float | int | None]:
    """p50 and p99 (nearest rank) in ms."""
    if not ttfts_s:
        return {"n": 0, "p50_ms": None, "p99_ms": None}
    return {
        "n": len(ttfts_s),
        "p50_ms": round(percentile(ttfts_s, 50) * 1000, 1),
        "p99_ms": round(percentile(ttfts_s, 99) * 1000, 1),
    }


def compare_heavy(
    beside: Sequence[dict[str, Any]], alone: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """Each heavy job with chats against without: text equal, where it turned (and, when the
    run with chats says how much each had said before the first chat, whether it turned after
    that), wall-time ratio; and the ratio of the heavy work's makespans."""
    jobs = []
    for a, b in zip(beside, alone, strict=True):
        turned = first_difference(a.get("text", ""), b.get("text", ""))
        said = a.get("chars_before_chats")
        jobs.append(
            {
                "job": a["name"],
                "same_text": turned is None,
                "first_difference": turned,
                "turned_after_chats": None
                if said is None
                else turned is not None and turned >= said,
                "wall_ratio": ratio(a.get("wall_s"), b.get("wall_s")),
            }
        )
    walls = [j["wall_ratio"] for j in jobs if j["wall_ratio"] is not None]
    return {
        "jobs": jobs,
        "all_same_text": all(j["same_text"] for j in jobs),
        "turned_after_chats": sum(1 for j in jobs if j["turned_after_chats"]),
        "makespan_ratio": ratio(makespan(beside), makespan(alone)),
        "max_job_wall_ratio": max(walls, default=None),
    }


def makespan(reports: Sequence[dict[str, Any]]) -> float | None:
    """The longest wall time of the jobs (None: one has none: it failed)."""
    walls = [r.get("wall_s") for r in reports]
    return None if None in walls or not walls else max(w for w in walls if w is not None)
