"""Each key's declared bounds, held: generated over the fields, so that a bound declared is a bound
tested (a value just past it refused, naming the key; one at it accepted)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from governor.config import FIELDS, Config, ConfigError

# The least step past a bound: integers move by one, floats by a little.
STEP = {"int": 1, "float": 1e-6}
# Values a bound alone does not make valid: the rules between keys want these beside them.
BESIDE: dict[str, dict[str, Any]] = {"lease_ttl": {"fleet_timeout": 1e-7}}
# The keys whose values a test of their own (``check``) judges: (refused, accepted).
CHECKED: dict[str, tuple[Any, Any]] = {
    "listen": ("nowhere", "[::1]:0"),
    "http_listen": ("127.0.0.1", "127.0.0.1:0"),
    "metrics_listen": ("127.0.0.1:65536", "localhost:9464"),
    "n_gpu_layers": (-2, -1),
    "upstream": ("ftp://example.com", "https://example.com"),
    "redis_url": ("http://example.com", "unix:///run/redis.sock"),
    "fleet_fail_open": ("chat", "heavy, background"),
    "trusted_sources": ("10.0.0.0/8, nowhere", "10.0.0.0/8, ::1"),
}
# Numbers with no bound declared: any value is taken. A new numeric key names its bound, or
# joins this list knowingly.
UNBOUNDED = {
    "stub_prompt_ms",
    "stub_output_ms",
    "interactive_max_cost",
    "heavy_max_cost",
    "overload_dwell",
}


def _fields_with(bound: str) -> list[dataclasses.Field[Any]]:
    """The fields that declare ``bound``."""
    if bound in ("min", "max", "check"):  # a min of 0 is declared: only None is not
        return [f for f in FIELDS if f.metadata[bound] is not None]
    return [f for f in FIELDS if f.metadata[bound]]


def _config(name: str, value: Any) -> Config:
    return Config(**{**BESIDE.get(name, {}), name: value})


def _refused(name: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"^{name}\b"):
        _config(name, value)


def _ids(fields: list[dataclasses.Field[Any]]) -> list[str]:
    return [f.name for f in fields]


@pytest.mark.parametrize("f", _fields_with("min"), ids=_ids(_fields_with("min")))
def test_min_is_held(f: dataclasses.Field[Any]) -> None:
    low = f.metadata["min"]
    _refused(f.name, low - STEP[str(f.type)])
    assert getattr(_config(f.name, low), f.name) == low


@pytest.mark.parametrize("f", _fields_with("max"), ids=_ids(_fields_with("max")))
def test_max_is_held(f: dataclasses.Field[Any]) -> None:
    low, high = f.metadata["min"], f.metadata["max"]
    _refused(f.name, high + STEP[str(f.type)])
    if low is not None:  # a range is named whole
        with pytest.raises(ConfigError, match=rf"^{f.name} must be within \[{low}, {high}\]$"):
            _config(f.name, high + STEP[str(f.type)])
    assert getattr(_config(f.name, high), f.name) == high


@pytest.mark.parametrize("f", _fields_with("positive"), ids=_ids(_fields_with("positive")))
def test_positive_is_held(f: dataclasses.Field[Any]) -> None:
    step = STEP[str(f.type)]
    _refused(f.name, 0)
    _refused(f.name, -step)
    assert getattr(_config(f.name, step), f.name) == step


@pytest.mark.parametrize("f", _fields_with("choices"), ids=_ids(_fields_with("choices")))
def test_choices_are_held(f: dataclasses.Field[Any]) -> None:
    assert f.default in f.metadata["choices"]
    for choice in f.metadata["choices"]:
        assert getattr(_config(f.name, choice), f.name) == choice
    _refused(f.name, "nope")


def test_every_check_has_its_examples() -> None:
    assert set(CHECKED) == {f.name for f in _fields_with("check")}


@pytest.mark.parametrize(("name", "examples"), CHECKED.items(), ids=list(CHECKED))
def test_checks_are_held(name: str, examples: tuple[Any, Any]) -> None:
    refused, accepted = examples
    _refused(name, refused)
    assert getattr(_config(name, accepted), name) == accepted


def test_every_number_is_bounded_or_knowingly_not() -> None:
    numbers = {f.name for f in FIELDS if str(f.type) in STEP}
    bounded = {f.name for bound in ("min", "max", "positive", "check") for f in _fields_with(bound)}
    assert numbers - bounded == UNBOUNDED


def test_every_default_is_within_its_bounds() -> None:
    Config()  # (the loop holds the defaults too; this says so where it would fail first)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"tls_cert": "c.pem"}, "^tls_cert and tls_key go together$"),
        ({"tls_client_ca": "ca.pem"}, "^tls_client_ca needs tls_cert and tls_key$"),
        ({"tls_require_client_cert": True}, "^tls_require_client_cert needs tls_client_ca$"),
        ({"workers": 5, "max_inflight": 4}, r"^workers must not exceed max_inflight"),
        ({"kv_capacity": 2047}, "^kv_capacity must hold n_ctx tokens in each worker's cache$"),
        ({"kv_layout": "slots", "kv_capacity": 8192}, "^kv_layout slots gives each slot n_ctx"),
        ({"lanes": True, "interactive_reserve": 4}, "^interactive_reserve must leave"),
        ({"fleet_timeout": 10.0}, "^fleet_timeout must be shorter than lease_ttl$"),
    ],
)
def test_the_rules_between_keys(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Config(**values)


@pytest.mark.parametrize(
    "values",
    [
        {"workers": 4, "max_inflight": 4},
        {"kv_capacity": 2047, "runner": "stub"},  # a notional budget: no worker's cache to fill
        {"kv_capacity": 2048},
        {"lanes": True, "interactive_reserve": 3},
        {"interactive_reserve": 4},  # without lanes there is no reserve
        {"fleet_timeout": 9.99},
    ],
)
def test_the_rules_let_through_what_they_allow(values: dict[str, Any]) -> None:
    Config(**values)
