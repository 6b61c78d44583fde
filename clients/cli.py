"""``governor-cli``: ping a governor, upload a file as one job, or run a generation.

Exit codes follow heptamini's client: ``ping`` exits 0 when the server is ready, 2 when it is
saturated (or draining), 1 on any error; ``upload`` exits 0 on ``confirm done``, 2 on ``confirm
abort``, 1 on ``need``, on retries spent while still refused, or on any error.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from pathlib import Path

from protocol.codes import Receipt, Status
from protocol.frames import encode_reply
from protocol.spec import JobSpec, Message

from . import tls
from .client import ClientError, GovernorClient, RetryPolicy, connect

EXIT_OK, EXIT_ERROR, EXIT_REFUSED = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="governor-cli", description=__doc__.split("\n")[0])
    parser.add_argument("--addr", default="127.0.0.1:7777", help="governor HOST:PORT")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds for the whole call")
    tls.add_arguments(parser.add_argument_group("TLS (default: plain TCP)"))
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
    generate = commands.add_parser(
        "generate", help="run an inference job and print its text (needs the llama runner)"
    )
    generate.add_argument("prompt", help="the prompt, or with --chat the user's message")
    generate.add_argument("--chat", action="store_true", help="send it as a chat message")
    generate.add_argument("--system", help="with --chat: a system message first")
    generate.add_argument("--max-new-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.8)
    generate.add_argument("--top-p", type=float, default=0.95)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    generate.add_argument("--stream", action="store_true", help="print the text as it comes")
    generate.add_argument("--ttl-ms", type=int, default=0)
    generate.add_argument("--max-attempts", type=int, default=10)
    return parser


async def _connect(args: argparse.Namespace) -> GovernorClient:
    return await connect(
        args.addr,
        timeout=args.timeout,
        ssl=tls.context_from(args),
        server_hostname=args.tls_server_name,
    )


async def _ping(args: argparse.Namespace) -> int:
    async with await _connect(args) as client:
        reply = await client.ping(timeout=args.timeout)
    sys.stdout.buffer.write(encode_reply(reply))
    if reply.status != Status.OK:
        return EXIT_ERROR
    return {1: EXIT_OK, 0: EXIT_REFUSED}.get(reply.receipt(Receipt.HEALTH) or 0, EXIT_ERROR)


async def _upload(args: argparse.Namespace) -> int:
    data = sys.stdin.buffer.read() if str(args.file) == "-" else args.file.read_bytes()
    retry = RetryPolicy(max_attempts=args.max_attempts, max_sleep_s=args.max_retry_ms / 1000)
    async with await _connect(args) as client:
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


async def _generate(args: argparse.Namespace) -> int:
    if args.chat:
        messages = [Message("user", args.prompt)]
        if args.system:
            messages.insert(0, Message("system", args.system))
        spec = JobSpec(messages=tuple(messages))
    else:
        spec = JobSpec(prompt=args.prompt)
    spec = dataclasses.replace(
        spec,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
        stream=args.stream,
    )

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    async with await _connect(args) as client:
        result = await client.generate(
            spec,
            ttl_ms=args.ttl_ms,
            retry=RetryPolicy(max_attempts=args.max_attempts),
            timeout=args.timeout,
            on_delta=show if args.stream else None,
        )
    reply = result.reply
    if reply.status == Status.DONE and reply.result is not None:
        if not args.stream:
            show(str(reply.result.get("text", "")))
        print()
        r = reply.result
        print(
            f"governor-cli: {r.get('prompt_tokens')} prompt + {r.get('completion_tokens')} "
            f"generated tokens, finish {r.get('finish_reason')}, ttft {r.get('ttft_ms')} ms, "
            f"tpot {r.get('tpot_ms')} ms",
            file=sys.stderr,
        )
    else:
        sys.stdout.buffer.write(encode_reply(reply))
    return {Status.DONE: EXIT_OK, Status.ABORT: EXIT_REFUSED}.get(reply.status, EXIT_ERROR)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = {"ping": _ping, "upload": _upload, "generate": _generate}[args.command]
    try:
        return asyncio.run(command(args))
    except (ClientError, OSError, TimeoutError, ValueError) as exc:
        print(f"governor-cli: {exc or type(exc).__name__}", file=sys.stderr)
        return EXIT_ERROR
