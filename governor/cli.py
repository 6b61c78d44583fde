"""``governor serve`` (flags map 1:1 onto :class:`governor.config.Config` fields),
``governor drain`` (a Kubernetes preStop hook's: drain a running daemon and wait for its jobs;
the SIGTERM that follows stops it), ``governor key-hash`` (a tenant's ``key_sha256`` line for an
API key) and ``governor model-path`` (the embedded model's file)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import getpass
import logging
import os
import resource
import secrets
import signal
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import orjson

from clients.helptext import DefaultsHelpFormatter, add_renamed, metavar
from protocol.frames import MAX_ID_CHARS

from . import __version__
from .config import (
    CLI_FIELDS,
    SECTIONS,
    Config,
    ConfigError,
    default_text,
    parse_address,
    section_fields,
    section_title,
)
from .core.tenants import key_sha256
from .runners import RunnerConfigError, RunnerStartError
from .runners.llama.runner import embedded_model_path
from .server import Server
from .telemetry import logs, memory

log = logging.getLogger("governor")


def _flag_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


_TYPES: dict[str, Callable[[str], Any]] = {
    "int": int,
    "float": float,
    "str": str,
    "str | None": str,
    "bool": _flag_bool,
}


DESCRIPTION = (
    "An ingress governor for LLM inference. 'governor serve' runs the daemon: its flags are the "
    "keys of its TOML config file, and override them. 'governor drain' asks a running daemon to "
    "drain and waits for its jobs to end (a Kubernetes preStop hook); SIGTERM then stops it. "
    "'governor key-hash' prints a tenant's key_sha256 line for an API key; 'governor "
    "model-path' the embedded model's file."
)

# The clients' variable (clients.apikey.ENV; the daemon does not import the clients).
API_KEY_ENV = "GOVERNOR_API_KEY"
NEW_KEY_BYTES = 32  # secrets.token_urlsafe: 43 characters, 256 random bits
KEY_HASH_DESCRIPTION = (
    f'Print the line a [[tenants]] table needs for an API key: key_sha256 = "<sha256 of the '
    f'key, hex>". The key is read from ${API_KEY_ENV}, else from standard input (its first '
    "line; on a terminal, a prompt that does not echo), never from the command line, where "
    "ps and the shell's history would show it; surrounding whitespace is dropped. With --new, "
    "a fresh random key is made instead and printed on the first line, the key_sha256 line on "
    "the second: the key is shown this once, the config keeps only its hash."
)


# Keys that name a file, and the texts a key's name does not describe.
_FILES = ("model", "fallback_model", "tls_cert", "tls_key", "tls_client_ca", "drain_token_file")
_TEXTS = {
    "trusted_sources": "CIDR[,CIDR...]",
    "fleet_fail_open": "LANES",
    "upstream_model": "NAME",
    "replica_id": "NAME",
}


def _metavar(f: dataclasses.Field[Any]) -> str:
    """What a flag takes, as its help shows it: its choices, true or false, a file, or what
    every CLI's options say (:func:`clients.helptext.metavar`: a unit, an address, N...)."""
    if f.metadata["choices"]:
        return "{" + ",".join(f.metadata["choices"]) + "}"
    if str(f.type) == "bool":
        return "{true,false}"
    if f.name in _FILES:
        return "FILE"
    if f.name in _TEXTS:
        return _TEXTS[f.name]
    return metavar(f.name, str(f.type), f.metadata["help"])


def _help(f: dataclasses.Field[Any]) -> str:
    """A flag's help: its key's text and its one default (argparse formats a help with %)."""
    return f"{f.metadata['help']} (default: {default_text(f)})".replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="governor", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"governor {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the daemon",
        description="Run the governor daemon. Its settings: the defaults, then the --config "
        "file's keys, then environment variables named GOVERNOR_ and the key in capitals "
        "(GOVERNOR_MAX_INFLIGHT=8), then these flags.",
    )
    serve.add_argument(
        "--config", type=Path, metavar="FILE", help="TOML file with the same keys as these flags"
    )
    for section in SECTIONS:
        group = serve.add_argument_group(section_title(section), section.__doc__)
        for f in section_fields(section):
            group.add_argument(
                "--" + f.name.replace("_", "-"),
                dest=f.name,
                type=_TYPES[str(f.type)],
                default=None,
                metavar=_metavar(f),
                help=_help(f),
            )
    _add_drain(commands)
    key_hash = commands.add_parser(
        "key-hash",
        help="print a tenant's key_sha256 line for an API key",
        description=KEY_HASH_DESCRIPTION,
    )
    key_hash.add_argument(
        "--new",
        action="store_true",
        help="make a new random key; print it, then its key_sha256 line",
    )
    commands.add_parser(
        "model-path",
        help="print the embedded model's GGUF file (for another server on the same model)",
    )
    return parser


