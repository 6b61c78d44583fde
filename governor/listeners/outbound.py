"""A connection's transport as both doors use it: its id and peer, its writes bounded for a
client that does not read, and its close.

What each door parses and answers is its own (the TCP session's frames, the front door's h11
exchanges); how bytes leave, and what happens to a client that stops reading them, is the same
on both and written once, here: a client that leaves ``write_buffer_bytes`` of answers unread
while the transport is paused, or reads none for ``write_timeout`` seconds, is cut off
(``abort()``: a flushing close would wait on it forever), counted and logged alike whichever
door it came through.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from typing import cast

from ..core.sources import source_of
from ..core.tenants import Tenant
from ..state import ServerState
from ..telemetry.logs import event

log = logging.getLogger("governor.intake")

# Connections the kernel holds for a listener until the loop accepts them (capped by somaxconn).
BACKLOG = 4096

_connection_ids = itertools.count(1)


def connection_id() -> int:
    """A new connection's id, unique across listeners: it names the connection in logs."""
    return next(_connection_ids)


class Outbound:
    """One connection's way out. :attr:`write_due` is when the client must have read what was
    written (the door keeps it on its timer: :meth:`pause` and :meth:`close` say when it
    moved)."""

    def __init__(self, state: ServerState, conn_id: int) -> None:
        self.state = state
        self.conn_id = conn_id
        self.transport: asyncio.Transport | None = None
        self.source = ""  # the client's address (its /64 for IPv6)
        self.paused = False  # the client is not reading: the transport's buffer is past its mark
        self.write_due = math.inf  # cut off then unless the client reads again

    def made(self, transport: asyncio.BaseTransport) -> tuple[str, Tenant | None]:
        """The connection is open: its source, and the tenant its verified client certificate
        names, if any."""
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.source = source_of(str(peer[0])) if peer else ""
        return self.source, self.state.connections.certificate_tenant(transport)

    def write(self, data: bytes) -> bool:
        """Send ``data``; False when the client was cut off for leaving too much unread (past
        the high-water mark writing was paused; past ``write_buffer_bytes`` it is dropped)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return True
        transport.write(data)
        if self.paused and transport.get_write_buffer_size() > self.state.config.write_buffer_bytes:
            self.cut("slow_reader")
            return False
        return True

    def pause(self) -> bool:
        """The client stopped reading: it must read again within ``write_timeout``. True:
        :attr:`write_due` moved."""
        self.paused = True
        return self._await_reading()

    def resume(self) -> None:
        """It reads again (:attr:`write_due` is gone)."""
        self.paused = False
        self.write_due = math.inf

    def close(self) -> bool:
        """Close after what was written: at once if the client does not read it, else once it
        has (within ``write_timeout``). True: :attr:`write_due` moved."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        if self.paused:
            transport.abort()
            return False
        transport.close()
        return self._await_reading()

    def overdue(self, now: float) -> bool:
        """True when the client has not read for ``write_timeout``: it has been cut off."""
        if now < self.write_due:
            return False
        self.cut("write_timeout")
        return True

    def _await_reading(self) -> bool:
        if self.write_due != math.inf:
            return False
        self.write_due = self.state.now() + self.state.config.write_timeout
        return True

    def cut(self, reason: str) -> None:
        """Drop the connection now, with what it left unread (``reason`` ``slow_reader`` or
        ``write_timeout``)."""
        transport, state = self.transport, self.state
        if transport is None:
            return
        state.connections.refused[reason] += 1
        unread = transport.get_write_buffer_size()
        why = (
            f"read no reply for {state.config.write_timeout:g} s"
            if reason == "write_timeout"
            else "left more replies unread than write_buffer_bytes"
        )
        line = state.connections.sources.line(
            f"cut off connection {self.conn_id} from {self.source}: its client {why}"
        )
        if line is not None:
            event(
                log, logging.WARNING, line, event="cut", reason=reason, source=self.source,
                unread=unread,
            )  # fmt: skip
        transport.abort()
