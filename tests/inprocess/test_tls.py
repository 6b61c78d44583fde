"""TLS on the protocol listener: contexts from the config, handshakes that must fail, client
certificates as tenant identity, and governor-cli and the load tests speaking TLS.

Certificates come from ``trustme``: a server CA (the daemon's certificate for 127.0.0.1) and a
separate client CA (``tls_client_ca``), both made per test in ``tmp_path``.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trustme
from cryptography.hazmat.primitives import serialization

from clients import ClientError, GovernorClient, TLSSetupError, client_context
from governor.config import Config, ConfigError
from governor.core.tenants import TenantConfig, Tenants
from governor.listeners import tls
from governor.server import Server
from tests.conftest import Daemon, ServerFactory, wait_until

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Pki:
    dir: Path
    server_ca: trustme.CA
    client_ca: trustme.CA
    ca_file: Path  # the server CA, for clients
    client_ca_file: Path  # the client CA, for the server's tls_client_ca
    cert: Path  # the server's chain and key
    key: Path

    def client_cert(self, name: str, *, ca: trustme.CA | None = None) -> Path:
        """A client certificate for ``name`` (its commonName and a DNS subjectAltName), its key
        in the same file; by the client CA unless ``ca`` is given."""
        issued = (ca or self.client_ca).issue_cert(name, common_name=name)
        path = self.dir / f"client-{name}-{id(ca)}.pem"
        issued.private_key_and_cert_chain_pem.write_to_path(str(path))
        return path

    def client(self, cert: Path | None = None) -> ssl.SSLContext:
        return client_context(ca=str(self.ca_file), cert=None if cert is None else str(cert))

    def tls_config(self, *, client_ca: bool = False, **more: Any) -> dict[str, Any]:
        config: dict[str, Any] = {"tls_cert": str(self.cert), "tls_key": str(self.key)}
        if client_ca:
            config["tls_client_ca"] = str(self.client_ca_file)
        return config | more


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    server_ca, client_ca = trustme.CA(), trustme.CA()
    issued = server_ca.issue_cert("127.0.0.1", "localhost")
    pki = Pki(
        tmp_path,
        server_ca,
        client_ca,
        tmp_path / "ca.pem",
        tmp_path / "client-ca.pem",
        tmp_path / "server.pem",
        tmp_path / "server.key",
    )
    server_ca.cert_pem.write_to_path(str(pki.ca_file))
    client_ca.cert_pem.write_to_path(str(pki.client_ca_file))
    issued.private_key_pem.write_to_path(str(pki.key))
    for i, blob in enumerate(issued.cert_chain_pems):
        blob.write_to_path(str(pki.cert), append=i > 0)
    return pki


def sha(key: str) -> str:
    import hashlib

    return hashlib.sha256(key.encode()).hexdigest()


# Contexts, no sockets ------------------------------------------------------------------


def test_plain_tcp_is_the_default() -> None:
    assert tls.server_context(Config()) is None
    assert tls.describe(Config()) == ""


def test_the_server_context_follows_the_config(pki: Pki) -> None:
    context = tls.server_context(Config(**pki.tls_config()))
    assert context is not None
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert context.verify_mode == ssl.CERT_NONE
    optional = tls.server_context(Config(**pki.tls_config(client_ca=True)))
    assert optional is not None
    assert optional.verify_mode == ssl.CERT_OPTIONAL
    required = tls.server_context(
        Config(**pki.tls_config(client_ca=True, tls_require_client_cert=True))
    )
    assert required is not None
    assert required.verify_mode == ssl.CERT_REQUIRED


def handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> ssl.SSLObject:
    """A TLS handshake between two in-memory ends; returns the server's end."""
    s_in, s_out, c_in, c_out = (ssl.MemoryBIO() for _ in range(4))
    server_end = server.wrap_bio(s_in, s_out, server_side=True)
    client_end = client.wrap_bio(c_in, c_out, server_hostname="127.0.0.1")
    done = {"server": False, "client": False}
    for _ in range(10):
        for name, end, out, peer_in in (
            ("client", client_end, c_out, s_in),
            ("server", server_end, s_out, c_in),
        ):
            if not done[name]:
                try:
                    end.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
            peer_in.write(out.read())
        if all(done.values()):
            return server_end
    raise AssertionError("the in-memory handshake did not finish")


