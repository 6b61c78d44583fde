"""The log writer: lines built by the caller, written by a thread, bounded, never blocking."""

from __future__ import annotations

import io
import logging
import re
import threading
import time

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.telemetry import logs


class Recording(io.StringIO):
    """A stream that counts its writes, and can be made to hang like a full pipe."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0
        self.unblocked = threading.Event()
        self.unblocked.set()

    def write(self, s: str) -> int:
        self.unblocked.wait(30)
        self.writes += 1
        return super().write(s)


@pytest.fixture
def jobs_logger() -> logging.Logger:
    return logging.getLogger("governor.test_logs")


def test_json_lines_from_events_and_records_in_order_and_flushed_on_stop(
    jobs_logger: logging.Logger,
) -> None:
    stream = Recording()
    stop = logs.configure("info", "json", stream)
    try:
        for n in range(500):
            logs.event(jobs_logger, logging.INFO, f"job {n}", event="job", n=n, lane=None)
        logs.event(jobs_logger, logging.DEBUG, "below the level")  # not written
        try:
            raise ValueError("boom")
        except ValueError:
            jobs_logger.exception("a record the ordinary way")
    finally:
        stop()
    lines = [orjson.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["n"] for line in lines[:-1]] == list(range(500))
    first = {k: lines[0][k] for k in ("msg", "level", "logger", "lane")}
    assert first == {"msg": "job 0", "level": "info", "logger": "governor.test_logs", "lane": None}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", lines[0]["ts"])
    last = lines[-1]
    assert (last["level"], last["msg"]) == ("error", "a record the ordinary way")
    assert "ValueError: boom" in last["exc"]
    # 501 lines, written in batches: far fewer writes than lines.
    assert stream.writes < 100


def test_text_lines_carry_the_fields(jobs_logger: logging.Logger) -> None:
    stream = Recording()
    stop = logs.configure("info", "text", stream)
    try:
        logs.event(jobs_logger, logging.WARNING, "job done", job="J_1", detail="two words")
    finally:
        stop()
    (line,) = stream.getvalue().splitlines()
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING governor.test_logs: job done "
        r'job=J_1 detail="two words"',
        line,
    ), line


def test_configure_then_stop_gives_the_root_logger_back() -> None:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    stop = logs.configure("warning", "json", io.StringIO())
    assert (root.level, root.handlers == handlers) == (logging.WARNING, False)
    stop()
    assert (root.level, root.handlers) == (level, handlers)
    assert logs.dropped_records() == 0


def test_a_stuck_stream_drops_lines_past_the_bound_and_never_blocks_the_caller(
    jobs_logger: logging.Logger,
) -> None:
    stream = Recording()
    stream.unblocked.clear()  # a log collector that stopped reading
    writer = logs.LineWriter(stream, max_pending=100)
    writer.start()
    try:
        writer.put("first")  # taken by the thread, which then hangs in write()
        deadline = time.monotonic() + 10
        while writer._pending and time.monotonic() < deadline:
            time.sleep(0.005)
        started = time.monotonic()
        for n in range(1000):
            writer.put(f"line {n}")
        assert time.monotonic() - started < 5  # (a blocked caller would hang here for 30 s)
        assert writer.dropped == 900
    finally:
        stream.unblocked.set()
        writer.stop()
    assert stream.getvalue().splitlines() == ["first"] + [f"line {n}" for n in range(100)]


@given(st.text(), st.text())
def test_a_text_line_is_one_line_of_printable_characters_whatever_the_values(
    job: str, msg: str
) -> None:
    line = logs.text_line(0.0, logging.INFO, "governor.jobs", msg, {"job": job})
    assert "\n" not in line
    assert all(c.isprintable() or c == " " for c in line), repr(line)


def test_a_job_id_cannot_forge_a_line_or_reach_the_terminal() -> None:
    forged = "J_1\n2026-11-22 12:00:00,000 INFO governor.jobs: job done job=J_2\x1b[2J\r"
    line = logs.text_line(0.0, logging.INFO, "governor.jobs", f"job {forged}", {"job": forged})
    assert line.count("\n") == 0
    assert "\x1b" not in line
    assert "\\x0a2026" in line  # in the message, escaped
    assert 'job="J_1\\n2026' in line  # in a field, as JSON


def test_a_traceback_keeps_its_lines_but_not_their_control_characters() -> None:
    line = logs.text_line(0.0, logging.ERROR, "governor", "boom", {}, exc="Traceback\n  x\x1b[2J")
    assert line.splitlines()[1:] == ["Traceback", "  x\\x1b[2J"]
