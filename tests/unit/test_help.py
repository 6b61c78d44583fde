"""Every ``--help`` of ``governor``, ``governor-cli`` and ``python -m loadtest``, each command
included: plain text (``--help`` prints reST markup as it stands), each default shown once, as
it is typed, and no citation of a tracker or of files outside the repository (a help says what a
thing does, not where it was asked for)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.cli import build_parser as client_parser
from clients.helptext import DefaultsHelpFormatter, plain, shown_default
from governor.cli import build_parser as governor_parser
from governor.config import CLI_FIELDS
from loadtest.cli import build_parser as loadtest_parser

WIDE = 100_000  # no wrapping: a default or a citation is never cut in two
MARKUP = re.compile(r"``|:[a-z]+(:[a-z]+)?:`")
CITATION = re.compile(r"(?i)\bissues? #?\d|\bseeds? 0\d|\.\./shared")
BOOLEAN_DEFAULT = re.compile(r"\(default: (True|False)\)")


def walk(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every subcommand's parser below it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from walk(sub)


PARSERS = {
    p.prog: p for build in (governor_parser, client_parser, loadtest_parser) for p in walk(build())
}


def formatter(parser: argparse.ArgumentParser) -> argparse.HelpFormatter:
    return parser.formatter_class(prog=parser.prog, width=WIDE)  # type: ignore[call-arg]


def formatted(parser: argparse.ArgumentParser) -> str:
    """``parser``'s whole help as ``--help`` prints it, but unwrapped, on one line."""
    f = formatter(parser)
    f.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    f.add_text(parser.description)
    for group in parser._action_groups:
        f.start_section(group.title)
        f.add_text(group.description)
        f.add_arguments(group._group_actions)
        f.end_section()
    f.add_text(parser.epilog)
    return " ".join(f.format_help().split())


def entries(parser: argparse.ArgumentParser) -> Iterator[tuple[argparse.Action, str]]:
    """Each option or positional of ``parser`` and its entry in the help, on one line."""
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        f = formatter(parser)
        f.add_argument(action)
        yield action, " ".join(f.format_help().split())


def problems(parser: argparse.ArgumentParser) -> list[str]:
    """What is wrong with ``parser``'s help: a second default, a default in Python's words
    (True, False), markup, a citation."""
    found = [
        f"{parser.prog}: {text}"
        for _, text in entries(parser)
        if text.count("(default:") > 1 or BOOLEAN_DEFAULT.search(text)
    ]
    text = formatted(parser)
    found += [f"{parser.prog}: {m.group()!r}" for m in MARKUP.finditer(text)]
    found += [f"{parser.prog}: {m.group()!r}" for m in CITATION.finditer(text)]
    return found


def missing_defaults(parser: argparse.ArgumentParser) -> list[str]:
    """Each option with a default to show (not None, not a flag's False, not an empty list)
    whose help does not show it, as the parser holds it."""
    return [
        f"{parser.prog}: {text}"
        for action, text in entries(parser)
        if action.default not in (None, False, [])
        and f"(default: {shown_default(action)})" not in text
    ]


def test_every_program_and_command_is_walked() -> None:
    assert {"governor", "governor serve", "governor drain"} <= set(PARSERS)
    assert {"governor-cli", "governor-cli ping", "governor-cli generate"} <= set(PARSERS)
    assert {"python -m loadtest", "python -m loadtest bench fleet"} <= set(PARSERS)
    assert len(PARSERS) > 25


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_help_is_plain_with_one_default_an_entry_and_no_citation(prog: str) -> None:
    assert problems(PARSERS[prog]) == []


@pytest.mark.parametrize("prog", sorted(p for p in PARSERS if p.startswith("governor-cli")))
def test_each_client_default_is_shown(prog: str) -> None:
    assert missing_defaults(PARSERS[prog]) == []


def test_the_client_defaults_read_as_typed() -> None:
    shown = {
        (prog, action.option_strings[0]): text
        for prog, parser in PARSERS.items()
        if prog.startswith("governor-cli")
        for action, text in entries(parser)
        if action.option_strings
    }
    assert "(default: 120 for generate, a generation on a busy CPU; 20 otherwise)" in " ".join(
        shown["governor-cli", "--timeout"].split()
    )
    assert "(default: 128)" in shown["governor-cli generate", "--max-new-tokens"]
    assert "(default: 0.8)" in shown["governor-cli generate", "--temperature"]
    assert "(default: 8192)" in shown["governor-cli upload", "--chunk-bytes"]
    assert "(default:" not in shown["governor-cli generate", "--stream"]


