"""From outcomes to numbers: per-class latencies, goodput, yields, retries and wasted work.

A report is a plain JSON-ready dict::

    {"command", "target", "addr", "date", "settings": {...}, "slo": {...},
     "steps": [step, ...]}

with one step per offered load (``rate --rate 1,2,4`` has three; the others one). A step::

    {"label", "offered", "offered_rps", "duration_s", "goodput_rps",
     "all": stats, "classes": {name: stats}, "timeline": {...}, "requests": [[...], ...]}

Every offered request ends in exactly one status, so ``offered == done + yielded + aborted +
timed_out + errors`` in each stats. A request is *good* when it is done and meets every
objective set for its class: time to first token, time per output token, end to end (a payload
job's first output is its done frame). Goodput is good requests per second of the step. Each
stats also has ``met``: the shares of its offered requests done within their TTFT objective,
their TPOT objective and both (the governor's attainment by lane, as the client saw it).
*Wasted* tokens are the output tokens of requests that were not good: work the target did that
no user could use.

Two figures say whether the hints fit the work under overload (a step's ``"saturation"`` and
``"paused"``):

* saturation: among the monitor's samples taken while at least twice the cap of clients were
  waiting (requests sent and not ended at the client, less the jobs running on the server, read
  at the client's sample nearest in time), the share with every slot busy and the mean number
  busy. Slots idle while clients wait are hints that sent clients back too late. With an
  interactive reserve (``--interactive-reserve``, the governor's own), ``usable_busy_share``
  leaves out the reserved slots while no interactive request is outstanding at the client:
  nobody waiting may take them, so only the others can be idle for a late hint.
* paused: the jobs refused at least once with ``lane_paused``, and their yields per job (all
  of them, and the ``lane_paused`` ones): a hint that does not say when the pause can end has
  a paused client retry in a loop.
"""

from __future__ import annotations

import bisect
import collections
import datetime
import platform
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .driver import Run
from .monitor import Sample
from .stats import summarize
from .targets import ABORTED, DONE, ERROR, STATUSES, TIMED_OUT, YIELDED, Outcome

# Columns of a step's "requests" rows (the raw data plots and compare read back).
REQUEST_FIELDS = ("cls", "sent_s", "status", "ttft_ms", "tpot_ms", "e2e_ms", "tokens", "attempts")
OBJECTIVES = ("ttft_ms", "tpot_ms", "e2e_ms")


@dataclass(frozen=True, slots=True)
class Slo:
    """Objectives in ms: a default per objective, and overrides per class (None: not set)."""

    default: dict[str, float] = field(default_factory=dict)
    by_class: dict[str, dict[str, float]] = field(default_factory=dict)

    def limit(self, objective: str, cls: str) -> float | None:
        return self.by_class.get(cls, {}).get(objective, self.default.get(objective))

    def met(self, outcome: Outcome) -> bool:
        return all(self.meets(outcome, objective) for objective in OBJECTIVES)

    def meets(self, outcome: Outcome, objective: str) -> bool:
        """Done, and within this one objective (or none set, or nothing to measure)."""
        if outcome.status != DONE:
            return False
        limit = self.limit(objective, outcome.request.cls)
        value = getattr(outcome, objective)
        return limit is None or value is None or value <= limit

    def as_dict(self) -> dict[str, Any]:
        return {"default": self.default, "by_class": self.by_class}


def parse_slo(objective: str, values: Iterable[str], slo: Slo) -> None:
    """Fill ``slo`` from ``--slo-ttft-ms`` style values: ``MS`` sets the default, ``CLASS=MS``
    one class's. Raises :class:`ValueError`."""
    for text in values:
        cls, sep, ms = text.rpartition("=")
        value = float(ms)
        if not value > 0:
            raise ValueError(f"{text!r}: an objective must be a positive number of ms")
        if sep:
            slo.by_class.setdefault(cls, {})[objective] = value
        else:
            slo.default[objective] = value


def _summary(values: Iterable[float | None]) -> dict[str, float | int | None]:
    return summarize([v for v in values if v is not None]).as_dict()


