"""Unit tests of the sans-IO wire codec (``protocol/``): no sockets, no event loop.

Covers the bounded line reader, request decoding with every envelope rule, the bad-line
classifier, reply encoding and decoding, the error-to-reply table, upload assembly with
each need code in the order the assembler checks them, and which content types are job specs.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import orjson
import pytest

from protocol.codes import (
    SERVER_ONLY_FIELDS,
    ErrorCode,
    NeedCode,
    Receipt,
    Status,
    Verb,
)
from protocol.errors import (
    BadLine,
    EnvelopeInvalid,
    LineTooLong,
    ManifestInvalid,
    RemoteProtocolError,
    ReplyInvalid,
    UploadNeed,
)
from protocol.frames import (
    MAX_ID_CHARS,
    U64_MAX,
    Reply,
    Request,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    error_reply,
)
from protocol.lines import LineReader
from protocol.spec import SPEC_CONTENT_TYPE, SpecInvalid, is_json_content_type, parse_spec
from protocol.upload import PreparedUpload, Upload, split_payload

_DROP = object()  # a field value meaning "leave this field out"


def with_fields(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A copy of ``base`` with ``changes`` applied; a value of ``_DROP`` removes the field."""
    out = dict(base)
    for key, value in changes.items():
        if value is _DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def drain(reader: LineReader) -> list[bytes]:
    lines = []
    while (line := reader.next_line()) is not None:
        lines.append(line)
    return lines


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# --------------------------------------------------------------------------------------------
# LineReader
# --------------------------------------------------------------------------------------------

MAX = 8


def test_line_reader_rejects_a_zero_limit() -> None:
    with pytest.raises(ValueError, match="max_line_bytes"):
        LineReader(0)


def test_lines_split_on_newline_and_strip_one_carriage_return() -> None:
    reader = LineReader(64)
    reader.feed(b"one\ntwo\r\n\nfour\r\r\nfi\rve\nsix")
    assert drain(reader) == [b"one", b"two", b"", b"four\r", b"fi\rve"]
    assert reader.next_line() is None
    assert reader.buffered == len(b"six")
    reader.feed(b"\r\n")
    assert reader.next_line() == b"six"
    assert reader.next_line() is None
    assert reader.buffered == 0


def test_bare_carriage_return_line() -> None:
    reader = LineReader(4)
    reader.feed(b"\r\n\r\r\n")
    assert drain(reader) == [b"", b"\r"]


def test_one_byte_at_a_time_gives_the_same_lines() -> None:
    data = b'{"v":0}\r\nsecond line\n\n\r\nlast\r\n'
    whole = LineReader(64)
    whole.feed(data)
    expected = drain(whole)
    assert expected == [b'{"v":0}', b"second line", b"", b"", b"last"]

    reader = LineReader(64)
    got: list[bytes] = []
    for i in range(len(data)):
        reader.feed(data[i : i + 1])
        got.extend(drain(reader))
    assert got == expected
    assert reader.buffered == 0


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"])
def test_a_line_of_exactly_max_line_bytes_passes(ending: bytes) -> None:
    reader = LineReader(MAX)
    reader.feed(b"a" * MAX + ending + b"next\n")
    assert drain(reader) == [b"a" * MAX, b"next"]


def test_a_full_length_line_whose_cr_and_lf_arrive_in_separate_feeds_passes() -> None:
    reader = LineReader(MAX)
    reader.feed(b"a" * MAX)
    assert reader.next_line() is None
    reader.feed(b"\r")
    assert reader.next_line() is None  # the "\n" may still follow
    assert reader.buffered == MAX + 1
    reader.feed(b"\n")
    assert reader.next_line() == b"a" * MAX
    assert reader.buffered == 0


def test_a_full_length_crlf_line_fed_one_byte_at_a_time_passes() -> None:
    reader = LineReader(MAX)
    got: list[bytes] = []
    for byte in b"b" * MAX + b"\r\n":
        reader.feed(bytes([byte]))
        got.extend(drain(reader))
    assert got == [b"b" * MAX]


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"])
def test_a_line_one_byte_too_long_raises_once_its_newline_arrived(ending: bytes) -> None:
    reader = LineReader(MAX)
    reader.feed(b"a" * (MAX + 1) + ending)
    with pytest.raises(LineTooLong) as info:
        reader.next_line()
    assert info.value.limit == MAX
    assert info.value.need_code is NeedCode.LINE_TOO_LARGE
    assert info.value.fatal


def test_a_line_one_byte_too_long_raises_when_its_newline_arrives_later() -> None:
    reader = LineReader(MAX)
    reader.feed(b"a" * MAX)
    assert reader.next_line() is None
    reader.feed(b"a")
    try:
        pending = reader.next_line()
    except LineTooLong:
        return  # refused before the newline: also fine
    assert pending is None
    reader.feed(b"\n")
    with pytest.raises(LineTooLong):
        reader.next_line()


def test_a_line_one_byte_too_long_raises_before_its_newline_arrives() -> None:
    reader = LineReader(MAX)
    reader.feed(b"a" * (MAX + 1))
    with pytest.raises(LineTooLong):
        reader.next_line()


def test_an_unterminated_line_two_bytes_too_long_raises() -> None:
    reader = LineReader(MAX)
    reader.feed(b"a" * (MAX + 2))
    with pytest.raises(LineTooLong):
        reader.next_line()


def test_a_full_length_line_and_cr_then_a_non_newline_raises() -> None:
    reader = LineReader(MAX)
    reader.feed(b"a" * MAX + b"\r")
    assert reader.next_line() is None
    reader.feed(b"x")
    with pytest.raises(LineTooLong):
        reader.next_line()


def test_a_long_line_after_good_lines_raises_only_when_reached() -> None:
    reader = LineReader(MAX)
    reader.feed(b"ok\nfine\n" + b"z" * (MAX + 5) + b"\n")
    assert reader.next_line() == b"ok"
    assert reader.next_line() == b"fine"
    with pytest.raises(LineTooLong):
        reader.next_line()


def test_after_line_too_long_every_call_raises() -> None:
    reader = LineReader(MAX)
    reader.feed(b"x" * (MAX + 1) + b"\n")
    for _ in range(3):
        with pytest.raises(LineTooLong):
            reader.next_line()
    reader.feed(b"ok\n")
    with pytest.raises(LineTooLong):
        reader.next_line()


def test_after_an_unterminated_line_too_long_every_call_raises() -> None:
    reader = LineReader(MAX)
    reader.feed(b"x" * (MAX * 3))
    with pytest.raises(LineTooLong):
        reader.next_line()
    reader.feed(b"\nok\n")
    for _ in range(2):
        with pytest.raises(LineTooLong):
            reader.next_line()


def test_many_lines_in_one_feed() -> None:
    lines = [f"line-{i}".encode() for i in range(5000)]
    reader = LineReader(16)
    reader.feed(b"\n".join(lines) + b"\n")
    assert drain(reader) == lines
    assert reader.buffered == 0


