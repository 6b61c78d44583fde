"""The daemon of ``soak``: started here (or the one at ``--addr``), its output watched for
tracebacks, its workers found."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ...support.processes import stop

LISTEN_LINE = re.compile(rb"listening on (\S+):(\d+)")
TRACEBACK = "Traceback (most recent call last)"
START_TIMEOUT_S = 120.0  # the llama runner loads a model per worker


class StderrWatch:
    """Reads a daemon's stderr to its end on a thread (a full pipe would block the daemon),
    counting tracebacks and keeping the first one."""

    def __init__(self, stream: IO[bytes], head: bytes = b"") -> None:
        self.tracebacks = 0
        self.first_traceback: list[str] = []
        self._in_traceback = False
        self._lock = threading.Lock()
        for line in head.splitlines(keepends=True):
            self._line(line)
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _line(self, raw: bytes) -> None:
        line = raw.decode(errors="replace").rstrip("\n")
        with self._lock:
            if TRACEBACK in line:
                self.tracebacks += 1
                self._in_traceback = not self.first_traceback
            if self._in_traceback and len(self.first_traceback) < 40:
                self.first_traceback.append(line)

    def _read(self, stream: IO[bytes]) -> None:
        for line in stream:
            self._line(line)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


class LogFileWatch:
    """Counts tracebacks in a daemon's log file (``--daemon-log``), from where it ended at the
    start of the run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = path.stat().st_size
        self.tracebacks = 0
        self.first_traceback: list[str] = []

    def poll(self) -> None:
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += data.rfind(b"\n") + 1
        lines = data[: data.rfind(b"\n") + 1].decode(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if TRACEBACK in line:
                self.tracebacks += 1
                if not self.first_traceback:
                    self.first_traceback = lines[i : i + 40]


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    host: str
    port: int
    stderr: StderrWatch

    def stop(self) -> int:
        """SIGTERM (drain), then SIGKILL after 15 s; its exit status."""
        status = stop(self.proc, grace_s=15)
        self.stderr.join(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return status


def start_daemon(args: argparse.Namespace) -> Daemon:
    """``governor serve`` on 127.0.0.1:0; waits for its listening line (raises OSError)."""
    flags = ["--runner", args.runner, "--max-inflight", str(args.max_inflight)]
    if args.runner == "stub":
        flags += ["--stub-ms", str(args.stub_ms)]
    else:
        flags += ["--threads", "1"]
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "governor", "serve", "--listen", "127.0.0.1:0"),
            *flags,
            *args.serve_arg,
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stderr is not None
    fd, head = proc.stderr.fileno(), b""
    deadline = time.monotonic() + START_TIMEOUT_S
    # Raw reads: a buffered readline() could keep the listening line where select() cannot see.
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0 and selector.select(timeout=left):
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            head += chunk
            if match := LISTEN_LINE.search(head[: head.rfind(b"\n") + 1]):
                watch = StderrWatch(proc.stderr, head)
                return Daemon(proc, match[1].decode(), int(match[2]), watch)
    proc.kill()
    proc.wait()
    proc.stderr.close()
    raise OSError(f"the daemon did not start: {head.decode(errors='replace')[-2000:]}")


def worker_pids(pid: int) -> list[int]:
    """The daemon's child processes (its runner's workers), from /proc."""
    children: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                children += [int(c) for c in (task / "children").read_text().split()]
    return sorted(set(children))
