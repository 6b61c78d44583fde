"""The daemon's lifecycle: start, serve, drain, stop.

:class:`Server` owns the listening socket, the set of connections, every job task, the runner
pools (each a runner, its slot ledger and its circuit breaker), the health prober and the
operator's HTTP listener. The drain is the graceful half of shutdown, begun by a signal or
by ``POST /drain``: readiness fails at once, admission closes (new payloads get ``yield``
with ``draining``, on connections old and new: the listener stays open, so that a client
routed here late gets that answer rather than a refused connection), and running jobs get
``shutdown_grace`` seconds from the drain's start to finish. The stop is the other half, and
only a signal (SIGTERM, SIGINT) begins it (:meth:`Server.drain`): it waits for the running
jobs until that deadline, gives any still running a ``confirm abort`` with ``shutdown``, and
closes everything. A drain begun by ``POST /drain`` (a preStop hook's) therefore leaves the
process up, failing readiness and answering ``draining``, until the signal that follows it
(the kubelet's, once the hook returns; systemd's, on stop); with no job left running, that
signal stops it at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.codes import ErrorCode, NeedCode

from . import compiled
from .config import Config
from .core.admission import Admission, Pool
from .core.breaker import BreakerSettings, BreakerState, CircuitBreaker
from .core.kvbudget import KvBudget
from .core.ledger import SlotLedger
from .core.overload import OverloadController, OverloadSettings
from .core.policy import LanePolicy
from .core.tenants import Tenants
from .listeners import tls
from .listeners.admin import AdminListener
from .listeners.base import Listener
from .listeners.http import FrontDoor
from .listeners.tcp import TcpListener
from .ops.health import Health
from .runners import KvCacheRunner, Pausing, Rated, Runner, StubRunner
from .state import ServerState
from .telemetry import memory
from .telemetry.logs import event

if TYPE_CHECKING:
    from .fleetstore import Fleet

log = logging.getLogger("governor")


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
        from .runners.llama.runner import (
            LlamaRunner,
            LlamaSettings,
            default_threads,
            embedded_model_path,
        )

        return LlamaRunner(
            LlamaSettings(
                model=Path(config.model) if config.model else embedded_model_path(),
                n_ctx=config.n_ctx,
                slots=config.max_inflight,
                kv_cells=config.kv_capacity,
                workers=config.workers,
                threads=config.threads or default_threads(config.workers),
                n_gpu_layers=config.n_gpu_layers,
                step_tokens=config.batch_tokens,
                min_chunk=config.min_prompt_chunk,
                kv_cache_type=config.kv_cache_type,
                kv_layout=config.layout,
                max_new_tokens=config.max_new_tokens,
                job_timeout_s=config.job_timeout,
            )
        )
    if config.runner == "http":
        from .runners.sidecar.runner import HttpRunner, HttpSettings

        return HttpRunner(
            HttpSettings(
                upstream=config.upstream,
                model=config.upstream_model,
                max_new_tokens=config.max_new_tokens,
                timeout_s=config.job_timeout,
                chat_ttft_ms=config.interactive_ttft_slo_ms if config.lanes else 0.0,
            )
        )
    raise ValueError(f"unknown runner {config.runner!r}")


def build_policy(config: Config, kv: KvBudget | None) -> LanePolicy:
    """The lane policy; its KV capacity is the runner's caches', else ``kv_capacity``."""
    return LanePolicy(
        prompt_weight=config.prompt_weight,
        output_weight=config.output_weight,
        tool_risk_weight=config.tool_risk_weight,
        lanes=config.lane_table,
        interactive_reserve=config.interactive_reserve,
        reserve_lend_after_s=config.reserve_lend_after,
        prompt_ceiling=config.prompt_ceiling,
        kv_capacity=kv.capacity if kv is not None else config.kv_capacity,
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
            workers=1,
            kv_capacity=0,
            threads=config.threads or 1,
            lanes=False,  # the pool's own settings
        )
    )


def preemptible(config: Config, runner: Runner) -> bool:
    """Whether admission may suspend lent jobs for chats: under lanes, with ``preemption``, on
    a runner that carries out a job's pause (:class:`Pausing`: the llama runner; the http
    runner, for the jobs its upstream can continue)."""
    return config.lanes and config.preemption and isinstance(runner, Pausing)


def kv_budget(runner: Runner) -> tuple[KvBudget | None, Callable[[], int] | None]:
    """The runner's KV caches for admission to reserve in, and what they hold; (None, None)
    for a runner without any."""
    if isinstance(runner, KvCacheRunner):
        return KvBudget(runner.kv_caches()), runner.kv_used
    return None, None


def build_breaker(config: Config, ledger: SlotLedger, name: str) -> CircuitBreaker:
    breaker = CircuitBreaker(
        BreakerSettings(
            window_s=config.breaker_window,
            min_failures=config.breaker_failures,
            error_rate=config.breaker_error_rate,
            cooldown_s=config.breaker_cooldown,
        ),
        ledger.clock,
    )

    def changed(before: BreakerState, after: BreakerState, why: str) -> None:
        event(
            log,
            logging.WARNING if after == BreakerState.OPEN else logging.INFO,
            f"{name} pool's circuit breaker {before.label} -> {after.label}: {why}",
            event="breaker",
            pool=name,
            before=before.label,
            after=after.label,
            why=why,
        )

    breaker.on_change = changed
    return breaker


def build_fallback_pool(config: Config) -> Pool | None:
    """The fallback pool (``fallback_runner``): its runner, its slots, its breaker."""
    fallback = build_fallback(config)
    if fallback is None:
        return None
    kv, kv_used = kv_budget(fallback)
    ledger = SlotLedger(
        config.fallback_workers,
        expected_service_s=fallback.expected_service_s,
        kv=kv,
        kv_used=kv_used,
    )
    return Pool("fallback", fallback, ledger, build_breaker(config, ledger, "fallback"))


def build_overload(config: Config, ledger: SlotLedger) -> OverloadController | None:
    """With lanes: the overload states, on the ledger's clock."""
    if not config.lanes:
        return None
    settings = OverloadSettings(
        window_s=config.overload_window,
        min_dwell_s=config.overload_dwell,
        kv_danger=config.kv_danger,
        degraded_max_new_tokens=config.degraded_max_new_tokens,
        pause_background=config.pause_background,
        interactive_only=config.interactive_only,
        kv_preemptible=ledger.preemptible,
    )
    return OverloadController(settings, ledger.clock)