def _add_drain(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``drain`` command and its options."""
    drain = commands.add_parser(
        "drain",
        help="drain a running daemon (for a preStop hook)",
        formatter_class=DefaultsHelpFormatter,
        description="Ask a running daemon to drain (POST /drain on its metrics_listen, from "
        "this host): its readiness fails and new jobs are told 'draining'. Then wait for its "
        "running jobs. Exit 0 once none runs, 1 if some still run after --wait seconds or on "
        "any error. The daemon keeps running, drained, until SIGTERM or SIGINT stops it (at "
        "once when no job runs): in Kubernetes the kubelet sends it when this preStop hook "
        "returns; by hand, send it yourself (systemctl stop, kill -TERM).",
    )
    listen = drain.add_argument(
        "--metrics-listen",
        default="127.0.0.1:9464",
        help="the daemon's metrics_listen address",
    )
    add_renamed(drain, "--metrics-addr", listen)
    drain.add_argument(
        "--wait",
        type=float,
        default=30.0,
        help="seconds to wait for running jobs",
    )
    drain.add_argument(
        "--token-file",
        type=Path,
        help="a file holding the daemon's drain token (its drain_token_file), sent as "
        "Authorization: Bearer TOKEN",
    )


def model_path() -> int:
    """``governor model-path``: the embedded model's file, or 1 when it is not installed."""
    try:
        print(embedded_model_path())
    except RunnerStartError as exc:
        print(f"governor: {exc}", file=sys.stderr)
        return 1
    return 0


def key_hash(new: bool) -> int:
    """``governor key-hash``: 0 with the line printed; 1 for a key no client could send."""
    if new:
        key = secrets.token_urlsafe(NEW_KEY_BYTES)
        print(key)
    else:
        try:
            key = _key_to_hash()
        except (ValueError, EOFError, OSError) as exc:  # ValueError: not UTF-8 text
            print(f"governor: key-hash: {exc or 'no key on standard input'}", file=sys.stderr)
            return 1
    print(f'key_sha256 = "{key_sha256(key)}"')
    return 0


def _key_to_hash() -> str:
    """``$GOVERNOR_API_KEY``, else standard input's first line; raises ValueError (never
    showing the key) for one that both doors would not take alike."""
    where = f"${API_KEY_ENV}"
    key = os.environ.get(API_KEY_ENV)
    if not key:
        where = "the key on standard input"
        if sys.stdin.isatty():
            key = getpass.getpass("API key (not echoed): ")
        else:
            key = sys.stdin.readline(4 * MAX_ID_CHARS)
    key = key.strip()
    if not key:
        raise ValueError(f"no key: set ${API_KEY_ENV} or give the key on standard input")
    if len(key) > MAX_ID_CHARS:
        raise ValueError(f"{where} is {len(key)} characters long; a key has at most {MAX_ID_CHARS}")
    # The TCP door hashes a key's UTF-8 bytes, the HTTP door reads its header as Latin-1, and
    # trims it: printable ASCII without spaces is the same key through both.
    if not all("!" <= c <= "~" for c in key):
        raise ValueError(
            f"{where} holds a space, a control or a non-ASCII character: a key is printable "
            "ASCII without spaces (governor key-hash --new makes one)"
        )
    return key


def drain(address: str, wait: float, token_file: Path | None = None) -> int:
    headers: dict[str, str] = {}
    try:
        host, port = parse_address(address, what="--metrics-listen", allow_port_zero=False)
        if token_file is not None:
            headers["Authorization"] = f"Bearer {_read_token(token_file)}"
    except ConfigError as exc:
        print(f"governor: {exc}", file=sys.stderr)
        return 1
    host = f"[{host}]" if ":" in host else host
    request = urllib.request.Request(
        f"http://{host}:{port}/drain?wait={wait:g}", method="POST", headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=wait + 10) as response:
            answer = orjson.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:  # ValueError: JSON, a header
        print(f"governor: drain failed: {exc}", file=sys.stderr)
        return 1
    print(orjson.dumps(answer).decode())
    if answer.get("drained"):
        print("governor: drained; SIGTERM now stops the daemon at once", file=sys.stderr)
        return 0
    return 1


def _read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--token-file {str(path)!r}: {exc}") from None
    if not token:
        raise ConfigError(f"--token-file {str(path)!r} is empty")
    return token


# Environment variables that set a key: the prefix and the key in capitals.
ENV_PREFIX = "GOVERNOR_"


def environment_values(environ: Mapping[str, str]) -> dict[str, Any]:
    """The keys set in the environment (``GOVERNOR_MAX_INFLIGHT=8``), each read as its flag
    reads its text. Other ``GOVERNOR_`` variables (a client's ``GOVERNOR_API_KEY``, the
    build's) name no key and are left alone."""
    values: dict[str, Any] = {}
    for f in CLI_FIELDS:
        name = ENV_PREFIX + f.name.upper()
        if name in environ:
            try:
                values[f.name] = _TYPES[str(f.type)](environ[name])
            except (ValueError, argparse.ArgumentTypeError) as exc:
                raise ConfigError(f"{name}: {exc}") from None
    return values


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] = {}) -> Config:
    """The settings: the defaults, then the --config file's keys, then the environment's
    ``GOVERNOR_`` variables, then the flags."""
    overrides: dict[str, Any] = {
        **environment_values(environ),
        **{f.name: getattr(args, f.name) for f in CLI_FIELDS if getattr(args, f.name) is not None},
    }
    if args.config is not None:
        return Config.load(args.config, overrides)
    return Config.from_mapping(overrides, source="flags")


