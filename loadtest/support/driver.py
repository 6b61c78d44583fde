"""Driving a workload at a target, bounded in time: the harness every traffic command shares.

* closed loop (:func:`closed_loop`, ``burst``): N clients on their own connections, released
  together by one starting gun, each sending its requests one after the other;
* open loop (:func:`open_loop`, ``rate``, ``mix``, ``replay``): each request is sent at its
  arrival time, whether or not earlier ones have ended, over a pool of connections.

Both stop at the deadline: requests still outstanding are cancelled (their outcomes stay
``timed_out``); in an open loop, requests not yet due are never sent and not counted as offered.
A sampler records the client's outstanding requests over time; a
:class:`~loadtest.monitor.Monitor` adds the governor's own inflight count where there is one.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx

from clients.client import ClientError

from . import hints
from .connections import CONNECT_TIMEOUT_S, StartError
from .monitor import Monitor, MonitorError
from .targets import DONE, ERROR, TIMED_OUT, GovernorTarget, Outcome, Target
from .workload import Request


@dataclass(slots=True)
class Run:
    """What one drive produced: outcomes in send order, and the timelines."""

    outcomes: list[Outcome] = field(default_factory=list)
    duration_s: float = 0.0
    # (t_s, requests outstanding at the client) every sample period.
    outstanding: list[tuple[float, int]] = field(default_factory=list)
    monitor: Monitor | None = None  # the governor's own view (None for other targets)
    hints: dict[str, Any] | None = None  # how its retry hints landed (None: not read)


# Sends a request on a connection (by index): the outcome it fills in, and its task.
Send = Callable[[Request, int], tuple[Outcome, asyncio.Task[None]]]


class Progress:
    """A one-line live bar on a terminal (nothing when ``out`` is not one)."""

    def __init__(self, out: TextIO | None, label: str, total: int, horizon_s: float) -> None:
        self.out = out if out is not None and out.isatty() else None
        self.label, self.total, self.horizon_s = label, total, horizon_s

    def show(self, run: Run, elapsed_s: float, outstanding: int) -> None:
        if self.out is None:
            return
        done = sum(1 for o in run.outcomes if o.status == DONE)
        ended = len(run.outcomes) - outstanding
        share = max(ended / self.total if self.total else 0.0, elapsed_s / self.horizon_s)
        bar = "#" * int(20 * min(share, 1.0))
        yields = sum(len(o.yields) for o in run.outcomes)
        print(
            f"\r{self.label} [{bar:20}] {elapsed_s:6.1f}s  sent {len(run.outcomes)}/{self.total}  "
            f"done {done}  yields {yields}  outstanding {outstanding} ",
            end="",
            file=self.out,
            flush=True,
        )

    def end(self) -> None:
        if self.out is not None:
            print(file=self.out, flush=True)


async def _prepare(
    target: Target, connections: int, *, deadline: float, sample_s: float, out: TextIO | None
) -> Monitor | None:
    """Connect everything before the start; a monitor for a governor. Raises StartError."""
    loop = asyncio.get_running_loop()
    connect_timeout = min(CONNECT_TIMEOUT_S, max(deadline - loop.time(), 0.001))
    monitor = None
    try:
        async with asyncio.timeout_at(deadline):
            if isinstance(target, GovernorTarget):
                probe = await target.endpoint.connect(timeout=connect_timeout)
                monitor = Monitor(probe, interval_s=sample_s, out=out)
                await monitor.baseline()
            await target.open(connections, timeout=connect_timeout)
    except* Exception as group:
        if monitor is not None:
            await monitor.client.close()
        await target.close()
        reachable = (ClientError, OSError, TimeoutError, MonitorError, httpx.HTTPError)
        first = group.exceptions[0]
        if not isinstance(first, reachable):
            raise
        raise StartError(
            f"cannot reach the target at {target.addr}: {first or type(first).__name__}"
        ) from None
    return monitor


async def _drive(
    target: Target,
    connections: int,
    start: Callable[[float, Run, Send], asyncio.Task[None]],
    *,
    total: int,
    horizon_s: float,
    timeout_s: float,
    sample_s: float,
    label: str,
    out: TextIO | None,
    progress_out: TextIO | None,
) -> Run:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    monitor = await _prepare(target, connections, deadline=deadline, sample_s=sample_s, out=out)
    run = Run(monitor=monitor)
    metrics = target.metrics if isinstance(target, GovernorTarget) else None
    before = await hints.read(*metrics) if metrics is not None else []
    tasks: set[asyncio.Task[None]] = set()  # outstanding
    sent: list[asyncio.Task[None]] = []
    progress = Progress(progress_out, label, total, horizon_s)
    t0 = time.monotonic()

    def send(request: Request, connection: int) -> tuple[Outcome, asyncio.Task[None]]:
        outcome = Outcome(request, time.monotonic() - t0)
        run.outcomes.append(outcome)
        task = loop.create_task(target.send(len(run.outcomes) - 1, outcome, t0, connection))
        tasks.add(task)
        sent.append(task)
        task.add_done_callback(tasks.discard)
        return outcome, task

    async def sample() -> None:
        while True:
            elapsed = time.monotonic() - t0
            run.outstanding.append((round(elapsed, 3), len(tasks)))
            progress.show(run, elapsed, len(tasks))
            await asyncio.sleep(sample_s)

    sampler = loop.create_task(sample())
    if monitor is not None:
        monitor.start(t0)
    main = start(t0, run, send)
    try:
        try:
            async with asyncio.timeout_at(deadline):
                await main
                while tasks:
                    await asyncio.wait(set(tasks))
        except TimeoutError:
            pass  # what is left is cancelled below and stays timed out
        run.duration_s = time.monotonic() - t0
        if metrics is not None:
            run.hints = hints.summary(before, await hints.read(*metrics))
    finally:
        main.cancel()
        for task in (*tasks, sampler):
            task.cancel()
        await asyncio.gather(main, sampler, *tasks, return_exceptions=True)
        progress.end()
        if monitor is not None:
            await monitor.stop()
            await monitor.client.close()
        await target.close()
    for task in (main, *sent):
        if not task.cancelled() and (exc := task.exception()) is not None:
            raise exc  # a bug, not a load-test outcome
    for outcome in run.outcomes:  # cancelled requests: timed out at the deadline
        if outcome.status == TIMED_OUT and outcome.end_s is None:
            outcome.end_s = run.duration_s
    return run


async def closed_loop(
    target: Target,
    clients: int,
    make: Callable[[int, int], Request | None],
    *,
    timeout_s: float,
    sample_s: float,
    label: str,
    total: int,
    out: TextIO | None = None,
    progress_out: TextIO | None = sys.stderr,
) -> Run:
    """``clients`` clients, each on its connection, sending ``make(client, round)`` until it
    returns None; a client whose connection broke stops (its further rounds are not offered)."""

    def start(t0: float, run: Run, send: Send) -> asyncio.Task[None]:
        async def client(index: int) -> None:
            round_ = 0
            while (request := make(index, round_)) is not None:
                outcome, task = send(request, index)
                await task
                if outcome.status == ERROR:
                    return
                round_ += 1

        async def all_clients() -> None:
            await asyncio.gather(*(client(i) for i in range(clients)))

        return asyncio.get_running_loop().create_task(all_clients())

    return await _drive(
        target,
        clients,
        start,
        total=total,
        horizon_s=timeout_s,
        timeout_s=timeout_s,
        sample_s=sample_s,
        label=label,
        out=out,
        progress_out=progress_out,
    )


async def open_loop(
    target: Target,
    requests: Sequence[Request],
    *,
    connections: int,
    timeout_s: float,
    sample_s: float,
    label: str,
    out: TextIO | None = None,
    progress_out: TextIO | None = sys.stderr,
) -> Run:
    """Send each request at its ``at_s``, round-robin over ``connections`` connections."""
    ordered = sorted(requests, key=lambda r: r.at_s)

    def start(t0: float, run: Run, send: Send) -> asyncio.Task[None]:
        async def schedule() -> None:
            for index, request in enumerate(ordered):
                delay = t0 + request.at_s - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                send(request, index)

        return asyncio.get_running_loop().create_task(schedule())

    horizon = ordered[-1].at_s if ordered else 0.0
    return await _drive(
        target,
        connections,
        start,
        total=len(ordered),
        horizon_s=max(horizon, 0.001),
        timeout_s=timeout_s,
        sample_s=sample_s,
        label=label,
        out=out,
        progress_out=progress_out,
    )
