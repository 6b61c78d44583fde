"""One client connection's IO: bytes to the session, its bytes to the socket, and the timers.

Everything the protocol decides lives in :class:`~governor.listeners.session.Session` (sans-IO) and
each admitted job's run in its :class:`~governor.execution.Execution`; this class only moves
bytes and events between them and the transport (uvicorn's ``h11_impl`` is the model): the
connection limits (:mod:`governor.core.sources`), one timer for the session's deadlines (a frame
waiting for its key's turn among them: reading stops meanwhile), flow control, and the
client's leaving.

Turns: a connection handles at most ``LINES_PER_TURN`` lines, then stops reading until the
other connections have had theirs (``call_soon``), so that one client pipelining thousands of
frames cannot hold the event loop for all of them while another's ping waits.

Flow control: when the client stops reading its replies (the transport's buffer passes its
high-water mark), reading stops and so does the handling of lines already read; both resume
when it reads again. A client that leaves ``write_buffer_bytes`` of replies unread (a running
job's stream keeps writing) or does not read for ``write_timeout`` seconds is cut off:
``abort()``, which drops what it did not read, since a flushing close would wait on it forever.
"""

from __future__ import annotations

import asyncio
import math
import socket
import ssl
from typing import cast

from protocol.codes import ErrorCode, NeedCode

from ..execution import start
from ..state import ServerState
from . import tls as tls_module
from .base import Deadlines, bind, bound_address
from .outbound import BACKLOG, Outbound, connection_id
from .session import Session


class TcpListener:
    """The protocol's listener (:class:`~governor.listeners.base.Listener`): on ``sock`` if
    given (a test's, already bound), else on ``listen``."""

    early = False

    def __init__(
        self, state: ServerState, tls: ssl.SSLContext | None, sock: socket.socket | None = None
    ) -> None:
        self.state = state
        self.tls = tls
        self._sock = sock
        self._server: asyncio.Server | None = None
        self.deadlines = Deadlines(state.admission.clock)  # every connection's, on one timer

    @property
    def address(self) -> tuple[str, int]:
        assert self._sock is not None
        return bound_address(self._sock)

    def bind(self) -> None:
        if self._sock is None:
            self._sock = bind(*self.state.config.listen_address, BACKLOG)

    async def serve(self) -> None:
        assert self._sock is not None
        self._server = (
            self.state.connections.listener
        ) = await asyncio.get_running_loop().create_server(
            lambda: cast(asyncio.Protocol, GovernorProtocol(self.state, self.deadlines)),
            sock=self._sock,
            backlog=BACKLOG,
            ssl=self.tls,
            ssl_handshake_timeout=tls_module.HANDSHAKE_TIMEOUT_S if self.tls is not None else None,
        )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        elif self._sock is not None:
            self._sock.close()
        self.deadlines.close()

    def describe(self) -> str | None:
        return None  # (the server's own line says where it listens, with its cap and runner)


