"""How busy the rest of the machine is: the CPU time other processes take while a measure runs,
and waiting for a quiet machine before one starts (a shared machine's noise falls on figures)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from .processes import cpu_s, process_tree


def parse_busy_s(proc_stat: str) -> float:
    """Seconds every CPU together spent not idle since boot, from ``/proc/stat``'s ``cpu`` line
    (user, nice, system, irq, softirq and steal: time another guest took counts as busy)."""
    fields = proc_stat.split("\n", 1)[0].split()
    if fields[0] != "cpu":
        raise ValueError("no cpu line first in /proc/stat")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """:func:`parse_busy_s` of this machine now."""
    return parse_busy_s(Path("/proc/stat").read_text())


def others_share(
    start: tuple[float, float, float], end: tuple[float, float, float], cpus: int
) -> float:
    """The share of all ``cpus`` that other processes kept busy between two readings of
    (wall seconds, machine busy seconds, busy seconds of ours), 0 to 1."""
    wall, machine, ours = (b - a for a, b in zip(start, end, strict=True))
    if wall <= 0:
        return 0.0
    return round(min(max((machine - ours) / (wall * cpus), 0.0), 1.0), 3)


class CpuWindow:
    """How busy the rest of the machine was over a measure: the machine's busy time less this
    process's and that of the process tree under ``pid`` (the target), as a share of every CPU.
    On a machine shared with other work, a figure taken while this is high is suspect."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid
        self.start = self._read()

    def _read(self) -> tuple[float, float, float]:
        times = os.times()
        ours = times.user + times.system
        for one in process_tree(self.pid) if self.pid is not None else ():
            try:
                ours += cpu_s(one)
            except (OSError, IndexError, ValueError):
                continue  # ended while we looked
        return time.monotonic(), machine_busy_s(), ours

    def others(self) -> float:
        return others_share(self.start, self._read(), os.cpu_count() or 1)


QUIET_SHARE = 0.03  # others below this share of the CPUs: a quiet machine


def wait_quiet(timeout_s: float, pid: int | None = None, window_s: float = 1.0) -> float:
    """Sleep until other processes keep less than :data:`QUIET_SHARE` of the CPUs busy over a
    ``window_s`` (``pid``: the target, whose own tree is not another), or ``timeout_s`` has
    passed; the share last seen. Blocking: from a coroutine, run it in a thread."""
    deadline = time.monotonic() + timeout_s
    while True:
        window = CpuWindow(pid)
        time.sleep(window_s)
        seen = window.others()
        if seen < QUIET_SHARE or time.monotonic() >= deadline:
            return seen
