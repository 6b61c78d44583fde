"""What connections, the probes, the exporter and the operator's listener see of the server.

:class:`ServerState` is the daemon's shared state without its lifecycle (uvicorn's
``ServerState``): the configuration, the admission (pools, tenants, overload state), the
measurements, the open connections, the job tasks and the payload buffers' budget.
:class:`~governor.server.Server` builds it, starts and stops everything around it, and is the
only module that imports the others' classes; they import this one, so nothing inside
``governor/`` imports in a circle.
"""

from __future__ import annotations

import asyncio
import collections
from typing import TYPE_CHECKING, Protocol

from protocol.codes import ErrorCode, NeedCode, Receipt

from .config import Config
from .core.admission import Admission, Budget
from .core.policy import LANES
from .core.slo import Attainment
from .core.sources import Displaced, Refused, Sources, parse_networks
from .core.tenants import Tenant
from .core.waitline import Candidate, WaitLine
from .ops.metrics import JobMetrics

if TYPE_CHECKING:  # (imported by the server only with redis_url: no Redis client otherwise)
    from .fleetstore import Fleet


class Connection(Protocol):
    """What the server does to a connection: abort its running jobs, close it."""

    def abort_running(self, need_code: NeedCode, error_code: ErrorCode, detail: str) -> None: ...

    def close(self) -> None: ...


class Displaceable(Protocol):
    """A connection as :class:`~governor.core.sources.Sources` counts it: one that can be told it
    makes way for a new one, and closed."""

    def displace(self, detail: str) -> None: ...

    def __hash__(self) -> int: ...


class ServerState:
    def __init__(self, config: Config, admission: Admission) -> None:
        self.config = config
        self.admission = admission
        self.pools = admission.pools
        self.primary = admission.primary
        self.fallback = admission.fallback
        self.ledger = admission.ledger
        self.clock = self.ledger.clock
        self.tenants = admission.tenants
        self.overload = admission.overload
        self.metrics = JobMetrics()
        self.slo = Attainment(config.overload_window, self.clock)  # objectives met, by lane
        self.bad_frames: collections.Counter[str] = collections.Counter()  # by need code
        # Connections ended by the server before they were served, or cut without a frame.
        self.refused: collections.Counter[str] = collections.Counter()  # by reason
        # The front door's answers, by path (a known one, else "other") and status.
        self.http_responses: collections.Counter[tuple[str, str]] = collections.Counter()
        self.sources: Sources[Displaceable] = Sources(
            max_connections=config.max_connections,
            max_per_source=config.max_connections_per_source,
            trusted=parse_networks(config.trusted_sources),
            guess_rate=config.auth_guess_rate,
            guess_burst=config.auth_guess_burst,
            clock=admission.ledger.clock,
        )
        self.displaced = 0  # connections closed to make way for new ones
        self.connections: set[Connection] = set()
        self.jobs: set[asyncio.Task[None]] = set()  # every admitted job's execution
        self.buffers = Budget(config.max_buffer_bytes)  # payload bytes held, server-wide
        self.last_token_at: float | None = None  # a client's job generated a token
        self.started = False  # the runners are ready and the listener accepts
        self.listener: asyncio.Server | None = None
        self.jobs_done = asyncio.Event()
        self.jobs_done.set()
        self.fleet: Fleet | None = None  # with redis_url: the fleet's step of every admission
        # The jobs waiting for their turn, from both doors (governor.intake.Wait).
        self.line: WaitLine[Candidate] = WaitLine(
            len(LANES), limit=config.max_waiting, per_tenant=config.max_waiting_per_tenant
        )

    @property
    def inflight(self) -> int:
        """Jobs holding a slot, in the primary pool and the fallback pool."""
        return self.admission.inflight

    @property
    def live_jobs(self) -> int:
        """Jobs whose execution has not ended: equal to :attr:`inflight` unless a slot leaked."""
        return sum(1 for task in self.jobs if not task.done())

    @property
    def listening(self) -> bool:
        """The listener accepts connections (or has yet to open: the runner is loading)."""
        if self.listener is None:
            return not self.started
        return self.listener.is_serving()

    def open_connection(self, conn: Displaceable, source: str, *, idle: bool) -> Refused | None:
        """A new connection, on either listener: counted (in place of an idle one, told why, at
        a limit), or refused (at ``max_connections`` or its source's limit with no idle
        connection to displace), the refusal counted."""
        opened = self.sources.open(conn, source, idle=idle)
        if isinstance(opened, Displaced):
            self.displaced += 1
            opened.victim.displace(opened.detail)
            return None
        if opened is not None:
            self.refused[opened.need_code] += 1
        return opened

    def certificate_tenant(self, transport: asyncio.BaseTransport) -> Tenant | None:
        """The tenant a TLS connection's verified client certificate names, if any."""
        if transport.get_extra_info("ssl_object") is None:
            return None
        cert = transport.get_extra_info("peercert")
        return self.tenants.find_cert(cert) if cert else None

    def job_started(self, task: asyncio.Task[None]) -> None:
        self.jobs.add(task)
        self.jobs_done.clear()

    def job_ended(self, task: asyncio.Task[None]) -> None:
        """Called once a job has given back its ticket."""
        self.jobs.discard(task)
        if not self.jobs:
            self.jobs_done.set()
        self.offer()

    def offer(self) -> None:
        """A slot may have freed (a job ended, a waiter left) or a drain began: the jobs waiting
        for their turn are decided again, in the line's order."""
        if self.line:
            self.line.offer(self._room)

    def _room(self) -> bool:
        return self.ledger.draining or not all(p.ledger.saturated for p in self.pools)

    def receipts(self) -> tuple[tuple[str, int], ...]:
        """The receipts every reply carries but ``cdr.bytes_in``, over both pools."""
        inflight = cap = executed = yielded = 0
        for pool in self.pools:  # (a loop, not four generators: every reply carries these)
            ledger = pool.ledger
            inflight += ledger.taken  # (slots, against the cap: a job of n sequences holds n)
            cap += ledger.cap
            executed += ledger.executed_total
            yielded += ledger.yielded_total
        return (
            (Receipt.HEALTH, int(self.ledger.ready)),
            (Receipt.INFLIGHT, inflight),
            (Receipt.CAP, cap),
            (Receipt.EXECUTED_TOTAL, executed),
            (Receipt.YIELDED_TOTAL, yielded),
        )

    def ping_receipts(self) -> tuple[tuple[str, int], ...]:
        state = self.overload.state if self.overload is not None else 0
        return (
            (Receipt.INFLIGHT_PEAK, self.ledger.peak_inflight),
            (Receipt.DRAINING, int(self.ledger.draining)),
            (Receipt.CONNECTIONS, len(self.connections)),
            (Receipt.OVERLOAD_STATE, int(state)),
        )
