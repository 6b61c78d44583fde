"""Property tests of the wire codec: whatever bytes or JSON a peer sends, the codec answers with
a frame or one of its own errors, never a stray exception; and what it builds, it reads back."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import orjson
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from protocol.codes import CLIENT_VERBS, SERVER_ONLY_FIELDS, NeedCode, Status, Verb
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
    is_id,
)
from protocol.lines import LineReader
from protocol.upload import Upload, split_payload

# No example database, so the tests write nothing into the working tree.
PROPS = settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
FEWER = settings(PROPS, max_examples=100)

# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------

# orjson refuses lone surrogates, so JSON text never holds them.
chars = st.characters(exclude_categories=["Cs"])
texts = st.text(chars, max_size=20)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=U64_MAX)  # what orjson can write
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(texts, children, max_size=4),
    max_leaves=8,
)
json_objects = st.dictionaries(texts, json_values, max_size=6)
# A cheaper "any JSON value", for spoiling one field of an otherwise valid object.
any_value = (
    json_scalars
    | st.lists(json_scalars, max_size=2)
    | st.dictionaries(texts, json_scalars, max_size=2)
)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# A valid object gets a few faults (mostly one, so that each check is reached on its own):
# a field given a near-miss value or any value, a field dropped, or a field added.
FAULT_COUNTS = st.sampled_from([0, 1, 1, 1, 1, 2, 3])
FAULTS = st.sampled_from(["near", "near", "any", "drop", "add"])

small_ints = st.integers(min_value=-1, max_value=40)
NEAR: dict[str, st.SearchStrategy[Any]] = {
    # The envelope.
    "v": st.sampled_from([1, -1, True, False, "0", 0.0, None]),
    "verb": st.sampled_from(["share", "ping", "clarify", "confirm", "Ping", ""]),
    "job": st.sampled_from(["", "j" * MAX_ID_CHARS, "j" * (MAX_ID_CHARS + 1), 7]) | texts,
    "seq": st.sampled_from([0, 1, -1, U64_MAX, True, 1.5, 2.0, "1"]),
    "ttl_ms": st.sampled_from([0, -1, U64_MAX, "1", True, None, 0.5]),
    "payload_manifest": st.sampled_from([{}, None, [], "{}", 0, False]),
    "payload_chunk": st.sampled_from([{}, None, [], "{}", 0, False]),
    # Manifests and chunks.
    "payload_id": st.sampled_from(["P_1", "P_2", "", "p" * (MAX_ID_CHARS + 1), 1]),
    "content_type": texts,
    "content_encoding": st.sampled_from(["identity", "", "gzip", None]),
    "cipher": st.sampled_from(["none", "", "aes", None]),
    "total_bytes": small_ints,
    "chunk_bytes": small_ints,
    "chunks": small_ints,
    "index": small_ints,
    "offset": small_ints,
    "sha256": st.binary(max_size=8).map(sha) | texts,
    "bytes_b64": st.binary(max_size=10).map(b64)
    | st.text(chars, max_size=8)
    | st.text(st.sampled_from("AQ/+=\n \r"), max_size=9),
}


@st.composite
def spoiled(draw: st.DrawFn, valid: dict[str, Any], extra_names: tuple[str, ...]) -> dict[str, Any]:
    out = dict(valid)
    for _ in range(draw(FAULT_COUNTS)):
        fault = draw(FAULTS)
        if fault == "add" or not out:
            name = draw(st.sampled_from(extra_names) | texts)
            out[name] = draw(NEAR.get(name, any_value) | any_value)
            continue
        name = draw(st.sampled_from(sorted(out)))
        if fault == "drop":
            del out[name]
        elif fault == "near":
            out[name] = draw(NEAR.get(name, any_value))
        else:
            out[name] = draw(any_value)
    return out


SAMPLE = split_payload(b"property payload!", chunk_bytes=6)  # chunks of 6, 6 and 5 bytes
PAYLOAD = b"property payload!"

manifest_like = spoiled(SAMPLE.manifest, ("content_type", "offset", "payload"))


@st.composite
def other_bytes(draw: st.DrawFn, chunk: dict[str, Any]) -> dict[str, Any]:
    """``chunk`` carrying other bytes, with their own correct sha256."""
    data = draw(st.binary(max_size=8))
    return {**chunk, "bytes_b64": b64(data), "sha256": sha(data)}


chunk_like = st.sampled_from(SAMPLE.chunks).flatmap(
    lambda chunk: spoiled(chunk, ("chunks", "total_bytes", "bytes")) | other_bytes(chunk)
)


@st.composite
def valid_requests(draw: st.DrawFn) -> tuple[dict[str, Any], Request]:
    """A frame that breaks no envelope rule, and the Request it must decode to."""
    verb = draw(st.sampled_from(sorted(CLIENT_VERBS)))
    job = draw(st.text(chars, min_size=1, max_size=MAX_ID_CHARS))
    seq = draw(st.integers(min_value=1, max_value=U64_MAX))
    frame: dict[str, Any] = {"v": 0, "verb": str(verb), "job": job, "seq": seq}
    ttl_ms = 0
    if draw(st.booleans()):
        ttl_ms = frame["ttl_ms"] = draw(st.integers(min_value=0, max_value=U64_MAX))
    manifest = chunk = inline = None
    if verb is Verb.SHARE:
        kind = draw(st.sampled_from(["manifest", "chunk", "inline"]))
        if kind == "manifest":
            manifest = frame["payload_manifest"] = draw(manifest_like)
        elif kind == "chunk":
            chunk = frame["payload_chunk"] = draw(chunk_like)
        else:
            inline = frame["payload_inline"] = draw(st.just({}) | chunk_like)
    return frame, Request(verb, job, seq, ttl_ms, manifest, chunk, inline)


_ENVELOPE_EXTRAS = (
    *sorted(SERVER_ONLY_FIELDS),
    "ttl_ms",
    "payload_manifest",
    "payload_chunk",
    "payload_inline",
    "api_key",
    "bogus",
)


@st.composite
def envelope_frames(draw: st.DrawFn) -> dict[str, Any]:
    """Frames built from the envelope's own field names, each field possibly spoiled; now and
    then the payload rule is broken on purpose: a ping with a payload, a share with none or
    with both."""
    frame = draw(valid_requests())[0]
    if draw(st.sampled_from([False, False, False, True])):
        payload = draw(st.sampled_from(["payload_manifest", "payload_chunk", "payload_inline"]))
        if payload in frame:
            del frame[payload]
        else:
            frame[payload] = draw(st.just({}) | manifest_like | chunk_like)
    return draw(spoiled(frame, _ENVELOPE_EXTRAS))


def dump(value: Any) -> bytes:
    return orjson.dumps(value)


# A line on the wire: raw bytes, any JSON value, or an envelope-shaped object.
wire_lines = st.one_of(
    st.binary(max_size=64),
    json_values.map(dump),
    envelope_frames().map(dump),
    valid_requests().map(lambda pair: dump(pair[0])),
    st.sampled_from([b"GET / HTTP/1.1", b"<html>", b"<?xml", b"GIF89a", b"[1]", b"{", b""]),
)


def _cut(draw: st.DrawFn, data: bytes) -> list[bytes]:
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=10)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


@st.composite
def streams(draw: st.DrawFn) -> list[bytes]:
    """Lines joined by \\n or \\r\\n (maybe with an unterminated tail), cut into pieces."""
    lines = draw(st.lists(wire_lines, max_size=8))
    data = b"".join(line + draw(st.sampled_from([b"\n", b"\r\n"])) for line in lines)
    data += draw(st.binary(max_size=8))
    return _cut(draw, data)


@st.composite
def binary_pieces(draw: st.DrawFn) -> list[bytes]:
    return _cut(draw, draw(st.binary(max_size=512)))


line_limits = st.sampled_from([1, 2, 3, 8, 16, 64, 512, 4096, 262144])

# --------------------------------------------------------------------------------------------
# LineReader + decode_request (+ Upload): never a stray exception
# --------------------------------------------------------------------------------------------


T = TypeVar("T")


def attempt(call: Callable[[], T], errors: type[Exception]) -> tuple[T | None, Exception | None]:
    """``call()``'s result, or the error of type ``errors`` it raised; others propagate."""
    try:
        return call(), None
    except errors as exc:
        return None, exc


