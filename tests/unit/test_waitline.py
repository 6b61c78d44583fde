"""The waiting line both doors share, against a model: the order a freed slot is offered in
(rank, then arrival), the bounds (in all, per declared tenant), each waiter out exactly once,
and an offer's round: the waiters decided in order while a slot may be free, the round ended by
one refused ``server_busy``, a round asked for from within one run after it, and its watch
told each time the line stops being empty or becomes so."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from governor.core.waitline import Waiter, WaitLine, wait_budget_s, waits
from protocol.codes import NeedCode

RANKS = 3
LIMIT = 6
PER_TENANT = 3
TENANTS = ("a", "b", "c")


class Job:
    """A waiting job: decided again, it takes a free slot (and leaves the line) or is refused
    ``server_busy``; once, it also asks for another round from within its decision."""

    def __init__(self, machine: Line, n: int) -> None:
        self.machine = machine
        self.n = n

    def decide(self) -> str | None:
        machine = self.machine
        machine.decided.append(self.n)
        if self.n in machine.refused:
            return NeedCode.SERVER_BUSY
        machine.free -= 1
        entry = next(m for m in machine.model if m[1] == self.n)
        assert machine.line.leave(machine.waiters[self.n])
        machine.model.remove(entry)
        machine.out.append(self.n)
        if machine.reenter:  # (a job ended meanwhile: a round asked for from within this one)
            machine.reenter = False
            machine.line.offer(machine.room)
        return None


class Line(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.told: list[bool] = []  # what the line's watch was told, in order
        self.line: WaitLine[Job] = WaitLine(
            RANKS, limit=LIMIT, per_tenant=PER_TENANT, watch=self.told.append
        )
        self.model: list[tuple[int, int, str, bool]] = []  # (rank, arrival, tenant, bounded)
        self.waiters: dict[int, Waiter[Job]] = {}
        self.arrivals = 0
        self.out: list[int] = []  # each waiter taken out, once
        self.free = 0  # slots free during an offer
        self.decided: list[int] = []  # the waiters an offer decided, in order
        self.refused: set[int] = set()  # the waiters refused server_busy in an offer
        self.reenter = False

    def room(self) -> bool:
        return self.free > 0

    def tenant_count(self, tenant: str) -> int:
        return sum(1 for m in self.model if m[2] == tenant)

    @rule(rank=st.integers(0, RANKS - 1), tenant=st.sampled_from(TENANTS), bounded=st.booleans())
    def join(self, rank: int, tenant: str, bounded: bool) -> None:
        self.arrivals += 1
        n = self.arrivals
        fits = len(self.model) < LIMIT and (not bounded or self.tenant_count(tenant) < PER_TENANT)
        job = Job(self, n)
        waiter = self.line.join(job, rank=rank, tenant=tenant, since=float(n), bounded=bounded)
        assert (waiter is not None) == fits
        if waiter is not None:
            assert (waiter.item.n, waiter.rank, waiter.tenant) == (n, rank, tenant)
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
        before = (len(self.line), [w.item.n for w in self.line.in_order()])
        assert not self.line.leave(self.waiters[n])
        assert (len(self.line), [w.item.n for w in self.line.in_order()]) == before

    @rule(
        free=st.integers(0, LIMIT),
        refused=st.sets(st.integers(1, 60), max_size=4),
        reenter=st.booleans(),
    )
    def offer(self, free: int, refused: set[int], reenter: bool) -> None:
        """Slots free up: the waiters are decided again in the line's order while a slot may be
        free; one refused ``server_busy`` (its tenant at its cap, say) ends the round."""
        order = [n for _, n, _, _ in sorted(self.model)]
        expected = simulate(order, free, refused, reenter)
        self.free, self.refused, self.reenter, self.decided = free, refused, reenter, []
        self.line.offer(lambda: False)  # (no room: nobody is decided)
        assert self.decided == []
        self.line.offer(self.room)
        assert self.decided == expected
        self.free, self.refused = 0, set()

    @invariant()
    def agrees(self) -> None:
        expected = [n for _, n, _, _ in sorted(self.model)]  # by rank, then arrival
        assert [w.item.n for w in self.line.in_order()] == expected
        assert len(self.line) == len(self.model) <= LIMIT
        for tenant in TENANTS:
            assert self.line.waiting(tenant) == self.tenant_count(tenant)
        assert len(self.out) == len(set(self.out))

    @invariant()
    def its_watch_knows_whether_anyone_waits(self) -> None:
        """Told at each change between an empty line and one with jobs, and only then."""
        assert self.told == [i % 2 == 0 for i in range(len(self.told))]
        assert (self.told[-1] if self.told else False) == bool(self.model)


def simulate(order: list[int], free: int, refused: set[int], reenter: bool) -> list[int]:
    """The waiters an offer decides, in order: rounds over the line while a slot is free, each
    ended by a refusal; one more round when the first admission asked for one."""
    decided, left, again = [], list(order), True
    while again:
        again = False
        for n in list(left):
            if free == 0:
                break
            decided.append(n)
            if n in refused:
                break
            free -= 1
            left.remove(n)
            if reenter:
                reenter, again = False, True
    return decided


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
