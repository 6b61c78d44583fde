"""``python -m loadtest COMMAND --help``: every option with a default shows it once, as the parser
holds it (the help text takes it from the parser, never from a copy written by hand)."""

from __future__ import annotations

import argparse
from typing import cast

import pytest

from clients.helptext import (
    DefaultsHelpFormatter,
    RawDescriptionDefaultsHelpFormatter,
    default_text,
    shown_default,
)
from loadtest.cli import BENCHMARKS, COMMANDS, GROUP, REGISTERED, build_parser
from loadtest.support.options import AddressList


def choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``parser``'s subcommands, by name."""
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(commands.choices)


def subparsers() -> dict[str, argparse.ArgumentParser]:
    """Each command's parser: the user's tools at the top, the benchmarks under ``bench``."""
    top = choices(build_parser())
    return {**{c.NAME: top[c.NAME] for c in REGISTERED}, **choices(top[GROUP])}


def rendered(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """``action``'s entry in ``parser``'s help, on one line (no wrapping to split a default)."""
    formatter = formatter_class(parser)(prog=parser.prog, width=100_000)
    formatter.add_argument(action)
    return " ".join(formatter.format_help().split())


def formatter_class(parser: argparse.ArgumentParser) -> type[argparse.HelpFormatter]:
    return cast(type[argparse.HelpFormatter], parser.formatter_class)


def default_problems(parser: argparse.ArgumentParser) -> list[str]:
    """Each option whose help does not show its default exactly once, as the parser holds it."""
    problems = []
    if not issubclass(formatter_class(parser), DefaultsHelpFormatter):
        problems.append(f"{parser.prog}: {formatter_class(parser).__name__} shows no defaults")
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        text = rendered(parser, action)
        count = text.count("(default:")
        shown = shown_default(action)
        if shown is None:
            # No default to read: the help may say once, in words, what happens without it.
            if count > 1:
                problems.append(f"{parser.prog} {name}: {count} defaults in {text!r}")
        elif count != 1 or f"(default: {shown})" not in text:
            problems.append(f"{parser.prog} {name}: not '(default: {shown})' once in {text!r}")
    return problems


def listed(parser: argparse.ArgumentParser) -> list[str]:
    """The subcommands ``parser``'s ``--help`` lists."""
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [choice.dest for choice in commands._choices_actions]


def test_every_command_is_listed() -> None:
    assert set(subparsers()) == set(COMMANDS)
    parser = build_parser()
    assert listed(parser) == [*(c.NAME for c in REGISTERED), GROUP]
    assert listed(choices(parser)[GROUP]) == [c.NAME for c in BENCHMARKS]
    assert {"burst", "rate", "fleet", "fleet-bench", "sdk-bench", "generation"} <= set(COMMANDS)
    shown = [a for p in subparsers().values() for a in p._actions if shown_default(a) is not None]
    assert len(shown) > 150  # (the check below has options to look at)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_default_is_shown_once_as_the_parser_holds_it(name: str) -> None:
    parser = subparsers()[name]
    assert default_problems(parser) == []


def test_the_check_catches_a_default_written_by_hand_or_left_out() -> None:
    parser = argparse.ArgumentParser(prog="p", formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--fine", type=int, default=3, help="a number")
    parser.add_argument("--twice", type=int, default=3, help="a number (default: 3)")
    parser.add_argument("--stale", type=int, default=3, help="a number (default: 4)")
    parser.add_argument("--silent", type=int, default=3)  # no help: argparse prints nothing
    parser.add_argument("--described", help="a file (default: the embedded one)")
    assert [p.split(":")[0] for p in default_problems(parser)] == [
        "p --twice",
        "p --stale",
        "p --silent",
    ]
    plain = argparse.ArgumentParser(prog="q")
    plain.add_argument("--n", type=int, default=3, help="a number (default: 3)")
    assert default_problems(plain) == ["q: HelpFormatter shows no defaults"]


def test_defaults_read_as_they_would_be_typed() -> None:
    assert default_text(10_000) == "10000"
    assert default_text(20.0) == "20"
    assert default_text(0.05) == "0.05"
    assert default_text((1, 4, 8, 16)) == "1,4,8,16"
    assert default_text(["naive", "breaker"]) == "naive,breaker"
    assert default_text("poisson") == "poisson"
    nothings: tuple[object, ...] = (None, False, True, [], ())
    for nothing in nothings:
        assert default_text(nothing) is None
    assert AddressList.default_text(("127.0.0.1", 7777)) == "127.0.0.1:7777"
    assert AddressList.default_text(("::1", 7777)) == "[::1]:7777"


def test_a_benchmarks_old_spelling_still_runs_it_for_a_release_with_a_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Not listed (above), but taken: the same options, and one line on stderr naming the new one.
    new = build_parser().parse_args(["bench", "fleet", "--replicas", "2"])
    assert capsys.readouterr().err == ""
    old = build_parser().parse_args(["fleet", "--replicas", "2"])
    assert capsys.readouterr().err == (
        "python -m loadtest: 'fleet' is deprecated and goes in the next release: use 'bench fleet'\n"
    )
    assert (old.command, new.command, new.benchmark) == ("fleet", GROUP, "fleet")
    assert vars(old) == {k: v for k, v in vars(new).items() if k != "benchmark"} | {
        "command": "fleet"
    }
    old_names = set(choices(build_parser())) - {c.NAME for c in REGISTERED} - {GROUP}
    assert old_names == {c.NAME for c in BENCHMARKS}


def test_a_default_typed_as_text_reaches_the_command_parsed() -> None:
    # Defaults given as the text a user would type go through the option's type, as typed text
    # does: the run sees the same values as before.
    args = build_parser().parse_args(["rate"])
    assert args.prompt_tokens == (64, 64)
    assert args.output_tokens == (16, 16)
    assert args.rate == [2.0]
    assert args.addr == ("127.0.0.1", 7777)
    assert build_parser().parse_args(["mix"]).rate == [1.0]
    assert build_parser().parse_args(["attack", "lockout"]).addr == ("127.0.0.1", 7777)
    assert build_parser().parse_args(["idle"]).addr == ("127.0.0.1", 7777)


def test_a_percent_sign_in_a_default_is_printed_as_is() -> None:
    parser = argparse.ArgumentParser(prog="p", formatter_class=RawDescriptionDefaultsHelpFormatter)
    parser.add_argument("--share", default="3%", help="busy at most")
    assert "busy at most (default: 3%)" in parser.format_help()
