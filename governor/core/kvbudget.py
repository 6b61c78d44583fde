"""The KV budget: the runner's caches as admission sees them.

Pure. A batched runner holds one KV cache per worker process, each with a number of cells
(token positions) and of sequences. Every admitted inference job reserves, in one cache, the
cells it may ever fill (its prompt and ``max_new_tokens``) and one sequence, before it runs; a
job that fits in no cache is refused at admission (``kv_pressure``, a yield) instead of failing
inside the runner. The reservation is the worst case: most jobs stop before ``max_new_tokens``,
so the cells a cache really holds (the runner reports them) are fewer, and the lane policy's
danger line is drawn on those.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..runners.base import CacheShape


class KvBudget:
    def __init__(self, caches: Sequence[CacheShape]) -> None:
        if not caches or any(c.cells < 1 or c.sequences < 1 for c in caches):
            raise ValueError("a KV budget needs caches of at least one cell and one sequence")
        self.caches = tuple(caches)
        self.capacity = sum(c.cells for c in caches)
        self.reserved = 0
        self._cells = [c.cells for c in caches]  # free, by cache
        self._sequences = [c.sequences for c in caches]

    def place(self, cells: int) -> int | None:
        """Reserve ``cells`` and a sequence in the cache with the most free cells that has
        both; returns its index, or None when none has."""
        best = None
        for i, free in enumerate(self._cells):
            if free >= cells and self._sequences[i] and (best is None or free > self._cells[best]):
                best = i
        if best is not None:
            self._cells[best] -= cells
            self._sequences[best] -= 1
            self.reserved += cells
        return best

    def take(self, index: int, cells: int) -> bool:
        """Reserve ``cells`` and a sequence in cache ``index`` (a job's own: its cells are
        there); False, nothing reserved, when it has not both."""
        if self._cells[index] < cells or not self._sequences[index]:
            return False
        self._cells[index] -= cells
        self._sequences[index] -= 1
        self.reserved += cells
        return True

    def release(self, index: int, cells: int) -> None:
        self._cells[index] += cells
        self._sequences[index] += 1
        self.reserved -= cells

    def free(self, index: int) -> tuple[int, int]:
        """Free cells and sequences of one cache."""
        return self._cells[index], self._sequences[index]
