"""TLS for clients: a context from a CA bundle and a client certificate, and the options for it.

``governor-cli`` and ``python -m loadtest`` take the same four options (:func:`add_arguments`)
and build their context with :func:`context_from`, so that each tool speaks TLS alike. The
client certificate, when given, is what names the connection's tenant to a governor with
``tls_client_ca`` (instead of an ``api_key``).
"""

from __future__ import annotations

import argparse
import ssl
from typing import Any

MINIMUM_VERSION = ssl.TLSVersion.TLSv1_2  # as the governor's listener


class TLSSetupError(ValueError):
    """A CA bundle or client certificate that cannot be used; the message names the file."""


def client_context(
    *, ca: str | None = None, cert: str | None = None, key: str | None = None
) -> ssl.SSLContext:
    """A context that verifies the server against ``ca`` (a PEM bundle; None: the system's CAs)
    and, with ``cert``, shows that certificate (its private key in ``key``, or in ``cert``).

    Raises :class:`TLSSetupError` naming the file that cannot be read or used.
    """
    if key is not None and cert is None:
        raise TLSSetupError("a client key needs its certificate: give the certificate too")
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    context.minimum_version = MINIMUM_VERSION
    if ca is not None:
        try:
            context.load_verify_locations(cafile=ca)
        except OSError as exc:  # ssl.SSLError included
            raise TLSSetupError(f"cannot use the CA bundle {ca}: {_why(exc)}") from None
    if cert is not None:

        def no_passphrase() -> bytes:
            # OpenSSL would prompt on the terminal; a load generator or a script has none.
            raise TLSSetupError(
                f"the client key {key or cert} is encrypted: give an unencrypted one"
            )

        try:
            context.load_cert_chain(cert, key, password=no_passphrase)
        except OSError as exc:
            files = cert if key is None else f"{cert} and {key}"
            raise TLSSetupError(f"cannot use the client certificate {files}: {_why(exc)}") from None
    return context


def add_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """``--tls``, ``--tls-ca``, ``--tls-cert``, ``--tls-key`` and ``--tls-server-name`` on
    ``parser`` (or an argument group of one)."""
    parser.add_argument(
        "--tls",
        action="store_true",
        help="speak TLS, verifying the server against the system's CAs (implied by the other "
        "--tls options)",
    )
    parser.add_argument(
        "--tls-ca", metavar="FILE", help="PEM CA bundle to verify the server's certificate with"
    )
    parser.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="PEM client certificate, which names the tenant to a governor with tls_client_ca",
    )
    parser.add_argument(
        "--tls-key", metavar="FILE", help="PEM private key of --tls-cert (default: in that file)"
    )
    parser.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="the name the server's certificate must carry (default: the host connected to)",
    )


def context_from(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The context :func:`add_arguments`' options ask for; None: plain TCP."""
    wanted = args.tls or any(
        v is not None for v in (args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    )
    if not wanted:
        return None
    return client_context(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key)


def _why(exc: OSError) -> str:
    if isinstance(exc, ssl.SSLError):
        return str(exc.reason or exc.strerror or exc)
    return exc.strerror or str(exc)


__all__ = ["TLSSetupError", "add_arguments", "client_context", "context_from"]