def test_many_short_lines_add_up_past_the_limit_without_raising() -> None:
    reader = LineReader(4)
    reader.feed(b"abcd\n" * 100)
    assert drain(reader) == [b"abcd"] * 100


def test_a_long_stream_in_small_pieces_keeps_the_buffer_bounded() -> None:
    # More than the compaction threshold (64 KiB) flows through in odd-sized pieces.
    lines = [(b"%05d" % i) * 10 for i in range(4000)]
    data = b"\r\n".join(lines) + b"\r\n"
    reader = LineReader(64)
    got: list[bytes] = []
    for i in range(0, len(data), 7):
        reader.feed(data[i : i + 7])
        got.extend(drain(reader))
        assert reader.buffered <= 64 + 2
    assert got == lines
    assert reader.buffered == 0


def test_buffered_counts_bytes_not_yet_returned() -> None:
    reader = LineReader(64)
    assert reader.buffered == 0
    reader.feed(b"ab\ncd")
    assert reader.buffered == 5
    assert reader.next_line() == b"ab"
    assert reader.buffered == 2
    assert reader.next_line() is None
    assert reader.buffered == 2
    reader.feed(b"e\r")
    assert reader.buffered == 4
    assert reader.next_line() is None
    reader.feed(b"\nf")
    assert reader.buffered == 6
    assert reader.next_line() == b"cde"
    assert reader.buffered == 1
    assert reader.next_line() is None
    assert reader.buffered == 1


# --------------------------------------------------------------------------------------------
# decode_request: valid frames
# --------------------------------------------------------------------------------------------

PING: dict[str, Any] = {"v": 0, "verb": "ping", "job": "J_1", "seq": 1}
MANIFEST = split_payload(b"hello world", chunk_bytes=4).manifest
CHUNK = split_payload(b"hello world", chunk_bytes=4).chunks[0]
SHARE_MANIFEST: dict[str, Any] = {
    "v": 0,
    "verb": "share",
    "job": "J_2",
    "seq": 7,
    "ttl_ms": 30000,
    "payload_manifest": MANIFEST,
}
SHARE_CHUNK: dict[str, Any] = {
    "v": 0,
    "verb": "share",
    "job": "J_2",
    "seq": 8,
    "payload_chunk": CHUNK,
}


def dumps(obj: Any) -> bytes:
    """JSON for a test frame; the stdlib encoder also writes integers past 64 bits."""
    return json.dumps(obj).encode()


def decode(obj: Any) -> Request:
    return decode_request(dumps(obj))


def test_a_valid_ping() -> None:
    req = decode(PING)
    assert req == Request(Verb.PING, "J_1", 1, 0, None, None)
    assert req.verb is Verb.PING


def test_a_ping_echoes_its_ttl() -> None:
    assert decode(with_fields(PING, ttl_ms=2500)).ttl_ms == 2500


def test_a_valid_share_manifest() -> None:
    req = decode(SHARE_MANIFEST)
    assert req.verb is Verb.SHARE
    assert (req.job, req.seq, req.ttl_ms) == ("J_2", 7, 30000)
    assert req.manifest == MANIFEST
    assert req.chunk is None


def test_a_valid_share_chunk() -> None:
    req = decode(SHARE_CHUNK)
    assert req.verb is Verb.SHARE
    assert (req.job, req.seq, req.ttl_ms) == ("J_2", 8, 0)
    assert req.chunk == CHUNK
    assert req.manifest is None


def test_envelope_limits_are_inclusive() -> None:
    req = decode(with_fields(PING, job="j" * MAX_ID_CHARS, seq=U64_MAX, ttl_ms=U64_MAX))
    assert (req.job, req.seq, req.ttl_ms) == ("j" * MAX_ID_CHARS, U64_MAX, U64_MAX)


def test_encode_request_decodes_back() -> None:
    line = encode_request(Verb.SHARE, "J_9", 3, ttl_ms=5, chunk=CHUNK)
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    assert decode_request(line[:-1]) == Request(Verb.SHARE, "J_9", 3, 5, None, CHUNK)
    # The governor's own asks of a share: its key, a wait for its turn, a place on any replica.
    line = encode_request(
        Verb.SHARE, "J_9", 4, chunk=CHUNK, api_key="k", max_wait_ms=300, fleet_wide=True
    )
    decoded = decode_request(line[:-1])
    assert (decoded.api_key, decoded.max_wait_ms, decoded.fleet_wide) == ("k", 300, True)
    assert decode_request(encode_request(Verb.PING, "J_9", 1)[:-1]).fleet_wide is None


# --------------------------------------------------------------------------------------------
# decode_request: envelope rules
# --------------------------------------------------------------------------------------------

ENVELOPE_CASES: list[tuple[str, dict[str, Any]]] = [
    ("v missing", with_fields(PING, v=_DROP)),
    ("v 1", with_fields(PING, v=1)),
    ("v true", with_fields(PING, v=True)),
    ("v false", with_fields(PING, v=False)),
    ("v '0'", with_fields(PING, v="0")),
    ("v 0.0", with_fields(PING, v=0.0)),
    ("v null", with_fields(PING, v=None)),
    ("verb missing", with_fields(PING, verb=_DROP)),
    ("verb unknown", with_fields(PING, verb="fetch")),
    ("verb clarify", with_fields(PING, verb="clarify")),
    ("verb confirm", with_fields(PING, verb="confirm")),
    ("verb upper case", with_fields(PING, verb="PING")),
    ("verb not a string", with_fields(PING, verb=["ping"])),
    ("job missing", with_fields(PING, job=_DROP)),
    ("job empty", with_fields(PING, job="")),
    ("job a number", with_fields(PING, job=5)),
    ("job a list", with_fields(PING, job=["J_1"])),
    ("job too long", with_fields(PING, job="j" * (MAX_ID_CHARS + 1))),
    ("seq missing", with_fields(PING, seq=_DROP)),
    ("seq 0", with_fields(PING, seq=0)),
    ("seq -1", with_fields(PING, seq=-1)),
    ("seq 1.5", with_fields(PING, seq=1.5)),
    ("seq 1.0", with_fields(PING, seq=1.0)),
    ("seq true", with_fields(PING, seq=True)),
    ("seq '1'", with_fields(PING, seq="1")),
    ("seq 2**64", with_fields(PING, seq=2**64)),
    ("ttl_ms negative", with_fields(PING, ttl_ms=-1)),
    ("ttl_ms a string", with_fields(PING, ttl_ms="100")),
    ("ttl_ms true", with_fields(PING, ttl_ms=True)),
    ("ttl_ms 2**64", with_fields(PING, ttl_ms=2**64)),
    ("manifest and chunk", with_fields(SHARE_MANIFEST, payload_chunk=CHUNK)),
    ("ping with manifest", with_fields(PING, payload_manifest=MANIFEST)),
    ("ping with chunk", with_fields(PING, payload_chunk=CHUNK)),
    ("ping with empty manifest", with_fields(PING, payload_manifest={})),
    ("share with neither", with_fields(SHARE_MANIFEST, payload_manifest=_DROP)),
    ("manifest a list", with_fields(SHARE_MANIFEST, payload_manifest=[MANIFEST])),
    ("manifest a string", with_fields(SHARE_MANIFEST, payload_manifest="{}")),
    ("manifest false", with_fields(SHARE_MANIFEST, payload_manifest=False)),
    ("chunk a number", with_fields(SHARE_CHUNK, payload_chunk=0)),
    ("unknown field", with_fields(PING, hello="world")),
    ("unknown field on a share", with_fields(SHARE_CHUNK, payload="x")),
    *(
        (f"server field {name}", with_fields(PING, **{name: "x"}))
        for name in sorted(SERVER_ONLY_FIELDS)
    ),
]


