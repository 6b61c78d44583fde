"""``governor-cli``: ping a governor, or upload a file as one job.

Exit codes follow heptamini's client: ``ping`` exits 0 when the server is ready, 2 when it is
saturated (or draining), 1 on any error; ``upload`` exits 0 on ``confirm done``, 2 on ``confirm
abort``, 1 on ``need``, on retries spent while still refused, or on any error.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from protocol.codes import Receipt, Status
from protocol.frames import encode_reply

from .client import ClientError, RetryPolicy, connect

EXIT_OK, EXIT_ERROR, EXIT_REFUSED = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="governor-cli", description=__doc__.split("\n")[0])
    parser.add_argument("--addr", default="127.0.0.1:7777", help="governor HOST:PORT")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds for the whole call")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("ping", help="health probe: exit 0 ready, 2 saturated, 1 error")
    upload = commands.add_parser("upload", help="upload FILE as one job and print its outcome")
    upload.add_argument("file", type=Path, help="payload file, or - for standard input")
    upload.add_argument("--job", help="job id (default: generated)")
    upload.add_argument("--chunk-bytes", type=int, default=8192)
    upload.add_argument("--content-type", default="application/octet-stream")
    upload.add_argument("--ttl-ms", type=int, default=0, help="abort the job if it runs longer")
    upload.add_argument(
        "--max-attempts", type=int, default=10, help="admission attempts in all; 1 never retries"
    )
    upload.add_argument("--max-retry-ms", type=int, default=5000, help="cap on one retry's sleep")
    return parser


async def _ping(args: argparse.Namespace) -> int:
    async with await connect(args.addr, timeout=args.timeout) as client:
        reply = await client.ping(timeout=args.timeout)
    sys.stdout.buffer.write(encode_reply(reply))
    if reply.status != Status.OK:
        return EXIT_ERROR
    return {1: EXIT_OK, 0: EXIT_REFUSED}.get(reply.receipt(Receipt.HEALTH) or 0, EXIT_ERROR)


async def _upload(args: argparse.Namespace) -> int:
    data = sys.stdin.buffer.read() if str(args.file) == "-" else args.file.read_bytes()
    retry = RetryPolicy(max_attempts=args.max_attempts, max_sleep_s=args.max_retry_ms / 1000)
    async with await connect(args.addr, timeout=args.timeout) as client:
        result = await client.upload(
            data,
            job=args.job,
            chunk_bytes=args.chunk_bytes,
            content_type=args.content_type,
            ttl_ms=args.ttl_ms,
            retry=retry,
            timeout=args.timeout,
        )
    sys.stdout.buffer.write(encode_reply(result.reply))
    if result.yields:
        print(
            f"governor-cli: yielded {len(result.yields)} time(s) before this outcome",
            file=sys.stderr,
        )
    return {Status.DONE: EXIT_OK, Status.ABORT: EXIT_REFUSED}.get(result.status, EXIT_ERROR)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = _ping if args.command == "ping" else _upload
    try:
        return asyncio.run(command(args))
    except (ClientError, OSError, TimeoutError) as exc:
        print(f"governor-cli: {exc or type(exc).__name__}", file=sys.stderr)
        return EXIT_ERROR
