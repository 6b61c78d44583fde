"""Fuzzing: hostile bytes through the codec, and hostile clients against a real server.

``test_codec_properties.py`` checks that well-shaped JSON gets the right codes; this file asks
only what must hold whatever a peer sends, with inputs that file does not make (byte-level
damage to valid frames: numbers past 64 bits, nesting past the parser's depth, invalid UTF-8,
control characters, a BOM, stray ``\\r``; uploads with any manifest; job specs):

* the codec (``LineReader`` -> ``decode_request`` -> ``Upload``, and ``parse_spec``) lets only
  its stable-coded :class:`~protocol.errors.RemoteProtocolError` subclasses escape;
* the reader buffers at most ``max_line_bytes`` (+ one read), and an upload holds at most its
  manifest's ``total_bytes``;
* a real server on real sockets, under interleaved uploads, inline payloads, garbage, split
  frames, cancels, pings and abrupt disconnects on several connections, answers every line
  with a v0 reply, gives each admitted job exactly one terminal frame, never runs more than
  ``max_inflight`` jobs, and holds nothing (slots, jobs, buffers, connections) once its
  clients are gone.

Runs in well under a minute by default. ``GOVERNOR_FUZZ_EXAMPLES=N`` runs N examples per test
instead (the search is random each run: a failure prints the seed and a
``@reproduce_failure`` blob to replay it).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvloop
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from governor.config import Config
from governor.server import Server
from protocol.codes import PROTOCOL_VERSION, ErrorCode, NeedCode, Receipt, Status, Verb
from protocol.errors import LineTooLong, RemoteProtocolError, ReplyInvalid
from protocol.frames import U64_MAX, decode_reply, decode_request, encode_request
from protocol.lines import _COMPACT_AT, LineReader  # (the compaction bound: a memory bound)
from protocol.spec import SPEC_CONTENT_TYPE, SpecInvalid, parse_spec
from protocol.upload import Upload, split_payload

_ENV_EXAMPLES = os.environ.get("GOVERNOR_FUZZ_EXAMPLES")


def fuzz_settings(default_examples: int) -> settings:
    """Random each run (not derandomized: a run may find what no run found before; every
    failure prints its seed and blob), no example database (nothing written into the tree),
    ``GOVERNOR_FUZZ_EXAMPLES`` overriding the example count."""
    return settings(
        max_examples=int(_ENV_EXAMPLES) if _ENV_EXAMPLES else default_examples,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------------------------
# Codec: byte-level damage to valid frames
# --------------------------------------------------------------------------------------------

# What a hostile or broken peer puts where a value (or anything) should be.
HOSTILE_TOKENS: tuple[bytes, ...] = (
    b"1" + b"0" * 40,  # past u64: orjson reads it as a float
    b"-" + b"9" * 30,
    b"18446744073709551616",  # U64_MAX + 1
    b"18446744073709551615",
    b"-9223372036854775809",
    b"1e400",  # infinity as a double: orjson refuses it
    b"1.0",
    b"-0",
    b"NaN",
    b"-Infinity",
    b"true",
    b"null",
    b'""',
    b"{}",
    b"[]",
    b"[" * 1100 + b"]" * 1100,  # past orjson's depth limit (1024)
    b'{"a":' * 600 + b"1" + b"}" * 600,
    b'"\\ud800"',  # a lone surrogate, escaped
    b'"\xff\xfe"',  # invalid UTF-8 inside a string
    b"\xc3",  # a truncated UTF-8 sequence
    b"\xef\xbb\xbf",  # a BOM
    b"\x00",
    b"\r",
    b"\r\n",
    b"\n",
    b"\t\x0b\x0c",
    b"\x1b[2J",
    b'"\\u0000"',
    '"é\u2028\u2029\U0001f600"'.encode(),
    b'"' + b"x" * 300 + b'"',  # over MAX_ID_CHARS
    b"GET / HTTP/1.1",
)

payloads = st.binary(max_size=96)
job_ids = st.sampled_from(["J_1", "J_2", "é", "j" * 256])


@st.composite
def valid_frames(draw: st.DrawFn) -> list[bytes]:
    """A few valid request lines (without newlines): an upload's manifest and chunks, an inline
    payload, a ping, a cancel, in a plausible order."""
    job = draw(job_ids)
    seq = draw(st.integers(1, 5) | st.just(U64_MAX - 200))  # (room for the chunks)
    kind = draw(st.sampled_from(["upload", "upload", "inline", "ping", "cancel"]))
    if kind == "ping" or kind == "cancel":
        return [encode_request(Verb(kind), job, seq)[:-1]]
    if kind == "inline":
        text = draw(st.text(st.characters(exclude_categories=["Cs"]), max_size=40))
        inline = {"data": text, "sha256": sha(text.encode())}
        return [encode_request(Verb.SHARE, job, seq, inline=inline)[:-1]]
    prep = split_payload(draw(payloads), chunk_bytes=draw(st.integers(1, 40)))
    lines = [encode_request(Verb.SHARE, job, seq, manifest=prep.manifest)[:-1]]
    lines += [
        encode_request(Verb.SHARE, job, seq + 1 + i, chunk=chunk)[:-1]
        for i, chunk in enumerate(prep.chunks)
    ]
    return lines


@st.composite
def damaged(draw: st.DrawFn, line: bytes) -> bytes:
    """``line`` with a few byte-level faults: a hostile token put in place of a value or at
    any position, a range deleted or duplicated, a byte overwritten, a tail cut off."""
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 1, 2, 3]))):
        fault = draw(st.sampled_from(["value", "value", "insert", "delete", "dup", "byte", "cut"]))
        if not line:
            fault = "insert"
        token = draw(st.sampled_from(HOSTILE_TOKENS))
        at = draw(st.integers(0, len(line)))
        if fault == "value":
            # Replace what follows a ':' up to the next ',' or '}' (a value, near enough).
            colons = [i for i, b in enumerate(line) if b == 0x3A]
            if colons:
                start = draw(st.sampled_from(colons)) + 1
                end = start
                while end < len(line) and line[end] not in b",}":
                    end += 1
                line = line[:start] + token + line[end:]
                continue
            fault = "insert"
        if fault == "insert":
            line = line[:at] + token + line[at:]
        elif fault == "delete":
            line = line[:at] + line[at + draw(st.integers(1, 8)) :]
        elif fault == "dup":
            line = line[:at] + line[at : at + 16] + line[at:]
        elif fault == "byte":
            line = line[:at] + bytes([draw(st.integers(0, 255))]) + line[at + 1 :]
        else:
            line = line[:at]
    return line


@st.composite
def hostile_streams(draw: st.DrawFn) -> tuple[int, list[bytes]]:
    """A line limit, and a stream of (mostly) damaged valid frames, ended by ``\\n`` or
    ``\\r\\n`` (maybe an unterminated tail), cut into pieces at random points."""
    max_line = draw(st.sampled_from([16, 64, 300, 1024, 4096, 262144]))
    lines: list[bytes] = []
    for group in draw(st.lists(valid_frames(), max_size=5)):
        lines += [draw(damaged(line)) for line in group]
    data = b"".join(line + draw(st.sampled_from([b"\n", b"\n", b"\r\n"])) for line in lines)
    if draw(st.booleans()):
        data += draw(st.sampled_from(HOSTILE_TOKENS))
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=12)))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    return max_line, pieces


MAX_PAYLOAD = 64  # small, so that damaged manifests hit the cap too


def check_upload(upload: Upload) -> None:
    """An upload's memory: its parts add up to ``bytes_received``, at most ``total_bytes``."""
    held = len(upload._data) + len(upload._payload)  # (private: the bytes actually held)
    assert held == upload.bytes_received
    manifest = upload.manifest
    if manifest is None:
        assert upload.bytes_received == 0
        return
    assert upload.bytes_received <= manifest.total_bytes <= upload.max_payload_bytes
    assert upload.chunks_received <= manifest.chunks <= upload.max_chunks