def stats(outcomes: Sequence[Outcome], duration_s: float, slo: Slo) -> dict[str, Any]:
    """The numbers of one group of requests (a class, or all)."""
    by_status = collections.Counter(o.status for o in outcomes)
    good = [o for o in outcomes if slo.met(o)]
    n = len(outcomes)
    met_ttft = [slo.meets(o, "ttft_ms") for o in outcomes]
    met_tpot = [slo.meets(o, "tpot_ms") for o in outcomes]
    both = sum(t and p for t, p in zip(met_ttft, met_tpot, strict=True))
    tokens = sum(o.tokens for o in outcomes)
    retried = [o for o in outcomes if o.attempts > 1]
    return {
        "offered": len(outcomes),
        **{status: by_status[status] for status in STATUSES},
        "yielded_by": _count(o.reason for o in outcomes if o.status == YIELDED),
        "aborted_by": _count(o.reason for o in outcomes if o.status == ABORTED),
        "errors_by": _count(o.reason for o in outcomes if o.status == ERROR),
        "yields": sum(len(o.yields) for o in outcomes),
        "yields_by": _count(reason for o in outcomes for _, reason, _ in o.yields),
        "retries": sum(max(o.attempts - 1, 0) for o in outcomes),
        "retried_jobs": len(retried),
        "first_retry_admitted": sum(o.first_retry_admitted for o in outcomes),
        # (a retry that was not answered with a yield: its job was admitted)
        "retries_admitted": sum(1 for o in outcomes if o.yields and o.attempts > len(o.yields)),
        "good": len(good),
        "met": {
            "ttft": round(sum(met_ttft) / n, 4) if n else None,
            "tpot": round(sum(met_tpot) / n, 4) if n else None,
            "both": round(both / n, 4) if n else None,
        },
        "goodput_rps": round(len(good) / duration_s, 4) if duration_s > 0 else 0.0,
        "throughput_rps": round(by_status[DONE] / duration_s, 4) if duration_s > 0 else 0.0,
        "tokens": tokens,
        "wasted_tokens": tokens - sum(o.tokens for o in good),
        "ttft_ms": _summary(o.ttft_ms for o in outcomes if o.status == DONE),
        "tpot_ms": _summary(o.tpot_ms for o in outcomes),
        "e2e_ms": _summary(o.e2e_ms for o in outcomes),
        "yield_latency_ms": _summary(ms for o in outcomes for _, _, ms in o.yields),
    }


PAUSED = "lane_paused"
INTERACTIVE = "interactive"


def saturation(
    outstanding: Sequence[tuple[float, int]],
    samples: Sequence[Sample],
    cap: int,
    *,
    reserve: int = 0,
    interactive: Sequence[tuple[float, float]] = (),
) -> dict[str, Any]:
    """How busy the slots were while at least ``2 * cap`` clients waited (see the module's
    docstring): ``samples`` (of the monitor) counted, the share of them with all ``cap`` slots
    busy, the share with every slot busy that a waiting client could take (``reserve`` slots
    kept for interactive work are left out while no interactive request is outstanding), and
    the mean number busy (None: no such sample).

    ``outstanding`` is the client's ``(t_s, requests outstanding)`` timeline, in time order;
    ``interactive`` the ``(sent_s, end_s)`` of each interactive request.
    """
    crowd = 2 * cap
    times = [t for t, _ in outstanding]
    busy: list[tuple[int, int]] = []  # (busy, slots a waiting client could take)
    for sample in samples:
        t = sample.t_ms / 1000
        i = bisect.bisect_left(times, t)
        if i == len(times) or (i > 0 and t - times[i - 1] <= times[i] - t):
            i -= 1  # the nearer of the two around it
        if i < 0:
            continue
        if outstanding[i][1] - sample.inflight >= crowd:
            chats = reserve and any(sent <= t < end for sent, end in interactive)
            busy.append((sample.inflight, cap if chats or not reserve else cap - reserve))
    n = len(busy)
    return {
        "waiting_at_least": crowd,
        "samples": n,
        "all_busy_share": round(sum(b >= cap for b, _ in busy) / n, 4) if n else None,
        "reserve": reserve,
        "usable_busy_share": round(sum(b >= usable for b, usable in busy) / n, 4) if n else None,
        "mean_busy": round(sum(b for b, _ in busy) / n, 3) if n else None,
    }


