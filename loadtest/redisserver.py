"""Where :class:`~loadtest.support.redisserver.RedisServer` was before the commands and their
shared code were put apart; tests/test_invariants.py still imports it from here. Import it from
:mod:`loadtest.support.redisserver`; this module goes once nothing imports it."""

from .support.redisserver import RedisServer

__all__ = ["RedisServer"]
