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
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from governor.runners.llama.batching import (
    MARGIN,
    MAX_PASSED,
    MIN_PREFILL,
    PREFILL_FLOOR,
    SETTLE,
    Entry,
    Scheduler,
    Sequence,
    after_step,
    preemptible_above,
    preempts,
)
from governor.runners.llama.stepcost import StepCosts, _bin, features


class FakeCache:
    """Cells as ids per slot, and the tokens they hold."""

    def __init__(self, slots: int) -> None:
        self.cells: list[list[int]] = [[] for _ in range(slots)]
        self.tokens: list[list[int]] = [[] for _ in range(slots)]
        self._ids = itertools.count()
        self.restores = True  # stashed cells go back (False: llama.cpp could not put them back)

    def forget(self, slot: int, start: int) -> None:
        assert 0 <= start < len(self.cells[slot]), "forgetting nothing"
        del self.cells[slot][start:]
        del self.tokens[slot][start:]

    def share(self, source: int, slot: int, length: int) -> None:
        assert not self.cells[slot], "sharing into a slot that holds cells"
        assert 0 < length <= len(self.cells[source])
        self.cells[slot] = self.cells[source][:length]
        self.tokens[slot] = self.tokens[source][:length]

    def stash(self, slot: int) -> object:
        return (list(self.cells[slot]), list(self.tokens[slot]))

    def unstash(self, slot: int, saved: object) -> bool:
        assert not self.cells[slot], "restoring into a slot that holds cells"
        if not self.restores:
            return False
        assert isinstance(saved, tuple)
        self.cells[slot], self.tokens[slot] = list(saved[0]), list(saved[1])
        return True

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


def test_the_probe_takes_a_step_of_its_own_when_nothing_else_runs_or_past_its_turns() -> None:
    s, cache = scheduler()
    s.submit(seq("chat", [1, 2, 3], max_new=50))
    run_step(s, cache)
    probe = seq("probe", [4, 5], max_new=1, priority=9)
    probe.alone = True
    s.submit(probe)
    steps = [[e.seq.key for e in run_step(s, cache)] for _ in range(MAX_PASSED + 1)]
    assert steps == [["chat"]] * MAX_PASSED + [["probe"]]
    assert "probe" not in s.running  # (its one token)
    s.remove("chat")
    s.submit(probe := seq("probe", [8, 9, 10], max_new=1, priority=9))
    probe.alone = True
    assert [(e.seq.key, e.tokens) for e in run_step(s, cache)] == [("probe", (8, 9, 10))]


