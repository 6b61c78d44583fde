"""A job's expected service time from its size (minimal form; the learned model replaces it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class JobSize:
    prompt_tokens: int
    max_new_tokens: int
