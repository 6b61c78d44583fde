"""A llama.cpp worker process: one model, one context, many sequences batched over one KV cache.

Started by :class:`governor.runners.llama.runner.LlamaRunner` as ``python -m
governor.runners.llama.worker``. It speaks JSON lines: requests on stdin, events on stdout,
diagnostics on stderr; each message is a dataclass of :mod:`~.llama_messages`, which holds their
codec, the one both ends use (a field shown optional below is null when absent). A crash here (a segfault in the native code, an out-of-memory kill) is
seen by the daemon as the end of stdout and costs the jobs in hand, which abort.

    stdin:  {"op": "run", "id": str, "tokens": [int], "max_new_tokens": int, "priority": int,
             "ttft_ms": float, "tpot_ms": float, "gap_ms": float, "expect": int,
             "temperature": float, "top_p": float, "top_k": int, "min_p": float, "seed": int | null,
             "stop": [str], "ignore_eos": bool, "n": int, "logprobs": int | null,
             "presence_penalty": float, "frequency_penalty": float, "repeat_penalty": float,
             "logit_bias": [[int, float]], "grammar": str | null, "alone"?: bool}
                                                                alone: stepped in steps of its
                                                                own (the health probe)
            {"op": "cancel", "id": str}
            {"op": "suspend", "id": str}                        not stepped until resumed
            {"op": "resume", "id": str}
            {"op": "embed", "id": str, "texts": [[int]]}
            {"op": "waiting", "jobs": bool}                     jobs wait at the daemon's
                                                                doors for a slot, or none does
            {"op": "offered", "id": str}                        the slot of a job it ended
                                                                has been offered (Refills)
    stdout: {"ev": "ready", "cells": int, "slots": int, "n_ctx_train": int,
             "rates": [float, float, float]}                    once, after loading and warming up
            {"ev": "refused", "error": str}                     instead, for an ``--n-ctx`` the
                                                                model was not trained for; exit 2
            {"ev": "step", "kv": int, "acks": int, "f": {id: int}, "rates"?: [float, float, float],
             "out": [{"id": str, "i": int, "text": str, "n": int, "lp"?: [entry]}],
             "done": [{"id": str, "choices": [{"text": str, "finish_reason": "stop" | "length"}],
                       "completion_tokens": int, "cached_tokens": int}
                      | {"id": str, "error": str}]}
                                                                after each decode step
            {"ev": "embedded", "id": str, "vectors": [[float]] | "error": str}
                                                                the answer to an "embed"

Each step is one ``llama_decode`` of the batch :class:`~.batching.Scheduler` plans: one token
of every generating sequence and whole prompts or chunks of at least ``--min-chunk`` tokens,
cut to the time the generating sequences have banked against their ``tpot_ms`` and to their
``gap_ms`` (``ttft_ms`` without one): the step budget, in that module. The cells of ended
sequences are kept for a later prompt with the same beginning, ``--n-ctx`` of them at most.
``out`` holds, for each sequence that let out text in the step (or, with log probabilities,
tokens), the job, the sequence's index ``i`` among the job's ``n``, its text, and ``n``, how
many tokens the job (all its sequences) has generated so far; ``f`` how many prompt tokens each
job whose prompt is still being fed has in the cache, ``kv`` the cache cells held after it,
``acks`` how many cancels were handled since the last event, and ``rates`` (in "ready", and
in a step event every ``RATES_EVERY`` steps) what a prompt token and a generated token cost now,
in seconds, the second with every slot generating, over the cells in use, and the third how
much that step grows a cell more: the daemon predicts a job's time from its size with them. A
job is done when all its sequences are, with each one's whole text and finish in ``choices``
(by index), ``completion_tokens`` over all of them, and ``cached_tokens``, how much of its
prompt was already in the cache (a prefix kept from an earlier job, or shared); or with an
``error``.
Requests are read between steps, in the order sent: a cancel stops its job before the next
step and frees its cells at once (an event with nothing else in it says so when no step
follows), and a run sent after a cancel or a finished job always finds their cells free.

Every step is timed, from its planning to its event, and the time taught to the scheduler's
:class:`~.stepcost.StepCosts` (a preempted or failed step teaches nothing). Before "ready", a
few calibration steps of known shape (prompts and generating sequences side by side) give the
model its first figures on this model and device.

Tokens are sampled in the order of llama.cpp's common sampler: logit biases, penalties
(repeat, frequency and presence, over the sequence's generated tokens), the grammar (GBNF
text, checked by the daemon before admission), then top_k, top_p, min_p, temperature and a
seeded draw (``seed + i`` for the job's ``i``-th sequence); greedy at temperature 0. A sequence
with biases, penalties, a grammar, top_k or top_p has llama.cpp's sampler chain; any other, the
same distribution drawn from the tokens that can matter (:mod:`.sampling`: a tenth to two
thirds of the chain's time at a 49,152-token vocabulary).

**Several choices.** A job with ``n`` above 1 runs its first sequence alone until its prompt is
in the cache; the step that samples its first token forks the others from it
(:meth:`~.batching.Scheduler.fork`): they share the prompt's cells and sample their first
tokens from the same logits. In a pool the slots share ``MAX_N - 1`` sequence ids for that
(llama.cpp reserves a row of logits for each id: one job's choices always fit, and 8 slots take
25 ids, not 129); with a stream a slot there are none (each would hold ``--n-ctx`` cells), and
the forks take free slots. A fork that finds no id free waits for one, and feeds the prompt's
last token itself.

**The cache's layout.** ``--kv-layout slots`` (the daemon's default): a stream of ``--n-ctx``
cells for each slot (llama.cpp's cache with ``kv_unified`` off, as llama-server has it; the
health probe takes a free slot's): a token attends over its own sequence's cells only, a
shared prefix is copied from stream to stream, and ``cells`` in "ready" counts the slots'
streams. ``pool``: one pool of ``--cells`` cells that every sequence takes its cells from
(llama.cpp's unified cache), a prefix two sequences share held once, and a sequence and
cells kept for the probe; every token attends over the span of cells in use. llama.cpp
runs a step in one pass for each run of consecutive streams, so a sequence takes the lowest
free slot and a step's entries come in slot order (:class:`~.batching.Scheduler`'s ``lowest``).

**Log probabilities.** With ``logprobs`` (k), each sampled token's log probability and the k
likeliest tokens' are read from the model's raw logits at its position (a log-softmax over the
vocabulary: before biases, penalties, grammar and temperature), in OpenAI's chat shape
(``entry``: ``{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}``).
A token's ``token`` is the text its bytes complete: a character split over tokens belongs to
the one that completes it (the one before has ""), and a token that a stop string cuts keeps
what comes before the stop. Its ``bytes`` are its own (cut the same way). So a job's entries'
tokens add up to its text exactly, and its text is let out at token boundaries only, each
piece (``lp``) with the entries of the tokens it is made of. An alternative's ``token`` is its
bytes decoded alone (a broken character shown as U+FFFD).

**Suspension.** A suspended job's sequences are not stepped (admission took its slot back for a
chat); it keeps its cells while the cache has room for them, and otherwise computes them again
when resumed (:class:`~.batching.Scheduler`). Its samplers and its text wait as they are, so a
resumed job lets out the tokens it would have, none lost or repeated. A worker whose jobs are
all suspended is idle.

**Refills.** While the daemon says jobs wait for a slot, a step that ends jobs is followed by
a wait for the runs of the jobs it gives the freed slots, until the daemon says it has offered
each ended job's slot (an "offered" after the runs it caused) or runs have taken them all
(``--refill-ms`` at most; the daemon's round trip takes a millisecond to seven), so that
their prompts go into the very next step, beside the running streams, as llama-server's queued
requests do: no step runs with a slot left empty that a job was waiting for, and jobs that
end together start their successors' prompts together.

**Embeddings.** An "embed" request is answered between two steps, in a second context made at
the first one (:class:`Embedder`); the generating sequences wait for it (a step event, empty,
after each of its own steps says that the worker is alive).

**Preemption.** A step that feeds the prompt of a less urgent job (a rewrite) can be long; a
run request for a more urgent one (a chat) that arrives meanwhile aborts it (llama.cpp's abort
callback, checked between the graph's operations on the CPU; llama.cpp takes the step's tokens
back out of the cache), and the next step starts with the chat's prompt. The rewrite loses
that step's work, and is preempted at most ``MAX_PASSED`` times in a row. (The health probe,
least urgent of all, preempts nothing.) Which steps may be preempted, and by what, the
scheduler decides (:func:`~.batching.preemptible_above`, pure); the worker carries it
out.
"""

