"""The front door's waiting line: requests held at the door until their turn. Pure, no clock.

Most HTTP clients never retry a 429 (load tools, scripts, frameworks at their defaults), so a
front door that only refuses fails them where a queueing server would have served them. A
request that finds no slot free therefore waits at the door when admission's hint says its turn
comes within its wait budget (:func:`waits`: the server's ``http_max_wait``, or less if the
request asks for less); when its turn would come later, it is answered 429 at once, so that no
client waits only to be refused.

:class:`WaitLine` holds who waits, in the order a slot is offered when one may have freed: by
lane (interactive first), then by arrival. It is bounded in total (``limit``) and per declared
tenant (``per_tenant``); past a bound a request is answered 429 at once. The line decides
nothing else: each waiter is decided again by admission (the cap, the tenants' limits and
shares, the promise line and the pauses hold as for any request), in this order, and leaves the
line exactly once, admitted, refused, or because its client left.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(eq=False, slots=True)
class Waiter(Generic[T]):
    """One request in the line: ``item`` is the caller's (the request's exchange)."""

    item: T
    rank: int  # its lane's place in LANES (0 without a lane policy): the lower, the sooner
    tenant: str
    since: float  # when it joined, on the caller's clock


class WaitLine(Generic[T]):
    """The requests waiting at the door, by rank then arrival, within the bounds."""

    __slots__ = ("_ranks", "_tenants", "limit", "per_tenant")

    def __init__(self, ranks: int, *, limit: int, per_tenant: int) -> None:
        self.limit = limit
        self.per_tenant = per_tenant  # 0: none but ``limit``
        # One insertion-ordered dict per rank: arrival order, and removal in constant time.
        self._ranks: list[dict[Waiter[T], None]] = [{} for _ in range(ranks)]
        self._tenants: collections.Counter[str] = collections.Counter()

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
        return True

    def in_order(self) -> list[Waiter[T]]:
        """The waiters, in the order a freed slot is offered to them (a copy: the caller may
        take them out as it goes)."""
        return [waiter for line in self._ranks for waiter in line]


def wait_budget_s(server_s: float, asked_ms: int | None) -> float:
    """A request's wait budget: the server's, or less if the request asked for less."""
    return server_s if asked_ms is None else min(server_s, asked_ms / 1000)


def waits(budget_s: float, waited_s: float, hint_ms: int) -> bool:
    """Whether a request refused with ``hint_ms`` waits for that turn: it comes within the
    request's budget, counting the time it has waited already."""
    return waited_s + hint_ms / 1000 <= budget_s
