"""What an upload does on ``yield``: the retry policy, the retry budget shared by uploads, and
:class:`RetryChoice`, one upload's decisions over them. Pure code: no sockets, no clock, the
random numbers from a generator it is given; :meth:`clients.client.GovernorClient.upload` does
the sending and the sleeping. The kinds of yield and how each is retried are described in
:mod:`clients.client`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from protocol.codes import ErrorCode, NeedCode, Status
from protocol.frames import Reply


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How an upload answers ``yield``.

    ``max_attempts`` counts admission attempts in all: 1 never retries. It is the only bound on
    retrying a busy yield; a ``breaker_open`` yield is retried only while the client's
    :class:`RetryBudget` also allows it, and a ``draining`` one never. By default the client
    sleeps ``retry_hint_ms`` plus a random ``jitter`` (up to ``jitter_ratio`` of the hint, at
    most ``max_jitter_s``), capped at ``max_sleep_s``. ``fixed_delay_s`` ignores the hint and
    sleeps that long instead: 0 is the naive client that retries at once, 0.5 behaves like
    heptamini's client against its own daemon (load tests compare against both).

    The jitter is small and positive: the governor already spreads refused clients over its
    coming releases, and holds a released slot for the client it was promised to, so arriving
    a little late costs that slot idle time and arriving early costs a refusal.
    """

    max_attempts: int = 10
    fixed_delay_s: float | None = None
    jitter_ratio: float = 0.1
    max_jitter_s: float = 0.002
    max_sleep_s: float = 5.0

    def delay_s(self, hint_ms: int | None, rng: random.Random) -> float:
        if self.fixed_delay_s is not None:
            return self.fixed_delay_s
        base = (hint_ms or 50) / 1000
        jitter = rng.uniform(0, min(base * self.jitter_ratio, self.max_jitter_s))
        return min(base + jitter, self.max_sleep_s)


DEFAULT_RETRY = RetryPolicy()
NO_RETRY = RetryPolicy(max_attempts=1)

_MILLI = 1000  # the budget counts in thousandths of a token, so its arithmetic is exact


class RetryBudget:
    """A token bucket that bounds retries into a failing backend (gRPC's retry throttling).

    It starts full, at ``max_tokens``. Each failure signal (a ``breaker_open`` yield, or a job
    aborted with ``backend_error``) withdraws one token, down to zero; each job that ends
    ``done`` deposits ``token_ratio``, up to ``max_tokens``. A retry after a failure signal is
    allowed only while more than half the tokens are left (after that signal's withdrawal).

    So a burst of failures gets about ``max_tokens / 2`` retries in all, however many uploads
    see them, and after that only ``1 / token_ratio`` jobs done buys one failure back: a
    healthy backend (failures rare, successes common) never notices the budget, and a failing
    one sees its offered load stay near the original requests instead of multiplying by
    ``max_attempts``. Busy yields neither withdraw nor need budget: they are flow control,
    cheap for the server and paced by its hint.

    Tokens are kept in thousandths (``token_ratio`` is rounded to three decimals, as gRPC
    does), so that ten deposits of 0.1 make exactly one token. This is mutable state for one
    event loop (it does no locking): pass the same budget to several :class:`GovernorClient`
    instances to make them share it.
    """

    __slots__ = ("_max", "_milli", "_ratio")

    def __init__(self, *, max_tokens: float = 10.0, token_ratio: float = 0.1) -> None:
        self._max = round(max_tokens * _MILLI)
        self._ratio = round(token_ratio * _MILLI)
        if self._max < 1:
            raise ValueError("max_tokens must be at least 0.001")
        if self._ratio < 1:
            raise ValueError("token_ratio must be at least 0.001")
        self._milli = self._max

    @property
    def max_tokens(self) -> float:
        return self._max / _MILLI

    @property
    def token_ratio(self) -> float:
        return self._ratio / _MILLI

    @property
    def tokens(self) -> float:
        """The tokens left now."""
        return self._milli / _MILLI

    def record_failure(self) -> None:
        """A failure signal: withdraw one token (never below zero)."""
        self._milli = max(self._milli - _MILLI, 0)

    def record_success(self) -> None:
        """A job ended ``done``: deposit ``token_ratio`` (never above ``max_tokens``)."""
        self._milli = min(self._milli + self._ratio, self._max)

    def allows_retry(self) -> bool:
        """Whether a retry after a failure signal may go: more than ``max_tokens / 2`` left."""
        return 2 * self._milli > self._max

    def __repr__(self) -> str:
        return (
            f"RetryBudget(tokens={self.tokens:g}, max_tokens={self.max_tokens:g}, "
            f"token_ratio={self.token_ratio:g})"
        )


def backend_failing(reply: Reply) -> bool:
    """Whether ``reply`` says the backend is failing (not busy): a budget failure signal."""
    if reply.status == Status.YIELD:
        return reply.need_code == NeedCode.BREAKER_OPEN
    return reply.status == Status.ABORT and reply.error_code == ErrorCode.BACKEND_ERROR


class RetryChoice:
    """One upload's retry decisions: after each answered attempt, whether to send it again and
    after how long.

    Every answer is booked in the shared :class:`RetryBudget` (a failure signal withdraws, a
    job done deposits). A yield is retried while ``policy.max_attempts`` is not spent and it is
    not ``draining``; a ``breaker_open`` one also only while the budget allows a retry (else
    :attr:`budget_exhausted`) and its hint, the breaker's remaining cooldown, is within
    ``policy.max_sleep_s``. The wait is :meth:`RetryPolicy.delay_s`, never negative.
    """

    __slots__ = ("attempts", "budget", "budget_exhausted", "policy", "rng", "yields")

    def __init__(self, policy: RetryPolicy, budget: RetryBudget, rng: random.Random) -> None:
        self.policy = policy
        self.budget = budget
        self.rng = rng
        self.attempts = 0  # admission attempts answered
        self.yields: list[Reply] = []
        self.budget_exhausted = False  # the last yield would have been retried but for the budget

    def after(self, reply: Reply) -> float | None:
        """Book the attempt ``reply`` answers (its final frame): the seconds to wait before
        sending the job again, or None when the upload ends with ``reply``."""
        self.attempts += 1
        failing = backend_failing(reply)
        if failing:
            self.budget.record_failure()
        elif reply.status == Status.DONE:
            self.budget.record_success()
        if reply.status != Status.YIELD:
            return None
        self.yields.append(reply)
        policy = self.policy
        if self.attempts >= policy.max_attempts or reply.need_code == NeedCode.DRAINING:
            return None
        if failing and not self.budget.allows_retry():
            self.budget_exhausted = True
            return None
        if failing and (reply.retry_hint_ms or 0) / 1000 > policy.max_sleep_s:
            return None  # the breaker stays open longer than this client will wait
        return max(policy.delay_s(reply.retry_hint_ms, self.rng), 0.0)
