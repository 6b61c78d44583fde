"""The batched worker's decisions: which tokens go into the next ``llama_decode`` step, and which
cells of the KV cache a new sequence can reuse.

Pure (no llama.cpp, no clock, no IO); :mod:`.llama_worker` applies it, through the two cache
operations of :class:`Cache`. One model context holds ``slots`` sequences over one KV cache of
``cells`` cells, and each step is one batch:

1. **Every generating sequence's next token** (the one it sampled last step, fed back), so a
   running stream advances at every step whatever else arrives (stall-free batching); but in the
   step that ends an interactive prompt (samples a chat's first token), a less urgent stream
   ahead of its TPOT objective by more than a token's share gives up its place (its token
   comes a step later), so a chat that arrives beside heavy streams gets its first token about
   as soon as on an idle worker, and each heavy stream loses at most a step per chat.
2. **Prompt tokens of sequences still being prefilled** (chunked prefill), from as many
   prompts as the step's budget holds, taken in this order: interactive prompts, then heavy,
   then background ones, the shortest left first within each (so a step's fixed cost is shared
   by as many tokens as it may carry, and short prompts get their first tokens soonest). A
   prompt passed over for ``MAX_PASSED`` steps in a row is taken first of its priority, so that
   a stream of shorter prompts cannot starve it for ever; a more urgent one still goes before
   it (a chat's first token does not wait for a rewrite's turn: on 8 slots past capacity, with
   a heavy prompt past its turns at most steps, chats got their first tokens 0.7 to 3.8 s after
   their slots), and in a step with room for no prompt at all the oldest past its turns takes a
   token anyway.

**How many prompt tokens: the step budget.** A step is as long as its tokens make it, and every
generating sequence waits for the whole step for its next token, so the step's prompt tokens
are cut to fit the generating sequences' objectives. Each sequence may carry ``tpot_s``, its
time-per-output-token (TPOT) objective, ``ttft_s``, its time-to-first-token objective, and
``gap_s``, a cap on any single gap between two of its tokens (the worker gives interactive jobs
one). A TPOT objective is an average (the time from a stream's first token to its last, over
its tokens), so a stream ahead of it has time banked, and its tokens to come will bank more
wherever a step is shorter than the objective's pace. The bound of a step is the least, over
the generating sequences with an objective, of the time until each one's next token is due at
the objective's pace (``MARGIN * tpot_s`` a token since its first) plus what its tokens to come
will bank by its end (``expected``, the tokens it is expected to generate: the daemon's learnt
share of ``max_new_tokens``; each at that pace less a step of every slot's token and a prompt
token, at the step costs' mean), never less than the step of the decodes alone, nor more than
``MARGIN * gap_s`` (without a gap, ``MARGIN * ttft_s``: no running stream pauses longer than a
new one is promised to wait). So a chat that runs its expected length ends within its
objective, and its longest pause holds too, whether a prompt beside it went in a few long
steps or in many short ones; in few, the prompt's slot generates sooner. (Counting only the
time banked, prompts went in at the pace the chats banked it, 4 tokens a step beside 8 chats,
their slots idle meanwhile; docs/BENCHMARKS.md, "What the objectives cost".) A heavy or
background stream, whose objectives are loose, lets a step take the full batch; with no bound
(nothing generating, or nothing with an objective), a step takes up to ``step_tokens``. A
chat whose first token came late keeps its pace too: past capacity, on 2 slots, letting such chats' gaps grow to their TTFT objective cost
them 3.5 times their TPOT objective and held their slots longer, for fewer jobs done
(docs/BENCHMARKS.md, "Past capacity").

A step takes the largest budget of prompt tokens whose predicted step
(:class:`~.stepcost.StepCosts`, learnt online by the worker, at the high end of its error for
steps of that size: about nine steps in ten end within it) fits the bound, with two rules:

* **No chunk below the knee.** A prompt that does not end in the step is fed ``knee`` tokens at
  least (where a step's cost per prompt token stops falling: on a CPU, flash attention makes a
  chunk of 32 tokens cost half again as much a token as one of 64). Where the bound leaves less,
  the prompt waits and the step goes on with shorter prompts or the decodes alone, so that the
  streams bank the time for a full chunk at a later step. A prompt passed over for
  ``MAX_PASSED`` steps (the bound never grows enough: streams slower than their objective)
  takes any chunk, at least ``PREFILL_FLOOR`` tokens whatever the bound, so every prompt
  progresses. An interactive prompt takes any chunk the bound leaves at once: a chat's first
  token is worth more than a chunk's efficiency (beside other chats' pace, waiting to bank a
  full chunk made it wait most of its TTFT objective).
* **A chat's first token waits on no less urgent prompt.** A step that ends an interactive
  prompt carries no heavy or background prompt tokens (but those of a prompt passed over
  ``MAX_PASSED`` steps), so a chat that arrives beside long rewrites gets its first token about
  as soon as on an idle worker.

So a long prompt slows the running chats by at most the time they have banked or will bank,
and their gap, while it is fed, and a newly admitted interactive prompt waits at most for the
step in progress.

**Prefix reuse.** A slot keeps its cells when its sequence ends (the tokens they hold are
known). A new sequence starts from the longest prefix of its prompt that some slot holds: its
own slot's cells up to where they differ, or another slot's, shared (with a unified KV cache
llama.cpp shares such cells between sequences: a system prompt common to many chats is
computed once). Kept cells are only a cache: whenever the cells of the free slots and the
running sequences' reservations (each its prompt and ``max_new_tokens``, as admission reserved
them) would exceed ``cells``, the least recently used free slots are cleared, so a step never
lacks room. And they are not free: with one pool of cells for all sequences, every token of
every step attends over the span of cells in use (for a model as small as the embedded one,
attending over 2,000 cells costs about half what its weights do), so the free slots keep ``keep`` cells at most
(the worker's: one job's context, ``n_ctx``; llama-server keeps one prompt a slot, but in a
cache of its own that no other slot's tokens attend over).

**A stream a slot.** With a KV cache that gives each slot a stream of cells of its own (the
worker's ``slots`` layout, llama-server's: each token attends over its own sequence's cells
only), ``lowest`` is set: a sequence takes the lowest free slot (the health probe, stepped
alone, the highest: a job placed above it would run above a hole once the probe ends), so that
the running ones hold consecutive slots (llama.cpp runs a step in one pass for each run of
consecutive streams), a prefix another slot holds is copied into it (llama.cpp copies a
stream whole; the cells past the prefix are then cleared), and a step's entries come in slot
order. A sequence being prefilled whose slot lies between two generating ones, and whose
prompt gets no chunk in a step, is fed its next prompt token in it (a *bridge*, the one
exception to the knee): a slot left out would split the step into two passes over the
weights. For the same reason, a slot that stays free below a running sequence for ``SETTLE``
steps (no job came for it: the last of a burst) takes the topmost running sequence, its
stream copied down. Kept cells then cost no other slot anything (``keep`` 0).

**Forks.** A job's further choices (OpenAI's ``n``) are forked from its first sequence the step
its prompt is whole in the cache: each shares all the prompt's cells and samples its first
token from the same logits, so the prompt is computed and held once. Each still counts the
prompt in its reservation: clearing kept cells errs on the side of room.

A sequence takes a slot when it is submitted, if one is free, else when one frees, most urgent
first. Admission upstream never sends more sequences than there are slots; waiting is for the
worker's own probe and for safety.

**Suspension.** A suspended sequence (admission took its slot back for a chat) is not stepped:
it keeps its slot and its cells, counted beside the running reservations, for as long as the
cache has room for them. When it has not (a running sequence's reservation needs them), the
newest suspended sequence gives up its slot, its cells left behind as a free slot's, which a
later sequence may clear; they are also copied out of the cache (:meth:`Cache.stash`: host
memory, for as long as it is suspended). Resumed, a sequence that kept its slot goes on at its
next token; one that gave it up is placed again, as a new prompt made of the tokens it held and
the one it sampled last (:meth:`Scheduler.resume`): its copied cells are put back in the slot
it gets, so that it feeds only that last token (with a stream a slot, a chat that takes a
suspended job's slot would otherwise cost the job its whole context computed again); where
llama.cpp cannot put them back, the prefix it finds still cached is reused, the rest is
computed again as any prompt is (within the running chats' objectives). Either way the step
that feeds its last token samples its next one, as the step it missed would have. Either way it
takes up, before any sequence of its priority submitted after it, where it stopped: no token
is lost or repeated.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field
from typing import Protocol

from .stepcost import StepCosts

MAX_PASSED = 8  # steps a pending prompt may be passed over before it takes any chunk
MIN_PREFILL = 16  # prompt tokens a step takes, at least, even when decodes fill step_tokens
PREFILL_FLOOR = 1  # prompt tokens a step takes, at least, once a prompt is past its turns
KNEE = 64  # the fewest tokens of a prompt that does not end in a step (see the docstring)
SETTLE = 3  # steps a free slot stays below a running one before the topmost moves into it
MARGIN = 0.9  # steps are planned to this share of a TPOT objective (the step in ten that errs)


class Cache(Protocol):
    """The KV cache operations the scheduler decides (llama.cpp's ``llama_memory_seq_*``)."""

    def forget(self, slot: int, start: int) -> None:
        """Drop the slot's cells from position ``start`` on."""
        ...

    def share(self, source: int, slot: int, length: int) -> None:
        """Give ``slot`` (holding nothing) the source slot's cells at positions below
        ``length``."""
        ...

    def stash(self, slot: int) -> object:
        """The slot's cells, copied out of the cache (to be put back by :meth:`unstash`)."""
        ...

    def unstash(self, slot: int, saved: object) -> bool:
        """Put cells :meth:`stash` copied into ``slot`` (holding nothing); False if it could
        not (the slot then holds nothing)."""
        ...


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
    reused: int = 0  # of which were there already (a prefix kept or shared)
    generated: int = 0  # tokens sampled
    pending: int = -1  # the token sampled last, fed at the next step (-1: none)
    passed: int = 0  # steps in a row its prompt was passed over
    preempted: int = 0  # steps with its prompt in them preempted in a row (see the worker)
    tpot_s: float = 0.0  # its time-per-output-token objective (0: none)
    gap_s: float = 0.0  # the longest gap between two of its tokens (0: its TTFT objective)
    ttft_s: float = 0.0  # its time-to-first-token objective (0: none)
    expected: int = 0  # the tokens it is expected to generate (0: max_new_tokens)
    first_at: float | None = None  # when its first token was sampled (plan's clock)
    last_at: float | None = None  # when its latest token was sampled (plan's clock)
    output_in_prompt: int = 0  # tokens it generated that a resume put in its prompt
    # Its cells, copied out when it gave up its slot (suspended), and how many tokens they hold.
    stash: tuple[object, int] | None = None
    # Stepped in steps of its own, and its cells cleared when it ends (the health probe):
    # llama.cpp's numerics depend on a step's batch and, in a pool, on the cells a token goes
    # to, so a probe that shared a job's steps, or left cells among the job's, could change
    # the job's greedy text.
    alone: bool = False

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)

    @property
    def recomputing(self) -> bool:
        """It is feeding again, after a suspension that cost its cells, what it had."""
        return self.output_in_prompt > 0

    @property
    def reservation(self) -> int:
        """The cells it may come to hold, as admission reserved them."""
        return len(self.prompt) - self.output_in_prompt + self.max_new_tokens


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
    cells: int
    cache: Cache
    costs: StepCosts = field(default_factory=StepCosts)
    knee: int = KNEE
    keep: int = 0  # the most cells the free slots keep for reuse (0: as many as fit)
    lowest: bool = False  # a sequence takes the lowest free slot (a stream each: see above)
    running: dict[str, Sequence] = field(default_factory=dict)  # those with a slot
    waiting: list[Sequence] = field(default_factory=list)
    # Not stepped; each with its slot and cells while the cache allows (see the docstring).
    suspended: dict[str, Sequence] = field(default_factory=dict)
    held: list[list[int]] = field(default_factory=list)  # the tokens each slot's cells hold
    _free: dict[int, int] = field(default_factory=dict)  # free slot: when it was freed
    _order: itertools.count[int] = field(default_factory=itertools.count)
    _freed: itertools.count[int] = field(default_factory=itertools.count)
    _holed: int = 0  # consecutive plans with a free slot below a running one (``lowest``)

    def __post_init__(self) -> None:
        if min(self.slots, self.step_tokens, self.cells, self.knee) < 1:
            raise ValueError("slots, step_tokens, cells and knee must be at least 1")
        self.held = [[] for _ in range(self.slots)]
        self._free = {slot: next(self._freed) for slot in range(self.slots)}

    # Sequences in and out ----------------------------------------------------------------

    def _here(self, key: str) -> bool:
        return (
            key in self.running or key in self.suspended or any(w.key == key for w in self.waiting)
        )

    def submit(self, seq: Sequence) -> None:
        if self._here(seq.key):
            raise ValueError(f"sequence {seq.key!r} is already here")
        if not seq.prompt:
            raise ValueError("a sequence needs at least one prompt token")
        seq.order = next(self._order)
        self.waiting.append(seq)
        self._assign()

    def remove(self, key: str, *, keep: bool = True) -> Sequence | None:
        """Take a sequence out (finished or cancelled); its slot goes to the next waiting.

        Its cells stay, for a later prompt with the same beginning, unless ``keep`` is False
        (they may be wrong: a step that failed). Returns it, or None when it is not here.
        """
        seq = self.running.pop(key, None) or self.suspended.pop(key, None)
        if seq is not None:
            if seq.slot >= 0:
                if not keep or seq.alone:
                    self._truncate(seq.slot, 0)
                self._free[seq.slot] = next(self._freed)
            self._assign()
            return seq
        for i, waiting in enumerate(self.waiting):
            if waiting.key == key:
                return self.waiting.pop(i)
        return None

    def suspend(self, key: str) -> bool:
        """Stop stepping a sequence (running or waiting for a slot); False when it is not here
        or suspended already."""
        seq = self.running.pop(key, None)
        if seq is None:
            for i, waiting in enumerate(self.waiting):
                if waiting.key == key:
                    seq = self.waiting.pop(i)
                    break
            else:
                return False
        self.suspended[key] = seq
        self._evict()
        return True

    def resume(self, key: str) -> bool:
        """Step a suspended sequence again: at once where it kept its slot, else placed again
        to compute what it held (see the module docstring); False when it is not suspended."""
        seq = self.suspended.pop(key, None)
        if seq is None:
            return False
        if seq.slot >= 0:
            self.running[key] = seq
            self._evict()
        else:
            self.waiting.append(seq)
            self._assign()
        return True

    def fork(self, source: Sequence, seq: Sequence) -> bool:
        """Start ``seq``, another sequence of ``source``'s prompt, from ``source``'s cells the
        step after it fed the whole prompt: ``seq`` shares all of them and samples its first
        token from the same logits (one job's several choices). False when no slot is free
        (or ``source`` does not hold the prompt): then it is to be submitted, and feeds the
        prompt's last token itself."""
        length = len(seq.prompt)
        if not self._free or source.slot < 0 or self.held[source.slot][:length] != list(seq.prompt):
            return False
        if self._here(seq.key):
            raise ValueError(f"sequence {seq.key!r} is already here")
        slot = min(self._free, key=self._least_worth)
        self._copy(source.slot, slot, length)
        del self._free[slot]
        seq.order = next(self._order)
        seq.slot = slot
        seq.fed = seq.reused = length
        self.running[seq.key] = seq
        self._evict()
        return True

    def _assign(self) -> None:
        # (A suspended sequence's slot is the cells' to keep, not a running one's to deny.)
        pinned = self._pinned()
        while self.waiting and len(self._free) < len(self.waiting) and pinned:
            _drop(self, pinned.pop())
        while self._free and self.waiting:
            seq = min(self.waiting, key=_urgency)
            self.waiting.remove(seq)
            self._place(seq)
            self.running[seq.key] = seq
        self._evict()

    def _place(self, seq: Sequence) -> None:
        """The free slot to run ``seq`` in, and the prefix of its prompt already cached."""
        limit = len(seq.prompt) - 1  # (the last prompt token is fed, for its logits)
        own = (
            (max(self._free) if seq.alone else min(self._free))
            if self.lowest
            else max(self._free, key=lambda s: (_common(self.held[s], seq.prompt), -self._free[s]))
        )
        if seq.stash is not None and _unstash(self, seq, own):
            return
        kept = min(_common(self.held[own], seq.prompt), limit)
        source, shared = own, kept
        for slot, tokens in enumerate(self.held):
            if slot != own and (length := min(_common(tokens, seq.prompt), limit)) > shared:
                source, shared = slot, length
        if source == own:
            slot = own
            self._truncate(slot, kept)
        else:
            # Into the free slot least worth keeping: the least recently freed of those that
            # hold nothing of this prompt.
            slot = (
                own
                if self.lowest
                else min(
                    self._free,
                    key=lambda s: (_common(self.held[s], seq.prompt) > 0, self._free[s]),
                )
            )
            self._copy(source, slot, shared)
        del self._free[slot]
        seq.slot = slot
        seq.fed = len(self.held[slot])
        if not seq.recomputing:  # (what it found cached of the prompt it came with)
            seq.reused = seq.fed

    def _least_worth(self, slot: int) -> tuple[int, int]:
        """A fork's order of free slots: the lowest, or those keeping nothing, least recent."""
        return (slot, 0) if self.lowest else (len(self.held[slot]) > 0, self._free[slot])

    def _evict(self) -> None:
        """Clear free slots, least recently used first, until every running sequence's
        reservation fits beside what the free slots keep and the suspended sequences hold, and
        the free slots keep ``keep`` cells at most; where clearing them all is not enough, the
        newest suspended sequences give up their slots (:func:`_drop`) and their cells are
        cleared in turn."""
        need = sum(seq.reservation for seq in self.running.values())
        pinned = self._pinned()
        while pinned and need + sum(len(self.held[s.slot]) for s in pinned) > self.cells:
            _drop(self, pinned.pop())
        need += sum(len(self.held[s.slot]) for s in pinned)
        kept = sum(len(self.held[slot]) for slot in self._free)
        for slot in sorted(self._free, key=self._free.__getitem__):
            if need + kept <= self.cells and (not self.keep or kept <= self.keep):
                return
            kept -= len(self.held[slot])
            self._truncate(slot, 0)

    def _pinned(self) -> list[Sequence]:
        """The suspended sequences that hold slots, the first to give theirs up last."""
        return sorted((seq for seq in self.suspended.values() if seq.slot >= 0), key=_urgency)

    def _copy(self, source: int, slot: int, length: int) -> None:
        """Put the first ``length`` cells of ``source`` in ``slot``, in place of its own."""
        self._truncate(slot, 0)
        self.cache.share(source, slot, length)
        self.held[slot] = self.held[source][:length]

    def _truncate(self, slot: int, length: int) -> None:
        if len(self.held[slot]) > length:
            self.cache.forget(slot, length)
            del self.held[slot][length:]

    # Steps -------------------------------------------------------------------------------

    @property
    def used(self) -> int:
        """Cells the running and suspended sequences hold (a shared prefix counted in each)."""
        held = [*self.running.values(), *self.suspended.values()]
        return sum(len(self.held[seq.slot]) for seq in held if seq.slot >= 0)

    @property
    def kept(self) -> int:
        """Cells the free slots keep for reuse."""
        return sum(len(self.held[slot]) for slot in self._free)

    @property
    def occupied(self) -> int:
        """Cells the cache holds, as the step-cost model counts them: every slot's, running or
        kept (a prefix two slots share counted in each; the model learns on the same count)."""
        return sum(len(tokens) for tokens in self.held)

    def plan(self, now: float = 0.0) -> list[Entry]:
        """The next step's entries (empty when there is nothing to compute), planned at
        ``now`` (the clock of the sequences' ``first_at``); in slot order where ``lowest``.
        A sequence ``alone`` is stepped in steps of its own: when no other has anything to
        compute, once passed over ``MAX_PASSED`` steps, or while a sequence waits for a slot."""
        if self.lowest:
            _settle(self)
        alone = next((s for s in self.running.values() if s.alone and _due(s)), None)
        if alone is None or (alone.passed < MAX_PASSED and not self.waiting):
            entries = self._shared(now, [s for s in self.running.values() if not s.alone])
            if alone is None or entries:
                if alone is not None:
                    alone.passed += 1
                return sorted(entries, key=_slot) if self.lowest else entries
        alone.passed = 0
        return _prefill([alone], len(alone.prompt), 0) or _decodes([alone], self.held)

    def _shared(self, now: float, running: list[Sequence]) -> list[Entry]:
        """The step of the sequences that share steps (see ``plan``)."""
        entries = _decodes(running, self.held)
        pending = sorted((s for s in running if s.prefilling), key=_taken_first)
        if not pending:
            return entries
        bridges = _bridges(entries, pending) if self.lowest else []
        full = max(self.step_tokens - len(entries) - len(bridges), MIN_PREFILL)
        prefill = self._fill(entries + bridges, pending, full, self.bound(entries, now))
        taken = {e.seq.key for e in prefill}
        for seq in pending:
            seq.passed = 0 if seq.key in taken else seq.passed + 1
        bridges = [e for e in bridges if e.seq.key not in taken]
        if any(e.sample and e.seq.priority == 0 for e in prefill):
            step = self.cost(entries + bridges + prefill)
            entries = [e for e in entries if not _deferrable(e.seq, now, step)]
        return entries + bridges + prefill

    def bound(self, decodes: list[Entry], now: float = 0.0) -> float | None:
        """The longest next step, planned at ``now``, that keeps the generating sequences
        ``decodes`` within their objectives: the least time any of them has banked or will
        bank (None: none has a TPOT objective)."""
        paced = [e.seq for e in decodes if e.seq.tpot_s > 0]
        if not paced:
            return None
        # The pace to come, at its slowest: every slot's token and a floor's prompt token (a
        # mean over the steps to come: the fit's, not its high end).
        slots = self.slots
        pace = self.costs.predict(slots + PREFILL_FLOOR, slots, self.occupied + slots)
        step = self.cost(decodes)
        return min(_banked(seq, now, step, pace) for seq in paced)

    def cost(self, entries: list[Entry]) -> float:
        """A step's predicted seconds, as it is planned: at the high end of the prediction's
        error (:meth:`~.stepcost.StepCosts.predict_high`)."""
        tokens = sum(len(e.tokens) for e in entries)
        sampled = sum(e.sample for e in entries)
        return self.costs.predict_high(tokens, sampled, self.occupied + tokens)

    def _fill(
        self, decodes: list[Entry], pending: list[Sequence], full: int, bound: float | None
    ) -> list[Entry]:
        """The prompt chunks of the step (see the module docstring, "How many prompt
        tokens")."""
        knee = min(self.knee, full)
        if bound is None:
            prefill = _prefill(pending, full, knee)
        else:
            prefill = _most(self.cost, decodes, pending, full, knee, bound)
        if any(e.sample and e.seq.priority == 0 for e in prefill):
            # A chat's first token waits on no less urgent prompt (but one past its turns).
            prefill = [e for e in prefill if e.seq.priority == 0 or e.seq.passed >= MAX_PASSED]
        late = [seq for seq in pending if seq.passed >= MAX_PASSED]
        if late and not prefill:  # past their turns, no room: the oldest's floor, whatever
            prefill = _prefill([min(late, key=lambda seq: seq.order)], PREFILL_FLOOR, knee)
        return prefill

    def advance(self, entries: list[Entry]) -> None:
        """The step ran: its tokens are in the cache. (Sampling sets ``pending`` after.)"""
        for entry in entries:
            seq = entry.seq
            self.held[seq.slot] += entry.tokens
            if seq.prefilling:
                seq.fed += len(entry.tokens)
            else:
                seq.pending = -1


