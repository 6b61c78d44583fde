"""One job's way over the replicas, as pure bookkeeping: the tries it made, the replicas it
left, and what each try's end decides (another replica, a wait, or the end). No sockets, no
``await``: :class:`clients.fleet.client.FleetClient` connects, sends and withdraws, and asks
:class:`JobRoute` at each step.

A move takes the whole payload to the other replica's connection (the held payload lives on
the one left, which is told to drop it). A job whose connection broke, or whose replica
aborted it with ``backend_error`` (while the shared retry budget allows), goes on elsewhere,
unless output was already streamed to the caller. ``RetryPolicy.max_attempts`` bounds the
tries of a job over every replica together, a connection that could not be opened included.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from protocol.codes import ErrorCode, NeedCode, Receipt, Status
from protocol.frames import Reply

from ..client import ClientError, UploadResult
from ..retry import RetryBudget, RetryPolicy
from .addresses import Address
from .replicas import Move, Replicas

# Aborts that say the replica went away under the job, not that the job failed: the job goes
# on elsewhere. (A connection-level abort also closes the connection.)
GONE_CODES = frozenset(
    {
        NeedCode.SHUTDOWN,
        NeedCode.IDLE_TIMEOUT,
        NeedCode.TOO_MANY_CONNECTIONS,
        NeedCode.TOO_MANY_JOBS,
    }
)


class NoReplicaAvailable(ClientError):
    """No replica answered: none could be reached, or every one is draining."""


def why_none(errors: Sequence[BaseException]) -> str:
    if not errors:
        return "every replica is draining"
    return f"no replica could be reached (the last: {errors[-1]!r})"


@dataclass(slots=True)
class FleetResult(UploadResult):
    """An :class:`~clients.client.UploadResult` over several replicas: ``attempts`` counts
    every try on every replica (connections that failed included), ``yields`` every yield.
    ``replica`` gave the last reply; ``tried`` lists the replicas in the order the job went
    to them (one entry per visit)."""

    replica: str = ""
    tried: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Next:
    """What follows a visit that was answered without an abort: go to ``move`` (None: the job
    ends there), first telling the replica left to drop the payload it holds (``withdraw``);
    with ``pace`` the move's delay is a hint, paced by :meth:`JobRoute.paced`."""

    move: Move | None
    withdraw: bool = False
    pace: bool = False


class Visit:
    """One visit's hooks into :meth:`~clients.client.GovernorClient.upload`: each answered
    attempt observed, each yield asked whether another replica should take the job, the
    streamed output passed on."""

    __slots__ = ("answered", "move", "name", "route")

    def __init__(self, route: JobRoute, name: str) -> None:
        self.route = route
        self.name = name
        self.answered = 0  # attempts answered on this visit
        self.move: Move | None = None  # where the last yield said to go

    def seen(self, sent_at: float, reply: Reply) -> None:
        self.answered += 1
        self.route.replicas.observe(self.name, reply)
        if self.route.on_attempt is not None:
            self.route.on_attempt(sent_at, reply)

    def elsewhere(self, reply: Reply) -> bool:
        """``on_yield``: True to stay (wait out the hint here), False to go to :attr:`move`."""
        self.move = self.route.replicas.after_yield(self.name, exclude=self.route.avoid)
        return self.move is None

    def delta(self, text: str) -> None:
        self.route.delivered = True
        if self.route.on_delta is not None:
            self.route.on_delta(text)


