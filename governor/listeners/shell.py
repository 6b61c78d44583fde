"""What both HTTP listeners share, with no IO: a request read under the same bounds.

The front door (:mod:`.http`) and the operator's listener (:mod:`.admin`) parse HTTP with h11
and read each request through an :class:`Incoming`: a head of at most :data:`MAX_HEAD_BYTES` in
:data:`MAX_HEADERS` fields (431), a body of at most its listener's bound, told by Content-Length
before it is read or counted as it arrives (413). What is refused before the request is whole
is a :class:`ClosingError`: h11 cannot answer a request it has not parsed, so each listener
writes it by hand in its own shape (an OpenAI error, a JSON one), then closes the connection.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Container
from dataclasses import dataclass
from http import HTTPStatus

import h11

from protocol.codes import NeedCode

MAX_HEAD_BYTES = 16 * 1024
MAX_HEADERS = 100


@dataclass(frozen=True, slots=True)
class ClosingError:
    """A request answered by hand before it is whole (then the connection closes)."""

    status: HTTPStatus
    code: str  # its need code
    message: str
    headers: tuple[tuple[str, str], ...] = ()


HEAD_TOO_LARGE = ClosingError(
    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
    NeedCode.SPEC_INVALID,
    f"a request head may have {MAX_HEADERS} fields and {MAX_HEAD_BYTES} bytes",
)


def header(request: h11.Request, name: bytes) -> str | None:
    """The value of the request's header ``name`` (lower case), the first if repeated."""
    for key, value in request.headers:  # (names lower-cased by h11)
        if key == name:
            return value.decode("latin-1")
    return None


class Incoming:
    """A connection's request as it arrives: its head (:meth:`head`) and its body's bytes
    (:meth:`data`) checked against the bounds, a :class:`ClosingError` past them.

    ``max_body``: the body's bound; ``paths``: those the listener names in its metrics (any
    other is ``"other"``).
    """

    def __init__(self, max_body: int, paths: Container[str] = ()) -> None:
        self.max_body = max_body
        self.paths = paths
        self.request: h11.Request | None = None
        self.path = "other"
        self.body = bytearray()

    def head(self, request: h11.Request) -> ClosingError | None:
        """The request's head: within the bounds (its body too, if it says its length)?"""
        size = len(request.target) + sum(len(n) + len(v) + 4 for n, v in request.headers)
        if size > MAX_HEAD_BYTES or len(request.headers) > MAX_HEADERS:
            return HEAD_TOO_LARGE
        self.request = request
        path = urllib.parse.urlsplit(request.target.decode("ascii", "replace")).path.rstrip("/")
        self.path = path if path in self.paths else "other"
        length = header(request, b"content-length")
        if length is not None and int(length) > self.max_body:  # (h11 checked it is a number)
            return self.too_large()
        return None

    def data(self, data: bytes) -> ClosingError | None:
        """More of its body: within its bound?"""
        self.body += data
        return self.too_large() if len(self.body) > self.max_body else None

    def too_large(self) -> ClosingError:
        """More bytes than the bounds allow: its head's, or its body's once the head is read."""
        if self.request is None:
            return HEAD_TOO_LARGE
        return ClosingError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            NeedCode.PAYLOAD_TOO_LARGE,
            f"a request body may have {self.max_body} bytes",
        )

    def done(self) -> None:
        """The request is answered: ready for the next."""
        self.request = None
        self.path = "other"
        self.body = bytearray()
