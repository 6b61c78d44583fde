"""The batched worker's scheduler, against a model of llama.cpp's KV cache.

The model holds each slot's cells as ids (a shared prefix is the same ids in two slots), so
the stateful test checks what llama.cpp needs for any interleaving of submissions, steps,
samples, cancels and ends: the cells in use never exceed the cache, every token goes in at the
next position of its sequence, the cells hold each prompt's own tokens, and every sequence
advances.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from governor.runners.batching import (
    MARGIN,
    MAX_PASSED,
    MIN_PREFILL,
    PREFILL_FLOOR,
    Entry,
    Scheduler,
    Sequence,
)
from governor.runners.stepcost import StepCosts, features


class FakeCache:
    """Cells as ids per slot, and the tokens they hold."""

    def __init__(self, slots: int) -> None:
        self.cells: list[list[int]] = [[] for _ in range(slots)]
        self.tokens: list[list[int]] = [[] for _ in range(slots)]
        self._ids = itertools.count()

    def forget(self, slot: int, start: int) -> None:
        assert 0 <= start < len(self.cells[slot]), "forgetting nothing"
        del self.cells[slot][start:]
        del self.tokens[slot][start:]

    def share(self, source: int, slot: int, length: int) -> None:
        assert not self.cells[slot], "sharing into a slot that holds cells"
        assert 0 < length <= len(self.cells[source])
        self.cells[slot] = self.cells[source][:length]
        self.tokens[slot] = self.tokens[source][:length]

    def decode(self, entries: list[Entry]) -> None:
        for entry in entries:
            slot = entry.seq.slot
            assert entry.start == len(self.cells[slot]), (
                "a token not at its sequence's next position"
            )
            self.cells[slot] += [next(self._ids) for _ in entry.tokens]
            self.tokens[slot] += entry.tokens

    @property
    def in_use(self) -> int:
        return len({cell for cells in self.cells for cell in cells})


def seq(key: str, prompt: list[int], max_new: int = 4, priority: int = 0) -> Sequence:
    return Sequence(key, tuple(prompt), max_new, priority=priority)


def scheduler(
    slots: int = 4, step_tokens: int = 64, cells: int = 1024
) -> tuple[Scheduler, FakeCache]:
    cache = FakeCache(slots)
    return Scheduler(slots, step_tokens, cells, cache), cache


def run_step(s: Scheduler, cache: FakeCache, token: int = 7) -> list[Entry]:
    entries = s.plan()
    cache.decode(entries)
    s.advance(entries)
    for entry in entries:
        if entry.sample:
            entry.seq.generated += 1
            if entry.seq.generated >= entry.seq.max_new_tokens:
                s.remove(entry.seq.key)
            else:
                entry.seq.pending = token
    return entries


def test_every_generating_sequence_gets_one_token_per_step() -> None:
    s, cache = scheduler()
    for i in range(3):
        s.submit(seq(f"s{i}", [i + 1, 2, 3], max_new=10))
    run_step(s, cache)  # the three prompts, together
    entries = run_step(s, cache)
    assert sorted((e.seq.key, len(e.tokens), e.sample) for e in entries) == [
        ("s0", 1, True),
        ("s1", 1, True),
        ("s2", 1, True),
    ]


def test_a_long_prompt_is_fed_in_chunks_beside_the_running_streams() -> None:
    s, cache = scheduler(step_tokens=32)
    s.submit(seq("chat", [1, 2], max_new=50))
    run_step(s, cache)
    s.submit(seq("rewrite", list(range(10, 110)), max_new=5, priority=1))
    sizes = []
    while s.running["rewrite"].prefilling:
        entries = run_step(s, cache)
        assert sum(len(e.tokens) for e in entries) <= 32
        assert any(e.seq.key == "chat" for e in entries), "the stream stalled for the prompt"
        sizes.append(sum(len(e.tokens) for e in entries if e.seq.key == "rewrite"))
    assert sizes == [31, 31, 31, 7]


def test_an_interactive_prompt_goes_before_a_heavy_one_and_never_shares_its_step() -> None:
    s, cache = scheduler(step_tokens=64)
    s.submit(seq("rewrite", list(range(10, 300)), priority=1))
    run_step(s, cache)
    s.submit(seq("chat", [1, 2, 3, 4, 5], priority=0))
    entries = run_step(s, cache)
    assert [(e.seq.key, len(e.tokens)) for e in entries] == [("chat", 5)]
    entries = run_step(s, cache)  # the chat's first token, and the rewrite's prompt goes on
    assert {e.seq.key for e in entries} == {"chat", "rewrite"}


def test_a_heavy_prompt_is_not_starved_by_a_stream_of_chats() -> None:
    s, cache = scheduler(slots=8, step_tokens=16, cells=10_000)
    s.submit(seq("rewrite", list(range(100, 164)), priority=1))
    chats = itertools.count()
    for _ in range(200):
        if len(s.running) < 8:  # a new chat prompt pending at every step
            s.submit(seq(f"chat{next(chats)}", list(range(1, 30)), max_new=2, priority=0))
        run_step(s, cache)
        if not s.running["rewrite"].prefilling:
            break
    assert not s.running["rewrite"].prefilling
    assert s.running["rewrite"].passed == 0


def test_a_prompt_reuses_the_cells_its_slot_kept_and_a_running_sequence_shares() -> None:
    s, cache = scheduler(slots=3)
    system = list(range(50, 70))
    s.submit(seq("a", [*system, 1, 2], max_new=1))
    run_step(s, cache)  # prefill and its only token: a ends, its slot keeps the cells
    assert not s.running
    s.submit(seq("b", [*system, 3, 4], max_new=5))
    b = s.running["b"]
    assert (b.slot, b.reused) == (0, 20)  # its own slot: the system prompt kept
    run_step(s, cache)
    s.submit(seq("c", [*system, 5], max_new=5))
    c = s.running["c"]
    assert c.slot != b.slot
    assert c.reused == 20  # shared with b, which is running
    assert cache.cells[c.slot][:20] == cache.cells[b.slot][:20]
    run_step(s, cache)
    assert cache.tokens[c.slot][:21] == [*system, 5]


def test_a_whole_prompt_in_the_cache_still_feeds_its_last_token() -> None:
    s, cache = scheduler()
    s.submit(seq("a", [1, 2, 3], max_new=1))
    run_step(s, cache)
    s.submit(seq("b", [1, 2, 3], max_new=1))
    assert s.running["b"].reused == 2
    entries = run_step(s, cache)
    assert [(e.tokens, e.start, e.sample) for e in entries] == [((3,), 2, True)]


def test_kept_cells_give_way_to_the_running_sequences_reservations() -> None:
    s, cache = scheduler(slots=2, cells=100)
    s.submit(seq("a", list(range(1, 61)), max_new=1))
    run_step(s, cache)
    run_step(s, cache)
    assert s.kept == 60  # a ended; its cells are kept
    s.submit(seq("b", list(range(200, 250)), max_new=10))  # 60 kept + 60 reserved > 100
    assert s.kept == 0
    assert cache.in_use == 0


class Batching(RuleBasedStateMachine):
    """Any interleaving, with prompts from a tiny vocabulary so that prefixes are shared."""

    def __init__(self) -> None:
        super().__init__()
        self.slots, self.cells, self.step_tokens = 4, 96, 24
        self.s, self.cache = scheduler(self.slots, self.step_tokens, self.cells)
        self.keys = itertools.count()
        self.tokens_fed: dict[str, int] = {}
        # Each sequence's prompt and the tokens it sampled: what its cells must come to hold.
        self.history: dict[str, list[int]] = {}

    def reserved(self) -> int:
        return sum(q.reservation for q in [*self.s.running.values(), *self.s.waiting])

    @rule(
        prompt=st.one_of(
            st.lists(st.integers(1, 3), min_size=1, max_size=8),
            st.lists(st.integers(1, 3), min_size=20, max_size=40),
        ),
        max_new=st.integers(1, 12),
        priority=st.integers(0, 2),
    )
    def submit(self, prompt: list[int], max_new: int, priority: int) -> None:
        # What admission guarantees: a slot and the job's whole reservation.
        new = seq(f"q{next(self.keys)}", prompt, max_new, priority)
        if len(self.s.running) + len(self.s.waiting) >= self.slots:
            return
        if self.reserved() + new.reservation > self.cells:
            return
        self.s.submit(new)
        self.history[new.key] = list(prompt)
        if new.slot >= 0:
            # The cells it starts from hold its own prompt's first tokens.
            assert self.cache.tokens[new.slot] == list(new.prompt[: new.reused])
            assert new.reused < len(new.prompt)

    @precondition(lambda self: self.s.running)
    @rule(token=st.integers(1, 3), stop=st.booleans())
    def step(self, token: int, stop: bool) -> None:
        running = list(self.s.running.values())
        passed = {q.key: q.passed for q in running}
        pending = [q for q in running if q.prefilling]
        entries = self.s.plan()
        assert entries, "sequences are running but the step is empty"
        decodes = [e for e in entries if not e.seq.prefilling]
        assert sorted(e.seq.key for e in decodes) == sorted(
            q.key for q in running if q.pending >= 0
        )
        assert sum(len(e.tokens) for e in entries) <= max(
            self.step_tokens, len(decodes) + MIN_PREFILL
        )
        prefills = [e for e in entries if e.seq.prefilling]
        if pending:
            first = min(q.priority for q in pending)
            assert prefills
            for e in prefills:
                assert e.seq.priority == first or passed[e.seq.key] >= MAX_PASSED
        self.cache.decode(entries)
        self.s.advance(entries)
        assert self.cache.in_use <= self.cells
        for entry in entries:
            if not entry.sample:
                continue
            q = entry.seq
            q.generated += 1
            if stop or q.generated >= q.max_new_tokens:
                self.s.remove(q.key)
                self.history.pop(q.key)
            else:
                q.pending = token
                self.history[q.key].append(token)

    @precondition(lambda self: self.s.running or self.s.waiting or self.s.suspended)
    @rule(data=st.data(), keep=st.booleans())
    def cancel(self, data: st.DataObject, keep: bool) -> None:
        keys = sorted([*self.s.running, *self.s.suspended, *(q.key for q in self.s.waiting)])
        key = data.draw(st.sampled_from(keys))
        assert self.s.remove(key, keep=keep) is not None
        assert self.s.remove(key) is None
        self.history.pop(key, None)

    @precondition(lambda self: self.s.running or self.s.waiting)
    @rule(data=st.data())
    def suspend(self, data: st.DataObject) -> None:
        keys = sorted([*self.s.running, *(q.key for q in self.s.waiting)])
        key = data.draw(st.sampled_from(keys))
        assert self.s.suspend(key)
        assert not self.s.suspend(key)
        assert key in self.s.suspended

    @precondition(lambda self: self.s.suspended)
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        # What admission guarantees a resumed job: a slot and its whole reservation again.
        key = data.draw(st.sampled_from(sorted(self.s.suspended)))
        q = self.s.suspended[key]
        if len(self.s.running) + len(self.s.waiting) >= self.slots:
            return
        if self.reserved() + q.reservation > self.cells:
            return
        assert self.s.resume(key)
        assert not self.s.resume(key)
        assert key in self.s.running or any(w.key == key for w in self.s.waiting)

    @invariant()
    def the_cache_model_and_the_scheduler_agree(self) -> None:
        assert [list(t) for t in self.s.held] == self.cache.tokens
        for q in self.s.running.values():
            assert self.cache.tokens[q.slot][: q.fed] == list(q.prompt[: q.fed])
        pinned = [q for q in self.s.suspended.values() if q.slot >= 0]
        slots = [q.slot for q in [*self.s.running.values(), *pinned]]
        assert len(set(slots)) == len(slots) <= self.slots
        assert self.s.used == sum(len(self.cache.cells[slot]) for slot in slots)
        # Kept cells, and those the suspended sequences keep, never crowd out what the running
        # sequences may still need.
        held = sum(len(self.s.held[q.slot]) for q in pinned)
        reserved = sum(q.reservation for q in self.s.running.values())
        assert self.s.kept + held + reserved <= self.cells
        assert not self.s.waiting or len(self.s.running) == self.slots

    @invariant()
    def no_token_is_lost_or_repeated(self) -> None:
        """Whatever was suspended, dropped and computed again: a sequence's cells hold the
        beginning of its prompt and sampled tokens, and a generating one all of it but the
        token it feeds next."""
        for q in [*self.s.running.values(), *self.s.suspended.values()]:
            history = self.history[q.key]
            assert q.reservation == len(history) - q.generated + q.max_new_tokens
            if q.slot < 0:
                assert list(q.prompt) == history[: len(q.prompt)]
                continue
            held = self.cache.tokens[q.slot]
            assert held == history[: len(held)]
            if q.pending >= 0:
                assert [*held, q.pending] == history


TestBatching = Batching.TestCase
TestBatching.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


@given(st.lists(st.integers(0, 3), max_size=30), st.lists(st.integers(0, 3), max_size=30))
def test_common_prefix(a: list[int], b: list[int]) -> None:
    from governor.runners.batching import _common

    n = _common(a, tuple(b))
    assert a[:n] == b[:n]
    assert n == min(len(a), len(b)) or a[n] != b[n]


def test_a_sequence_is_submitted_once() -> None:
    s, _ = scheduler()
    s.submit(seq("a", [1]))
    with pytest.raises(ValueError, match="already"):
        s.submit(seq("a", [1]))
    with pytest.raises(ValueError, match="prompt token"):
        s.submit(seq("b", []))


@given(
    pieces=st.lists(st.text(alphabet="ab<|>S", max_size=4), max_size=12),
    stops=st.lists(st.text(alphabet="ab<|>S", min_size=1, max_size=4), max_size=3),
)
def test_streamed_text_adds_up_and_never_shows_a_stop_string(
    pieces: list[str], stops: list[str]
) -> None:
    """The worker's output text: the deltas add up to the final text, which ends before the
    first stop string; text is held back only while it could still begin one."""
    from governor.runners.llama_worker import Text

    text, sent = Text(stops), []
    stopped = False
    for piece in pieces:
        stopped = text.add(piece.encode())
        sent.append(text.delta(final=stopped))
        if stopped:
            break
        # What is held back is the start of some stop string, and no more.
        held = text.text[len("".join(sent)) :]
        assert not held or any(s.startswith(held) for s in stops)
    if not stopped:
        sent.append(text.delta(final=True))
    assert "".join(sent) == text.text
    assert not any(s in text.text for s in stops)
    whole = "".join(pieces)
    assert whole.startswith(text.text)
    if not stopped:
        assert text.text == whole


# The step budget ------------------------------------------------------------------------


def costs(
    step_ms: float, token_ms: float, sample_ms: float = 0.0, attend_ms: float = 0.0
) -> StepCosts:
    """A step-cost model that knows these coefficients (it learns nothing here)."""
    return StepCosts((step_ms / 1000, token_ms / 1000, sample_ms / 1000, attend_ms / 1000))


def budgeted(
    step_costs: StepCosts, *, slots: int = 8, step_tokens: int = 256, cells: int = 100_000
) -> tuple[Scheduler, FakeCache]:
    cache = FakeCache(slots)
    return Scheduler(slots, step_tokens, cells, cache, costs=step_costs), cache


OWN_TOKENS = itertools.count(1_000_000)


def generating(s: Scheduler, cache: FakeCache, key: str, **limits: float) -> Sequence:
    """A sequence already generating (its one-token prompt fed, a token pending)."""
    # (A token of its own, which no other prompt starts with: no cell is shared by chance.)
    q = Sequence(key, (next(OWN_TOKENS),), 10_000, **limits)  # type: ignore[arg-type]
    s.submit(q)
    entries = [Entry(q, q.prompt, 0, True)]
    cache.decode(entries)
    s.advance(entries)
    q.pending = 7
    return q


def step_and_sample(s: Scheduler, cache: FakeCache) -> list[Entry]:
    entries = s.plan()
    cache.decode(entries)
    s.advance(entries)
    for entry in entries:
        if entry.sample:
            entry.seq.pending = 7  # every sequence goes on generating
    return entries


def prefill_tokens(entries: list[Entry]) -> int:
    return sum(len(e.tokens) for e in entries if e.seq.prefilling or e.start < len(e.seq.prompt))


def test_a_chat_keeps_its_pace_beside_a_long_prompt() -> None:
    """1 ms a step and 3 ms a token: a chat generating alone takes 4 ms a step; with a stall of
    1.5 a long prompt beside it gets 2 ms of each step (none of a token: the floor, 1 token)."""
    s, cache = budgeted(costs(1, 3), slots=4)
    chat = generating(s, cache, "chat", tpot_s=0.100, stall=1.5)
    s.submit(Sequence("rewrite", tuple(range(10, 1000)), 16, priority=1))
    entries = step_and_sample(s, cache)
    assert any(e.seq is chat for e in entries)
    assert prefill_tokens(entries) == 1  # 4 + 3 = 7 ms > 1.5 x 4 ms: only the floor
    # Without the stall, the objective (90 ms) bounds it: (90 - 4) / 3 = 28 tokens.
    chat.stall = 0.0
    assert prefill_tokens(step_and_sample(s, cache)) == 28
    # Without any objective, the whole step_tokens less the decodes.
    chat.tpot_s = 0.0
    assert prefill_tokens(step_and_sample(s, cache)) == 255


def test_a_short_prompt_goes_whole_beside_running_chats() -> None:
    """A chat's prompt that fits the objective goes in one step, stall or not (its first token
    comes at once); a long one beside it is held to the stall."""
    s, cache = budgeted(costs(2, 3), slots=8)
    for i in range(4):
        generating(s, cache, f"chat{i}", tpot_s=0.100, stall=1.5)
    s.submit(Sequence("new", tuple(range(10, 30)), 16))  # 20 tokens: 14 + 60 ms < 90 ms
    entries = step_and_sample(s, cache)
    assert [(e.seq.key, len(e.tokens), e.sample) for e in entries if e.seq.key == "new"] == [
        ("new", 20, True)
    ]
    s.submit(Sequence("long", tuple(range(100, 400)), 16))  # 300 tokens: never whole
    entries = step_and_sample(s, cache)
    # 5 generating: 2 + 15 = 17 ms a step; 1.5 x that is 25.5 ms: 2 prompt tokens (23 ms).
    assert prefill_tokens(entries) == 2


@given(
    step_ms=st.floats(0.5, 10),
    token_ms=st.floats(0.05, 5),
    sample_ms=st.floats(0, 2),
    attend_ms=st.floats(0, 0.01),
    limits=st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.01, 0.03, 0.1, 0.3]), st.sampled_from([0.0, 1.0, 1.5, 3.0])
        ),
        min_size=1,
        max_size=6,
    ),
    prompts=st.lists(st.tuples(st.integers(1, 600), st.integers(0, 2)), min_size=1, max_size=4),
    step_tokens=st.integers(16, 256),
)
@settings(max_examples=200, deadline=None)
def test_every_step_fits_its_bounds_and_leaves_no_stream_out(
    step_ms: float,
    token_ms: float,
    sample_ms: float,
    attend_ms: float,
    limits: list[tuple[float, float]],
    prompts: list[tuple[int, int]],
    step_tokens: int,
) -> None:
    """For any step costs, objectives, stalls and prompts: every generating sequence gets its
    token every step; a step's predicted cost stays within the tightest TPOT objective (less
    the margin), and within the tightest stall unless it feeds only whole prompts that fit the
    objective, wherever taking more than the floor of prompt tokens is what breaks them; every
    prompt is fed to its end, each step feeding some."""
    s, cache = budgeted(
        costs(step_ms, token_ms, sample_ms, attend_ms), slots=12, step_tokens=step_tokens
    )
    for i, (tpot_s, stall) in enumerate(limits):
        generating(s, cache, f"g{i}", tpot_s=tpot_s, stall=stall, priority=i % 3)
    for i, (length, priority) in enumerate(prompts):
        s.submit(Sequence(f"p{i}", tuple(range(1, length + 1)), 4, priority=priority))
    total = sum(length for length, _ in prompts)
    for _ in range(total + 1):
        if not any(q.prefilling for q in s.running.values()):
            break
        decoding = {q.key for q in s.running.values() if q.pending >= 0}
        before = s.occupied
        entries = s.plan()
        decodes = [e for e in entries if not e.seq.prefilling]
        prefill = [e for e in entries if e.seq.prefilling]
        assert {e.seq.key for e in decodes} == decoding
        assert prefill, "a step with prompts pending fed none"
        objective, stall_bound = s.bounds(decodes)
        cost = s.cost(entries)
        fed = sum(len(e.tokens) for e in prefill)
        assert fed <= max(step_tokens - len(decodes), MIN_PREFILL)
        if fed > PREFILL_FLOOR:
            if objective is not None:
                assert cost <= objective * (1 + 1e-9)
            if stall_bound is not None and cost > stall_bound * (1 + 1e-9):
                assert all(e.start + len(e.tokens) == len(e.seq.prompt) for e in prefill), (
                    "past the stall with a prompt that does not end"
                )
        cache.decode(entries)
        s.advance(entries)
        assert s.occupied == before + sum(len(e.tokens) for e in entries)
        for entry in entries:
            if entry.sample:
                entry.seq.pending = 7
    assert not any(q.prefilling for q in s.running.values()), "a prompt was never fed whole"


def test_a_heavy_prompt_progresses_beside_a_stream_of_chats_with_tight_objectives() -> None:
    """Chats whose objective no step can meet, and a chat prompt pending at every step: the
    rewrite's prompt still progresses (the floor, and its turn after MAX_PASSED steps)."""
    s, cache = budgeted(costs(5, 3), slots=10, step_tokens=64)
    for i in range(4):
        generating(s, cache, f"chat{i}", tpot_s=0.001, stall=1.1)
    s.submit(Sequence("rewrite", tuple(range(100, 150)), 4, priority=1))
    chats = itertools.count()
    steps = 0
    while s.running["rewrite"].prefilling:
        if len(s.running) < 10:
            s.submit(Sequence(f"new{next(chats)}", tuple(range(1, 30)), 2))
        step_and_sample(s, cache)
        for q in list(s.running.values()):
            if q.key.startswith("new") and q.pending >= 0:
                s.remove(q.key)
        steps += 1
        assert steps <= 50 * (MAX_PASSED + 1)
    assert steps <= 50 * (MAX_PASSED + 1)