def paused(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """The jobs that drew a ``lane_paused`` yield, and their yields per job."""
    jobs = [o for o in outcomes if any(reason == PAUSED for _, reason, _ in o.yields)]
    pauses = sum(reason == PAUSED for o in jobs for _, reason, _ in o.yields)
    yields = sum(len(o.yields) for o in jobs)
    return {
        "jobs": len(jobs),
        "done": sum(o.status == DONE for o in jobs),
        "yields_per_job": round(yields / len(jobs), 3) if jobs else None,
        "paused_yields_per_job": round(pauses / len(jobs), 3) if jobs else None,
    }


def _count(items: Iterable[str | None]) -> dict[str, int]:
    return dict(sorted(collections.Counter(i or "?" for i in items).items()))


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def step(
    run: Run, slo: Slo, *, label: str, offered_rps: float | None = None, reserve: int = 0
) -> dict[str, Any]:
    """One step's report: per-class and overall stats, the timelines and the raw requests
    (``reserve``: the target's interactive reserve, for the saturation figure)."""
    outcomes = run.outcomes
    duration = run.duration_s
    classes: dict[str, list[Outcome]] = collections.defaultdict(list)
    for o in outcomes:
        classes[o.request.cls].append(o)
    overall = stats(outcomes, duration, slo)
    monitor = run.monitor
    timeline: dict[str, Any] = {
        "outstanding": [[t, n] for t, n in run.outstanding],
        "yields_s": sorted(round(t, 3) for o in outcomes for t, _, _ in o.yields),
        "done_s": sorted(round(o.end_s, 3) for o in outcomes if o.status == DONE and o.end_s),
        "server_inflight": []
        if monitor is None
        else [[round(s.t_ms / 1000, 3), s.inflight] for s in monitor.samples],
    }
    cap = None if monitor is None else monitor.cap
    return {
        "label": label,
        "offered": len(outcomes),
        "offered_rps": round(offered_rps if offered_rps is not None else _rate(outcomes), 4),
        "duration_s": round(duration, 3),
        "goodput_rps": overall["goodput_rps"],
        "saturation": None
        if monitor is None or not cap
        else saturation(
            run.outstanding,
            monitor.samples,
            cap,
            reserve=reserve,
            interactive=[
                (o.sent_s, o.end_s if o.end_s is not None else duration)
                for o in outcomes
                if o.request.cls == INTERACTIVE
            ],
        ),
        "paused": paused(outcomes),
        "hints": run.hints,
        "cap": cap,
        "max_inflight_observed": None if monitor is None else monitor.max_inflight,
        "inflight_peak": None if monitor is None else monitor.inflight_peak,
        "max_outstanding": max((n for _, n in run.outstanding), default=0),
        "monitor_error": None if monitor is None or monitor.error is None else str(monitor.error),
        "all": overall,
        "classes": {name: stats(group, duration, slo) for name, group in sorted(classes.items())},
        "timeline": timeline,
        "requests": [
            [
                o.request.cls,
                round(o.sent_s, 4),
                o.status,
                _r(o.ttft_ms),
                _r(o.tpot_ms),
                _r(o.e2e_ms),
                o.tokens,
                o.attempts,
            ]
            for o in outcomes
        ],
    }


def _rate(outcomes: Sequence[Outcome]) -> float:
    """Offered requests per second over the span of their sends (all at once: infinite -> n)."""
    if len(outcomes) < 2:
        return float(len(outcomes))
    span = outcomes[-1].sent_s - outcomes[0].sent_s
    return len(outcomes) / span if span > 0.001 else float(len(outcomes))


def build(
    command: str, target: Any, settings: dict[str, Any], slo: Slo, steps: list[dict[str, Any]]
) -> dict[str, Any]:
    """The whole report."""
    return {
        "command": command,
        "target": target.kind,
        "addr": target.addr,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} python {platform.python_version()}",
        "settings": settings,
        "slo": slo.as_dict(),
        "steps": steps,
    }


# For people ----------------------------------------------------------------------------


def _latency(summary: dict[str, Any]) -> str:
    if not summary["n"]:
        return "-"
    return "/".join(_ms(summary[k]) for k in ("p50", "p90", "p99", "max"))


def _ms(value: float) -> str:
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _by(counts: dict[str, int]) -> str:
    return f" ({', '.join(f'{k} {v}' for k, v in counts.items())})" if counts else ""