@pytest.mark.parametrize("obj", [c[1] for c in ENVELOPE_CASES], ids=[c[0] for c in ENVELOPE_CASES])
def test_envelope_rule_raises_envelope_invalid(obj: dict[str, Any]) -> None:
    with pytest.raises(EnvelopeInvalid) as info:
        decode(obj)
    exc = info.value
    assert exc.need_code is NeedCode.ENVELOPE_INVALID
    assert exc.error_code is ErrorCode.BAD_ENVELOPE
    assert exc.verb is Verb.CLARIFY
    assert exc.status is Status.NEED
    assert not exc.fatal
    assert exc.detail


def test_every_server_only_field_is_covered() -> None:
    assert {"status", "need_code", "error_code", "retry_hint_ms", "receipts"} <= SERVER_ONLY_FIELDS
    for name in SERVER_ONLY_FIELDS:
        with pytest.raises(EnvelopeInvalid, match=name):
            decode(with_fields(SHARE_CHUNK, **{name: None}))


@pytest.mark.parametrize(
    ("obj", "job", "seq"),
    [
        (with_fields(PING, job="J_7", seq=9, v=1), "J_7", 9),
        (with_fields(PING, job="J_7", seq=9, status="ok"), "J_7", 9),
        (with_fields(PING, job="J_7", seq=9, payload_chunk=CHUNK), "J_7", 9),
        (with_fields(PING, job="J_7", seq=9, ttl_ms=-5), "J_7", 9),
        (with_fields(PING, job="", seq=9), None, 9),
        (with_fields(PING, job=_DROP, seq=9), None, 9),
        (with_fields(PING, job=12, seq=9), None, 9),
        (with_fields(PING, job="j" * (MAX_ID_CHARS + 1), seq=9), None, 9),
        (with_fields(PING, job="J_7", seq=0), "J_7", None),
        (with_fields(PING, job="J_7", seq=True), "J_7", None),
        (with_fields(PING, job="J_7", seq=1.5), "J_7", None),
        (with_fields(PING, job="J_7", seq=2**64), "J_7", None),
        (with_fields(PING, job="J_7", seq=_DROP), "J_7", None),
        (with_fields(PING, job=None, seq=-3, v=2), None, None),
        (with_fields(PING, job="J_7", seq=U64_MAX, verb="clarify"), "J_7", U64_MAX),
    ],
)
def test_envelope_invalid_carries_the_frames_valid_job_and_seq(
    obj: dict[str, Any], job: str | None, seq: int | None
) -> None:
    with pytest.raises(EnvelopeInvalid) as info:
        decode(obj)
    assert info.value.job == job
    assert info.value.seq == seq


# --------------------------------------------------------------------------------------------
# decode_request: lines that are not a JSON object
# --------------------------------------------------------------------------------------------

BAD_LINES: list[tuple[bytes, NeedCode]] = [
    (b"GET / HTTP/1.1", NeedCode.HTTP_REQUEST),
    (b"POST /x HTTP/1.1", NeedCode.HTTP_REQUEST),
    (b"  PUT /y HTTP/1.0", NeedCode.HTTP_REQUEST),
    (b"HTTP/1.1 200 OK", NeedCode.HTTP_REQUEST),
    (b"<!DOCTYPE html>", NeedCode.HTML_DOCUMENT),
    (b"<html>", NeedCode.HTML_DOCUMENT),
    (b"<HTML lang=en>", NeedCode.HTML_DOCUMENT),
    (b'<?xml version="1.0" encoding="UTF-8"?>', NeedCode.XML_DOCUMENT),
    (b"<rss>", NeedCode.XML_DOCUMENT),
    (b"<feed xmlns='http://www.w3.org/2005/Atom'>", NeedCode.XML_DOCUMENT),
    (b"GIF89a\x01\x00\x01\x00\x80\x00\x00", NeedCode.BINARY_GIF),
    (b"GIF87a", NeedCode.BINARY_GIF),
    (b"[1,2]", NeedCode.JSON_ARRAY),
    (b"[]", NeedCode.JSON_ARRAY),
    (b"[", NeedCode.JSON_ARRAY),
    (b"{bad", NeedCode.JSON_MALFORMED),
    (b'{"v":0,', NeedCode.JSON_MALFORMED),
    (b"{}}", NeedCode.JSON_MALFORMED),
    (b"hello", NeedCode.NOT_JSON),
    (b"\xff\xfe", NeedCode.NOT_JSON),
    (b"42", NeedCode.NOT_JSON),
    (b"null", NeedCode.NOT_JSON),
    (b'"str"', NeedCode.NOT_JSON),
    (b"true", NeedCode.NOT_JSON),
    (b"", NeedCode.NOT_JSON),
]


@pytest.mark.parametrize(("line", "need"), BAD_LINES, ids=[repr(b[0][:20]) for b in BAD_LINES])
def test_a_line_that_is_not_a_json_object_raises_bad_line(line: bytes, need: NeedCode) -> None:
    with pytest.raises(BadLine) as info:
        decode_request(line)
    exc = info.value
    assert type(exc) is BadLine
    assert exc.need_code is need
    assert exc.error_code is ErrorCode.BAD_FRAME
    assert (exc.verb, exc.status, exc.fatal) == (Verb.CLARIFY, Status.NEED, False)


def test_an_object_with_invalid_utf8_is_malformed_json() -> None:
    with pytest.raises(BadLine) as info:
        decode_request(b'{"v":0,"verb":"ping","job":"\xff","seq":1}')
    assert info.value.need_code is NeedCode.JSON_MALFORMED


# --------------------------------------------------------------------------------------------
# Replies
# --------------------------------------------------------------------------------------------

FULL_REPLY = Reply(
    verb=Verb.CLARIFY,
    job="J_3",
    seq=5,
    status=Status.YIELD,
    ttl_ms=1200,
    need_code=NeedCode.SERVER_BUSY,
    error_code=ErrorCode.BUSY,
    retry_hint_ms=500,
    detail="every slot is taken\nretry later",
    receipts=((Receipt.HEALTH, 0), (Receipt.INFLIGHT, 4), (Receipt.CAP, 4), ("x.big", U64_MAX)),
    result={"text": "hi", "tokens": [1, 2, 3], "nested": {"ok": True, "none": None}},
    elsewhere="10.0.0.2:7700",
)
MIN_REPLY = Reply(verb=Verb.CONFIRM, job="J_4", seq=2, status=Status.OK)


