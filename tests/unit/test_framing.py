"""The sidecar's decoders of an upstream's stream: its chunked body, then its events, whatever
the reads."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.runners.sidecar.framing import MAX_LINE, Chunks, SseEvents, UpstreamError


def encode(pieces: list[bytes], *, extension: bool, trailers: list[bytes], upper: bool) -> bytes:
    out = b""
    for piece in pieces:
        size = b"%X" % len(piece) if upper else b"%x" % len(piece)
        out += size + (b";name=value" if extension else b"") + b"\r\n" + piece + b"\r\n"
    return out + b"0\r\n" + b"".join(t + b"\r\n" for t in trailers) + b"\r\n"


def splits(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@given(
    pieces=st.lists(st.binary(min_size=1, max_size=300), max_size=12),
    cuts=st.lists(st.integers(0, 5000), max_size=30),
    extension=st.booleans(),
    trailers=st.lists(st.sampled_from([b"x-a: 1", b"x-checksum: abc"]), max_size=2),
    upper=st.booleans(),
    after=st.sampled_from([b"", b"HTTP/1.1 200 OK\r\n"]),
)
def test_any_body_in_any_reads_decodes_to_itself(
    pieces: list[bytes],
    cuts: list[int],
    extension: bool,
    trailers: list[bytes],
    upper: bool,
    after: bytes,
) -> None:
    wire = encode(pieces, extension=extension, trailers=trailers, upper=upper) + after
    chunks = Chunks()
    got = b""
    reads = splits(wire, cuts)
    while not chunks.done:
        got += b"".join(chunks.feed(reads.pop(0)))
    assert got == b"".join(pieces)
    # What came after the body is left (and keeps the connection from being reused).
    assert chunks.rest + b"".join(reads) == after


@given(cuts=st.lists(st.integers(0, 40), max_size=8))
def test_a_body_not_yet_ended_is_not_done(cuts: list[int]) -> None:
    wire = b"5\r\nhello\r\n3\r\nabc\r\n0\r\n"  # (its last blank line not yet come)
    chunks = Chunks()
    got = b"".join(b"".join(chunks.feed(read)) for read in splits(wire, cuts))
    assert got == b"helloabc"
    assert not chunks.done
    assert chunks.feed(b"\r\n") == []
    assert chunks.done


@pytest.mark.parametrize(
    "wire",
    [
        b"zz\r\nhello\r\n0\r\n\r\n",  # not hexadecimal
        b"0x5\r\nhello\r\n0\r\n\r\n",  # what int(..., 16) would take, HTTP does not
        b"+5\r\nhello\r\n0\r\n\r\n",
        b"\r\nhello\r\n0\r\n\r\n",  # no size
        b"5\r\nhelloX\r\n0\r\n\r\n",  # more data than the size
        b"11111111111111111\r\n",  # a size of 17 digits
    ],
)
def test_bad_framing_is_an_upstream_error(wire: bytes) -> None:
    with pytest.raises(UpstreamError):
        Chunks().feed(wire)


def test_a_framing_line_has_a_bound() -> None:
    chunks = Chunks()
    assert chunks.feed(b"5" * MAX_LINE) == []  # (a line still within it waits for its end)
    with pytest.raises(UpstreamError, match="too long"):
        chunks.feed(b"5")


EVENT = st.builds(
    lambda payload, comment, crlf: (
        (b": keep-alive" if comment else b"data: " + orjson.dumps(payload))
        + (b"\r\n\r\n" if crlf else b"\n\n"),
        None if comment else payload,
    ),
    st.dictionaries(
        st.sampled_from(["id", "choices", "usage"]), st.integers(-(2**53), 2**53) | st.text()
    ),
    st.booleans(),
    st.booleans(),
)


@given(
    events=st.lists(EVENT, max_size=10),
    cuts=st.lists(st.integers(0, 3000), max_size=20),
    after=st.sampled_from([b"", b"data: {}\n\n"]),
)
def test_a_streams_events_in_any_reads_come_out_whole_and_stop_at_done(
    events: list[tuple[bytes, object]], cuts: list[int], after: bytes
) -> None:
    """The relay's splitter (:class:`SseEvents`): each event's bytes as they came and its data
    decoded, whatever the reads; nothing after ``data: [DONE]``."""
    wire = b"".join(raw for raw, _ in events) + b"data: [DONE]\n\n" + after
    splitter = SseEvents(1 << 20)
    got = [event for read in splits(wire, cuts) for event in splitter.feed(read)]
    assert got == events
    assert splitter.done


def test_an_event_that_never_ends_has_a_bound() -> None:
    splitter = SseEvents(64)
    assert splitter.feed(b"data: " + b"x" * 58) == []  # (64 bytes held: within it)
    with pytest.raises(UpstreamError, match="over 64 bytes"):
        splitter.feed(b"x")