def test_a_verified_certificate_as_the_handshake_gives_it_names_its_tenant(pki: Pki) -> None:
    server = tls.server_context(Config(**pki.tls_config(client_ca=True)))
    assert server is not None
    tenants = Tenants(
        [
            TenantConfig(name="alpha", cert_name="alpha.clients.test"),
            TenantConfig(name="beta", key_sha256=sha("beta-key")),
        ],
        clock=lambda: 0.0,
    )
    end = handshake(server, pki.client(pki.client_cert("alpha.clients.test")))
    peercert = end.getpeercert()
    found = tenants.find_cert(peercert)
    assert found is not None
    assert found.name == "alpha"
    # No certificate (allowed by CERT_OPTIONAL): the handshake's empty answer names nobody.
    anonymous = handshake(server, pki.client()).getpeercert()
    assert not anonymous
    assert tenants.find_cert(anonymous) is None
    # A verified certificate whose name no tenant carries.
    stranger = handshake(server, pki.client(pki.client_cert("gamma.clients.test")))
    assert tenants.find_cert(stranger.getpeercert()) is None


CONFIG_ERRORS: list[tuple[str, Callable[[Pki], dict[str, Any]], str]] = [
    ("missing cert", lambda p: p.tls_config(tls_cert=str(p.dir / "nope.pem")), "cannot read tls_cert .*nope.pem"),
    ("missing key", lambda p: p.tls_config(tls_key=str(p.dir / "nope.key")), "cannot read tls_key .*nope.key"),
    ("a directory", lambda p: p.tls_config(tls_cert=str(p.dir)), "cannot read tls_cert .*: Is a directory"),
    ("junk cert", lambda p: p.tls_config(tls_cert=str(p.dir / "junk.pem")), "tls_cert .*junk.pem holds no PEM certificate"),
    ("empty cert", lambda p: p.tls_config(tls_cert=str(p.dir / "empty.pem")), "tls_cert .*empty.pem holds no PEM certificate"),
    ("junk key", lambda p: p.tls_config(tls_key=str(p.dir / "junk.pem")), "tls_key .*junk.pem is not a PEM private key"),
    ("another key", lambda p: p.tls_config(tls_key=str(p.dir / "other.key")), "tls_key .*other.key is not the private key of tls_cert .*server.pem"),
    ("encrypted key", lambda p: p.tls_config(tls_key=str(p.dir / "locked.key")), "tls_key .*locked.key is encrypted"),
    ("junk client CA", lambda p: p.tls_config(tls_client_ca=str(p.dir / "junk.pem")), "tls_client_ca .*junk.pem holds no PEM certificate"),
    ("missing client CA", lambda p: p.tls_config(tls_client_ca=str(p.dir / "nope-ca.pem")), "cannot read tls_client_ca .*nope-ca.pem"),
    ("binary file", lambda p: p.tls_config(tls_cert=str(p.dir / "binary.der")), "tls_cert .*binary.der is not a PEM file"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("_case", "config", "message"), CONFIG_ERRORS, ids=[c[0] for c in CONFIG_ERRORS]
)
def test_unusable_files_are_config_errors_naming_them(
    pki: Pki, _case: str, config: Callable[[Pki], dict[str, Any]], message: str
) -> None:  # fmt: skip
    (pki.dir / "junk.pem").write_text("not a certificate\n")
    (pki.dir / "empty.pem").write_text("")
    (pki.dir / "binary.der").write_bytes(b"\x30\x82\xff\xfe")
    pki.server_ca.issue_cert("127.0.0.1").private_key_pem.write_to_path(str(pki.dir / "other.key"))
    key = serialization.load_pem_private_key(pki.key.read_bytes(), password=None)
    (pki.dir / "locked.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(ConfigError, match=message):
        tls.server_context(Config(**config(pki)))


def test_a_cert_without_its_key_is_a_config_error(pki: Pki) -> None:
    with pytest.raises(ConfigError, match="tls_cert and tls_key go together"):
        Config(tls_cert=str(pki.cert))
    with pytest.raises(ConfigError, match="tls_cert and tls_key go together"):
        Config.from_mapping({"tls_key": str(pki.key)})


def test_client_contexts_name_the_file_they_cannot_use(pki: Pki) -> None:
    with pytest.raises(TLSSetupError, match=r"CA bundle .*nope\.pem"):
        client_context(ca=str(pki.dir / "nope.pem"))
    with pytest.raises(TLSSetupError, match=r"client certificate .*nope\.pem"):
        client_context(ca=str(pki.ca_file), cert=str(pki.dir / "nope.pem"))
    with pytest.raises(TLSSetupError, match="needs its certificate"):
        client_context(key=str(pki.key))
    context = client_context(ca=str(pki.ca_file), cert=str(pki.cert), key=str(pki.key))
    assert context.check_hostname
    assert context.verify_mode == ssl.CERT_REQUIRED


# Through a real listener -----------------------------------------------------------------


async def tls_server(make_server: ServerFactory, pki: Pki, **config: Any) -> Server:
    return await make_server(**pki.tls_config(**config))


def tls_version(client: GovernorClient) -> str | None:
    ssl_object = client._writer.get_extra_info("ssl_object")
    return None if ssl_object is None else str(ssl_object.version())


async def test_a_job_runs_over_tls(make_server: ServerFactory, pki: Pki) -> None:
    server = await tls_server(make_server, pki, stub_ms=0)
    host, port = server.address
    async with await GovernorClient.connect(host, port, ssl=pki.client()) as client:
        assert tls_version(client) in ("TLSv1.2", "TLSv1.3")
        assert (await client.ping()).status == "ok"
        result = await client.upload(b"hello over tls")
    assert result.done
    assert server.ledger.executed_total == 1


async def test_the_client_checks_the_server_certificate(
    make_server: ServerFactory, pki: Pki
) -> None:
    server = await tls_server(make_server, pki)
    host, port = server.address
    stranger = client_context()  # the system's CAs, which never signed the test CA
    with pytest.raises(ssl.SSLCertVerificationError):
        await GovernorClient.connect(host, port, ssl=stranger)
    with pytest.raises(ssl.SSLCertVerificationError, match=r"mismatch|match"):
        await GovernorClient.connect(host, port, ssl=pki.client(), server_hostname="elsewhere")
    async with await GovernorClient.connect(
        host, port, ssl=pki.client(), server_hostname="localhost"
    ) as client:
        assert (await client.ping()).status == "ok"


async def test_a_plain_client_is_closed_and_tls_clients_still_served(
    make_server: ServerFactory, pki: Pki
) -> None:
    loop = asyncio.get_running_loop()
    problems: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: problems.append(context))
    try:
        server = await tls_server(make_server, pki, stub_ms=0)
        host, port = server.address
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b'{"v":0,"verb":"ping","job":"J1","seq":0,"ttl_ms":0}\n')
        rest = await asyncio.wait_for(reader.read(), 5.0)  # to the server's close
        writer.close()
        assert b'"verb"' not in rest  # at most a TLS alert record, never a frame
        assert not server.connections
        async with await GovernorClient.connect(host, port, ssl=pki.client()) as client:
            assert (await client.upload(b"after the plain client")).done
        assert problems == []
    finally:
        loop.set_exception_handler(None)


