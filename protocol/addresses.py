"""``HOST:PORT`` addresses, read the same way by the daemon and the clients.

A listen address may ask for port 0 (the OS picks a free port); an address to connect to may
not, since nothing listens on port 0.
"""

from __future__ import annotations


def parse_address(text: str, *, allow_port_zero: bool) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) into its parts; raises ``ValueError``."""
    host, sep, port = text.rpartition(":")
    lowest = 0 if allow_port_zero else 1
    digits = port.isascii() and port.isdigit()  # ("²".isdigit(), but int() refuses it)
    if not sep or not host or not digits or not lowest <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


__all__ = ["parse_address"]
