"""A llama.cpp worker process: one model, one context, many sequences batched over one KV cache.

Started by :class:`governor.runners.llama.LlamaRunner` as ``python -m
governor.runners.llama_worker``. It speaks JSON lines: requests on stdin, events on stdout,
diagnostics on stderr. A crash here (a segfault in the native code, an out-of-memory kill) is
seen by the daemon as the end of stdout and costs the jobs in hand, which abort.

    stdin:  {"op": "run", "id": str, "tokens": [int], "max_new_tokens": int, "priority": int,
             "ttft_ms": float, "tpot_ms": float, "stall": float, "temperature": float,
             "top_p": float, "top_k": int, "min_p": float, "seed": int | null,
             "stop": [str], "ignore_eos": bool}
            {"op": "cancel", "id": str}
    stdout: {"ev": "ready", "cells": int, "slots": int, "n_ctx_train": int}
                                                                once, after loading and warming up
            {"ev": "refused", "error": str}                     instead, for an ``--n-ctx`` the
                                                                model was not trained for; exit 2
            {"ev": "step", "kv": int, "acks": int, "f": {id: int}, "out": {id: text},
             "n": {id: int}, "done": [{"id": str, "text": str, "completion_tokens": int,
             "cached_tokens": int, "finish_reason": "stop" | "length" | "error",
             "error"?: str}]}
                                                                after each decode step

Each step is one ``llama_decode`` of the batch :class:`~.batching.Scheduler` plans: one token
of every generating sequence and chunks of pending prompts, cut to fit the generating
sequences' ``tpot_ms`` and ``stall`` and the first-token deadlines ``ttft_ms`` after each
job's arrival (the step budget, in that module). ``out`` holds the text each sequence produced
in the step (left out when empty) and ``n`` how many tokens it has generated so far (for the
same sequences), ``f`` how many prompt tokens each sequence whose prompt is still being fed has
in the cache, ``kv`` the cache cells held after it,
``acks`` how many cancels were handled since the last event; ``cached_tokens`` is how much of
a job's prompt was already in the cache (a prefix kept from an earlier job, or shared). Requests are read between steps,
in the order sent: a cancel stops its sequence before the next step and frees its cells at once
(an event with nothing else in it says so when no step follows), and a run sent after a cancel
or a finished job always finds their cells free.

Every step is timed, from its planning to its event, and the time taught to the scheduler's
:class:`~.stepcost.StepCosts` (a preempted or failed step teaches nothing). Before "ready", a
few calibration steps of known shape (prompts and generating sequences side by side) give the
model its first figures on this model and device.

Tokens are sampled by llama.cpp's own sampler chain, one per sequence (top_k, top_p, min_p,
temperature, then a seeded draw; greedy at temperature 0).

**Preemption.** A step that feeds the prompt of a less urgent job (a rewrite) can be long; a
run request for a more urgent one (a chat) that arrives meanwhile aborts it (llama.cpp's abort
callback, checked between the graph's operations on the CPU; llama.cpp takes the step's tokens
back out of the cache), and the next step starts with the chat's prompt. The rewrite loses
that step's work, and is preempted at most ``MAX_PASSED`` times in a row. (The health probe,
least urgent of all, preempts nothing.)
"""

from __future__ import annotations

import argparse
import codecs
import ctypes
import io
import queue
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from .batching import MAX_PASSED, Entry, Scheduler, Sequence
from .stepcost import StepCosts

PROBE_SLOTS = 1  # a sequence beyond the admitted ones, for the health probe
PROBE_CELLS = 16  # and the cells its job (a few prompt tokens, one generated) needs
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


def emit(out: BinaryIO, event: dict[str, Any]) -> None:
    out.write(orjson.dumps(event) + b"\n")
    out.flush()


