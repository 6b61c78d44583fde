"""``governor-cli``: ping a governor, upload a file as one job, or run a generation.

Exit codes follow heptamini's client: ``ping`` exits 0 when the server is ready, 2 when it is
saturated (or draining), 1 on any error; ``upload`` exits 0 on ``confirm done``, 2 on ``confirm
abort``, 1 on ``need``, on retries spent while still refused, or on any error.

Several ``--addr`` (repeated, or comma-separated), or one name that resolves to several
addresses, are replicas of one service: jobs go through :class:`clients.fleet.FleetClient`,
which picks the less loaded of two, and goes elsewhere on a yield. ``ping`` then pings every
replica, prints each reply, and exits 0 when any is ready, 2 when all that answered are
saturated or draining, 1 when none answered.

To a governor with ``[[tenants]]`` declared, jobs carry the tenant's API key, read from
``GOVERNOR_API_KEY`` (or ``--api-key``, which shows in ``ps``), or the connection shows a client
certificate (``--tls-cert``). A job refused ``unauthorized`` is a ``confirm abort`` like any
other (exit 2), with a line on standard error saying what to give. A ping needs no key: a
governor answers it the same either way. The key is never printed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from protocol.codes import NeedCode, Receipt, Status
from protocol.frames import Reply, encode_reply
from protocol.spec import JobSpec, Message

from . import apikey, tls
from .client import (
    DEFAULT_MAX_WAIT_S,
    ClientError,
    GovernorClient,
    RetryPolicy,
    UploadResult,
    connect,
)
from .fleet import FleetClient, FleetResult, Replicas, resolve, split_addresses
from .helptext import HelpParser

EXIT_OK, EXIT_ERROR, EXIT_REFUSED = 0, 1, 2
DEFAULT_ADDR = "127.0.0.1:7777"
WAIT_PAUSE_S = 0.25  # between two pings of ping --wait
TIMEOUT_S, GENERATE_TIMEOUT_S = 20.0, 120.0  # --timeout's defaults: a call, a generation
SPEC = JobSpec(prompt="")  # its defaults are the options'
RETRY = RetryPolicy()


def build_parser() -> argparse.ArgumentParser:
    parser = HelpParser(prog="governor-cli", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--addr",
        action="append",
        metavar="HOST:PORT[,HOST:PORT...]",
        help=f"governor HOST:PORT (default: {DEFAULT_ADDR}); several (repeated or "
        "comma-separated), or a name that resolves to several addresses, are replicas: jobs "
        "go to the less loaded and move on a yield",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        help="seconds for the whole call (default: 120 for generate, a generation on a busy CPU; "
        "20 otherwise)",
    )
    apikey.add_arguments(parser)
    tls.add_arguments(parser.add_argument_group("TLS (default: plain TCP)"))
    commands = parser.add_subparsers(dest="command", required=True, parser_class=HelpParser)
    ping = commands.add_parser("ping", help="health probe: exit 0 ready, 2 saturated, 1 error")
    ping.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="ping again until the governor is ready or SECONDS pass (a daemon still "
        "starting: its port not yet open, its model loading); the exit is the last ping's; "
        "0: one ping",
    )
    upload = commands.add_parser("upload", help="upload FILE as one job and print its outcome")
    upload.add_argument("file", type=Path, help="payload file, or - for standard input")
    upload.add_argument("--job", help="job id (default: generated)")
    upload.add_argument("--chunk-bytes", type=int, default=8192, help="bytes in each chunk")
    upload.add_argument(
        "--content-type", default="application/octet-stream", help="the payload's media type"
    )
    _add_job_arguments(upload)
    upload.add_argument(
        "--max-retry-ms",
        type=int,
        default=round(RETRY.max_sleep_s * 1000),
        help="cap on one retry's sleep",
    )
    _add_generate(commands)
    return parser


def _add_generate(commands: argparse._SubParsersAction[HelpParser]) -> None:
    """The ``generate`` command and its options."""
    generate = commands.add_parser(
        "generate", help="run an inference job and print its text (the llama or http runner)"
    )
    generate.add_argument("prompt", help="the prompt, or with --chat the user's message")
    generate.add_argument("--chat", action="store_true", help="send it as a chat message")
    generate.add_argument("--system", help="with --chat: a system message first")
    generate.add_argument(
        "--max-new-tokens",
        type=int,
        default=SPEC.max_new_tokens,
        help="the most tokens to generate",
    )
    generate.add_argument(
        "--temperature", type=float, default=SPEC.temperature, help="sampling temperature, 0 to 2"
    )
    generate.add_argument(
        "--top-p",
        type=float,
        default=SPEC.top_p,
        help="sample among the likeliest tokens whose probabilities add up to this (above 0, "
        "at most 1)",
    )
    generate.add_argument(
        "--seed", type=int, help="sampling seed, for a repeatable text (default: a random one)"
    )
    generate.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    generate.add_argument("--stream", action="store_true", help="print the text as it comes")
    _add_job_arguments(generate)


def _add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``upload`` and ``generate`` share: the job's time limit and its retries."""
    parser.add_argument(
        "--ttl-ms",
        type=int,
        default=0,
        help="milliseconds the job may run once admitted before it is aborted; 0: no limit",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=RETRY.max_attempts,
        help="admission attempts in all; 1 never retries",
    )
    parser.add_argument(
        "--max-wait",
        type=float,
        default=DEFAULT_MAX_WAIT_S,
        metavar="SECONDS",
        help="seconds the job may wait on the governor for its turn when every slot is taken "
        "(within --timeout and the server's max_wait), instead of coming back on a hint; "
        "0: a yield at once (plain v0, as heptamini's daemon wants); with several replicas "
        "the job goes to another replica instead of waiting",
    )