class Batching(RuleBasedStateMachine):
    """Any interleaving, with prompts from a tiny vocabulary so that prefixes are shared."""

    def __init__(self) -> None:
        super().__init__()
        self.slots, self.cells, self.step_tokens = 4, 96, 24
        self.s, self.cache = scheduler(self.slots, self.step_tokens, self.cells)
        self.s.keep = 30  # (kept cells: less than the cache holds)
        self.keys = itertools.count()
        self.tokens_fed: dict[str, int] = {}
        # The free slots below a running sequence's at the last step, and in how many steps
        # in a row they were the same.
        self.holes: tuple[frozenset[int], int] = (frozenset(), 0)
        # Each sequence's prompt and the tokens it sampled: what its cells must come to hold.
        self.history: dict[str, list[int]] = {}

    @initialize(streams=st.booleans(), restores=st.booleans())
    def layout(self, streams: bool, restores: bool) -> None:
        """A pool, its kept cells bounded; or a stream a slot: the lowest free slot first,
        kept cells unbounded (they cost no other slot). A suspended sequence that gives up its
        slot has its cells put back when resumed, or (llama.cpp could not) computes them
        again."""
        self.cache.restores = restores
        self.s.lowest = streams
        if streams:
            self.s.keep = 0

    def reserved(self) -> int:
        return sum(q.reservation for q in [*self.s.running.values(), *self.s.waiting])

    def free(self) -> set[int]:
        pinned = [q for q in self.s.suspended.values() if q.slot >= 0]
        return set(range(self.slots)) - {q.slot for q in [*self.s.running.values(), *pinned]}

    @rule(
        prompt=st.one_of(
            st.lists(st.integers(1, 3), min_size=1, max_size=8),
            st.lists(st.integers(1, 3), min_size=20, max_size=40),
        ),
        max_new=st.integers(1, 12),
        priority=st.integers(0, 2),
        probe=st.integers(0, 4),
    )
    def submit(self, prompt: list[int], max_new: int, priority: int, probe: int) -> None:
        # What admission guarantees: a slot and the job's whole reservation. (And the worker:
        # one health probe at a time, stepped alone.)
        new = seq(f"q{next(self.keys)}", prompt, max_new, priority)
        here = [*self.s.running.values(), *self.s.suspended.values(), *self.s.waiting]
        new.alone = probe == 0 and not any(q.alone for q in here)
        if len(self.s.running) + len(self.s.waiting) >= self.slots:
            return
        if self.reserved() + new.reservation > self.cells:
            return
        free = self.free()
        self.s.submit(new)
        self.history[new.key] = list(prompt)
        if self.s.lowest and free:  # (the probe the highest: no job's slot lies above it)
            assert new.slot == (max(free) if new.alone else min(free))
        if new.slot >= 0:
            # The cells it starts from hold its own prompt's first tokens.
            assert self.cache.tokens[new.slot] == list(new.prompt[: new.reused])
            assert new.reused < len(new.prompt)

    @precondition(lambda self: self.s.running)
    @rule(token=st.integers(1, 3), stop=st.booleans())
    def step(self, token: int, stop: bool) -> None:
        running = [q for q in self.s.running.values() if not q.alone]
        alone = [q for q in self.s.running.values() if q.alone and (q.prefilling or q.pending >= 0)]
        passed = {q.key: q.passed for q in self.s.running.values()}
        entries = self.s.plan()
        assert entries, "sequences are running but the step is empty"
        if entries[0].seq.alone:  # a step of its own: when no other could run, or its turn
            (entry,) = entries
            q = entry.seq
            assert entry.sample
            assert entry.start == len(self.s.held[q.slot])
            if q.prefilling:  # (its whole prompt, or what is left of it)
                assert entry.start + len(entry.tokens) == len(q.prompt)
            else:
                assert entry.tokens == (q.pending,)
            others = [q for q in running if q.prefilling or q.pending >= 0]
            assert not others or passed[entry.seq.key] >= MAX_PASSED
        else:
            self.shared_step(entries, running, passed)
            for q in alone:
                assert q.passed == passed[q.key] + 1 <= MAX_PASSED
        if self.s.lowest:  # (a hole splits a step in passes: the last of a burst move down)
            top = max((q.slot for q in self.s.running.values() if not q.alone), default=-1)
            holes = frozenset(self.free() & set(range(top)))
            last, steps = self.holes
            self.holes = (holes, steps + 1 if holes and holes == last else int(bool(holes)))
            assert self.holes[1] < SETTLE, "a hole below a running slot stayed"
        self.advance(entries, token, stop)

    def shared_step(
        self, entries: list[Entry], running: list[Sequence], passed: dict[str, int]
    ) -> None:
        pending = [q for q in running if q.prefilling]
        if self.s.lowest:  # (llama.cpp runs consecutive streams in one pass)
            assert [e.seq.slot for e in entries] == sorted(e.seq.slot for e in entries)
        decodes = [e for e in entries if not e.seq.prefilling]
        assert sorted(e.seq.key for e in decodes) == sorted(
            q.key for q in running if q.pending >= 0
        )
        prefills = [e for e in entries if e.seq.prefilling]
        # With a stream a slot, a prompt whose slot lies between two generating ones is in
        # every step (a bridge: one token, at least), so that no step splits in two passes.
        generating = [q.slot for q in running if q.pending >= 0]
        between = [
            q
            for q in pending
            if self.s.lowest and min(generating, default=0) < q.slot < max(generating, default=0)
        ]
        bridged = [q for q in between if len(q.prompt) - q.fed > 1]
        bridges = [e for e in prefills if e.seq in bridged and len(e.tokens) == 1]
        stepped = {e.seq.key for e in prefills}
        assert all(q.key in stepped for q in bridged), "a step split in two passes"
        full = max(self.step_tokens - len(decodes) - len(bridged), MIN_PREFILL)
        assert sum(len(e.tokens) for e in entries) <= len(decodes) + len(bridged) + full
        if pending:
            assert prefills, "prompts wait, nothing generates, and none was fed"
            knee = min(self.s.knee, full)
            for e in prefills:
                ends = e.start + len(e.tokens) == len(e.seq.prompt)
                chat = e.seq.priority == 0  # (a chat's prompt takes any chunk)
                late = passed[e.seq.key] >= MAX_PASSED
                assert ends or len(e.tokens) >= knee or chat or late or e in bridges

    def advance(self, entries: list[Entry], token: int, stop: bool) -> None:
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
                assert not (q.alone and self.cache.cells[q.slot]), "a probe left cells behind"
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
        assert not self.s.keep or self.s.kept <= self.s.keep
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
    from governor.runners.llama.batching import _common

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
    from governor.runners.llama.worker import Text

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


