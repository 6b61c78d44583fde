"""API keys end to end, on real processes: ``governor key-hash`` makes the config line, a daemon
started with it takes the key from ``governor-cli`` and ``python -m loadtest`` (read from
``GOVERNOR_API_KEY`` or ``--api-key``), refuses them ``unauthorized`` without it, and no tool
prints the key."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from tests.conftest import Daemon

ROOT = Path(__file__).resolve().parents[2]
KEY = "k-3f9a1c77e2b84d06"  # what the tests give as the tenant's key
WRONG = "k-not-the-tenants-0b5e"


def run(
    *args: str, env: Mapping[str, str] | None = None, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` from the repository, ``GOVERNOR_API_KEY`` unset unless ``env`` sets it."""
    base = {k: v for k, v in os.environ.items() if k != "GOVERNOR_API_KEY"}
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**base, **(env or {})},
        input=stdin,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def key_hash(*args: str, env: Mapping[str, str] | None = None, stdin: str = "") -> str:
    done = run("-m", "governor", "key-hash", *args, env=env, stdin=stdin)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def keyed(daemon: Callable[..., Daemon], tmp_path: Path) -> Daemon:
    """A daemon with one tenant, declared by the line ``governor key-hash`` printed for KEY."""
    line = key_hash(env={"GOVERNOR_API_KEY": KEY})
    config = tmp_path / "tenants.toml"
    config.write_text(f'[[tenants]]\nname = "ide"\n{line}')
    return daemon("--config", str(config), "--stub-ms", "0", "--max-inflight", "8")


# governor key-hash -------------------------------------------------------------------------


def test_key_hash_prints_the_keys_sha256_as_a_toml_line() -> None:
    want = f'key_sha256 = "{hashlib.sha256(KEY.encode()).hexdigest()}"\n'
    assert key_hash(env={"GOVERNOR_API_KEY": KEY}) == want
    assert key_hash(stdin=KEY + "\n") == want  # `echo KEY | governor key-hash`
    assert key_hash(stdin=f"  {KEY}\r\n") == want  # surrounding whitespace dropped
    # The environment's key wins over standard input's.
    assert key_hash(env={"GOVERNOR_API_KEY": KEY}, stdin="other\n") == want


def test_key_hash_new_prints_a_fresh_key_once_then_its_line() -> None:
    first, second = key_hash("--new").splitlines(), key_hash("--new").splitlines()
    key, line = first
    assert len(key) >= 43
    assert line == f'key_sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"'
    assert second[0] != key


@pytest.mark.parametrize(
    ("stdin", "why"),
    [
        ("", "no key"),
        ("two words\n", "printable ASCII without spaces"),
        ("clé-secrète\n", "printable ASCII without spaces"),
        ("x" * 300 + "\n", "300 characters long; a key has at most 256"),
    ],
)
def test_key_hash_refuses_a_key_without_showing_it(stdin: str, why: str) -> None:
    done = run("-m", "governor", "key-hash", stdin=stdin)
    assert done.returncode == 1
    assert why in done.stderr
    assert done.stdout == ""
    if stdin.strip():
        assert stdin.strip() not in done.stderr
        assert stdin.split()[0] not in done.stderr


# A daemon's tenant line ---------------------------------------------------------------------


def test_a_placeholder_key_sha256_stops_the_daemon_naming_the_tenant_once(tmp_path: Path) -> None:
    config = tmp_path / "governor.toml"
    config.write_text('[[tenants]]\nname = "ide"\nkey_sha256 = "…"\n')  # the README's sample
    done = run("-m", "governor", "serve", "--runner", "stub", "--config", str(config))
    assert done.returncode == 2
    assert done.stderr.count("'ide'") == 1, done.stderr
    for said in ("key_sha256 must be 64 lower-case hex digits", "sha256", "governor key-hash"):
        assert said in done.stderr
    assert "Traceback" not in done.stderr


# governor-cli ---------------------------------------------------------------------------------


