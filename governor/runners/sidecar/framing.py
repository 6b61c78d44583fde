"""The upstream's framing, sans-IO: a chunked HTTP/1.1 body and an OpenAI-style event stream,
decoded from their bytes as they come, whatever the reads. Pure (no IO, no clock), and compiled
with the hot path (``governor/compiled.py``): a sidecar decodes both once a token.
"""

from __future__ import annotations

from typing import Any

import orjson

MAX_LINE = 4096  # the longest line of a chunked body's framing: a chunk's size, a trailer
HEX = frozenset(b"0123456789abcdefABCDEF")


class UpstreamError(Exception):
    """The upstream could not be reached, or broke the protocol or the connection."""


class UpstreamTimeout(UpstreamError):
    """The upstream sent nothing for the client's timeout (or did not accept a connection)."""


class Chunks:
    """A chunked body's decoder (RFC 9112, 7.1): :meth:`feed` it what arrives, it gives the
    data (each chunk's, as much of it as has come) and says when the body :attr:`done` (its
    last chunk and trailers read; :attr:`rest` is what came after, nothing from a server that
    waits for the next request)."""

    __slots__ = ("done", "left", "rest", "stage")

    def __init__(self) -> None:
        self.stage = 0  # 0: a size line next, 1: data (``left`` bytes), 2: its CRLF, 3: trailers
        self.left = 0
        self.rest = b""
        self.done = False

    def feed(self, data: bytes) -> list[bytes]:
        buffer, at, out = self.rest + data if self.rest else data, 0, []
        while not self.done:
            if self.stage == 1:
                piece = buffer[at : at + self.left]
                if not piece:
                    break
                out.append(piece)
                at += len(piece)
                self.left -= len(piece)
                if self.left:
                    break
                self.stage = 2
                continue
            end = buffer.find(b"\r\n", at)
            if end < 0:
                if len(buffer) - at > MAX_LINE:
                    raise UpstreamError("the upstream's chunked body has a line too long")
                break
            line, at = buffer[at:end], end + 2
            if self.stage == 2:
                if line:
                    raise UpstreamError("the upstream's chunk does not end where its size says")
                self.stage = 0
            elif self.stage == 0:
                size = line.split(b";", 1)[0].strip()
                if not size or not HEX.issuperset(size) or len(size) > 16:
                    raise UpstreamError(f"the upstream's chunk size is not one: {line[:40]!r}")
                self.left = int(size, 16)
                self.stage = 1 if self.left else 3
            elif not line:  # the blank line after the trailers
                self.done = True
        self.rest = buffer[at:]
        return out


class SseEvents:
    """An OpenAI-style stream's events, from its bytes as they come (:meth:`feed`), up to
    ``data: [DONE]`` (:attr:`done`; what follows is left): each event's bytes as they came (to
    pass on), and its ``data:`` decoded (None for an event with no data, a comment, say;
    ``orjson.JSONDecodeError`` for data that is not JSON). Split on the blank line that ends an
    event, in the stream's bytes: no decoding of lines but the data's."""

    __slots__ = ("_buffer", "done", "limit")

    def __init__(self, limit: int) -> None:
        self._buffer = b""
        self.done = False
        self.limit = limit  # the most held of an event not yet ended

    def feed(self, data: bytes) -> list[tuple[bytes, Any]]:
        if self.done:
            return []
        buffer = self._buffer + data if self._buffer else data
        if len(buffer) > self.limit:  # (no blank line: no end of an event in sight)
            raise UpstreamError(f"the upstream's stream event is over {self.limit} bytes")
        out = []
        while True:
            end, cut = _event_end(buffer)
            if end < 0:
                break
            raw, buffer = buffer[:cut], buffer[cut:]
            lines = [
                line[5:].strip() for line in raw[:end].splitlines() if line.startswith(b"data:")
            ]
            if lines == [b"[DONE]"]:
                self.done = True
                break
            out.append((raw, orjson.loads(b"\n".join(lines)) if lines else None))
        self._buffer = buffer
        return out


def _event_end(buffer: bytes) -> tuple[int, int]:
    """Where the first whole event in ``buffer`` ends (its blank line: ``\\n\\n`` or
    ``\\r\\n\\r\\n``), and where the next begins; (-1, -1): none is whole yet."""
    lf, crlf = buffer.find(b"\n\n"), buffer.find(b"\r\n\r\n")
    if crlf >= 0 and (lf < 0 or crlf < lf):
        return crlf, crlf + 4
    return (lf, lf + 2) if lf >= 0 else (-1, -1)
