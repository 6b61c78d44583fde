"""Counting outcomes and latencies, and the report a run ends with.

Every offered job ends in exactly one bucket, so ``offered == executed + yielded + aborted +
timed_out + errors``:

* ``executed``: ``confirm done``;
* ``yielded``: the last answer was ``yield`` (retries spent, or none allowed), by ``need_code``;
* ``aborted``: ``confirm abort`` or ``clarify need``, by ``need_code``;
* ``timed_out``: still outstanding when ``--timeout`` passed, then cancelled;
* ``errors``: the connection broke during the upload (by exception type).

The report is a plain dict: :func:`report_lines` prints it for people, and its JSON is the last
line of stdout for programs.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from clients.client import UploadResult
from protocol.codes import Status

from .common import AttemptLog
from .stats import summarize


@dataclass(slots=True)
class Tally:
    offered: int = 0
    executed: int = 0
    timed_out: int = 0
    yielded_by: collections.Counter[str] = field(default_factory=collections.Counter)
    aborted_by: collections.Counter[str] = field(default_factory=collections.Counter)
    errors_by: collections.Counter[str] = field(default_factory=collections.Counter)
    retries: int = 0
    retried_jobs: int = 0  # jobs that needed at least one retry
    first_retry_admitted: int = 0  # ... of which the first retry was admitted
    yield_ms: list[float] = field(default_factory=list)  # every yield, retries' included
    e2e_ms: list[float] = field(default_factory=list)  # done jobs: first send to done, retries in

    @property
    def yielded(self) -> int:
        return self.yielded_by.total()

    @property
    def aborted(self) -> int:
        return self.aborted_by.total()

    @property
    def errors(self) -> int:
        return self.errors_by.total()

    def add_result(self, result: UploadResult, log: AttemptLog) -> None:
        self._add_attempts(log)
        if log.attempts == 2 and result.admitted_at is not None:
            self.first_retry_admitted += 1
        reply = result.reply
        if reply.status == Status.DONE:
            self.executed += 1
            self.e2e_ms.append((result.finished - result.started) * 1000)
        elif reply.status == Status.YIELD:
            self.yielded_by[reply.need_code or "?"] += 1
        else:  # abort, or a need that ended the upload
            self.aborted_by[reply.need_code or str(reply.status)] += 1

    def add_timed_out(self, log: AttemptLog) -> None:
        self._add_attempts(log)
        self.timed_out += 1

    def add_error(self, exc: BaseException, log: AttemptLog) -> None:
        self._add_attempts(log)
        self.errors_by[type(exc).__name__] += 1

    def _add_attempts(self, log: AttemptLog) -> None:
        self.retries += log.retries
        self.retried_jobs += log.retries > 0
        self.yield_ms.extend(log.yield_ms)

    def report(self, **context: Any) -> dict[str, Any]:
        """The run's numbers, JSON-ready; ``context`` (command, addr, cap, ...) goes in first."""
        return {
            **context,
            "offered": self.offered,
            "executed": self.executed,
            "yielded": self.yielded,
            "aborted": self.aborted,
            "timed_out": self.timed_out,
            "errors": self.errors,
            "yielded_by": dict(sorted(self.yielded_by.items())),
            "aborted_by": dict(sorted(self.aborted_by.items())),
            "errors_by": dict(sorted(self.errors_by.items())),
            "retries": self.retries,
            "retried_jobs": self.retried_jobs,
            "first_retry_admitted": self.first_retry_admitted,
            "yield_latency_ms": summarize(self.yield_ms).as_dict(),
            "e2e_ms": summarize(self.e2e_ms).as_dict(),
        }


def _by(counts: dict[str, int]) -> str:
    return f" ({', '.join(f'{k} {v}' for k, v in counts.items())})" if counts else ""


def _latency(summary: dict[str, Any]) -> str:
    if not summary["n"]:
        return "none"
    stats = "  ".join(f"{k} {summary[k]:.1f}" for k in ("p50", "p90", "p99", "max"))
    return f"{stats} ms  (n={summary['n']})"


def _value(value: object) -> str:
    return "-" if value is None else str(value)


def report_lines(report: dict[str, Any]) -> list[str]:
    """The summary for people, one fact a line."""
    return [
        f"offered      {report['offered']}",
        f"executed     {report['executed']} (done)",
        f"aborted      {report['aborted']}{_by(report['aborted_by'])}",
        f"yielded      {report['yielded']}{_by(report['yielded_by'])}",
        f"timed out    {report['timed_out']}",
        f"errors       {report['errors']}{_by(report['errors_by'])}",
        f"max inflight {_value(report['max_inflight_observed'])} observed by the monitor, "
        f"{_value(report['inflight_peak'])} peak by the server (backend.inflight_peak), "
        f"cap {_value(report['cap'])}",
        f"yield latency  {_latency(report['yield_latency_ms'])}",
        f"e2e latency    {_latency(report['e2e_ms'])}",
        f"retries      {report['retries']} ({report['retried_jobs']} job(s) retried, "
        f"{report['first_retry_admitted']} admitted at their first retry)",
        f"duration     {report['duration_s']:.3f} s",
    ]
