"""The seam between admission and execution.

A :class:`Runner` executes one admitted job per call of :meth:`Runner.run`, an async
generator of :class:`Token` events (partial output, as it is produced) ending with one
:class:`Finished`. The server cancels the iteration's task to stop a job (client gone,
``ttl_ms`` spent, shutdown): a runner must stop work promptly when cancelled and raise
:class:`RunnerError` for a job that failed, never anything else.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from protocol.codes import NeedCode


@dataclass(frozen=True, slots=True)
class Job:
    """An admitted job: its verified payload and what the manifest said of it."""

    id: str
    payload: bytes
    content_type: str = "application/octet-stream"


@dataclass(frozen=True, slots=True)
class Token:
    """Partial output."""

    text: str


@dataclass(frozen=True, slots=True)
class Finished:
    """The job's end; ``result`` goes into the terminal ``confirm done`` frame."""

    result: Mapping[str, Any] = field(default_factory=dict)


RunEvent = Token | Finished


class RunnerError(Exception):
    """A job failed in the backend. ``code`` is the ``need_code`` of its ``confirm abort``."""

    def __init__(self, detail: str, code: NeedCode = NeedCode.BACKEND_ERROR) -> None:
        super().__init__(detail)
        self.detail = detail
        self.code = code


class Runner(Protocol):
    name: str

    @property
    def expected_service_s(self) -> float:
        """A first guess at a job's service time, before any has been observed."""
        ...

    async def start(self) -> None:
        """Get ready to run jobs (load models, start workers)."""
        ...

    async def close(self) -> None: ...

    def run(self, job: Job) -> AsyncGenerator[RunEvent, None]: ...
