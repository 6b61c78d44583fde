"""A bounded, linear-time splitter of a byte stream into ``\\n``-terminated lines."""

from __future__ import annotations

from .errors import LineTooLong

_COMPACT_AT = 64 * 1024  # drop consumed bytes once this many have piled up at the front


class LineReader:
    """Bytes in with :meth:`feed`, lines out with :meth:`next_line`.

    A line is returned without its ``\\n`` (and without a ``\\r`` before it). At most
    ``max_line_bytes`` bytes of a line are ever buffered: once an unterminated line grows past
    that, :meth:`next_line` raises :class:`LineTooLong`, and keeps raising it, since the
    stream cannot be resynchronised. The reader remembers how far it has searched for a
    newline, so feeding a long line a byte at a time stays linear.
    """

    __slots__ = ("_broken", "_buf", "_scanned", "_start", "max_line_bytes")

    def __init__(self, max_line_bytes: int) -> None:
        if max_line_bytes < 1:
            raise ValueError("max_line_bytes must be at least 1")
        self.max_line_bytes = max_line_bytes
        self._buf = bytearray()
        self._start = 0  # where the current (unreturned) line begins
        self._scanned = 0  # bytes after _start already known to hold no newline
        self._broken = False

    def feed(self, data: bytes) -> None:
        if not self._broken:  # (a broken stream is never read again: keep none of it)
            self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes held that are not yet part of a returned line."""
        return len(self._buf) - self._start

    def next_line(self) -> bytes | None:
        """The next complete line, or ``None`` until more data is fed."""
        if self._broken:
            raise LineTooLong(self.max_line_bytes)
        buf = self._buf
        end = buf.find(b"\n", self._start + self._scanned)
        if end < 0:
            self._scanned = len(buf) - self._start
            # A full-length line may still be waiting for the "\n" after its "\r".
            over = self._scanned - self.max_line_bytes
            if over > 1 or (over == 1 and buf[-1] != 0x0D):
                self._broken = True
                raise LineTooLong(self.max_line_bytes)
            self._compact()
            return None
        stop = end - 1 if end > self._start and buf[end - 1] == 0x0D else end
        if stop - self._start > self.max_line_bytes:
            self._broken = True
            raise LineTooLong(self.max_line_bytes)
        line = bytes(buf[self._start : stop])
        self._start = end + 1
        self._scanned = 0
        return line

    def _compact(self) -> None:
        if self._start >= _COMPACT_AT or self._start == len(self._buf):
            del self._buf[: self._start]
            self._start = 0