def test_the_step_costs_learn_a_machine_from_its_steps() -> None:
    """Steps timed on a machine of known costs, with noise and a hiccup: the fit finds the costs
    (the prior says a CPU; this machine is a GPU's shape: a dear step, cheap tokens)."""
    truth = (0.012, 0.00008, 0.0004, 0.000002)
    learnt = StepCosts()
    rng = random.Random(3)
    for i in range(200):
        tokens = rng.choice([1, 2, 4, 8, 16, 64, 256])
        sampled = min(tokens, rng.choice([1, 2, 4, 8]))
        cells = rng.randrange(16, 4096)
        seconds = sum(c * v for c, v in zip(truth, features(tokens, sampled, cells), strict=True))
        if i == 150:
            seconds *= 40  # a hiccup: counted at most OUTLIER times the prediction
        learnt.observe(tokens, sampled, cells, seconds * rng.uniform(0.97, 1.03))
    for tokens, sampled, cells in [(1, 1, 100), (8, 8, 2000), (256, 1, 3000), (64, 4, 500)]:
        want = sum(c * v for c, v in zip(truth, features(tokens, sampled, cells), strict=True))
        assert learnt.predict(tokens, sampled, cells) == pytest.approx(want, rel=0.05)
    assert all(c >= 0 for c in learnt.coefficients)