class Text:
    """A sequence's output: incremental UTF-8 decoding, stop strings, and the end of the text
    that could still be the start of a stop string, held back until it cannot."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.sent = 0  # characters of self.text already emitted

    def add(self, piece: bytes) -> bool:
        """Append a token's bytes; True when a stop string has appeared (the text ends there)."""
        self.text += self.decoder.decode(piece)
        cuts = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.text = self.text[: min(cuts)]
            return True
        return False

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

    def delta(self, *, final: bool) -> str:
        if final:
            self.text += self.decoder.decode(b"", final=True)
        upto = len(self.text) if final else max(len(self.text) - self._partial(), self.sent)
        delta = self.text[self.sent : upto]
        self.sent = upto
        return delta


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
        self.n_ctx_train = ll.llama_model_n_ctx_train(self.model)
        refusal = context_refusal(args.n_ctx, self.n_ctx_train, Path(args.model).name)
        if refusal is not None:
            ll.llama_model_free(self.model)
            raise Refused(refusal)
        self.slots = args.slots + PROBE_SLOTS
        self.batch_size = args.step_tokens + self.slots
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = args.cells + PROBE_CELLS
        cparams.n_batch = cparams.n_ubatch = self.batch_size
        cparams.n_seq_max = self.slots
        cparams.n_threads = cparams.n_threads_batch = args.threads
        cparams.kv_unified = True  # one pool of cells that any sequence may take
        if args.kv_type == "q8_0":  # (llama.cpp quantises the V cache only with flash attention)
            cparams.type_k = cparams.type_v = ll.GGML_TYPE_Q8_0
            cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cparams.no_perf = True
        self.ctx = ll.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise SystemExit("cannot create the llama.cpp context (out of memory?)")
        self.size = ll.llama_n_ctx(self.ctx)
        self.cells = self.size - PROBE_CELLS
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
            return self.ll.llama_decode(self.ctx, batch), sampled
        finally:
            self._set_abort(self.ctx, self._no_abort, None)

    def forget(self, slot: int, start: int) -> None:
        self.ll.llama_memory_seq_rm(self.memory, slot, start, -1)

    def share(self, source: int, slot: int, length: int) -> None:
        self.ll.llama_memory_seq_cp(self.memory, source, slot, 0, length)

    def sampler(self, request: dict[str, Any]) -> Any:
        ll = self.ll
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        temperature = request["temperature"]
        if temperature <= 0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
            return chain
        if request["top_k"] > 0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(request["top_k"]))
        if request["top_p"] < 1:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_p(request["top_p"], 1))
        if request["min_p"] > 0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_min_p(request["min_p"], 1))
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_temp(temperature))
        seed = request["seed"] if request["seed"] is not None else random.randrange(2**31)
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dist(seed))
        return chain

    def sample(self, chain: Any, index: int) -> int:
        return int(self.ll.llama_sampler_sample(chain, self.ctx, index))

    def free_sampler(self, chain: Any) -> None:
        self.ll.llama_sampler_free(chain)

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


class Job:
    """A running sequence's state beside the scheduler's: its sampler and its text."""

    __slots__ = ("chain", "request", "seq", "text")

    def __init__(self, model: Model, request: dict[str, Any]) -> None:
        self.request = request
        self.seq = Sequence(
            request["id"],
            tuple(request["tokens"]),
            request["max_new_tokens"],
            priority=request["priority"],
            tpot_s=request.get("tpot_ms", 0.0) / 1000,
            stall=request.get("stall", 0.0),
            ttft_s=request.get("ttft_ms", 0.0) / 1000,
        )
        if ttft_ms := request.get("ttft_ms", 0.0):
            self.seq.deadline = time.perf_counter() + ttft_ms / 1000
        self.chain = model.sampler(request)
        self.text = Text(request["stop"])