def check_coded(exc: RemoteProtocolError, *, fatal: bool) -> None:
    """A codec error carries its stable wire codes (and whether it closes the connection)."""
    assert exc.fatal is fatal
    assert type(exc.need_code) is NeedCode
    assert type(exc.error_code) is ErrorCode
    event(f"{type(exc).__name__} {exc.need_code}")


def feed_line(line: bytes, uploads: dict[str, Upload]) -> None:
    """What the server does with one line, short of IO: decode it, then apply its manifest,
    chunk or inline payload to its job's upload. Only RemoteProtocolError may escape."""
    req = decode_request(line)
    event(f"decoded {req.verb}")
    if req.verb is not Verb.SHARE:
        return
    upload = uploads.setdefault(req.job, Upload(MAX_PAYLOAD))
    try:
        if req.manifest is not None:
            upload.apply_manifest(req.manifest)
        elif req.chunk is not None:
            if upload.is_final_chunk_again(req.chunk):
                event("final chunk again")
            elif upload.apply_chunk(req.chunk) is not None:
                event("payload complete")
        else:
            assert req.inline is not None
            upload.apply_inline(req.inline)
    finally:
        check_upload(upload)


@fuzz_settings(300)
@given(case=hostile_streams())
def test_damaged_frame_streams_raise_only_coded_errors(case: tuple[int, list[bytes]]) -> None:
    max_line, pieces = case
    reader = LineReader(max_line)
    uploads: dict[str, Upload] = {}
    for piece in pieces:
        reader.feed(piece)
        try:
            while (line := reader.next_line()) is not None:
                assert len(line) <= max_line
                if not line.strip():
                    continue
                try:
                    feed_line(line, uploads)
                except RemoteProtocolError as exc:
                    check_coded(exc, fatal=False)
        except LineTooLong:
            event("line too long")
            return  # fatal: the server reads no more from this connection
        # Bounded: what is buffered is at most one line and its "\r"; what the buffer holds,
        # consumed bytes included, at most the compaction threshold more.
        assert reader.buffered <= max_line + 1
        assert len(reader._buf) < _COMPACT_AT + max_line + 2  # (private: the real memory)


