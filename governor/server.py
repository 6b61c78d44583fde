"""The daemon's lifecycle: start, serve, drain, stop.

:class:`Server` owns the listening socket, the set of connections, every job task and the
slot ledger. ``drain`` is the graceful half of shutdown: admission closes (new payloads get
``yield`` with ``draining``), the listener stops, running jobs get ``shutdown_grace`` seconds to
finish, and any still running then get a ``confirm abort`` with ``shutdown`` before their
connections close.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import socket
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, NamedTuple

from protocol.codes import ErrorCode, NeedCode, Receipt

from .config import Config
from .connection import GovernorProtocol
from .ledger import SlotLedger
from .metrics import MetricsEndpoint
from .overload import OverloadController, OverloadSettings
from .policy import Lane, LanePolicy
from .runners import Runner, StubRunner
from .tenants import Tenants

log = logging.getLogger("governor")

LISTEN_BACKLOG = 4096
OVERLOAD_PERIOD_S = 0.5  # a burst of connects must not be refused before the governor can answer


def build_runner(config: Config) -> Runner:
    """The runner the configuration names; raises ``RunnerStartError`` when it cannot be."""
    if config.runner == "stub":
        return StubRunner(
            config.stub_ms / 1000,
            fail_rate=config.stub_fail_rate,
            prompt_s=config.stub_prompt_ms / 1000,
            output_s=config.stub_output_ms / 1000,
        )
    if config.runner == "llama":
        from .runners.llama import LlamaRunner, LlamaSettings, default_threads, embedded_model_path

        workers = config.pool_workers
        return LlamaRunner(
            LlamaSettings(
                model=Path(config.model) if config.model else embedded_model_path(),
                n_ctx=config.n_ctx,
                threads=config.threads or default_threads(workers),
                n_gpu_layers=config.n_gpu_layers,
                workers=workers,
                max_new_tokens=config.max_new_tokens,
                job_timeout_s=config.job_timeout,
            )
        )
    if config.runner == "http":
        from .runners.http import HttpRunner, HttpSettings

        return HttpRunner(
            HttpSettings(
                upstream=config.upstream,
                model=config.upstream_model,
                max_new_tokens=config.max_new_tokens,
                timeout_s=config.job_timeout,
            )
        )
    raise ValueError(f"unknown runner {config.runner!r}")


def build_policy(config: Config) -> LanePolicy:
    kv_capacity = config.kv_capacity
    if not kv_capacity and config.runner == "llama":
        kv_capacity = config.n_ctx * config.pool_workers
    return LanePolicy(
        prompt_weight=config.prompt_weight,
        output_weight=config.output_weight,
        tool_risk_weight=config.tool_risk_weight,
        interactive_max_cost=config.interactive_max_cost,
        heavy_max_cost=config.heavy_max_cost,
        lane_slots={
            Lane.INTERACTIVE: None,
            Lane.HEAVY: config.heavy_slots or None,
            Lane.BACKGROUND: config.background_slots or None,
        },
        interactive_reserve=config.interactive_reserve,
        lane_max_new_tokens={
            Lane.INTERACTIVE: config.interactive_max_new_tokens,
            Lane.HEAVY: config.heavy_max_new_tokens,
            Lane.BACKGROUND: config.background_max_new_tokens,
        },
        prompt_ceiling=config.prompt_ceiling,
        kv_capacity=kv_capacity,
        kv_danger=config.kv_danger,
        kv_interactive_share=config.kv_interactive_share,
    )


def build_fallback(config: Config) -> Runner | None:
    """The ladder's smaller pool: the primary runner's kind, with the fallback settings."""
    if not config.lanes or config.fallback_model is None:
        return None
    model = None if config.fallback_model == "embedded" else config.fallback_model
    return build_runner(
        dataclasses.replace(
            config,
            model=model,
            n_ctx=config.fallback_n_ctx,
            max_inflight=config.fallback_workers,
            workers=config.fallback_workers,
            threads=config.threads or 1,
            lanes=False,  # the pool's own settings: its slots are its workers
        )
    )


class Pool(NamedTuple):
    """A runner and the slots it has: the fallback pool beside the primary one."""

    runner: Runner
    ledger: SlotLedger


class Server:
    def __init__(self, config: Config, runner: Runner | None = None) -> None:
        self.config = config
        self.runner = runner if runner is not None else build_runner(config)
        self.ledger = SlotLedger(
            config.max_inflight,
            expected_service_s=self.runner.expected_service_s,
            policy=build_policy(config) if config.lanes else None,
        )
        self.tenants = Tenants(config.tenants, self.ledger.clock)
        fallback = build_fallback(config)
        # The fallback pool (a runner and its own slots), for the overload ladder.
        self.fallback = (
            None
            if fallback is None
            else Pool(
                fallback,
                SlotLedger(config.fallback_workers, expected_service_s=fallback.expected_service_s),
            )
        )
        self.overload = (
            OverloadController(
                OverloadSettings(
                    ttft_slo_ms=config.ttft_slo_ms,
                    window_s=config.overload_window,
                    min_dwell_s=config.overload_dwell,
                    kv_danger=config.kv_danger,
                    degraded_max_new_tokens=config.degraded_max_new_tokens,
                    pause_background=config.pause_background,
                    interactive_only=config.interactive_only,
                ),
                self.ledger.clock,
            )
            if config.lanes
            else None
        )
        self.ladder: collections.Counter[str] = collections.Counter()  # fallback steps taken
        # Every yield, by need code, lane ('-' without lanes) and tenant.
        self.refusals: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.connections: set[GovernorProtocol] = set()
        self.outcomes: collections.Counter[str] = collections.Counter()  # job ends, by code
        self.bad_frames: collections.Counter[str] = collections.Counter()  # by need code
        self.buffered_bytes = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._listener: asyncio.Server | None = None
        self._watch: asyncio.Task[None] | None = None
        self._metrics: MetricsEndpoint | None = None
        self._jobs_done = asyncio.Event()
        self._force = asyncio.Event()
        self._jobs_done.set()

    # Lifecycle -----------------------------------------------------------------------

    async def start(self, sock: socket.socket | None = None) -> None:
        """Bind (on ``sock`` if given, else on ``config.listen``), start the runner, then serve.

        The port is bound first, so that a taken address fails at once, and connections are
        accepted only once the runner is ready (every worker has loaded its model).
        """
        if sock is None:
            host, port = self.config.listen_address
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
        try:
            await self.runner.start()
        except BaseException:
            sock.close()
            raise
        if self.fallback is not None:
            try:
                await self.fallback.runner.start()
            except BaseException:
                await self.runner.close()  # its workers must not outlive the failed start
                sock.close()
                raise
        self._listener = await asyncio.get_running_loop().create_server(
            lambda: GovernorProtocol(self), sock=sock, backlog=LISTEN_BACKLOG
        )
        host, port = self.address
        log.info(
            "governor listening on %s:%d (max_inflight=%d, runner=%s)",
            host,
            port,
            self.ledger.cap,
            self.runner.name,
        )
        if self.tenants.open:
            log.info("no tenants declared: running open, as one default tenant with no limits")
        else:
            log.info(
                "%d tenant(s): %s",
                len(self.tenants.all()),
                ", ".join(t.name for t in self.tenants.all()),
            )
        if self.ledger.policy is not None:
            p = self.ledger.policy
            log.info(
                "lanes on: interactive reserve %d slot(s), KV budget %s",
                p.interactive_reserve,
                f"{p.kv_capacity} tokens" if p.kv_capacity else "off",
            )
        if self.overload is not None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_overload())
        if self.config.metrics_address is not None:
            self._metrics = MetricsEndpoint(self)
            await self._metrics.start(*self.config.metrics_address)
            mhost, mport = self._metrics.address
            log.info("metrics on http://%s:%d/metrics", mhost, mport)

    @property
    def address(self) -> tuple[str, int]:
        assert self._listener is not None
        assert self._listener.sockets
        host, port = self._listener.sockets[0].getsockname()[:2]
        return host, port

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        return None if self._metrics is None else self._metrics.address

    async def drain(self, grace: float | None = None) -> int:
        """Stop admitting and accepting, wait for running jobs, then stop.

        Returns how many jobs were still running at the deadline (and were aborted).
        """
        grace = self.config.shutdown_grace if grace is None else grace
        self.ledger.draining = True
        if self.fallback is not None:
            self.fallback.ledger.draining = True
        if self._listener is not None:
            self._listener.close()
        if self.inflight:
            log.info("draining: %d job(s) running, %g s to finish", self.inflight, grace)
            waits = [asyncio.ensure_future(e.wait()) for e in (self._jobs_done, self._force)]
            await asyncio.wait(waits, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
        aborted = self.inflight
        if aborted:
            log.warning("aborting %d job(s) still running at the end of the grace period", aborted)
            for conn in list(self.connections):
                conn.abort_running(
                    NeedCode.SHUTDOWN,
                    ErrorCode.UNAVAILABLE,
                    "the governor is shutting down and the job did not finish in time",
                )
        await self.close()
        return aborted

    def force(self) -> None:
        """Cut a drain's grace period short (a second signal)."""
        self._force.set()

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        for conn in list(self.connections):
            conn.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._metrics is not None:
            await self._metrics.close()
        await self.runner.close()
        if self.fallback is not None:
            await self.fallback.runner.close()

    async def _watch_overload(self) -> None:
        """Re-evaluate the overload state twice a second; log each change."""
        overload, ledger = self.overload, self.ledger
        assert overload is not None
        while True:
            await asyncio.sleep(OVERLOAD_PERIOD_S)
            capacity = ledger.policy.kv_capacity if ledger.policy is not None else 0
            overload.kv_utilisation = ledger.kv_reserved / capacity if capacity else 0.0
            before = overload.state
            if overload.update() != before:
                log.warning(
                    "overload state %s -> %s (%s)",
                    before.label,
                    overload.state.label,
                    ", ".join(
                        f"{k} {v:.3g}" for k, v in overload.signals().items() if v is not None
                    ),
                )

    # Called by connections -----------------------------------------------------------

    def accept_connection(self, conn: GovernorProtocol) -> bool:
        if len(self.connections) >= self.config.max_connections:
            return False
        self.connections.add(conn)
        return True

    def connection_closed(self, conn: GovernorProtocol) -> None:
        self.connections.discard(conn)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run a job's coroutine as a task the server owns."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._jobs_done.clear()
        return task

    @property
    def inflight(self) -> int:
        """Jobs running, in the primary pool and the fallback pool."""
        return self.ledger.inflight + (self.fallback.ledger.inflight if self.fallback else 0)

    def job_finished(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        if self.inflight == 0:
            self._jobs_done.set()

    def reserve_buffer(self, nbytes: int) -> bool:
        if self.buffered_bytes + nbytes > self.config.max_buffer_bytes:
            return False
        self.buffered_bytes += nbytes
        return True

    def release_buffer(self, nbytes: int) -> None:
        self.buffered_bytes -= nbytes

    def ping_receipts(self) -> tuple[tuple[str, int], ...]:
        state = self.overload.state if self.overload is not None else 0
        return (
            (Receipt.INFLIGHT_PEAK, self.ledger.peak_inflight),
            (Receipt.DRAINING, int(self.ledger.draining)),
            (Receipt.CONNECTIONS, len(self.connections)),
            (Receipt.OVERLOAD_STATE, int(state)),
        )