@given(
    steps=st.lists(
        st.tuples(
            st.integers(1, 512), st.integers(0, 16), st.integers(0, 8192), st.floats(1e-5, 5.0)
        ),
        max_size=60,
    )
)
def test_step_costs_are_never_negative_whatever_the_steps(
    steps: list[tuple[int, int, int, float]],
) -> None:
    learnt = StepCosts()
    for tokens, sampled, cells, seconds in steps:
        learnt.observe(tokens, sampled, cells, seconds)
        assert all(c >= 0 and math.isfinite(c) for c in learnt.coefficients)
        assert learnt.per_token(cells) > 0


def burst_of_chats(deadline: float) -> tuple[float, float]:
    """Eight chats of 15 new prompt tokens arrive while one chat generates (2 ms a step, 3 ms
    a token; the stall of 1.5 lets in a token a step, the objective's 90 ms 28): when the last
    gets its first token, and the longest step."""
    s, cache = budgeted(costs(2, 3), slots=10)
    generating(s, cache, "running", tpot_s=0.100, stall=1.5)
    for i in range(8):
        q = Sequence(f"chat{i}", tuple(range(100 * i + 1, 100 * i + 16)), 16)
        q.deadline = deadline
        s.submit(q)
    now = longest = 0.0
    first: dict[str, float] = {}
    while any(q.prefilling for q in s.running.values()):
        entries = s.plan(now)
        longest = max(longest, s.cost(entries))
        now += s.cost(entries)  # the step runs as predicted
        cache.decode(entries)
        s.advance(entries)
        for entry in entries:
            if entry.sample:
                first.setdefault(entry.seq.key, now)
                entry.seq.pending = 7
    assert len(first) == 9
    return max(first.values()), longest