def test_several_short_prompts_go_in_one_step_interactive_first_and_shortest_first() -> None:
    """Nothing with an objective generating: one step takes every prompt that fits, the
    shortest first, chats before heavier prompts (and alone: their first tokens wait on none);
    a prompt that would get less than the knee waits."""
    s, cache = budgeted(costs(2, 3), slots=8, step_tokens=100)
    s.knee = 90
    s.submit(Sequence("rewrite", tuple(range(1000, 1200)), 4, priority=1))
    s.submit(Sequence("long chat", tuple(range(100, 150)), 4))
    s.submit(Sequence("heavy", tuple(range(300, 310)), 4, priority=1))
    s.submit(Sequence("short chat", tuple(range(200, 220)), 4))
    s.submit(Sequence("shortest chat", tuple(range(400, 410)), 4))
    entries = step_and_sample(s, cache)
    assert [(e.seq.key, len(e.tokens), e.sample) for e in entries] == [
        ("shortest chat", 10, True),
        ("short chat", 20, True),
        ("long chat", 50, True),
    ]
    # The chats' tokens, then "heavy" whole; 87 tokens left would not end the rewrite and
    # are below the knee: it waits.
    entries = step_and_sample(s, cache)
    prompts = [(e.seq.key, len(e.tokens)) for e in entries if e.start < len(e.seq.prompt)]
    assert prompts == [("heavy", 10)]
    assert s.running["rewrite"].passed == 2


@given(
    step_ms=st.floats(0.5, 5),
    token_ms=st.floats(0.05, 2),
    streams=st.integers(0, 6),
    ahead=st.integers(0, 30),
    prompts=st.lists(st.integers(1, 120), min_size=2, max_size=6),
    priority=st.integers(0, 2),
    lowest=st.booleans(),
)
@settings(max_examples=200, deadline=None)
def test_prompts_that_wait_together_go_in_one_step_where_the_streams_slack_allows(
    step_ms: float,
    token_ms: float,
    streams: int,
    ahead: int,
    prompts: list[int],
    priority: int,
    lowest: bool,
) -> None:
    """Prompts of one lane that reach the worker together (a wave: jobs that ended together
    replaced at once) are fed together: where the step that takes them all whole beside the
    generating chats fits the time those chats have banked (each ``ahead`` tokens ahead of its
    TPOT objective) and the step's tokens, one step feeds every one of them whole and samples
    each one's first token."""
    s, cache = budgeted(costs(step_ms, token_ms), slots=16, step_tokens=512)
    s.lowest = lowest
    now = 100.0
    for i in range(streams):
        q = generating(s, cache, f"g{i}", tpot_s=0.1, gap_s=0.5, ttft_s=1.0)
        q.generated = 40
        q.first_at = now - MARGIN * 0.1 * (q.generated - ahead)
        q.last_at = now - 0.01
    tpot, ttft, gap = LANE_LIMITS[priority]
    for i, length in enumerate(prompts):
        prompt = tuple(range(10_000 * (i + 1), 10_000 * (i + 1) + length))
        s.submit(Sequence(f"p{i}", prompt, 4, priority, tpot_s=tpot, ttft_s=ttft, gap_s=gap))
    decodes = [
        Entry(q, (q.pending,), len(s.held[q.slot]), True)
        for q in s.running.values()
        if q.pending >= 0
    ]
    waiting = [q for q in s.running.values() if q.prefilling]
    whole = [Entry(q, q.prompt, 0, True) for q in waiting]
    bound = s.bound(decodes, now)
    fits = sum(prompts) <= 512 - len(decodes) and (
        bound is None or s.cost(decodes + whole) <= bound
    )
    entries = s.plan(now)
    fed = {e.seq.key: len(e.tokens) for e in entries if e.seq.prefilling}
    if fits:
        assert fed == {q.key: len(q.prompt) for q in waiting}
        assert all(e.sample for e in entries if e.seq.key in fed)
    else:
        assert sum(fed.values()) <= 512 - len(decodes)