def preemptible_above(entries: list[Entry]) -> int:
    """Whether the step of ``entries`` may be preempted (see the worker), as the priority a
    run arriving meanwhile must be more urgent than (lower) to preempt it; -1: it may not.
    A step may be preempted when it feeds prompts (more than a token each: a bridge makes
    no step worth preempting) and none is interactive or has been preempted
    ``MAX_PASSED`` steps in a row already; the health probe, least urgent of all, preempts
    nothing it may not."""
    prefill = _feeding(entries)
    if not prefill or any(s.priority == 0 or s.preempted >= MAX_PASSED for s in prefill):
        return -1
    return min(seq.priority for seq in prefill)


def after_step(entries: list[Entry], *, preempted: bool) -> None:
    """The step of ``entries`` ran, or was preempted (nothing of it is in the cache: its
    prompts are planned again, each one's preemptions in a row counted)."""
    for seq in _feeding(entries):
        seq.preempted = seq.preempted + 1 if preempted else 0


def preempts(priority: int, above: int) -> bool:
    """Whether a run of ``priority`` preempts the step running, preemptible above ``above``
    (:func:`preemptible_above`)."""
    return priority < above


def _feeding(entries: list[Entry]) -> list[Sequence]:
    """The sequences whose prompts a step feeds, more than a token each."""
    return [e.seq for e in entries if e.seq.prefilling and len(e.tokens) > 1]


