"""The batched worker's scheduler, against a model of llama.cpp's KV cache.

The model holds each slot's cells as ids (a shared prefix is the same ids in two slots), so
the stateful test checks what llama.cpp needs for any interleaving of submissions, steps,
samples, cancels and ends: the cells in use never exceed the cache, every token goes in at the
next position of its sequence, the cells hold each prompt's own tokens, and every sequence
advances.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from governor.runners.batching import MAX_PASSED, MIN_PREFILL, Entry, Scheduler, Sequence


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
            else:
                q.pending = token

    @precondition(lambda self: self.s.running or self.s.waiting)
    @rule(data=st.data(), keep=st.booleans())
    def cancel(self, data: st.DataObject, keep: bool) -> None:
        keys = sorted([*self.s.running, *(q.key for q in self.s.waiting)])
        key = data.draw(st.sampled_from(keys))
        assert self.s.remove(key, keep=keep) is not None
        assert self.s.remove(key) is None

    @invariant()
    def the_cache_model_and_the_scheduler_agree(self) -> None:
        assert [list(t) for t in self.s.held] == self.cache.tokens
        for q in self.s.running.values():
            assert self.cache.tokens[q.slot][: q.fed] == list(q.prompt[: q.fed])
        slots = [q.slot for q in self.s.running.values()]
        assert len(set(slots)) == len(slots) <= self.slots
        assert self.s.used == sum(len(self.cache.cells[q.slot]) for q in self.s.running.values())
        # Kept cells never crowd out what the running sequences may still need.
        assert self.s.kept + sum(q.reservation for q in self.s.running.values()) <= self.cells
        assert not self.s.waiting or len(self.s.running) == self.slots


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
