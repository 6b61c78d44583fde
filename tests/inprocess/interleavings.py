"""One state machine for every door: the count holds whatever the clients do.

A hypothesis state machine drives one real server over real loopback sockets, on a loop of its
own, through a *door*: the TCP frame protocol (``tests/inprocess/door_tcp.py``) or the OpenAI front door
(``tests/inprocess/door_http.py``). The machine holds what every door promises and checks it the same way
after every step, and at the end:

- the cap: slots held equal the live executions, never more than ``max_inflight``; each
  tenant's count adds up to the slots, none over its own cap; the runner runs no more jobs than
  are live; with a fleet, no more than the fleet leased, the leases within the fleet's cap and
  each held by a live execution;
- nothing runs on for a client that has gone: a job whose client left (or was closed) ends;
- the payload buffers stay under ``max_buffer_bytes``;
- every request a connected client sent is answered once, never twice, unless its job runs (or
  it waits at the door), and no answer comes for nothing sent;
- at the end every job finishes and is answered, every client leaves, and every slot, live
  execution, buffered byte, tenant count, place in line, fleet lease and promise in the
  ledger's line is given back.

Each door adds what only it has (its own moves, the shape of its answers, its own books) behind
the small :class:`Door` protocol below.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator, Sequence
from typing import Any, ClassVar, Protocol, TypeVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from governor.config import Config
from governor.core.policy import LANES
from governor.core.tenants import TenantConfig
from governor.runners import Finished, Job, RunEvent, RunnerError, RunnerHealth
from governor.server import Server
from protocol.spec import JobSpec

T = TypeVar("T")


def tenants(cap: int) -> tuple[TenantConfig, TenantConfig]:
    """Two tenants for a server of ``cap`` slots: a's own cap is one, b's above the server's.
    a's jobs past its one are refused tenant_busy (no place in the ledger's line), b's past the
    server's cap server_busy (a promise); and only the server's cap bounds what runs, so a cap
    overrun shows."""
    return (
        TenantConfig(name="a", key_sha256=hashlib.sha256(b"k-a").hexdigest(), max_inflight=1),
        TenantConfig(name="b", key_sha256=hashlib.sha256(b"k-b").hexdigest(), max_inflight=cap + 1),
    )


KEYS = {"a": "k-a", "b": "k-b"}
SETTLE_S = 2.0  # the longest wait for the answers owed, or for the counts to add up
FINAL_S = 5.0  # the longest wait for everything to be given back once the clients have gone


class GateRunner:
    """A :class:`~governor.runners.Runner` whose jobs run until the test ends them, each as it
    says: finished, or failed with a :class:`RunnerError`."""

    name = "gate"

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Future[bool]] = {}

    @property
    def expected_service_s(self) -> float:
        return 0.05

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    max_new_tokens = 1 << 20

    def prepare(self, job_id: str, spec: JobSpec | None, payload: bytes = b"") -> Job:
        return Job(job_id, payload, spec=spec)

    async def run(self, job: Job) -> AsyncGenerator[RunEvent, None]:
        gate = self.gates[job.id] = asyncio.get_running_loop().create_future()
        try:
            ok = await gate
        finally:
            del self.gates[job.id]
        if not ok:
            raise RunnerError("gate runner: failed on purpose")
        yield Finished({"runner": self.name})

    def running(self) -> list[str]:
        """Jobs in the runner that the test has not ended (job ids are unique in a run)."""
        return sorted(job for job, gate in self.gates.items() if not gate.done())

    def end(self, job: str, ok: bool) -> None:
        self.gates[job].set_result(ok)

    async def probe(self) -> bool:
        return True

    def health(self) -> RunnerHealth:
        return RunnerHealth(supervisor_alive=True, workers_live=0, workers=0)


def accounted(server: Server) -> tuple[int, int, int, list[int]]:
    """(slots held, live executions, buffered payload bytes, each tenant's inflight)."""
    return (
        server.inflight,
        server.live_jobs,
        server.buffered_bytes,
        [t.inflight for t in server.tenants.all()],
    )


def holders(server: Server) -> str:
    """What may hold a slot, for a failure's message: each connection's jobs (phase, with an
    execution or not), a job admitted and not yet started, and the fleet's leases."""
    parts = []
    for conn in server.connections:
        session = conn.session  # type: ignore[attr-defined]
        jobs = {job: (s.phase.name, s.execution is not None) for job, s in session.jobs.items()}
        admitted = session.table.admitted
        parts.append(
            f"conn(closed={session.closed}, paused={session.paused}, jobs={jobs}, "
            f"admitted={admitted.job if admitted is not None else None})"
        )
    if server.fleet is not None:
        gate = server.fleet.gate
        parts.append(f"fleet(leases={len(gate.leases)}, answers={dict(gate.answers)})")
    return "; ".join(parts) or "no connection"


def given_back(server: Server) -> bool:
    """Nothing held: no slot, no execution, no payload byte, no tenant count or place in line."""
    return accounted(server)[:3] == (0, 0, 0) and all(
        t.inflight == 0 and t.waiting == 0 and not t.running for t in server.tenants.all()
    )


async def poll(condition: Callable[[], bool], timeout: float) -> bool:
    """Let the loop run until ``condition`` holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.002)
    return True


def pick(data: st.DataObject, items: Sequence[T], label: str) -> T | None:
    """One of ``items`` by a drawn index (the same draw however many there are), or None."""
    index = data.draw(st.integers(0, 15), label=label)
    return items[index % len(items)] if items else None


class DoorClient(Protocol):
    """One connection through a door, as the machine sees it."""

    name: str
    writer: asyncio.StreamWriter
    reading: asyncio.Task[None]
    left: bool  # the client closed it (or reset it, or half-closed it)
    eof: bool  # it is closed (by the server, or after the client left)

    @property
    def open(self) -> bool: ...


class Door(Protocol):
    """How clients reach the server, and what the answers that way must look like.

    The machine calls the door for what every door has (connect, submit work, cancel a job,
    leave); each door's own moves are its methods marked with :func:`move`, each a rule of the
    machine of its own.
    """

    MAX_CLIENTS: ClassVar[int]
    LEAVINGS: ClassVar[tuple[str, ...]]  # the ways a client may leave
    LAST_JOBS_S: ClassVar[float]  # how long the last jobs may take to reach the runner at the end
    # Steps before the drain may come: one at once refuses every job after it, leaving little
    # running to see; one late is seen in fewer examples, with fewer steps after it.
    DRAIN_AFTER: ClassVar[int]
    # Its clients can cancel a job and stay; where they cannot (HTTP), leaving is their cancel,
    # which ``disconnect`` draws already (of clients whose job runs among others).
    CANCELS: ClassVar[bool]

    @property
    def clients(self) -> Sequence[DoorClient]:
        """Every client that connected, in order."""
        ...

    def settings(self) -> dict[str, Any]:
        """The server's settings for this door (with ``max_inflight`` and ``tenants``)."""
        ...

    def make_runner(self) -> GateRunner: ...

    def started(self) -> None:
        """The server has started."""

    def connect_a_client(self) -> None: ...

    def submit(self, client: Any, data: st.DataObject) -> None:
        """``client`` sends work drawn from ``data`` (jobs, maybe with their cancels)."""

    def crowd(self, data: st.DataObject) -> None:
        """Several clients send jobs at once, more than the slots (where the tenant's own cap
        is above the server's, the server's cap alone decides which run)."""

    def cancellable(self) -> list[tuple[Any, str]]:
        """(client, job) that a cancel may name: running jobs first, else any (empty if none)."""
        ...

    def cancel(self, client: Any, job: str, data: st.DataObject) -> None:
        """``client`` cancels ``job``, as its door lets it."""

    def leavers(self) -> list[Any]:
        """The clients that may leave now."""
        ...

    def disconnect(self, client: Any, how: str, last_words: bool) -> None:
        """``client`` leaves (``how`` one of ``LEAVINGS``), where the door has them after a last
        request in the same write (``last_words``)."""

    def job_ending(self, job: str, ok: bool) -> None:
        """The runner is about to end ``job`` as the test says."""

    def quiet(self) -> bool:
        """Every answer owed has come, every close has been seen by both sides."""
        ...

    def after_settle(self) -> None:
        """(for the transcript: what runs, what waits)"""

    def pending(self) -> list[Any]:
        """Requests admitted later, without another word from their client (at the door)."""
        ...

    def orphans(self) -> set[str]:
        """Jobs the runner still runs whose client has gone."""
        ...

    def buffers_settle(self) -> bool:
        """The buffered bytes are what the door knows to be held (True if it cannot say)."""
        ...

    def check_accounts(self) -> None:
        """The door's own books, after the machine's (slots, tenants, buffers)."""

    def problems(self, client: Any) -> list[str]:
        """Answers to nothing sent, bytes that do not parse."""
        ...

    def asks(self, client: Any) -> list[Any]:
        """What ``client`` sent that asks for an answer; each has ``answers``."""
        ...

    def owed(self, client: Any) -> list[Any]:
        """Of those, what the server owes ``client`` now (on a connection both keep open)."""
        ...

    def check_answer(self, client: Any, ask: Any) -> None:
        """The answer(s) ``ask`` got have the shape they must have."""

    def check_connection(self, client: Any) -> None:
        """The connection closed (or not) as it must."""

    def check_final(self) -> None:
        """Once every job has ended, before the clients leave."""

    async def forget(self) -> None:
        """Once every client has gone and every slot is back: what the door keeps for a while
        (places kept for retries) must go in its time; it waits for that, and checks it."""


Move = Callable[..., None]


def move(**strategies: st.SearchStrategy[Any]) -> Callable[[Move], Move]:
    """Marks a door's method as a move of its own: a rule of the machine, its arguments drawn
    from ``strategies``, always enabled (it does nothing when it finds nothing to act on)."""

    def mark(method: Move) -> Move:
        method.__dict__["move_strategies"] = strategies
        return method

    return mark


class Interleavings(RuleBasedStateMachine):
    """Drives one real server through ``door`` on a loop of its own (``make_loop``); see
    :func:`machine` for a machine of a door and a loop."""

    door_type: ClassVar[Callable[[Interleavings], Door]]
    make_loop: ClassVar[Callable[[], asyncio.AbstractEventLoop]] = asyncio.new_event_loop
    # More settings for the server: a fleet's (a real Redis) in the fleet's variant.
    config: ClassVar[dict[str, Any]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.loop = type(self).make_loop()
        self.door = type(self).door_type(self)
        self.runner = self.door.make_runner()
        self.server: Server | None = None
        self.neighbour: Server | None = None  # (another replica of the fleet's, idle)
        self.transcript: list[str] = []
        self.drained = False
        self.broken = False  # a job has failed: the breaker may open
        self.failed = False
        self.steps = 0  # (counted by an invariant: the same whatever the timing)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def log(self, line: str) -> None:
        self.transcript.append(line)

    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        """On a failure: what was sent and received, in the falsifying example's notes."""
        try:
            yield
        except BaseException:
            if self.failed:  # (noted already)
                raise
            self.failed = True
            note("sent and received (> sent, < received):\n  " + "\n  ".join(self.transcript))
            raise

    @property
    def the_server(self) -> Server:
        assert self.server is not None
        return self.server

    @initialize()
    def start(self) -> None:
        async def start() -> Server:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            settings = dict(self.config)
            if settings.pop("neighbour", False):  # (its stub runner never gets a job)
                self.neighbour = Server(Config(listen="127.0.0.1:0", runner="stub", **settings))
                await self.neighbour.start()
            config = Config(
                listen="127.0.0.1:0",
                runner="stub",  # (not built: the gate runner is given)
                **self.door.settings(),
                **settings,
            )
            server = Server(config, self.runner)
            await server.start(sock=sock)
            return server

        self.server = self.run(start())
        self.door.started()

    # Waiting for the server --------------------------------------------------------------

    def settle(self) -> None:
        """Wait (bounded) for the server to answer what was sent; the invariants then say
        what is missing, if anything is."""

        async def settle() -> None:
            # Quiet, and still quiet once the callbacks its last step scheduled have run: one
            # of them may move a job on (a waiting job admitted when a slot frees, which then
            # owes its answer until it reaches the runner or the fleet refuses it).
            deadline = time.monotonic() + SETTLE_S
            while await poll(self.door.quiet, deadline - time.monotonic()):
                for _ in range(3):
                    await asyncio.sleep(0)
                if self.door.quiet():
                    return

        self.run(settle())
        self.door.after_settle()

    def live(self) -> list[Any]:
        return [c for c in self.door.clients if c.open]

    def a_client(self, data: st.DataObject) -> Any:
        """A connected client (a new one if none is left)."""
        client = pick(data, self.live(), "client")
        if client is None:
            self.door.connect_a_client()
            client = self.live()[-1]
        return client

    def end_job(self, job: str, ok: bool) -> None:
        with self.reporting():
            self.door.job_ending(job, ok)
        self.runner.end(job, ok)
        self.broken = self.broken or not ok

    # Rules: what every door has ----------------------------------------------------------

    # What a rule may act on depends on real time (a job reaches the runner, a reply its client,
    # a request at the HTTP door is decided again at its hint, when the loop gets to them): the
    # rules are always enabled and pick by a drawn index, doing nothing when there is nothing to
    # act on, so that hypothesis draws the same choices whatever the timing.

    @rule()
    def connect(self) -> None:
        if len(self.live()) >= self.door.MAX_CLIENTS:
            self.log(f"(no connect: {self.door.MAX_CLIENTS} clients connected)")
            return
        self.door.connect_a_client()

    @rule(data=st.data())
    def submit(self, data: st.DataObject) -> None:
        """A client sends work: jobs (as the door draws them), maybe with their cancels."""
        self.door.submit(self.a_client(data), data)

    @rule(data=st.data())
    def crowd(self, data: st.DataObject) -> None:
        """More jobs than the slots at once, from several clients."""
        self.door.crowd(data)

    @precondition(lambda self: self.door.CANCELS)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        """A client cancels a job it sent: running, or (where its door lets it say so) held or
        over."""
        target = pick(data, self.door.cancellable(), "job")
        if target is None:
            self.log("(no job to cancel)")
            return
        self.door.cancel(*target, data)

    @rule(data=st.data())
    def disconnect(self, data: st.DataObject) -> None:
        """A client leaves: while its job runs, while it waits, or between requests."""
        client = pick(data, self.door.leavers(), "client")
        how = data.draw(st.sampled_from(self.door.LEAVINGS), label="how")
        # (drawn whether or not a client is left to leave, which is up to the timing: the
        # draws of a step must not depend on it, or hypothesis cannot replay the example)
        last_words = data.draw(st.booleans(), label="last words")
        if client is None:
            self.log("(no client to leave)")
            return
        self.door.disconnect(client, how, last_words)
        self.settle()

    @rule(data=st.data(), ok=st.booleans())
    def end_a_job(self, data: st.DataObject, ok: bool) -> None:
        """The runner finishes a running job, or fails it."""
        job = pick(data, self.runner.running(), "job")
        if job is None:
            self.log("(no job to end)")
            return
        self.end_job(job, ok)
        self.settle()

    @precondition(lambda self: not self.drained and self.steps >= self.door.DRAIN_AFTER)
    @rule()
    def drain(self) -> None:
        """From now on, new jobs are refused as draining; running ones go on."""
        self.drained = True
        self.log("server begins a drain")

        async def drain() -> None:
            self.the_server.begin_drain("test")

        self.run(drain())
        self.settle()

    # Invariants --------------------------------------------------------------------------

    @invariant()
    def count_steps(self) -> None:
        self.steps += 1

    def accounts_settle(self) -> bool:
        server = self.the_server
        return (
            server.inflight == server.live_jobs
            and self.door.buffers_settle()
            and not self.door.orphans()
        )

    @invariant()
    def slots_held_are_live_jobs(self) -> None:
        if self.server is None:
            return
        server = self.server
        with self.reporting():
            # A task that has just ended gives its slot back in its done-callback, a loop
            # iteration later; a leaked slot is never given back.
            self.run(poll(self.accounts_settle, SETTLE_S))
            inflight, live, buffered, tenants = accounted(server)
            assert inflight == live, (
                f"{inflight} slot(s) held, {live} live execution(s): {holders(server)}"
            )
            cap = server.config.max_inflight
            assert inflight <= cap, f"{inflight} slot(s) held, over the cap of {cap}"
            assert sum(tenants) == inflight, f"tenants' counts {tenants}, {inflight} slot(s)"
            for tenant in server.tenants.all():
                assert tenant.inflight <= tenant.config.max_inflight, tenant.name
            assert len(self.runner.running()) <= live
            orphans = self.door.orphans()
            assert not orphans, f"jobs run on for clients that left: {orphans}"
            assert buffered <= server.config.max_buffer_bytes
            if server.fleet is not None:  # the runner runs only jobs the fleet leased
                leases = len(server.fleet.gate.leases)
                assert leases <= (server.config.fleet_max_inflight or leases)  # (0: no cap)
                assert len(self.runner.running()) <= leases
                assert leases <= live, f"{leases} lease(s) held, {live} live execution(s)"
            self.door.check_accounts()

    @invariant()
    def one_answer_each(self) -> None:
        with self.reporting():
            self.check_answers()

    def check_answers(self) -> None:
        for client in self.door.clients:
            problems = self.door.problems(client)
            assert not problems, f"{client}: {problems}"
            for ask in self.door.asks(client):
                assert len(ask.answers) <= 1, f"{client}: two answers to {ask}"
                if ask.answers:
                    self.door.check_answer(client, ask)
            if client.open:
                owed = self.door.owed(client)
                assert not owed, f"{client}: no answer to {owed}"
            self.door.check_connection(client)

    # The end -----------------------------------------------------------------------------

    def teardown(self) -> None:
        try:
            if self.server is not None and not self.failed:
                with self.reporting():
                    self.run(self.finish())
        finally:
            self.run(self.close())
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    async def finish(self) -> None:
        """Every job finishes and is answered (those admitted later too, once they run); then
        every client leaves, and the server must give back every slot, byte and count, and
        whatever a door keeps for a while once its time has passed."""
        server = self.the_server
        deadline = time.monotonic() + self.door.LAST_JOBS_S + SETTLE_S
        # (a request at the door may be admitted in any iteration: its job is live before it
        # reaches the runner)
        while server.live_jobs or self.door.pending():
            for job in self.runner.running():
                self.end_job(job, True)
            await poll(self.door.quiet, SETTLE_S)
            for _ in range(3):
                await asyncio.sleep(0)
            if time.monotonic() > deadline:
                self.log("(the wait for the last jobs timed out)")
                break
            await asyncio.sleep(0.005)
        self.log("runner finishes every job")
        await poll(self.door.quiet, SETTLE_S)
        assert not self.runner.running(), f"jobs still running: {self.runner.running()}"
        assert not self.door.pending(), f"still waiting: {self.door.pending()}"
        self.check_answers()
        self.door.check_final()
        for client in self.door.clients:
            if not client.left:
                client.left = True
                client.writer.close()
        self.log("every client closes")
        await poll(lambda: accounted(server)[:3] == (0, 0, 0) and not server.connections, FINAL_S)
        inflight, live, buffered, _ = accounted(server)
        assert (inflight, live, buffered) == (0, 0, 0), (
            f"with no client left: {inflight} slot(s) held, {live} live execution(s), "
            f"{buffered} payload byte(s) buffered"
        )
        assert not server.connections
        for tenant in server.tenants.all():
            assert (tenant.inflight, tenant.running) == (0, []), tenant.name
        if server.fleet is not None:
            leases = server.fleet.gate.leases
            assert not leases, f"{len(leases)} fleet lease(s) held with no job left"
        await self.door.forget()
        last = len(LANES) - 1
        await poll(lambda: given_back(server) and server.ledger.waiting(last) == 0, FINAL_S)
        for tenant in server.tenants.all():
            assert tenant.waiting == 0, f"tenant {tenant.name}: waiting {tenant.waiting}"
        assert server.ledger.waiting(last) == 0, "promises left in the ledger's line"

    async def close(self) -> None:
        for client in self.door.clients:
            client.writer.close()
            client.reading.cancel()
        await asyncio.gather(*(c.reading for c in self.door.clients), return_exceptions=True)
        if self.server is not None:
            server = self.server
            await server.close()
            await poll(lambda: not server.connections, FINAL_S)  # their connection_lost ran
        if self.neighbour is not None:
            await self.neighbour.close()
        for client in self.door.clients:  # their transports must close before the loop does
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(client.writer.wait_closed(), 1.0)


def machine(
    door: Callable[[Interleavings], Door],
    make_loop: Callable[[], asyncio.AbstractEventLoop],
    config: dict[str, Any] | None = None,
) -> type[Interleavings]:
    """The machine for ``door`` on loops from ``make_loop``: the shared rules and invariants,
    and a rule for each of the door's own moves."""

    def as_rule(name: str, method: Any) -> Any:
        def apply(self: Interleavings, **args: Any) -> None:
            getattr(self.door, name)(**args)

        apply.__name__ = apply.__qualname__ = name
        apply.__doc__ = method.__doc__
        as_a_rule: Any = rule  # (its overloads cannot tell a dict's keys from target's)
        return as_a_rule(**method.move_strategies)(apply)

    moves = {
        name: as_rule(name, method)
        for name in dir(door)
        if hasattr(method := getattr(door, name), "move_strategies")
    }
    attrs: dict[str, Any] = {
        "door_type": door,
        "make_loop": staticmethod(make_loop),
        "config": config or {},
        **moves,
    }
    loop_name = getattr(make_loop, "__module__", "loop").split(".")[0]
    return type(f"{door.__name__}On{loop_name.title()}", (Interleavings,), attrs)
