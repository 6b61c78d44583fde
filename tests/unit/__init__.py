"""Pure tests: the codec, the decisions, the config and the layout; no socket, no process."""