def table(step_report: dict[str, Any]) -> list[str]:
    """A step's summary table: one row per class and one for all (latencies p50/p90/p99/max)."""
    rows = [
        f"{'class':12} {'offered':>7} {'done':>5} {'good':>5} {'goodput/s':>9} "
        f"{'met ttft/tpot/both %':>20} {'yields':>6} {'retries':>7} {'wasted tok':>10}  "
        f"{'ttft ms':>20}  {'tpot ms':>15}  {'e2e ms':>22}"
    ]
    groups = dict(step_report["classes"])
    if len(groups) != 1:
        groups["all"] = step_report["all"]
    for name, s in groups.items():
        met = "/".join(
            "-" if (v := s["met"][k]) is None else f"{100 * v:.0f}"
            for k in ("ttft", "tpot", "both")
        )
        rows.append(
            f"{name:12} {s['offered']:7} {s['done']:5} {s['good']:5} {s['goodput_rps']:9.3f} "
            f"{met:>20} {s['yields']:6} {s['retries']:7} {s['wasted_tokens']:10}  "
            f"{_latency(s['ttft_ms']):>20}  {_latency(s['tpot_ms']):>15}  {_latency(s['e2e_ms']):>22}"
        )
    return rows


def summary_lines(step_report: dict[str, Any]) -> list[str]:
    """The step's outcome counts, the server's view, then the table."""
    a = step_report["all"]
    peak = step_report["inflight_peak"]
    lines = [
        f"{step_report['label']}: offered {a['offered']} ({step_report['offered_rps']}/s) "
        f"in {step_report['duration_s']:.3f} s",
        f"  done {a['done']}, yielded {a[YIELDED]}{_by(a['yielded_by'])}, aborted {a[ABORTED]}"
        f"{_by(a['aborted_by'])}, timed out {a[TIMED_OUT]}, errors {a[ERROR]}{_by(a['errors_by'])}",
        f"  yields {a['yields']}{_by(a['yields_by'])}, retries {a['retries']} "
        f"({a['retried_jobs']} job(s) retried, {a['first_retry_admitted']} admitted at their "
        f"first retry, {a['retries_admitted']} retries admitted in all), yield latency "
        f"{_latency(a['yield_latency_ms'])} ms",
    ]
    if step_report["cap"] is not None:
        lines.append(
            f"  max inflight {step_report['max_inflight_observed']} observed by the monitor, "
            f"{'-' if peak is None else peak} peak by the server, cap {step_report['cap']}"
        )
    else:
        lines.append(f"  max outstanding at the client {step_report['max_outstanding']}")
    if step_report["monitor_error"]:
        lines.append(f"  monitor stopped early: {step_report['monitor_error']}")
    lines += _overload_lines(step_report) + _hint_lines(step_report.get("hints"))
    lines.append(f"  goodput {step_report['goodput_rps']}/s; latencies p50/p90/p99/max:")
    return lines + ["  " + row for row in table(step_report)]


def _hint_lines(h: dict[str, Any] | None) -> list[str]:
    """How the governor's hints landed, as its /metrics said (with --metrics-addr)."""
    if not h or not h["returns"]:
        return []
    line = (
        f"  hints (the governor's /metrics): {h['returns']} return(s) at their hint, "
        f"{100 * h['landing_rate']:.1f}% landed"
    )
    if h["errors"]:
        median = h["median_abs_le"]
        line += (
            f"; {h['errors']} error(s) known: {100 * h['within_10pct']:.1f}% within 10% of "
            f"the hint, {100 * h['early_share']:.1f}% early, median |error| "
            f"{'past 100%' if median is None else f'<= {100 * median:g}%'} of the hint"
        )
    return [line]


def _overload_lines(step_report: dict[str, Any]) -> list[str]:
    """The saturation and the paused jobs' yields, where there is anything to say."""
    lines = []
    sat = step_report.get("saturation")
    if sat and sat["samples"]:
        lines.append(
            f"  while {sat['waiting_at_least']}+ clients waited ({sat['samples']} samples): "
            f"every slot busy in {100 * sat['all_busy_share']:.1f}%, "
            f"{sat['mean_busy']:.2f} of {step_report['cap']} busy on average"
        )
        if sat.get("reserve"):
            lines.append(
                f"  every slot a waiting client could take busy in "
                f"{100 * sat['usable_busy_share']:.1f}% (the {sat['reserve']} reserved "
                f"left out while no interactive request was outstanding)"
            )
    pause = step_report.get("paused")
    if pause and pause["jobs"]:
        lines.append(
            f"  {pause['jobs']} job(s) paused ({pause['done']} done): "
            f"{pause['yields_per_job']:.2f} yields per job, "
            f"{pause['paused_yields_per_job']:.2f} of them lane_paused"
        )
    return lines