def _prefill(pending: list[Sequence], budget: int, knee: int) -> list[Entry]:
    """Prompt chunks of ``budget`` tokens in all at most, from ``pending`` in the order taken:
    each prompt's whole rest where it fits, else a chunk of at least ``knee`` tokens; an
    interactive prompt, or one passed over ``MAX_PASSED`` steps, takes any chunk."""
    entries: list[Entry] = []
    for seq in pending:
        left = len(seq.prompt) - seq.fed
        take = min(budget, left)
        if take <= 0 or (take < left and take < knee and seq.passed < MAX_PASSED and seq.priority):
            continue
        end = seq.fed + take
        entries.append(Entry(seq, seq.prompt[seq.fed : end], seq.fed, end == len(seq.prompt)))
        budget -= take
    return entries


def _most(
    cost: Callable[[list[Entry]], float],
    decodes: list[Entry],
    pending: list[Sequence],
    full: int,
    knee: int,
    bound: float,
) -> list[Entry]:
    """The chunks of the largest budget (0 to ``full`` prompt tokens) whose step beside
    ``decodes`` fits ``bound`` by ``cost`` (the step grows with the budget: a bisection)."""
    low, high = 0, full
    while low < high:
        mid = (low + high + 1) // 2
        if cost(decodes + _prefill(pending, mid, knee)) <= bound:
            low = mid
        else:
            high = mid - 1
    return _prefill(pending, low, knee)


