"""The waiting line both doors share: jobs held until their turn. Pure, no clock.

Most HTTP clients never retry a 429 (load tools, scripts, frameworks at their defaults), and a
TCP client that comes back late on its hint leaves the slot it was promised empty meanwhile. A
job that finds no slot free therefore waits for its turn when it may (an HTTP request always,
within the server's ``max_wait``; a TCP job when its frame asks with ``max_wait_ms``) and
admission's hint says its turn comes within its wait budget (:func:`waits`: the server's
``max_wait``, or less if the job asks for less); when its turn would come later, it is refused
at once, so that no client waits only to be refused.

:class:`WaitLine` holds who waits, in the order a slot is offered when one may have freed
(:meth:`WaitLine.offer`): by lane (interactive first), then by arrival. It is bounded in total
(``limit``) and per declared tenant (``per_tenant``); past a bound a job is refused at once. The
line decides nothing else: each waiter is decided again by admission (the cap, the tenants'
limits and shares, the promise line and the pauses hold as for any job), in this order, and
leaves the line exactly once, admitted, refused, or because its client left.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from protocol.codes import NeedCode


class Candidate(Protocol):
    """A waiting job, as the line offers it a slot."""

    def decide(self) -> str | None:
        """Decide it again: the need code of a refusal (it may go on waiting), None: admitted."""
        ...


T = TypeVar("T", bound=Candidate)


@dataclass(eq=False, slots=True)
class Waiter(Generic[T]):
    """One request in the line: ``item`` is the caller's (the request's exchange)."""

    item: T
    rank: int  # its lane's place in LANES (0 without a lane policy): the lower, the sooner
    tenant: str
    since: float  # when it joined, on the caller's clock


class WaitLine(Generic[T]):
    """The requests waiting at the door, by rank then arrival, within the bounds."""

    __slots__ = ("_again", "_offering", "_ranks", "_tenants", "limit", "per_tenant", "watch")

    def __init__(
        self,
        ranks: int,
        *,
        limit: int,
        per_tenant: int,
        watch: Callable[[bool], None] | None = None,
    ) -> None:
        self.limit = limit
        self.per_tenant = per_tenant  # 0: none but ``limit``
        self.watch = watch  # told when the line stops being empty (True) and becomes so again
        # One insertion-ordered dict per rank: arrival order, and removal in constant time.
        self._ranks: list[dict[Waiter[T], None]] = [{} for _ in range(ranks)]
        self._tenants: collections.Counter[str] = collections.Counter()
        self._offering = False  # in offer (a call from within it asks for one more round)
        self._again = False

    def __len__(self) -> int:
        return sum(len(rank) for rank in self._ranks)

    def waiting(self, tenant: str) -> int:
        return self._tenants[tenant]

    def join(
        self, item: T, *, rank: int, tenant: str, since: float, bounded: bool = True
    ) -> Waiter[T] | None:
        """``item`` joins the back of its rank; None (nothing changed) at a bound.
        ``bounded``: the tenant's own bound applies (a declared tenant's; not the anonymous
        one of a door without tenants, which ``limit`` alone bounds)."""
        if len(self) >= self.limit:
            return None
        if bounded and self.per_tenant and self._tenants[tenant] >= self.per_tenant:
            return None
        waiter = Waiter(item, rank, tenant, since)
        self._ranks[rank][waiter] = None
        self._tenants[tenant] += 1
        if self.watch is not None and len(self._tenants) == 1 == self._tenants[tenant]:
            self.watch(True)
        return waiter

    def leave(self, waiter: Waiter[T]) -> bool:
        """Take ``waiter`` out of the line; False (nothing changed) if it is not in it."""
        line = self._ranks[waiter.rank]
        if waiter not in line:
            return False
        del line[waiter]
        self._tenants[waiter.tenant] -= 1
        if not self._tenants[waiter.tenant]:
            del self._tenants[waiter.tenant]
            if self.watch is not None and not self._tenants:
                self.watch(False)
        return True

    def in_order(self) -> list[Waiter[T]]:
        """The waiters, in the order a freed slot is offered to them (a copy: the caller may
        take them out as it goes)."""
        return [waiter for line in self._ranks for waiter in line]

    def offer(self, room: Callable[[], bool]) -> None:
        """A slot may have freed (a job ended, a waiter left) or a drain began: the waiters are
        decided again, in the line's order, while ``room()`` says a slot may be free; a waiter
        refused ``server_busy`` ends the round (those behind it would be too). A call from
        within a decision (a job ended meanwhile) makes one more round after this one."""
        if self._offering:
            self._again = True
            return
        self._offering = True
        try:
            self._again = True
            while self._again:
                self._again = False
                for waiter in self.in_order():
                    if not room():
                        break
                    if waiter not in self._ranks[waiter.rank]:  # (gone in an earlier decision)
                        continue
                    if waiter.item.decide() == NeedCode.SERVER_BUSY:
                        break
        finally:
            self._offering = False


def wait_budget_s(server_s: float, asked_ms: int | None) -> float:
    """A request's wait budget: the server's, or less if the request asked for less."""
    return server_s if asked_ms is None else min(server_s, asked_ms / 1000)


def waits(budget_s: float, waited_s: float, hint_ms: int) -> bool:
    """Whether a request refused with ``hint_ms`` waits for that turn: it comes within the
    request's budget, counting the time it has waited already."""
    return waited_s + hint_ms / 1000 <= budget_s