def test_a_burst_of_chats_is_fed_as_fast_as_their_objective_allows_when_due() -> None:
    """Their first tokens due sooner than the prompts can all be fed, the chats' prompts go at
    the pace of the running chat's objective (whole steps of it), not one prompt a step; and
    never past the objective, however late they are."""
    due_last, due_longest = burst_of_chats(deadline=0.3)
    lax_last, lax_longest = burst_of_chats(deadline=math.inf)
    assert due_last < lax_last
    assert lax_longest < due_longest <= 0.09 + 1e-9
    assert burst_of_chats(deadline=0.0) == (due_last, due_longest)


def test_a_heavy_prompt_past_its_deadline_is_fed_within_the_chats_objective() -> None:
    """A rewrite's first token is overdue beside generating chats: its prompt goes at the
    chats' objective (90 ms a step), no longer at their stall, and never past the objective."""
    s, cache = budgeted(costs(2, 3), slots=4)
    chat = generating(s, cache, "chat", tpot_s=0.100, stall=1.5)
    rewrite = Sequence("rewrite", tuple(range(1000, 1600)), 4, priority=1)
    rewrite.deadline = 10.0
    s.submit(rewrite)
    assert prefill_tokens(step_and_sample(s, cache)) == 1  # on time: the stall's pace
    entries = s.plan(now=11.0)
    assert sum(len(e.tokens) for e in entries if e.seq is rewrite) == 28  # (90 - 5) / 3
    assert s.cost(entries) <= 0.09
    assert any(e.seq is chat for e in entries)