async def test_a_silent_peer_is_dropped_at_the_handshake_deadline(
    make_server: ServerFactory, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tls, "HANDSHAKE_TIMEOUT_S", 0.2)
    server = await tls_server(make_server, pki, idle_timeout=60.0)
    host, port = server.address
    reader, writer = await asyncio.open_connection(host, port)
    try:
        # Without the handshake deadline nothing would close it before idle_timeout (60 s).
        assert await asyncio.wait_for(reader.read(), 5.0) == b""
    finally:
        writer.close()


async def test_a_required_client_certificate_fails_the_handshake_without_one(
    make_server: ServerFactory, pki: Pki
) -> None:
    server = await tls_server(
        make_server, pki, client_ca=True, tls_require_client_cert=True, stub_ms=0
    )
    host, port = server.address
    # TLS 1.3 finishes the client's half of the handshake before the server has checked it:
    # the refusal may come at connect or at the first read.
    with pytest.raises((OSError, ClientError)):
        async with await GovernorClient.connect(host, port, ssl=pki.client()) as client:
            await client.ping()
    with pytest.raises((OSError, ClientError)):  # a certificate, but not by the client CA
        async with await GovernorClient.connect(
            host, port, ssl=pki.client(pki.client_cert("alpha", ca=pki.server_ca))
        ) as client:
            await client.ping()
    assert server.ledger.executed_total == 0
    async with await GovernorClient.connect(
        host, port, ssl=pki.client(pki.client_cert("alpha"))
    ) as client:
        assert (await client.ping()).status == "ok"


