"""``SortedAllocator``: lowest free id first, with contiguous runs and fragmentation stats.

The free set is a ``sortedcontainers.SortedList``. Handing out the lowest ids keeps the
in-use set compact, and ``allocate_contiguous(n)`` finds a run of ``n`` consecutive ids
(useful for kernels or copies that want one slice of the pool).

Costs: ``allocate(n)`` O(n log F) (a slice delete of the head); frees O(n log F);
``allocate_contiguous`` O(F) to find the first fitting run, F = free pages.
"""

from __future__ import annotations

import functools

import numpy as np
from sortedcontainers import SortedList

from allocators.errors import PoolExhausted
from allocators.refcounting import RefCountingAllocator, _require_count


class SortedAllocator(RefCountingAllocator):
    """Lowest-id-first strategy of :class:`RefCountingAllocator`."""

    def _init_free(self, ids: np.ndarray) -> None:
        self._free = SortedList(ids.tolist())
        self._take_free = functools.partial(self._free.pop, 0)
        self._give_free = self._free.add
        self._give_free_list = self._free.update

    def _pop_free(self, n: int) -> np.ndarray:
        out = np.asarray(self._free[:n], dtype=np.int64)
        del self._free[:n]
        return out

    def _push_free(self, ids: np.ndarray) -> None:
        self._free.update(ids.tolist())

    def _free_ids(self) -> np.ndarray:
        return np.fromiter(self._free, dtype=np.int64, count=len(self._free))

    def allocate_contiguous(self, n: int) -> np.ndarray:
        """Hand out ``n`` consecutive page ids (the lowest such run) with count 1 each.

        Only FREE pages are considered (CACHED pages are not evicted to make a run).
        Raises ``PoolExhausted`` (``available`` = the largest free run) and changes
        nothing when no run of ``n`` free pages exists.
        """
        n = _require_count(n)
        if n == 0:
            return np.empty(0, dtype=np.int64)
        free = self._free_ids()
        start = _first_run(free, n)
        if start is None:
            raise PoolExhausted(n, self.stats().largest_free_run, what="contiguous pages")
        ids = free[start : start + n]
        del self._free[start : start + n]
        self._refcount[ids] = 1
        self._note_peak()
        return ids.copy()


def _first_run(sorted_ids: np.ndarray, n: int) -> int | None:
    """Index in ``sorted_ids`` where the first run of ``n`` consecutive ids starts."""
    if sorted_ids.size < n:
        return None
    if n == 1:
        return 0
    # A run of n starts at i iff ids[i + n - 1] - ids[i] == n - 1 (ids are unique, sorted).
    span = sorted_ids[n - 1 :] - sorted_ids[: sorted_ids.size - n + 1]
    hits = np.flatnonzero(span == n - 1)
    return int(hits[0]) if hits.size else None
