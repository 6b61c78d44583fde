"""Load tests for the governor: ``python -m loadtest COMMAND``.

Each command is a sibling module (``burst`` now; ``rate``, ``mix``, ``replay`` and ``compare``
to come) built on the client library in :mod:`clients.client`. Every run is bounded by
``--timeout``, connects only to ``--addr``, prints the daemon's state transitions as a monitor
sees them, then a summary whose last line is one-line JSON.
"""