# The envelope rules of HEPTAMINI_V0.md, restated independently of protocol/frames.py.
PAYLOAD_FIELDS = ("payload_manifest", "payload_chunk", "payload_inline")
REQUEST_FIELDS = frozenset({"v", "verb", "job", "seq", "ttl_ms", "api_key", *PAYLOAD_FIELDS})
BAD_LINE_CODES = frozenset(
    {
        NeedCode.HTTP_REQUEST,
        NeedCode.HTML_DOCUMENT,
        NeedCode.XML_DOCUMENT,
        NeedCode.BINARY_GIF,
        NeedCode.JSON_ARRAY,
        NeedCode.JSON_MALFORMED,
        NeedCode.NOT_JSON,
    }
)


def _u64(value: object) -> bool:
    return type(value) is int and 0 <= value <= U64_MAX


def _job_ok(value: object) -> bool:
    return type(value) is str and 1 <= len(value) <= MAX_ID_CHARS


def _seq_ok(value: object) -> bool:
    return _u64(value) and value != 0


def envelope_ok(obj: dict[str, Any]) -> bool:
    if not obj.keys() <= REQUEST_FIELDS:
        return False
    if type(obj.get("v")) is not int or obj["v"] != 0:
        return False
    verb = obj.get("verb")
    if type(verb) is not str or verb not in ("share", "ping", "cancel"):
        return False
    if not (_job_ok(obj.get("job")) and _seq_ok(obj.get("seq")) and _u64(obj.get("ttl_ms", 0))):
        return False
    if obj.get("api_key") is not None and not _job_ok(obj["api_key"]):
        return False
    payloads = [obj[name] for name in PAYLOAD_FIELDS if obj.get(name) is not None]
    if verb != "share":
        return not payloads
    return len(payloads) == 1 and type(payloads[0]) is dict


