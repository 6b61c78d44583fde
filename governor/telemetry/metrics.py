"""What the daemon measures of each job, in Prometheus' terms (:mod:`governor.ops.exporter` exports it).

Gauges and counters are read from the server's own state at scrape time, so admission pays
nothing for them. What is measured per job (times and sizes) goes into :class:`Histogram`,
a few integer increments on the event loop: prometheus-client's own histogram takes a lock
per observation, for threads this daemon does not have on its hot path. A scrape runs on the
event loop too (:mod:`governor.listeners.admin` schedules it there), so it reads consistent state.

Labels are bounded: lanes, pools, wire codes and tenants from the config; never a job id.
Lane ``-`` is a job with lanes off.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterator, Sequence

from prometheus_client.core import HistogramMetricFamily

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
DECISION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3)
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PROBE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """Counts per bucket (each value in the first bucket whose bound it does not exceed)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative, as Prometheus wants them."""
        return cumulative(self.bounds, self.counts)


def cumulative(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[str, float]]:
    """Counts per bucket (the last one +Inf) as Prometheus' cumulative buckets."""
    out: list[tuple[str, float]] = []
    total = 0
    for bound, count in zip((*bounds, float("inf")), counts, strict=True):
        total += count
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
    return out


class LaneHistograms:
    """One histogram per lane, made on the lane's first observation."""

    def __init__(self, name: str, documentation: str, bounds: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = bounds
        self.by_lane: dict[str, Histogram] = {}

    def observe(self, lane: str, value: float) -> None:
        histogram = self.by_lane.get(lane)
        if histogram is None:
            histogram = self.by_lane[lane] = Histogram(self.bounds)
        histogram.observe(value)

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["lane"])
        for lane, h in sorted(self.by_lane.items()):
            family.add_metric([lane], h.buckets(), h.sum)
        return family


class ResumeMetrics:
    """A paused job's resumes, where its runner measures them (the http runner's): the seconds
    to its next token, and the prompt tokens its upstream computed again."""

    def __init__(self) -> None:
        self.seconds = LaneHistograms(
            "governor_resume_seconds",
            "From a resumed job's new request to its next token (the sidecar's pauses).",
            TTFT_BUCKETS,
        )
        self.recomputed = LaneHistograms(
            "governor_resume_recomputed_tokens",
            "Prompt tokens the upstream computed again at a resume (its cache held the rest).",
            (0, *TOKEN_BUCKETS),
        )

    def observe(self, lane: str, seconds: float | None, recomputed: int | None) -> None:
        """One resume (None: not measured)."""
        if seconds is not None:
            self.seconds.observe(lane, seconds)
        if recomputed is not None:
            self.recomputed.observe(lane, recomputed)


class JobMetrics:
    """What the daemon measures of each job and admission attempt."""

    def __init__(self) -> None:
        # Lines refused for their envelope or shape, by need code.
        self.bad_frames: collections.Counter[str] = collections.Counter()
        # The front door's answers, by path (a known one, else "other") and status.
        self.http_responses: collections.Counter[tuple[str, str]] = collections.Counter()
        self.ttft = LaneHistograms(
            "governor_time_to_first_token_seconds",
            "From admission to the job's first generated text.",
            TTFT_BUCKETS,
        )
        self.tpot = LaneHistograms(
            "governor_time_per_output_token_seconds",
            "Time per output token after the first, per finished job.",
            TPOT_BUCKETS,
        )
        self.e2e = LaneHistograms(
            "governor_e2e_job_latency_seconds",
            "From admission to the job's terminal frame, for every admitted job.",
            E2E_BUCKETS,
        )
        self.decision = LaneHistograms(
            "governor_admission_decision_seconds",
            "Time to decide an admission attempt (admit or yield).",
            DECISION_BUCKETS,
        )
        self.wait = LaneHistograms(
            "governor_admission_wait_seconds",
            "From a job's first yield to its admission: the wait its client did instead of "
            "a queue (0 when admitted at once).",
            WAIT_BUCKETS,
        )
        self.door_wait = LaneHistograms(
            "governor_wait_seconds",
            "How long jobs waited in line for their turn (both doors), whatever ended the wait.",
            WAIT_BUCKETS,
        )
        # Waits in line, by lane and how they ended (admitted, refused: a yield or 429,
        # unavailable: a drain's, 503 on HTTP; rejected: 400; left: the client went).
        self.door_waits: collections.Counter[tuple[str, str]] = collections.Counter()
        # Busy jobs that could have waited and were refused at once, by why they did not wait
        # (beyond_budget: their turn later than their wait budget; line_full).
        self.not_waited: collections.Counter[str] = collections.Counter()
        self.prompt_tokens = LaneHistograms(
            "governor_job_prompt_tokens", "Prompt tokens of jobs that finished.", TOKEN_BUCKETS
        )
        self.output_tokens = LaneHistograms(
            "governor_job_output_tokens", "Generated tokens of jobs that finished.", TOKEN_BUCKETS
        )
        self.resumes = ResumeMetrics()
        self.prompt_pieces = LaneHistograms(
            "governor_prompt_piece_seconds",
            "Each piece of a long prompt sent ahead into the upstream's cache (the sidecar's, "
            "in front of llama-server), from its request to its answer.",
            TPOT_BUCKETS,
        )
        self.probe = Histogram(PROBE_BUCKETS)
        # Admitted jobs' ends, by outcome (done, an abort's need code, client_gone), lane, pool.
        self.finished: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.aborts: collections.Counter[str] = collections.Counter()  # abort frames, by code
        self.probes: collections.Counter[str] = collections.Counter()  # by result

    def observe_job(
        self,
        lane: str,
        held_s: float,
        ttft_s: float | None,
        tpot_s: float | None,
        prompt: object,
        completion: object,
    ) -> None:
        """An admitted job's end: its times, and its token counts where it reported them."""
        self.e2e.observe(lane, held_s)
        if ttft_s is not None:
            self.ttft.observe(lane, ttft_s)
        if tpot_s is not None:
            self.tpot.observe(lane, tpot_s)
        if isinstance(prompt, int):
            self.prompt_tokens.observe(lane, prompt)
        if isinstance(completion, int):
            self.output_tokens.observe(lane, completion)

    def lane_families(self) -> Iterator[HistogramMetricFamily]:
        for h in (
            self.ttft,
            self.tpot,
            self.e2e,
            self.decision,
            self.wait,
            self.prompt_tokens,
            self.output_tokens,
            self.resumes.seconds,
            self.resumes.recomputed,
            self.prompt_pieces,
        ):
            yield h.family()