# --------------------------------------------------------------------------------------------
# Upload: any manifest, then chunks that fit, overflow, or lie
# --------------------------------------------------------------------------------------------

huge = st.sampled_from([U64_MAX, 2**64, 2**100, -1, True])
sizes = st.integers(0, 48) | huge
SIZE_FIELDS = ("total_bytes", "chunk_bytes", "chunks")


@fuzz_settings(300)
@given(data=st.data(), max_payload=st.sampled_from([0, 1, 16, 48, 2**20]))
def test_an_upload_never_holds_more_than_its_manifest(
    data: st.DataObject, max_payload: int
) -> None:
    upload = Upload(max_payload)
    payload = b""
    for _ in range(data.draw(st.integers(1, 16), label="steps")):
        manifest = upload.manifest
        if manifest is None or data.draw(st.integers(0, 9)) == 0:
            # Mostly a manifest that describes a real payload, with a field now and then
            # nudged off by one or made huge (or negative, or a boolean).
            payload = data.draw(st.binary(max_size=48), label="payload")
            chunk_bytes = data.draw(st.integers(1, 48), label="chunk_bytes")
            obj: dict[str, Any] = {
                "payload_id": "P",
                "total_bytes": len(payload),
                "chunk_bytes": chunk_bytes,
                "chunks": max(1, -(-len(payload) // chunk_bytes)),
                "sha256": sha(payload),
            }
            for name in data.draw(st.lists(st.sampled_from(SIZE_FIELDS), max_size=2)):
                nudged = obj[name] + data.draw(st.sampled_from([-1, 1]))
                obj[name] = data.draw(st.just(nudged) | huge, label=name)
            try:
                upload.apply_manifest(obj)
                event("manifest accepted")
            except RemoteProtocolError as exc:
                event(f"manifest {exc.need_code}")
            check_upload(upload)
            continue
        # The next slice of the payload, or other bytes of any size up to a little over the
        # chunk size with their own correct sha256 (so that the size checks decide), at the
        # right index and offset mostly.
        received = upload.bytes_received
        right = payload[received : received + manifest.chunk_bytes]
        size = data.draw(st.integers(0, min(manifest.chunk_bytes, 48) + 2), label="size")
        piece = data.draw(st.just(right) | st.binary(min_size=size, max_size=size), label="bytes")
        index = upload.chunks_received if not upload.complete else 0
        chunk = {
            "payload_id": "P",
            "index": data.draw(st.just(index) | st.integers(0, 3) | huge, label="index"),
            "offset": data.draw(st.just(received) | sizes, label="offset"),
            "sha256": data.draw(st.just(sha(piece)) | st.just("0" * 64), label="sha256"),
            "bytes_b64": base64.b64encode(piece).decode(),
        }
        try:
            if upload.apply_chunk(chunk) is not None:
                event("payload complete")
        except RemoteProtocolError as exc:
            event(f"chunk {exc.need_code}")
        check_upload(upload)


# --------------------------------------------------------------------------------------------
# Job specs: what the runners' prepare() reads from a verified payload
# --------------------------------------------------------------------------------------------

spec_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), U64_MAX)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(["user", "system", "assistant", "stop"]),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=6,
)
SPEC_FIELDS = (
    *("prompt", "messages", "max_new_tokens", "temperature", "top_p", "top_k", "min_p"),
    *("seed", "stop", "ignore_eos"),
    *("stream", "tenant", "lane", "tool_risk", "ttft_slo_ms", "tpot_slo_ms"),
)
message_like = st.fixed_dictionaries(
    {"role": spec_values | st.sampled_from(["user", "system"]), "content": spec_values}
)
specs = st.dictionaries(
    st.sampled_from(SPEC_FIELDS) | st.text(max_size=6),
    spec_values | st.lists(message_like, max_size=2),
    max_size=5,
)


