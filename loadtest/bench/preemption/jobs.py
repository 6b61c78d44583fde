"""``bench preemption``'s daemon and jobs: the governor it starts and stops, a job run on it
to its end, its metrics, every wait bounded by the run's deadline."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from clients import ClientError, GovernorClient, RetryPolicy
from governor.runners.llama.runner import embedded_model_path
from protocol.spec import JobSpec

from ...support import llama_server
from ...support.connections import HINT_CAP_S, run_loop
from ...support.processes import REPO, free_port, stop, wait_http_ready, wait_listening
from ...support.replicas import Replica, Sample, by_label, total

HOST = "127.0.0.1"
# The hints honoured, up to the daemon's longest (bounded by --timeout).
RETRY = RetryPolicy(max_attempts=100_000, max_sleep_s=HINT_CAP_S)
SAMPLE_S = 0.1
POLL_S = 0.02
READY_TIMEOUT_S = 180.0
WARMUP = JobSpec(prompt="Hello", max_new_tokens=4, temperature=0.0, ignore_eos=True)
T = TypeVar("T")


class Job:
    """One generate call on a connection of its own: when it started, its first token, its end."""

    def __init__(self, name: str, spec: JobSpec) -> None:
        self.name = name
        self.spec = spec
        self.started: float | None = None
        self.first_token: float | None = None
        self.ended: float | None = None
        self.chars = 0  # of its text streamed so far
        self.report: dict[str, Any] = {"name": name}

    def on_delta(self, text: str) -> None:
        if self.first_token is None:
            self.first_token = time.monotonic()
        self.chars += len(text)

    async def run(self, port: int, deadline: float) -> dict[str, Any]:
        try:
            async with await GovernorClient.connect(HOST, port, timeout=left(deadline)) as client:
                self.started = time.monotonic()
                got = await client.generate(
                    self.spec, retry=RETRY, timeout=left(deadline), on_delta=self.on_delta
                )
        except (ClientError, OSError, TimeoutError) as exc:
            self.ended = time.monotonic()
            self.report["error"] = f"{type(exc).__name__}: {exc}"
            return self.report
        self.ended = time.monotonic()
        result = got.reply.result or {}
        self.report.update(
            status=str(got.reply.status),
            need_code=got.reply.need_code,
            wall_s=round(self.ended - self.started, 3),
            ttft_s=None if self.first_token is None else round(self.first_token - self.started, 3),
            server_ttft_ms=result.get("ttft_ms"),
            prompt_tokens=result.get("prompt_tokens"),
            completion_tokens=result.get("completion_tokens"),
            degraded=result.get("degraded"),
            yields=len(got.yields),
            yield_codes=dict(collections.Counter(str(y.need_code) for y in got.yields)),
            yield_hints_ms=[y.retry_hint_ms for y in got.yields],
            text=str(result.get("text", "")),
        )
        if not got.done:
            self.report["error"] = f"{got.reply.status} {got.reply.need_code}"
        return self.report


def left(deadline: float) -> float:
    """Seconds to ``deadline``; TimeoutError when none are left."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("the run's --timeout passed")
    return remaining


async def until(done: Callable[[], bool], deadline: float) -> None:
    while not done():
        left(deadline)
        await asyncio.sleep(POLL_S)


async def metrics(d: Replica) -> list[Sample]:
    """Its /metrics, or ``RuntimeError`` when it does not answer."""
    samples = await d.metrics()
    if samples is None:
        raise RuntimeError(f"{d.name} did not answer /metrics: {d.log_tail(1500)}")
    return samples


@contextlib.contextmanager
def daemon(args: argparse.Namespace, folder: Path, deadline: float) -> Iterator[Replica]:
    """``governor serve --lanes true`` on the embedded model, ready; with ``--sidecar``, in
    front of a llama-server of ``--slots`` slots (``-np``, 2,048 tokens each) on the same
    model instead. Each stopped by its PID."""
    with contextlib.ExitStack() as stack:
        runner: tuple[str, ...]
        if args.sidecar:
            upstream = stack.enter_context(upstream_server(args, folder, deadline))
            runner = ("--runner", "http", "--upstream", upstream)
        else:
            runner = ("--threads", str(args.threads))
        yield stack.enter_context(governor(args, folder, deadline, runner))


@contextlib.contextmanager
def upstream_server(args: argparse.Namespace, folder: Path, deadline: float) -> Iterator[str]:
    """llama-server on the embedded model; its URL, once it answers."""
    port = free_port()
    command = upstream_command(args, port)
    with (folder / f"llama-server-{port}.log").open("wb") as out:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        url = f"http://{HOST}:{port}"
        wait_http_ready(proc, url + llama_server.READY_PATH, "llama-server", left(deadline))
        yield url
    finally:
        stop(proc)


def upstream_command(args: argparse.Namespace, port: int) -> list[str]:
    """llama-server of ``--upstream-slots`` (else ``--slots``) slots of 2,048 tokens each."""
    slots = args.upstream_slots or args.slots
    return llama_server.command(
        args.llama_server,
        embedded_model_path(),
        port=port,
        slots=slots,
        ctx=slots * 2048,
        threads=args.threads,
    )


@contextlib.contextmanager
def governor(
    args: argparse.Namespace, folder: Path, deadline: float, runner: tuple[str, ...]
) -> Iterator[Replica]:
    port, metrics_port = free_port(), free_port()
    log = folder / f"governor-{port}.log"
    command = [
        *(sys.executable, "-m", "governor", "serve", "--lanes", "true", *runner),
        *("--listen", f"{HOST}:{port}", "--metrics-listen", f"{HOST}:{metrics_port}"),
        *("--max-inflight", str(args.slots)),
        *("--log-level", "warning", "--shutdown-grace", "2"),
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
    found = Replica("governor", proc, port, metrics_port, log, args.slots)
    try:
        wait_for = min(READY_TIMEOUT_S, left(deadline))
        try:
            wait_listening(port, proc, wait_for)
            ready = f"http://{HOST}:{metrics_port}/healthz/ready"
            wait_http_ready(proc, ready, "governor", min(wait_for, left(deadline)))
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: {found.log_tail(1500)}") from None
        yield found
    finally:
        stop(proc)


async def bounded(work: Awaitable[T], deadline: float) -> T:
    async with asyncio.timeout(left(deadline)):
        return await work


def in_loop(work: Callable[[], Awaitable[T]], deadline: float) -> T:
    async def main() -> T:
        return await bounded(work(), deadline)

    return run_loop(main())


async def warm(d: Replica, deadline: float) -> None:
    """One tiny job first: the parts measured do not pay for the worker's first step."""
    report = await Job("warm-up", WARMUP).run(d.port, deadline)
    if "error" in report:
        raise RuntimeError(f"the warm-up job failed: {report['error']}")


def counters(samples: list[Sample]) -> dict[str, Any]:
    return {
        "suspensions": by_label(samples, "governor_suspensions_total", "lane"),
        "resumes": by_label(samples, "governor_resumes_total", "lane"),
        "overload_transitions": total(samples, "governor_overload_transitions_total"),
        "overload_state": total(samples, "governor_overload_state"),
    }


def since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The counters' growth (by lane for the labelled ones); the overload state at the end."""
    grown: dict[str, Any] = {"overload_state": after["overload_state"]}
    for key in ("suspensions", "resumes"):
        grown[key] = {k: int(v - before[key].get(k, 0)) for k, v in after[key].items()}
    grown["overload_transitions"] = int(
        after["overload_transitions"] - before["overload_transitions"]
    )
    return grown
