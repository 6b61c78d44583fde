"""The user's tools of ``python -m loadtest``, one module each, or for a long one a package (the
command in its ``__init__``, its parts beside it); the project's benchmarks are
:mod:`loadtest.bench`'s.

A command module has ``NAME`` (the subcommand), ``add_parser`` (its options) and ``run`` (the
parsed options in, the exit status out); :mod:`loadtest.cli` registers every one from a single
list. Commands share code only through :mod:`loadtest.support`, never by importing each other.
"""