@pytest.mark.parametrize("streams", [True, False])
def test_a_prompt_between_generating_streams_is_fed_a_token_a_step_that_bridges_them(
    streams: bool,
) -> None:
    """With a stream a slot, a prompt waiting for time to bank (on its chat's pace, a chunk of
    the knee would not fit) but lying between two generating slots gets its next token in
    the step, so that llama.cpp runs the step in one pass; with one pool, or above the
    generating slots, it waits."""
    s, cache = budgeted(costs(2, 3), slots=4, step_tokens=512)
    s.lowest = streams
    first = generating(s, cache, "first", tpot_s=0.1, gap_s=0.5, ttft_s=1.0)
    s.submit(Sequence("rewrite", tuple(range(1000, 1400)), 4, priority=1))
    last = generating(s, cache, "last", tpot_s=0.1, gap_s=0.5, ttft_s=1.0)
    s.submit(Sequence("above", tuple(range(2000, 2400)), 4, priority=1))
    first.first_at, first.generated = 0.0, 10  # on its pace at 0.9 s: no chunk of 64 fits
    rewrite, above = s.running["rewrite"], s.running["above"]
    assert (first.slot, rewrite.slot, last.slot, above.slot) == (0, 1, 2, 3)
    entries = s.plan(0.9)
    prompts = [(e.seq.key, e.tokens, e.start, e.sample) for e in entries if e.seq.prefilling]
    assert prompts == ([("rewrite", (1000,), 0, False)] if streams else [])
    if streams:
        assert [e.seq.slot for e in entries] == [0, 1, 2]
        cache.decode(entries)
        s.advance(entries)
        assert rewrite.fed == 1  # the bridge fed the prompt on
        assert rewrite.passed == 1  # (not a turn: the prompt is still passed over)


def test_with_a_stream_a_slot_the_last_of_a_burst_move_down_into_a_hole_that_stays() -> None:
    """A hole that a job fills at once moves nothing. The sequence in slot 1 ends and no job
    comes for its slot: after ``SETTLE`` steps with the hole, the topmost sequence moves into
    it, its cells copied there, and goes on where it was, on consecutive slots again."""
    s, cache = scheduler(slots=4, step_tokens=64)
    s.lowest = True
    for key, prompt in (("a", [1, 2]), ("b", [3, 4, 5]), ("c", [6, 7, 8, 9])):
        s.submit(seq(key, prompt, max_new=40))
    c = s.running["c"]
    run_step(s, cache)
    s.remove("b")
    s.submit(seq("d", [5, 5], max_new=40))  # (takes slot 1 at once)
    for _ in range(SETTLE + 1):
        run_step(s, cache)
    assert c.slot == 2
    s.remove("d")
    slots = [[e.seq.slot for e in run_step(s, cache)] for _ in range(SETTLE + 1)]
    assert slots == [[0, 2]] * (SETTLE - 1) + [[0, 1]] * 2
    assert c.slot == 1
    assert cache.tokens[1] == [6, 7, 8, 9] + [7] * 2 * (SETTLE + 1) == s.held[1]
    assert cache.tokens[2] == [] == s.held[2]


def test_a_chunk_below_the_knee_waits_while_the_chats_bank_the_time() -> None:
    """2 ms a step, 3 ms a token: a chat 10 tokens ahead of its 90 ms pace has 900 ms in hand,
    capped at its gap; one a token's share ahead with its last token to come, 90 ms. A long
    prompt beside it goes in chunks that fill the bound, never below the knee: (90 - 2 - 3) /
    3 = 28 tokens would do, so the step is the chat's token alone. With more tokens to come,
    the time they will bank is in hand too, at the slowest pace to come (a step of every slot's
    token and one prompt token, 17 ms: 73 ms each); with none in hand, the step is the decodes
    alone."""
    s, cache = budgeted(costs(2, 3), slots=4, step_tokens=512)
    chat = generating(s, cache, "chat", tpot_s=0.1, gap_s=0.5, ttft_s=1.0)
    chat.first_at, chat.generated, chat.max_new_tokens = 0.0, 10, 11
    s.submit(Sequence("rewrite", tuple(range(1000, 2000)), 4, priority=1))

    def fed(now: float) -> int:
        return sum(len(e.tokens) for e in s.plan(now) if e.seq.key == "rewrite")

    assert fed(0.81) == 0  # a token's share ahead: 28 tokens would fit, below the knee (64)
    assert s.running["rewrite"].passed == 1
    assert fed(0.69) == 68  # 210 ms in hand: (210 - 5) / 3
    assert s.running["rewrite"].passed == 0
    assert fed(0.0) == 148  # 900 ms in hand, capped at the gap: (450 - 5) / 3
    chat.gap_s = 0.0
    assert fed(0.0) == 298  # no gap: the TTFT objective caps it, (900 - 5) / 3
    chat.gap_s = 0.5
    s.running["rewrite"].passed = MAX_PASSED  # passed over too long: any chunk goes
    assert fed(0.81) == 28
    s.running["rewrite"].passed = MAX_PASSED
    assert fed(0.9) == PREFILL_FLOOR  # on its pace, nothing in hand: the floor, whatever
    s.running["rewrite"].passed = 0
    chat.max_new_tokens = 14  # on its pace, three tokens to come: 219 ms
    assert fed(0.9) == 71  # (219 - 5) / 3
    chat.max_new_tokens = 1000  # more than its gap
    assert fed(0.9) == 148
    chat.expected = 14  # but expected to stop at 14 (the daemon's learnt share): as above
    assert fed(0.9) == 71