class GovernorProtocol:
    """One connection's :class:`asyncio.Protocol` (by its methods, not by inheritance: a
    compiled class with a Python base keeps its attributes in a dict, and this one's are read
    several times a frame)."""

    def __init__(self, state: ServerState, deadlines: Deadlines) -> None:
        self.state = state
        self.transport: asyncio.Transport | None = None
        self.session = Session(state, self, conn_id := connection_id())
        self.out = Outbound(state, conn_id)  # its writes, bounded, and its close
        self._loop = asyncio.get_running_loop()
        self._served = False  # counted in the connections and against its source
        self._deadlines = deadlines
        self.due_at: int | None = None  # (its place in the deadlines)
        self._deadline = math.inf  # the next, on the session's clock
        self._next_turn = False  # lines wait for another turn, after the other connections'

    # asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        state, session, out = self.state, self.session, self.out
        session.credentials.connected(*out.made(transport))
        self.transport = out.transport
        session.idle = session.is_idle
        refused = state.connections.opened(self, session, session.source, idle=session.is_idle)
        if refused is not None:
            session.fatal(refused.need_code, refused.error_code, refused.detail)
            return
        self._served = True
        self._schedule()

    def connection_lost(self, exc: Exception | None) -> None:
        self._deadlines.remove(self)
        self.session.connection_lost()
        if self._served:
            self._served = False
            self.state.connections.closed(self, self.session)

    def pause_writing(self) -> None:
        # The client is not reading its replies: stop reading and handling its requests.
        self.session.pause()
        self._reading()
        if self.out.pause():
            self._schedule()

    def resume_writing(self) -> None:
        session = self.session
        if session.closed:
            return
        self.out.resume()
        self._schedule()
        session.resume()
        self._turn_ended(self._receive(b""))  # (the lines that waited may fill the buffer again)
        self._reading()

    def data_received(self, data: bytes) -> None:
        self._turn_ended(self._receive(data))

    def _receive(self, data: bytes) -> bool:
        """The session handles the bytes; each job it admits on the way is started before it
        handles the next line. True when lines remain for another turn."""
        session = self.session
        more = session.receive_data(data)
        while (admitted := session.next_event()) is not None:
            session.started(start(self.state, admitted, session.table.replies))
            more = session.receive_data(b"")
        return more

    # For the session (sans-IO: what it asks of its connection) -----------------------------

    def write(self, data: bytes) -> None:
        if not self.out.write(data):
            self.session.closed = True  # (cut off: its client left too much unread)

    def wake(self) -> None:
        """The session decided a waiting job between reads (the line offered it a slot): start
        it if admitted, and keep its next deadline."""
        if not self.session.closed:
            self._turn_ended(self._receive(b""))
            self._reading()

    def _turn_ended(self, more: bool) -> None:
        """After a turn of handling lines: another one after the other connections' (reading
        stops meanwhile) if lines remain; the deadline timer moved if one came sooner."""
        session = self.session
        if more and not self._next_turn:
            self._next_turn = True
            self._loop.call_soon(self._take_turn)
            self._reading()
        elif session.deferred is not None:  # a frame waits for its key's turn: so does reading
            self._reading()
        sooner = session.sooner
        if sooner is not None:
            session.sooner = None
            if sooner < self._deadline:
                self._schedule()

    def _take_turn(self) -> None:
        self._next_turn = False
        if not self.session.closed:
            self._turn_ended(self._receive(b""))
            self._reading()  # (again, once no turn is pending)

    def _reading(self) -> None:
        """Read while the client reads its replies and its lines are handled as they come."""
        transport, session = self.transport, self.session
        if transport is None or session.closed:
            return
        wanted = not (session.paused or session.deferred or self._next_turn)
        if transport.is_reading() != wanted:
            if wanted:
                transport.resume_reading()
            else:
                transport.pause_reading()

    def eof_received(self) -> bool:
        # EOF is the client leaving: a half-close cannot be told apart from a close, and work
        # must not run on for a client that is gone. Returning False closes the transport,
        # and connection_lost cancels what runs.
        return False

    # For the server ------------------------------------------------------------------------

    def abort_running(self, need_code: NeedCode, error_code: ErrorCode, detail: str) -> None:
        self.session.table.abort_running(need_code, error_code, detail)

    def close(self) -> None:
        """Close after the replies written so far: at once if the client does not read them,
        else within ``write_timeout``."""
        self.session.closed = True
        if self.out.close():
            self._schedule()

    # Deadlines -----------------------------------------------------------------------------

    def _schedule(self) -> None:
        """Keep the next deadline, the session's or the write's, on the listener's one timer."""
        session = self.session
        deadline = self.out.write_due
        if not session.closed:
            deadline = min(deadline, session.next_deadline(session.clock()))
        self._deadline = deadline
        self._deadlines.put(self, deadline)

    def on_deadline(self) -> None:
        session = self.session
        if self.out.overdue(session.clock()):
            session.closed = True
            return
        if session.expire(session.clock()):  # a frame that waited for its key's turn went on
            self._turn_ended(self._receive(b""))
            self._reading()
        self._schedule()  # (closed: only a write still due)