async def _connect(args: argparse.Namespace) -> GovernorClient | FleetClient:
    """One connection for one governor; a :class:`FleetClient` for several replicas."""
    texts = split_addresses(args.addr or [DEFAULT_ADDR])
    ssl = tls.context_from(args)
    key = apikey.key_from(args)
    async with asyncio.timeout(args.timeout):
        found = await resolve(texts)
    if len(found) == 1:  # (one name, connected to as given: it may have a v4 and a v6 address)
        only = texts[0] if len(texts) == 1 else found[0].name
        return await connect(
            only, timeout=args.timeout, api_key=key, ssl=ssl, server_hostname=args.tls_server_name
        )
    return FleetClient(
        Replicas(found),
        targets=texts,
        api_key=key,
        ssl=ssl,
        server_hostname=args.tls_server_name,
        connect_timeout=args.timeout,
    )


def _max_wait(client: GovernorClient | FleetClient, args: argparse.Namespace) -> float | None:
    """The wait a job asks for on one governor (a fleet's client goes elsewhere instead)."""
    return args.max_wait if isinstance(client, GovernorClient) and args.max_wait > 0 else None


def _health_exit(reply: Reply) -> int:
    if reply.status != Status.OK:
        return EXIT_ERROR
    return {1: EXIT_OK, 0: EXIT_REFUSED}.get(reply.receipt(Receipt.HEALTH) or 0, EXIT_ERROR)


async def _ping(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + args.wait
    while True:
        try:
            code = await _ping_once(args)
        except (OSError, ClientError, TimeoutError):
            if loop.time() >= deadline:
                raise
        else:
            if code == EXIT_OK or loop.time() >= deadline:
                return code
        await asyncio.sleep(WAIT_PAUSE_S)


async def _ping_once(args: argparse.Namespace) -> int:
    async with await _connect(args) as client:
        if isinstance(client, FleetClient):
            return await _ping_fleet(client, args.timeout)
        reply = await client.ping(timeout=args.timeout)
    sys.stdout.buffer.write(encode_reply(reply))
    return _health_exit(reply)


async def _ping_fleet(fleet: FleetClient, timeout: float) -> int:
    """Every replica's reply on stdout, one line each, in address order."""
    exits = []
    for name, reply in (await fleet.ping_all(timeout=timeout)).items():
        if isinstance(reply, Exception):
            print(f"governor-cli: {name}: {reply or type(reply).__name__}", file=sys.stderr)
            exits.append(EXIT_ERROR)
            continue
        sys.stdout.buffer.write(encode_reply(reply))
        exits.append(_health_exit(reply))
    if EXIT_OK in exits:
        return EXIT_OK
    return EXIT_REFUSED if EXIT_REFUSED in exits else EXIT_ERROR


def _note_unauthorized(reply: Reply, args: argparse.Namespace) -> None:
    """On stderr, for a job refused ``unauthorized``: what to give (never the key itself)."""
    if reply.need_code == NeedCode.UNAUTHORIZED:
        given = apikey.key_from(args) is not None
        print(f"governor-cli: unauthorized: {apikey.unauthorized_hint(given)}", file=sys.stderr)


def _note_replicas(result: UploadResult) -> None:
    """On stderr, for a job over several replicas: where it went."""
    if isinstance(result, FleetResult) and len(result.tried) > 1:
        print(f"governor-cli: tried {' -> '.join(result.tried)}", file=sys.stderr)


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
            max_wait=_max_wait(client, args),
        )
    sys.stdout.buffer.write(encode_reply(result.reply))
    if result.yields:
        print(
            f"governor-cli: yielded {len(result.yields)} time(s) before this outcome",
            file=sys.stderr,
        )
    _note_replicas(result)
    _note_unauthorized(result.reply, args)
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
            max_wait=_max_wait(client, args),
        )
    reply = result.reply
    _note_replicas(result)
    if reply.status == Status.DONE and reply.result is not None:
        if not args.stream:
            show(str(reply.result.get("text", "")))
        print()
        print(f"governor-cli: {summary(reply.result)}", file=sys.stderr)
    else:
        sys.stdout.buffer.write(encode_reply(reply))
        _note_unauthorized(reply, args)
    return {Status.DONE: EXIT_OK, Status.ABORT: EXIT_REFUSED}.get(reply.status, EXIT_ERROR)


def summary(result: Mapping[str, Any]) -> str:
    """A finished generation's counts and pace, for people. A count the runner did not report
    (the ``http`` runner's prompt, behind an upstream that sends no usage in its stream) is
    said to be unknown, and a count taken from the stream's chunks says so."""
    prompt, completion = result.get("prompt_tokens"), result.get("completion_tokens")
    if prompt is None:
        counts = "prompt tokens not reported by the upstream + "
    else:
        counts = f"{prompt} prompt + "
    counts += f"{completion} generated tokens"
    if result.get("counted") == "chunks":
        counts += " (counted from the streamed chunks)"
    parts = [counts, f"finish {result.get('finish_reason')}"]
    parts += [
        f"{name} {result[key]} ms"
        for name, key in (("ttft", "ttft_ms"), ("tpot", "tpot_ms"))
        if result.get(key) is not None
    ]
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.timeout is None:
        args.timeout = GENERATE_TIMEOUT_S if args.command == "generate" else TIMEOUT_S
    command = {"ping": _ping, "upload": _upload, "generate": _generate}[args.command]
    try:
        return asyncio.run(command(args))
    except (ClientError, OSError, TimeoutError, ValueError) as exc:
        print(f"governor-cli: {exc or type(exc).__name__}", file=sys.stderr)
        return EXIT_ERROR
