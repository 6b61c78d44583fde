"""The front door's waiting line against a model: the order a freed slot is offered in (rank,
then arrival), the bounds (in all, per declared tenant), and each waiter out exactly once."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from governor.core.waitline import Waiter, WaitLine, wait_budget_s, waits

RANKS = 3
LIMIT = 6
PER_TENANT = 3
TENANTS = ("a", "b", "c")


class Line(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.line: WaitLine[int] = WaitLine(RANKS, limit=LIMIT, per_tenant=PER_TENANT)
        self.model: list[tuple[int, int, str, bool]] = []  # (rank, arrival, tenant, bounded)
        self.waiters: dict[int, Waiter[int]] = {}
        self.arrivals = 0
        self.out: list[int] = []  # each waiter taken out, once

    def tenant_count(self, tenant: str) -> int:
        return sum(1 for m in self.model if m[2] == tenant)

    @rule(rank=st.integers(0, RANKS - 1), tenant=st.sampled_from(TENANTS), bounded=st.booleans())
    def join(self, rank: int, tenant: str, bounded: bool) -> None:
        self.arrivals += 1
        n = self.arrivals
        fits = len(self.model) < LIMIT and (not bounded or self.tenant_count(tenant) < PER_TENANT)
        waiter = self.line.join(n, rank=rank, tenant=tenant, since=float(n), bounded=bounded)
        assert (waiter is not None) == fits
        if waiter is not None:
            assert (waiter.item, waiter.rank, waiter.tenant) == (n, rank, tenant)
            self.model.append((rank, n, tenant, bounded))
            self.waiters[n] = waiter

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        """A waiter leaves (admitted, refused, or its client gone)."""
        entry = data.draw(st.sampled_from(self.model))
        assert self.line.leave(self.waiters[entry[1]])
        self.model.remove(entry)
        self.out.append(entry[1])

    @precondition(lambda self: self.out)
    @rule(data=st.data())
    def leave_again(self, data: st.DataObject) -> None:
        """Out already: taking it out again changes nothing."""
        n = data.draw(st.sampled_from(self.out))
        before = (len(self.line), [w.item for w in self.line.in_order()])
        assert not self.line.leave(self.waiters[n])
        assert (len(self.line), [w.item for w in self.line.in_order()]) == before

    @invariant()
    def agrees(self) -> None:
        expected = [n for _, n, _, _ in sorted(self.model)]  # by rank, then arrival
        assert [w.item for w in self.line.in_order()] == expected
        assert len(self.line) == len(self.model) <= LIMIT
        for tenant in TENANTS:
            assert self.line.waiting(tenant) == self.tenant_count(tenant)
        assert len(self.out) == len(set(self.out))


Line.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
test_the_line = Line.TestCase


def test_a_request_may_ask_for_less_than_the_servers_budget_never_more() -> None:
    assert wait_budget_s(30.0, None) == 30.0
    assert wait_budget_s(30.0, 0) == 0.0
    assert wait_budget_s(30.0, 1500) == 1.5
    assert wait_budget_s(30.0, 90_000) == 30.0


@given(
    budget_ms=st.integers(0, 60_000),
    hints=st.lists(st.integers(1, 60_000), max_size=30),
)
def test_a_waiter_never_waits_past_its_budget(budget_ms: int, hints: list[int]) -> None:
    """Refused again and again, each time told a turn: it waits for each turn only while the
    turns it waited for add up to its budget; refused at once if the first is beyond it."""
    budget_s, waited_s = budget_ms / 1000, 0.0
    for hint_ms in hints:
        if not waits(budget_s, waited_s, hint_ms):
            break
        waited_s += hint_ms / 1000
    assert waited_s <= budget_s + 1e-9
    if hints and hints[0] > budget_ms:
        assert waited_s == 0