def build_fleet(config: Config, ledger: SlotLedger) -> Fleet | None:
    """With ``redis_url``: the fleet's gate and its store (the Redis client is imported only
    then)."""
    if config.redis_url is None:
        return None
    from .core.fleetgate import FleetGate, FleetSettings
    from .fleetstore import Fleet, RedisStore

    fail_open = config.fleet_fail_lanes
    assert fail_open is not None  # (Config checked it)
    # A name of its own for this run, so that two replicas given one replica_id (or a replica
    # restarted before its old leases expired) never share a lease id.
    replica = config.replica_id or f"{socket.gethostname()}-{os.getpid()}"
    settings = FleetSettings(
        replica_id=f"{replica}/{secrets.token_hex(3)}",
        max_inflight=config.fleet_max_inflight,
        lease_ttl_s=config.lease_ttl,
        timeout_s=config.fleet_timeout,
        fail_open=fail_open,
        min_hint_ms=ledger.min_hint_ms,
        max_hint_ms=ledger.max_hint_ms,
    )
    return Fleet(FleetGate(settings, ledger.clock), RedisStore(config.redis_url))


class Server:
    """The lifecycle around the :class:`~governor.state.ServerState` it builds."""

    def __init__(self, config: Config, runner: Runner | None = None) -> None:
        self.config = config
        self._tls = tls.server_context(config)  # (first: an unusable file stops it before all)
        self.runner = runner if runner is not None else build_runner(config)
        kv, kv_used = kv_budget(self.runner)
        self.ledger = SlotLedger(
            config.max_inflight,
            expected_service_s=self.runner.expected_service_s,
            hint_margin=config.hint_margin,
            policy=build_policy(config, kv) if config.lanes else None,
            kv=kv,
            kv_used=kv_used,
            preemptible=preemptible(config, self.runner),
        )
        if isinstance(self.runner, Rated):  # (its jobs predicted from their sizes at once)
            self.ledger.estimates.model.assumed = self.runner.rates
        self.tenants = Tenants(config.tenants, self.ledger.clock)
        self.primary = Pool(
            "primary", self.runner, self.ledger, build_breaker(config, self.ledger, "primary")
        )
        # The fallback pool, for the overload ladder and while the primary's breaker is open.
        self.fallback = build_fallback_pool(config)
        self.overload = build_overload(config, self.ledger)
        self.admission = Admission(
            self.primary,
            self.tenants,
            fallback=self.fallback,
            overload=self.overload,
            slo=config.slo_policy,
        )
        self.state = ServerState(config, self.admission)
        self.fleet = self.state.fleet = build_fleet(config, self.ledger)
        if self.fleet is not None:
            self.fleet.unserved = self.admission.unserved
            ledger = self.ledger
            self.fleet.ready_ms = ledger.ready_in_ms
            self.fleet.turn_s = lambda: ledger.service_s / ledger.cap
        self.pools = self.admission.pools
        self.metrics = self.state.metrics
        self.connections = self.state.connections
        self.health = Health(self.state)
        self._listeners: list[Listener] = []
        self._tcp: TcpListener | None = None
        # The heartbeat, the prober and the overload watch.
        self._background: list[asyncio.Task[None]] = []
        self._admin: AdminListener | None = None
        self._front: FrontDoor | None = None
        self._drain_deadline: float | None = None
        self._force = asyncio.Event()

    # Lifecycle -----------------------------------------------------------------------

    async def start(self, sock: socket.socket | None = None) -> None:
        """Bind every listener (the protocol's on ``sock`` if given, else on ``listen``), start
        the runner, then serve.

        The ports are bound first, so that a taken address fails at once; the probes answer
        from then on (live, not ready while the model loads); connections are accepted only
        once the runner is ready (every worker has loaded its model).
        """
        loop = asyncio.get_running_loop()
        self._tcp = TcpListener(self.state, self._tls, sock)
        self._listeners = [self._tcp]
        try:
            if self.config.http_address is not None:
                self._front = FrontDoor(
                    self.state, self.config.served_model, self._tls, self.health.readiness
                )
                self._listeners.append(self._front)
            if self.config.metrics_address is not None:  # (its drain token is read here)
                self._admin = AdminListener(self.state, self.health, self._drain_for_admin, loop)
                self._listeners.append(self._admin)
            for listener in self._listeners:
                listener.bind()
            await self._serve(early=True)
            self._background.append(loop.create_task(self.health.heartbeat()))
            await self._start_runners()
        except BaseException:
            await self._stop_background()
            await self._close_listeners()
            raise
        await self._serve(early=False)
        self.state.connections.started = True
        if self.fleet is not None:
            self.fleet.address = reachable_at(*self.address)
            self._background.append(loop.create_task(self.fleet.run()))
            self._background.append(loop.create_task(self.fleet.placements.run()))
        self._background.append(loop.create_task(self.health.probe_loop()))
        self._background.append(loop.create_task(memory.trim_loop()))
        if self.overload is not None:
            self._background.append(loop.create_task(self._watch_overload()))
        self._announce()

    async def _serve(self, *, early: bool) -> None:
        for listener in self._listeners:
            if listener.early == early:
                await listener.serve()
                if (line := listener.describe()) is not None:
                    log.info("%s", line)

    async def _start_runners(self) -> None:
        await self.runner.start()
        if self.fallback is not None:
            try:
                await self.fallback.runner.start()
            except BaseException:
                await self.runner.close()  # its workers must not outlive the failed start
                raise

    async def _close_listeners(self) -> None:
        for listener in self._listeners:
            await listener.close()

    def _announce(self) -> None:
        """What now serves, in the log: the fleet, the listener, the tenants, the lanes."""
        if self.fleet is not None:
            s = self.fleet.gate.settings
            log.info(
                "fleet: replica %s on %s, fleet_max_inflight %s, lease_ttl %g s, failing open "
                "for %s",
                s.replica_id,
                self.config.redis_url,
                s.max_inflight or "unset",
                s.lease_ttl_s,
                ", ".join(sorted(s.fail_open)) or "no lane",
            )
        host, port = self.address
        log.info(
            "governor listening on %s:%d (%smax_inflight=%d, runner=%s)",
            host,
            port,
            tls.describe(self.config),
            self.ledger.cap,
            self.runner.name,
        )
        current, hot_path = compiled.summary()
        log.log(logging.INFO if current else logging.WARNING, "%s", hot_path)
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
                "lanes on: interactive reserve %d slot(s)%s, KV budget %s",
                p.interactive_reserve,
                f" (lent after {p.reserve_lend_after_s:g} s without a chat)"
                if p.reserve_lend_after_s
                else "",
                f"{p.kv_capacity} tokens" if p.kv_capacity else "off",
            )

    @property
    def address(self) -> tuple[str, int]:
        assert self._tcp is not None
        return self._tcp.address

    @property
    def http_address(self) -> tuple[str, int] | None:
        return None if self._front is None else self._front.address

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        return None if self._admin is None else self._admin.address

    @property
    def inflight(self) -> int:
        """Jobs holding a slot, in the primary pool and the fallback pool."""
        return self.state.inflight

    @property
    def live_jobs(self) -> int:
        """Jobs whose execution has not ended (equal to :attr:`inflight`: no slot leaks)."""
        return self.state.jobs.live

    @property
    def buffered_bytes(self) -> int:
        return self.state.connections.buffers.used

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    async def _drain_for_admin(self, wait: float) -> int:
        """POST /drain: the drain alone, not the stop (see the module docstring); returns how
        many jobs still run after ``wait`` seconds."""
        self.begin_drain("POST /drain")
        running = await self.wait_for_jobs(wait)
        if not running:
            log.info("drained: no job running; SIGTERM or SIGINT stops the process at once")
        return running

    def begin_drain(self, reason: str, grace: float | None = None) -> None:
        """Refuse new jobs from now on (requests waiting at the front door too, at once);
        running ones have until the drain's deadline."""
        if self._drain_deadline is not None:
            return
        grace = self.config.shutdown_grace if grace is None else grace
        self._drain_deadline = asyncio.get_running_loop().time() + grace
        for pool in self.pools:
            pool.ledger.draining = True
        self.state.offer()
        event(
            log,
            logging.INFO,
            f"draining ({reason}): {self.inflight} job(s) running, {grace:g} s to finish",
            event="drain",
            reason=reason,
            inflight=self.inflight,
            grace_s=grace,
        )

    async def drain(self, grace: float | None = None) -> int:
        """Drain (if not begun already), wait for running jobs until its deadline, then stop.

        Returns how many jobs were still running at the deadline (and were aborted).
        """
        self.begin_drain("shutdown", grace)
        assert self._drain_deadline is not None
        aborted = await self.wait_for_jobs(self._drain_deadline - asyncio.get_running_loop().time())
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

    async def wait_for_jobs(self, timeout: float) -> int:
        """Wait at most ``timeout`` seconds for running jobs to end (a second signal cuts the
        wait short); returns how many still run."""
        if self.inflight and timeout > 0:
            events = (self.state.jobs.done, self._force)
            waits = [asyncio.ensure_future(e.wait()) for e in events]
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
        return self.inflight

    def force(self) -> None:
        """Cut a drain's grace period short (a second signal)."""
        self._force.set()

    async def _stop_background(self) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self._background.clear()

    async def close(self) -> None:
        await self._stop_background()
        await self._close_listeners()
        for conn in list(self.connections):
            conn.close()
        jobs = list(self.state.jobs.tasks)
        for task in jobs:
            task.cancel()
        if jobs:
            await asyncio.gather(*jobs, return_exceptions=True)
        if self.fleet is not None:
            await self.fleet.close()
        for pool in self.pools:
            await pool.runner.close()

    async def _watch_overload(self) -> None:
        """Re-evaluate the overload state every ``evaluate_s`` (the pause hints count on that
        period); log each change."""
        overload, ledger = self.overload, self.ledger
        assert overload is not None
        while True:
            await asyncio.sleep(overload.settings.evaluate_s)
            ledger.resume()  # (a suspended job waiting on a promise that was not kept)
            overload.kv_utilisation = ledger.kv_utilisation
            before = overload.state
            if overload.update() != before:
                signals = {k: v for k, v in overload.signals().items() if v is not None}
                event(
                    log,
                    logging.WARNING,
                    f"overload state {before.label} -> {overload.state.label} ("
                    + ", ".join(f"{k} {v:.3g}" for k, v in signals.items())
                    + ")",
                    event="overload",
                    before=before.label,
                    after=overload.state.label,
                    **signals,
                )


def reachable_at(host: str, port: int) -> str:
    """Where the fleet's clients reach a TCP door bound to ``host``:``port`` (HOST:PORT, as
    they name replicas): its host, or this machine's name when it listens on every address."""
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
