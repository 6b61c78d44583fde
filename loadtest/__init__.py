"""Load tests for the governor: ``python -m loadtest COMMAND`` (or ``governor-loadtest``).

Traffic commands (``burst``, ``rate``, ``mix``, ``replay``) send a workload (:mod:`.workload`)
to a target (:mod:`.targets`: the governor, or an OpenAI-compatible server such as the
``baseline``) through the harness in :mod:`.driver`, and leave a report (:mod:`.report`) with
plots and an HTML page (:mod:`.render`); ``compare`` puts reports side by side. Every run is
bounded in time and connects only where it is told.
"""