def test_a_prompt_goes_whole_on_the_time_the_chats_have_banked() -> None:
    """Chats ahead of their TPOT objective (an average since their first token) let a prompt
    too long for one token's share go whole, in a step no longer than their TTFT objective
    (less the margin); behind it, past it, or with no first token known, the prompt is fed at
    the stall's pace."""
    s, cache = budgeted(costs(2, 4), slots=8)
    chats = [generating(s, cache, f"chat{i}", tpot_s=0.1, stall=1.5, ttft_s=1.0) for i in range(4)]
    for chat in chats:
        chat.first_at, chat.generated = 0.0, 10  # 10 tokens: due by 0.9 s at 90 ms each

    def fed(key: str, now: float) -> int:
        return sum(len(e.tokens) for e in s.plan(now) if e.seq.key == key)

    s.submit(Sequence("new", tuple(range(10, 90)), 16))  # 80 tokens: 2 + 4 x 84 = 338 ms
    assert fed("new", 0.5) == 80  # 400 ms banked
    assert fed("new", 0.6) == 2  # 300 ms banked; the stall: 1.5 x (2 + 16) ms is 2 tokens
    assert fed("new", 1.0) == 2  # behind: one token's share (90 ms), and the stall
    chats[0].first_at = None
    assert fed("new", 0.5) == 2
    chats[0].first_at = 0.0
    s.remove("new")
    for chat in chats:
        chat.generated = 1000  # far ahead: only the TTFT objective bounds the step, 900 ms
    s.submit(Sequence("fits", tuple(range(1, 201)), 16))  # 2 + 4 x 204 = 818 ms
    assert fed("fits", 0.5) == 200
    s.remove("fits")
    s.submit(Sequence("long", tuple(range(1, 231)), 16))  # 2 + 4 x 234 = 938 ms
    assert fed("long", 0.5) == 2


