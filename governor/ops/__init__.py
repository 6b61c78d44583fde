"""What operators see: health and readiness (:mod:`.health`) and the Prometheus exporter
(:mod:`.exporter`), read from the server's state and :mod:`governor.telemetry`."""
