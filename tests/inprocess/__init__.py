"""An in-process server on real sockets: the doors, their invariants, hostile clients."""
