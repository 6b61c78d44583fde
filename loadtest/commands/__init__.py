"""The commands of ``python -m loadtest``, one module each.

A command module has ``NAME`` (the subcommand), ``add_parser`` (its options) and ``run`` (the
parsed options in, the exit status out); :mod:`loadtest.cli` registers every one from a single
list. Commands share code only through :mod:`loadtest.support`, never by importing each other.
"""