def _raise_fd_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < wanted:
            log.warning(
                "open-file limit %d is below max_connections + 64; raise it (ulimit -n)", new
            )


async def serve(config: Config) -> int:
    try:
        server = Server(config)
        await server.start()
    except RunnerConfigError as exc:  # a setting the model cannot honour (n_ctx, say)
        log.error("cannot start the %s runner: %s", config.runner, exc)
        return 2
    except RunnerStartError as exc:
        log.error("cannot start the %s runner: %s", config.runner, exc)
        return 1
    except ConfigError as exc:  # a file the config names, read at start (TLS, drain token)
        log.error("%s", exc)
        return 2
    # What exists now (the modules, the runner, the configuration) lives as long as the daemon:
    # out of the cyclic collector's sight, so that its full collections walk only what the
    # connections made (walking it all took 4 % of a burst's CPU). Here, not in Server.start:
    # a process that starts many servers (the tests) would keep each one's garbage for good.
    gc.freeze()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if not stop.is_set():
            if server.draining:  # (POST /drain began it: this is the stop that follows)
                log.info("%s: stopping the drained daemon (a second signal forces exit)", name)
            else:
                log.info("%s: draining, then stopping (a second signal forces exit)", name)
            server.begin_drain(name)  # readiness fails from this moment
            stop.set()
        else:
            log.warning("%s again: aborting running jobs now", name)
            server.force()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await stop.wait()
        aborted = await server.drain()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    log.info("stopped (%d job(s) aborted at shutdown)", aborted)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "drain":
        return drain(args.metrics_listen, args.wait, args.token_file)
    if args.command == "key-hash":
        return key_hash(args.new)
    if args.command == "model-path":
        return model_path()
    try:
        config = config_from_args(args, os.environ)
    except ConfigError as exc:
        print(f"governor: {exc}", file=sys.stderr)
        return 2
    stop_logging = logs.configure(config.log_level, config.log_format)
    _raise_fd_limit(config.max_connections + 64)
    memory.keep_large_blocks_mapped()
    import uvloop

    try:
        return uvloop.run(serve(config))
    except OSError as exc:  # the listen address is taken or not ours
        log.error("cannot serve: %s", exc)
        return 1
    finally:
        stop_logging()