from __future__ import annotations

import argparse
import bisect
import codecs
import ctypes
import io
import math
import queue
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from protocol.spec import MAX_N

from . import messages as msg
from .batching import (
    KNEE,
    Entry,
    Scheduler,
    Sequence,
    after_step,
    preemptible_above,
    preempts,
)
from .sampling import NO_PENALTIES, Draws, penalties, plain
from .stepcost import StepCosts

# In a pool, a sequence beyond the admitted ones for the health probe, and the cells its job
# (a few prompt tokens, one generated) needs; with a stream a slot, the probe takes a free
# slot's (a stream of its own would cost n_ctx cells: the daemon skips the probe when none is).
PROBE_SLOTS = 1
PROBE_CELLS = 16
# The most a step waits, after a job's last token, for the run of the job the daemon gives the
# freed slot, should the daemon not say it has offered the slot (see Refills).
REFILL_MS = 10.0
RATES_EVERY = 32  # steps between two of the rates a step event says (see above)
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: the sequence ids one context may have
EMBED_SEQUENCES = 64  # texts one embedding step takes at most
# llama.cpp's warning for a context whose cells per sequence exceed the model's training
# context. With kv_unified every sequence may address the whole cache, so llama.cpp counts all
# its cells (every slot's, and the probe's) as one sequence's, and warns whenever the cache is
# larger than one training context: a cache of four 2048-token slots on a model trained for
# 8192 tokens, say. What bounds a sequence here is n_ctx: admission refuses a job whose prompt
# and max_new_tokens exceed it, and n_ctx is checked against n_ctx_train before the context is
# made (:func:`context_refusal`). The warning then speaks of cells no sequence can reach, and
# is dropped (only it: llama.cpp's other lines pass as before).
TRAINING_OVERFLOW_WARNING = b"possible training context overflow"
GGML_LOG_WARN, GGML_LOG_ERROR, GGML_LOG_CONT = 3, 4, 5  # llama.cpp's enum ggml_log_level


class Refused(Exception):
    """The worker cannot serve this configuration; the message is for people."""


class EmbedFailed(Exception):
    """An embedding request failed (no context for it, a decode that failed)."""