def cli(
    d: Daemon, *args: str, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``governor-cli --addr D ARGS``; an ``upload -`` uploads ``hello``."""
    return run("-m", "clients", "--addr", d.addr, "--timeout", "10", *args, env=env, stdin="hello")


def test_governor_cli_sends_the_key_from_the_environment(keyed: Daemon) -> None:
    env = {"GOVERNOR_API_KEY": KEY}
    done = cli(keyed, "generate", "hello", "--max-new-tokens", "4", env=env)
    assert done.returncode == 0, done.stderr
    assert "generated tokens" in done.stderr
    upload = cli(keyed, "upload", "-", env=env)
    assert upload.returncode == 0, upload.stderr
    assert json.loads(upload.stdout)["status"] == "done"
    # The flag wins over the environment.
    flag = cli(keyed, "--api-key", KEY, "upload", "-", env={"GOVERNOR_API_KEY": WRONG})
    assert flag.returncode == 0, flag.stderr
    # A ping needs no key (a governor answers it the same either way), and takes one.
    assert cli(keyed, "ping").returncode == 0
    assert cli(keyed, "ping", env=env).returncode == 0


def test_governor_cli_without_the_key_says_unauthorized_and_what_to_give(keyed: Daemon) -> None:
    for command in (["generate", "hello"], ["upload", "-"]):
        done = cli(keyed, *command)
        assert done.returncode == 2  # a confirm abort
        reply = json.loads(done.stdout)
        assert (reply["status"], reply["need_code"]) == ("abort", "unauthorized")
        assert "unauthorized" in done.stderr
        assert "GOVERNOR_API_KEY" in done.stderr


def test_governor_cli_never_shows_a_wrong_key(keyed: Daemon) -> None:
    for env, args in (({"GOVERNOR_API_KEY": WRONG}, ()), ({}, ("--api-key", WRONG))):
        done = cli(keyed, *args, "generate", "hello", env=env)
        assert done.returncode == 2
        assert json.loads(done.stdout)["need_code"] == "unauthorized"
        assert "did not accept the API key" in done.stderr
        assert WRONG not in done.stdout + done.stderr
    too_long = cli(keyed, "upload", "-", env={"GOVERNOR_API_KEY": "y" * 300})
    assert too_long.returncode == 1
    assert "GOVERNOR_API_KEY is 300 characters long" in too_long.stderr
    assert "yyyy" not in too_long.stdout + too_long.stderr


# python -m loadtest --------------------------------------------------------------------------


def burst(
    d: Daemon, out: Path, *args: str, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run(
        "-m", "loadtest", "burst", "--addr", d.addr, "--clients", "3", "--rounds", "1",
        "--no-plots", "--no-progress", "--timeout", "30", "--out", str(out), "--json", *args,
        env=env,
    )  # fmt: skip


def test_loadtest_burst_sends_the_key(keyed: Daemon, tmp_path: Path) -> None:
    done = burst(keyed, tmp_path / "env", env={"GOVERNOR_API_KEY": KEY})
    assert done.returncode == 0, done.stderr
    step = json.loads(done.stdout.splitlines()[-1])["steps"][0]
    assert step["all"]["done"] == 3
    assert step["monitor_error"] is None
    report = (tmp_path / "env" / "report.json").read_text()
    assert KEY not in report + done.stdout + done.stderr
    flag = burst(keyed, tmp_path / "flag", "--api-key", KEY)
    assert flag.returncode == 0, flag.stderr
    assert json.loads(flag.stdout.splitlines()[-1])["steps"][0]["all"]["done"] == 3
    assert KEY not in (tmp_path / "flag" / "report.json").read_text()


def test_loadtest_burst_without_the_key_reports_unauthorized(keyed: Daemon, tmp_path: Path) -> None:
    done = burst(keyed, tmp_path)
    assert done.returncode == 0, done.stderr  # the run reached its end: the report says how
    stats = json.loads(done.stdout.splitlines()[-1])["steps"][0]["all"]
    assert (stats["done"], stats["aborted_by"]) == (0, {"unauthorized": 3})
    assert "3 request(s) unauthorized" in done.stderr
    assert "GOVERNOR_API_KEY" in done.stderr
    wrong = burst(keyed, tmp_path / "wrong", env={"GOVERNOR_API_KEY": WRONG})
    assert "did not accept the API key" in wrong.stderr
    assert WRONG not in wrong.stdout + wrong.stderr