async def test_an_optional_client_certificate_from_another_ca_is_refused(
    make_server: ServerFactory, pki: Pki
) -> None:
    server = await tls_server(make_server, pki, client_ca=True)
    host, port = server.address
    foreign = pki.client_cert("alpha.clients.test", ca=trustme.CA())
    with pytest.raises((OSError, ClientError)):
        async with await GovernorClient.connect(host, port, ssl=pki.client(foreign)) as client:
            await client.ping()
    async with await GovernorClient.connect(host, port, ssl=pki.client()) as client:
        assert (await client.ping()).status == "ok"  # no certificate at all is allowed


async def test_a_client_certificate_runs_jobs_as_its_tenant(
    make_server: ServerFactory, pki: Pki
) -> None:
    """Needs the connection to look its certificate's tenant up (``Tenants.find_cert``)."""
    server = await tls_server(
        make_server,
        pki,
        client_ca=True,
        stub_ms=300,
        tenants=(
            TenantConfig(name="alpha", cert_name="alpha.clients.test"),
            TenantConfig(name="beta", key_sha256=sha("beta-key")),
        ),
    )
    host, port = server.address
    alpha = next(t for t in server.tenants.all() if t.name == "alpha")
    async with await GovernorClient.connect(
        host, port, ssl=pki.client(pki.client_cert("alpha.clients.test"))
    ) as client:
        running = asyncio.ensure_future(client.upload(b"as alpha, no api_key"))
        await wait_until(lambda: alpha.inflight == 1)
        assert (await running).done
    for cert in (None, pki.client_cert("gamma.clients.test")):  # no tenant's name: no entry
        async with await GovernorClient.connect(host, port, ssl=pki.client(cert)) as client:
            refused = await client.upload(b"nobody")
        assert refused.reply.need_code == "unauthorized"
    async with await GovernorClient.connect(
        host, port, ssl=pki.client(), api_key="beta-key"
    ) as client:
        assert (await client.upload(b"as beta, by key")).done
    assert server.ledger.executed_total == 2


# A real daemon, governor-cli and the load tests ------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clients", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_governor_cli_over_tls_against_a_daemon(
    daemon: Callable[..., Daemon], pki: Pki, tmp_path: Path
) -> None:
    d = daemon("--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--stub-ms", "0")
    d.wait_for_log(rb"listening on \S+ \(TLS, ")
    payload = tmp_path / "payload.bin"
    payload.write_bytes(b"x" * 20_000)
    done = cli("--addr", d.addr, "--tls-ca", str(pki.ca_file), "upload", str(payload))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "done"
    ping = cli("--addr", d.addr, "--tls-ca", str(pki.ca_file), "--timeout", "5", "ping")
    assert ping.returncode == 0, ping.stderr
    plain = cli("--addr", d.addr, "--timeout", "5", "ping")  # plain TCP to a TLS listener
    assert plain.returncode == 1
    untrusted = cli("--addr", d.addr, "--tls", "--timeout", "5", "ping")
    assert untrusted.returncode == 1
    assert "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
    missing = cli("--addr", d.addr, "--tls-ca", str(tmp_path / "nope.pem"), "ping")
    assert missing.returncode == 1
    assert "nope.pem" in missing.stderr


def test_a_daemon_with_an_unusable_key_names_it(pki: Pki) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "governor",
            "serve",
            "--runner",
            "stub",
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            str(pki.cert),
            "--tls-key",
            str(pki.dir / "nope.key"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2  # a config error, as for a bad flag
    assert "cannot read tls_key" in proc.stderr
    assert "nope.key" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "listening on" not in proc.stderr


def test_loadtest_burst_over_tls(daemon: Callable[..., Daemon], pki: Pki, tmp_path: Path) -> None:
    d = daemon(
        "--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--stub-ms", "0",
        "--max-inflight", "8",
    )  # fmt: skip
    proc = subprocess.run(
        [
            sys.executable, "-m", "loadtest", "burst", "--addr", d.addr,
            "--tls-ca", str(pki.ca_file), "--clients", "4", "--rounds", "3",
            "--no-plots", "--no-progress", "--out", str(tmp_path / "out"), "--timeout", "30", "--json",
        ],
        capture_output=True, text=True, timeout=90, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    step = summary["steps"][0]
    assert step["all"]["done"] == 12
    assert step["monitor_error"] is None  # the monitor's pings went over TLS too
    assert step["max_inflight_observed"] is not None