@fuzz_settings(200)
@example(spec={"messages": [{"role": [], "content": "x"}]})
@given(spec=specs)
def test_any_job_spec_is_parsed_or_refused_with_a_code(spec: dict[str, Any]) -> None:
    for content_type in (SPEC_CONTENT_TYPE, "application/octet-stream"):
        try:
            parse_spec(orjson.dumps(spec), content_type, max_new_tokens_ceiling=1024)
        except SpecInvalid as exc:
            check_coded(exc, fatal=False)


# --------------------------------------------------------------------------------------------
# A real server on real sockets: generated scripts of hostile clients
# --------------------------------------------------------------------------------------------
#
# Each example is one whole scenario in one event loop of its own (asyncio.run or uvloop.run,
# drawn), from a server started on a port-0 socket to its close: hypothesis drives a sync test,
# and nothing is shared between examples. A script is a list of steps on a few connections;
# the client side keeps a model of what it sent (every frame has a fresh seq, three apart, so
# that the answers to one frame, at seq + 1 or + 2, are told apart from the next frame's).

CAP = 2  # max_inflight
MAX_LINE = 2048
STEP_SEQ = 3
SETTLE_S = 10.0  # generous: a loaded CI machine must not fail a correct server
BAD_LINE_CODES = frozenset(
    {
        "http_request",
        "html_document",
        "xml_document",
        "binary_gif",
        "json_array",
        "json_malformed",
        "not_json",
        "envelope_invalid",
    }
)
CONNECTION_FATAL = frozenset(
    {"line_too_large", "idle_timeout", "too_many_jobs", "too_many_connections"}
)
REPLY_FIELDS = frozenset(
    {"v", "verb", "job", "seq", "ttl_ms", "status", "need_code", "error_code"}
    | {"retry_hint_ms", "detail", "receipts", "result", "delta"}
)
CLOSING = "the connection is closing"


