"""One client connection's IO: bytes to the session, its bytes to the socket, and the timers.

Everything the protocol decides lives in :class:`~governor.session.Session` (sans-IO) and
each admitted job's run in its :class:`~governor.execution.Execution`; this class only moves
bytes and events between them and the transport (uvicorn's ``h11_impl`` is the model): the
connection limit, the idle timeout, pausing reads while the client does not read its replies,
and the client's leaving.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import cast

from protocol.codes import ErrorCode, NeedCode

from .session import Session
from .state import ServerState

_connection_ids = itertools.count(1)


class GovernorProtocol(asyncio.Protocol):
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.transport: asyncio.Transport | None = None
        self.session = Session(state, self._write, self.close, next(_connection_ids))
        self._loop = asyncio.get_running_loop()
        self._idle_timer: asyncio.TimerHandle | None = None
        self._last_active = self._loop.time()

    # asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        config = self.state.config
        if len(self.state.connections) >= config.max_connections:
            self.session.fatal(
                NeedCode.TOO_MANY_CONNECTIONS,
                ErrorCode.QUOTA,
                f"the server is at its limit of {config.max_connections} connections",
            )
            return
        self.state.connections.add(self)
        self._idle_timer = self._loop.call_at(
            self._last_active + config.idle_timeout, self._check_idle
        )

    def connection_lost(self, exc: Exception | None) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self.session.connection_lost()
        self.state.connections.discard(self)

    def pause_writing(self) -> None:
        # The client is not reading its replies: stop reading its requests until it does.
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.session.closed:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        session = self.session
        lines = session.lines
        session.receive_data(data)
        if session.lines != lines:  # a whole line is a live client; a trickle of bytes is not
            self._last_active = self._loop.time()

    def eof_received(self) -> bool:
        # EOF is the client leaving: a half-close cannot be told apart from a close, and work
        # must not run on for a client that is gone. Returning False closes the transport,
        # and connection_lost cancels what runs.
        return False

    # For the server ------------------------------------------------------------------------

    def abort_running(self, need_code: NeedCode, error_code: ErrorCode, detail: str) -> None:
        self.session.abort_running(need_code, error_code, detail)

    def close(self) -> None:
        self.session.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    # IO ----------------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    def _check_idle(self) -> None:
        session = self.session
        if session.closed:
            return
        now, timeout = self._loop.time(), self.state.config.idle_timeout
        deadline = self._last_active + timeout
        if now >= deadline and not session.running:
            session.fatal(NeedCode.IDLE_TIMEOUT, ErrorCode.TIMEOUT, f"no frame for {timeout:g} s")
            return
        self._idle_timer = self._loop.call_at(
            deadline if deadline > now else now + timeout, self._check_idle
        )
