"""TLS on the protocol listener: the server's :class:`ssl.SSLContext`, built from the config.

Pure but for reading the PEM files the config names. Every failure of the ``ssl`` module or the
OS to load them is translated here, at this one boundary, into a
:class:`~governor.config.ConfigError` that names the key and the file, so that a daemon with a
wrong path says so instead of printing an OpenSSL traceback.

Who a verified client certificate names is the tenants' business
(:meth:`governor.core.tenants.Tenants.find_cert`); this module only decides whether one is asked
for (``tls_client_ca``) and whether the handshake fails without one
(``tls_require_client_cert``).
"""

from __future__ import annotations

import ssl
from pathlib import Path

from ..config import Config, ConfigError

MINIMUM_VERSION = ssl.TLSVersion.TLSv1_2
# A peer that connects and never finishes its handshake holds a socket and a buffer, but no
# connection slot (the protocol sees it only once the handshake is done): bound how long.
HANDSHAKE_TIMEOUT_S = 10.0


def server_context(config: Config) -> ssl.SSLContext | None:
    """The listener's context, or None when the config asks for plain TCP (no ``tls_cert``).

    Raises :class:`ConfigError` naming the file that cannot be read or used.
    """
    if config.tls_cert is None or config.tls_key is None:
        return None  # Config has checked already that they come together
    cert, key = config.tls_cert, config.tls_key
    cert_pem = _read("tls_cert", cert)
    _read("tls_key", key)
    try:  # the chain alone first, so that a bad chain is not blamed on the key
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=cert_pem)
    except (ssl.SSLError, ValueError) as exc:  # ValueError: an empty file
        raise ConfigError(f"tls_cert {cert} holds no PEM certificate ({_why(exc)})") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = MINIMUM_VERSION

    def no_passphrase() -> bytes:
        # Without this callback OpenSSL would prompt on the terminal, and a daemon has none.
        raise ConfigError(f"tls_key {key} is encrypted: the daemon needs an unencrypted key")

    try:
        context.load_cert_chain(cert, key, password=no_passphrase)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(f"tls_key {key} is not the private key of tls_cert {cert}") from None
        raise ConfigError(f"tls_key {key} is not a PEM private key ({_why(exc)})") from None
    except OSError as exc:  # the file changed between the reads above and this one
        raise ConfigError(f"cannot read tls_cert {cert} or tls_key {key}: {exc}") from None
    if config.tls_client_ca is not None:
        ca = config.tls_client_ca
        ca_pem = _read("tls_client_ca", ca)
        try:
            context.load_verify_locations(cadata=ca_pem)
        except (ssl.SSLError, ValueError) as exc:
            raise ConfigError(
                f"tls_client_ca {ca} holds no PEM certificate ({_why(exc)})"
            ) from None
        # OPTIONAL still fails the handshake on a certificate that does not verify; it only
        # lets a client without one through (to show an api_key instead).
        context.verify_mode = (
            ssl.CERT_REQUIRED if config.tls_require_client_cert else ssl.CERT_OPTIONAL
        )
    return context


def describe(config: Config) -> str:
    """How the listener speaks, as the start of its log line's parenthesis ("" for plain TCP)."""
    if config.tls_cert is None:
        return ""
    if config.tls_require_client_cert:
        return "TLS, client certificates required, "
    if config.tls_client_ca is not None:
        return "TLS, client certificates accepted, "
    return "TLS, "


def _read(key: str, path: str) -> str:
    try:
        return Path(path).read_text(encoding="ascii")
    except OSError as exc:
        raise ConfigError(f"cannot read {key} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{key} {path} is not a PEM file (PEM is ASCII text)") from None


def _why(exc: Exception) -> str:
    if isinstance(exc, ssl.SSLError):
        return str(exc.reason or exc.strerror or exc)
    return str(exc)
