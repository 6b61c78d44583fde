"""The v0 envelope: requests in, replies out, and the classifier for lines that are no frame.

A request line becomes a :class:`Request` through :func:`decode_request`, which applies every
envelope rule and raises :class:`BadLine` or :class:`EnvelopeInvalid` otherwise. Manifest and
chunk objects are checked by :mod:`protocol.upload`, since their problems get upload codes.
Replies are :class:`Reply` values, written by :func:`encode_reply` and read back by clients
with :func:`decode_reply`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from .codes import (
    CLIENT_VERBS,
    PROTOCOL_VERSION,
    SERVER_ONLY_FIELDS,
    UNKNOWN_JOB,
    NeedCode,
    Status,
    Verb,
)
from .errors import BadLine, EnvelopeInvalid, RemoteProtocolError, ReplyInvalid

U64_MAX = 2**64 - 1
MAX_ID_CHARS = 256  # job and payload ids are echoed in every reply, so they are bounded
MAX_WAIT_MS = 86_400_000  # a day: the server's own bound (max_wait) is far below it

_REQUEST_FIELDS = frozenset(
    {
        "v",
        "verb",
        "job",
        "seq",
        "ttl_ms",
        "payload_manifest",
        "payload_chunk",
        "payload_inline",
        "api_key",
        "max_wait_ms",
        "fleet_wide",
    }
)
_PAYLOADS = _MANIFEST, _CHUNK, _INLINE = ("payload_manifest", "payload_chunk", "payload_inline")
_VERBS = {str(verb): verb for verb in CLIENT_VERBS}  # (a dict look-up: Verb(...) is slower)

JSONObject = Mapping[str, Any]


def is_uint(value: object, maximum: int = U64_MAX) -> bool:
    """A JSON integer in ``[0, maximum]`` (booleans are not integers on the wire)."""
    return type(value) is int and 0 <= value <= maximum


def is_id(value: object) -> bool:
    return type(value) is str and 0 < len(value) <= MAX_ID_CHARS


@dataclass(slots=True)  # (not frozen, though never changed: governor/compiled.py)
class Request:
    """A client frame that passed every envelope rule."""

    verb: Verb
    job: str
    seq: int
    ttl_ms: int = 0
    manifest: JSONObject | None = None  # checked by protocol.upload
    chunk: JSONObject | None = None  # checked by protocol.upload
    inline: JSONObject | None = None  # extension: a whole payload in one frame
    api_key: str | None = None  # extension: the tenant's key
    max_wait_ms: int | None = None  # extension: a share may wait this long for its turn
    fleet_wide: bool | None = None  # extension: a share's client goes where `elsewhere` says


def decode_request(line: bytes) -> Request:
    """Parse one line (without its newline) into a :class:`Request`."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        raise BadLine(*classify_bad_line(line)) from None
    if type(obj) is not dict:
        if type(obj) is list:
            raise BadLine(NeedCode.JSON_ARRAY, "a JSON array; send one JSON object per line")
        raise BadLine(NeedCode.NOT_JSON, "a JSON value that is not an object")
    return _check_envelope(obj)


def _check_envelope(obj: dict[str, Any]) -> Request:
    job = obj.get("job")
    seq = obj.get("seq")
    # The frame's own job and seq, when valid, so that the reply to a bad frame can name them.
    ctx_job = job if is_id(job) else None
    ctx_seq = seq if type(seq) is int and 1 <= seq <= U64_MAX else None

    def invalid(detail: str) -> EnvelopeInvalid:
        return EnvelopeInvalid(detail, job=ctx_job, seq=ctx_seq)

    if not obj.keys() <= _REQUEST_FIELDS:  # (a subset test builds no set: every frame has one)
        unknown = obj.keys() - _REQUEST_FIELDS
        server_only = sorted(unknown & SERVER_ONLY_FIELDS)
        if server_only:
            raise invalid(f"a request must not set the server field {server_only[0]!r}")
        raise invalid(f"unknown field {sorted(unknown)[0]!r}")
    if obj.get("v") != PROTOCOL_VERSION or type(obj.get("v")) is not int:
        raise invalid(f"'v' must be {PROTOCOL_VERSION}")
    verb = obj.get("verb")
    if type(verb) is not str or verb not in CLIENT_VERBS:
        raise invalid(f"'verb' must be one of {sorted(map(str, CLIENT_VERBS))}")
    if ctx_job is None:
        raise invalid(f"'job' must be a non-empty string of at most {MAX_ID_CHARS} characters")
    if ctx_seq is None:
        raise invalid("'seq' must be an integer >= 1")
    ttl_ms = obj.get("ttl_ms", 0)
    if not is_uint(ttl_ms):
        raise invalid("'ttl_ms' must be a non-negative integer")
    manifest, chunk, inline = obj.get(_MANIFEST), obj.get(_CHUNK), obj.get(_INLINE)
    carried = (manifest is not None) + (chunk is not None) + (inline is not None)
    if verb != Verb.SHARE:
        if carried:
            raise invalid(f"a {verb} carries no payload")
    elif carried != 1:
        raise invalid(f"a share carries exactly one of {', '.join(map(repr, _PAYLOADS))}")
    else:
        value = manifest if manifest is not None else chunk if chunk is not None else inline
        if type(value) is not dict:
            name = _MANIFEST if manifest is not None else _CHUNK if chunk is not None else _INLINE
            raise invalid(f"{name!r} must be an object")
    api_key, max_wait_ms, fleet_wide = _extensions(obj, verb, invalid)
    return Request(
        _VERBS[verb],
        ctx_job,
        ctx_seq,
        ttl_ms,
        manifest,
        chunk,
        inline,
        api_key,
        max_wait_ms,
        fleet_wide,
    )