def _bridges(decodes: list[Entry], pending: list[Sequence]) -> list[Entry]:
    """With a stream a slot: the next prompt token of each sequence being prefilled whose slot
    lies between two generating ones (and that has more than that token left, so that it
    samples nothing). llama.cpp steps each run of consecutive streams in a pass of its own,
    and every pass reads all the weights, so a slot left out of a step splits it in two (a
    step of 7 decodes a sixth slower on the embedded model); one token keeps the run whole
    for about a decode's cost, and feeds the prompt on."""
    if not decodes:
        return []
    low, high = min(map(_slot, decodes)), max(map(_slot, decodes))
    return [
        Entry(seq, seq.prompt[seq.fed : seq.fed + 1], seq.fed, False)
        for seq in pending
        if low < seq.slot < high and len(seq.prompt) - seq.fed > 1
    ]


def _decodes(running: list[Sequence], held: list[list[int]]) -> list[Entry]:
    """The generating sequences' entries: each its token sampled last."""
    return [Entry(s, (s.pending,), len(held[s.slot]), True) for s in running if s.pending >= 0]


def _banked(seq: Sequence, now: float, step: float = 0.0, pace: float = 0.0) -> float:
    """The longest next step that keeps ``seq`` within its TPOT objective (less the margin), an
    average over its tokens from its first to its expected last: the time until its next token
    is due at that pace and what its tokens to come will bank, each a step of ``pace`` (the
    slowest to come), never less than ``step`` (the decodes alone), nor more than what is left
    of its cap (:func:`_cap`) since its latest token."""
    per = MARGIN * seq.tpot_s
    if seq.first_at is None:
        return per
    since = now - seq.last_at if seq.last_at is not None else 0.0
    left = max(per, _cap(seq)) - since
    ahead = seq.first_at + per * seq.generated - now
    # What its tokens to come will bank at ``pace`` by its end.
    expected = min(seq.expected or seq.max_new_tokens, seq.max_new_tokens)
    future = max(expected - seq.generated - 1, 0) * max(per - pace, 0.0)
    return min(max(step, ahead + future), left)


