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
from .fleet import (
    Address,
    Ejection,
    FleetClient,
    FleetResult,
    NoReplicaAvailable,
    Replicas,
    ReplicaState,
    ReplicaStatus,
)
from .tls import TLSSetupError, client_context

__all__ = [
    "NO_RETRY",
    "Address",
    "ClientError",
    "ConnectionLost",
    "Ejection",
    "FleetClient",
    "FleetResult",
    "GovernorClient",
    "NoReplicaAvailable",
    "ReplicaState",
    "ReplicaStatus",
    "Replicas",
    "RetryBudget",
    "RetryPolicy",
    "TLSSetupError",
    "UploadResult",
    "client_context",
    "connect",
]
