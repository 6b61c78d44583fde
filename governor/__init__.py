"""governor: an ingress governor for LLM inference.

Find your way in:

* ``protocol/`` (a top-level package): the sans-IO codec shared with the clients.
* :mod:`governor.core.ledger`: the admission ledger, the hard cap and the retry hint.
* :mod:`governor.listeners.tcp`: one client connection, from bytes to admission and back.
* :mod:`governor.intake`: what both doors (TCP, HTTP) do alike with a job: authenticate,
  submit, start, take back a fleet refusal.
* :mod:`governor.server`: the daemon's lifecycle (start, serve, drain, stop).
* :mod:`governor.runners`: what executes admitted jobs.
"""

__version__ = "0.1.0"