def test_a_full_reply_round_trips() -> None:
    decoded = decode_reply(encode_reply(FULL_REPLY))
    assert decoded == FULL_REPLY
    assert decoded.receipt(Receipt.CAP) == 4
    assert decoded.receipt("x.big") == U64_MAX
    assert decoded.receipt("absent") is None
    assert decoded.retry_hint_ms == 500
    assert decoded.need_code == "server_busy"
    assert decoded.elsewhere == "10.0.0.2:7700"


def test_a_minimal_reply_round_trips() -> None:
    decoded = decode_reply(encode_reply(MIN_REPLY))
    assert decoded == MIN_REPLY
    assert decoded.receipts == ()
    assert decoded.result is None


@pytest.mark.parametrize("reply", [FULL_REPLY, MIN_REPLY], ids=["full", "minimal"])
def test_encode_reply_ends_with_exactly_one_newline(reply: Reply) -> None:
    data = encode_reply(reply)
    assert data.endswith(b"\n")
    assert data.count(b"\n") == 1
    assert not data.endswith(b"\r\n")


def test_optional_reply_fields_are_absent_when_none() -> None:
    obj = orjson.loads(encode_reply(MIN_REPLY))
    assert obj == {"v": 0, "verb": "confirm", "job": "J_4", "seq": 2, "ttl_ms": 0, "status": "ok"}


def test_reply_fields_are_written_with_their_wire_names() -> None:
    obj = orjson.loads(encode_reply(FULL_REPLY))
    assert obj["v"] == 0
    assert obj["verb"] == "clarify"
    assert obj["status"] == "yield"
    assert obj["need_code"] == "server_busy"
    assert obj["error_code"] == "busy"
    assert obj["retry_hint_ms"] == 500
    assert obj["receipts"][:3] == [
        {"kind": "server.health", "value_u64": 0},
        {"kind": "backend.inflight", "value_u64": 4},
        {"kind": "backend.cap", "value_u64": 4},
    ]
    assert obj["result"]["tokens"] == [1, 2, 3]


def test_zero_and_empty_optional_fields_are_still_written() -> None:
    reply = Reply(Verb.CLARIFY, "J", 1, Status.YIELD, retry_hint_ms=0, detail="", result={})
    obj = orjson.loads(encode_reply(reply))
    assert obj["retry_hint_ms"] == 0
    assert obj["detail"] == ""
    assert obj["result"] == {}
    assert decode_reply(encode_reply(reply)) == reply


def test_reply_terminal() -> None:
    assert Reply(Verb.CONFIRM, "J", 1, Status.DONE).terminal
    assert Reply(Verb.CONFIRM, "J", 1, Status.ABORT).terminal
    assert not Reply(Verb.CONFIRM, "J", 1, Status.OK).terminal
    assert not Reply(Verb.CLARIFY, "J", 1, Status.YIELD).terminal


def _reply_obj(**changes: Any) -> bytes:
    base = {"v": 0, "verb": "confirm", "job": "J_1", "seq": 2, "status": "ok"}
    return dumps(with_fields(base, **changes))


def test_the_reply_helper_builds_a_valid_reply() -> None:
    assert decode_reply(_reply_obj()) == Reply(Verb.CONFIRM, "J_1", 2, Status.OK)


@pytest.mark.parametrize(
    "line",
    [
        b"garbage",
        b"",
        b"{",
        b"\xff",
        b"[1, 2]",
        b"42",
        b"null",
        b'"reply"',
        _reply_obj(verb=_DROP),
        _reply_obj(status=_DROP),
        _reply_obj(job=_DROP),
        _reply_obj(seq=_DROP),
        _reply_obj(verb="shout"),
        _reply_obj(status="maybe"),
        _reply_obj(verb=None),
        _reply_obj(verb=["confirm"]),
        _reply_obj(status={"ok": 1}),
        _reply_obj(v=_DROP),
        _reply_obj(v=1),
        _reply_obj(v="0"),
        _reply_obj(v=None),
        _reply_obj(job=""),
        _reply_obj(job=7),
        _reply_obj(seq=-1),
        _reply_obj(seq="2"),
        _reply_obj(seq=1.5),
        _reply_obj(receipts="abc"),
        _reply_obj(receipts=5),
        _reply_obj(receipts=[1]),
        _reply_obj(receipts=[{"kind": "server.health"}]),
        _reply_obj(receipts=[{"value_u64": 1}]),
        _reply_obj(receipts={"kind": "x", "value_u64": 1}),
        _reply_obj(elsewhere=7700),
    ],
)
def test_decode_reply_raises_reply_invalid(line: bytes) -> None:
    with pytest.raises(ReplyInvalid):
        decode_reply(line)


@pytest.mark.parametrize("v", [False, 0.0], ids=["false", "0.0"])
def test_decode_reply_rejects_a_non_integer_v(v: Any) -> None:
    with pytest.raises(ReplyInvalid):
        decode_reply(_reply_obj(v=v))


@pytest.mark.parametrize(
    "changes",
    [
        {"ttl_ms": "x"},
        {"retry_hint_ms": "soon"},
        {"retry_hint_ms": -1},
        {"receipts": [{"kind": "server.health", "value_u64": -1}]},
        {"receipts": [{"kind": 1, "value_u64": 1}]},
    ],
    ids=["ttl_ms str", "retry_hint str", "retry_hint negative", "receipt negative", "kind int"],
)
def test_decode_reply_rejects_mistyped_optional_fields(changes: dict[str, Any]) -> None:
    with pytest.raises(ReplyInvalid):
        decode_reply(_reply_obj(**changes))


# --------------------------------------------------------------------------------------------
# error_reply: the table in errors.py
# --------------------------------------------------------------------------------------------

ERROR_TABLE: list[tuple[RemoteProtocolError, Verb, Status, ErrorCode, NeedCode, bool]] = [
    (
        BadLine(NeedCode.HTTP_REQUEST, "looks like HTTP"),
        Verb.CLARIFY,
        Status.NEED,
        ErrorCode.BAD_FRAME,
        NeedCode.HTTP_REQUEST,
        False,
    ),
    (
        EnvelopeInvalid("bad v", job="J", seq=3),
        Verb.CLARIFY,
        Status.NEED,
        ErrorCode.BAD_ENVELOPE,
        NeedCode.ENVELOPE_INVALID,
        False,
    ),
    (
        UploadNeed(NeedCode.CHUNK_HASH_MISMATCH, "chunk 1"),
        Verb.CLARIFY,
        Status.NEED,
        ErrorCode.NEED_MORE,
        NeedCode.CHUNK_HASH_MISMATCH,
        False,
    ),
    (
        ManifestInvalid("bad sha256"),
        Verb.CLARIFY,
        Status.NEED,
        ErrorCode.NEED_MANIFEST_FIX,
        NeedCode.MANIFEST_INVALID,
        False,
    ),
    (
        LineTooLong(262144),
        Verb.CONFIRM,
        Status.ABORT,
        ErrorCode.BAD_FRAME,
        NeedCode.LINE_TOO_LARGE,
        True,
    ),
]