def test_the_checks_catch_what_they_look_for() -> None:
    # A formatter that adds a default after a help that has one, Python's True, markup in a
    # description, a citation in a help, and an option whose default is not shown.
    bad = argparse.ArgumentParser(
        prog="p",
        description="Runs :class:`a.B` and ``x``.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bad.add_argument("--n", type=int, default=4, help="a number (default: 4)")
    bad.add_argument("--on", type=bool, default=True, help="on or off")
    bad.add_argument("--path", default="x", help="as issue 13 and ../shared/x ask")
    assert problems(bad) == [
        "p: --n N a number (default: 4) (default: 4)",
        "p: --on ON on or off (default: True)",
        "p: ':class:`'",
        "p: '``'",
        "p: '``'",
        "p: 'issue 1'",
        "p: '../shared'",
    ]
    quiet = argparse.ArgumentParser(prog="q")
    quiet.add_argument("--n", type=int, default=4, help="a number")
    quiet.add_argument("--flag", action="store_true", help="a flag")
    assert missing_defaults(quiet) == ["q: --n N a number"]


def test_plain_takes_the_markup_out() -> None:
    assert plain(":class:`governor.config.Config`") == "governor.config.Config"
    assert plain(":meth:`~clients.fleet.FleetClient.ping_all`") == "ping_all"
    assert plain(":ref:`the table <config-table>`") == "the table"
    assert plain("``--addr`` and **seed**, ``a`` b") == "--addr and seed, a b"
    assert plain("a `single` quote stays") == "a `single` quote stays"
    parser = argparse.ArgumentParser(
        prog="p", description="``p``: :mod:`x.y`", formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("--n", type=int, default=4, help="``N`` things")
    assert "p: x.y" in parser.format_help()
    assert "N things (default: 4)" in parser.format_help()


def test_serve_shows_each_flags_choices_booleans_and_units() -> None:
    serve = formatted(PARSERS["governor serve"])
    for f in CLI_FIELDS:
        flag = "--" + f.name.replace("_", "-")
        if f.metadata["choices"]:
            assert f"{flag} {{{','.join(f.metadata['choices'])}}}" in serve, flag
        elif str(f.type) == "bool":
            assert f"{flag} {{true,false}}" in serve, flag
        units = {"_timeout": "SECONDS", "_ms": "MS", "_bytes": "BYTES", "listen": "HOST:PORT"}
        for suffix, unit in units.items():
            if f.name.endswith(suffix):
                assert f"{flag} {unit}" in serve, flag


UNITS = {"_ms": "MS", "_bytes": "BYTES", "_s": "SECONDS", "timeout": "SECONDS"}


def shown_metavar(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """What ``action`` takes, as ``parser``'s help shows it after the option."""
    f = formatter(parser)
    default = f._get_default_metavar_for_optional(action)
    return f._format_args(action, default)


def test_every_option_says_what_it_takes_in_one_vocabulary() -> None:
    """Across the three CLIs: a number shows N, NUMBER, a unit or its own name, never its dest
    in capitals (TTL_MS, CHUNK_BYTES); a dest's unit is its metavar's; addresses HOST:PORT."""
    for prog, parser in PARSERS.items():
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0 or action.help == argparse.SUPPRESS:
                continue
            shown, name = shown_metavar(parser, action), action.dest
            where = f"{prog} {action.option_strings[-1]}: {shown}"
            if action.choices is None and getattr(action.type, "__name__", "") in ("int", "float"):
                assert shown != name.upper() or name in ("port", "pid", "seed"), where
            for suffix, unit in UNITS.items():
                if name.endswith(suffix) and not name.endswith("_ms_s"):
                    assert unit in shown, where
            if name.endswith(("listen", "addr")):
                assert "HOST:PORT" in shown, where


def test_the_metavar_vocabulary() -> None:
    parser = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    options = {
        "--ttl-ms": {"type": int},
        "--chunk-bytes": {"type": int},
        "--hold": {"type": float, "help": "seconds they are held"},
        "--kill-every-s": {"type": float},
        "--rounds": {"type": int},
        "--time-scale": {"type": float},
        "--out": {"type": Path, "help": "the directory to write to"},
        "--report": {"type": Path},
        "--addr": {},
        "--openai": {"help": "the server's base URL"},
        "--model": {"help": "a GGUF file"},
        "--name": {},
        "--port": {"type": int},
    }
    for option, kwargs in options.items():
        parser.add_argument(option, **kwargs)  # type: ignore[arg-type]
    usage = parser.format_usage()
    for expected in (
        "--ttl-ms MS",
        "--chunk-bytes BYTES",
        "--hold SECONDS",
        "--kill-every-s SECONDS",
        "--rounds N",
        "--time-scale NUMBER",
        "--out DIR",
        "--report FILE",
        "--addr HOST:PORT",
        "--openai URL",
        "--model FILE",
        "--name NAME",
        "--port PORT",
    ):
        assert expected in usage, expected


def test_a_renamed_option_still_works_for_a_release_and_says_its_new_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = governor_parser().parse_args(["drain", "--metrics-addr", "127.0.0.1:9"])
    assert args.metrics_listen == "127.0.0.1:9"
    assert "--metrics-addr is deprecated" in capsys.readouterr().err
    assert "--metrics-addr" not in formatted(PARSERS["governor drain"])
    bench = loadtest_parser().parse_args(["bench", "sdk-bench", "--timeout", "7"])
    assert bench.request_timeout == 7.0
    assert "use --request-timeout" in capsys.readouterr().err


def test_timeout_is_always_the_whole_call_or_run() -> None:
    """One meaning of --timeout across the CLIs: the bound on the whole command; a round's, a
    run's or a request's bound has a name of its own."""
    for prog, parser in PARSERS.items():
        for action in parser._actions:
            if "--timeout" in action.option_strings and action.help != argparse.SUPPRESS:
                assert re.search(r"\bwhole (call|run)\b", action.help or ""), prog