def is_connection_frame(frame: dict[str, Any]) -> bool:
    """A reply about the connection (a bad line, or its fatal close), not about the job it
    names: a job's own abort when its connection closes says so in its detail."""
    need = frame.get("need_code")
    if need in BAD_LINE_CODES:
        return True
    return need in CONNECTION_FATAL and not str(frame.get("detail", "")).startswith(CLOSING)


@dataclass
class Sent:
    """A frame the client wrote: the answers to it carry its job and seq + 1 (or + 2)."""

    job: str
    seq: int
    kind: str  # "frame" (manifest, chunk, inline, ping: exactly one answer) or "cancel" (0-1)


@dataclass
class Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    frames: list[dict[str, Any]] = field(default_factory=list)  # every reply, decoded
    sent: list[Sent] = field(default_factory=list)
    seq: int = 1
    eof: asyncio.Event = field(default_factory=asyncio.Event)  # the server closed it
    closed_by_us: bool = False
    task: asyncio.Task[None] | None = None
    # job -> its final frame (as sent), for a retry after a yield
    finals: dict[str, bytes] = field(default_factory=dict)

    @property
    def usable(self) -> bool:
        """Open both ways as far as this side knows (the server may have closed it since)."""
        return not (self.closed_by_us or self.eof.is_set() or self.writer.is_closing())

    def answered(self, job: str) -> Callable[[], bool]:
        """Whether a reply naming ``job`` has come (or the connection has closed)."""
        return lambda: self.eof.is_set() or any(f["job"] == job for f in self.frames)

    def next_seq(self) -> int:
        seq, self.seq = self.seq, self.seq + STEP_SEQ
        return seq

    async def read_replies(self) -> None:
        try:
            while line := await self.reader.readline():
                if not line.endswith(b"\n") and self.closed_by_us:
                    break  # we dropped the connection in the middle of a reply
                assert line.endswith(b"\n"), f"a reply cut short: {line!r}"
                frame = orjson.loads(line)
                assert type(frame) is dict, frame
                assert frame.keys() <= REPLY_FIELDS, frame
                assert frame["v"] == PROTOCOL_VERSION
                try:
                    reply = decode_reply(line)
                except ReplyInvalid as exc:  # (an assertion, with the frame in its message)
                    raise AssertionError(f"not a v0 reply: {line!r}: {exc}") from None
                inflight, cap = reply.receipt(Receipt.INFLIGHT), reply.receipt(Receipt.CAP)
                if inflight is not None:
                    assert cap is not None, frame
                    assert inflight <= cap, frame
                self.frames.append(frame)
        except (ConnectionError, OSError):
            pass
        finally:
            self.eof.set()


@dataclass(frozen=True)
class Step:
    conn: int
    action: str
    args: tuple[Any, ...] = ()
    split: tuple[int, ...] = ()  # cut points: the bytes go out in pieces, the loop run between


GARBAGE = st.one_of(
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b" ")),
    st.sampled_from(
        [
            b"GET / HTTP/1.1\r",
            b"<!DOCTYPE html>",
            b"[1, 2]",
            b'{"v": 0',
            b"42",
            b'{"v": 0, "verb": "share", "job": "", "seq": 1}',
            b'{"v": 0, "verb": "confirm", "job": "J", "seq": 1}',
            b'{"v": 1, "verb": "ping", "job": "J", "seq": 1}',
            b"\xef\xbb\xbf{}",
            b"[" * 1100,
        ]
    ),
    st.just(b"x" * (MAX_LINE + 10)),  # over the line limit: fatal for the connection
)

