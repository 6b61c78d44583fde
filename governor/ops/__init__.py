"""What operators see: health and readiness (:mod:`.health`), metrics (:mod:`.metrics`,
:mod:`.exporter`), structured logs (:mod:`.logs`) and the process's memory (:mod:`.memory`)."""
