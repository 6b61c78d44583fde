"""How long a job will hold its slot, from its own size: rates learned online, one model a pool.

A job's size is known at admission (its prompt in tokens and its ``max_new_tokens``), so a
running job's end can be predicted from it rather than from an average over jobs whose sizes
differ tenfold. Each finished job teaches the pool's :class:`ServiceModel` three rates, as
exponentially weighted means (alpha 0.2):

    prefill_s   its time to first token over its prompt tokens
    decode_s    the rest of its time over its output tokens after the first
    ratio       its output tokens over its max_new_tokens (a job may stop early)

and a job is expected to take ``prompt * prefill_s + max_new_tokens * ratio * decode_s``.
A job without a size (a raw payload on the stub runner), or any job before a sized job has
finished, is expected to take ``base_s``: the mean slot-holding time of such jobs, seeded with
the runner's own guess. Jobs that did not finish (failed, cancelled, out of time) teach nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.2


@dataclass(frozen=True, slots=True)
class JobSize:
    prompt_tokens: int
    max_new_tokens: int


class ServiceModel:
    __slots__ = ("base_s", "decode_s", "prefill_s", "ratio")

    def __init__(self, base_s: float) -> None:
        self.base_s = base_s
        self.prefill_s: float | None = None  # None until a sized job has finished
        self.decode_s = 0.0
        self.ratio = 1.0

    def knows(self, size: JobSize | None) -> bool:
        """Whether :meth:`predict_s` tells this job apart from the mean of unsized jobs."""
        return size is not None and self.prefill_s is not None

    def predict_s(self, size: JobSize | None) -> float:
        if size is None or self.prefill_s is None:
            return self.base_s
        return size.prompt_tokens * self.prefill_s + (
            size.max_new_tokens * self.ratio * self.decode_s
        )

    def observe(
        self,
        size: JobSize | None,
        held_s: float,
        ttft_s: float | None,
        completion_tokens: int | None,
    ) -> None:
        """A finished job: its size at admission and what it measured."""
        if size is None or ttft_s is None or completion_tokens is None:
            self.base_s += ALPHA * (held_s - self.base_s)
            return
        prefill = ttft_s / max(size.prompt_tokens, 1)
        decode = (held_s - ttft_s) / max(completion_tokens - 1, 1)
        ratio = min(completion_tokens / max(size.max_new_tokens, 1), 1.0)
        if self.prefill_s is None:  # the first: taken as it is
            self.prefill_s, self.decode_s, self.ratio = prefill, decode, ratio
            return
        self.prefill_s += ALPHA * (prefill - self.prefill_s)
        self.decode_s += ALPHA * (decode - self.decode_s)
        self.ratio += ALPHA * (ratio - self.ratio)
