"""``baseline``: the queueing peer the governor is compared with, on the same model.

llama-cpp-python's own OpenAI-compatible server (``python -m llama_cpp.server``), started with
``--interrupt_requests False`` so that it queues every request (its default cuts a running
stream short when the next request arrives): the faithful "accept everything" runner. It
listens on 127.0.0.1 only; load it with ``--openai URL`` on any traffic command. The server
is this command's child: stopped by its own PID on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from ..support.common import positive_int

NAME = "baseline"
READY_TIMEOUT_S = 120.0


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
    wait_ready(proc, url + "/v1/models", "llama_cpp.server")
    return proc, url


def wait_ready(
    proc: subprocess.Popen[bytes], url: str, what: str, timeout: float = READY_TIMEOUT_S
) -> None:
    """Poll ``url`` until it answers 200; stop ``proc`` and raise :class:`RuntimeError` when it
    exits first or ``timeout`` passes (a server still loading its model answers 503)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:  # (urllib's HTTPError, for a 503, is one too)
            if proc.poll() is not None or time.monotonic() > deadline:
                stop(proc)
                raise RuntimeError(f"{what} did not start (exit {proc.poll()})") from None
            time.sleep(0.3)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s; by PID, this process's own child only."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME, help="run the queueing baseline: llama-cpp-python's server", description=__doc__
    )
    parser.add_argument("--port", type=positive_int, default=8000, help="(default: 8000)")
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=2,
        help="n_threads: give it the cores the governor's workers share (default: 2)",
    )
    parser.add_argument("--n-ctx", type=positive_int, default=2048, help="(default: 2048)")
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the embedded model)")


def run(args: argparse.Namespace) -> int:
    from governor.runners.llama import embedded_model_path

    model = args.model or embedded_model_path()
    try:
        proc, url = start(model, args.port, threads=args.threads, n_ctx=args.n_ctx, quiet=False)
    except RuntimeError as exc:
        print(f"loadtest baseline: {exc}", file=sys.stderr)
        return 1
    print(
        f"baseline: llama_cpp.server on {model.name} at {url} (pid {proc.pid}); Ctrl-C stops it",
        flush=True,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        proc.wait()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        stop(proc)
    return 0
