"""The replicas' addresses: ``HOST:PORT`` texts, and the names that stand for several replicas
(the A records of a headless service) resolved into one :class:`Address` each."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.addresses import parse_address


@dataclass(frozen=True, slots=True)
class Address:
    """One replica: where to connect, and the name it was found under (checked against the
    server's TLS certificate; None: ``host`` itself)."""

    host: str
    port: int
    server_hostname: str | None = None

    @property
    def name(self) -> str:
        """``HOST:PORT`` (``[v6]:PORT``): how the replica is named in results and status."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def split_addresses(addresses: str | Iterable[str]) -> list[str]:
    """``HOST:PORT`` texts from one comma-separated string or several; raises ``ValueError``
    for one that is not ``HOST:PORT``, or for none at all."""
    texts = [addresses] if isinstance(addresses, str) else list(addresses)
    out = [part.strip() for text in texts for part in text.split(",") if part.strip()]
    if not out:
        raise ValueError("no address given")
    for text in out:
        parse_address(text, allow_port_zero=False)
    return out


AddrInfo = tuple[Any, Any, Any, Any, tuple[Any, ...]]


def spread(host: str, port: int, infos: Iterable[AddrInfo]) -> list[Address]:
    """The replicas behind ``host`` from its ``getaddrinfo`` answer: one per address.

    A name with several addresses of one family (the A records of a headless service) stands
    for several replicas. A name with one address per family (``localhost``: 127.0.0.1 and
    ::1) is one host reachable two ways: it stays one replica, connected to by name as ever.
    When both families have several, the family with more wins (the first answered on a tie).
    """
    by_family: dict[Any, list[str]] = {}
    for family, _, _, _, sockaddr in infos:
        ips = by_family.setdefault(family, [])
        if sockaddr[0] not in ips:
            ips.append(str(sockaddr[0]))
    widest = max(by_family.values(), key=len, default=[])
    if len(widest) <= 1:
        return [Address(host, port)]
    return [Address(ip, port, host) for ip in widest]


Resolver = Callable[[str, int], Awaitable[Sequence[Address]]]


async def system_resolver(host: str, port: int) -> list[Address]:
    """:func:`spread` over the system's ``getaddrinfo``; a name that does not resolve stays as
    it is (connecting to it then fails, and counts against it, as for any replica down)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:  # socket.gaierror included
        return [Address(host, port)]
    return spread(host, port, infos)


def resolve_now(addresses: str | Iterable[str]) -> list[Address]:
    """:func:`resolve` with the system's resolver, blocking: for a command line deciding,
    before its event loop runs, whether it speaks to one governor or to several."""
    found: list[Address] = []
    for text in split_addresses(addresses):
        host, port = parse_address(text, allow_port_zero=False)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            found.append(Address(host, port))
            continue
        found += spread(host, port, infos)
    return distinct(found)


async def resolve(
    addresses: str | Iterable[str], *, resolver: Resolver | None = None
) -> list[Address]:
    """Every replica that ``addresses`` (``HOST:PORT`` texts, or one comma-separated string)
    stand for, once each, in order. ``resolver`` replaces the system's (tests, service
    discovery)."""
    lookup = resolver or system_resolver
    found: list[Address] = []
    for text in split_addresses(addresses):
        found += await lookup(*parse_address(text, allow_port_zero=False))
    return distinct(found)


def distinct(addresses: Iterable[Address]) -> list[Address]:
    """Each replica once (the first address under its name), in order."""
    seen: dict[str, Address] = {}
    for a in addresses:
        seen.setdefault(a.name, a)
    return list(seen.values())