_UNPARSED = object()


def check_decoded(line: bytes, upload: Upload) -> None:
    """decode_request agrees with the restated envelope rules: a Request for a valid frame,
    EnvelopeInvalid (naming the frame's valid job and seq) for an invalid object, BadLine for
    anything else. A share's manifest or chunk then goes to ``upload``: UploadNeed or nothing."""
    try:
        parsed: Any = orjson.loads(line)
    except orjson.JSONDecodeError:
        parsed = _UNPARSED
    req, error = attempt(partial(decode_request, line), RemoteProtocolError)
    if error is not None:
        assert isinstance(error, RemoteProtocolError)
        assert type(error.need_code) is NeedCode
        assert not error.fatal
        event(error.need_code.value)
    else:
        event("request")

    if type(parsed) is not dict:
        assert type(error) is BadLine
        assert error.need_code in BAD_LINE_CODES
        if type(parsed) is list:
            assert error.need_code is NeedCode.JSON_ARRAY
        elif parsed is not _UNPARSED:
            assert error.need_code is NeedCode.NOT_JSON
        return
    if not envelope_ok(parsed):
        assert type(error) is EnvelopeInvalid
        assert error.job == (parsed.get("job") if _job_ok(parsed.get("job")) else None)
        assert error.seq == (parsed.get("seq") if _seq_ok(parsed.get("seq")) else None)
        return

    assert error is None
    assert req == Request(
        Verb(parsed["verb"]),
        parsed["job"],
        parsed["seq"],
        parsed.get("ttl_ms", 0),
        parsed.get("payload_manifest"),
        parsed.get("payload_chunk"),
        parsed.get("payload_inline"),
        parsed.get("api_key"),
    )
    if req.verb is not Verb.SHARE or req.inline is not None:
        return
    if req.manifest is not None:
        _, error = attempt(partial(upload.apply_manifest, req.manifest), UploadNeed)
    else:
        assert req.chunk is not None
        _, error = attempt(partial(upload.apply_chunk, req.chunk), UploadNeed)
    if error is not None:
        assert isinstance(error, UploadNeed)
        assert type(error.need_code) is NeedCode


def expected_split(data: bytes) -> tuple[list[bytes], bytes]:
    """The lines a correct reader returns for ``data``, and its unterminated tail."""
    *complete, tail = data.split(b"\n")
    return [line[:-1] if line.endswith(b"\r") else line for line in complete], tail


