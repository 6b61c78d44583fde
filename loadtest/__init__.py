"""Load tests for the governor: ``python -m loadtest COMMAND`` (or ``governor-loadtest``).

:mod:`.cli` registers the commands, one module each in :mod:`.commands`; what they share is in
:mod:`.support`. Traffic commands (``burst``, ``rate``, ``mix``, ``replay``) send a workload
(:mod:`.support.workload`) to a target (:mod:`.support.targets`: the governor, or an
OpenAI-compatible server such as the ``baseline``) through the harness in
:mod:`.support.driver`, and leave a report (:mod:`.support.report`) with plots and an HTML page
(:mod:`.support.render`); ``compare`` puts reports side by side. Every run is bounded in time
and connects only where it is told.
"""
