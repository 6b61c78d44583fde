"""The ``--help`` of ``governor-cli`` and ``python -m loadtest``: each option's default shown
once, read from the parser itself, what each option takes in one vocabulary (N, MS, SECONDS,
BYTES, HOST:PORT, FILE, URL; :func:`metavar`, ``governor serve``'s too), every text printed
plain, and one wording for a renamed option or command (:func:`deprecated`).

A command's description is often its module's docstring, written for the source's readers in
reStructuredText; argparse would print its markup as it stands. :func:`plain` takes the markup
out, and :class:`DefaultsHelpFormatter` applies it to every text it prints.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

# :role:`target`, :role:`~a.b.name` (shown: name) and :role:`text <target>` (shown: text).
_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(~?)([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)
_STRONG = re.compile(r"\*\*(.+?)\*\*", re.DOTALL)


def _role_text(match: re.Match[str]) -> str:
    short, target = match.groups()
    if target.endswith(">") and "<" in target:
        return target[: target.rindex("<")].rstrip()
    return target.rsplit(".", 1)[-1] if short else target


def plain(text: str) -> str:
    """``text`` without its reStructuredText markup: roles, inline literals, strong emphasis."""
    text = _ROLE.sub(_role_text, text)
    text = _LITERAL.sub(r"\1", text)
    return _STRONG.sub(r"\1", text)


def default_text(value: Any) -> str | None:
    """A parser's default as it would be typed on the command line; None where there is nothing
    to show: no default, a flag's False (or True), an empty list."""
    if value is None or value is argparse.SUPPRESS or isinstance(value, bool):
        return None
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return ",".join(t for v in value if (t := default_text(v)) is not None) or None
    return str(value)


def shown_default(action: argparse.Action) -> str | None:
    """What the help says of ``action``'s default (None: nothing). An action class may say how
    its defaults read with a ``default_text`` of its own."""
    if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
        return None  # a positional that must be given
    render = getattr(action, "default_text", default_text)
    text: str | None = render(action.default)
    return text


# What a value of each parsing function reads as (the functions of loadtest.support.options and
# argparse's own types, by name: clients does not import loadtest).
_TYPE_METAVARS = {
    "int": "N",
    "positive_int": "N",
    "non_negative_int": "N",
    "positive_ints": "N,N,...",
    "float": "NUMBER",
    "positive_float": "NUMBER",
    "share": "NUMBER",
    "parse_addr": "HOST:PORT",
    "parse_addrs": "HOST:PORT,...",
    "Path": "FILE",
}
# Numbers whose name says more than N or NUMBER does.
_NAMED_NUMBERS = ("port", "pid", "seed", "minutes")
_SECONDS = re.compile(r"\bseconds\b", re.IGNORECASE)


def metavar(name: str, kind: str, help_text: str) -> str:
    """What an option ``name`` (its dest) of ``kind`` (its type's name) takes, as its help
    shows it: a unit (MS, BYTES, SECONDS), an address, a URL or a file, N for a count, NUMBER
    for another number; else its name in capitals (MODEL, NAME: a text)."""
    if name.endswith("_ms"):
        return "MS"
    if name.endswith("_bytes"):
        return "BYTES"
    if name.endswith(("listen", "addr")):
        return "HOST:PORT"
    if name.endswith("url") or name == "upstream" or re.search(r"\bURL\b", help_text):
        return "URL"
    number = _TYPE_METAVARS.get(kind)
    if number in ("N", "NUMBER"):
        if name in _NAMED_NUMBERS:
            return name.upper()
        if name.endswith(("_s", "timeout")) or _SECONDS.search(help_text):
            return "SECONDS"
    if number == "FILE" and re.search(r"\bdirectory\b", help_text):
        return "DIR"
    if number is None and re.search(r"\bfile\b", help_text):
        return "FILE"
    return number or name.upper()


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Each option's help ends with ``(default: X)``, X taken from the parser's own default, so
    that the help cannot name another value than the one a run uses. A default of None shows
    nothing: the option's help may say in words what happens without it. Every text is printed
    without reStructuredText markup (:func:`plain`)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = None if action.help is None else plain(action.help)
        shown = shown_default(action)
        if shown is None:
            return text
        return f"{text or ''} (default: {shown.replace('%', '%%')})".lstrip()

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        kind = getattr(action.type, "__name__", "str")
        return metavar(action.dest, kind, action.help or "")


class RawDescriptionDefaultsHelpFormatter(
    DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter
):
    """:class:`DefaultsHelpFormatter`, with the description's lines printed as written."""


class _Renamed(argparse.Action):
    """An option's old spelling: still taken, with a warning naming the new one."""

    def __init__(self, option_strings: list[str], dest: str, *, new: str, **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        deprecated(parser.prog, str(option_string), self.new)
        setattr(namespace, self.dest, values)


def deprecated(program: str, old: str, new: str) -> None:
    """Say on stderr that ``old`` (an option or a command) is now ``new`` and that the old
    spelling goes in the next release; one wording for every renamed thing."""
    print(
        f"{program}: {old} is deprecated and goes in the next release: use {new}",
        file=sys.stderr,
    )


def add_renamed(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, old: str, action: argparse.Action
) -> None:
    """Take ``old``, an option renamed ``action``'s first spelling, for one more release: it
    sets the same value, warns on stderr and is left out of ``--help``."""
    kwargs: dict[str, Any] = {"type": action.type} if action.type is not None else {}
    parser.add_argument(
        old,
        dest=action.dest,
        action=_Renamed,
        new=action.option_strings[0],
        help=argparse.SUPPRESS,
        **kwargs,
    )


class HelpParser(argparse.ArgumentParser):
    """A parser whose help shows the defaults (:class:`DefaultsHelpFormatter`, or a subclass
    asked for); given as ``parser_class`` to ``add_subparsers``, every subcommand's too."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(**kwargs)


__all__ = [
    "DefaultsHelpFormatter",
    "HelpParser",
    "RawDescriptionDefaultsHelpFormatter",
    "add_renamed",
    "default_text",
    "deprecated",
    "metavar",
    "plain",
    "shown_default",
]
