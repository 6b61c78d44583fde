"""The shape every listener shares, so that the server starts and stops them in one loop.

A listener binds when the daemon starts (a taken address fails the start at once, before the
model loads), serves when the daemon is ready for it (the probes while the runner loads, the
job doors once it is ready) and closes when the daemon stops, as aiohttp's sites and trio's
listeners do.
"""

from __future__ import annotations

import socket
from typing import Protocol


class Listener(Protocol):
    early: bool  # serves while the runner starts (the probes), not only once it is ready

    @property
    def address(self) -> tuple[str, int]:
        """The bound address (its port, where port 0 asked for any)."""
        ...

    def bind(self) -> None:
        """Take the address now; raises OSError where it is taken."""
        ...

    async def serve(self) -> None:
        """Accept connections from now on; returns once they are accepted."""
        ...

    async def close(self) -> None:
        """Stop accepting (a listener never bound or never served closes too)."""
        ...

    def describe(self) -> str | None:
        """What the log says once it serves; None: the server says it itself."""
        ...


def bind(host: str, port: int, backlog: int) -> socket.socket:
    """A listening socket on ``host:port`` (an IPv6 host where it has a colon)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=backlog)


def bound_address(sock: socket.socket) -> tuple[str, int]:
    host, port = sock.getsockname()[:2]
    return str(host), int(port)
