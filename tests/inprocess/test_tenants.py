"""Tenants: keys, caps, rates and lanes, in the pure parts and through a real server."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import re
import time
from typing import Any

import pytest

from clients import NO_RETRY, GovernorClient, RetryPolicy
from governor.config import Config, ConfigError
from governor.core.tenants import TenantConfig, Tenants, TokenBucket, key_sha256
from protocol.spec import JobSpec
from tests.conftest import ServerFactory, wait_until


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_token_bucket_refills_at_its_rate() -> None:
    bucket = TokenBucket(rate=2.0, burst=4.0, now=0.0)
    assert bucket.wait_s(4, now=0.0) == 0.0
    bucket.take(4, now=0.0)
    assert bucket.wait_s(1, now=0.0) == pytest.approx(0.5)
    assert bucket.wait_s(1, now=0.5) == pytest.approx(0.0)
    assert bucket.wait_s(10, now=0.5) == pytest.approx(1.5)  # never more than a full bucket


def test_keys_are_found_by_their_hash_only() -> None:
    tenants = Tenants([TenantConfig(name="a", key_sha256=sha("secret-a"))], clock=lambda: 0.0)
    tenant = tenants.find("secret-a")
    assert tenant is not None
    assert tenant.name == "a"
    assert tenants.find("secret-b") is None
    assert tenants.find(None) is None
    assert not tenants.open
    open_ = Tenants([], clock=lambda: 0.0)
    assert open_.open
    found = open_.find(None)
    assert found is not None
    assert found.name == "default"


def peercert(common_name: str | None = None, *dns: str, ip: str | None = None) -> dict[str, Any]:
    """What ``getpeercert()`` gives for a verified certificate (the fields find_cert reads)."""
    subject = [(("organizationName", "Clients"),)]
    if common_name is not None:
        subject.append((("commonName", common_name),))
    alt = [("DNS", name) for name in dns] + ([("IP Address", ip)] if ip else [])
    return {"subject": tuple(subject), "subjectAltName": tuple(alt), "version": 3}


CERT_TENANTS = [
    TenantConfig(name="alpha", cert_name="alpha.clients.test"),
    TenantConfig(name="beta", cert_name="beta.clients.test", key_sha256=sha("beta-key")),
    TenantConfig(name="keyed", key_sha256=sha("keyed-key")),
]


@pytest.mark.parametrize(
    ("cert", "tenant"),
    [
        (peercert("alpha.clients.test"), "alpha"),  # the subject's commonName
        (peercert("someone", "beta.clients.test"), "beta"),  # a DNS subjectAltName
        (peercert("alpha.clients.test", "alpha.clients.test"), "alpha"),  # both, one tenant
        (peercert(None, "x.test", "alpha.clients.test"), "alpha"),
        (peercert("alpha.clients.test", "beta.clients.test"), None),  # two tenants: ambiguous
        (peercert("gamma.clients.test", "gamma.test"), None),  # no tenant's name
        (peercert("ALPHA.clients.test"), None),  # names are compared exactly
        (peercert(None, ip="alpha.clients.test"), None),  # only DNS names count
        (peercert("keyed"), None),  # a tenant's name is not its cert_name
        ({}, None),  # no certificate (CERT_OPTIONAL, none shown)
        (None, None),  # not a TLS connection
    ],
)
def test_a_certificate_names_the_tenant_with_its_cert_name(
    cert: dict[str, Any] | None, tenant: str | None
) -> None:
    found = Tenants(CERT_TENANTS, clock=lambda: 0.0).find_cert(cert)
    assert (found.name if found is not None else None) == tenant


def test_an_open_daemon_takes_any_certificate_as_its_default_tenant() -> None:
    tenants = Tenants([], clock=lambda: 0.0)
    for cert in (None, {}, peercert("anyone")):
        found = tenants.find_cert(cert)
        assert found is not None
        assert found.name == "default"


def test_key_and_certificate_find_the_same_tenant() -> None:
    tenants = Tenants(CERT_TENANTS, clock=lambda: 0.0)
    assert tenants.find("beta-key") is tenants.find_cert(peercert("beta.clients.test"))
    assert tenants.find("keyed-key") is not None
    assert [t.name for t in tenants.all()] == ["alpha", "beta", "keyed"]
    assert not tenants.open


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "needs key_sha256 .*, cert_name .* or both"),
        ({"cert_name": ""}, "cert_name must be"),
        ({"cert_name": " alpha"}, "cert_name must be"),
        ({"cert_name": 7}, "cert_name must be"),
        ({"key_sha256": "NOTHEX"}, "key_sha256 must be 64 lower-case hex digits, the sha256"),
    ],
)
def test_a_tenant_needs_a_key_or_a_certificate_name(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TenantConfig(name="t", **fields)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"key_sha256": "…"}, "tenant 'ide': key_sha256 must be 64 lower-case hex digits, the "
         "sha256 of the tenant's API key (not the key itself); `governor key-hash` prints"),
        ({"key_sha256": sha("k").upper()}, "tenant 'ide': key_sha256 must be 64 lower-case"),
        ({}, "tenant 'ide': needs key_sha256"),
        ({"cert_name": "x", "colour": "red"}, "tenant 'ide': unknown key 'colour'"),
        ({"cert_name": "x", "max_inflight": "2"}, "tenant 'ide': '<' not supported"),
    ],
)  # fmt: skip
def test_a_bad_tenant_is_named_once_with_what_is_expected(
    table: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        Config.from_mapping({"tenants": [{"name": "ide", **table}]}, source="governor.toml")
    assert str(caught.value).startswith(f"governor.toml: {message}")
    assert str(caught.value).count("'ide'") == 1
    with pytest.raises(ConfigError, match=re.escape("each [[tenants]] table needs a name")):
        Config.from_mapping({"tenants": [table]})


def test_key_sha256_is_what_the_tenants_look_keys_up_by() -> None:
    assert key_sha256("abc") == (
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # FIPS 180-2's
    )
    tenants = Tenants([TenantConfig(name="a", key_sha256=key_sha256("é-key"))], clock=lambda: 0)
    assert tenants.find("é-key") is not None


def test_config_tenants_by_certificate_only_and_unique_names() -> None:
    config = Config.from_mapping({"tenants": [{"name": "a", "cert_name": "a.test"}]})
    assert config.tenants[0].key_sha256 is None
    assert config.tenants[0].cert_name == "a.test"
    twice = [{"name": "a", "cert_name": "same"}, {"name": "b", "cert_name": "same"}]
    with pytest.raises(ConfigError, match="tenant cert_names must be unique"):
        Config.from_mapping({"tenants": twice})
    keys = [{"name": "a", "key_sha256": sha("k")}, {"name": "b", "key_sha256": sha("k")}]
    with pytest.raises(ConfigError, match=r"tenant keys \(key_sha256\) must be unique"):
        Config.from_mapping({"tenants": keys})
    # Two tenants by certificate only have no key to collide on.
    both = [{"name": "a", "cert_name": "a.test"}, {"name": "b", "cert_name": "b.test"}]
    assert len(Config.from_mapping({"tenants": both}).tenants) == 2
    with pytest.raises(ConfigError, match="needs key_sha256"):
        Config.from_mapping({"tenants": [{"name": "a"}]})


TENANTS: list[dict[str, Any]] = [
    {"name": "noisy", "key_sha256": sha("noisy-key"), "max_inflight": 1, "requests_per_s": 4},
    {"name": "quiet", "key_sha256": sha("quiet-key"), "max_inflight": 3},
    {"name": "batch", "key_sha256": sha("batch-key"), "lanes": ("background",)},
]


async def make(make_server: ServerFactory, **config: Any) -> Any:
    return await make_server(tenants=tuple(TenantConfig(**t) for t in TENANTS), **config)


async def test_unknown_or_missing_keys_are_unauthorized(make_server: ServerFactory) -> None:
    server = await make(make_server, stub_ms=0)
    host, port = server.address
    for key in (None, "wrong-key"):
        async with await GovernorClient.connect(host, port, api_key=key) as client:
            result = await client.upload(b"hello", retry=NO_RETRY)
        assert (result.reply.verb, result.reply.status) == ("confirm", "abort")
        assert (result.reply.need_code, result.reply.error_code) == ("unauthorized", "unauthorized")
        assert "noisy" not in (result.reply.detail or "")
    async with await GovernorClient.connect(host, port, api_key="quiet-key") as client:
        assert (await client.upload(b"hello")).done
    assert server.ledger.executed_total == 1


async def test_a_client_that_only_pings_shows_its_key_on_them(make_server: ServerFactory) -> None:
    """A load test's monitor only pings: its pings carry the key, so the grace does not close
    it, as it closes a connection that pings without one."""
    server = await make(make_server, stub_ms=0, auth_grace=0.3)
    host, port = server.address
    async with (
        await GovernorClient.connect(host, port, api_key="quiet-key") as keyed,
        await GovernorClient.connect(host, port) as bare,
    ):
        for client in (keyed, bare):
            assert (await client.ping()).status == "ok"  # answered alike
        await wait_until(lambda: bare.closed)  # its grace is over, and so is keyed's
        assert not keyed.closed
        assert (await keyed.ping()).status == "ok"
        assert (await keyed.upload(b"still here")).done


async def test_a_tenant_pinned_to_a_lane_runs_there(make_server: ServerFactory) -> None:
    server = await make(make_server, stub_ms=500, lanes=True, max_inflight=2)
    host, port = server.address
    async with await GovernorClient.connect(host, port, api_key="batch-key") as client:
        running = asyncio.ensure_future(client.generate(JobSpec(prompt="short", max_new_tokens=4)))
        await wait_until(lambda: server.ledger.inflight == 1)
        # A cheap, interactive-priced job, run in the only lane its tenant may use.
        assert server.ledger.lane_inflight == {"background": 1}
        assert (await running).done


async def test_noisy_neighbour_gets_only_its_cap(make_server: ServerFactory) -> None:
    server = await make(make_server, stub_ms=200, max_inflight=4)
    host, port = server.address
    peak = collections.Counter[str]()

    def watch() -> None:
        for tenant in server.tenants.all():
            peak[tenant.name] = max(peak[tenant.name], tenant.inflight)

    async def job(key: str) -> tuple[str, float, str | None]:
        async with await GovernorClient.connect(host, port, api_key=key) as client:
            start = time.monotonic()
            result = await client.upload(b"x", retry=RetryPolicy(max_attempts=1))
            watch()
            return str(result.status), time.monotonic() - start, result.reply.need_code

    async def sampler(jobs: asyncio.Future[Any]) -> None:
        while not jobs.done():
            watch()
            await asyncio.sleep(0.01)

    # The noisy tenant bursts 10 times its quota of 1 slot; the quiet one sends 3 jobs.
    jobs = asyncio.gather(
        *(job("noisy-key") for _ in range(10)), *(job("quiet-key") for _ in range(3))
    )
    results, _ = await asyncio.gather(jobs, sampler(jobs))
    noisy = [r for r in results[:10] if r is not None]
    quiet = [r for r in results[10:13] if r is not None]
    assert peak["noisy"] <= 1
    assert sum(1 for r in noisy if r[0] == "done") == 1
    refusals = {r[2] for r in noisy if r[0] == "yield"}
    assert refusals <= {"tenant_busy", "rate_limited"}
    assert refusals
    # The quiet tenant kept its share and its latency: all three ran at once.
    assert [r[0] for r in quiet] == ["done"] * 3
    assert max(r[1] for r in quiet) < 1.0
    assert server.admission.refusals[("tenant_busy", "-", "noisy")] >= 1
    assert not any(t == "quiet" for (_, _, t) in server.admission.refusals)


async def test_contended_slots_are_shared_by_weight(make_server: ServerFactory) -> None:
    heavy_user = TenantConfig(name="big", key_sha256=sha("big-key"), weight=3.0)
    light_user = TenantConfig(name="small", key_sha256=sha("small-key"), weight=1.0)
    server = await make_server(
        tenants=(heavy_user, light_user),
        stub_ms=150,
        max_inflight=4,
    )
    host, port = server.address
    big, small = server.tenants.find("big-key"), server.tenants.find("small-key")
    assert big is not None
    assert small is not None
    samples: list[tuple[float, int, int]] = []  # (time, big's inflight, small's waiting)

    async def sampler() -> None:
        while True:
            samples.append((time.monotonic(), big.inflight, small.waiting))
            await asyncio.sleep(0.005)

    async def jobs(key: str, n: int) -> list[str]:
        async with await GovernorClient.connect(host, port, api_key=key) as client:
            results = await asyncio.gather(
                *(client.upload(b"x", retry=RetryPolicy(max_attempts=200)) for _ in range(n))
            )
        return [str(r.status) for r in results]

    watching = asyncio.ensure_future(sampler())
    big_jobs = asyncio.ensure_future(jobs("big-key", 12))
    await wait_until(lambda: big.inflight == 4)  # the big tenant holds every slot ...
    small_arrives = time.monotonic()
    small_done = await jobs("small-key", 4)  # ... when the small one arrives and must wait
    big_done = await big_jobs
    watching.cancel()
    assert big_done == ["done"] * 12
    assert small_done == ["done"] * 4
    # Nothing is preempted: once the big tenant's jobs admitted before the small one arrived
    # have ended (one service time, 150 ms), it holds at most its share while the small waits.
    settled = small_arrives + 0.2
    contended = [s for s in samples if s[0] >= settled and s[2] > 0]
    assert contended
    assert all(big_running <= 3 for _, big_running, _ in contended)  # 4 x 3 / 4
    assert server.admission.refusals[("tenant_share", "-", "big")] > 0
