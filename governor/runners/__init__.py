"""Runners execute admitted jobs; :mod:`.base` defines the interface."""

from .base import (
    Embedder,
    Fed,
    Finished,
    Forwarding,
    Job,
    KvCacheRunner,
    Pause,
    Pausing,
    Relay,
    Relayed,
    RunEvent,
    Runner,
    RunnerConfigError,
    RunnerError,
    RunnerHealth,
    RunnerStartError,
    Token,
)
from .stub import StubRunner

__all__ = [
    "Embedder",
    "Fed",
    "Finished",
    "Forwarding",
    "Job",
    "KvCacheRunner",
    "Pause",
    "Pausing",
    "Relay",
    "Relayed",
    "RunEvent",
    "Runner",
    "RunnerConfigError",
    "RunnerError",
    "RunnerHealth",
    "RunnerStartError",
    "StubRunner",
    "Token",
]