def context_refusal(n_ctx: int, n_ctx_train: int, model: str) -> str | None:
    """Why ``n_ctx``, the longest sequence admission lets in, is more than ``model`` was
    trained for, or None. ``n_ctx_train`` 0: the model does not say (nothing is checked)."""
    if 0 < n_ctx_train < n_ctx:
        return (
            f"n_ctx {n_ctx} is more than the {n_ctx_train} tokens {model} was trained for (its "
            "context_length): a job that long would run past what the model has seen. Set "
            f"n_ctx (fallback_n_ctx, for the fallback model) to {n_ctx_train} or less"
        )
    return None


def add_draw(ll: Any, chain: Any, request: msg.Run, seed: int) -> None:
    """End llama.cpp's sampler ``chain`` with the request's draw: greedy at temperature 0, else
    top_k, top_p, min_p (each when asked for), the temperature and a draw seeded by ``seed``."""
    temperature = request.temperature
    if temperature <= 0:
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
        return
    if request.top_k > 0:
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(request.top_k))
    if request.top_p < 1:
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_p(request.top_p, 1))
    if request.min_p > 0:
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_min_p(request.min_p, 1))
    ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_temp(temperature))
    ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dist(seed))


def emit(out: BinaryIO, event: msg.Event) -> None:
    out.write(msg.encode(event))
    out.flush()


class Text:
    """A sequence's output: incremental UTF-8 decoding, stop strings, and the end of the text
    that could still be the start of a stop string, held back until it cannot.

    It keeps each token's bytes, where its text ends (the characters its bytes complete) and
    a note of the caller's (its log probabilities), for a caller that lets text out in whole
    tokens (``whole``): :attr:`fresh` is then the tokens each delta is made of."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.sent = 0  # characters of self.text already emitted
        self.pieces: list[bytes] = []  # each token's bytes
        self.ends: list[int] = []  # where each token's text ends in self.text
        self.notes: list[Any] = []
        self.fresh = range(0)  # the tokens the last delta let out
        self._let_out = 0  # tokens let out

    def add(self, piece: bytes, note: Any = None) -> bool:
        """Append a token's bytes; True when a stop string has appeared (the text ends there)."""
        self.text += self.decoder.decode(piece)
        self.pieces.append(piece)
        self.ends.append(len(self.text))
        self.notes.append(note)
        cuts = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self._cut(min(cuts))
            return True
        return False

    def _cut(self, at: int) -> None:
        """End the text at ``at``: the tokens after it go, the one it falls in keeps what
        comes before it (its bytes too)."""
        kept = bisect.bisect_left(self.ends, at) + 1 if at else 0
        del self.pieces[kept:], self.ends[kept:], self.notes[kept:]
        if kept:
            self.ends[-1] = at
            rest = len(self.text[:at].encode()) - sum(len(p) for p in self.pieces[:-1])
            self.pieces[-1] = self.pieces[-1][: max(rest, 0)]
        self.text = self.text[:at]
        self.decoder.reset()  # (bytes of a character after the stop are not the text's)

    def _partial(self) -> int:
        """The length of the longest end of the text that begins a stop string."""
        text = self.text
        return max(
            (
                n
                for stop in self.stops
                for n in range(len(stop) - 1, 0, -1)
                if text.endswith(stop[:n])
            ),
            default=0,
        )

    def delta(self, *, final: bool, whole: bool = False) -> str:
        """The text not yet let out that can be now: all of it when ``final``, else what can
        no longer begin a stop string, and with ``whole`` only through the last whole token."""
        if final:
            tail = self.decoder.decode(b"", final=True)
            if tail:  # (a character left broken at the end)
                self.text += tail
                self.ends[-1] = len(self.text)
        upto = len(self.text) if final else max(len(self.text) - self._partial(), self.sent)
        if whole and not final:
            last = bisect.bisect_right(self.ends, upto)  # (tokens that end by upto)
            upto = max(self.ends[last - 1] if last else 0, self.sent)
        # The tokens it completes: those whose text ends by ``upto`` (but one that completes
        # no character yet, at the end, waits for the token that does).
        done = len(self.ends) if final else bisect.bisect_left(self.ends, upto)
        if not final and done < len(self.ends) and self.ends[done] == upto and upto:
            done += 1
        self.fresh = range(self._let_out, max(done, self._let_out))
        self._let_out = self.fresh.stop
        delta = self.text[self.sent : upto]
        self.sent = upto
        return delta

    def token(self, i: int) -> str:
        """The ``i``-th token's text."""
        return self.text[self.ends[i - 1] if i else 0 : self.ends[i]]