@given(
    step_ms=st.floats(0.5, 5),
    token_ms=st.floats(0.05, 3),
    objectives=st.lists(
        st.tuples(st.sampled_from([0.05, 0.1, 0.3]), st.sampled_from([0.0, 0.5, 1.0, 15.0])),
        min_size=1,
        max_size=4,
    ),
    arrivals=st.lists(
        st.tuples(st.integers(0, 60), st.integers(1, 400), st.integers(0, 2)), max_size=8
    ),
)
@settings(max_examples=150, deadline=None)
def test_every_stream_keeps_its_tpot_on_average_and_pauses_no_longer_than_its_ttft(
    step_ms: float,
    token_ms: float,
    objectives: list[tuple[float, float]],
    arrivals: list[tuple[int, int, int]],
) -> None:
    """Steps run as predicted, prompts of any lane arriving at any step: every stream's mean
    time per output token since its first stays within its TPOT objective (less the margin),
    and no gap between two of its tokens is longer than that objective's share or its TTFT
    objective (less the margin), however much time it banked."""
    s, cache = budgeted(costs(step_ms, token_ms), slots=16)
    streams = [
        generating(s, cache, f"g{i}", tpot_s=tpot, stall=1.5, ttft_s=ttft)
        for i, (tpot, ttft) in enumerate(objectives)
    ]
    now = 0.0
    times: dict[str, list[float]] = {q.key: [now] for q in streams}
    for q in streams:
        q.first_at, q.generated = now, 1
    due = sorted(arrivals)
    for step in range(200):
        while due and due[0][0] <= step:
            _, length, priority = due.pop(0)
            s.submit(Sequence(f"p{step}-{len(due)}", tuple(range(1, length + 1)), 4, priority))
        entries = s.plan(now)
        now += s.cost(entries)  # the step runs as predicted
        cache.decode(entries)
        s.advance(entries)
        for entry in entries:
            if entry.sample and entry.seq in streams:
                entry.seq.generated += 1
                times[entry.seq.key].append(now)
            if entry.sample:
                entry.seq.pending = 7
    for q in streams:
        t, per = times[q.key], MARGIN * q.tpot_s
        assert (t[-1] - t[0]) / (len(t) - 1) <= per * (1 + 1e-9)
        longest = max(b - a for a, b in itertools.pairwise(t))
        assert longest <= max(per, MARGIN * q.ttft_s) * (1 + 1e-9)