CONNS = 3
conn_index = st.integers(0, CONNS - 1)


@st.composite
def steps(draw: st.DrawFn) -> Step:
    conn = draw(conn_index)
    action = draw(
        st.sampled_from(
            ["upload"] * 4
            + ["inline"] * 2
            + ["retry", "garbage", "cancel", "ping", "disconnect", "half", "wait", "partial"]
        )
    )
    split = tuple(sorted(draw(st.lists(st.integers(1, 400), max_size=3))))
    if action == "upload":
        size = draw(st.integers(0, 1500))
        chunk = draw(st.sampled_from([64, 256, 1024]))
        fault = draw(st.sampled_from(["none"] * 6 + ["hash", "skip", "offset"]))
        return Step(conn, action, (size, chunk, fault), split)
    if action == "partial":  # an upload left unfinished (its bytes stay buffered)
        return Step(conn, action, (draw(st.integers(200, 1500)),), split)
    if action == "inline":
        text = draw(st.text(st.characters(exclude_categories=["Cs"]), max_size=30))
        return Step(conn, action, (text, draw(st.sampled_from([True] * 5 + [False]))), split)
    if action == "garbage":
        return Step(conn, action, (draw(GARBAGE),), split)
    if action == "cancel":  # the n-th job this connection named (or one it never did)
        return Step(conn, action, (draw(st.integers(0, 3)),), split)
    if action == "retry":
        return Step(conn, action, (draw(st.integers(0, 6)),), split)
    if action == "disconnect":
        return Step(conn, action, (draw(st.sampled_from(["rst", "fin"])),))
    if action == "half":  # part of a frame, then the connection is dropped
        return Step(conn, action, (draw(st.integers(1, 60)),))
    if action == "wait":
        return Step(conn, action, (draw(st.sampled_from([0, 1, 5, 20])),))
    return Step(conn, action, (), split)


@dataclass(frozen=True)
class Scenario:
    stub_ms: int
    max_jobs_per_conn: int
    held_payloads_per_conn: int
    loop: str
    script: tuple[Step, ...]


scenarios = st.builds(
    Scenario,
    stub_ms=st.sampled_from([0, 5, 40, 100]),
    max_jobs_per_conn=st.sampled_from([3, 64]),
    held_payloads_per_conn=st.sampled_from([1, 8]),
    loop=st.sampled_from(["uvloop", "asyncio"]),
    script=st.lists(steps(), min_size=1, max_size=30).map(tuple),
)


async def eventually(condition: Callable[[], bool], what: str) -> None:
    """Wait (polling the loop) until ``condition`` holds; fail after SETTLE_S."""
    deadline = time.monotonic() + SETTLE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not settled within {SETTLE_S:g} s: {what}")
        await asyncio.sleep(0.002)


