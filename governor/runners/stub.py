"""A runner that only takes time: for tests, load tests and trying the protocol out."""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import AsyncGenerator

from protocol.spec import JobSpec, check_ceiling

from .base import Finished, Job, RunEvent, RunnerError, RunnerHealth, Token

STUB_MAX_NEW_TOKENS = 1 << 20


class StubRunner:
    """Holds each job for ``delay_s``, then finishes it, or fails it with ``fail_rate``.

    A job spec's job also takes ``prompt_s`` per prompt token (estimated) before its first
    token, then ``output_s`` per further token of its ``max_new_tokens``, and streams: a stub
    whose time follows a model's, calibrated by those two rates.
    """

    name = "stub"

    def __init__(
        self,
        delay_s: float,
        *,
        fail_rate: float = 0.0,
        prompt_s: float = 0.0,
        output_s: float = 0.0,
        seed: int | None = None,
    ) -> None:
        if min(delay_s, prompt_s, output_s) < 0 or not 0.0 <= fail_rate <= 1.0:
            raise ValueError("times must be >= 0 and fail_rate within [0, 1]")
        self.delay_s = delay_s
        self.fail_rate = fail_rate
        self.prompt_s = prompt_s
        self.output_s = output_s
        self._random = random.Random(seed)

    @property
    def expected_service_s(self) -> float:
        return self.delay_s

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    @property
    def max_new_tokens(self) -> int:
        return STUB_MAX_NEW_TOKENS

    def prepare(self, job_id: str, spec: JobSpec | None, payload: bytes = b"") -> Job:
        """Any payload will do (it only takes time); a job spec is read, for the lane policy."""
        if spec is not None:
            check_ceiling(spec, STUB_MAX_NEW_TOKENS)
        return Job(job_id, payload, spec=spec)

    async def run(self, job: Job) -> AsyncGenerator[RunEvent, None]:
        spec = job.spec
        prompt_tokens = spec.estimated_prompt_tokens() if spec else 0
        await asyncio.sleep(self.delay_s + prompt_tokens * self.prompt_s)
        if self._random.random() < self.fail_rate:
            raise RunnerError("stub runner: injected failure")
        result: dict[str, object] = {
            "runner": self.name,
            "bytes": len(job.payload),
            "sha256": hashlib.sha256(job.payload).hexdigest(),
        }
        if spec is not None:
            yield Token("stub ")
            await asyncio.sleep((spec.max_new_tokens - 1) * self.output_s)
            result.update(prompt_tokens=prompt_tokens, completion_tokens=spec.max_new_tokens)
        yield Finished(result)

    async def probe(self) -> bool:
        """Fails at ``fail_rate`` like its jobs, but takes no time (a probe must be quick)."""
        if self._random.random() < self.fail_rate:
            raise RunnerError("stub runner: injected probe failure")
        return True

    def health(self) -> RunnerHealth:
        return RunnerHealth(supervisor_alive=True, workers_live=0, workers=0)