def test_a_chats_first_token_waits_on_no_heavy_prompt() -> None:
    """Heavy streams generate, far ahead of their objectives: a step may take the full batch,
    a rewrite's prompt fills it. A chat's prompt goes first, alone: the rewrite's tokens would
    delay its first token; once the rewrite is past its turns, it shares the chat's step, after
    the chat's prompt."""
    s, cache = budgeted(costs(2, 3), slots=6, step_tokens=512)
    for i in range(2):
        heavy = generating(s, cache, f"heavy{i}", tpot_s=1.0, ttft_s=15.0, priority=1)
        heavy.first_at, heavy.generated = 0.0, 1000
    s.submit(Sequence("rewrite", tuple(range(1000, 3000)), 4, priority=1))
    entries = s.plan(1.0)
    assert sum(len(e.tokens) for e in entries if e.seq.key == "rewrite") == 510  # the batch
    s.submit(Sequence("chat", tuple(range(100, 150)), 4, gap_s=0.5))
    entries = s.plan(1.0)
    assert [(e.seq.key, len(e.tokens)) for e in entries] == [("chat", 50)]  # (heavies wait)
    s.running["rewrite"].passed = MAX_PASSED  # past its turns: the rest of the batch
    entries = s.plan(1.0)
    prefill = [(e.seq.key, len(e.tokens)) for e in entries if e.seq.prefilling]
    assert prefill == [("chat", 50), ("rewrite", 460)]
    # Nothing generating: the same.
    for i in range(2):
        s.remove(f"heavy{i}")
    assert [(e.seq.key, len(e.tokens)) for e in s.plan(1.0)] == [("chat", 50)]


def test_a_chats_prompt_goes_before_heavy_prompts_past_their_turns_in_any_chunk() -> None:
    """Eight slots (2 ms a step, 3.5 ms a token): two chats generating on their pace, heavy
    prompts pending, each passed over in turn until it is past its turns. A chat's prompt of
    100 tokens goes first at every step, in the chunks the chats' pace leaves (below the knee:
    a chat's first token is worth more than a chunk's efficiency), so it is whole within a few
    steps; a heavy prompt past its turns takes what the chat's leaves. (Before, each heavy
    prompt past its turns went first in turn and the chat's prompt waited for the knee: on 8
    slots past capacity its first token came 0.7 to 3.8 s after its slot.)"""
    s, cache = budgeted(costs(2, 3.5), slots=8, step_tokens=256)
    now = 10.0
    for i in range(2):
        chat = generating(s, cache, f"chat{i}", tpot_s=0.1, gap_s=0.5, ttft_s=1.0)
        chat.first_at, chat.last_at, chat.generated = now, now, 1
    for i in range(4):
        s.submit(Sequence(f"rewrite{i}", tuple(range(1000 * i, 1000 * i + 400)), 4, priority=1))
        s.running[f"rewrite{i}"].passed = MAX_PASSED - i  # one past its turns, the rest soon
    s.submit(Sequence("new", tuple(range(50_000, 50_100)), 4, tpot_s=0.1, ttft_s=1.0, gap_s=0.5))
    new = s.running["new"]
    steps = 0
    while new.prefilling:
        late = {q.key for q in s.running.values() if q.priority and q.passed >= MAX_PASSED}
        entries = s.plan(now)
        fed = [e.seq.key for e in entries if e.seq.prefilling]
        assert fed[0] == "new", fed  # (the chat's prompt first, whatever is past its turns)
        assert set(fed[1:]) <= late  # (and only what is past its turns beside it)
        now += s.cost(entries)
        cache.decode(entries)
        s.advance(entries)
        for entry in entries:
            if entry.sample and not entry.seq.prefilling:
                entry.seq.generated += 1
                entry.seq.last_at = now
                entry.seq.pending = 7
        steps += 1
    assert steps <= 5
    assert now - 10.0 < 0.45


