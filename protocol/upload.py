"""Upload assembly: a manifest, then chunks in order, each verified as it arrives.

Every chunk is checked against its own sha256 before it is kept, the running size against
the manifest and the payload cap, and the whole payload against the manifest's sha256 when
the last chunk lands. Problems raise :class:`UploadNeed` with the v0 need code; the upload
keeps its state, so the client can send the right frame next.

:func:`split_payload` is the sending side, shared by the clients and the tests.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from .codes import NeedCode
from .errors import ManifestInvalid, UploadNeed
from .frames import MAX_ID_CHARS, is_id, is_uint

DEFAULT_MAX_PAYLOAD_BYTES = 50 * 1024 * 1024
DEFAULT_MAX_CHUNKS = 65536
_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")
_MANIFEST_FIELDS = frozenset(
    {
        "payload_id",
        "content_type",
        "content_encoding",
        "cipher",
        "total_bytes",
        "chunk_bytes",
        "chunks",
        "sha256",
    }
)
_CHUNK_FIELDS = frozenset({"payload_id", "index", "offset", "sha256", "bytes_b64"})
_INLINE_FIELDS = frozenset({"content_type", "sha256", "data"})
INLINE_PAYLOAD_ID = "inline"


@dataclass(slots=True)  # (not frozen, though never changed: governor/compiled.py)
class Manifest:
    payload_id: str
    content_type: str
    total_bytes: int
    chunk_bytes: int
    chunks: int
    sha256: str  # lower-case hex

    @classmethod
    def from_wire(
        cls,
        obj: Mapping[str, Any],
        max_payload_bytes: int,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
    ) -> Manifest:
        unknown = obj.keys() - _MANIFEST_FIELDS
        if unknown:
            raise ManifestInvalid(f"unknown manifest field {sorted(unknown)[0]!r}")
        payload_id = obj.get("payload_id")
        if not is_id(payload_id):
            raise ManifestInvalid(
                f"'payload_id' must be a non-empty string of at most {MAX_ID_CHARS} characters"
            )
        content_type = obj.get("content_type", "application/octet-stream")
        if type(content_type) is not str or len(content_type) > MAX_ID_CHARS:
            raise ManifestInvalid("'content_type' must be a short string")
        if obj.get("content_encoding", "identity") not in ("", "identity"):
            raise ManifestInvalid("'content_encoding' must be 'identity'")
        if obj.get("cipher", "none") not in ("", "none"):
            raise ManifestInvalid("'cipher' must be 'none'")
        for name in ("total_bytes", "chunk_bytes", "chunks"):
            if not is_uint(obj.get(name)):
                raise ManifestInvalid(f"{name!r} must be a non-negative integer")
        total, chunk_bytes, chunks = obj["total_bytes"], obj["chunk_bytes"], obj["chunks"]
        if chunk_bytes == 0 or chunks == 0:
            raise ManifestInvalid("'chunk_bytes' and 'chunks' must be at least 1")
        if chunks > max_chunks:
            raise ManifestInvalid(f"{chunks} chunks is over the limit of {max_chunks}")
        if total > chunk_bytes * chunks:
            raise ManifestInvalid("'total_bytes' does not fit in 'chunks' of 'chunk_bytes'")
        if total > max_payload_bytes:
            raise ManifestInvalid(
                f"payload of {total} bytes is over the cap of {max_payload_bytes}"
            )
        digest = obj.get("sha256")
        if type(digest) is not str or not _SHA256_HEX.fullmatch(digest):
            raise ManifestInvalid("'sha256' must be the payload's sha256 as 64 hex digits")
        # (cast: is_id/is_uint checked these, but bool checks do not narrow the type.)
        return cls(cast(str, payload_id), content_type, total, chunk_bytes, chunks, digest.lower())


@dataclass(slots=True)  # (not frozen, though never changed: governor/compiled.py)
class Chunk:
    payload_id: str
    index: int
    offset: int
    sha256: str
    bytes_b64: str

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> Chunk:
        unknown = obj.keys() - _CHUNK_FIELDS
        if unknown:
            raise UploadNeed(NeedCode.CHUNK_INVALID, f"unknown chunk field {sorted(unknown)[0]!r}")
        payload_id, index, offset = obj.get("payload_id"), obj.get("index"), obj.get("offset", 0)
        digest, data = obj.get("sha256"), obj.get("bytes_b64")
        if not is_id(payload_id):
            raise UploadNeed(NeedCode.CHUNK_INVALID, "'payload_id' must be a non-empty string")
        if not is_uint(index) or not is_uint(offset):
            raise UploadNeed(
                NeedCode.CHUNK_INVALID, "'index' and 'offset' must be non-negative integers"
            )
        if type(digest) is not str:
            raise UploadNeed(NeedCode.CHUNK_INVALID, "'sha256' must be a hex string")
        if type(data) is not str:
            raise UploadNeed(NeedCode.CHUNK_B64_INVALID, "'bytes_b64' must be a base64 string")
        return cls(cast(str, payload_id), cast(int, index), offset, digest, data)

    def decode(self, limit: int) -> bytes:
        """The chunk's bytes, refused when not base64, then when longer than ``limit``.

        heptamini checks in that order, so a string both over-long and not base64 is
        ``chunk_b64_invalid``. Decoding an over-long string first costs no more than the line
        that carried it (``max_line_bytes``) allows.
        """
        try:
            data = binascii.a2b_base64(self.bytes_b64, strict_mode=True)  # (b64decode's own)
        except (binascii.Error, ValueError):
            raise UploadNeed(
                NeedCode.CHUNK_B64_INVALID, f"chunk {self.index}: 'bytes_b64' is not base64"
            ) from None
        if len(data) > limit:
            raise UploadNeed(NeedCode.CHUNK_TOO_LARGE, f"chunk {self.index} is over {limit} bytes")
        return data


def _digest_matches(data: bytes, declared: str) -> bool:
    return hashlib.sha256(data).hexdigest() == declared.strip().lower()


class Upload:
    """One job's upload, from its manifest to its verified payload.

    :meth:`apply_chunk` returns the payload once the last chunk has verified. After that the
    upload stays complete and :meth:`is_final_chunk_again` recognises a resend of that same
    last chunk, which is how a client retries admission after a ``yield``.

    Chunks are appended to one ``bytearray``: what an upload holds is its bytes, however small
    its chunks (a list of 2-byte ``bytes`` objects would cost 35 bytes of headers for each).
    """

    __slots__ = (
        "_chunks",
        "_data",
        "_final",
        "_hash",
        "_payload",
        "manifest",
        "max_chunks",
        "max_payload_bytes",
    )

    def __init__(
        self,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
    ) -> None:
        self.max_payload_bytes = max_payload_bytes
        self.max_chunks = max_chunks
        self.manifest: Manifest | None = None
        self._reset()

    def _reset(self) -> None:
        self._data = bytearray()
        self._chunks = 0
        self._payload = b""
        self._hash = hashlib.sha256()
        self._final: Chunk | None = None

    @property
    def bytes_received(self) -> int:
        return len(self._payload) if self._final is not None else len(self._data)

    @property
    def chunks_received(self) -> int:
        return self._chunks

    @property
    def complete(self) -> bool:
        return self._final is not None

    def apply_manifest(self, obj: Mapping[str, Any]) -> Manifest:
        """Start (or restart) the upload; raises :class:`ManifestInvalid`."""
        manifest = Manifest.from_wire(obj, self.max_payload_bytes, self.max_chunks)
        self._reset()
        self.manifest = manifest
        return manifest

    def apply_chunk(self, obj: Mapping[str, Any]) -> bytes | None:
        """Take the next chunk; returns the whole payload when this one completes it."""
        manifest = self.manifest
        if manifest is None:
            raise UploadNeed(NeedCode.MANIFEST_MISSING, "send 'payload_manifest' first")
        chunk = Chunk.from_wire(obj)
        if chunk.payload_id != manifest.payload_id:
            raise UploadNeed(
                NeedCode.PAYLOAD_ID_MISMATCH,
                f"chunk is for payload {chunk.payload_id!r}, the manifest for "
                f"{manifest.payload_id!r}",
            )
        expected = self._chunks
        if self.complete or chunk.index != expected:
            detail = (
                "the payload is complete; send a new manifest"
                if self.complete
                else f"expected chunk index {expected}"
            )
            raise UploadNeed(NeedCode.CHUNK_EXPECTED_INDEX, detail)
        received = len(self._data)
        if chunk.offset != received:
            raise UploadNeed(NeedCode.CHUNK_OFFSET_MISMATCH, f"expected chunk offset {received}")
        data = chunk.decode(manifest.chunk_bytes)
        if received + len(data) > manifest.total_bytes:
            raise UploadNeed(
                NeedCode.PAYLOAD_TOO_LARGE,
                f"chunks add up to more than the declared {manifest.total_bytes} bytes",
            )
        digest = hashlib.sha256(data).hexdigest()
        if digest != chunk.sha256.strip().lower():
            raise UploadNeed(NeedCode.CHUNK_HASH_MISMATCH, f"chunk {chunk.index}: sha256 mismatch")
        self._data += data
        self._chunks += 1
        if manifest.chunks > 1:  # (a payload of one chunk is that chunk: its digest is known)
            self._hash.update(data)
        if self._chunks < manifest.chunks:
            return None
        # The last chunk: the payload is verified whole, or the upload starts over.
        received = len(self._data)
        if received != manifest.total_bytes:
            self._restart()
            raise UploadNeed(
                NeedCode.PAYLOAD_SIZE_MISMATCH,
                f"received {received} bytes, the manifest declared {manifest.total_bytes}; "
                "send a new manifest",
            )
        if (digest if manifest.chunks == 1 else self._hash.hexdigest()) != manifest.sha256:
            self._restart()
            raise UploadNeed(
                NeedCode.PAYLOAD_HASH_MISMATCH, "payload sha256 mismatch; send a new manifest"
            )
        self._final = chunk
        self._payload, self._data = bytes(self._data), bytearray()
        return self._payload

    def apply_inline(self, obj: Mapping[str, Any]) -> bytes:
        """A whole payload in one frame (*ext*): UTF-8 ``data`` checked against ``sha256``."""
        unknown = obj.keys() - _INLINE_FIELDS
        if unknown:
            raise UploadNeed(NeedCode.INLINE_INVALID, f"unknown field {sorted(unknown)[0]!r}")
        data, digest = obj.get("data"), obj.get("sha256")
        content_type = obj.get("content_type", "application/octet-stream")
        if type(data) is not str:
            raise UploadNeed(NeedCode.INLINE_INVALID, "'data' must be a string")
        if type(digest) is not str or not _SHA256_HEX.fullmatch(digest):
            raise UploadNeed(NeedCode.INLINE_INVALID, "'sha256' must be 64 hex digits")
        if type(content_type) is not str or len(content_type) > MAX_ID_CHARS:
            raise UploadNeed(NeedCode.INLINE_INVALID, "'content_type' must be a short string")
        payload = data.encode()
        if len(payload) > self.max_payload_bytes:
            raise UploadNeed(
                NeedCode.PAYLOAD_TOO_LARGE, f"over the payload cap of {self.max_payload_bytes}"
            )
        if not _digest_matches(payload, digest):
            raise UploadNeed(
                NeedCode.PAYLOAD_HASH_MISMATCH, "sha256 of the UTF-8 bytes of 'data' mismatch"
            )
        self._reset()
        size = len(payload)
        self.manifest = Manifest(
            INLINE_PAYLOAD_ID, content_type, size, max(size, 1), 1, digest.lower()
        )
        self._payload = payload
        self._final = Chunk(INLINE_PAYLOAD_ID, 0, 0, digest.lower(), "")
        return payload

    def _restart(self) -> None:
        """Forget the manifest too: the client must start over."""
        self._reset()
        self.manifest = None

    def is_final_chunk_again(self, obj: Mapping[str, Any]) -> bool:
        """Whether ``obj`` is the identical last chunk of this complete upload."""
        if self._final is None:
            return False
        try:
            return Chunk.from_wire(obj) == self._final
        except UploadNeed:
            return False

    @property
    def payload(self) -> bytes:
        """The verified payload of a complete upload."""
        if self._final is None:
            raise RuntimeError("the upload is not complete")
        return self._payload


@dataclass(frozen=True, slots=True)
class PreparedUpload:
    """What a client sends for one payload: its manifest and chunks as wire objects."""

    manifest: dict[str, Any]
    chunks: tuple[dict[str, Any], ...]


def split_payload(
    payload: bytes,
    *,
    payload_id: str = "P_1",
    chunk_bytes: int = 8192,
    content_type: str = "application/octet-stream",
) -> PreparedUpload:
    """Manifest and chunks for ``payload``; an empty payload is one empty chunk."""
    if chunk_bytes < 1:
        raise ValueError("chunk_bytes must be at least 1")
    pieces = [payload[i : i + chunk_bytes] for i in range(0, len(payload), chunk_bytes)] or [b""]
    manifest = {
        "payload_id": payload_id,
        "content_type": content_type,
        "content_encoding": "identity",
        "cipher": "none",
        "total_bytes": len(payload),
        "chunk_bytes": chunk_bytes,
        "chunks": len(pieces),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    chunks = tuple(
        {
            "payload_id": payload_id,
            "index": i,
            "offset": i * chunk_bytes,
            "sha256": hashlib.sha256(piece).hexdigest(),
            "bytes_b64": base64.b64encode(piece).decode("ascii"),
        }
        for i, piece in enumerate(pieces)
    )
    return PreparedUpload(manifest, chunks)