@pytest.mark.parametrize(
    ("exc", "verb", "status", "error_code", "need_code", "fatal"),
    ERROR_TABLE,
    ids=[type(row[0]).__name__ for row in ERROR_TABLE],
)
def test_error_reply_follows_the_table(
    exc: RemoteProtocolError,
    verb: Verb,
    status: Status,
    error_code: ErrorCode,
    need_code: NeedCode,
    fatal: bool,
) -> None:
    receipts = [(Receipt.HEALTH, 1), (Receipt.BYTES_IN, 99)]
    reply = error_reply(exc, "J_5", 12, 700, receipts)
    assert reply.verb is verb
    assert reply.status is status
    assert reply.error_code == error_code
    assert reply.need_code == need_code
    assert exc.fatal is fatal
    assert reply.terminal is (status is Status.ABORT)
    assert (reply.job, reply.seq, reply.ttl_ms) == ("J_5", 12, 700)
    assert reply.detail == exc.detail
    assert reply.receipts == tuple(receipts)
    assert decode_reply(encode_reply(reply)) == reply


@pytest.mark.parametrize("seq", [U64_MAX + 1, U64_MAX + 2])
def test_encode_reply_caps_seq_at_u64_max(seq: int) -> None:
    """A reply counts on from its request's seq, which may be the largest there is."""
    reply = error_reply(EnvelopeInvalid("x"), "J", seq)
    assert decode_reply(encode_reply(reply)).seq == U64_MAX
    done = Reply(Verb.CONFIRM, "J", seq, Status.DONE)
    assert decode_reply(encode_reply(done)).seq == U64_MAX


def test_decode_errors_map_to_their_replies() -> None:
    with pytest.raises(RemoteProtocolError) as bad:
        decode_request(b"GET / HTTP/1.1")
    reply = error_reply(bad.value, "J_?", 1)
    assert (reply.verb, reply.status, reply.error_code, reply.need_code) == (
        Verb.CLARIFY,
        Status.NEED,
        "bad_frame",
        "http_request",
    )
    with pytest.raises(RemoteProtocolError) as env:
        decode(with_fields(PING, v=1))
    reply = error_reply(env.value, "J_1", 2)
    assert (reply.error_code, reply.need_code) == ("bad_envelope", "envelope_invalid")


# --------------------------------------------------------------------------------------------
# Upload
# --------------------------------------------------------------------------------------------

DATA = b"0123456789"  # chunk_bytes=4: chunks of 4, 4 and 2 bytes


def prepared(
    payload: bytes = DATA, chunk_bytes: int = 4, payload_id: str = "P_1"
) -> PreparedUpload:
    return split_payload(payload, chunk_bytes=chunk_bytes, payload_id=payload_id)


def started(prep: PreparedUpload | None = None, **kwargs: Any) -> Upload:
    upload = Upload(**kwargs)
    upload.apply_manifest((prep or prepared()).manifest)
    return upload


def need(upload: Upload, chunk: dict[str, Any]) -> NeedCode:
    with pytest.raises(UploadNeed) as info:
        upload.apply_chunk(chunk)
    exc = info.value
    assert (exc.verb, exc.status, exc.fatal) == (Verb.CLARIFY, Status.NEED, False)
    assert exc.error_code is ErrorCode.NEED_MORE
    assert exc.detail
    code = exc.need_code
    assert isinstance(code, NeedCode)
    return code


def make_chunk(data: bytes, index: int, offset: int, payload_id: str = "P_1") -> dict[str, Any]:
    return {
        "payload_id": payload_id,
        "index": index,
        "offset": offset,
        "sha256": sha(data),
        "bytes_b64": b64(data),
    }


def test_split_payload_shapes() -> None:
    prep = prepared()
    assert prep.manifest == {
        "payload_id": "P_1",
        "content_type": "application/octet-stream",
        "content_encoding": "identity",
        "cipher": "none",
        "total_bytes": 10,
        "chunk_bytes": 4,
        "chunks": 3,
        "sha256": sha(DATA),
    }
    assert [base64.b64decode(c["bytes_b64"]) for c in prep.chunks] == [b"0123", b"4567", b"89"]
    assert [c["offset"] for c in prep.chunks] == [0, 4, 8]
    assert [c["index"] for c in prep.chunks] == [0, 1, 2]
    with pytest.raises(ValueError, match="chunk_bytes"):
        split_payload(b"x", chunk_bytes=0)


def test_a_multi_chunk_payload_assembles_exactly() -> None:
    payload = bytes(range(256)) * 5 + b"tail"
    prep = prepared(payload, chunk_bytes=100)
    assert len(prep.chunks) == 13
    upload = Upload()
    manifest = upload.apply_manifest(prep.manifest)
    assert (manifest.total_bytes, manifest.chunk_bytes, manifest.chunks) == (1284, 100, 13)
    for chunk in prep.chunks[:-1]:
        assert upload.apply_chunk(chunk) is None
        assert not upload.complete
    assert upload.bytes_received == 1200
    assert upload.apply_chunk(prep.chunks[-1]) == payload
    assert upload.complete
    assert upload.payload == payload
    assert upload.bytes_received == len(payload)


def test_a_single_chunk_payload() -> None:
    prep = prepared(b"abc", chunk_bytes=3)
    upload = started(prep)
    assert upload.apply_chunk(prep.chunks[0]) == b"abc"


def test_an_empty_payload_is_one_empty_chunk() -> None:
    prep = prepared(b"")
    assert prep.manifest["total_bytes"] == 0
    assert prep.manifest["chunks"] == 1
    assert len(prep.chunks) == 1
    assert prep.chunks[0]["bytes_b64"] == ""
    upload = started(prep)
    assert not upload.complete
    result = upload.apply_chunk(prep.chunks[0])
    assert result is not None
    assert result == b""
    assert upload.complete
    assert upload.payload == b""


def test_chunk_before_manifest_is_manifest_missing() -> None:
    prep = prepared()
    assert need(Upload(), prep.chunks[0]) is NeedCode.MANIFEST_MISSING
    # Even a malformed chunk: the missing manifest is reported first.
    assert need(Upload(), {}) is NeedCode.MANIFEST_MISSING


def test_payload_id_mismatch() -> None:
    upload = started()
    other = prepared(payload_id="P_2")
    assert need(upload, other.chunks[0]) is NeedCode.PAYLOAD_ID_MISMATCH
    # Reported before the index check.
    assert need(upload, other.chunks[2]) is NeedCode.PAYLOAD_ID_MISMATCH