def _extensions(
    obj: dict[str, Any], verb: str, invalid: Callable[[str], EnvelopeInvalid]
) -> tuple[str | None, int | None, bool | None]:
    """The governor's own fields of a frame: its key, a share's wait for its turn, and whether
    its client goes to the replica a yield names."""
    api_key = obj.get("api_key")
    if api_key is not None and not is_id(api_key):
        raise invalid(f"'api_key' must be a non-empty string of at most {MAX_ID_CHARS} characters")
    max_wait_ms = obj.get("max_wait_ms")
    if max_wait_ms is not None:
        if verb != Verb.SHARE:
            raise invalid(f"a {verb} carries no 'max_wait_ms'")
        if not is_uint(max_wait_ms, MAX_WAIT_MS):
            raise invalid(f"'max_wait_ms' must be an integer from 0 to {MAX_WAIT_MS}")
    fleet_wide = obj.get("fleet_wide")
    if fleet_wide is not None:
        if verb != Verb.SHARE:
            raise invalid(f"a {verb} carries no 'fleet_wide'")
        if type(fleet_wide) is not bool:
            raise invalid("'fleet_wide' must be true or false")
    return api_key, max_wait_ms, fleet_wide


_HTTP_METHODS = tuple(
    m.encode() + b" "
    for m in ("GET", "POST", "PUT", "HEAD", "DELETE", "OPTIONS", "PATCH", "CONNECT", "TRACE", "PRI")
)


def classify_bad_line(line: bytes) -> tuple[NeedCode, str]:
    """What a line that is not a JSON object looks like, as a need code and a hint."""
    text = line.strip()
    if text.startswith(_HTTP_METHODS) or text.startswith(b"HTTP/"):
        return NeedCode.HTTP_REQUEST, "looks like HTTP; this port speaks newline-delimited JSON"
    if text.startswith((b"GIF87a", b"GIF89a")):
        return (
            NeedCode.BINARY_GIF,
            "looks like a GIF image; this port speaks newline-delimited JSON",
        )
    lowered = text[:16].lower()
    if lowered.startswith((b"<!doctype", b"<html")):
        return NeedCode.HTML_DOCUMENT, "looks like HTML; this port speaks newline-delimited JSON"
    if lowered.startswith((b"<?xml", b"<rss", b"<feed")):
        return NeedCode.XML_DOCUMENT, "looks like XML; this port speaks newline-delimited JSON"
    if text.startswith(b"["):
        return NeedCode.JSON_ARRAY, "a JSON array; send one JSON object per line"
    if text.startswith(b"{"):
        return NeedCode.JSON_MALFORMED, "starts like a JSON object but does not parse"
    return NeedCode.NOT_JSON, "not JSON; this port speaks newline-delimited JSON"


@dataclass(slots=True)  # (not frozen, though never changed: governor/compiled.py)
class Reply:
    """A server frame."""

    verb: Verb
    job: str
    seq: int
    status: Status
    ttl_ms: int = 0
    need_code: str | None = None
    error_code: str | None = None
    retry_hint_ms: int | None = None
    detail: str | None = None  # extension: a human-readable reason
    receipts: tuple[tuple[str, int], ...] = ()
    result: JSONObject | None = None  # extension: what a finished job produced
    delta: str | None = None  # extension: streamed output since the last frame
    elsewhere: str | None = None  # extension: a yield's HOST:PORT of a replica that is sooner

    @property
    def terminal(self) -> bool:
        """Done or abort: the job is over, and no further frame will name it."""
        return self.status in (Status.DONE, Status.ABORT)

    def receipt(self, kind: str) -> int | None:
        for k, value in self.receipts:
            if k == kind:
                return value
        return None


