"""Logs: text for people, JSON lines for machines, written off the event loop.

An event is a message with fields: one per job outcome (``event="job"``) and one per state
change (``readiness``, ``liveness``, ``breaker``, ``overload``, ``worker``, ``drain``). With
``log_format = "json"`` each record is one JSON object on one line::

    {"ts": "2026-11-22T12:00:00.123+00:00", "level": "info", "logger": "governor.jobs",
     "msg": "job done", "event": "job", "job": "J_1", "tenant": "default", ...}

and with ``text`` the fields follow the message as ``key=value``.

Every job writes a line, so what a line costs the event loop is kept to formatting it
(``docs/BENCHMARKS.md`` gives its share of a job, ``CHANGELOG.md`` what batching it saved): :func:`event` builds the line itself, with no
``logging.LogRecord``, and appends it to the :class:`LineWriter`'s buffer. A writer thread
takes whatever has piled up and writes it in one call, so a stderr pipe that a log collector
drains slowly never stalls admission; the loop never waits on a lock or wakes the thread for
each line (only the first line after a write does). When :data:`MAX_PENDING` lines are
waiting, further lines are dropped and counted (``governor_log_records_dropped_total``), never
waited for. Records logged the ordinary way (``log.info(...)``, exceptions) take the same
route through :class:`WriterHandler`, formatted by the same functions.

Before :func:`configure` (a server run inside a test), :func:`event` hands its record to
``logging`` as usual, its fields under ``extra``.
"""

from __future__ import annotations

import collections
import datetime
import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TextIO

import orjson

MAX_PENDING = 10_000  # lines waiting for the writer; more are dropped
BATCH_S = 0.01  # the writer gathers lines this long after the first, then writes them at once


class LineFormat(Protocol):
    def __call__(
        self,
        created: float,
        level: int,
        logger: str,
        msg: str,
        fields: Mapping[str, Any],
        exc: str | None = None,
    ) -> str: ...


def json_line(
    created: float,
    level: int,
    logger: str,
    msg: str,
    fields: Mapping[str, Any],
    exc: str | None = None,
) -> str:
    line: dict[str, Any] = {
        "ts": datetime.datetime.fromtimestamp(created, datetime.UTC).isoformat(
            timespec="milliseconds"
        ),
        "level": logging.getLevelName(level).lower(),
        "logger": logger,
        "msg": msg,
    }
    line.update(fields)
    if exc:
        line["exc"] = exc
    return orjson.dumps(line, default=str).decode()


def text_line(
    created: float,
    level: int,
    logger: str,
    msg: str,
    fields: Mapping[str, Any],
    exc: str | None = None,
) -> str:
    """``2026-11-22 12:00:00,123 INFO governor.jobs: job done job=J_1 ...`` (logging's
    default time format, local time)."""
    text = f"{_second(int(created))},{int(created * 1000) % 1000:03d} "
    text += f"{logging.getLevelName(level)} {logger}: {_escape(msg)}"
    if fields:
        text += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
    if exc:  # a traceback's own lines stay lines; nothing in them may move the cursor
        text += "\n" + "\n".join(_escape(line) for line in exc.split("\n"))
    return text


def _escape(text: str) -> str:
    """``text`` with every character that is not printable (C0 and C1 controls, DEL, line and
    paragraph separators, unassigned code points) as a backslash escape: a value from the
    network (a job id holding ``"\\n2026-11-22 ... INFO"``) must not forge a line, nor an ESC
    sequence rewrite the operator's terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escaped(c) for c in text)


def _escaped(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


@functools.lru_cache(maxsize=4)
def _second(second: int) -> str:
    """The local date and time of a second (most lines fall in the same second as the last)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))


_PLAIN = {None: "null", True: "true", False: "false"}


def _text_value(value: Any) -> str:
    """A field's value: a plain word as it is, anything else as JSON (escaped: JSON leaves C1
    controls as they are)."""
    kind = type(value)
    if kind is str:
        if value and " " not in value and "=" not in value and value.isprintable():
            return str(value)
    elif kind is int:
        return str(value)
    elif value is None or kind is bool:
        return _PLAIN[value]
    return _escape(orjson.dumps(value, default=str).decode())


class LineWriter:
    """The writer thread and the bounded buffer of lines it writes."""

    def __init__(self, stream: TextIO, max_pending: int = MAX_PENDING) -> None:
        self.stream = stream
        self.max_pending = max_pending
        self.dropped = 0
        # deque.append and popleft are atomic: the loop appends, the thread takes, no lock.
        self._pending: collections.deque[str] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="governor-log", daemon=True)

    def put(self, line: str) -> None:
        """Queue a line; never blocks (a full buffer drops it)."""
        pending = self._pending
        if len(pending) >= self.max_pending:
            self.dropped += 1
            return
        pending.append(line)
        if not self._wake.is_set():  # (a flag read: no lock, no system call)
            self._wake.set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Write what is pending, then end the thread."""
        self._stopping = True
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        pending, wake = self._pending, self._wake
        while not self._stopping or pending:
            wake.wait()
            if not self._stopping:
                time.sleep(BATCH_S)  # let a burst pile up: one write for it, not one a line
            wake.clear()  # (before taking: a line put after this sets it again)
            lines = [pending.popleft() for _ in range(len(pending))]
            if not lines:
                continue
            try:
                self.stream.write("\n".join(lines) + "\n")
                self.stream.flush()
            except (OSError, ValueError):  # a closed or broken stderr: nothing to tell
                pass


class WriterHandler(logging.Handler):
    """Ordinary log records, formatted by the caller, to the :class:`LineWriter`."""

    def __init__(self, writer: LineWriter, line_format: LineFormat) -> None:
        super().__init__()
        self.writer = writer
        self.line_format = line_format

    def emit(self, record: logging.LogRecord) -> None:
        try:
            exc = None
            if record.exc_info:
                exc = logging.Formatter().formatException(record.exc_info)
            fields = getattr(record, "fields", None) or {}
            self.writer.put(
                self.line_format(
                    record.created, record.levelno, record.name, record.getMessage(), fields, exc
                )
            )
        except Exception:
            self.handleError(record)


_writer: LineWriter | None = None
_format: LineFormat = text_line


def event(logger: logging.Logger, level: int, msg: str, /, **fields: Any) -> None:
    """Log ``msg`` with structured ``fields`` (cheap when the level is off)."""
    if not logger.isEnabledFor(level):
        return
    writer = _writer
    if writer is None:
        logger.log(level, msg, extra={"fields": fields})
        return
    writer.put(_format(time.time(), level, logger.name, msg, fields))


def dropped_records() -> int:
    """Lines dropped so far because the writer fell behind (0 before :func:`configure`)."""
    return 0 if _writer is None else _writer.dropped


def configure(level: str, fmt: str, stream: TextIO | None = None) -> Callable[[], None]:
    """Send the process's logs to ``stream`` (stderr) through a writer thread; returns the
    stop function, which writes what is pending first."""
    global _writer, _format
    # Nothing here prints a record's source line, thread or process: don't look them up.
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    writer = LineWriter(stream if stream is not None else sys.stderr)
    _format = json_line if fmt == "json" else text_line
    root = logging.getLogger()
    handlers, root_level = root.handlers[:], root.level
    root.handlers[:] = [WriterHandler(writer, _format)]
    root.setLevel(level.upper())
    writer.start()
    _writer = writer

    def stop() -> None:
        global _writer
        _writer = None
        root.handlers[:], root.level = handlers, root_level
        writer.stop()

    return stop
