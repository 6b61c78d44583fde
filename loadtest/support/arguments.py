"""The options several commands take with one meaning, each defined once here: its spelling,
type and default. Where the commands say it in their own words (``--threads``: whose threads),
the help is the command's; where they differ in the default, so is the default."""

from __future__ import annotations

import argparse
from pathlib import Path

from clients.helptext import add_renamed

from . import llama_server
from .options import positive_float, positive_int

# A parser or one of its groups: what ``add_argument`` is called on.
Options = argparse._ActionsContainer

MODEL_HELP = "a GGUF file (default: the embedded model)"
N_CTX = 2048


def add_model(parser: Options, text: str = MODEL_HELP) -> None:
    """``--model``: the GGUF file to load; none given, the embedded model."""
    parser.add_argument("--model", type=Path, help=text)


def add_threads(parser: Options, *, default: int, text: str) -> None:
    """``--threads``: llama.cpp's threads, of the servers the command starts."""
    parser.add_argument("--threads", type=positive_int, default=default, help=text)


def add_n_ctx(parser: Options, *, text: str, default: int = N_CTX) -> None:
    """``--n-ctx``: the context size of the model the command loads."""
    parser.add_argument("--n-ctx", type=positive_int, default=default, help=text)


def add_llama_server(parser: Options, *, text: str) -> None:
    """``--llama-server``: llama.cpp's ``llama-server`` binary, where the build script puts it
    unless given."""
    parser.add_argument(
        "--llama-server", type=Path, default=llama_server.default_binary(), help=text
    )


def add_round_timeout(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--round-timeout`` (once ``--timeout``, still taken): how long a round may take."""
    add_renamed(
        parser,
        "--timeout",
        parser.add_argument(
            "--round-timeout", type=positive_float, default=300.0, help="seconds a round may take"
        ),
    )


def add_quiet_wait(parser: Options, *, what: str) -> None:
    """``--wait-quiet`` and ``--attempts``: how long to wait, before each of ``what``, for other
    processes to leave the CPUs, and how many runs of a round others disturbed to try."""
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=120.0,
        help=f"seconds to wait at most, before each {what}, for other processes to leave the "
        "CPUs below 3%% busy; 0: start at once",
    )
    parser.add_argument(
        "--attempts",
        type=positive_int,
        default=3,
        help="runs of a round while others disturbed it; the least disturbed is kept",
    )