class Model:
    """The llama.cpp model, its context and the step's batch, through the low-level API."""

    def __init__(self, args: argparse.Namespace) -> None:
        import llama_cpp as ll

        # Set (by the request reader) to abort a preemptible step.
        self.preempt = threading.Event()
        # llama.cpp's warnings and errors on stderr, but the overflow warning (n_ctx is checked
        # below: no sequence passes n_ctx_train) and a preempted step's errors
        self._log_callback = _without_training_overflow_warning(ll, self.preempt.is_set)
        self.ll = ll
        ll.llama_backend_init()
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = args.n_gpu_layers
        self.model = ll.llama_model_load_from_file(args.model.encode(), mparams)
        if not self.model:
            raise SystemExit(f"cannot load the model {args.model}")
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = ll.llama_model_n_ctx_train(self.model)
        refusal = context_refusal(args.n_ctx, self.n_ctx_train, Path(args.model).name)
        if refusal is not None:
            ll.llama_model_free(self.model)
            raise Refused(refusal)
        # Sequence ids: one for each admitted job, and in a pool the probe's and MAX_N - 1 more
        # that the jobs' further choices share (llama.cpp reserves a row of logits for each
        # id; with a stream a slot, each id would hold n_ctx cells: choices wait for slots).
        self.streams = args.kv_layout == "slots"
        further = 0 if self.streams else MAX_N - 1 + PROBE_SLOTS
        self.slots = min(args.slots + further, MAX_SEQUENCES)
        self.n_ctx, self.threads = args.n_ctx, args.threads  # (for the embedding context)
        self.batch_size = args.step_tokens + self.slots
        cparams = ll.llama_context_default_params()
        cparams.n_batch = cparams.n_ubatch = self.batch_size
        cparams.n_seq_max = self.slots
        cparams.n_threads = cparams.n_threads_batch = args.threads
        # A stream of n_ctx cells for each id, attended over by its own tokens only (llama.cpp
        # rounds each up to 256), or one pool of cells that any sequence may take.
        cparams.kv_unified = not self.streams
        cparams.n_ctx = self.slots * args.n_ctx if self.streams else args.cells + PROBE_CELLS
        if args.kv_cache_type == "q8_0":  # (llama.cpp quantises V only with flash attention)
            cparams.type_k = cparams.type_v = ll.GGML_TYPE_Q8_0
            cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cparams.no_perf = True
        self.ctx = ll.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise SystemExit("cannot create the llama.cpp context (out of memory?)")
        self.size = ll.llama_n_ctx(self.ctx)
        # (what admission may reserve: the slots' streams, or the pool but the probe's cells)
        self.cells = self.size if self.streams else self.size - PROBE_CELLS
        self.memory = ll.llama_get_memory(self.ctx)
        self.batch = ll.llama_batch_init(self.batch_size, 0, 1)
        self._piece = ctypes.create_string_buffer(256)
        # (llama-cpp-python declares the function but binds it not: bound here)
        self._set_abort = ll.llama_cpp._lib.llama_set_abort_callback
        self._set_abort.argtypes = [ctypes.c_void_p, ll.ggml_abort_callback, ctypes.c_void_p]
        self._set_abort.restype = None
        self._abort = ll.ggml_abort_callback(lambda _: self.preempt.is_set())
        self._no_abort = ll.ggml_abort_callback()  # NULL: no callback, no cost

    def decode(self, entries: list[Entry], *, preemptible: bool = False) -> tuple[int, list[int]]:
        """Run one step; returns llama_decode's status (2: preempted) and, per entry that
        samples, the index of its logits in the batch."""
        batch, n, sampled = self.batch, 0, []
        for entry in entries:
            slot = entry.seq.slot
            for i, token in enumerate(entry.tokens):
                batch.token[n] = token
                batch.pos[n] = entry.start + i
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = slot
                batch.logits[n] = 0
                n += 1
            if entry.sample:
                batch.logits[n - 1] = 1
                sampled.append(n - 1)
        batch.n_tokens = n
        if not preemptible:
            return self.ll.llama_decode(self.ctx, batch), sampled
        # (A callback into Python at every operation of the graph: for long steps only.)
        self._set_abort(self.ctx, self._abort, None)
        try:
            status = self.ll.llama_decode(self.ctx, batch)
        finally:
            self._set_abort(self.ctx, self._no_abort, None)
        if status == 2:
            # Preempted: none of the step may stay in the cache (the worker plans it again).
            # llama.cpp takes back the positions of the micro-batch it aborted only, and with a
            # stream a slot it splits a step into several: the earlier ones' stay.
            for entry in entries:
                self.forget(entry.seq.slot, entry.start)
        return status, sampled

    def forget(self, slot: int, start: int) -> None:
        self.ll.llama_memory_seq_rm(self.memory, slot, start, -1)

    def share(self, source: int, slot: int, length: int) -> None:
        if self.streams:  # (llama.cpp copies a whole stream to another, replacing it)
            self.ll.llama_memory_seq_cp(self.memory, source, slot, -1, -1)
            self.forget(slot, length)
        else:
            self.ll.llama_memory_seq_cp(self.memory, source, slot, 0, length)

    def stash(self, slot: int) -> object:
        """The slot's cells, as llama.cpp writes a sequence's state (host memory, not the
        cache's)."""
        size = self.ll.llama_state_seq_get_size(self.ctx, slot)
        buffer = (ctypes.c_uint8 * size)()
        return ctypes.string_at(
            buffer, self.ll.llama_state_seq_get_data(self.ctx, buffer, size, slot)
        )

    def unstash(self, slot: int, saved: object) -> bool:
        assert isinstance(saved, bytes)
        buffer = (ctypes.c_uint8 * len(saved)).from_buffer_copy(saved)
        return bool(self.ll.llama_state_seq_set_data(self.ctx, buffer, len(saved), slot))

    def sampler(self, request: msg.Run, index: int = 0) -> Any:
        """The sampler of the request's ``index``-th sequence: :class:`~.sampling.Draws` for a
        plain one, else llama.cpp's chain; None when its grammar does not parse (the daemon
        checks it before admission: this is for safety)."""
        seed = request.seed + index if request.seed is not None else None
        if plain(request):
            return Draws(temperature=request.temperature, min_p=request.min_p, seed=seed)
        ll = self.ll
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        for constraint in self._constraints(request):
            if not constraint:
                ll.llama_sampler_free(chain)
                return None
            ll.llama_sampler_chain_add(chain, constraint)
        add_draw(ll, chain, request, seed if seed is not None else random.randrange(2**31))
        return chain

    def _constraints(self, request: msg.Run) -> Iterator[Any]:
        """The samplers that come before any draw: logit biases, penalties, the grammar
        (each made only when asked for; a grammar that does not parse is a NULL one)."""
        ll = self.ll
        if bias := request.logit_bias:
            entries = (ll.llama_logit_bias * len(bias))(
                *(ll.llama_logit_bias(t, b) for t, b in bias)
            )
            yield ll.llama_sampler_init_logit_bias(self.n_vocab, len(bias), entries)
        if (weights := penalties(request)) != NO_PENALTIES:
            # Over all the tokens the sequence may generate (OpenAI's penalties count them all).
            window = request.max_new_tokens
            yield ll.llama_sampler_init_penalties(self.n_vocab, window, *weights)
        if grammar := request.grammar:
            yield ll.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")

    def sample(self, chain: Any, index: int) -> int:
        if isinstance(chain, Draws):
            return chain(self.logits(index))
        return int(self.ll.llama_sampler_sample(chain, self.ctx, index))

    def free_sampler(self, chain: Any) -> None:
        if not isinstance(chain, Draws):
            self.ll.llama_sampler_free(chain)

    def logits(self, index: int) -> npt.NDArray[np.float32]:
        """The raw logits at the batch's ``index``-th token (a view, valid until the next
        step)."""
        row = self.ll.llama_get_logits_ith(self.ctx, index)
        return np.ctypeslib.as_array(row, shape=(self.n_vocab,))

    def scores(self, index: int, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
        """The log probability of ``token`` at the batch's ``index``-th logits, and the ``top``
        likeliest tokens' (id, log probability), likeliest first: a log-softmax of the raw
        logits over the vocabulary."""
        logits = self.logits(index)
        peak = float(logits.max())
        norm = peak + math.log(float(np.exp(logits - peak).sum(dtype=np.float64)))
        best = np.argpartition(logits, -top)[-top:] if top else np.zeros(0, dtype=np.intp)
        best = best[np.argsort(-logits[best], kind="stable")]
        return float(logits[token]) - norm, [(int(t), float(logits[t]) - norm) for t in best]

    def is_eog(self, token: int) -> bool:  # end of generation: EOS, EOT, <|im_end|> ...
        return bool(self.ll.llama_vocab_is_eog(self.vocab, token))

    def piece(self, token: int) -> bytes:
        n = self.ll.llama_token_to_piece(self.vocab, token, self._piece, 256, 0, False)
        if n < 0:  # (a piece longer than the buffer: none in practice)
            buf = ctypes.create_string_buffer(-n)
            n = self.ll.llama_token_to_piece(self.vocab, token, buf, -n, 0, False)
            return buf.raw[:n]
        return self._piece.raw[:n]

    def tokenize(self, text: bytes) -> list[int]:
        tokens = (self.ll.llama_token * (len(text) + 8))()
        n = self.ll.llama_tokenize(self.vocab, text, len(text), tokens, len(tokens), True, False)
        return list(tokens[: max(n, 0)])


class Embedder:
    """A second context on the worker's model, for embeddings, made at the first request: each
    text a sequence of its own, its hidden states mean-pooled by llama.cpp, then scaled to unit
    length (as OpenAI's are). It costs a KV cache of ``n_ctx`` cells and the buffers of an
    ``n_ctx``-token step (a text is pooled in one step, so one step must hold the longest)."""

    def __init__(self, model: Model) -> None:
        ll = model.ll
        params = ll.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = model.n_ctx
        params.n_seq_max = EMBED_SEQUENCES
        params.kv_unified = True
        params.embeddings = True
        params.pooling_type = ll.LLAMA_POOLING_TYPE_MEAN
        params.n_threads = params.n_threads_batch = model.threads
        params.no_perf = True
        self.ll, self.size = ll, model.n_ctx
        self.ctx = ll.llama_init_from_model(model.model, params)
        if not self.ctx:
            raise EmbedFailed("cannot create the embedding context (out of memory?)")
        self.memory = ll.llama_get_memory(self.ctx)
        self.batch = ll.llama_batch_init(model.n_ctx, 0, 1)
        self.n_embd = ll.llama_model_n_embd(model.model)

    def embed(self, texts: list[list[int]]) -> Iterator[list[list[float]]]:
        """The texts' vectors, a step's worth at a time (as many texts as one step holds)."""
        group: list[list[int]] = []
        for tokens in texts:
            if group and (
                sum(map(len, group)) + len(tokens) > self.size or len(group) == EMBED_SEQUENCES
            ):
                yield self._step(group)
                group = []
            group.append(tokens)
        if group:
            yield self._step(group)

    def _step(self, group: list[list[int]]) -> list[list[float]]:
        ll, batch, n = self.ll, self.batch, 0
        for seq, tokens in enumerate(group):
            for position, token in enumerate(tokens):
                batch.token[n] = token
                batch.pos[n] = position
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq
                batch.logits[n] = 1
                n += 1
        batch.n_tokens = n
        try:
            status = ll.llama_decode(self.ctx, batch)
            if status != 0:
                raise EmbedFailed(f"llama_decode returned {status}")
            vectors = []
            for seq in range(len(group)):
                pooled = ll.llama_get_embeddings_seq(self.ctx, seq)
                vector = np.ctypeslib.as_array(pooled, shape=(self.n_embd,)).astype(np.float64)
                norm = float(np.linalg.norm(vector))
                vectors.append((vector / norm if norm else vector).tolist())
            return vectors
        finally:
            ll.llama_memory_clear(self.memory, True)


def _without_training_overflow_warning(ll: Any, aborting: Callable[[], bool]) -> Any:
    """llama.cpp's warnings and errors on stderr, but :data:`TRAINING_OVERFLOW_WARNING`'s line
    and the errors of a step aborted on purpose (while ``aborting()``: a preempted step);
    returns the callback, which must stay referenced as long as llama.cpp may call it.
    (llama-cpp-python's own callback reads the log levels of an older llama.cpp: it shows this
    one's warnings as errors and drops its errors as debug lines, depending on its logger's
    level.)"""
    shown = False

    @ll.llama_log_callback  # type: ignore[untyped-decorator]  # (llama-cpp-python: untyped)
    def callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        nonlocal shown
        if level != GGML_LOG_CONT:  # (a continued line goes where its first went)
            shown = level == GGML_LOG_WARN and TRAINING_OVERFLOW_WARNING not in text
            shown = shown or (level == GGML_LOG_ERROR and not aborting())
        if shown:
            sys.stderr.write(text.decode("utf-8", "replace"))
            sys.stderr.flush()

    ll.llama_log_set(callback, ctypes.c_void_p(0))
    return callback


class Branch:
    """One of a job's sequences, its ``index``-th choice: its sampler and its text."""

    __slots__ = ("chain", "finish", "index", "job", "seq", "text")

    def __init__(self, job: Job, index: int, chain: Any) -> None:
        request = job.request
        self.job = job
        self.index = index
        self.chain = chain  # None once freed
        self.finish: str | None = None
        self.seq = Sequence(
            request.id if index == 0 else f"{request.id}/{index}",
            tuple(request.tokens),
            request.max_new_tokens,
            priority=request.priority,
            tpot_s=request.tpot_ms / 1000,
            gap_s=request.gap_ms / 1000,
            ttft_s=request.ttft_ms / 1000,
            expected=request.expect,
            alone=request.alone,
        )
        self.text = Text(request.stop)


class Job:
    """A run request: its ``n`` sequences (the first submitted at once, the others forked from
    it once it has fed the prompt) and the tokens they have generated together."""

    __slots__ = ("branches", "forked", "generated", "key", "logprobs", "request", "suspended")

    def __init__(self, request: msg.Run) -> None:
        self.request = request
        self.key = request.id
        self.logprobs = request.logprobs
        self.branches: list[Branch] = []
        self.forked = request.n == 1
        self.generated = 0
        self.suspended = False

    @property
    def finished(self) -> bool:
        return all(branch.finish is not None for branch in self.branches)


class Worker:
    """The step loop: requests in, one decode, samples out."""

    def __init__(self, model: Model, scheduler: Scheduler, out: BinaryIO) -> None:
        self.model = model
        self.scheduler = scheduler
        self.out = out
        self.jobs: dict[str, Job] = {}
        self.branches: dict[str, Branch] = {}  # by their sequences' keys
        self.acks = 0  # cancels handled since the last event
        self._rates_at = 0  # the steps observed when the next step event says the rates
        self.embedder: Embedder | None = None
        # While a step feeds prompts of this priority or less urgent, a run more urgent than
        # it preempts the step (-1: the step in progress cannot be preempted).
        self.preemptible_above = -1
        self.waiting = False  # jobs wait at the daemon's doors for a slot
        self.freed = 0  # slots the last step freed that no run has taken since (see refill)
        self.unoffered: set[str] = set()  # jobs it ended whose slots the daemon has not offered

    def arrived(self, request: msg.Request) -> None:
        """Called by the request reader as a request arrives, while a step may be running."""
        if isinstance(request, msg.Run) and preempts(request.priority, self.preemptible_above):
            self.model.preempt.set()

    def handle(self, request: msg.Request) -> None:
        if isinstance(request, msg.Run):
            self.freed = max(self.freed - request.n, 0)
            self._start(request)
        elif isinstance(request, msg.Waiting):
            self.waiting = request.jobs
        elif isinstance(request, msg.Offered):
            self.unoffered.discard(request.id)
        elif isinstance(request, msg.Cancel):
            self._drop(request.id)
            self.acks += 1
        elif isinstance(request, msg.Embed):
            self._embed(request)
        elif isinstance(request, msg.Suspend | msg.Resume):
            self._pause(request.id, isinstance(request, msg.Suspend))

    def _pause(self, key: str, suspend: bool) -> None:
        """Suspend or resume a job's sequences (those not finished; a job already finished or
        gone: nothing)."""
        job = self.jobs.get(key)
        if job is None or job.suspended == suspend:
            return
        job.suspended = suspend
        for branch in job.branches:
            if branch.finish is None:
                if suspend:
                    self.scheduler.suspend(branch.seq.key)
                else:
                    self.scheduler.resume(branch.seq.key)

    def _embed(self, request: msg.Embed) -> None:
        """Embed the texts between two steps (an empty step event after each embedding step:
        the daemon hears from the worker while it embeds)."""
        vectors: list[list[float]] = []
        try:
            if self.embedder is None:
                self.embedder = Embedder(self.model)
            for group in self.embedder.embed(request.texts):
                vectors += group
                self._emit([], [])
        except EmbedFailed as exc:
            emit(self.out, msg.Embedded(request.id, error=str(exc)))
            return
        emit(self.out, msg.Embedded(request.id, vectors))

    def _start(self, request: msg.Run) -> None:
        job = Job(request)
        for index in range(request.n):
            chain = self.model.sampler(request, index)
            if chain is None:
                self._free(job)
                self._emit([], [msg.Done(job.key, error="its grammar does not parse")])
                return
            job.branches.append(Branch(job, index, chain))
        self.jobs[job.key] = job
        for branch in job.branches:
            self.branches[branch.seq.key] = branch
        self.scheduler.submit(job.branches[0].seq)

    def _drop(self, key: str, *, keep: bool = True) -> Job | None:
        """Take a job out, finished or not (its sequences' cells stay unless ``keep`` is
        False); None when it is not here."""
        job = self.jobs.pop(key, None)
        if job is None:
            return None  # finished already
        for branch in job.branches:
            if self.branches.pop(branch.seq.key, None) is not None:
                self.scheduler.remove(branch.seq.key, keep=keep)
        self._free(job)
        return job

    def _free(self, job: Job) -> None:
        for branch in job.branches:
            if branch.chain is not None:
                self.model.free_sampler(branch.chain)
                branch.chain = None

    @property
    def busy(self) -> bool:
        """It has a job to step (one not suspended)."""
        return any(not job.suspended for job in self.jobs.values())

    @property
    def refilling(self) -> bool:
        """The last step freed slots that the daemon has not yet offered to the jobs waiting,
        or runs have not yet taken: the next step waits for them (:func:`refill`)."""
        return self.freed > 0 and bool(self.unoffered)

    def step(self) -> None:
        self.freed = 0
        self.unoffered.clear()
        started = time.perf_counter()
        scheduler = self.scheduler
        entries = scheduler.plan(started)
        if not entries:
            if self.acks:
                self._emit([], [])
            return
        above = preemptible_above(entries)  # (the scheduler decides; this carries it out)
        if above >= 0:
            self.model.preempt.clear()
            self.preemptible_above = above
        status, sampled = self.model.decode(entries, preemptible=above >= 0)
        self.preemptible_above = -1
        preempted = status == 2 and above >= 0
        after_step(entries, preempted=preempted)
        if preempted:
            return
        tokens = sum(len(e.tokens) for e in entries)
        cells = scheduler.occupied + tokens
        scheduler.advance(entries)
        if status != 0:
            # Admission reserves every job's cells, so this is a fault, not a full cache.
            failed = {self.branches[e.seq.key].job.key for e in entries}
            for key in failed:
                self._drop(key, keep=False)
            self._emit(
                [], [msg.Done(key, error=f"llama_decode returned {status}") for key in failed]
            )
            return
        fed = {e.seq.key: e.seq.fed for e in entries if e.seq.prefilling and not e.seq.recomputing}
        out: list[msg.Out] = []
        done: list[msg.Done] = []
        samplers = (e for e in entries if e.sample)
        for entry, index in zip(samplers, sampled, strict=True):
            branch = self.branches[entry.seq.key]
            forks = self._fork(branch) if not branch.job.forked else []
            for each in (branch, *forks):
                self._sample(each, index, out, done)
        self._emit(out, done, fed)
        scheduler.costs.observe(tokens, len(sampled), cells, time.perf_counter() - started)

    def _fork(self, first: Branch) -> list[Branch]:
        """The job's other sequences, now that ``first`` has fed the prompt: those forked from
        it (they sample from its logits now); the others wait for a sequence id."""
        job = first.job
        job.forked = True
        forked = []
        for branch in job.branches[1:]:
            if self.scheduler.fork(first.seq, branch.seq):
                forked.append(branch)
            else:
                self.scheduler.submit(branch.seq)
        return forked

    def _emit(
        self, out: list[msg.Out], done: list[msg.Done], fed: dict[str, int] | None = None
    ) -> None:
        rates = self.rates() if self.scheduler.costs.observed >= self._rates_at else None
        emit(self.out, msg.Step(self.scheduler.used, self.acks, fed or {}, out, done, rates))
        self.acks = 0

    def rates(self) -> tuple[float, float, float]:
        """What a prompt token and a generated token cost now: a prompt's through the layers,
        a step's with every slot generating over the cells in use (attention over cells not in
        use would be a guess: the calibration's steps hold a few dozen), and how much that step
        grows a cell more; the next are said ``RATES_EVERY`` steps on."""
        scheduler = self.scheduler
        self._rates_at = scheduler.costs.observed + RATES_EVERY
        costs, slots = scheduler.costs, scheduler.slots
        cells = scheduler.occupied + slots
        step = costs.decode(slots, cells)
        return costs.per_token(0), step, max(costs.decode(slots, cells + 1024) - step, 0.0) / 1024

    def _sample(self, branch: Branch, index: int, out: list[msg.Out], done: list[msg.Done]) -> None:
        model, seq, job = self.model, branch.seq, branch.job
        token = model.sample(branch.chain, index)
        finish = None
        if model.is_eog(token) and not job.request.ignore_eos:
            finish = "stop"
        else:
            seq.generated += 1
            job.generated += 1
            seq.last_at = time.perf_counter()
            if seq.generated == 1:
                seq.first_at = seq.last_at
            note = model.scores(index, token, job.logprobs) if job.logprobs is not None else None
            if branch.text.add(model.piece(token), note):
                finish = "stop"
            elif seq.generated >= seq.max_new_tokens:
                finish = "length"
            else:
                seq.pending = token
        self._let_out(branch, out, final=finish is not None)
        if finish is not None:
            self._finish(branch, finish, done)

    def _let_out(self, branch: Branch, out: list[msg.Out], *, final: bool) -> None:
        """The sequence's text that can go now, with its tokens' log probabilities."""
        job, text = branch.job, branch.text
        delta = text.delta(final=final, whole=job.logprobs is not None)
        lp = None
        if job.logprobs is not None and text.fresh:
            lp = [self._entry(text, i) for i in text.fresh]
        elif not delta:
            return
        out.append(msg.Out(job.key, branch.index, delta, job.generated, lp))

    def _entry(self, text: Text, i: int) -> dict[str, Any]:
        """The ``i``-th token's log probabilities, in OpenAI's chat shape."""
        logprob, top = text.notes[i]
        piece = self.model.piece
        return {
            "token": text.token(i),
            "logprob": logprob,
            "bytes": list(text.pieces[i]),
            "top_logprobs": [
                {"token": piece(t).decode(errors="replace"), "logprob": p, "bytes": list(piece(t))}
                for t, p in top
            ],
        }

    def _finish(self, branch: Branch, finish: str, done: list[msg.Done]) -> None:
        """The sequence is over; its job too once all its sequences are."""
        branch.finish = finish
        self.branches.pop(branch.seq.key, None)
        self.scheduler.remove(branch.seq.key)
        if branch.chain is not None:
            self.model.free_sampler(branch.chain)
            branch.chain = None
        job = branch.job
        if not job.finished:
            return
        del self.jobs[job.key]
        if not job.request.alone:  # (the probe holds no slot of the daemon's)
            self.freed += len(job.branches)
            self.unoffered.add(job.key)
        ends = [msg.Ended(b.text.text, b.finish or "stop") for b in job.branches]
        done.append(msg.Done(job.key, ends, job.generated, job.branches[0].seq.reused))


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m governor.runners.llama.worker")
    parser.add_argument("--model", required=True)
    parser.add_argument("--cells", type=int, required=True, help="KV cache cells")
    parser.add_argument("--slots", type=int, required=True, help="sequences at once")
    parser.add_argument(
        "--n-ctx", type=int, required=True, help="the longest sequence (prompt + output)"
    )
    parser.add_argument("--step-tokens", type=int, required=True)
    parser.add_argument("--min-chunk", type=int, default=KNEE, help="a prompt chunk's least")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--n-gpu-layers", type=int, default=0)
    parser.add_argument("--refill-ms", type=float, default=REFILL_MS, help="see Refills")
    parser.add_argument("--kv-cache-type", choices=("f16", "q8_0"), default="f16")
    parser.add_argument("--kv-layout", choices=("pool", "slots"), default="pool")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but events may reach the daemon's pipe

    try:
        model = Model(args)
    except Refused as exc:
        emit(out, msg.Refused(str(exc)))
        return 2
    scheduler = Scheduler(
        model.slots,
        args.step_tokens,
        model.size,
        model,
        knee=args.min_chunk,
        keep=0 if model.streams else args.n_ctx,  # (a slot's kept cells cost no other slot)
        lowest=model.streams,
    )
    worker = Worker(model, scheduler, io.BytesIO())
    # The first evaluation after loading is slow (buffers are set up): pay it before "ready".
    worker.handle(greedy_request("warm-up", model.tokenize(b"Hello"), 2))
    while worker.busy:
        worker.step()
    calibrate(worker)
    worker.out = out
    emit(out, msg.Ready(model.cells, args.slots, model.n_ctx_train, worker.rates()))

    inbox: queue.SimpleQueue[msg.Request] = queue.SimpleQueue()

    def read() -> None:
        for line in sys.stdin.buffer:
            request = msg.decode_request(line)
            worker.arrived(request)
            inbox.put(request)
        inbox.put(msg.Exit())  # the daemon closed our stdin

    threading.Thread(target=read, daemon=True).start()
    while True:
        # Block while idle; between steps, take whatever has arrived, in order.
        request: msg.Request | None = inbox.get() if not worker.busy else _poll(inbox)
        while request is not None:
            if isinstance(request, msg.Exit):
                return 0
            worker.handle(request)
            request = _poll(inbox)
        worker.step()
        if worker.waiting and worker.refilling and not refill(worker, inbox, args.refill_ms / 1000):
            return 0


def greedy_request(key: str, tokens: list[int], max_new_tokens: int) -> msg.Run:
    """A greedy run request (the worker's own: warm-up, calibration)."""
    return msg.Run(id=key, tokens=tokens, max_new_tokens=max_new_tokens, seed=0, ignore_eos=True)


def calibrate(worker: Worker) -> None:
    """Steps of known shape, for the step-cost model's first figures: a prompt alone, a prompt
    beside a generating sequence, two generating, one (about 80 tokens in all, scaled down
    for a tiny cache)."""
    model, scheduler = worker.model, worker.scheduler
    scheduler.costs = StepCosts()  # (the warm-up's first step is no measure of any other)
    size = scheduler.cells
    text = b"The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 8
    first = model.tokenize(text)[: max(min(48, size // 3), 2)]
    second = model.tokenize(text[::-1])[: max(min(16, size // 8), 1)]
    worker.handle(greedy_request("calibration-1", first, 6))
    worker.step()
    worker.handle(greedy_request("calibration-2", second, 4))
    while worker.busy:
        worker.step()


def refill(worker: Worker, inbox: queue.SimpleQueue[msg.Request], limit_s: float) -> bool:
    """Wait, ``limit_s`` at most, until the daemon has offered every slot the last step freed
    (it said jobs wait for one) or runs have taken them all, handling what comes meanwhile;
    False: it said exit."""
    deadline = time.perf_counter() + limit_s
    while worker.refilling and (left := deadline - time.perf_counter()) > 0:
        try:
            request = inbox.get(timeout=left)
        except queue.Empty:
            break
        if isinstance(request, msg.Exit):
            return False
        worker.handle(request)
    return True


def _poll(inbox: queue.SimpleQueue[msg.Request]) -> msg.Request | None:
    try:
        return inbox.get_nowait()
    except queue.Empty:
        return None


if __name__ == "__main__":
    sys.exit(main())