class Worker:
    """The step loop: requests in, one decode, samples out."""

    def __init__(self, model: Model, scheduler: Scheduler, out: BinaryIO) -> None:
        self.model = model
        self.scheduler = scheduler
        self.out = out
        self.jobs: dict[str, Job] = {}
        self.acks = 0  # cancels handled since the last event
        # While a step feeds prompts of this priority or less urgent, a run more urgent than
        # it preempts the step (-1: the step in progress cannot be preempted).
        self.preemptible_above = -1

    def arrived(self, request: dict[str, Any]) -> None:
        """Called by the request reader as a request arrives, while a step may be running."""
        if request["op"] == "run" and request["priority"] < self.preemptible_above:
            self.model.preempt.set()

    def handle(self, request: dict[str, Any]) -> None:
        if request["op"] == "run":
            job = Job(self.model, request)
            self.jobs[job.seq.key] = job
            self.scheduler.submit(job.seq)
        elif request["op"] == "cancel":
            self._end(request["id"])
            self.acks += 1

    def _end(self, key: str, *, keep: bool = True) -> Job | None:
        job = self.jobs.pop(key, None)
        if job is None:
            return None  # finished already
        self.scheduler.remove(key, keep=keep)
        self.model.free_sampler(job.chain)
        return job

    @property
    def busy(self) -> bool:
        return bool(self.jobs)

    def step(self) -> None:
        started = time.perf_counter()
        scheduler = self.scheduler
        entries = scheduler.plan(started)
        if not entries:
            if self.acks:
                self._emit({}, {}, [])
            return
        prefill = [e.seq for e in entries if e.seq.prefilling]
        preemptible = bool(prefill) and all(
            seq.priority > 0 and seq.preempted < MAX_PASSED for seq in prefill
        )
        if preemptible:
            self.model.preempt.clear()
            self.preemptible_above = min(seq.priority for seq in prefill)
        status, sampled = self.model.decode(entries, preemptible=preemptible)
        self.preemptible_above = -1
        if status == 2 and preemptible:
            for seq in prefill:
                seq.preempted += 1  # nothing of the step is in the cache: plan again
            return
        for seq in prefill:
            seq.preempted = 0
        tokens = sum(len(e.tokens) for e in entries)
        cells = scheduler.occupied + tokens
        scheduler.advance(entries)
        out: dict[str, str] = {}
        counts: dict[str, int] = {}
        done: list[dict[str, Any]] = []
        if status != 0:
            # Admission reserves every job's cells, so this is a fault, not a full cache.
            for entry in entries:
                if (job := self._end(entry.seq.key, keep=False)) is not None:
                    done.append(self._done(job, "error", f"llama_decode returned {status}"))
            self._emit(out, counts, done)
            return
        fed = {e.seq.key: e.seq.fed for e in entries if e.seq.prefilling}
        samplers = (e for e in entries if e.sample)
        for entry, index in zip(samplers, sampled, strict=True):
            self._sample(self.jobs[entry.seq.key], index, out, counts, done)
        self._emit(out, counts, done, fed)
        scheduler.costs.observe(tokens, len(sampled), cells, time.perf_counter() - started)

    def _emit(
        self,
        out: dict[str, str],
        counts: dict[str, int],
        done: list[dict[str, Any]],
        fed: dict[str, int] | None = None,
    ) -> None:
        event = {"ev": "step", "kv": self.scheduler.used, "acks": self.acks, "f": fed or {}}
        emit(self.out, {**event, "out": out, "n": counts, "done": done})
        self.acks = 0

    def _sample(
        self,
        job: Job,
        index: int,
        out: dict[str, str],
        counts: dict[str, int],
        done: list[dict[str, Any]],
    ) -> None:
        model, seq = self.model, job.seq
        token = model.sample(job.chain, index)
        finish = None
        if model.is_eog(token) and not job.request["ignore_eos"]:
            finish = "stop"
        else:
            seq.generated += 1
            if seq.generated == 1:
                seq.first_at = time.perf_counter()
            if job.text.add(model.piece(token)):
                finish = "stop"
            elif seq.generated >= seq.max_new_tokens:
                finish = "length"
            else:
                seq.pending = token
        if finish is None:
            if delta := job.text.delta(final=False):
                out[seq.key] = delta
                counts[seq.key] = seq.generated
            return
        if delta := job.text.delta(final=True):
            out[seq.key] = delta
            counts[seq.key] = seq.generated
        self._end(seq.key)
        done.append(self._done(job, finish))

    @staticmethod
    def _done(job: Job, finish: str, error: str | None = None) -> dict[str, Any]:
        event = {
            "id": job.seq.key,
            "text": job.text.text,
            "completion_tokens": job.seq.generated,
            "cached_tokens": job.seq.reused,
            "finish_reason": finish,
        }
        if error is not None:
            event["error"] = error
        return event


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m governor.runners.llama_worker")
    parser.add_argument("--model", required=True)
    parser.add_argument("--cells", type=int, required=True, help="KV cache cells")
    parser.add_argument("--slots", type=int, required=True, help="sequences at once")
    parser.add_argument(
        "--n-ctx", type=int, required=True, help="the longest sequence (prompt + output)"
    )
    parser.add_argument("--step-tokens", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--n-gpu-layers", type=int, default=0)
    parser.add_argument("--kv-type", choices=("f16", "q8_0"), default="f16")
    args = parser.parse_args(argv)
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but events may reach the daemon's pipe

    try:
        model = Model(args)
    except Refused as exc:
        emit(out, {"ev": "refused", "error": str(exc)})
        return 2
    scheduler = Scheduler(model.slots, args.step_tokens, model.size, model)
    worker = Worker(model, scheduler, io.BytesIO())
    # The first evaluation after loading is slow (buffers are set up): pay it before "ready".
    worker.handle(_private("warm-up", model.tokenize(b"Hello"), 2))
    while worker.busy:
        worker.step()
    calibrate(worker)
    worker.out = out
    emit(
        out,
        {
            "ev": "ready",
            "cells": model.cells,
            "slots": args.slots,
            "n_ctx_train": model.n_ctx_train,
        },
    )

    inbox: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()

    def read() -> None:
        for line in sys.stdin.buffer:
            request = orjson.loads(line)
            worker.arrived(request)
            inbox.put(request)
        inbox.put({"op": "exit"})  # the daemon closed our stdin

    threading.Thread(target=read, daemon=True).start()
    while True:
        # Block while idle; between steps, take whatever has arrived, in order.
        request: dict[str, Any] | None = inbox.get() if not worker.busy else _poll(inbox)
        while request is not None:
            if request["op"] == "exit":
                return 0
            worker.handle(request)
            request = _poll(inbox)
        worker.step()


def _private(key: str, tokens: list[int], max_new_tokens: int) -> dict[str, Any]:
    """A greedy run request of the worker's own (warm-up, calibration)."""
    return {
        "op": "run",
        "id": key,
        "tokens": tokens,
        "max_new_tokens": max_new_tokens,
        "priority": 0,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "seed": 0,
        "stop": [],
        "ignore_eos": True,
    }


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
    worker.handle(_private("calibration-1", first, 6))
    worker.step()
    worker.handle(_private("calibration-2", second, 4))
    while worker.busy:
        worker.step()


def _poll(inbox: queue.SimpleQueue[dict[str, Any]]) -> dict[str, Any] | None:
    try:
        return inbox.get_nowait()
    except queue.Empty:
        return None


if __name__ == "__main__":
    sys.exit(main())
