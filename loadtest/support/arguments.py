"""The options several commands take with one meaning, each defined once here: its spelling,
type and default. Where the commands say it in their own words (``--threads``: whose threads),
the help is the command's; where they differ in the default, so is the default."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import llama_server
from .options import positive_int

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
