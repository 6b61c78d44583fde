"""Tenants: who may run what, how much at once, and how fast. Pure code, an injectable clock.

Declared in the TOML config (``[[tenants]]`` tables); each has an API key, stored only as its
sha256, or a client certificate name (``cert_name``), or both; a concurrency cap, token buckets
for requests per second and tokens per second, the lanes it may use and a weight. A frame
carries its key in ``api_key``; a connection whose TLS client certificate was verified against
``tls_client_ca`` names its tenant by that certificate (:meth:`Tenants.find_cert`). With no
tenant declared the daemon runs open, as one default tenant with no limits.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .ledger import Slot

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
DEFAULT_TENANT = "default"


def key_sha256(api_key: str) -> str:
    """What a tenant's ``key_sha256`` holds for ``api_key``: the sha256 of its UTF-8 bytes, as
    64 lower-case hex digits (``governor key-hash`` prints the config line)."""
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantConfig:
    name: str
    key_sha256: str | None = None  # hex sha256 of the API key; the key itself is never stored
    # A verified client certificate's subject commonName or one of its DNS subjectAltNames.
    cert_name: str | None = None
    max_inflight: int = 0  # 0: no cap of its own
    requests_per_s: float = 0.0  # 0: no request rate limit
    request_burst: float = 0.0  # bucket size; 0: one second's worth (at least 1)
    tokens_per_s: float = 0.0  # prompt + max_new_tokens per second; 0: no limit
    token_burst: float = 0.0
    lanes: tuple[str, ...] = ()  # allowed lanes; empty: all
    weight: float = 1.0
    # Its own objectives, over its lane's (an interactive job's only tightened): 0, the lane's.
    ttft_slo_ms: float = 0.0
    tpot_slo_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.key_sha256 is None and self.cert_name is None:
            raise ValueError(
                f"tenant {self.name!r}: needs key_sha256 (an API key), cert_name (a client "
                "certificate) or both"
            )
        if self.key_sha256 is not None and not (
            isinstance(self.key_sha256, str) and _SHA256_HEX.fullmatch(self.key_sha256)
        ):
            raise ValueError(
                f"tenant {self.name!r}: key_sha256 must be 64 lower-case hex digits, the "
                "sha256 of the tenant's API key (not the key itself); `governor key-hash` "
                "prints the line for a key"
            )
        if self.cert_name is not None and (
            not isinstance(self.cert_name, str)
            or not self.cert_name
            or self.cert_name != self.cert_name.strip()
        ):
            raise ValueError(
                f"tenant {self.name!r}: cert_name must be a certificate's name, a non-empty "
                "string without surrounding spaces"
            )
        if (
            min(
                self.max_inflight,
                self.requests_per_s,
                self.tokens_per_s,
                self.ttft_slo_ms,
                self.tpot_slo_ms,
            )
            < 0
            or self.weight <= 0
        ):
            raise ValueError(f"tenant {self.name!r}: limits must be >= 0 and weight > 0")


class TokenBucket:
    """``rate`` per second, up to ``burst``; :meth:`wait_s` says how long until ``n`` are there."""

    __slots__ = ("burst", "level", "rate", "stamp")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst or max(rate, 1.0)
        self.level = self.burst
        self.stamp = now

    def _refill(self, now: float) -> None:
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_s(self, n: float, now: float) -> float:
        self._refill(now)
        if n <= self.level:
            return 0.0
        if n > self.burst:  # it will never fit a full bucket: wait for a full one
            n = self.burst
        return (n - self.level) / self.rate

    def take(self, n: float, now: float) -> None:
        self._refill(now)
        self.level -= n  # may go below zero for a job larger than the burst


class Tenant:
    """A tenant's live state: what it runs now, and its buckets."""

    def __init__(self, config: TenantConfig, now: float) -> None:
        self.config = config
        self.name = config.name
        self.inflight = 0
        self.waiting = 0  # its refused payloads held for a retry
        self.running: list[Slot] = []  # its running jobs' slots (for the hint at its cap)
        self.requests = TokenBucket(config.requests_per_s, config.request_burst, now)
        self.tokens = TokenBucket(config.tokens_per_s, config.token_burst, now)

    def allows_lane(self, lane: str) -> bool:
        return not self.config.lanes or lane in self.config.lanes

    def wait_s(self, tokens: int, now: float) -> float:
        """How long until both buckets can take one more request of ``tokens``."""
        waits = [0.0]
        if self.config.requests_per_s:
            waits.append(self.requests.wait_s(1, now))
        if self.config.tokens_per_s:
            waits.append(self.tokens.wait_s(tokens, now))
        return max(waits)

    def charge(self, tokens: int, now: float) -> None:
        if self.config.requests_per_s:
            self.requests.take(1, now)
        if self.config.tokens_per_s:
            self.tokens.take(tokens, now)

    def refund(self, tokens: int, now: float) -> None:
        """Give back a :meth:`charge` for a job that did not run after all."""
        if self.config.requests_per_s:
            self.requests.take(-1, now)
        if self.config.tokens_per_s:
            self.tokens.take(-tokens, now)