def run_stream(pieces: list[bytes], max_line: int) -> None:
    reader = LineReader(max_line)
    upload = Upload()
    got: list[bytes] = []

    def take_lines() -> None:
        while (line := reader.next_line()) is not None:
            assert b"\n" not in line
            assert len(line) <= max_line
            got.append(line)
            check_decoded(line, upload)

    raised = False
    for piece in pieces:
        reader.feed(piece)
        _, error = attempt(take_lines, LineTooLong)
        if error is not None:
            assert isinstance(error, LineTooLong)
            assert error.need_code is NeedCode.LINE_TOO_LARGE
            assert error.fatal
            raised = True
            break

    # Against an oracle: bytes.split, with the limit applied to each line.
    lines, tail = expected_split(b"".join(pieces))
    too_long = [i for i, line in enumerate(lines) if len(line) > max_line]
    if raised:
        # Exactly the lines before the first over-long one came out (all of them, when the
        # over-long one is the unterminated tail), and the reader stays broken.
        assert got == lines[: too_long[0] if too_long else len(lines)]
        assert too_long or len(tail) > max_line
        _, again = attempt(reader.next_line, LineTooLong)
        assert isinstance(again, LineTooLong), "a reader past LineTooLong must keep raising"
    else:
        assert not too_long
        assert got == lines
        assert reader.buffered == len(tail)
        # max_line + 1: a full-length line may still be waiting for the "\n" after its "\r".
        assert len(tail) <= max_line + 1


@PROPS
@given(data=st.binary(max_size=1024), max_line=line_limits)
def test_any_bytes_in_one_feed(data: bytes, max_line: int) -> None:
    run_stream([data], max_line)


@PROPS
@given(pieces=binary_pieces(), max_line=line_limits)
def test_any_bytes_cut_into_pieces(pieces: list[bytes], max_line: int) -> None:
    run_stream(pieces, max_line)


@PROPS
@given(pieces=st.lists(st.binary(max_size=40), max_size=12), max_line=line_limits)
def test_any_list_of_binary_chunks(pieces: list[bytes], max_line: int) -> None:
    run_stream(pieces, max_line)


@st.composite
def near_limit_streams(draw: st.DrawFn) -> tuple[int, list[bytes]]:
    """Lines a byte or two either side of the limit, with stray and real "\r"s, in pieces."""
    max_line = draw(st.integers(1, 24))
    lengths = st.integers(max(0, max_line - 2), max_line + 2) | st.integers(0, max_line)

    def content(n: int) -> st.SearchStrategy[bytes]:
        """``n`` bytes of "a" with up to two "\r" among them."""
        cr_at = st.lists(st.integers(0, n - 1), max_size=2) if n else st.just([])
        return cr_at.map(lambda at: bytes(13 if k in at else 97 for k in range(n)))

    data = b""
    for _ in range(draw(st.integers(0, 6))):
        data += draw(lengths.flatmap(content)) + draw(st.sampled_from([b"\n", b"\r\n"]))
    if draw(st.booleans()):
        data += draw(lengths.flatmap(content))  # an unterminated tail
    if draw(st.booleans()):
        # Cut right after every "\r": a full-length line then waits for its "\n" alone.
        at = [i + 1 for i, byte in enumerate(data) if byte == 13]
        return max_line, [data[a:b] for a, b in zip([0, *at], [*at, len(data)], strict=True)]
    return max_line, _cut(draw, data)


@FEWER
@given(case=near_limit_streams())
def test_lines_near_the_limit(case: tuple[int, list[bytes]]) -> None:
    max_line, pieces = case
    run_stream(pieces, max_line)


@FEWER
@given(pieces=streams(), max_line=line_limits)
def test_json_ish_streams(pieces: list[bytes], max_line: int) -> None:
    run_stream(pieces, max_line)


@FEWER
@given(value=json_values)
def test_any_json_value_decodes_or_raises_a_protocol_error(value: Any) -> None:
    check_decoded(dump(value), Upload())


@PROPS
@given(frame=envelope_frames())
def test_envelope_shaped_frames_decode_or_raise_a_protocol_error(frame: dict[str, Any]) -> None:
    check_decoded(dump(frame), Upload())


@FEWER
@given(pair=valid_requests())
def test_valid_frames_decode_to_their_request(pair: tuple[dict[str, Any], Request]) -> None:
    frame, expected = pair
    line = dump(frame)
    reader = LineReader(262144)
    reader.feed(line + b"\r\n")
    assert reader.next_line() == line
    assert decode_request(line) == expected
    encoded = encode_request(
        expected.verb,
        expected.job,
        expected.seq,
        ttl_ms=expected.ttl_ms,
        manifest=expected.manifest,
        chunk=expected.chunk,
        inline=expected.inline,
    )
    assert encoded.endswith(b"\n")
    assert encoded.count(b"\n") == 1
    assert decode_request(encoded[:-1]) == expected


