"""A client for several governor replicas: pick one from what its receipts say, go elsewhere
on ``yield`` or ``draining``, eject one that keeps failing.

In layers, as everywhere in this project:

- :mod:`~clients.fleet.addresses`: ``HOST:PORT`` texts and the names that stand for several
  replicas, resolved;
- :mod:`~clients.fleet.replicas`: :class:`Replicas`, the policy (picking, moving after a yield,
  leaving a draining replica, outlier ejection), pure code over a clock it is given;
- :mod:`~clients.fleet.route`: :class:`~clients.fleet.route.JobRoute`, one job's tries and the
  choice after each, pure too;
- :mod:`~clients.fleet.client`: :class:`FleetClient`, the IO: one lazily opened
  :class:`~clients.client.GovernorClient` per replica, which asks the pure layers at each step.
"""

from .addresses import (
    Address,
    Resolver,
    resolve,
    resolve_now,
    split_addresses,
    spread,
    system_resolver,
)
from .client import PROBE_TIMEOUT_S, WITHDRAW_TIMEOUT_S, FleetClient
from .replicas import (
    DEFAULT_HINT_MS,
    FLEET_WIDE_CODES,
    Ejection,
    Move,
    Replicas,
    ReplicaState,
    ReplicaStatus,
)
from .route import GONE_CODES, FleetResult, JobRoute, NoReplicaAvailable

__all__ = [
    "DEFAULT_HINT_MS",
    "FLEET_WIDE_CODES",
    "GONE_CODES",
    "PROBE_TIMEOUT_S",
    "WITHDRAW_TIMEOUT_S",
    "Address",
    "Ejection",
    "FleetClient",
    "FleetResult",
    "JobRoute",
    "Move",
    "NoReplicaAvailable",
    "ReplicaState",
    "ReplicaStatus",
    "Replicas",
    "Resolver",
    "resolve",
    "resolve_now",
    "split_addresses",
    "spread",
    "system_resolver",
]
