"""Runners execute admitted jobs; :mod:`.base` defines the interface."""

from .base import Finished, Job, RunEvent, Runner, RunnerError, Token
from .stub import StubRunner

__all__ = ["Finished", "Job", "RunEvent", "Runner", "RunnerError", "StubRunner", "Token"]