def test_a_suspended_sequence_is_not_stepped_and_goes_on_where_it_stopped() -> None:
    s, cache = scheduler(slots=2, cells=100)
    s.submit(seq("heavy", [1, 2, 3, 4], max_new=10, priority=1))
    run_step(s, cache, token=5)
    run_step(s, cache, token=6)
    assert s.suspend("heavy")
    s.submit(seq("chat", [9, 9], max_new=3))
    for _ in range(3):
        assert all(e.seq.key == "chat" for e in run_step(s, cache))
    assert s.resume("heavy")
    (entry,) = s.plan()
    assert (entry.seq.key, entry.tokens, entry.start, entry.sample) == ("heavy", (6,), 5, True)
    assert cache.tokens[entry.seq.slot] == [1, 2, 3, 4, 5]


def test_a_suspended_sequence_the_cache_cannot_keep_computes_again_what_it_held() -> None:
    s, cache = scheduler(slots=2, cells=40, step_tokens=64)
    s.submit(seq("heavy", list(range(10, 30)), max_new=10, priority=1))
    run_step(s, cache, token=5)  # the prompt, and its first token sampled
    run_step(s, cache, token=6)
    heavy = s.running["heavy"]
    assert s.suspend("heavy")
    assert heavy.slot >= 0  # (room to keep it)
    s.submit(seq("chat", list(range(50, 65)), max_new=10))  # 25 reserved + 21 kept > 40
    assert heavy.slot == -1
    assert heavy.prompt == (*range(10, 30), 5, 6)
    assert heavy.reservation == 30  # as admitted: its prompt and max_new_tokens
    run_step(s, cache)
    s.remove("chat")
    assert s.resume("heavy")
    entries = run_step(s, cache, token=8)
    (entry,) = entries
    # Whatever of it the cache still kept is reused; the rest is fed again, and the step that
    # feeds the token it sampled last samples its next one.
    assert entry.seq.key == "heavy"
    assert entry.sample
    assert entry.tokens[-1] == 6
    assert cache.tokens[heavy.slot] == [*range(10, 30), 5, 6]
    assert heavy.generated == 3
    assert heavy.pending == 8
    assert not heavy.prefilling


