"""Configuration: parsing, validation, flags mapping 1:1 onto keys, and docs/CONFIG.md's tables."""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import re
import tomllib
import types
from pathlib import Path

import pytest

import clients
import protocol
from governor.cli import build_parser, config_from_args, drain
from governor.config import (
    CLI_FIELDS,
    RUNNERS,
    SECTIONS,
    Config,
    ConfigError,
    default_text,
    parse_address,
    reference_markdown,
    section_fields,
)
from governor.core.policy import Lane, LaneSettings
from governor.core.slo import Objectives, SloPolicy
from governor.core.tenants import TenantConfig
from governor.server import build_policy
from loadtest.support.options import parse_addr
from protocol import addresses

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:7777", ("127.0.0.1", 7777)),
        ("localhost:0", ("localhost", 0)),
        ("[::1]:9000", ("::1", 9000)),
        ("0.0.0.0:65535", ("0.0.0.0", 65535)),
    ],
)
def test_parse_address(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize(
    "text", ["7777", ":7777", "host:", "host:port", "host:65536", "host:-1", "host:\u00b2"]
)
def test_parse_address_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="HOST:PORT"):
        parse_address(text)


def test_port_zero_is_for_listening_not_for_connecting() -> None:
    """One parser, two rules: the daemon may listen on port 0 (any free port); nothing can be
    reached there, so a client's target, the load tester's and ``governor drain``'s may not."""
    assert addresses.parse_address("[::1]:0", allow_port_zero=True) == ("::1", 0)
    assert addresses.parse_address("[::1]:1", allow_port_zero=False) == ("::1", 1)
    with pytest.raises(ValueError, match=r"^'\[::1\]:0' is not HOST:PORT$"):
        addresses.parse_address("[::1]:0", allow_port_zero=False)
    assert Config(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0").listen_address[1] == 0
    with pytest.raises(ValueError, match=r"^'127.0.0.1:0' is not HOST:PORT$"):
        asyncio.run(clients.connect("127.0.0.1:0"))
    with pytest.raises(argparse.ArgumentTypeError, match="is not HOST:PORT"):
        parse_addr("127.0.0.1:0")


def test_governor_drain_refuses_port_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert drain("127.0.0.1:0", 1.0) == 1
    assert capsys.readouterr().err == "governor: --metrics-listen '127.0.0.1:0' is not HOST:PORT\n"


def test_every_field_is_a_flag_and_flags_override_the_file(tmp_path: Path) -> None:
    config_file = tmp_path / "g.toml"
    config_file.write_text('max_inflight = 2\nidle_timeout = 5\nmetrics_listen = "127.0.0.1:0"\n')
    parser = build_parser()
    flags = vars(parser.parse_args(["serve"])).keys()
    assert {f.name for f in dataclasses.fields(Config)} - {"tenants"} <= flags
    args = parser.parse_args(["serve", "--config", str(config_file), "--max-inflight", "9"])
    config = config_from_args(args)
    assert config.max_inflight == 9  # the flag wins
    assert config.idle_timeout == 5.0  # an int in TOML is fine for a float key
    assert config.metrics_address == ("127.0.0.1", 0)
    assert config.stub_ms == Config().stub_ms  # untouched keys keep their defaults


def test_the_environment_sets_keys_between_the_file_and_the_flags(tmp_path: Path) -> None:
    config_file = tmp_path / "g.toml"
    config_file.write_text('max_inflight = 2\nidle_timeout = 5\nlisten = "127.0.0.1:7000"\n')
    environ = {
        "GOVERNOR_MAX_INFLIGHT": "3",
        "GOVERNOR_IDLE_TIMEOUT": "7.5",
        "GOVERNOR_LANES": "on",
        "GOVERNOR_HTTP_LISTEN": "0.0.0.0:8000",
        "GOVERNOR_API_KEY": "a client's key, not a setting",
        "MAX_INFLIGHT": "5",  # (no prefix: not ours)
    }
    parser = build_parser()
    args = parser.parse_args(["serve", "--config", str(config_file), "--idle-timeout", "9"])
    config = config_from_args(args, environ)
    assert config.max_inflight == 3  # the environment over the file
    assert config.idle_timeout == 9.0  # the flag over the environment
    assert config.lanes is True
    assert config.http_listen == "0.0.0.0:8000"
    assert config.listen == "127.0.0.1:7000"  # the file's, where the environment says nothing
    assert config_from_args(parser.parse_args(["serve"]), environ).max_inflight == 3


@pytest.mark.parametrize(
    ("variable", "text", "message"),
    [
        ("GOVERNOR_MAX_INFLIGHT", "four", "GOVERNOR_MAX_INFLIGHT: invalid literal"),
        ("GOVERNOR_LANES", "maybe", "GOVERNOR_LANES: 'maybe' is not true or false"),
        ("GOVERNOR_MAX_INFLIGHT", "0", "max_inflight must be at least 1"),
    ],
)
def test_a_bad_environment_value_is_refused_by_name(variable: str, text: str, message: str) -> None:
    args = build_parser().parse_args(["serve"])
    with pytest.raises(ConfigError, match=message):
        config_from_args(args, {variable: text})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_inflight": 0}, "max_inflight must be at least 1"),
        ({"max_inflight": True}, "must be of type int"),
        ({"stub_fail_rate": 1.5}, "stub_fail_rate"),
        ({"idle_timeout": 0}, "idle_timeout must be positive"),
        ({"shutdown_grace": -1}, "must not be negative"),
        ({"log_level": "loud"}, "log_level"),
        ({"metrics_listen": "nowhere"}, "HOST:PORT"),
        ({"nope": 1}, "unknown key 'nope'"),
        ({"ttft_slo_ms": 500.0}, "'ttft_slo_ms' is now 'interactive_ttft_slo_ms'"),
        ({"interactive_tpot_slo_ms": 0}, "interactive_tpot_slo_ms must be positive"),
        ({"heavy_tpot_slo_ms": -1}, "heavy_tpot_slo_ms must not be negative"),
        ({"interactive_stall": 1.5}, "'interactive_stall' is gone: a running chat's steps"),
        ({"interactive_gap_ms": -1}, "interactive_gap_ms must not be negative"),
        ({"min_prompt_chunk": 0}, "min_prompt_chunk must be at least 1"),
        ({"kv_cache_type": "q4_0"}, "kv_cache_type must be one of f16, q8_0"),
        ({"auth_backoff": 10.0}, "'auth_backoff' is gone: failed keys now slow"),
        ({"trusted_sources": "10.0.0.0/8, nowhere"}, "trusted_sources: 'nowhere' is not"),
        ({"auth_guess_rate": 0}, "auth_guess_rate must be positive"),
        ({"auth_guess_burst": 0}, "auth_guess_burst must be at least 1"),
    ],
)
def test_invalid_values_are_refused(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Config.from_mapping(values)


def test_the_slo_policy_is_the_configs() -> None:
    config = Config.from_mapping(
        {"interactive_tpot_slo_ms": 60, "heavy_ttft_slo_ms": 0, "interactive_gap_ms": 250}
    )
    policy = config.slo_policy
    assert policy.lanes[Lane.INTERACTIVE] == Objectives(1000.0, 60.0)
    assert policy.lanes[Lane.HEAVY] == Objectives(0.0, 1000.0)
    assert policy.lanes[Lane.BACKGROUND] == Objectives(60000.0, 2000.0)
    assert (policy.gap_ms(Lane.INTERACTIVE), policy.gap_ms(Lane.HEAVY)) == (250.0, 0.0)
    assert Config().slo_policy == SloPolicy()  # (the config's defaults are the policy's)


LANE_TABLE = """
listen = "127.0.0.1:7777"

[lanes.interactive]
max_cost = 900
reserve = 2
ttft_slo_ms = 500
gap_ms = 300

[lanes.heavy]
slots = 3
max_new_tokens = 512

[lanes.background]
tpot_slo_ms = 4000
"""


def test_the_lane_table_is_the_policys_and_the_flat_names_its_fields(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "governor.toml"
    path.write_text(LANE_TABLE)
    config = Config.load(path, {"max_inflight": 4})
    assert config.lanes  # (a [lanes] table turns them on)
    assert (config.interactive_reserve, config.heavy_slots, config.interactive_gap_ms) == (
        2,
        3,
        300,
    )
    table = config.lane_table
    assert table[Lane.INTERACTIVE] == LaneSettings(max_cost=900.0, max_new_tokens=256)
    assert table[Lane.HEAVY] == LaneSettings(max_cost=12000.0, slots=3, max_new_tokens=512)
    assert table[Lane.BACKGROUND] == LaneSettings(max_new_tokens=1024)
    assert config.slo_policy.lanes[Lane.INTERACTIVE].ttft_ms == 500.0
    assert config.slo_policy.lanes[Lane.BACKGROUND].tpot_ms == 4000.0
    assert build_policy(config, None).lanes == table  # (what the server's policy reads)
    assert not caplog.records
    # The flat names: the same config, each with a warning that names its row.
    flat = tmp_path / "flat.toml"
    flat.write_text("lanes = true\nheavy_slots = 3\ninteractive_reserve = 2\n")
    old = Config.load(flat, {"max_inflight": 4})
    assert (old.lanes, old.heavy_slots, old.interactive_reserve) == (True, 3, 2)
    warned = sorted(r.getMessage() for r in caplog.records)
    assert len(warned) == 2, warned
    assert "'slots' in [lanes.heavy]" in warned[0]
    assert "'reserve' in [lanes.interactive]" in warned[1]
    off = Config.from_mapping({"lanes": {"enabled": False, "heavy": {"slots": 1}}})
    assert (off.lanes, off.heavy_slots) == (False, 1)


@pytest.mark.parametrize(
    ("lanes", "message"),
    [
        ({"urgent": {"slots": 1}}, "not 'urgent'"),
        ({"heavy": {"reserve": 1}}, r"\[lanes.heavy\] has no key 'reserve'"),
        ({"interactive": {"only": True}}, "has no key 'only'"),  # (interactive_only: no row)
        ({"heavy": 3}, "not 'heavy'"),
        ({"heavy": {"slots": "3"}}, "heavy_slots must be of type int"),
        ({"enabled": "yes"}, "lanes must be of type bool"),
    ],
)
def test_a_bad_lane_table_is_refused_by_name(lanes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Config.from_mapping({"lanes": lanes})


def test_a_lane_key_given_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="slots and heavy_slots both given"):
        Config.from_mapping({"heavy_slots": 2, "lanes": {"heavy": {"slots": 3}}})


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        Config.load(tmp_path / "absent.toml")


def test_the_configuration_reference_matches_the_code() -> None:
    reference = (ROOT / "docs" / "CONFIG.md").read_text()
    assert reference_markdown() in reference
    tenants = reference.split("\n## Tenants\n", 1)[1]
    listed = set(re.findall(r"`(\w+)`", "".join(re.findall(r"^\| ([^|]+) \|", tenants, re.M))))
    assert listed == {f.name for f in dataclasses.fields(TenantConfig)}


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return capsys.readouterr().out


def _flags_help(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> dict[str, str]:
    """``governor serve --help``'s text for each flag, on one line."""
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping: a default is never cut in two
    options = _help(["serve"], capsys).split("\noptions:\n", 1)[1]
    entries: list[str] = []
    for line in options.split("\n"):
        if line.startswith("  -"):
            entries.append(line)
        elif line.startswith("   ") and entries:  # (an entry's help, wrapped)
            entries[-1] += " " + line
        # (else a section's title or its description, between its flags and the last's)
    return {entry.split()[0]: " ".join(entry.split()) for entry in entries}


def test_each_flag_shows_its_one_default(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    helps = _flags_help(monkeypatch, capsys)
    for f in CLI_FIELDS:
        text = helps["--" + f.name.replace("_", "-")]
        assert text.count("(default:") == 1, text
        assert text.endswith(f"(default: {default_text(f)})"), text
    assert "(default:" not in helps["--config"]


@pytest.mark.parametrize("f", CLI_FIELDS, ids=[f.name for f in CLI_FIELDS])
def test_a_default_is_shown_as_toml_writes_it(f: dataclasses.Field[object]) -> None:
    text = default_text(f)
    if f.default is None:
        assert text == "unset"
    else:
        assert tomllib.loads(f"value = {text}")["value"] == f.default
        assert type(tomllib.loads(f"value = {text}")["value"]) is type(f.default)


@pytest.mark.parametrize("argv", [[], ["serve"], ["drain"]])
def test_help_is_plain_text_that_cites_no_tracker(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """No Sphinx roles or reST literals (``--help`` prints them raw), and no "issue 13" or "seed
    003": a help says what a thing does and why, not where it was asked for."""
    text = _help(argv, capsys)
    assert "`" not in text
    assert not re.search(r":(class|func|meth|mod|attr):", text)
    assert not re.search(r"(?i)\b(issue|seed)s? #?\d", text)


def test_the_runner_help_names_every_runner() -> None:
    (runner,) = [f for f in dataclasses.fields(Config) if f.name == "runner"]
    for name in RUNNERS:
        assert f"{name} (" in runner.metadata["help"], name


@pytest.mark.parametrize("module", [protocol, clients])
def test_public_names_are_exported(module: types.ModuleType) -> None:
    names: list[str] = module.__all__
    assert len(names) == len(set(names))
    for name in names:
        assert hasattr(module, name), name


KEY_SHA = "8d969eef6ecad3c29a3a629280e686cf0c3f5d5a86aff3ca12020c923adc6c92"  # sha256("123456")


def test_tenants_from_toml(tmp_path: Path) -> None:
    config_file = tmp_path / "g.toml"
    config_file.write_text(
        f"""
[[tenants]]
name = "alpha"
key_sha256 = "{KEY_SHA}"
max_inflight = 2
requests_per_s = 5
lanes = ["interactive"]
"""
    )
    (tenant,) = Config.load(config_file).tenants
    assert (tenant.name, tenant.max_inflight, tenant.requests_per_s, tenant.lanes) == (
        "alpha",
        2,
        5.0,
        ("interactive",),
    )


@pytest.mark.parametrize(
    ("tenants", "message"),
    [
        ([{"name": "a", "key_sha256": "nothex"}], "key_sha256"),
        ([{"name": "a", "key_sha256": KEY_SHA, "colour": 1}], "colour"),
        ([{"name": "a", "key_sha256": KEY_SHA}, {"name": "a", "key_sha256": KEY_SHA}], "unique"),
        ("alpha", "tables"),
    ],
)
def test_bad_tenants_are_refused(tenants: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Config.from_mapping({"tenants": tenants})


def test_every_key_is_in_one_section_and_the_sections_make_the_config() -> None:
    owners = collections.Counter(name for section in SECTIONS for name in section.__annotations__)
    assert set(owners) == {f.name for f in dataclasses.fields(Config)}
    assert set(owners.values()) == {1}
    # The order of --help and the README: the sections', each in its own order.
    assert [f.name for f in CLI_FIELDS] == [
        f.name for section in SECTIONS for f in section_fields(section)
    ]
    assert len(SECTIONS) == 6


@pytest.mark.parametrize(
    ("settings", "layout"),
    [
        ({}, "slots"),  # (4 slots)
        ({"max_inflight": 1}, "slots"),
        ({"max_inflight": 16, "workers": 2}, "slots"),
        ({"max_inflight": 8, "kv_capacity": 20_000}, "pool"),  # (cells said: a pool of them)
        ({"max_inflight": 2, "kv_layout": "slots"}, "slots"),
        ({"max_inflight": 8, "kv_layout": "pool"}, "pool"),
    ],
)
def test_the_kv_layout_auto_gives_a_stream_a_slot_unless_cells_are_said(
    settings: dict[str, object], layout: str
) -> None:
    assert Config(**settings).layout == layout  # type: ignore[arg-type]