class Harness:
    def __init__(self, server: Server) -> None:
        self.server = server
        self.conns: list[Conn] = []  # every connection ever opened, for the final checks
        self.live: list[Conn | None] = [None] * CONNS
        self.jobs = 0
        self.peak = 0

    async def conn(self, index: int) -> Conn:
        conn = self.live[index]
        if conn is None or not conn.usable:
            host, port = self.server.address
            reader, writer = await asyncio.open_connection(host, port, limit=2**22)
            conn = Conn(reader, writer)
            conn.task = asyncio.get_running_loop().create_task(conn.read_replies())
            self.conns.append(conn)
            self.live[index] = conn
        return conn

    async def write(self, conn: Conn, data: bytes, split: tuple[int, ...] = ()) -> None:
        """Write ``data``, in pieces at ``split`` with the loop run between them."""
        start = 0
        for cut in (*(c for c in split if c < len(data)), len(data)):
            if conn.writer.is_closing():
                return
            conn.writer.write(data[start:cut])
            start = cut
            await asyncio.sleep(0)

    def frame(self, conn: Conn, verb: Verb, job: str, kind: str = "frame", **kw: Any) -> bytes:
        seq = conn.next_seq()
        conn.sent.append(Sent(job, seq, kind))
        return encode_request(verb, job, seq, **kw)

    def new_job(self) -> str:
        self.jobs += 1
        return f"J{self.jobs}"

    async def run(self, step: Step) -> None:
        if step.action == "wait":
            await asyncio.sleep(step.args[0] / 1000)
            return
        conn = await self.conn(step.conn)
        data = b""
        if step.action in ("upload", "partial"):
            job = self.new_job()
            size = step.args[0]
            chunk_bytes, fault = step.args[1:] if step.action == "upload" else (128, "none")
            prep = split_payload(os.urandom(size), chunk_bytes=chunk_bytes)
            chunks = list(prep.chunks)
            if step.action == "partial":
                chunks = chunks[: len(chunks) - 1]
            elif fault == "hash":
                chunks[-1] = {**chunks[-1], "sha256": "0" * 64}
            elif fault == "skip" and len(chunks) > 1:
                del chunks[0]
            elif fault == "offset":
                chunks[0] = {**chunks[0], "offset": 1}
            data = self.frame(conn, Verb.SHARE, job, manifest=prep.manifest)
            for chunk in chunks:
                data += (last := self.frame(conn, Verb.SHARE, job, chunk=chunk))
            if chunks and step.action == "upload":
                conn.finals[job] = last
        elif step.action == "inline":
            job = self.new_job()
            text, good = step.args
            inline = {"data": text, "sha256": sha(text.encode()) if good else "0" * 64}
            data = self.frame(conn, Verb.SHARE, job, inline=inline)
            conn.finals[job] = data
        elif step.action == "retry":  # the same final frame again, with a fresh seq
            jobs = list(conn.finals)
            if not jobs:
                return
            job = jobs[step.args[0] % len(jobs)]
            frame = orjson.loads(conn.finals[job])
            frame["seq"] = conn.next_seq()
            conn.sent.append(Sent(job, frame["seq"], "frame"))
            data = orjson.dumps(frame) + b"\n"
        elif step.action == "garbage":
            data = step.args[0] + b"\n"
        elif step.action == "cancel":
            # The latest jobs first: those are the ones likely to be running or held.
            named = list(dict.fromkeys(s.job for s in reversed(conn.sent) if s.job[0] == "J"))
            pick = step.args[0]
            job = named[pick] if pick < len(named) else f"unknown{pick}"
            data = self.frame(conn, Verb.CANCEL, job, kind="cancel")
        elif step.action == "ping":
            data = self.frame(conn, Verb.PING, "ping")
        elif step.action == "half":
            frame = encode_request(Verb.PING, "half", conn.next_seq())
            await self.write(conn, frame[: step.args[0] % len(frame)])
            await self.disconnect(conn, "fin")
            return
        else:
            assert step.action == "disconnect"
            await self.disconnect(conn, step.args[0])
            return
        await self.write(conn, data, step.split)

    async def disconnect(self, conn: Conn, how: str) -> None:
        conn.closed_by_us = True
        if how == "rst":  # SO_LINGER 0: the close sends a RST, dropping what is unsent
            sock = conn.writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.writer.transport.abort()
        else:
            conn.writer.close()
        await asyncio.sleep(0)

    async def ping_all(self) -> None:
        waiting = []
        for conn in self.conns:
            if conn.usable:
                conn.writer.write(self.frame(conn, Verb.PING, f"quiet{conn.seq}"))
                waiting.append((conn, f"quiet{conn.seq - STEP_SEQ}"))
            elif not conn.closed_by_us:  # the server closed it: read what it sent first
                await eventually(conn.eof.is_set, "no EOF after the server closed")
        for conn, job in waiting:
            await eventually(conn.answered(job), "no answer to a ping")

    async def watch_cap(self) -> None:
        """The highest inflight seen between steps (the ledger's own peak covers the rest)."""
        while True:
            self.peak = max(self.peak, self.server.inflight)
            await asyncio.sleep(0.0005)


