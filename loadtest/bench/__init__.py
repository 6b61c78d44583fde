"""The project's own benchmarks, ``python -m loadtest bench COMMAND``, one module each (or, for
a long one, a package: the command in its ``__init__``, its parts in modules beside it).

Each one starts the servers it measures (the governor, a peer to compare it with, a model
server) on loopback ports of its own. A benchmark module has what a command module of
:mod:`loadtest.commands` has (``NAME``, ``add_parser``, ``run``) and shares code only through
:mod:`loadtest.support`, never by importing another command or benchmark.
"""
