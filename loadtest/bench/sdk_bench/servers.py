"""The servers of ``bench sdk-bench``: the governor with its front door, and the baseline it is
compared with, each started on a free loopback port."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ...support import baseline_server, llama_server
from ...support.processes import REPO, free_port, stop, wait_http_ready

READY_TIMEOUT_S = 180.0
API_KEY = "sdk-bench"  # the governor runs open (no tenants) and llama_cpp.server checks none


def governor_command(args: argparse.Namespace, model: Path, http_port: int) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "governor",
        "serve",
        "--runner",
        args.runner,
        "--listen",  # (its protocol listener, unused here: any free port)
        "127.0.0.1:0",
        "--http-listen",
        f"127.0.0.1:{http_port}",
        "--max-inflight",
        str(args.max_inflight),
        "--max-connections",
        str(max(1024, 2 * args.clients)),
        "--probe-interval",  # no readiness probe during the run
        "600",
        "--log-level",
        "warning",
    ]
    if args.runner == "llama":
        argv += ["--model", str(model), "--threads", str(args.threads)]
        argv += ["--n-ctx", str(args.n_ctx)]
    else:
        argv += ["--stub-ms", str(args.stub_ms)]
    return argv + list(args.governor_arg)


@dataclass(slots=True)
class Started:
    """A server of one run: its process (stopped by PID) and its API's base URL."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str  # ending in /v1
    argv: list[str]


def baseline_command(args: argparse.Namespace, model: Path, port: int) -> list[str]:
    """``--baseline``'s server: llama-cpp-python's, or llama-server with the governor's slots
    (``-np K``), each of ``--n-ctx`` tokens (its ``-c`` is all the slots' together)."""
    if args.baseline == "llama-server":
        return llama_server.command(
            args.llama_server,
            model,
            port=port,
            slots=args.max_inflight,
            ctx=args.n_ctx * args.max_inflight,
            threads=args.threads,
        )
    return baseline_server.command(model, port, threads=args.threads, n_ctx=args.n_ctx)


def launch(name: str, args: argparse.Namespace, model: Path, log: Path) -> Started:
    """Start ``name`` on a free loopback port, its output to ``log``, and wait until it is ready:
    ``/v1/models`` answers (the governor answers once its runner is ready; llama-server,
    ``/health``). Blocking: nothing else runs meanwhile. Raises RuntimeError (with the process
    stopped)."""
    port = free_port()
    ready = "/v1/models"
    if name == "governor":
        argv = governor_command(args, model, port)
    else:
        argv = baseline_command(args, model, port)
        if args.baseline == "llama-server":
            ready = llama_server.READY_PATH
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
    root = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(proc, root + ready, name, READY_TIMEOUT_S)
    except BaseException:
        stop(proc)
        raise
    return Started(name, proc, root + "/v1", argv)
