"""The IO of a client of several replicas: one lazily opened
:class:`~clients.client.GovernorClient` per replica, and each job run over them as
:class:`~clients.fleet.route.JobRoute` says, asking :class:`~clients.fleet.replicas.Replicas` at
each step."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from ssl import SSLContext
from types import TracebackType
from typing import Self

from protocol.codes import Status
from protocol.frames import Reply
from protocol.spec import SPEC_CONTENT_TYPE, JobSpec

from ..client import (
    INLINE_MAX_BYTES,
    ClientError,
    ConnectionLost,
    GovernorClient,
    UploadResult,
)
from ..retry import DEFAULT_RETRY, RetryBudget, RetryPolicy
from .addresses import Address, Resolver, resolve, split_addresses
from .replicas import DEFAULT_EJECTION, Ejection, Move, Replicas
from .route import GONE_CODES, FleetResult, JobRoute, NoReplicaAvailable, why_none

WITHDRAW_TIMEOUT_S = 2.0  # telling a replica to drop a held payload: one round trip
PROBE_TIMEOUT_S = 2.0  # the ping that asks a left replica whether it is ready again


# One visit's send: (client, retry, on_attempt, on_yield, on_delta) -> its result.
_Send = Callable[
    [
        GovernorClient,
        RetryPolicy,
        Callable[[float, Reply], None],
        Callable[[Reply], bool],
        Callable[[str], None],
        float | None,
    ],
    Awaitable[UploadResult],
]


class FleetClient:
    """Jobs over several governor replicas, one lazily opened connection to each.

    :meth:`connect` resolves the addresses (no connection is opened until a job needs one);
    :meth:`upload`, :meth:`generate` and :meth:`ping` have :class:`GovernorClient`'s
    signatures and return a :class:`FleetResult`. ``replicas`` is the policy; pass one to
    several clients to make them share what they learn. The retry budget is shared by the
    connections to every replica.
    """

    def __init__(
        self,
        replicas: Replicas,
        *,
        targets: Sequence[str] = (),
        api_key: str | None = None,
        retry_budget: RetryBudget | None = None,
        ssl: SSLContext | None = None,
        server_hostname: str | None = None,
        connect_timeout: float = 10.0,
        resolver: Resolver | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """``targets``: the addresses as given, for :meth:`refresh`."""
        if ssl is None and server_hostname is not None:
            raise ValueError("server_hostname is for TLS connections only: give ssl too")
        self.replicas = replicas
        self.targets = list(targets)
        self.api_key = api_key
        self._budget = retry_budget if retry_budget is not None else RetryBudget()
        self._ssl = ssl
        self._server_hostname = server_hostname
        self._connect_timeout = connect_timeout
        self._resolver = resolver
        self._rng = rng if rng is not None else random.Random()
        self._clients: dict[str, GovernorClient] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # Per replica: connections that could not be opened, and the latest reason.
        self._connect_failures: dict[str, tuple[int, BaseException]] = {}
        self._jobs = itertools.count(1)

    @classmethod
    async def connect(
        cls,
        addresses: str | Iterable[str],
        *,
        timeout: float = 10.0,
        api_key: str | None = None,
        retry_budget: RetryBudget | None = None,
        ssl: SSLContext | None = None,
        server_hostname: str | None = None,
        ejection: Ejection = DEFAULT_EJECTION,
        resolver: Resolver | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> Self:
        """Resolve ``addresses`` (``HOST:PORT`` texts, comma-separated or several; a name may
        stand for several replicas: :func:`spread`) into a client; connections open as jobs
        need them, each bounded by ``timeout``. Raises ``ValueError`` for a bad address."""
        targets = split_addresses(addresses)
        found = await resolve(targets, resolver=resolver)
        return cls(
            Replicas(found, ejection=ejection, rng=rng, clock=clock),
            targets=targets,
            api_key=api_key,
            retry_budget=retry_budget,
            ssl=ssl,
            server_hostname=server_hostname,
            connect_timeout=timeout,
            resolver=resolver,
            rng=rng,
        )

    @property
    def retry_budget(self) -> RetryBudget:
        return self._budget

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)

    async def refresh(self) -> None:
        """Resolve the addresses again (replicas come and go behind a name); connections to
        replicas no longer named are closed."""
        if not self.targets:
            return
        dropped = self.replicas.update(await resolve(self.targets, resolver=self._resolver))
        for address in dropped:
            await self._drop(address.name)

    async def open(self) -> list[str]:
        """Connect to every replica now (a load generator, before its starting gun): the
        names connected. A replica that cannot be reached counts a failure; raises
        :class:`NoReplicaAvailable` when none can."""
        errors: list[BaseException] = []

        async def one(address: Address) -> str | None:
            try:
                await self._connection(address)
            except (ClientError, OSError, TimeoutError) as exc:
                self.replicas.failure(address.name)
                errors.append(exc)
                return None
            return address.name

        opened = await asyncio.gather(*(one(a) for a in self.replicas.addresses))
        names = [n for n in opened if n is not None]
        if not names:
            raise NoReplicaAvailable(why_none(errors))
        return names

    # Operations ------------------------------------------------------------------------

    async def ping(self, *, timeout: float = 10.0) -> Reply:
        """Ping one replica (picked as for a job; another if it cannot be reached)."""
        errors: list[BaseException] = []
        avoid: set[str] = set()
        async with asyncio.timeout(timeout):
            while (address := self.replicas.pick(exclude=avoid)) is not None:
                reply = await self._ping(address, timeout=timeout, errors=errors)
                if reply is not None:
                    return reply
                avoid.add(address.name)
        raise NoReplicaAvailable(why_none(errors))

    async def ping_all(self, *, timeout: float = 10.0) -> dict[str, Reply | Exception]:
        """Ping every replica at once: its reply, or why it could not be reached."""
        addresses = self.replicas.addresses

        async def one(address: Address) -> Reply | Exception:
            errors: list[BaseException] = []
            reply = await self._ping(address, timeout=timeout, errors=errors)
            if reply is not None:
                return reply
            error = errors[-1]
            return error if isinstance(error, Exception) else ClientError(str(error))

        results = await asyncio.gather(*(one(a) for a in addresses))
        return {a.name: r for a, r in zip(addresses, results, strict=True)}

    async def upload(
        self,
        payload: bytes,
        *,
        job: str | None = None,
        chunk_bytes: int = 8192,
        content_type: str = "application/octet-stream",
        ttl_ms: int = 0,
        retry: RetryPolicy = DEFAULT_RETRY,
        timeout: float | None = None,
        on_attempt: Callable[[float, Reply], None] | None = None,
        on_delta: Callable[[str], None] | None = None,
        inline: bool = False,
        max_wait: float | None = None,
    ) -> FleetResult:
        """:meth:`GovernorClient.upload` over the replicas (module docstring). ``max_wait``
        lets the job wait for its turn on the replica it was sent to (None, the default: a
        refused job goes to another replica at once)."""

        def send(
            client: GovernorClient,
            policy: RetryPolicy,
            seen: Callable[[float, Reply], None],
            elsewhere: Callable[[Reply], bool],
            delta: Callable[[str], None],
            wait: float | None,
        ) -> Awaitable[UploadResult]:
            return client.upload(
                payload,
                job=job_id,
                chunk_bytes=chunk_bytes,
                content_type=content_type,
                ttl_ms=ttl_ms,
                retry=policy,
                on_attempt=seen,
                on_delta=delta,
                inline=inline,
                on_yield=elsewhere,
                max_wait=max_wait if max_wait is not None else wait,
                # (it goes where a yield sends it, and waits a little where it stays)
                fleet_wide=self.replicas.fleet_wide,
                wait_on_return=self.replicas.fleet_wide,
            )

        job_id = job or self._job_id()
        run = _FleetJob(self, job_id, retry, on_attempt, on_delta, send)
        async with asyncio.timeout(timeout):
            return await run.run()

    async def generate(
        self,
        spec: JobSpec,
        *,
        job: str | None = None,
        ttl_ms: int = 0,
        retry: RetryPolicy = DEFAULT_RETRY,
        timeout: float | None = None,
        on_attempt: Callable[[float, Reply], None] | None = None,
        on_delta: Callable[[str], None] | None = None,
        max_wait: float | None = None,
    ) -> FleetResult:
        """:meth:`GovernorClient.generate` over the replicas."""
        payload = spec.encode()
        return await self.upload(
            payload,
            job=job,
            content_type=SPEC_CONTENT_TYPE,
            ttl_ms=ttl_ms,
            retry=retry,
            timeout=timeout,
            on_attempt=on_attempt,
            on_delta=on_delta,
            inline=len(payload) < INLINE_MAX_BYTES,
            max_wait=max_wait,
        )

    # Plumbing --------------------------------------------------------------------------

    def _job_id(self) -> str:
        return f"J_f{next(self._jobs)}"  # (ids are per connection; the f marks the fleet's)

    async def _connection(self, address: Address) -> GovernorClient:
        """The open connection to ``address``, opening (or reopening) it if need be."""
        name = address.name
        lock = self._locks.setdefault(name, asyncio.Lock())
        failed_before, _ = self._connect_failures.get(name, (0, None))
        async with lock:  # concurrent jobs wait for one connection, not open one each
            client = self._clients.get(name)
            if client is not None and not client.closed:
                return client
            failed, why = self._connect_failures.get(name, (0, None))
            if failed != failed_before:  # it failed while this job waited: do not wait again
                raise ConnectionLost(f"cannot connect to {name}: {why!r}")
            if client is not None:  # closed by the server (idle), or lost: not a failure
                del self._clients[name]
                await client.close()
            tls_name = self._server_hostname or address.server_hostname
            try:
                client = await GovernorClient.connect(
                    address.host,
                    address.port,
                    timeout=self._connect_timeout,
                    api_key=self.api_key,
                    retry_budget=self._budget,
                    ssl=self._ssl,
                    server_hostname=tls_name if self._ssl is not None else None,
                )
            except (ClientError, OSError, TimeoutError) as exc:
                self._connect_failures[name] = (failed + 1, exc)
                raise
            self._clients[name] = client
            return client

    async def _drop(self, name: str) -> None:
        client = self._clients.pop(name, None)
        if client is not None:
            await client.close()

    async def _ping(
        self, address: Address, *, timeout: float, errors: list[BaseException]
    ) -> Reply | None:
        try:
            client = await self._connection(address)
            reply = await client.ping(timeout=timeout)
        except (ClientError, OSError, TimeoutError) as exc:
            errors.append(exc)
            self.replicas.failure(address.name)
            await self._drop(address.name)
            return None
        self.replicas.observe(address.name, reply)
        return reply

    async def _probe(self, *, force: bool = False) -> None:
        """Ping the left replicas that are due: a ready one is picked again."""
        due = self.replicas.probes_due(force=force)

        async def one(address: Address) -> None:
            with contextlib.suppress(ClientError, OSError, TimeoutError):
                client = await self._connection(address)
                self.replicas.observe(address.name, await client.ping(timeout=PROBE_TIMEOUT_S))

        if due:
            await asyncio.gather(*(one(a) for a in due))

    async def _withdraw(self, name: str, client: GovernorClient, job: str) -> None:
        try:
            await client.withdraw(job, timeout=WITHDRAW_TIMEOUT_S)
        except (ClientError, OSError, TimeoutError):
            await self._drop(name)  # its answer must not come to a connection still in use


class _FleetJob:
    """One job's tries over the replicas: the connecting, sending and withdrawing, each step's
    choice its :class:`JobRoute`'s."""

    def __init__(
        self,
        fleet: FleetClient,
        job: str,
        retry: RetryPolicy,
        on_attempt: Callable[[float, Reply], None] | None,
        on_delta: Callable[[str], None] | None,
        send: _Send,
    ) -> None:
        self.fleet = fleet
        self.job = job
        self.send = send
        self.route = JobRoute(
            fleet.replicas, fleet.retry_budget, retry, fleet._rng, on_attempt, on_delta
        )

    async def run(self) -> FleetResult:
        route = self.route
        await self.fleet._probe()
        target = route.pick()
        if target is None:  # every replica is left: ask them all now, not in recheck_s
            await self.fleet._probe(force=True)
            target = route.pick()
        delay, wait = 0.0, None
        while target is not None and route.may_try():
            if delay > 0:
                await asyncio.sleep(delay)
            move = await self._visit(target, wait)
            if move is None:
                break
            target, delay, wait = move.address, move.delay_s, move.wait_s
        return route.result()

    async def _visit(self, address: Address, wait: float | None = None) -> Move | None:
        """Try the job on ``address`` (where it may wait ``wait`` for its turn): where to go
        next, or None when it has ended."""
        name, fleet, route = address.name, self.fleet, self.route
        visit = route.visit(name)
        try:
            client = await fleet._connection(address)
        except (ClientError, OSError, TimeoutError) as exc:
            return route.unreachable(name, exc)
        try:
            result = await self.send(
                client, route.policy(), visit.seen, visit.elsewhere, visit.delta, wait
            )
        except ClientError as exc:  # the connection broke under the job
            route.broke(visit, exc)
            await fleet._drop(name)
            if route.delivered:
                raise  # its output went out in part: starting over would send it twice
            return route.give_up_on(name)
        route.ended(name, result)
        reply = result.reply
        if reply.status == Status.ABORT:
            if route.delivered:
                return None
            if reply.need_code in GONE_CODES:  # the replica went away under the job
                await fleet._drop(name)
                return route.gone(name, reply)
            return route.after_abort(name, reply)
        step = route.after_reply(name, result, visit.move)
        if step.withdraw:
            await fleet._withdraw(name, client, self.job)
        if step.move is not None and step.pace:
            return route.paced(step.move)
        return step.move
