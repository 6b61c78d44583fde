"""The codec's errors. Each one carries the reply it calls for.

    ProtocolError                 the peer sent something the protocol does not allow
    ├── RemoteProtocolError       ...a client's frame: the server answers it with a reply
    │   ├── BadLine               not a JSON object         clarify/need   bad_frame
    │   ├── EnvelopeInvalid       breaks an envelope rule   clarify/need   bad_envelope
    │   ├── UploadNeed            an upload problem         clarify/need   need_more
    │   │   └── ManifestInvalid   a manifest problem        clarify/need   need_manifest_fix
    │   └── LineTooLong           over max_line_bytes       confirm/abort  bad_frame, fatal
    └── ReplyInvalid              a server's reply a client cannot read

A ``RemoteProtocolError`` is never raised past the server's connection handler: it is turned
into exactly one reply frame (``protocol.frames.error_reply``), and only ``fatal`` ones close the
connection. Nothing else escapes the codec: the JSON parser's, base64's and hashlib's exceptions
are translated here.
"""

from __future__ import annotations

from .codes import ErrorCode, NeedCode, Status, Verb


class ProtocolError(Exception):
    """Base class of every error the codec raises."""


class RemoteProtocolError(ProtocolError):
    """A client's frame that the server must answer with ``need_code``/``error_code``."""

    verb: Verb = Verb.CLARIFY
    status: Status = Status.NEED
    error_code: ErrorCode = ErrorCode.BAD_FRAME
    fatal = False  # True: after the reply the connection is closed

    def __init__(self, need_code: NeedCode, detail: str) -> None:
        super().__init__(f"{need_code}: {detail}")
        self.need_code = need_code
        self.detail = detail


class BadLine(RemoteProtocolError):
    """The line is not a JSON object; ``need_code`` says what it looks like instead."""


class EnvelopeInvalid(RemoteProtocolError):
    error_code = ErrorCode.BAD_ENVELOPE

    def __init__(self, detail: str, *, job: str | None = None, seq: int | None = None) -> None:
        super().__init__(NeedCode.ENVELOPE_INVALID, detail)
        # The frame's own job and seq when they were valid, so the reply can name them.
        self.job = job
        self.seq = seq


class UploadNeed(RemoteProtocolError):
    error_code = ErrorCode.NEED_MORE


class ManifestInvalid(UploadNeed):
    error_code = ErrorCode.NEED_MANIFEST_FIX

    def __init__(self, detail: str) -> None:
        super().__init__(NeedCode.MANIFEST_INVALID, detail)


class LineTooLong(RemoteProtocolError):
    verb = Verb.CONFIRM
    status = Status.ABORT
    fatal = True

    def __init__(self, limit: int) -> None:
        super().__init__(NeedCode.LINE_TOO_LARGE, f"a line is longer than {limit} bytes")
        self.limit = limit


class ReplyInvalid(ProtocolError):
    """A line from the server that is not a valid reply frame."""