def test_chunk_expected_index_on_a_skip() -> None:
    prep = prepared()
    upload = started(prep)
    assert need(upload, prep.chunks[1]) is NeedCode.CHUNK_EXPECTED_INDEX
    assert upload.apply_chunk(prep.chunks[0]) is None
    assert need(upload, prep.chunks[2]) is NeedCode.CHUNK_EXPECTED_INDEX


def test_chunk_expected_index_on_a_repeat() -> None:
    prep = prepared()
    upload = started(prep)
    assert upload.apply_chunk(prep.chunks[0]) is None
    assert need(upload, prep.chunks[0]) is NeedCode.CHUNK_EXPECTED_INDEX
    assert upload.bytes_received == 4


def test_chunk_offset_mismatch() -> None:
    prep = prepared()
    upload = started(prep)
    upload.apply_chunk(prep.chunks[0])
    assert need(upload, with_fields(prep.chunks[1], offset=3)) is NeedCode.CHUNK_OFFSET_MISMATCH
    assert need(upload, with_fields(prep.chunks[1], offset=_DROP)) is NeedCode.CHUNK_OFFSET_MISMATCH


def test_offset_defaults_to_zero_for_the_first_chunk() -> None:
    prep = prepared()
    upload = started(prep)
    assert upload.apply_chunk(with_fields(prep.chunks[0], offset=_DROP)) is None
    assert upload.bytes_received == 4


@pytest.mark.parametrize(
    "bytes_b64",
    ["!!!!", "MDEyMw", "MD y", "MD\nE", "ÄÄÄÄ", "M===", "A", "=MDE"],
    ids=["punct", "no-padding", "space", "newline", "non-ascii", "over-padded", "one", "pad-first"],
)
def test_chunk_b64_invalid(bytes_b64: str) -> None:
    prep = prepared()
    upload = started(prep)
    assert (
        need(upload, with_fields(prep.chunks[0], bytes_b64=bytes_b64)) is NeedCode.CHUNK_B64_INVALID
    )
    assert upload.apply_chunk(prep.chunks[0]) is None


@pytest.mark.parametrize("value", [None, 5, ["MDEyMw=="], {"b": 1}, _DROP])
def test_bytes_b64_not_a_string_is_chunk_b64_invalid(value: Any) -> None:
    prep = prepared()
    upload = started(prep)
    assert need(upload, with_fields(prep.chunks[0], bytes_b64=value)) is NeedCode.CHUNK_B64_INVALID


def test_chunk_too_large_after_decoding() -> None:
    prep = prepared()
    upload = started(prep)
    data = b"01234"  # one byte over chunk_bytes; its base64 is not longer than 4 bytes' worth
    chunk = make_chunk(data, 0, 0)
    assert len(chunk["bytes_b64"]) == 8
    assert need(upload, chunk) is NeedCode.CHUNK_TOO_LARGE
    assert upload.bytes_received == 0


def test_an_overlong_string_that_is_not_base64_is_chunk_b64_invalid() -> None:
    """heptamini checks base64 before size: a string both too long for chunk_bytes and not
    base64 is chunk_b64_invalid, whatever its length."""
    prep = prepared()
    upload = started(prep)
    # 12 characters cannot decode to at most 4 bytes.
    assert need(upload, make_chunk(b"0123456", 0, 0)) is NeedCode.CHUNK_TOO_LARGE
    for bad in ("!" * 12, b64(b"0123456")[:-1], b64(b"0123456") + "!"):
        assert need(upload, with_fields(prep.chunks[0], bytes_b64=bad)) is (
            NeedCode.CHUNK_B64_INVALID
        ), bad
    assert upload.bytes_received == 0
    assert upload.apply_chunk(prep.chunks[0]) is None  # and the upload keeps its place


def test_payload_too_large() -> None:
    prep = prepared()
    upload = started(prep)
    upload.apply_chunk(prep.chunks[0])
    upload.apply_chunk(prep.chunks[1])
    # A full-size last chunk: 4 + 4 + 4 bytes against the declared 10.
    assert need(upload, make_chunk(b"89ab", 2, 8)) is NeedCode.PAYLOAD_TOO_LARGE
    assert upload.bytes_received == 8
    assert upload.apply_chunk(prep.chunks[2]) == DATA


def test_chunk_hash_mismatch() -> None:
    prep = prepared()
    upload = started(prep)
    bad = with_fields(prep.chunks[0], sha256=sha(b"0124"))
    assert need(upload, bad) is NeedCode.CHUNK_HASH_MISMATCH
    assert (
        need(upload, with_fields(prep.chunks[0], sha256="not hex")) is NeedCode.CHUNK_HASH_MISMATCH
    )
    assert upload.bytes_received == 0


def test_chunk_hash_is_compared_case_insensitively() -> None:
    prep = prepared()
    upload = started(prep)
    chunk = with_fields(prep.chunks[0], sha256=prep.chunks[0]["sha256"].upper())
    assert upload.apply_chunk(chunk) is None


def test_payload_size_mismatch_then_a_new_manifest_is_needed() -> None:
    prep = prepared()
    # 10 bytes arrive in 3 chunks, but the manifest declares 12 (which 3 chunks of 4 allow).
    manifest = with_fields(prep.manifest, total_bytes=12)
    upload = Upload()
    upload.apply_manifest(manifest)
    upload.apply_chunk(prep.chunks[0])
    upload.apply_chunk(prep.chunks[1])
    assert need(upload, prep.chunks[2]) is NeedCode.PAYLOAD_SIZE_MISMATCH
    assert upload.manifest is None
    assert upload.bytes_received == 0
    assert not upload.complete
    assert need(upload, prep.chunks[0]) is NeedCode.MANIFEST_MISSING
    assert need(upload, prep.chunks[2]) is NeedCode.MANIFEST_MISSING


def test_payload_hash_mismatch_then_a_new_manifest_is_needed() -> None:
    prep = prepared()
    upload = Upload()
    upload.apply_manifest(with_fields(prep.manifest, sha256=sha(b"something else")))
    upload.apply_chunk(prep.chunks[0])
    upload.apply_chunk(prep.chunks[1])
    assert need(upload, prep.chunks[2]) is NeedCode.PAYLOAD_HASH_MISMATCH
    assert upload.manifest is None
    assert not upload.complete
    assert need(upload, prep.chunks[0]) is NeedCode.MANIFEST_MISSING
    # Starting over with the right manifest works.
    upload.apply_manifest(prep.manifest)
    results = [upload.apply_chunk(c) for c in prep.chunks]
    assert results == [None, None, DATA]


