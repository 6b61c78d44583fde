"""Replicas of the governor on this machine: ``governor serve --runner stub`` processes on free
loopback ports, each with its metrics listener, started together, scraped over HTTP, stopped
(or killed) by their PIDs. The fleet commands run them against a Redis of their own."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from clients.fleet import Address

from .processes import free_port

HOST = "127.0.0.1"
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0
HTTP_TIMEOUT_S = 2.0

Sample = tuple[str, dict[str, str], float]


def parse_metrics(text: str) -> list[Sample]:
    """Prometheus text exposition as ``(name, labels, value)``, read by prometheus_client's own
    parser."""
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def total(samples: Iterable[Sample], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        v
        for n, have, v in samples
        if n == name and all(have.get(k) == want for k, want in labels.items())
    )


def by_label(samples: Iterable[Sample], name: str, label: str) -> dict[str, float]:
    """``name``'s samples summed by one label's value."""
    out: dict[str, float] = collections.defaultdict(float)
    for n, labels, v in samples:
        if n == name:
            out[labels.get(label, "")] += v
    return dict(out)


@dataclass(frozen=True, slots=True)
class Gauges:
    """What one replica's ``/metrics`` said of its fleet side."""

    fleet_leases: int  # its jobs running on a lease
    fleet_inflight: int  # the store's count at its latest answer
    inflight: int  # its slots taken (jobs still asking the store included)


def gauges_from(samples: Sequence[Sample]) -> Gauges:
    return Gauges(
        int(total(samples, "governor_fleet_leases")),
        int(total(samples, "governor_fleet_inflight")),
        int(total(samples, "governor_inflight")),
    )


@dataclass
class Replica:
    """One ``governor serve`` process; its stderr goes to a file (a pipe nobody reads would
    block it)."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    log: Path
    slots: int
    killed: bool = False

    @property
    def addr(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def address(self) -> Address:
        return Address(HOST, self.port)

    def kill(self) -> None:
        """SIGKILL, by its PID; reaped at once."""
        self.killed = True
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    async def gauges(self) -> Gauges | None:
        samples = await self.metrics()
        return None if samples is None else gauges_from(samples)

    async def metrics(self) -> list[Sample] | None:
        try:
            body = await http_get(HOST, self.metrics_port, "/metrics")
        except (OSError, TimeoutError, ValueError):
            return None
        return parse_metrics(body.decode(errors="replace"))


async def http_get(host: str, port: int, path: str, timeout: float = HTTP_TIMEOUT_S) -> bytes:
    """One GET on a connection of its own (the governor's HTTP listener closes each): the body
    of a 200, else ``ValueError``."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
            )
            data = await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise ValueError(f"GET {path}: {head[:60]!r}")
    return body


def spawn(name: str, folder: Path, slots: int, flags: Sequence[str]) -> Replica:
    port, metrics_port = free_port(), free_port()
    log = folder / f"{name}-{port}.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "governor", "serve", "--runner", "stub"),
                *("--listen", f"{HOST}:{port}", "--metrics-listen", f"{HOST}:{metrics_port}"),
                *("--replica-id", name, "--max-inflight", str(slots)),
                *("--log-level", "warning", "--shutdown-grace", "2"),
                *flags,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return Replica(name, proc, port, metrics_port, log, slots)


async def wait_ready(replica: Replica, timeout: float = START_TIMEOUT_S) -> None:
    """Until both of its ports accept connections; ``OSError`` if it exits or the time runs
    out first."""
    deadline = time.monotonic() + timeout
    for port in (replica.port, replica.metrics_port):
        while True:
            if replica.proc.poll() is not None:
                raise OSError(f"{replica.name} exited: {replica.log_tail()}")
            try:
                _, writer = await asyncio.open_connection(HOST, port)
            except OSError:
                if time.monotonic() > deadline:
                    raise OSError(f"{replica.name} did not listen: {replica.log_tail()}") from None
                await asyncio.sleep(0.02)
                continue
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            break


def stop_all(replicas: Sequence[Replica]) -> None:
    """SIGTERM each one still running (by its PID), then wait; SIGKILL after the grace."""
    live = [r for r in replicas if r.proc.poll() is None]
    for r in live:
        r.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for r in live:
        try:
            r.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()


@contextlib.asynccontextmanager
async def replica_set(
    folder: Path, specs: Sequence[tuple[str, int, Sequence[str]]]
) -> AsyncIterator[list[Replica]]:
    """Start every ``(name, slots, flags)`` at once and wait for them; stop them after."""
    started: list[Replica] = []
    try:
        for name, slots, flags in specs:
            started.append(spawn(name, folder, slots, flags))
        await asyncio.gather(*(wait_ready(r) for r in started))
        yield started
    finally:
        stop_all(started)
