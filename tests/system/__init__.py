"""Real processes: the daemon, the embedded model, a real Redis, the load tests."""
