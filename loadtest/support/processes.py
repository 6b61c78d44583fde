"""Processes this load tester starts and watches, on Linux: a free loopback port for each,
waiting until it listens or answers, stopping it by its own PID, and what ``/proc`` says of it
(CPU time, resident memory, its descendants and their memory)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]  # the checkout: daemons started here run its governor
PORT_FLOOR = 10_000
_GIVEN: set[int] = set()


def free_port() -> int:
    """A loopback port that is free now and not handed out before by this process, for a child
    to bind. It is drawn below the kernel's ephemeral range: a port the kernel chose (``bind``
    to 0) may be taken again, between this call and the child's bind, as the local end of any
    outgoing connection (a CI run lost a replica to that, ``Address already in use``)."""
    low = ephemeral_low()
    while True:
        port = random.randrange(PORT_FLOOR, low)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port


def ephemeral_low() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return low if low > PORT_FLOOR + 1000 else 65536


def cpu_s(pid: int) -> float:
    """The process's user + system CPU seconds, all of its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("the daemon did not listen in time")


def stop(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> int:
    """SIGTERM the process (by its PID) unless it has ended, SIGKILL after ``grace_s``; its
    exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def wait_http_ready(proc: subprocess.Popen[bytes], url: str, what: str, timeout: float) -> None:
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


def proc_status(pid: int, field: str) -> int | None:
    """A number from ``/proc/PID/status`` (``VmRSS`` in KiB, ``Threads``); None: not readable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_kib(pid: int) -> int | None:
    """The process's resident set in KiB (None: no such process readable)."""
    return proc_status(pid, "VmRSS")


def parse_rollup_kib(smaps_rollup: str) -> dict[str, int]:
    """The ``Name: N kB`` lines of a ``/proc/PID/smaps_rollup`` text, in KiB by name."""
    fields: dict[str, int] = {}
    for line in smaps_rollup.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            fields[name] = int(parts[0])
    return fields


def descendants(parents: dict[int, int], root: int) -> list[int]:
    """Every process below ``root`` in a ``{pid: parent pid}`` map, children before theirs."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found: list[int] = []
    todo = [root]
    while todo:
        below = sorted(children.get(todo.pop(), ()))
        found += below
        todo += below
    return found


def parent_pids() -> dict[int, int]:
    """``{pid: parent pid}`` of every process readable in ``/proc`` now."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:  # (the command name, in parentheses, may hold spaces: split after the last ")")
            parents[int(entry.name)] = int(
                (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            )
        except (OSError, IndexError, ValueError):
            continue  # ended while we looked
    return parents


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it, now."""
    return [pid, *descendants(parent_pids(), pid)]


def tree_rollup_kib(pid: int) -> dict[str, int] | None:
    """``smaps_rollup``'s fields summed over ``pid`` and all its descendants, in KiB; None:
    ``pid`` not readable. ``Pss`` counts a page shared among N processes as 1/N in each, so a
    page shared within the tree (a model file mapped by every worker) counts once in all; but a
    page shared with processes outside it (the same file mapped by another program) counts only
    in part: ``Pss_Anon``, without file pages, does not depend on them."""
    total: dict[str, int] | None = None
    for one in process_tree(pid):
        try:
            fields = parse_rollup_kib(Path(f"/proc/{one}/smaps_rollup").read_text())
        except OSError:
            if one == pid:
                return None
            continue  # ended while we looked
        total = total or {}
        for name, kib in fields.items():
            total[name] = total.get(name, 0) + kib
    return total