def test_a_resumed_sequence_goes_before_newer_ones_of_its_priority() -> None:
    s, cache = scheduler(slots=1, cells=200)
    s.submit(seq("old", [1, 2, 3], max_new=5, priority=1))
    run_step(s, cache)
    s.suspend("old")
    s.submit(seq("new", [4, 5, 6], max_new=5, priority=1))  # takes the slot: old's cells go
    s.resume("old")
    s.remove("new")
    assert "old" in s.running


def test_a_heavy_stream_ahead_of_its_objective_gives_its_place_to_a_chats_prompt() -> None:
    s, cache = scheduler(slots=4, cells=1000)
    ahead = generating(s, cache, "ahead", tpot_s=1.0)
    ahead.priority, ahead.first_at, ahead.generated = 1, 0.0, 10  # its 11th token due at 9 s
    behind = generating(s, cache, "behind", tpot_s=1.0)
    behind.priority, behind.first_at, behind.generated = 1, -7.5, 10  # due at 1.5 s
    chat = generating(s, cache, "chat", tpot_s=0.1)
    chat.first_at, chat.generated = 0.0, 10
    s.submit(seq("new", [5, 6, 7]))
    # At 1 s, "ahead" has 8 s in hand and skips the step that gives the chat its first token;
    # "behind" has less than a token's share (0.9 s) and the chat has its objective: they stay.
    assert {e.seq.key for e in s.plan(1.0)} == {"behind", "chat", "new"}
    # Nor in a step that feeds only part of a chat's prompt, nor without one, is any left out.
    s.remove("new")
    s.submit(seq("long", list(range(100, 400))))
    s.step_tokens = 8
    assert {e.seq.key for e in s.plan(1.0)} == {"ahead", "behind", "chat", "long"}
    s.remove("long")
    assert {e.seq.key for e in s.plan(1.0)} == {"ahead", "behind", "chat"}
