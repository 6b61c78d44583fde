"""What the commands' parsers share: option types (addresses, positive numbers, lists of them).
Their help (each default shown once, read from the parser) is :mod:`clients.helptext`'s."""

from __future__ import annotations

import argparse
import json
from typing import Any

from clients.helptext import HelpParser, deprecated
from protocol.addresses import parse_address

DEFAULT_ADDR = "127.0.0.1:7777"


def parse_addr(text: str) -> tuple[str, int]:
    """``HOST:PORT`` of a daemon to connect to, for argparse (port 0 is no such address)."""
    try:
        return parse_address(text, allow_port_zero=False)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_addrs(text: str) -> list[tuple[str, int]]:
    """One or more comma-separated ``HOST:PORT``, for argparse (with :class:`AddressList`)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"{text!r} names no HOST:PORT")
    return [parse_addr(part) for part in parts]


class AddressList(argparse.Action):
    """``--addr``, repeatable and comma-separated: ``addr`` is the first address (the one
    governor of a single-address run, as before), ``addrs`` every one given (not set at all
    when the option was not given)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        addrs = [*(getattr(namespace, "addrs", None) or []), *values]
        namespace.addrs = addrs
        setattr(namespace, self.dest, addrs[0])

    @staticmethod
    def default_text(value: tuple[str, int]) -> str:
        """The default (one parsed address) as it would be typed, for :func:`clients.helptext.shown_default`."""
        host, port = value
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def positive_ints(text: str) -> tuple[int, ...]:
    """``1,4,8,16`` for argparse: positive integers, in the order given, no repeats."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list like 1,4,8") from None
    if not values or min(values) < 1 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: positive integers, each once")
    return values


class CommandParser(HelpParser):
    """A command's parser: its help shows the defaults, and every command takes ``--json``.

    ``group``: the parser of a group of commands (``bench``), which takes no ``--json`` of its
    own. ``renamed_to``: this parser is a moved command's old spelling, kept for one release;
    taking it says the new one on stderr (``--help`` included)."""

    def __init__(
        self, *, group: bool = False, renamed_to: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.renamed_to = renamed_to
        if not group:
            self.add_argument(
                "--json",
                action="store_true",
                help="end stdout with the run's report as one line of JSON, for scripts",
            )

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self.renamed_to is not None:
            program, _, old = self.prog.rpartition(" ")
            deprecated(program, repr(old), repr(self.renamed_to))
        return super().parse_known_args(args, namespace)


def print_json(args: argparse.Namespace, report: Any) -> None:
    """The run's report as the last line of stdout, when ``--json`` asks for it."""
    if args.json:
        print(json.dumps(report), flush=True)
