"""The batched worker's decision: which tokens go into the next ``llama_decode`` step.

Pure (no llama.cpp, no clock, no IO); :mod:`.llama_worker` applies it. One model context holds
``slots`` sequences over one KV cache, and each step is one batch:

1. **Every generating sequence's next token** (the one it sampled last step, fed back), so a
   running stream advances at every step whatever else arrives.
2. **Prompt tokens of sequences still being prefilled**, up to ``step_tokens`` for the whole
   step (chunked prefill). Only the most urgent priority with a prompt pending gets prefill in a
   step (interactive prompts go before heavy ones: a chat's prompt never shares its step with a
   rewrite's), oldest first within it. A prompt passed over for ``MAX_PASSED`` steps in a row is
   taken anyway, so that a stream of chats cannot starve a rewrite for ever.

So a long prompt delays the running streams by at most one step of ``step_tokens`` tokens, and
a newly admitted interactive prompt waits at most for the step in progress.

A sequence takes one of the ``slots`` (a llama.cpp sequence id) when it is submitted, if one is
free, else when one frees, most urgent first. Admission upstream never sends more sequences
than there are slots; waiting is for the worker's own probe and for safety.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

MAX_PASSED = 8  # steps a pending prompt may be passed over for a more urgent one
MIN_PREFILL = 16  # prompt tokens a step takes, at least, even when decodes fill step_tokens


@dataclass(slots=True, eq=False)
class Sequence:
    """One job in the worker: its prompt, and how far it has got."""

    key: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    priority: int = 0  # 0 is the most urgent (the interactive lane)
    order: int = 0  # submission order, set by the scheduler
    slot: int = -1  # its llama.cpp sequence id, once it has one
    fed: int = 0  # prompt tokens in the cache
    cached: int = 0  # of which taken from another sequence's cells (a shared prefix)
    generated: int = 0  # tokens sampled
    pending: int = -1  # the token sampled last, fed at the next step (-1: none)
    passed: int = 0  # steps in a row its prompt was passed over

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)

    @property
    def cells(self) -> int:
        """KV cells it holds: its prompt's so far and every generated token fed back."""
        return self.fed + max(self.generated - (self.pending >= 0), 0)


@dataclass(frozen=True, slots=True)
class Entry:
    """Tokens of one sequence in a step, at positions ``start`` onwards."""

    seq: Sequence
    tokens: tuple[int, ...]
    start: int
    sample: bool  # a token is sampled from the last one's logits


@dataclass(slots=True)
class Scheduler:
    slots: int
    step_tokens: int
    running: dict[str, Sequence] = field(default_factory=dict)  # those with a slot
    waiting: list[Sequence] = field(default_factory=list)
    _free: list[int] = field(default_factory=list)
    _order: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.slots < 1 or self.step_tokens < 1:
            raise ValueError("slots and step_tokens must be at least 1")
        self._free = list(range(self.slots - 1, -1, -1))  # pop() gives slot 0 first

    def submit(self, seq: Sequence) -> None:
        if seq.key in self.running or any(w.key == seq.key for w in self.waiting):
            raise ValueError(f"sequence {seq.key!r} is already here")
        if not seq.prompt:
            raise ValueError("a sequence needs at least one prompt token")
        seq.order = next(self._order)
        self.waiting.append(seq)
        self._assign()

    def remove(self, key: str) -> Sequence | None:
        """Take a sequence out (finished or cancelled); its slot goes to the next waiting.

        Returns it (its ``slot`` still set, for the caller to clear its cells), or None when
        it is not here.
        """
        seq = self.running.pop(key, None)
        if seq is not None:
            self._free.append(seq.slot)
            self._assign()
            return seq
        for i, waiting in enumerate(self.waiting):
            if waiting.key == key:
                return self.waiting.pop(i)
        return None

    def _assign(self) -> None:
        while self._free and self.waiting:
            seq = min(self.waiting, key=_urgency)
            self.waiting.remove(seq)
            seq.slot = self._free.pop()
            self.running[seq.key] = seq

    @property
    def cells(self) -> int:
        return sum(seq.cells for seq in self.running.values())

    def plan(self) -> list[Entry]:
        """The next step's entries (empty when there is nothing to compute)."""
        entries = [
            Entry(seq, (seq.pending,), seq.cells, True)
            for seq in self.running.values()
            if seq.pending >= 0
        ]
        pending = sorted((s for s in self.running.values() if s.prefilling), key=_urgency)
        if not pending:
            return entries
        budget = max(self.step_tokens - len(entries), MIN_PREFILL)
        first = pending[0].priority
        for seq in pending:
            if budget <= 0 or (seq.priority != first and seq.passed < MAX_PASSED):
                seq.passed += 1
                continue
            seq.passed = 0
            take = min(budget, len(seq.prompt) - seq.fed)
            end = seq.fed + take
            entries.append(Entry(seq, seq.prompt[seq.fed : end], seq.fed, end == len(seq.prompt)))
            budget -= take
        return entries

    @staticmethod
    def advance(entries: list[Entry]) -> None:
        """The step ran: its tokens are in the cache. (Sampling sets ``pending`` after.)"""
        for entry in entries:
            seq = entry.seq
            if seq.prefilling:
                seq.fed += len(entry.tokens)
            else:
                seq.pending = -1


def _urgency(seq: Sequence) -> tuple[int, int]:
    return (seq.priority, seq.order)
