"""The processes of ``bench guidellm-bench``: each server started and warmed up, guidellm run
in a process group of its own, and every one ended."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ...support import llama_server
from ...support.processes import REPO, free_port, wait_http_ready
from .argv import governor_command, llama_server_command

READY_TIMEOUT_S = 180.0


@dataclass(slots=True)
class Started:
    """A server of one run: its process (stopped by PID) and its base URL (no ``/v1``)."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str
    argv: list[str]


def launch(name: str, args: argparse.Namespace, model: Path, log: Path) -> Started:
    """Start ``name`` on a free loopback port, its output to ``log``, and wait until it is
    ready. Blocking. Raises RuntimeError (with the process stopped)."""
    port = free_port()
    if name == "governor":
        argv, ready = governor_command(args, model, port), "/v1/models"
    else:
        argv, ready = llama_server_command(args, model, port), llama_server.READY_PATH
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    wait_http_ready(proc, url + ready, name, READY_TIMEOUT_S)  # (stops it if it fails)
    return Started(name, proc, url, argv)


def warm_up(url: str, output_tokens: int) -> None:
    """One chat, not counted, so that neither server's first-request costs fall in a run."""
    body = {
        "messages": [{"role": "user", "content": "In one sentence, what is the sea?"}],
        "max_tokens": output_tokens,
        "temperature": 0,
    }
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()
    except OSError as exc:
        raise RuntimeError(f"the warm-up chat failed: {exc}") from None


def run_guidellm(argv: list[str], env: Mapping[str, str], log: Path, timeout: float) -> int | None:
    """Run guidellm, its output to ``log``; its exit status, None when ``timeout`` passed
    first. It runs in a session of its own, so that on a timeout its worker processes are
    stopped with it (by its process group, which is its PID)."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv,
            cwd=log.parent,  # (anything guidellm leaves behind lands beside its log)
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        end_group(proc)
        return None
    except BaseException:  # (Ctrl-C reaches this process only: guidellm is in its own session)
        end_group(proc)
        raise


def end_group(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM ``proc``'s process group (its own: started with ``start_new_session``), SIGKILL
    after ``grace_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    except ProcessLookupError:
        pass
