"""Liveness and readiness: two different questions, each answered with its reasons.

*Liveness* asks whether a restart would help, and nothing else: the event loop runs (a
heartbeat no older than ``loop_stall_limit``), the listener is up, and the worker supervisor
stands (every worker is running or being restarted). It is computed off the event loop, by
the HTTP thread (:mod:`governor.listeners.admin`), from the heartbeat's time and the last snapshot it
took, so a stalled loop is reported as such instead of leaving the probe without an answer.
A model that does not load, a hung worker, a backend returning errors: a restart helps none
of them, so none of them fails liveness.

*Readiness* asks whether this replica can serve a real request now:

* a real probe succeeded recently: every ``probe_interval`` one token is generated through a
  worker (beside its jobs, in a sequence kept for the probe; through the upstream, for the
  http runner), the path a client's job takes, within ``probe_timeout``; a token generated
  for a client's job is evidence just as good, so a runner that says it has no room for a
  probe is not probed (and not called unready for it);
* workers are loaded (at least one);
* the daemon is not draining;
* the KV cache in use is below its danger line (``kv_danger``, with lanes on);
* the primary pool's circuit breaker is not open, unless a fallback pool takes its jobs;
* and, only with ``unready_when_saturated``, a slot is free (by default a saturated replica
  is ready: ``yield`` already tells its clients when to come back).

A probe that times out leaves its worker to the runner's own clean-up: it is cancelled, and
killed and replaced if it does not confirm (a hung worker heals itself).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from ..core.breaker import BreakerState
from ..runners import RunnerError, RunnerHealth
from ..state import ServerState
from ..telemetry.logs import event

log = logging.getLogger("governor.ops.health")

BEAT_S = 0.2


@dataclass(frozen=True, slots=True)
class Check:
    ok: bool
    detail: str


@dataclass(frozen=True, slots=True)
class Verdict:
    checks: dict[str, Check]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks.values())

    def failing(self) -> list[str]:
        return [name for name, c in self.checks.items() if not c.ok]

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "status": "ok" if self.ok else "fail",
                "checks": {
                    name: {"ok": c.ok, "detail": c.detail} for name, c in self.checks.items()
                },
            }
        )


class Health:
    """The probes' state for one server; :meth:`heartbeat` and :meth:`probe_loop` are its
    loops."""

    def __init__(self, state: ServerState, clock: Callable[[], float] = time.monotonic) -> None:
        self.server = state
        self.config = state.config
        self.clock = clock
        self.beat = clock()  # the event loop's last heartbeat, read by the HTTP thread
        # Snapshots taken on the loop at each beat, for liveness computed off it.
        self.listening = True
        self.supervisor = RunnerHealth(supervisor_alive=True, workers_live=0, workers=0)
        self.orphans = 0  # slots held with no live execution (a leak: never, by design)
        self.orphaned_since: float | None = None
        self.last_ok: float | None = None  # a probe succeeded
        self.last_failure: float | None = None  # a probe failed
        self.failure_detail = ""
        self._ready: bool | None = None
        self._live: bool | None = None

    # The verdicts ------------------------------------------------------------------------

    def liveness(self) -> Verdict:
        age = self.clock() - self.beat
        limit = self.config.loop_stall_limit
        s = self.supervisor
        return Verdict(
            {
                "event_loop": Check(
                    age < limit, f"last ran {age:.2f} s ago (loop_stall_limit {limit:g} s)"
                ),
                "listener": Check(
                    self.listening, "accepting" if self.listening else "the listener is closed"
                ),
                "slots": self._slots_check(),
                "supervisor": Check(
                    s.supervisor_alive,
                    f"{s.workers_live} of {s.workers} workers live, {s.restarts} restarts"
                    if s.supervisor_alive
                    else "a worker is lost: neither running nor being restarted",
                ),
            }
        )

    def _slots_check(self) -> Check:
        """Every slot held has a live execution; a slot without one for longer than
        ``job_timeout`` has leaked, and only a restart gives it back."""
        since, limit = self.orphaned_since, self.config.job_timeout
        if since is None:
            return Check(True, "every slot held has a live job")
        age = self.clock() - since
        return Check(
            age <= limit,
            f"{self.orphans} slot(s) held with no live job for {age:.1f} s (job_timeout {limit:g} s)",
        )

    def readiness(self) -> Verdict:
        """Computed on the event loop (a stalled loop cannot answer: unready)."""
        server, config = self.server, self.config
        now = self.clock()
        checks: dict[str, Check] = {}
        if not server.connections.started:
            checks["started"] = Check(False, "starting: the runner is loading")
        runner = server.admission.primary.runner.health()
        if runner.workers:
            checks["workers"] = Check(
                runner.workers_live > 0,
                f"{runner.workers_live} of {runner.workers} workers loaded",
            )
        checks["probe"] = self._probe_check(now)
        ledger = server.ledger
        checks["draining"] = Check(
            not ledger.draining, "draining" if ledger.draining else "not draining"
        )
        policy = ledger.policy
        if policy is not None and ledger.kv is not None:
            share = ledger.kv_utilisation
            checks["kv"] = Check(
                share < policy.kv_danger,
                f"KV cache {share:.0%} in use (danger line {policy.kv_danger:.0%})",
            )
        breaker = server.admission.primary.breaker
        fallback = server.admission.fallback
        if breaker.state != BreakerState.OPEN:
            checks["breaker"] = Check(True, f"the primary pool's breaker is {breaker.state.label}")
        elif fallback is not None and fallback.breaker.state != BreakerState.OPEN:
            checks["breaker"] = Check(True, "the primary pool's breaker is open; jobs fall back")
        else:
            checks["breaker"] = Check(False, "the primary pool's breaker is open")
        if config.unready_when_saturated:
            checks["saturation"] = Check(
                not ledger.saturated, f"{ledger.taken} of {ledger.cap} slots taken"
            )
        return Verdict(checks)

    def _probe_check(self, now: float) -> Check:
        max_age = self.config.probe_max_age
        last_failure = self.last_failure
        # A probe that succeeded, or a client's job that generated a token: the path works.
        tokens = [t for t in (self.last_ok, self.server.jobs.last_token_at) if t is not None]
        last_ok = max(tokens) if tokens else None
        if last_ok is None:
            return Check(False, self.failure_detail or "no probe has succeeded yet")
        if last_failure is not None and last_failure > last_ok:
            return Check(False, f"the last probe failed: {self.failure_detail}")
        age = now - last_ok
        if age > max_age:
            return Check(False, f"nothing generated for {age:.1f} s (probe_max_age {max_age:g} s)")
        return Check(True, f"generated {age:.1f} s ago")

    # The loops ---------------------------------------------------------------------------

    async def heartbeat(self) -> None:
        """The heartbeat, until cancelled: from before the runner starts (live while loading).

        The probes have a loop of their own (:meth:`probe_loop`): a probe waiting on a hung
        worker must not hold the heartbeat back, or a hung worker would fail liveness.
        """
        while True:
            self._beat()
            await asyncio.sleep(BEAT_S)

    async def probe_loop(self) -> None:
        """Probe every ``probe_interval``, until cancelled: once the runner has started."""
        while True:
            await self.probe()
            await asyncio.sleep(self.config.probe_interval)

    def _beat(self) -> None:
        server = self.server
        self.beat = self.clock()
        self.listening = server.connections.listening
        self.supervisor = server.admission.primary.runner.health()
        self.orphans = server.inflight - server.jobs.live
        if self.orphans <= 0:
            self.orphaned_since = None
        elif self.orphaned_since is None:
            self.orphaned_since = self.beat
        live, ready = self.liveness(), self.readiness()
        self._note("liveness", live, self._live)
        self._note("readiness", ready, self._ready)
        self._live, self._ready = live.ok, ready.ok

    def _note(self, name: str, verdict: Verdict, before: bool | None) -> None:
        """Log each change of a verdict, with the checks that decided it.

        The first verdict is logged only if it passes: failing while the model loads is how
        every start begins, not news.
        """
        if before == verdict.ok or (before is None and not verdict.ok):
            return
        failing = verdict.failing()
        event(
            log,
            logging.INFO if verdict.ok else logging.WARNING,
            f"{name} {'passes' if verdict.ok else 'fails'}"
            + (": " + "; ".join(verdict.checks[n].detail for n in failing) if failing else ""),
            event=name,
            ok=verdict.ok,
            failing=failing,
        )

    async def probe(self) -> None:
        """One readiness probe on the primary pool; in half-open, it is the breaker's trial."""
        pool, metrics = self.server.admission.primary, self.server.metrics
        if pool.ledger.draining or pool.ledger.saturated:
            metrics.probes["skipped"] += 1  # busy: its jobs' tokens are the evidence
            return
        breaker = pool.breaker
        # (retry_after_s moves an open breaker whose cooldown is over to half-open.)
        trial = breaker.retry_after_s(pool.ledger.service_s) is None and breaker.started()
        failed: bool | None = None
        started = self.clock()
        try:
            async with asyncio.timeout(self.config.probe_timeout):
                ran = await pool.runner.probe()
        except TimeoutError:
            failed = True
            self._failed(
                "timeout", f"no token within probe_timeout {self.config.probe_timeout:g} s"
            )
        except RunnerError as exc:
            failed = True
            self._failed("failed", exc.detail)
        except Exception as exc:  # a runner bug fails the probe, not the probe loop
            log.exception("the readiness probe raised")
            failed = True
            self._failed("failed", f"the probe raised {exc!r}")
        else:
            if ran:
                failed = False
                self.last_ok = now = self.clock()
                metrics.probes["ok"] += 1
                metrics.probe.observe(now - started)
            else:
                metrics.probes["skipped"] += 1
        finally:
            if trial:
                breaker.record(failed, trial=True)

    def _failed(self, result: str, detail: str) -> None:
        self.last_failure = self.clock()
        self.failure_detail = detail
        self.server.metrics.probes[result] += 1