@FEWER
@given(data=st.binary(max_size=256) | json_values.map(dump) | envelope_frames().map(dump))
def test_decode_reply_raises_only_reply_invalid(data: bytes) -> None:
    reply, error = attempt(partial(decode_reply, data), ReplyInvalid)
    if error is not None:
        return
    assert isinstance(reply, Reply)
    assert isinstance(reply.verb, Verb)
    assert isinstance(reply.status, Status)
    assert is_id(reply.job)


# --------------------------------------------------------------------------------------------
# Upload: any JSON object as a manifest or a chunk
# --------------------------------------------------------------------------------------------

any_objects = st.dictionaries(texts, any_value, max_size=6)
manifest_objects = st.one_of(st.just(SAMPLE.manifest), manifest_like, any_objects)
chunk_objects = st.one_of(st.sampled_from(SAMPLE.chunks), chunk_like, any_objects)
OPERATIONS = ["manifest", "chunk", "chunk", "next", "next", "next", "again"]


CHUNK_FIELDS = frozenset({"payload_id", "index", "offset", "sha256", "bytes_b64"})


def _chunk_key(obj: dict[str, Any]) -> tuple[Any, ...] | None:
    """What makes two chunk objects the same chunk (types included: 1 is not true)."""
    if not obj.keys() <= CHUNK_FIELDS:
        return None
    values = (obj.get(name) for name in ("payload_id", "index", "sha256", "bytes_b64"))
    return (*((type(v), v) for v in values), (type(obj.get("offset", 0)), obj.get("offset", 0)))