def test_need_codes_in_the_order_the_assembler_checks_them() -> None:
    payload = b"abcdef"  # chunk_bytes=4: "abcd", "ef"
    prep = prepared(payload, chunk_bytes=4)
    upload = Upload()
    assert need(upload, {"bogus": 1}) is NeedCode.MANIFEST_MISSING
    upload.apply_manifest(prep.manifest)
    assert upload.apply_chunk(prep.chunks[0]) is None

    chunk: dict[str, Any] = {
        "payload_id": "P_X",
        "index": 7,
        "offset": 99,
        "sha256": sha(b"wxyz"),
        "bytes_b64": "!" * 12,
    }
    assert need(upload, with_fields(chunk, index=_DROP)) is NeedCode.CHUNK_INVALID
    assert need(upload, chunk) is NeedCode.PAYLOAD_ID_MISMATCH
    chunk["payload_id"] = "P_1"
    assert need(upload, chunk) is NeedCode.CHUNK_EXPECTED_INDEX
    chunk["index"] = 1
    assert need(upload, chunk) is NeedCode.CHUNK_OFFSET_MISMATCH
    chunk["offset"] = 4
    assert need(upload, chunk) is NeedCode.CHUNK_B64_INVALID  # over-long too: base64 first
    chunk["bytes_b64"] = b64(b"wxyz5")
    assert need(upload, chunk) is NeedCode.CHUNK_TOO_LARGE  # decoded to 5 > 4
    chunk["bytes_b64"] = b64(b"wxyz")
    assert need(upload, chunk) is NeedCode.PAYLOAD_TOO_LARGE  # 4 + 4 > 6
    chunk["bytes_b64"] = b64(b"ef")
    assert need(upload, chunk) is NeedCode.CHUNK_HASH_MISMATCH
    chunk["sha256"] = sha(b"ef")
    assert upload.apply_chunk(chunk) == payload


CHUNK_INVALID_CASES: list[tuple[str, dict[str, Any]]] = [
    ("index missing", {"index": _DROP}),
    ("index negative", {"index": -1}),
    ("index a string", {"index": "0"}),
    ("index a float", {"index": 0.0}),
    ("index true", {"index": True}),
    ("offset negative", {"offset": -1}),
    ("offset a string", {"offset": "0"}),
    ("payload_id missing", {"payload_id": _DROP}),
    ("payload_id empty", {"payload_id": ""}),
    ("payload_id a number", {"payload_id": 1}),
    ("sha256 missing", {"sha256": _DROP}),
    ("sha256 a number", {"sha256": 0}),
    ("unknown field", {"extra": "x"}),
    ("bytes instead of bytes_b64", {"bytes": "MDEyMw=="}),
]


@pytest.mark.parametrize(
    "changes", [c[1] for c in CHUNK_INVALID_CASES], ids=[c[0] for c in CHUNK_INVALID_CASES]
)
def test_chunk_invalid(changes: dict[str, Any]) -> None:
    prep = prepared()
    upload = started(prep)
    assert need(upload, with_fields(prep.chunks[0], **changes)) is NeedCode.CHUNK_INVALID
    assert upload.apply_chunk(prep.chunks[0]) is None


BAD_SECOND_CHUNKS: list[tuple[str, dict[str, Any]]] = [
    ("payload_id", {"payload_id": "P_2"}),
    ("index", {"index": 2}),
    ("offset", {"offset": 5}),
    ("b64", {"bytes_b64": "****"}),
    ("too large", {"bytes_b64": b64(b"45678")}),
    ("hash", {"sha256": sha(b"nope")}),
    ("invalid", {"index": _DROP}),
]


@pytest.mark.parametrize(
    "changes", [c[1] for c in BAD_SECOND_CHUNKS], ids=[c[0] for c in BAD_SECOND_CHUNKS]
)
def test_after_a_need_the_upload_accepts_the_correct_next_chunk(changes: dict[str, Any]) -> None:
    prep = prepared()
    upload = started(prep)
    assert upload.apply_chunk(prep.chunks[0]) is None
    for _ in range(2):
        need(upload, with_fields(prep.chunks[1], **changes))
    assert upload.bytes_received == 4
    assert upload.apply_chunk(prep.chunks[1]) is None
    assert upload.apply_chunk(prep.chunks[2]) == DATA


def test_after_payload_too_large_the_upload_accepts_the_correct_last_chunk() -> None:
    prep = prepared()
    upload = started(prep)
    upload.apply_chunk(prep.chunks[0])
    upload.apply_chunk(prep.chunks[1])
    assert need(upload, make_chunk(b"89!", 2, 8)) is NeedCode.PAYLOAD_TOO_LARGE
    assert upload.apply_chunk(prep.chunks[2]) == DATA


VALID_MANIFEST = prepared().manifest

MANIFEST_CASES: list[tuple[str, dict[str, Any]]] = [
    ("payload_id empty", {"payload_id": ""}),
    ("payload_id missing", {"payload_id": _DROP}),
    ("payload_id a number", {"payload_id": 1}),
    ("payload_id too long", {"payload_id": "p" * (MAX_ID_CHARS + 1)}),
    ("content_type a number", {"content_type": 5}),
    ("content_type too long", {"content_type": "t" * (MAX_ID_CHARS + 1)}),
    ("chunk_bytes 0", {"chunk_bytes": 0}),
    ("chunks 0", {"chunks": 0}),
    ("chunk_bytes 0, empty payload", {"chunk_bytes": 0, "total_bytes": 0, "sha256": sha(b"")}),
    ("chunks 0, empty payload", {"chunks": 0, "total_bytes": 0, "sha256": sha(b"")}),
    ("chunk_bytes missing", {"chunk_bytes": _DROP}),
    ("chunks negative", {"chunks": -1}),
    ("total_bytes missing", {"total_bytes": _DROP}),
    ("total_bytes a string", {"total_bytes": "10"}),
    ("total_bytes a float", {"total_bytes": 10.0}),
    ("total_bytes true", {"total_bytes": True}),
    ("total_bytes negative", {"total_bytes": -1}),
    ("total over chunk_bytes*chunks", {"total_bytes": 13}),
    ("total over the cap", {"total_bytes": 101, "chunk_bytes": 101, "chunks": 1}),
    ("sha256 short", {"sha256": "ab" * 31}),
    ("sha256 long", {"sha256": "ab" * 33}),
    ("sha256 not hex", {"sha256": "g" * 64}),
    ("sha256 missing", {"sha256": _DROP}),
    ("sha256 a number", {"sha256": 0}),
    ("sha256 with newline", {"sha256": "a" * 64 + "\n"}),
    ("content_encoding gzip", {"content_encoding": "gzip"}),
    ("content_encoding null", {"content_encoding": None}),
    ("cipher aes", {"cipher": "aes"}),
    ("cipher a list", {"cipher": ["none"]}),
    ("unknown field", {"compression": "none"}),
]


@pytest.mark.parametrize(
    "changes", [c[1] for c in MANIFEST_CASES], ids=[c[0] for c in MANIFEST_CASES]
)
def test_manifest_invalid(changes: dict[str, Any]) -> None:
    upload = Upload(max_payload_bytes=100)
    with pytest.raises(ManifestInvalid) as info:
        upload.apply_manifest(with_fields(VALID_MANIFEST, **changes))
    exc = info.value
    assert isinstance(exc, UploadNeed)
    assert exc.need_code is NeedCode.MANIFEST_INVALID
    assert exc.error_code is ErrorCode.NEED_MANIFEST_FIX
    assert (exc.verb, exc.status) == (Verb.CLARIFY, Status.NEED)
    assert upload.manifest is None


