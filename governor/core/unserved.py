"""Unserved demand: the jobs turned away, each counted once however often its client retries.

The yield totals count refusals, so they grow with the clients' retry policy (a client that
retries 15 times counts 15 times), not with demand. An autoscaler needs the demand itself: how
many distinct jobs were turned away, and how many tokens they asked for, per lane and tenant;
and how many of them were never served (their client left, or stopped coming back).

A job is one :class:`~governor.core.admission.Attempt`, which each door keeps across its
client's retries (a TCP job by its id on its connection, an HTTP request by the place kept for
it); admission tells this ledger of each job's first refusal (:meth:`turned_away`), and the
door of a job that will not be served (:meth:`gave_up`). A job turned away and then admitted is
not counted again, nor is one refused again after the fleet took its admission back.
"""

from __future__ import annotations

import collections

Key = tuple[str, str]  # (lane, tenant)


class UnservedDemand:
    """Counters of distinct jobs turned away, their tokens, and those that gave up, by lane
    and tenant (``-`` as the lane without a lane policy, or before a job was given one)."""

    __slots__ = ("gave_up_jobs", "jobs", "tokens")

    def __init__(self) -> None:
        self.jobs: collections.Counter[Key] = collections.Counter()
        self.tokens: collections.Counter[Key] = collections.Counter()
        self.gave_up_jobs: collections.Counter[Key] = collections.Counter()

    def turned_away(self, key: Key, tokens: int) -> None:
        """A job's first refusal: ``tokens`` is what it asked for (prompt and output)."""
        self.jobs[key] += 1
        self.tokens[key] += tokens

    def counters(self) -> tuple[tuple[str, collections.Counter[Key]], ...]:
        """Each counter by what it counts: ``jobs``, ``tokens``, ``gave_up``."""
        return (("jobs", self.jobs), ("tokens", self.tokens), ("gave_up", self.gave_up_jobs))

    def totals(self) -> tuple[int, int, int]:
        """Jobs turned away, their tokens, and those that gave up, every lane and tenant."""
        jobs, tokens, gave_up = (sum(counter.values()) for _, counter in self.counters())
        return jobs, tokens, gave_up

    def gave_up(self, key: Key) -> None:
        """A job turned away will not be served: its client left, cancelled, or did not come
        back in time, or it was refused for good."""
        self.gave_up_jobs[key] += 1


__all__ = ["Key", "UnservedDemand"]
