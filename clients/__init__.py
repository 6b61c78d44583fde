"""Clients for the governor: an asyncio library and the ``governor-cli`` command."""

from .client import (
    NO_RETRY,
    ClientError,
    ConnectionLost,
    GovernorClient,
    RetryBudget,
    RetryPolicy,
    UploadResult,
    connect,
)
from .tls import TLSSetupError, client_context

__all__ = [
    "NO_RETRY",
    "ClientError",
    "ConnectionLost",
    "GovernorClient",
    "RetryBudget",
    "RetryPolicy",
    "TLSSetupError",
    "UploadResult",
    "client_context",
    "connect",
]
