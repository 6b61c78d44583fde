"""The governor's wire protocol, with no IO: bytes in, frames out, frames in, bytes out.

* :mod:`protocol.codes`: every verb, status, need/error code and receipt kind.
* :mod:`protocol.errors`: the error tree; each error knows its reply.
* :mod:`protocol.lines`: the bounded line reader.
* :mod:`protocol.frames`: the v0 envelope, its validation, and the bad-line classifier.
* :mod:`protocol.upload`: upload assembly with per-chunk and per-payload sha256 checks.
"""

from .codes import ErrorCode, NeedCode, Receipt, Status, Verb
from .errors import (
    BadLine,
    EnvelopeInvalid,
    LineTooLong,
    ManifestInvalid,
    ProtocolError,
    RemoteProtocolError,
    ReplyInvalid,
    UploadNeed,
)
from .frames import Reply, Request, decode_reply, decode_request, encode_reply, encode_request
from .lines import LineReader
from .upload import PreparedUpload, Upload, split_payload

__all__ = [
    "BadLine",
    "EnvelopeInvalid",
    "ErrorCode",
    "LineReader",
    "LineTooLong",
    "ManifestInvalid",
    "NeedCode",
    "PreparedUpload",
    "ProtocolError",
    "Receipt",
    "RemoteProtocolError",
    "Reply",
    "ReplyInvalid",
    "Request",
    "Status",
    "Upload",
    "UploadNeed",
    "Verb",
    "decode_reply",
    "decode_request",
    "encode_reply",
    "encode_request",
    "split_payload",
]
