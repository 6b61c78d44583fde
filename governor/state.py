"""What connections, the probes, the exporter and the operator's listener see of the server.

:class:`ServerState` is the daemon's shared state without its lifecycle (uvicorn's
``ServerState``), in eight parts: the configuration, the admission (pools, tenants, overload
state), the measurements and the objectives' attainment, the open connections and what they
share (:class:`Connections`: the limits by source, the payload buffers' budget), the job tasks
(:class:`Jobs`), the line of jobs waiting for their turn, and the fleet.
:class:`~governor.server.Server` builds it, starts and stops everything around it, and is the
only module that imports the others' classes; they import this one, so nothing inside
``governor/`` imports in a circle.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

from protocol.codes import ErrorCode, NeedCode, Receipt

from .config import Config
from .core.admission import Admission, Budget, Pool, Ticket
from .core.ledger import SlotLedger
from .core.overload import OverloadController
from .core.policy import LANES
from .core.slo import Attainment
from .core.sources import Displaced, Refused, Sources, parse_networks
from .core.tenants import Tenant, Tenants
from .core.waitline import Candidate, WaitLine
from .runners.base import Refilling
from .telemetry.metrics import JobMetrics

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


class Connections:
    """Both listeners' open connections and what they share: the limits and pacing by source
    (:class:`~governor.core.sources.Sources`), the server's payload buffers' budget, and the
    connections refused or displaced."""

    def __init__(self, config: Config, tenants: Tenants, clock: Callable[[], float]) -> None:
        self.sources: Sources[Displaceable] = Sources(
            max_connections=config.max_connections,
            max_per_source=config.max_connections_per_source,
            trusted=parse_networks(config.trusted_sources),
            guess_rate=config.auth_guess_rate,
            guess_burst=config.auth_guess_burst,
            clock=clock,
        )
        self.tenants = tenants
        self.open: set[Connection] = set()
        self.buffers = Budget(config.max_buffer_bytes)  # payload bytes held, server-wide
        # Ended by the server before they were served, or cut without a frame, by reason.
        self.refused: collections.Counter[str] = collections.Counter()
        self.displaced = 0  # closed to make way for new ones
        self.listener: asyncio.Server | None = None  # the protocol's, once it serves
        self.started = False  # the runners are ready and the listener accepts

    def __len__(self) -> int:
        return len(self.open)

    def __iter__(self) -> Iterator[Connection]:
        return iter(list(self.open))  # (a copy: closing one takes it out)

    @property
    def listening(self) -> bool:
        """The listener accepts connections (or has yet to open: the runner is loading)."""
        if self.listener is None:
            return not self.started
        return self.listener.is_serving()

    def opened(
        self, conn: Connection, counted: Displaceable, source: str, *, idle: bool
    ) -> Refused | None:
        """A new connection, on either door: counted against its source as ``counted`` (in
        place of an idle one, told why, at a limit) and among the open ones, or refused (at
        ``max_connections`` or its source's limit with no idle connection to displace), the
        refusal counted, for the door to answer its way."""
        opened = self.sources.open(counted, source, idle=idle)
        if isinstance(opened, Displaced):
            self.displaced += 1
            opened.victim.displace(opened.detail)
            opened = None
        if opened is not None:
            self.refused[opened.need_code] += 1
            return opened
        self.open.add(conn)
        return None

    def closed(self, conn: Connection, counted: Displaceable) -> None:
        """A connection :meth:`opened` let in has ended."""
        self.open.discard(conn)
        self.sources.close(counted)

    def certificate_tenant(self, transport: asyncio.BaseTransport) -> Tenant | None:
        """The tenant a TLS connection's verified client certificate names, if any."""
        if transport.get_extra_info("ssl_object") is None:
            return None
        cert = transport.get_extra_info("peercert")
        return self.tenants.find_cert(cert) if cert else None


class Jobs:
    """Every admitted job's execution task, until it has given back its ticket."""

    def __init__(self, ended: Callable[[], None]) -> None:
        self.tasks: set[asyncio.Task[None]] = set()
        self.done = asyncio.Event()  # set while none runs
        self.done.set()
        self.last_token_at: float | None = None  # a client's job generated a token
        self._ended = ended  # (a slot may have freed)

    @property
    def live(self) -> int:
        """Jobs whose execution has not ended: the slots held unless a slot leaked."""
        return sum(1 for task in self.tasks if not task.done())

    def started(self, task: asyncio.Task[None]) -> None:
        self.tasks.add(task)
        self.done.clear()

    def ended(self, task: asyncio.Task[None]) -> None:
        """Called once a job has given back its ticket."""
        self.tasks.discard(task)
        if not self.tasks:
            self.done.set()
        self._ended()


class ServerState:
    def __init__(self, config: Config, admission: Admission) -> None:
        self.config = config
        self.admission = admission
        self.metrics = JobMetrics()
        self.slo = Attainment(config.overload_window, admission.clock)  # objectives met, by lane
        self.connections = Connections(config, admission.tenants, admission.clock)
        self.jobs = Jobs(self.offer)
        # The jobs waiting for their turn, from both doors (governor.intake.Wait).
        self.line: WaitLine[Candidate] = WaitLine(
            len(LANES),
            limit=config.max_waiting,
            per_tenant=config.max_waiting_per_tenant,
            watch=self._waiting,
        )
        self.fleet: Fleet | None = None  # with redis_url: the fleet's step of every admission

    # The admission's parts, read often (it owns them) ------------------------------------

    def now(self) -> float:
        """The time on the admission's clock (the ledger's: injected in tests)."""
        return self.admission.clock()

    @property
    def ledger(self) -> SlotLedger:
        return self.admission.ledger

    @property
    def pools(self) -> tuple[Pool, ...]:
        return self.admission.pools

    @property
    def tenants(self) -> Tenants:
        return self.admission.tenants

    @property
    def overload(self) -> OverloadController | None:
        return self.admission.overload

    @property
    def inflight(self) -> int:
        """Jobs holding a slot, in the primary pool and the fallback pool."""
        return self.admission.inflight

    def _waiting(self, jobs: bool) -> None:
        """Jobs wait at the doors, or none does: a runner that keeps freed slots busy is told
        (the next job is offered the slot as soon as it frees)."""
        runner = self.admission.primary.runner
        if isinstance(runner, Refilling):
            runner.waiting(jobs)

    def released(self, task: asyncio.Task[None], ticket: Ticket) -> None:
        """A job has given back its ticket: its slot is offered to the jobs waiting, and a
        runner that keeps freed slots busy is told so, after them."""
        self.jobs.ended(task)
        if isinstance(runner := ticket.pool.runner, Refilling):
            runner.offered(ticket.job)

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
