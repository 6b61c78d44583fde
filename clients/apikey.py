"""The API key for clients: ``--api-key`` and ``GOVERNOR_API_KEY``, read one way.

``governor-cli`` and ``python -m loadtest`` take the same option (:func:`add_arguments`) and
read the key with :func:`key_from`: the flag when given, else the environment variable (set
but empty counts as unset). The environment is the safer of the two: a flag shows in ``ps``
and in the shell's history. To a governor with ``[[tenants]]`` declared the key names the
tenant: it goes as ``api_key`` on each job's first frame and on pings (TCP), or as
``Authorization: Bearer KEY`` (HTTP). A client certificate (``--tls-cert``) may name the
tenant instead.

No message, report or repr here shows the key.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from protocol.frames import MAX_ID_CHARS

ENV = "GOVERNOR_API_KEY"
MAX_KEY_CHARS = MAX_ID_CHARS  # the protocol's bound on an api_key


class APIKeyError(ValueError):
    """A key no governor would take; the message says why without showing it."""


def add_arguments(parser: argparse.ArgumentParser | Any, *, help: str | None = None) -> None:
    """``--api-key KEY`` on ``parser`` (or an argument group of one). Its default stays None,
    so that no help text can print the environment's key: :func:`key_from` reads that."""
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help=help
        or f"the tenant's API key, for a governor with [[tenants]] declared (default: "
        f"${ENV}, which is safer: a flag shows in ps and in the shell's history)",
    )


def key_from(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> str | None:
    """The key :func:`add_arguments`' option gives, else ``GOVERNOR_API_KEY``; None: no key.

    Raises :class:`APIKeyError` for a key no governor would take (empty, too long)."""
    key: str | None = args.api_key
    if key is None:
        key = (os.environ if environ is None else environ).get(ENV) or None
        where = ENV
    else:
        where = "--api-key"
    if key is None:
        return None
    if not key:
        raise APIKeyError(f"{where} is empty")
    if len(key) > MAX_KEY_CHARS:
        raise APIKeyError(
            f"{where} is {len(key)} characters long; a key has at most {MAX_KEY_CHARS}"
        )
    return key


def unauthorized_hint(key_given: bool) -> str:
    """What to do about an ``unauthorized`` answer, for a command's standard error."""
    if key_given:
        return (
            "the governor did not accept the API key: check that its sha256 is a tenant's "
            "key_sha256 (governor key-hash prints it)"
        )
    return (
        f"the governor declares tenants and this connection showed no key: set {ENV} (or give "
        "--api-key), or a client certificate with --tls-cert"
    )


__all__ = ["ENV", "MAX_KEY_CHARS", "APIKeyError", "add_arguments", "key_from", "unauthorized_hint"]