def _cap(seq: Sequence) -> float:
    """The longest gap between two of ``seq``'s tokens: its own (``gap_s``), else its TTFT
    objective (no running stream pauses longer than a new one is promised to wait); less the
    margin, and none without either."""
    return MARGIN * (seq.gap_s or seq.ttft_s) or math.inf


def _deferrable(seq: Sequence, now: float, step: float) -> bool:
    """Whether a generating sequence may skip the step (of ``step`` seconds) that samples a
    chat's first token: a less urgent one with a TPOT objective, more than a token's share
    ahead of it, whose cap leaves room, after the time since its latest token, for that step
    and one as long after it."""
    if seq.priority == 0 or seq.tpot_s <= 0 or seq.first_at is None:
        return False
    per = MARGIN * seq.tpot_s
    since = now - seq.last_at if seq.last_at is not None else 0.0
    ahead = seq.first_at + per * seq.generated - now > per
    return ahead and since + 2 * step <= max(per, _cap(seq))


def _taken_first(seq: Sequence) -> tuple[int, int, int]:
    """The order prompts are taken in: the most urgent first; within a priority, those passed
    over ``MAX_PASSED`` steps, the oldest first (were the budget always spent before they came,
    they would be passed over for good), then the shortest left, the oldest."""
    if seq.passed >= MAX_PASSED:
        return (seq.priority, -1, seq.order)
    return (seq.priority, len(seq.prompt) - seq.fed, seq.order)


