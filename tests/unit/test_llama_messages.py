"""The daemon-worker messages: every request and event comes back from its line as it went, and
a line that is no message is refused by name, never taken for one."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.runners.llama import messages as msg

ids = st.text(min_size=1, max_size=12)
tokens = st.lists(st.integers(0, 50_000), max_size=8)
finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
rates = st.tuples(finite, finite, finite)

runs = st.builds(
    msg.Run,
    id=ids,
    tokens=tokens,
    max_new_tokens=st.integers(1, 4096),
    priority=st.integers(0, 9),
    alone=st.booleans(),
    ttft_ms=finite,
    seed=st.none() | st.integers(0, 2**31),
    stop=st.lists(st.text(max_size=4), max_size=3),
    n=st.integers(1, 4),
    logprobs=st.none() | st.integers(0, 5),
    logit_bias=st.lists(st.tuples(st.integers(0, 100), finite), max_size=3),
    grammar=st.none() | st.text(max_size=20),
)
requests = st.one_of(
    runs,
    st.builds(msg.Cancel, ids),
    st.builds(msg.Suspend, ids),
    st.builds(msg.Resume, ids),
    st.builds(msg.Embed, ids, st.lists(tokens, max_size=3)),
    st.builds(msg.Waiting, st.booleans()),
    st.builds(msg.Offered, ids),
)
outs = st.builds(
    msg.Out,
    ids,
    st.integers(0, 3),
    st.text(max_size=8),
    st.integers(0, 100),
    st.none() | st.lists(st.fixed_dictionaries({"token": st.text(max_size=3)}), max_size=2),
)
dones = st.builds(
    msg.Done,
    ids,
    st.lists(st.builds(msg.Ended, st.text(max_size=8), st.sampled_from(["stop", "length"]))),
    st.integers(0, 100),
    st.integers(0, 100),
    st.none() | st.text(max_size=10),
)
events = st.one_of(
    st.builds(msg.Ready, st.integers(1, 10**6), st.integers(1, 64), st.integers(1, 10**5), rates),
    st.builds(msg.Refused, st.text(max_size=20)),
    st.builds(
        msg.Step,
        st.integers(0, 10**6),
        st.integers(0, 9),
        st.dictionaries(ids, st.integers(0, 4096), max_size=3),
        st.lists(outs, max_size=3),
        st.lists(dones, max_size=2),
        st.none() | rates,
    ),
    st.builds(
        msg.Embedded,
        ids,
        st.none() | st.lists(st.lists(finite, max_size=3), max_size=2),
        st.none() | st.text(max_size=10),
    ),
)


def _close(value: object) -> object:
    """A message's fields as JSON carries them (tuples as lists, floats as orjson writes them)."""
    return orjson.loads(orjson.dumps(value))


@given(requests)
def test_every_request_comes_back_from_its_line(request: msg.Request) -> None:
    line = msg.encode(request)
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1  # (one line: a text field's newline is escaped)
    back = msg.decode_request(line)
    assert type(back) is type(request)
    assert _close(back) == _close(request)


@given(events)
def test_every_event_comes_back_from_its_line(event: msg.Event) -> None:
    back = msg.decode_event(msg.encode(event))
    assert type(back) is type(event)
    assert _close(back) == _close(event)


def test_the_lines_are_the_shapes_the_worker_documents() -> None:
    assert orjson.loads(msg.encode(msg.Suspend("heavy"))) == {"op": "suspend", "id": "heavy"}
    run = orjson.loads(msg.encode(msg.Run(id="j", tokens=[1, 2], max_new_tokens=4)))
    assert (run["op"], run["tokens"], run["n"], run["alone"]) == ("run", [1, 2], 1, False)
    step = orjson.loads(msg.encode(msg.Step(5, 0, {"j": 2}, [msg.Out("j", 0, "a", 1)], [])))
    assert step["ev"] == "step"
    assert step["out"] == [{"id": "j", "i": 0, "text": "a", "n": 1, "lp": None}]
    # A raw line, as a test's pipe writes it, is read as the same request.
    raw = b'{"op":"run","id":"p","tokens":[3],"max_new_tokens":1,"priority":9,"alone":true}\n'
    probe = msg.decode_request(raw)
    assert isinstance(probe, msg.Run)
    assert (probe.priority, probe.alone, probe.temperature) == (9, True, 0.0)


@pytest.mark.parametrize(
    ("line", "reader", "message"),
    [
        (b"not json\n", msg.decode_request, "not JSON"),
        (b"[1, 2]\n", msg.decode_request, "not an object"),
        (b'{"op": "explode", "id": "x"}\n', msg.decode_request, "no request"),
        (b'{"id": "x"}\n', msg.decode_request, "no request"),
        (b'{"op": "cancel"}\n', msg.decode_request, "Cancel"),  # (its id missing)
        (b'{"op": "cancel", "id": "x", "why": 1}\n', msg.decode_request, "Cancel"),
        (b'{"op": "run", "id": "x"}\n', msg.decode_request, "Run"),
        (b'{"ev": "done"}\n', msg.decode_event, "no event"),
        (
            b'{"ev": "step", "kv": 0, "acks": 0, "f": {}, "out": [{}], "done": []}\n',
            msg.decode_event,
            "a step event that is not one",
        ),
        (b'{"ev": "ready", "cells": 1}\n', msg.decode_event, "Ready"),
    ],
)
def test_a_line_that_is_no_message_is_refused_by_name(
    line: bytes, reader: object, message: str
) -> None:
    with pytest.raises(msg.MessageInvalid, match=message):
        reader(line)  # type: ignore[operator]
