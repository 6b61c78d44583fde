"""The queueing baseline's server: llama-cpp-python's own OpenAI-compatible server
(``python -m llama_cpp.server``), started with ``--interrupt_requests False`` so that it queues
every request (its default cuts a running stream short when the next request arrives). It
listens on 127.0.0.1 only and is stopped by its own PID (:func:`~.processes.stop`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .processes import wait_http_ready

READY_TIMEOUT_S = 120.0  # loading the model included


def command(model: Path, port: int, *, threads: int, n_ctx: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        str(threads),
        "--n_ctx",
        str(n_ctx),
        "--interrupt_requests",
        "False",
    ]


def start(
    model: Path, port: int, *, threads: int = 1, n_ctx: int = 2048, quiet: bool = True
) -> tuple[subprocess.Popen[bytes], str]:
    """Start the server and wait until it answers ``/v1/models``; returns it and its URL.

    Raises :class:`RuntimeError` (after stopping it) when it exits or is not ready in time.
    """
    output = subprocess.DEVNULL if quiet else None
    proc = subprocess.Popen(
        command(model, port, threads=threads, n_ctx=n_ctx),
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=output,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http_ready(proc, url + "/v1/models", "llama_cpp.server", READY_TIMEOUT_S)
    return proc, url