OPEN = TenantConfig(name=DEFAULT_TENANT, key_sha256="0" * 64)


class Tenants:
    """The declared tenants, found by key or by client certificate; with none declared,
    everyone is the default tenant."""

    def __init__(self, configs: Iterable[TenantConfig], clock: Callable[[], float]) -> None:
        now = clock()
        self._tenants = [Tenant(c, now) for c in configs]
        self._by_key = {t.config.key_sha256: t for t in self._tenants if t.config.key_sha256}
        self._by_cert = {t.config.cert_name: t for t in self._tenants if t.config.cert_name}
        self.open = not self._tenants
        self._default = Tenant(OPEN, now)

    def all(self) -> list[Tenant]:
        return [self._default] if self.open else list(self._tenants)

    def fair_share(self, tenant: Tenant, cap: int) -> int | None:
        """``tenant``'s weighted share of ``cap`` while another tenant waits; None: no contention.

        Shared among the tenants active now (running or waiting), by weight; a tenant whose own
        ``max_inflight`` is below its share gets that, and the rest goes to the others.
        """
        if self.open:  # (one tenant: nobody else waits)
            return None
        active = [t for t in self.all() if t is tenant or t.inflight or t.waiting]
        if not any(t.waiting for t in active if t is not tenant):
            return None
        remaining, pool = float(cap), active
        while True:
            total = sum(t.config.weight for t in pool)
            capped = [
                t
                for t in pool
                if t.config.max_inflight
                and t.config.max_inflight < remaining * t.config.weight / total
            ]
            if not capped or tenant in capped:
                break
            remaining -= sum(t.config.max_inflight for t in capped)
            pool = [t for t in pool if t not in capped]
        return max(1, math.ceil(remaining * tenant.config.weight / total))

    def find(self, api_key: str | None) -> Tenant | None:
        """The key's tenant; None for a missing or unknown key (unless the daemon runs open)."""
        if self.open:
            return self._default
        if api_key is None:
            return None
        # Looked up by the key's hash: the stored secret is never compared, only its digest.
        return self._by_key.get(key_sha256(api_key))

    def find_cert(self, peercert: Mapping[str, Any] | None) -> Tenant | None:
        """The tenant a verified client certificate names; None for no certificate, or one
        that names no tenant or more than one (unless the daemon runs open).

        ``peercert`` is what ``transport.get_extra_info("peercert")`` (``getpeercert()``)
        gives: None or ``{}`` without a certificate, and a certificate there was verified
        against ``tls_client_ca`` by the handshake (the listener asks for none without it).
        Its names are the subject's commonName and its DNS subjectAltNames, compared exactly;
        a certificate whose names match two tenants is ambiguous and names neither, so that
        which one it gets never depends on the order of the certificate's fields.
        """
        if self.open:
            return self._default
        if not peercert:
            return None
        names = {
            value
            for rdn in peercert.get("subject", ())
            for key, value in rdn
            if key == "commonName"
        }
        names.update(value for kind, value in peercert.get("subjectAltName", ()) if kind == "DNS")
        found = {t for name in names if (t := self._by_cert.get(name)) is not None}
        return found.pop() if len(found) == 1 else None