def _next_chunk(upload: Upload) -> dict[str, Any]:
    """The chunk of SAMPLE (6, 6 and 5 bytes) that comes after what ``upload`` holds."""
    return SAMPLE.chunks[min(upload.bytes_received // 6, len(SAMPLE.chunks) - 1)]


@FEWER
@given(data=st.data(), max_payload=st.sampled_from([16, 17, 17, 2**20]))
def test_upload_raises_only_upload_need(data: st.DataObject, max_payload: int) -> None:
    upload = Upload(max_payload_bytes=max_payload)
    final: dict[str, Any] | None = None  # the chunk that last completed the upload
    steps = data.draw(st.integers(0, 12), label="steps")
    for step in range(steps):
        # Mostly start with a manifest, so that the chunk checks past it are reached.
        first = step == 0 and data.draw(st.sampled_from([True, True, True, False]))
        kind = "manifest" if first else data.draw(st.sampled_from(OPERATIONS), label="operation")
        if first:
            obj = data.draw(st.just(SAMPLE.manifest) | manifest_like, label="first manifest")
        elif kind == "manifest":
            obj = data.draw(manifest_objects, label="manifest")
        elif kind == "next":
            obj = _next_chunk(upload)
            kind = "chunk"
        elif kind == "again" and final is not None:
            again_objects = st.just(final) | spoiled(final, ("bytes",)) | chunk_objects
            obj = data.draw(again_objects, label="again")
        else:
            obj = data.draw(chunk_objects, label="chunk")
        if kind == "again":
            again = upload.is_final_chunk_again(obj)
            if final is None or not upload.complete:
                assert again is False
            else:
                assert again is (_chunk_key(obj) == _chunk_key(final))
            if again:
                event("final chunk again")
            continue
        before = (upload.manifest, upload.bytes_received, upload.complete)
        if kind == "manifest":
            manifest, error = attempt(partial(upload.apply_manifest, obj), UploadNeed)
            if error is not None:
                assert isinstance(error, ManifestInvalid)
                assert error.need_code is NeedCode.MANIFEST_INVALID
                assert (upload.manifest, upload.bytes_received, upload.complete) == before
                continue
            assert manifest is not None
            assert upload.manifest == manifest
            assert manifest.total_bytes <= max_payload
            assert manifest.total_bytes <= manifest.chunk_bytes * manifest.chunks
            assert (upload.bytes_received, upload.complete) == (0, False)
            continue
        result, error = attempt(partial(upload.apply_chunk, obj), UploadNeed)
        if error is not None:
            assert isinstance(error, UploadNeed)
            assert not isinstance(error, ManifestInvalid)
            assert type(error.need_code) is NeedCode
            event(error.need_code.value)
            if error.need_code in (NeedCode.PAYLOAD_SIZE_MISMATCH, NeedCode.PAYLOAD_HASH_MISMATCH):
                assert upload.manifest is None
                assert upload.bytes_received == 0
            else:
                # Any other refusal leaves the upload as it was.
                assert (upload.manifest, upload.bytes_received, upload.complete) == before
            continue
        # Accepted: the chunk is the next one, in place, and its bytes match its sha256.
        assert upload.manifest is not None
        data_in = base64.b64decode(obj["bytes_b64"])
        assert obj["payload_id"] == upload.manifest.payload_id
        assert obj.get("offset", 0) == before[1]
        assert sha(data_in) == obj["sha256"].strip().lower()
        assert len(data_in) <= upload.manifest.chunk_bytes
        assert upload.bytes_received == before[1] + len(data_in)
        assert upload.bytes_received <= upload.manifest.total_bytes
        if result is not None:
            # Whatever completes an upload was verified against its manifest.
            event("complete")
            assert upload.complete
            assert len(result) == upload.manifest.total_bytes
            assert sha(result) == upload.manifest.sha256
            assert upload.payload == result
            assert upload.is_final_chunk_again(obj)
            final = obj


@FEWER
@given(data=st.data())
def test_refused_chunks_do_not_spoil_an_upload(data: st.DataObject) -> None:
    """Between the right chunks come spoiled ones; each refused one changes nothing."""
    upload = Upload()
    upload.apply_manifest(SAMPLE.manifest)
    result = None
    for i, chunk in enumerate(SAMPLE.chunks):
        for other in data.draw(st.lists(chunk_like, max_size=3), label=f"before chunk {i}"):
            before = upload.bytes_received
            accepted, error = attempt(partial(upload.apply_chunk, other), UploadNeed)
            if error is not None:
                assert isinstance(error, UploadNeed)
                event(error.need_code.value)
                if error.need_code in (
                    NeedCode.PAYLOAD_SIZE_MISMATCH,
                    NeedCode.PAYLOAD_HASH_MISMATCH,
                ):
                    assert upload.manifest is None  # the last chunk, with other bytes
                    return
                assert upload.bytes_received == before
                continue
            # Accepted: a well-formed next chunk (the right one, or other bytes that fit).
            data_in = base64.b64decode(other["bytes_b64"])
            assert other["payload_id"] == SAMPLE.manifest["payload_id"]
            assert other["index"] == i
            assert other.get("offset", 0) == before
            assert sha(data_in) == other["sha256"].strip().lower()
            assert len(data_in) <= SAMPLE.manifest["chunk_bytes"]
            assert upload.bytes_received == before + len(data_in)
            if accepted is not None:
                assert accepted == PAYLOAD
            return
        result = upload.apply_chunk(chunk)
    assert result == PAYLOAD
    assert upload.payload == PAYLOAD


b64_strings = (
    st.text(chars, max_size=12)
    | st.text(st.sampled_from("AQw/+=-_\n\r \x00é"), max_size=12)
    | st.binary(max_size=9).map(b64)
)


@PROPS
@given(text=b64_strings, own_sha=st.booleans())
def test_any_bytes_b64_string_is_decoded_or_refused(text: str, own_sha: bool) -> None:
    """Whatever string a chunk carries: the right need code, never a stray exception."""
    chunk_bytes = SAMPLE.manifest["chunk_bytes"]
    try:
        decoded: bytes | None = base64.b64decode(text, validate=True)
    except ValueError:  # binascii.Error is a ValueError
        decoded = None
    chunk = {**SAMPLE.chunks[0], "bytes_b64": text}
    if own_sha and decoded is not None:
        chunk["sha256"] = sha(decoded)
    upload = Upload()
    upload.apply_manifest(SAMPLE.manifest)
    result, error = attempt(partial(upload.apply_chunk, chunk), UploadNeed)
    if decoded is None:  # base64 first, as heptamini checks, however long the string
        expected: NeedCode | None = NeedCode.CHUNK_B64_INVALID
    elif len(decoded) > chunk_bytes:
        expected = NeedCode.CHUNK_TOO_LARGE
    elif sha(decoded) != chunk["sha256"]:
        expected = NeedCode.CHUNK_HASH_MISMATCH
    else:
        expected = None
    if expected is None:
        assert error is None
        assert result is None
        assert upload.bytes_received == len(decoded or b"")
    else:
        assert isinstance(error, UploadNeed)
        assert error.need_code is expected
        assert upload.bytes_received == 0


@PROPS
@given(obj=spoiled(SAMPLE.chunks[-1], ("bytes", "chunks")) | chunk_objects)
def test_is_final_chunk_again_only_for_the_same_final_chunk(obj: dict[str, Any]) -> None:
    upload = Upload()
    upload.apply_manifest(SAMPLE.manifest)
    for chunk in SAMPLE.chunks[:-1]:
        upload.apply_chunk(chunk)
    assert upload.is_final_chunk_again(obj) is False  # not complete yet
    assert upload.apply_chunk(SAMPLE.chunks[-1]) == PAYLOAD
    same = _chunk_key(obj) == _chunk_key(SAMPLE.chunks[-1])
    if same:
        event("same chunk")
    assert upload.is_final_chunk_again(obj) is same


# --------------------------------------------------------------------------------------------
# split_payload and Upload: any payload round-trips
# --------------------------------------------------------------------------------------------


@FEWER
@given(payload=st.binary(max_size=3000), chunk_bytes=st.integers(1, 64))
def test_split_payload_reassembles_exactly(payload: bytes, chunk_bytes: int) -> None:
    prep = split_payload(payload, chunk_bytes=chunk_bytes, payload_id="P_x")
    assert len(prep.chunks) == max(1, -(-len(payload) // chunk_bytes))
    assert prep.manifest["chunks"] == len(prep.chunks)
    upload = Upload()
    upload.apply_manifest(prep.manifest)
    *head, last = prep.chunks
    for chunk in head:
        assert upload.apply_chunk(chunk) is None
    assert upload.apply_chunk(last) == payload
    assert upload.payload == payload
    assert upload.bytes_received == len(payload)
    assert upload.is_final_chunk_again(last)


@FEWER
@given(payload=st.binary(max_size=600), chunk_bytes=st.integers(1, 64), seq=st.integers(1, 2**40))
def test_an_upload_survives_the_wire(payload: bytes, chunk_bytes: int, seq: int) -> None:
    """Manifest and chunks as request lines, through LineReader and decode_request."""
    prep = split_payload(payload, chunk_bytes=chunk_bytes)
    wire = encode_request(Verb.SHARE, "J_1", seq, manifest=prep.manifest) + b"".join(
        encode_request(Verb.SHARE, "J_1", seq + 1 + i, chunk=c) for i, c in enumerate(prep.chunks)
    )
    reader = LineReader(1024)
    reader.feed(wire)
    upload = Upload()
    result = None
    while (line := reader.next_line()) is not None:
        req = decode_request(line)
        if req.manifest is not None:
            upload.apply_manifest(req.manifest)
        else:
            assert req.chunk is not None
            result = upload.apply_chunk(req.chunk)
    assert result == payload
    assert reader.buffered == 0


# --------------------------------------------------------------------------------------------
# Replies round-trip
# --------------------------------------------------------------------------------------------

u64 = st.integers(min_value=0, max_value=U64_MAX)
codes = st.none() | st.sampled_from(list(NeedCode)) | texts
replies = st.builds(
    Reply,
    verb=st.sampled_from(list(Verb)),
    job=st.text(chars, min_size=1, max_size=MAX_ID_CHARS),
    seq=u64,
    status=st.sampled_from(list(Status)),
    ttl_ms=u64,
    need_code=codes,
    error_code=codes,
    retry_hint_ms=st.none() | u64,
    detail=st.none() | st.text(chars),
    receipts=st.lists(st.tuples(texts, u64), max_size=8).map(tuple),
    result=st.none() | json_objects,
)


@FEWER
@given(reply=replies)
def test_replies_round_trip(reply: Reply) -> None:
    data = encode_reply(reply)
    assert data.endswith(b"\n")
    assert data.count(b"\n") == 1
    assert decode_reply(data) == reply
    assert decode_reply(data[:-1]) == reply
