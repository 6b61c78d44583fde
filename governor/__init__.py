"""governor: an ingress governor for LLM inference.

Find your way in, from the bottom layer up (``tests/unit/test_layout.py`` holds the layers):

* ``protocol/`` (a top-level package): the sans-IO codec shared with the clients.
* :mod:`governor.core`: the pure decisions. :mod:`governor.core.admission` decides whether a
  job runs now; :mod:`governor.core.ledger` holds the hard cap and times the retry hints.
* :mod:`governor.runners`: what executes admitted jobs, behind the ``Runner`` seam.
* :mod:`governor.ops`: health, metrics, logs.
* :mod:`governor.listeners`: the doors. :mod:`governor.listeners.session` is one TCP
  connection's protocol, sans-IO, :mod:`governor.listeners.http_session` one HTTP connection's;
  :mod:`governor.listeners.tcp` and :mod:`governor.listeners.http` move their bytes.
* :mod:`governor.intake`: what both doors do alike with a job: authenticate, submit, start,
  take back a fleet refusal; :mod:`governor.execution`: one admitted job's run.
* :mod:`governor.server`: the daemon's lifecycle (start, serve, drain, stop).
"""

__version__ = "0.1.0"
