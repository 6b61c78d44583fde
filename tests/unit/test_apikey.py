"""The API key's one reading for governor-cli and the load tests (``--api-key``, else
``GOVERNOR_API_KEY``), and the places that must never show it: help, reprs, reports."""

from __future__ import annotations

import argparse

import pytest

from clients import apikey
from clients.cli import build_parser as cli_parser
from governor import cli as governor_cli
from loadtest.cli import build_parser as loadtest_parser
from loadtest.support.connections import endpoint_from
from loadtest.support.traffic import settings_of

SECRET = "k-unit-7d1e"


def parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    apikey.add_arguments(parser)
    return parser.parse_args(argv)


def test_the_flag_wins_and_an_empty_variable_is_unset() -> None:
    env = {apikey.ENV: "from-env"}
    assert apikey.key_from(parsed("--api-key", "from-flag"), env) == "from-flag"
    assert apikey.key_from(parsed(), env) == "from-env"
    assert apikey.key_from(parsed(), {apikey.ENV: ""}) is None
    assert apikey.key_from(parsed(), {}) is None


def test_a_key_no_governor_takes_is_refused_without_showing_it() -> None:
    with pytest.raises(apikey.APIKeyError, match="--api-key is empty"):
        apikey.key_from(parsed("--api-key", ""), {})
    with pytest.raises(apikey.APIKeyError) as caught:
        apikey.key_from(parsed(), {apikey.ENV: "z" * 257})
    assert str(caught.value) == "GOVERNOR_API_KEY is 257 characters long; a key has at most 256"
    assert apikey.key_from(parsed(), {apikey.ENV: "z" * 256}) == "z" * 256


def test_the_daemon_names_the_clients_variable() -> None:
    assert governor_cli.API_KEY_ENV == apikey.ENV


def test_no_help_shows_the_environments_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(apikey.ENV, SECRET)
    for parser, argv in (
        (cli_parser(), ["ping"]),
        (loadtest_parser(), ["burst", "--addr", "127.0.0.1:9"]),
        (loadtest_parser(), ["idle"]),
        (loadtest_parser(), ["attack", "lockout"]),
    ):
        args = parser.parse_args(argv)
        assert args.api_key is None  # read by key_from, never a parser default
    assert SECRET not in cli_parser().format_help()
    commands = next(
        a for a in loadtest_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    for name in ("burst", "rate", "mix", "replay", "idle", "attack"):
        help_text = commands.choices[name].format_help()
        assert "--api-key KEY" in help_text, name
        assert SECRET not in help_text


def test_the_key_reaches_the_endpoint_but_not_its_repr_or_the_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(apikey.ENV, SECRET)
    for argv in (["burst"], ["burst", "--api-key", SECRET]):
        args = loadtest_parser().parse_args(argv)
        endpoint = endpoint_from(args)
        assert endpoint.api_key == SECRET
        assert SECRET not in repr(endpoint)
        assert "api_key" not in settings_of(args)
        assert SECRET not in repr(settings_of(args))