def test_a_heavy_prompt_progresses_beside_a_stream_of_chats_with_tight_objectives() -> None:
    """Chats whose objective no step can meet, and a chat prompt pending at every step: the
    rewrite's prompt still progresses (the floor, and its turn after MAX_PASSED steps)."""
    s, cache = budgeted(costs(5, 3), slots=10, step_tokens=64)
    for i in range(4):
        generating(s, cache, f"chat{i}", tpot_s=0.001, gap_s=0.002)
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


def test_the_step_costs_learn_how_far_each_size_of_step_runs_over() -> None:
    """Steps of 20 and of 300 tokens run 0 % to 30 % over the machine's costs, steps of a token
    0 % to 20 % under, all sizes in turn: about nine steps in ten of every size end within the
    time planned for them (:meth:`StepCosts.predict_high`, the fit times the size's spread),
    where about half the long ones end within the fit alone; a spread never shrinks a
    step, and a size never seen takes the largest spread seen."""
    truth = {1: (0.8, 1.0), 20: (1.0, 1.3), 300: (1.0, 1.3)}
    learnt = StepCosts()
    rng = random.Random(5)
    within = {tokens: [0, 0, 0] for tokens in truth}  # within the plan, the fit; of all
    for i in range(1200):
        tokens = rng.choice(list(truth))
        seconds = (0.002 + 0.003 * tokens) * rng.uniform(*truth[tokens])
        if i >= 300:
            within[tokens][0] += seconds <= learnt.predict_high(tokens, 1, 100)
            within[tokens][1] += seconds <= learnt.predict(tokens, 1, 100)
            within[tokens][2] += 1
        learnt.observe(tokens, 1, 100, seconds)
    for tokens, (plan, fit, steps) in within.items():
        assert plan >= 0.8 * steps, (tokens, within)
        if tokens > 1:
            assert fit <= 0.65 * steps, (tokens, within)
    assert min(learnt.spreads) >= 1.0
    assert learnt.spreads[_bin(8)] == max(learnt.spreads)