class JobRoute:
    """One job's tries over the replicas, and the choice after each (see the module
    docstring); ``rng`` paces a move's wait, ``clock`` times the job."""

    def __init__(
        self,
        replicas: Replicas,
        budget: RetryBudget,
        retry: RetryPolicy,
        rng: random.Random,
        on_attempt: Callable[[float, Reply], None] | None = None,
        on_delta: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replicas = replicas
        self.budget = budget
        self.retry = retry
        self.rng = rng
        self.on_attempt = on_attempt
        self.on_delta = on_delta
        self.clock = clock
        self.attempts = 0
        self.yields: list[Reply] = []
        self.tried: list[str] = []
        self.avoid: set[str] = set()  # replicas this job left: draining, broken, failing
        self.errors: list[BaseException] = []
        self.delivered = False  # output streamed to the caller: the job cannot start over
        self.last: UploadResult | None = None
        self.last_replica = ""  # the replica that gave self.last
        self.budget_exhausted = False
        self.started = clock()

    # Where to go -------------------------------------------------------------------------

    def pick(self) -> Address | None:
        """A new pick, away from the replicas this job has left."""
        return self.replicas.pick(exclude=self.avoid)

    def may_try(self) -> bool:
        return self.attempts < self.retry.max_attempts

    def elsewhere(self) -> Move | None:
        address = self.pick()
        return None if address is None else Move(address, 0.0)

    def give_up_on(self, name: str) -> Move | None:
        """``name`` failed the job (no reply, or a reply that says it went away): counted
        against it, and the job goes elsewhere."""
        self.replicas.failure(name)
        self.avoid.add(name)
        return self.elsewhere()

    # A visit -----------------------------------------------------------------------------

    def visit(self, name: str) -> Visit:
        """The job goes to ``name``."""
        self.tried.append(name)
        self.replicas.sent(name)
        return Visit(self, name)

    def policy(self) -> RetryPolicy:
        """The retry policy of the next visit: the attempts left to the job."""
        return replace(self.retry, max_attempts=self.retry.max_attempts - self.attempts)

    def unreachable(self, name: str, error: BaseException) -> Move | None:
        """No connection to ``name`` could be opened: a try, and a failure."""
        self.attempts += 1
        self.errors.append(error)
        return self.give_up_on(name)

    def broke(self, visit: Visit, error: BaseException) -> None:
        """The connection broke under the job (the attempt it was on counts)."""
        self.attempts += visit.answered + 1
        self.errors.append(error)

    def ended(self, name: str, result: UploadResult) -> None:
        """The visit to ``name`` ended with ``result``."""
        self.attempts += result.attempts
        self.yields += result.yields
        self.last, self.last_replica = result, name

    # After a visit -----------------------------------------------------------------------

    def after_reply(self, name: str, result: UploadResult, move: Move | None) -> Next:
        """After a visit ended on anything but an abort: ``move`` is where its last yield
        said to go (None: it stopped on its own, or was not asked)."""
        reply = result.reply
        if reply.status != Status.YIELD or result.budget_exhausted:
            return Next(None)
        if self.attempts >= self.retry.max_attempts:
            return Next(None)
        if reply.need_code == NeedCode.DRAINING:
            self.avoid.add(name)
            return Next(self.elsewhere())
        if move is None:
            # The client stopped on its own: a breaker_open hint longer than it would sleep.
            self.avoid.add(name)
            move = self.replicas.after_yield(name, exclude=self.avoid)
            if move is None:
                return Next(None)
        return Next(move, withdraw=reply.receipt(Receipt.PAYLOAD_HELD) == 1, pace=True)

    def paced(self, move: Move) -> Move:
        """A move after a wait waits as the retry policy waits a hint of that length."""
        if move.delay_s > 0:
            hint_ms = math.ceil(move.delay_s * 1000)
            return Move(move.address, self.retry.delay_s(hint_ms, self.rng), move.wait_s)
        return move

    def gone(self, name: str, reply: Reply) -> Move | None:
        """After an abort of :data:`GONE_CODES` (its connection dropped): a replica shutting
        down is left, any other counted a failure; the job goes elsewhere."""
        if reply.need_code == NeedCode.SHUTDOWN:
            self.replicas.leave(name)
            self.avoid.add(name)
            return self.elsewhere()
        return self.give_up_on(name)

    def after_abort(self, name: str, reply: Reply) -> Move | None:
        """After any other abort: a backend error goes elsewhere while the budget allows."""
        if reply.error_code == ErrorCode.BACKEND_ERROR:
            # Observed as a failure already, and withdrawn from the budget by the client.
            if not self.budget.allows_retry():
                self.budget_exhausted = True
                return None
            self.avoid.add(name)
            return self.elsewhere()
        return None

    def result(self) -> FleetResult:
        """The job's end: its last reply; raises :class:`NoReplicaAvailable` when no replica
        gave one."""
        last = self.last
        if last is None:
            raise NoReplicaAvailable(why_none(self.errors)) from (
                self.errors[-1] if self.errors else None
            )
        return FleetResult(
            last.reply,
            self.attempts,
            self.yields,
            self.started,
            last.admitted_at,
            self.clock(),
            self.budget_exhausted or last.budget_exhausted,
            replica=self.last_replica,
            tried=tuple(self.tried),
        )