def check_answers(conn: Conn) -> None:
    """Every frame the client sent got its answer: exactly one (at most one on a connection
    that closed). An admitted job's terminal frame is the answer to the frame that completed
    its payload, so this is also "exactly one terminal frame per admitted job". (Per frame,
    not per job id: an id may be used again once its job has ended, as a retry of a finished
    job's final frame does.)"""
    answers: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for frame in conn.frames:
        if not is_connection_frame(frame) and frame.get("delta") is None:
            answers.setdefault((frame["job"], frame["seq"]), []).append(frame)
    for (job, seq), frames in answers.items():
        terminal = [f for f in frames if f["status"] in (Status.DONE, Status.ABORT)]
        assert len(terminal) <= 1, f"job {job!r} got {len(terminal)} terminal frames at {seq}"
    open_to_end = not conn.closed_by_us and not conn.eof.is_set()
    for sent in conn.sent:
        got = answers.get((sent.job, sent.seq + 1), []) + answers.get((sent.job, sent.seq + 2), [])
        if sent.kind == "cancel" or not open_to_end:
            assert len(got) <= 1, f"{sent}: {got}"
        else:
            assert len(got) == 1, f"{sent} got {len(got)} answers: {got}\nall: {conn.frames}"
        for frame in got:
            event(f"answer {frame['status']} {frame.get('need_code') or ''}".strip())


async def run_scenario(scenario: Scenario) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    config = Config(
        listen="127.0.0.1:0",
        runner="stub",
        stub_ms=scenario.stub_ms,
        max_inflight=CAP,
        max_line_bytes=MAX_LINE,
        max_jobs_per_conn=scenario.max_jobs_per_conn,
        held_payloads_per_conn=scenario.held_payloads_per_conn,
    )
    server = Server(config)
    await server.start(sock=sock)
    harness = Harness(server)
    watcher = asyncio.get_running_loop().create_task(harness.watch_cap())
    try:
        for step in scenario.script:
            await harness.run(step)
        # Quiet: a ping through each open connection (its answer comes after the server has
        # read everything before it), every job ended (so its terminal frame is written),
        # then a ping again (its answer comes after those frames).
        await harness.ping_all()
        await eventually(lambda: server.live_jobs == server.inflight == 0, "jobs still running")
        await harness.ping_all()
        assert server.inflight == 0
        for conn in harness.conns:
            check_answers(conn)
        for conn in harness.conns:
            if not conn.closed_by_us:
                await harness.disconnect(conn, "fin")
        await eventually(lambda: not server.connections, "connections still open")
        await eventually(lambda: server.buffered_bytes == 0, "payload bytes still buffered")
        assert (server.inflight, server.live_jobs) == (0, 0)
        assert harness.peak <= CAP
        assert server.ledger.peak_inflight <= CAP
        event(f"peak inflight {server.ledger.peak_inflight}")
    finally:
        watcher.cancel()
        for conn in harness.conns:
            conn.writer.transport.abort()
        tasks = [c.task for c in harness.conns if c.task is not None]
        await asyncio.gather(watcher, *tasks, return_exceptions=True)
        await server.close()
    for conn in harness.conns:  # a reply that broke the envelope fails the example here
        assert conn.task is not None
        if not conn.task.cancelled() and (exc := conn.task.exception()) is not None:
            raise exc


@fuzz_settings(300)
@given(scenario=scenarios)
def test_hostile_clients_against_a_real_server(scenario: Scenario) -> None:
    if scenario.loop == "uvloop":
        uvloop.run(run_scenario(scenario))
    else:
        asyncio.run(run_scenario(scenario))