def _urgency(seq: Sequence) -> tuple[int, int]:
    return (seq.priority, seq.order)


def _due(seq: Sequence) -> bool:
    """Whether ``seq`` has tokens to compute."""
    return seq.prefilling or seq.pending >= 0


def _drop(s: Scheduler, seq: Sequence) -> None:
    """A suspended sequence gives up its slot (its cells stay as the free slot's, and are
    copied out of the cache) and will put them back in the slot it is given, or where it
    cannot compute again what it held, then feed the token it sampled last."""
    tokens = s.held[seq.slot]
    if tokens:
        seq.stash = (s.cache.stash(seq.slot), len(tokens))
    if seq.fed >= len(seq.prompt):  # it was generating: its prompt becomes what it had
        context = tuple(tokens) + ((seq.pending,) if seq.pending >= 0 else ())
        seq.output_in_prompt += len(context) - len(seq.prompt)
        seq.prompt = context
    seq.pending = -1
    s._free[seq.slot] = next(s._freed)
    seq.slot = -1
    seq.fed = 0


def _unstash(s: Scheduler, seq: Sequence, slot: int) -> bool:
    """Put a dropped sequence's cells back, in ``slot``: it goes on from them (all it held
    but the token it sampled last, which it feeds); False where llama.cpp could not."""
    assert seq.stash is not None
    (saved, length), seq.stash = seq.stash, None
    s._truncate(slot, 0)
    if not s.cache.unstash(slot, saved):
        return False
    if length >= len(seq.prompt):  # (its last token is fed again, for its logits)
        length = len(seq.prompt) - 1
        s.cache.forget(slot, length)
    s.held[slot] = list(seq.prompt[:length])
    del s._free[slot]
    seq.slot, seq.fed = slot, length
    return True


