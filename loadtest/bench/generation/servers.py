"""The targets of ``bench generation``: the command line each is started with, on a free
loopback port, and stopped by its PID (the package's docstring has them)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clients.client import RetryPolicy

from ...support import baseline_server, llama_server
from ...support.connections import Endpoint
from ...support.processes import (
    REPO,
    free_port,
    stop,
    wait_http_ready,
    wait_listening,
)
from ...support.targets import GovernorTarget, OpenAITarget, Shape, Target

TARGETS = ("governor", "governor-q8_0", "per-process", "llama-server", "llama-cpp-python")
DEFAULT_TARGETS = ("governor", "per-process", "llama-server")
GOVERNORS = ("governor", "governor-q8_0", "per-process")
READY_TIMEOUT_S = 180.0
RETRY = RetryPolicy(max_attempts=10_000, max_sleep_s=2.0)  # bounded by --timeout

# llama-server: the fields every request carries; burst requests also skip its prompt cache.
LLAMA_SERVER_EXTRA: dict[str, Any] = {
    "ignore_eos": True,
    "stream_options": {"include_usage": True},
}
COLD_EXTRA: dict[str, Any] = {"cache_prompt": False}


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """What every target is started with, from the options."""

    model: Path
    threads: int
    n_ctx: int
    server_ctx: int
    n_gpu_layers: int
    llama_server: Path
    governor_args: tuple[str, ...] = ()


def command(name: str, settings: Settings, *, slots: int, lanes: bool, port: int) -> list[str]:
    """The command line that starts target ``name`` with ``slots`` slots on ``port``."""
    if name == "llama-server":
        return llama_server.command(
            settings.llama_server,
            settings.model,
            port=port,
            slots=slots,
            ctx=settings.server_ctx,
            threads=settings.threads,
            n_gpu_layers=settings.n_gpu_layers,
            unified_kv=True,
        )
    if name == "llama-cpp-python":
        return baseline_server.command(
            settings.model, port, threads=settings.threads, n_ctx=settings.n_ctx
        )
    if name not in GOVERNORS:
        raise ValueError(f"no target {name!r}")
    # per-process: one worker per slot, --threads 0 (the governor's default: the cores shared
    # out among its workers), the runner that ran one sequence per worker process.
    workers, threads = (slots, 0) if name == "per-process" else (1, settings.threads)
    cache = ["--kv-cache-type", "q8_0"] if name == "governor-q8_0" else []
    return [
        sys.executable,
        "-m",
        "governor",
        "serve",
        "--runner",
        "llama",
        "--model",
        str(settings.model),
        "--listen",
        f"127.0.0.1:{port}",
        "--max-inflight",
        str(slots),
        "--workers",
        str(workers),
        "--threads",
        str(threads),
        "--n-ctx",
        str(settings.n_ctx),
        "--n-gpu-layers",
        str(settings.n_gpu_layers),
        "--lanes",
        "on" if lanes else "off",
        "--probe-interval",
        "600",
        "--log-level",
        "warning",
        *cache,
        *settings.governor_args,
    ]


@dataclass(slots=True)
class Instance:
    """One started target: its process (stopped by PID) and how to load it."""

    name: str
    proc: subprocess.Popen[bytes]
    argv: list[str]
    endpoint: Endpoint | None = None  # a governor
    url: str | None = None  # an OpenAI-compatible server
    extra: dict[str, Any] = field(default_factory=dict)  # in every request's body
    cold_extra: dict[str, Any] = field(default_factory=dict)  # ... and in the burst's

    def target(self, shape: Shape, cold: bool = False) -> Target:
        if self.endpoint is not None:
            return GovernorTarget(self.endpoint, shape, RETRY)
        assert self.url is not None
        extra = {**self.extra, **self.cold_extra} if cold else self.extra
        return OpenAITarget(self.url, shape, extra=extra)


def launch(name: str, settings: Settings, *, slots: int, lanes: bool, log: Path) -> Instance:
    """Start a target, its output to ``log``; wait until an HTTP server answers, or a governor
    listens. Blocking: nothing else runs meanwhile. Raises RuntimeError (with it stopped)."""
    port = free_port()
    argv = command(name, settings, slots=slots, lanes=lanes, port=port)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    if name == "llama-server":
        wait_http_ready(proc, url + llama_server.READY_PATH, name, READY_TIMEOUT_S)
        return Instance(name, proc, argv, url=url, extra=LLAMA_SERVER_EXTRA, cold_extra=COLD_EXTRA)
    if name == "llama-cpp-python":
        wait_http_ready(proc, url + "/v1/models", name, READY_TIMEOUT_S)
        return Instance(name, proc, argv, url=url)
    try:
        wait_listening(port, proc, READY_TIMEOUT_S)
    except BaseException:
        stop(proc)
        raise
    return Instance(name, proc, argv, endpoint=Endpoint("127.0.0.1", port))


async def start(name: str, settings: Settings, *, slots: int, lanes: bool, log: Path) -> Instance:
    """:func:`launch`, and for a governor its first ping answered: the port is bound before
    the workers load, and connections are served once they have."""
    inst = launch(name, settings, slots=slots, lanes=lanes, log=log)
    if inst.endpoint is None:
        return inst
    try:
        async with await inst.endpoint.connect(timeout=READY_TIMEOUT_S) as client:
            await client.ping(timeout=READY_TIMEOUT_S)
    except BaseException:
        stop(inst.proc)
        raise
    return inst