def test_short_chats_keep_their_objective_when_long_steps_run_over_their_prediction() -> None:
    """Two slots, a rewrite's long prompt fed beside chats of 3 to 8 tokens, on a machine whose
    steps of 16 tokens or more run 0 % to 30 % over its costs (and shorter ones under), the
    costs learnt online as the worker learns them: a chat that banked time on short steps spends
    it on a chunk of the prompt, and a chunk that runs over lands on its mean when it ends right
    after. Planned at the fit alone, 1 % to 2 % of the chats miss their TPOT objective (the
    margin covers a tenth: the 99th percentile is 101 to 105 ms over 8 seeds); planned at the
    spread, the 99th percentile is within it (91 to 94 ms)."""
    rng = random.Random(11)
    s, cache = budgeted(StepCosts((0.002, 0.003, 0.0, 0.0)), slots=2, step_tokens=512)
    now = 0.0
    times: dict[str, list[float]] = {}
    keys = itertools.count()

    def submit(priority: int, length: int, max_new: int) -> None:
        prompt = tuple(rng.randrange(1, 30_000) for _ in range(length))
        tpot, ttft, gap = LANE_LIMITS[priority]
        key = f"{priority}-{next(keys)}"
        s.submit(Sequence(key, prompt, max_new, priority, tpot_s=tpot, ttft_s=ttft, gap_s=gap))

    for _ in range(10_000):
        lanes = {q.priority for q in s.running.values()}
        if 0 not in lanes and rng.random() < 0.3:
            submit(0, 20, rng.randint(3, 8))
        if 1 not in lanes:
            submit(1, 600, 8)
        entries = s.plan(now)
        tokens = sum(len(e.tokens) for e in entries)
        over = rng.uniform(1.0, 1.3) if tokens >= 16 else rng.uniform(0.8, 1.0)
        took = (0.002 + 0.003 * tokens) * over
        s.costs.observe(tokens, sum(e.sample for e in entries), s.occupied + tokens, took)
        cache.decode(entries)
        s.advance(entries)
        now += took
        for entry in entries:
            if entry.sample:
                q = entry.seq
                q.generated += 1
                q.first_at = now if q.first_at is None else q.first_at
                q.last_at = now
                times.setdefault(q.key, []).append(now)
                if q.generated >= q.max_new_tokens:
                    s.remove(q.key)
                else:
                    q.pending = 7
    chats = sorted(
        (t[-1] - t[0]) / (len(t) - 1)
        for key, t in times.items()
        if key.startswith("0-") and len(t) > 1
    )
    assert len(chats) > 1000
    assert chats[len(chats) * 99 // 100] <= 0.1


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


LANE_LIMITS = {  # (tpot_s, ttft_s, gap_s) of the worker's jobs by priority, as admission sets
    0: (0.1, 1.0, 0.5),
    1: (1.0, 15.0, 0.0),
    2: (2.0, 60.0, 0.0),
}


@given(
    step_ms=st.floats(0.5, 5),
    token_ms=st.floats(0.05, 2),
    sample_ms=st.floats(0, 0.5),
    knee=st.integers(1, 128),
    step_tokens=st.integers(16, 512),
    streams=st.lists(
        st.tuples(
            st.sampled_from([0.05, 0.1, 0.3]),
            st.sampled_from([0.0, 0.2, 0.5]),
            st.sampled_from([0.0, 1.0, 15.0]),
            st.integers(0, 2),
            st.integers(2, 300),
        ),
        min_size=1,
        max_size=4,
    ),
    arrivals=st.lists(
        st.tuples(
            st.integers(0, 60),
            st.integers(1, 600),
            st.integers(0, 2),
        ),
        max_size=8,
    ),
)
@example(  # a heavy stream deferred for two chats' first tokens in a row, past its cap (fixed)
    step_ms=4.0,
    token_ms=0.8125,
    sample_ms=0.0,
    knee=1,
    step_tokens=67,
    streams=[(0.05, 0.2, 0.0, 1, 300)],
    arrivals=[(4, 1, 0), (4, 66, 0), (4, 128, 0)],
)
@settings(max_examples=200, deadline=None)
def test_every_stream_keeps_its_pace_and_gap_and_every_prompt_is_fed_in_chunks_past_the_knee(
    step_ms: float,
    token_ms: float,
    sample_ms: float,
    knee: int,
    step_tokens: int,
    streams: list[tuple[float, float, float, int, int]],
    arrivals: list[tuple[int, int, int]],
) -> None:
    """Steps run as predicted (a step never costs more than 5 + 2 x 12 tokens of decodes, less
    than any stream's share: the plan can always meet the objectives), prompts of any lane and
    length arriving at any step: every stream ends with its mean time per output token since
    its first within its TPOT objective (less the margin), however late that first came (a
    chat past capacity keeps its pace, see the module docstring), and no gap between two
    tokens of any stream is longer than its cap; every step holds every generating sequence's
    token (but for a less urgent stream that gives its place to a chat's first token); every
    prompt is fed to its end, each chunk at least the knee unless it ends the prompt or the
    prompt was passed over ``MAX_PASSED`` times."""
    s, cache = budgeted(costs(step_ms, token_ms, sample_ms), slots=16, step_tokens=step_tokens)
    s.knee = knee
    now = 0.0
    limits: dict[str, tuple[float, float, float]] = {}  # each one's TPOT, TTFT and gap
    for i, (tpot, gap, ttft, priority, length) in enumerate(streams):
        q = generating(s, cache, f"g{i}", tpot_s=tpot, gap_s=gap, ttft_s=ttft)
        q.priority, q.first_at, q.last_at, q.generated = priority, now, now, 1
        q.max_new_tokens = length
        limits[q.key] = (tpot, ttft, gap)
    times: dict[str, list[float]] = {q.key: [now] for q in s.running.values()}
    due = sorted(arrivals)
    for step in range(5000):
        while due and due[0][0] <= step:
            _, length, priority = due.pop(0)
            tpot, ttft, gap = LANE_LIMITS[priority]
            key = f"p{step}-{len(due)}"
            prompt = tuple(range(1, length + 1))
            q = Sequence(key, prompt, 4, priority, tpot_s=tpot, ttft_s=ttft, gap_s=gap)
            s.submit(q)
            limits[key] = (tpot, ttft, gap)
        if not due and not s.running:
            break
        generating_now = {q.key for q in s.running.values() if q.pending >= 0}
        passed = {q.key: q.passed for q in s.running.values()}
        full = max(step_tokens - len(generating_now), MIN_PREFILL)
        entries = s.plan(now)
        stepped = {e.seq.key for e in entries if not e.seq.prefilling}
        left_out = generating_now - stepped
        if left_out:
            assert any(
                e.sample and e.seq.priority == 0 and e.start < len(e.seq.prompt) for e in entries
            ), "a generating sequence left out of a step that samples no chat's first token"
            assert all(s.running[key].priority > 0 for key in left_out)
        for e in entries:
            if e.start < len(e.seq.prompt):  # a prompt's chunk
                ends = e.start + len(e.tokens) == len(e.seq.prompt)
                chat, late = e.seq.priority == 0, passed[e.seq.key] >= MAX_PASSED
                assert ends or len(e.tokens) >= min(knee, full) or chat or late
        now += s.cost(entries)  # the step runs as predicted
        cache.decode(entries)
        s.advance(entries)
        for entry in entries:
            if not entry.sample:
                continue
            q = entry.seq
            q.generated += 1
            q.last_at = now  # (as the worker sets them)
            if q.first_at is None:
                q.first_at = now
            times.setdefault(q.key, []).append(now)
            if q.generated >= q.max_new_tokens:
                s.remove(q.key)
            else:
                q.pending = 7
    assert not due
    assert not s.running, "a prompt was never fed whole, or a stream never ended"
    for key, t in times.items():
        if len(t) < 2:
            continue
        tpot, ttft, gap = limits[key]
        per = MARGIN * tpot
        assert (t[-1] - t[0]) / (len(t) - 1) <= per * (1 + 1e-9), key
        cap = max(per, MARGIN * (gap or ttft) or math.inf)
        assert max(b - a for a, b in itertools.pairwise(t)) <= cap * (1 + 1e-9), key


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


@pytest.mark.parametrize("restores", [True, False], ids=["cells-put-back", "computed-again"])
def test_a_suspended_sequence_the_cache_cannot_keep_goes_on_from_its_stashed_cells(
    restores: bool,
) -> None:
    """Its slot given up, its cells are copied out of the cache and put back in the slot it
    gets when resumed: it feeds only the token it sampled last. Where llama.cpp cannot put
    them back, it computes again what it held."""
    s, cache = scheduler(slots=2, cells=40, step_tokens=64)
    cache.restores = restores
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
    # Its cells put back, or whatever of it the cache still kept is reused and the rest fed
    # again; the step that feeds the token it sampled last samples its next one.
    assert entry.seq.key == "heavy"
    assert entry.sample
    assert entry.tokens[-1] == 6
    assert (entry.tokens == (6,)) == restores
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


def test_a_step_feeding_a_rewrite_is_preemptible_by_a_more_urgent_run_only() -> None:
    s, _ = scheduler(slots=4, step_tokens=32)
    s.submit(seq("rewrite", list(range(1000, 1200)), priority=2))
    entries = s.plan()
    above = preemptible_above(entries)
    assert above == 2
    assert preempts(0, above)  # a chat
    assert preempts(1, above)  # a heavy job
    assert not preempts(2, above)  # its own lane
    assert not preempts(9, above)  # the health probe, least urgent
    s.submit(seq("chat", list(range(10, 30))))
    assert preemptible_above(s.plan()) == -1  # (a chat's prompt in the step)


def test_a_decode_step_is_not_preemptible() -> None:
    s, cache = scheduler(slots=2, step_tokens=64)
    s.submit(seq("heavy", list(range(100, 120)), max_new=8, priority=1))
    run_step(s, cache)  # the whole prompt: it generates from now on
    entries = s.plan()
    assert entries
    assert not any(e.seq.prefilling for e in entries)
    assert preemptible_above(entries) == -1


@settings(max_examples=60, deadline=None)
@given(preempted=st.lists(st.booleans(), min_size=1, max_size=40))
def test_a_prompt_is_preempted_at_most_max_passed_steps_in_a_row(preempted: list[bool]) -> None:
    """Whatever runs arrive (each step preempted or not, as ``preempted`` says, when it may
    be), no prompt loses more than ``MAX_PASSED`` steps in a row, and each step that ran fed it."""
    s, cache = scheduler(slots=2, step_tokens=16)
    rewrite = seq("rewrite", list(range(1000, 1400)), priority=1)
    s.submit(rewrite)
    in_a_row = 0
    for wanted in preempted:
        entries = s.plan()
        fed = rewrite.fed
        above = preemptible_above(entries)
        lost = wanted and above >= 0 and preempts(0, above)
        after_step(entries, preempted=lost)
        if lost:
            in_a_row += 1
            assert rewrite.fed == fed
            continue
        assert in_a_row <= MAX_PASSED
        in_a_row = 0
        cache.decode(entries)
        s.advance(entries)
        assert rewrite.fed > fed or not rewrite.prefilling
        assert rewrite.preempted == 0
    assert in_a_row <= MAX_PASSED
