"""Logs: text for people, JSON lines for machines, written off the event loop.

An event is a message with fields: one per job outcome (``event="job"``) and one per state
change (``readiness``, ``liveness``, ``breaker``, ``overload``, ``worker``, ``drain``). With
``log_format = "json"`` each record is one JSON object on one line::

    {"ts": "2026-11-22T12:00:00.123+00:00", "level": "info", "logger": "governor.jobs",
     "msg": "job done", "event": "job", "job": "J_1", "tenant": "default", ...}

and with ``text`` the fields follow the message as ``key=value``. Records go through a bounded
queue to a writer thread: a stderr pipe that a log collector drains slowly must never stall
admission. When the queue is full, records are dropped and counted, never waited for
(``governor_log_records_dropped_total``).

What a record costs the event loop is kept small, since every job writes one: no caller,
thread or process lookups (nothing prints them; the logging HOWTO's "Optimization"), and the
writer formats and writes whatever has queued up in one write, not one system call a line
(``docs/BENCHMARKS.md`` measures the per-job line).
"""

from __future__ import annotations

import copy
import datetime
import logging
import logging.handlers
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

import orjson

QUEUE_SIZE = 10_000
MAX_BATCH = 512  # records written at once
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def event(logger: logging.Logger, level: int, msg: str, /, **fields: Any) -> None:
    """Log ``msg`` with structured ``fields`` (cheap when the level is off)."""
    if logger.isEnabledFor(level):
        logger.log(level, msg, extra={"fields": fields})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        line.update(getattr(record, "fields", {}))
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line["exc"] = record.exc_text
        return orjson.dumps(line, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", None)
        if not fields:
            return text
        return text + " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())


def _text_value(value: Any) -> str:
    if isinstance(value, str) and value and " " not in value and "=" not in value:
        return value
    return orjson.dumps(value, default=str).decode()


class DroppingQueueHandler(logging.handlers.QueueHandler):
    """Never blocks: a record that finds the queue full is dropped and counted."""

    def __init__(self, q: queue.Queue[Any]) -> None:
        super().__init__(q)
        self.dropped = 0

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        # The message is merged here, and a traceback kept apart from it for the formatter
        # (the stock prepare folds it into the message).
        record = copy.copy(record)
        record.msg, record.args = record.getMessage(), None
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1


def dropped_records() -> int:
    """Records dropped so far because the writer fell behind (0 before :func:`configure`)."""
    return sum(
        h.dropped for h in logging.getLogger().handlers if isinstance(h, DroppingQueueHandler)
    )


class BatchWriter:
    """The writer thread: takes what has queued up, formats it, and writes it in one go."""

    def __init__(self, q: queue.Queue[Any], formatter: logging.Formatter, stream: TextIO) -> None:
        self.queue = q
        self.formatter = formatter
        self.stream = stream
        self._thread = threading.Thread(target=self._run, name="governor-log", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.queue.put(None)  # (blocks only until the writer has made room)
        self._thread.join()

    def _run(self) -> None:
        q, running = self.queue, True
        while running:
            batch = [q.get()]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(q.get_nowait())
                except queue.Empty:
                    break
            lines = []
            for record in batch:
                if record is None:
                    running = False
                else:
                    lines.append(self.formatter.format(record))
            if lines:
                try:
                    self.stream.write("\n".join(lines) + "\n")
                    self.stream.flush()
                except (OSError, ValueError):  # a closed or broken stderr: nothing to tell
                    pass


def configure(level: str, fmt: str) -> Callable[[], None]:
    """Send the process's logs to stderr through a writer thread; returns the stop function."""
    # Nothing here prints a record's source line, thread or process: don't look them up.
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    q: queue.Queue[Any] = queue.Queue(QUEUE_SIZE)
    root = logging.getLogger()
    root.handlers[:] = [DroppingQueueHandler(q)]
    root.setLevel(level.upper())
    writer = BatchWriter(q, JsonFormatter() if fmt == "json" else TextFormatter(), sys.stderr)
    writer.start()
    return writer.stop
