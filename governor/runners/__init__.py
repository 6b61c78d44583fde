"""Runners execute admitted jobs; :mod:`.base` defines the interface."""

from .base import (
    Finished,
    Job,
    KvCacheRunner,
    RunEvent,
    Runner,
    RunnerError,
    RunnerHealth,
    RunnerStartError,
    Token,
)
from .stub import StubRunner

__all__ = [
    "Finished",
    "Job",
    "KvCacheRunner",
    "RunEvent",
    "Runner",
    "RunnerError",
    "RunnerHealth",
    "RunnerStartError",
    "StubRunner",
    "Token",
]
