"""The floor: the least a Python server on uvloop spends on one admitted job of ``burst.py``.

``python -m loadtest.support.floor --listen 127.0.0.1:P`` answers the two frames of ``burst.py``'s
admitted scenario and nothing else: a manifest with ``clarify ok``, its one chunk (decoded and
checked against its sha256 and the manifest's) with ``confirm done``, both as long as the
governor's replies (the same receipts, a result). No admission, no runner, no task, no metrics,
no log: the event loop, the two socket reads and writes, the JSON and the hash.
``loadtest bench peer --floor`` runs it beside the governor and heptaminid, so that the
governor's CPU time per job can be read against what is left once everything it decides is
taken away.

It is a measuring stick, not a server: anything else it is sent closes the connection.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
from typing import cast

import orjson
import uvloop

from protocol.lines import LineReader


def _receipts(inflight: int, executed: int, received: int) -> list[dict[str, object]]:
    return [
        {"kind": "server.health", "value_u64": 1},
        {"kind": "backend.inflight", "value_u64": inflight},
        {"kind": "backend.cap", "value_u64": 64},
        {"kind": "server.executed_total", "value_u64": executed},
        {"kind": "server.yielded_total", "value_u64": 0},
        {"kind": "cdr.bytes_in", "value_u64": received},
    ]


class Floor(asyncio.Protocol):
    executed = 0  # jobs done, over all connections

    def __init__(self) -> None:
        self.lines = LineReader(1 << 20)
        self.manifest_sha = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)

    def data_received(self, data: bytes) -> None:
        self.lines.feed(data)
        while (line := self.lines.next_line()) is not None:
            reply = self.answer(orjson.loads(line))
            if reply is None:
                self.transport.close()
                return
            self.transport.write(orjson.dumps(reply) + b"\n")

    def answer(self, frame: dict[str, object]) -> dict[str, object] | None:
        head = {"v": 0, "job": frame.get("job"), "seq": int(frame["seq"]) + 1}  # type: ignore[call-overload]
        manifest = frame.get("payload_manifest")
        if isinstance(manifest, dict):
            self.manifest_sha = manifest["sha256"]
            return {**head, "verb": "clarify", "status": "ok", "receipts": _receipts(0, 0, 0)}
        chunk = frame.get("payload_chunk")
        if not isinstance(chunk, dict):
            return None
        data = base64.b64decode(chunk["bytes_b64"], validate=True)
        sha = hashlib.sha256(data).hexdigest()
        if sha != chunk["sha256"] or sha != self.manifest_sha:
            return None
        Floor.executed += 1
        receipts = _receipts(1, Floor.executed, len(data))
        receipts.append({"kind": "cdr.backend.ms", "value_u64": 0})
        result = {"runner": "floor", "bytes": len(data), "sha256": sha}
        return {**head, "verb": "confirm", "status": "done", "receipts": receipts, "result": result}


async def serve(host: str, port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Floor, host, port)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.support.floor", description=__doc__)
    parser.add_argument("--listen", default="127.0.0.1:7790", help="HOST:PORT")
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    uvloop.run(serve(host, int(port)))


if __name__ == "__main__":
    main()
