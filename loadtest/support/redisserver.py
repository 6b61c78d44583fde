"""A throwaway Redis server for tests and load tests: Debian's ``redis-server`` on a free
loopback port, with a data folder of its own, no persistence, stopped by its own PID."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from .processes import free_port


class RedisServer:
    """``with RedisServer() as redis: redis.url``. :meth:`stop` and :meth:`start` again (on the
    same port) let a test take the store away and bring it back."""

    def __init__(self, port: int | None = None, *, binary: str = "redis-server") -> None:
        found = shutil.which(binary)
        if found is None:
            raise RuntimeError(
                f"{binary} not found: install Debian's redis-server (deploy/setup.sh does)"
            )
        self.binary = found
        self.port = port or free_port()
        self.folder = Path(tempfile.mkdtemp(prefix="governor-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(self.folder),
                "--save", "",
                "--appendonly", "no",
                "--protected-mode", "yes",
                "--daemonize", "no",
                "--loglevel", "warning",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def pause(self) -> None:
        """Freeze it (SIGSTOP): connections stay open, nothing is answered."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # (a paused one could not stop)
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)
