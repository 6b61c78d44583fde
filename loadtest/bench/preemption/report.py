"""``bench preemption``'s verdicts against its targets, and its summary as text."""

from __future__ import annotations

from typing import Any

from .jobs import SAMPLE_S

# Targets (the burst's are what lending every slot means; the chats' and the heavy jobs' the
# design's).
CHAT_P99_OVER_IDLE = 2.0
HEAVY_WALL_RATIO = 1.15
FULL_SHARE = 0.95


def verdicts(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each figure with its target and whether it was met (None: nothing to judge)."""
    b, c, h = report["burst"], report["chats"], report["heavy"]
    slots, peak, share = report["settings"]["slots"], b["peak_slots_taken"], b["full_share"]
    rows = [
        ("burst: peak slots taken", peak, f"= {slots}", peak == slots),
        (
            "burst: share of waiting samples with every slot taken",
            share,
            f">= {FULL_SHARE}",
            None if share is None else share >= FULL_SHARE,
        ),
        ("burst: highest overload state", b["overload_max"], "0", b["overload_max"] == 0),
        (
            "chats: TTFT p99 beside heavy / idle",
            c["p99_over_idle"],
            f"<= {CHAT_P99_OVER_IDLE}",
            _at_most(c["p99_over_idle"], CHAT_P99_OVER_IDLE),
        ),
        (
            "heavy: texts the same with chats as without",
            h["all_same_text"],
            "true",
            h["all_same_text"],
        ),
        (
            "heavy: texts that turned after the first chat",
            h["turned_after_chats"],
            "0",
            h["turned_after_chats"] == 0,
        ),
        (
            "heavy: makespan with chats / without",
            h["makespan_ratio"],
            f"<= {HEAVY_WALL_RATIO}",
            _at_most(h["makespan_ratio"], HEAVY_WALL_RATIO),
        ),
        (
            "heavy: worst job's wall time with chats / without",
            h["max_job_wall_ratio"],
            f"<= {HEAVY_WALL_RATIO}",
            _at_most(h["max_job_wall_ratio"], HEAVY_WALL_RATIO),
        ),
    ]
    return [{"figure": f, "value": v, "target": t, "met": m} for f, v, t, m in rows]


def _at_most(value: float | None, bound: float) -> bool | None:
    return None if value is None else value <= bound


def job_line(r: dict[str, Any]) -> str:
    if "wall_s" not in r:
        return f"  {r['name']:10} {r.get('error')}"
    codes = ", ".join(f"{k} x{n}" for k, n in r["yield_codes"].items())
    if r["yield_hints_ms"]:
        codes += f"; hints {', '.join(str(h) for h in r['yield_hints_ms'])} ms"
    return (
        f"  {r['name']:10} wall {r['wall_s']:7.2f} s  ttft {r['ttft_s']} s  "
        f"{r['completion_tokens']} tokens of a {r['prompt_tokens']}-token prompt  "
        f"{r['yields']} refusal(s){f' ({codes})' if codes else ''}"
        + (f"  ERROR {r['error']}" if "error" in r else "")
    )


def print_summary(report: dict[str, Any]) -> None:
    b, c, h = report["burst"], report["chats"], report["heavy"]
    print(f"burst: {len(b['jobs'])} rewrites at once, {b['seconds']} s")
    print(
        f"  /metrics every {SAMPLE_S * 1000:.0f} ms: {b['samples']} samples ({b['metrics_misses']} "
        f"missed), a job waiting in {b['samples_with_waiting']}, every slot taken in "
        f"{b['full_while_waiting']} of those"
    )
    for r in b["jobs"]:
        print(job_line(r))
    print("chats, one at a time:")
    for key, what in (("idle", "idle daemon"), ("beside_heavy", "beside the heavy jobs")):
        s = c[key]
        print(f"  {what:22} TTFT p50 {s['p50_ms']} ms  p99 {s['p99_ms']} ms  ({s['n']} chats)")
    print(
        f"  refusals beside the heavy jobs: {c['yields_beside_heavy']}; chats sent from "
        f"{h['chats_from_s']} s into the heavy jobs (each had its first token)"
    )
    print(
        f"heavy jobs: {h['seconds_with_chats']} s with chats, {h['seconds_without_chats']} s "
        f"without"
    )
    for j, a, w in zip(h["jobs"], h["with_chats"], h["without_chats"], strict=True):
        text = "same text"
        if not j["same_text"]:
            when = "after" if j["turned_after_chats"] else "before"
            text = (
                f"text differs at char {j['first_difference']} ({when} the first chat: "
                f"{a.get('chars_before_chats')} chars said by then)"
            )
        print(
            f"  {j['job']:10} {text}; wall {a.get('wall_s')} s with chats, {w.get('wall_s')} s "
            f"without (x{j['wall_ratio']})"
        )
    if "control" in h:
        k = h["control"]
        same = sum(j["same_text"] for j in k["jobs"])
        print(
            f"  control, without chats again: {same}/{len(k['jobs'])} texts the same, makespan "
            f"x{k['makespan_ratio']} ({k['seconds']} s)"
        )
    for key in ("metrics_with_chats", "metrics_without_chats"):
        m = h[key]
        print(
            f"  {key.removeprefix('metrics_').replace('_', ' ')}: suspensions {m['suspensions']}, "
            f"resumes {m['resumes']}, overload transitions {m['overload_transitions']}"
        )
    print("figures and targets:")
    for v in report["verdicts"]:
        mark = {True: "met", False: "MISSED", None: "n/a"}[v["met"]]
        print(f"  {v['figure']:54} {v['value']!s:>8}  target {v['target']:8} {mark}")
    for error in report["errors"]:
        print(f"error: {error}")


def without_texts(reports: list[dict[str, Any]]) -> None:
    """The texts left out of the report (compared already): their length and first words."""
    for r in reports:
        text = r.pop("text", None)
        if text is not None:
            r["text_chars"] = len(text)
            r["text_head"] = text[:60]
