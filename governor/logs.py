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
"""

from __future__ import annotations

import copy
import datetime
import logging
import logging.handlers
import queue
import sys
from collections.abc import Callable
from typing import Any

import orjson

QUEUE_SIZE = 10_000
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


def configure(level: str, fmt: str) -> Callable[[], None]:
    """Send the process's logs to stderr through a writer thread; returns the stop function."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    q: queue.Queue[Any] = queue.Queue(QUEUE_SIZE)
    root = logging.getLogger()
    root.handlers[:] = [DroppingQueueHandler(q)]
    root.setLevel(level.upper())
    listener = logging.handlers.QueueListener(q, handler, respect_handler_level=False)
    listener.start()
    return listener.stop