def encode_reply(reply: Reply) -> bytes:
    frame: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "verb": reply.verb,
        "job": reply.job,
        # A reply counts on from its request's seq, which may be the largest there is.
        "seq": min(reply.seq, U64_MAX),
        "ttl_ms": reply.ttl_ms,
        "status": reply.status,
    }
    if reply.need_code is not None:
        frame["need_code"] = reply.need_code
    if reply.retry_hint_ms is not None:
        frame["retry_hint_ms"] = reply.retry_hint_ms
    if reply.error_code is not None:
        frame["error_code"] = reply.error_code
    if reply.detail is not None:
        frame["detail"] = reply.detail
    if reply.receipts:
        frame["receipts"] = [{"kind": k, "value_u64": v} for k, v in reply.receipts]
    if reply.result is not None:
        frame["result"] = reply.result
    if reply.delta is not None:
        frame["delta"] = reply.delta
    if reply.elsewhere is not None:
        frame["elsewhere"] = reply.elsewhere
    return orjson.dumps(frame, option=orjson.OPT_APPEND_NEWLINE)


def error_reply(
    exc: RemoteProtocolError,
    job: str,
    seq: int,
    ttl_ms: int = 0,
    receipts: Iterable[tuple[str, int]] = (),
) -> Reply:
    """The one reply a remote protocol error calls for; ``seq`` is the reply's own."""
    return Reply(
        verb=exc.verb,
        job=job,
        seq=seq,
        status=exc.status,
        ttl_ms=ttl_ms,
        need_code=exc.need_code,
        error_code=exc.error_code,
        detail=exc.detail,
        receipts=tuple(receipts),
    )


def decode_reply(line: bytes) -> Reply:
    """Parse a server frame; raises :class:`ReplyInvalid` for anything else."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ReplyInvalid(f"reply is not JSON: {exc}") from None
    if type(obj) is not dict:
        raise ReplyInvalid("reply is not a JSON object")
    try:
        receipts = tuple((r["kind"], r["value_u64"]) for r in obj.get("receipts") or ())
        # (before they are a Reply's: its receipts are typed, and compiled code checks that)
        if any(type(k) is not str or not is_uint(v) for k, v in receipts):
            raise ReplyInvalid("reply breaks the envelope: receipts")
        reply = Reply(
            verb=Verb(obj["verb"]),
            job=obj["job"],
            seq=obj["seq"],
            status=Status(obj["status"]),
            ttl_ms=obj.get("ttl_ms", 0),
            need_code=obj.get("need_code"),
            error_code=obj.get("error_code"),
            retry_hint_ms=obj.get("retry_hint_ms"),
            detail=obj.get("detail"),
            receipts=receipts,
            result=obj.get("result"),
            delta=obj.get("delta"),
            elsewhere=obj.get("elsewhere"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ReplyInvalid(f"reply breaks the envelope: {exc!r}") from None
    if type(obj.get("v")) is not int or obj["v"] != PROTOCOL_VERSION:
        raise ReplyInvalid("reply breaks the envelope: 'v' must be 0")
    if not is_id(reply.job) or not is_uint(reply.seq) or not is_uint(reply.ttl_ms):
        raise ReplyInvalid("reply breaks the envelope: job, seq or ttl_ms")
    if reply.retry_hint_ms is not None and not is_uint(reply.retry_hint_ms):
        raise ReplyInvalid("reply breaks the envelope: retry_hint_ms")
    for name in ("need_code", "error_code", "detail", "delta", "elsewhere"):
        if not isinstance(getattr(reply, name), str | None):
            raise ReplyInvalid(f"reply breaks the envelope: {name}")
    if reply.result is not None and type(reply.result) is not dict:
        raise ReplyInvalid("reply breaks the envelope: result")
    return reply


def encode_request(
    verb: Verb,
    job: str,
    seq: int,
    *,
    ttl_ms: int = 0,
    manifest: JSONObject | None = None,
    chunk: JSONObject | None = None,
    inline: JSONObject | None = None,
    api_key: str | None = None,
    max_wait_ms: int | None = None,
    fleet_wide: bool | None = None,
) -> bytes:
    """A client frame, newline included. Does not validate: servers do."""
    frame: dict[str, Any] = {"v": PROTOCOL_VERSION, "verb": verb, "job": job, "seq": seq}
    frame["ttl_ms"] = ttl_ms
    if api_key is not None:
        frame["api_key"] = api_key
    if max_wait_ms is not None:
        frame["max_wait_ms"] = max_wait_ms
    if fleet_wide is not None:
        frame["fleet_wide"] = fleet_wide
    for name, value in zip(_PAYLOADS, (manifest, chunk, inline), strict=True):
        if value is not None:
            frame[name] = value
    return orjson.dumps(frame, option=orjson.OPT_APPEND_NEWLINE)


__all__ = [
    "UNKNOWN_JOB",
    "Reply",
    "Request",
    "classify_bad_line",
    "decode_reply",
    "decode_request",
    "encode_reply",
    "encode_request",
    "error_reply",
]