def test_manifest_limits_are_inclusive_and_defaults_apply() -> None:
    upload = Upload(max_payload_bytes=12)
    manifest = upload.apply_manifest(
        with_fields(
            VALID_MANIFEST,
            total_bytes=12,
            sha256=VALID_MANIFEST["sha256"].upper(),
            content_type=_DROP,
            content_encoding=_DROP,
            cipher=_DROP,
        )
    )
    assert manifest.total_bytes == 12
    assert manifest.sha256 == VALID_MANIFEST["sha256"]
    assert manifest.content_type == "application/octet-stream"


def test_an_invalid_manifest_leaves_the_upload_in_progress() -> None:
    prep = prepared()
    upload = started(prep)
    upload.apply_chunk(prep.chunks[0])
    with pytest.raises(ManifestInvalid):
        upload.apply_manifest(with_fields(prep.manifest, cipher="aes"))
    assert upload.bytes_received == 4
    assert upload.apply_chunk(prep.chunks[1]) is None
    assert upload.apply_chunk(prep.chunks[2]) == DATA


def test_a_new_manifest_restarts_the_upload() -> None:
    first = prepared()
    second = prepared(b"another payload", chunk_bytes=5, payload_id="P_2")
    upload = started(first)
    upload.apply_chunk(first.chunks[0])
    upload.apply_chunk(first.chunks[1])
    upload.apply_manifest(second.manifest)
    assert upload.bytes_received == 0
    assert need(upload, first.chunks[2]) is NeedCode.PAYLOAD_ID_MISMATCH
    assert [upload.apply_chunk(c) for c in second.chunks] == [None, None, b"another payload"]


def test_the_same_manifest_again_restarts_from_chunk_zero() -> None:
    prep = prepared()
    upload = started(prep)
    upload.apply_chunk(prep.chunks[0])
    upload.apply_manifest(prep.manifest)
    assert upload.bytes_received == 0
    assert need(upload, prep.chunks[1]) is NeedCode.CHUNK_EXPECTED_INDEX
    assert [upload.apply_chunk(c) for c in prep.chunks] == [None, None, DATA]


def test_a_new_manifest_after_completion_starts_a_new_upload() -> None:
    prep = prepared()
    upload = started(prep)
    for chunk in prep.chunks:
        upload.apply_chunk(chunk)
    assert upload.complete
    upload.apply_manifest(prep.manifest)
    assert not upload.complete
    assert not upload.is_final_chunk_again(prep.chunks[-1])
    with pytest.raises(RuntimeError):
        _ = upload.payload
    assert [upload.apply_chunk(c) for c in prep.chunks] == [None, None, DATA]


def test_is_final_chunk_again() -> None:
    prep = prepared()
    upload = started(prep)
    final = prep.chunks[-1]
    assert not upload.is_final_chunk_again(final)
    upload.apply_chunk(prep.chunks[0])
    upload.apply_chunk(prep.chunks[1])
    assert not upload.is_final_chunk_again(final)  # the right chunk, but not yet applied
    upload.apply_chunk(final)
    assert upload.is_final_chunk_again(final)
    assert upload.is_final_chunk_again(dict(final))
    assert not upload.is_final_chunk_again(prep.chunks[0])
    assert not upload.is_final_chunk_again(prep.chunks[1])
    assert not upload.is_final_chunk_again(with_fields(final, bytes_b64=b64(b"8!")))
    assert not upload.is_final_chunk_again(with_fields(final, payload_id="P_2"))
    assert not upload.is_final_chunk_again(with_fields(final, offset=7))
    assert not upload.is_final_chunk_again({})
    assert not upload.is_final_chunk_again(with_fields(final, extra=1))
    # The upload stays complete: a resent final chunk is not applied a second time.
    assert need(upload, final) is NeedCode.CHUNK_EXPECTED_INDEX
    assert upload.payload == DATA


def test_payload_raises_before_completion() -> None:
    prep = prepared()
    upload = Upload()
    with pytest.raises(RuntimeError):
        _ = upload.payload
    upload.apply_manifest(prep.manifest)
    upload.apply_chunk(prep.chunks[0])
    upload.apply_chunk(prep.chunks[1])
    with pytest.raises(RuntimeError):
        _ = upload.payload
    upload.apply_chunk(prep.chunks[2])
    assert upload.payload == DATA


def test_payload_raises_after_a_failed_final_chunk() -> None:
    prep = prepared()
    upload = Upload()
    upload.apply_manifest(with_fields(prep.manifest, sha256="0" * 64))
    for chunk in prep.chunks[:-1]:
        upload.apply_chunk(chunk)
    need(upload, prep.chunks[-1])
    with pytest.raises(RuntimeError):
        _ = upload.payload


# Job specs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content_type", "is_json"),
    [
        (SPEC_CONTENT_TYPE, True),
        ("application/json", True),
        (" Application/JSON ; charset=utf-8", True),
        ("application/vnd.governor.job+json;v=1", True),
        ("text/plain", False),
        ("application/octet-stream", False),
        ("application/jsonx", False),
        ("", False),
    ],
)
def test_which_content_types_are_json_job_specs(content_type: str, is_json: bool) -> None:
    assert is_json_content_type(content_type) is is_json
    spec = parse_spec(b'{"prompt": "hi"}', content_type, max_new_tokens_ceiling=64)
    assert spec.prompt == ("hi" if is_json else '{"prompt": "hi"}')


@pytest.mark.parametrize(
    ("fields", "objectives"),
    [
        ({}, (0.0, 0.0)),
        ({"ttft_slo_ms": 500, "tpot_slo_ms": 40.5}, (500.0, 40.5)),
        ({"ttft_slo_ms": 0}, "'ttft_slo_ms' must be above 0"),
        ({"tpot_slo_ms": -1}, "'tpot_slo_ms' must be a number"),
        ({"tpot_slo_ms": "fast"}, "'tpot_slo_ms' must be a number"),
        ({"ttft_slo_ms": 4e6}, "'ttft_slo_ms' must be a number"),
    ],
)
def test_a_job_spec_may_carry_its_own_objectives(
    fields: dict[str, object], objectives: tuple[float, float] | str
) -> None:
    payload = orjson.dumps({"prompt": "hi", **fields})
    if isinstance(objectives, str):
        with pytest.raises(SpecInvalid, match=objectives):
            parse_spec(payload, SPEC_CONTENT_TYPE, max_new_tokens_ceiling=64)
        return
    spec = parse_spec(payload, SPEC_CONTENT_TYPE, max_new_tokens_ceiling=64)
    assert (spec.ttft_slo_ms, spec.tpot_slo_ms) == objectives
    assert parse_spec(spec.encode(), SPEC_CONTENT_TYPE, max_new_tokens_ceiling=64) == spec