def _settle(s: Scheduler) -> None:
    """With a stream a slot: once a free slot has stayed below a running sequence for
    ``SETTLE`` plans (no job came to take it: the last of a burst), the topmost running
    sequence moves into the lowest such slot, its stream copied there, so that the steps run
    in one pass again."""
    top = max((q for q in s.running.values() if not q.alone), key=_slot_of, default=None)
    holes = [slot for slot in s._free if slot < top.slot] if top is not None else []
    s._holed = s._holed + 1 if holes else 0
    if top is None or s._holed < SETTLE:
        return
    s._holed = 0
    slot, source = min(holes), top.slot
    s._truncate(slot, 0)
    if s.held[source]:
        s._copy(source, slot, len(s.held[source]))
        s._truncate(source, 0)
    del s._free[slot]
    s._free[source] = next(s._freed)
    top.slot = slot


def _slot_of(seq: Sequence) -> int:
    return seq.slot


def _slot(entry: Entry) -> int:
    return entry.seq.slot


def _common(a: Tokens[int], b: Tokens[int]) -> int:
    """The length of the common prefix of two token sequences (by bisection over slices, which
    compare at C speed)."""
    low, high = 0, min(len(a), len(b))
    if high and a[0] != b[0]:
        return 0
    a, b = list(a[:high]), list(b[:high])
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low
