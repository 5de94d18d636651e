"""``FreeListAllocator``: O(1) LIFO free list; the most recently freed page is reused first.

The free set is a stack of ids in an ``array('q')`` (its end is the next page handed
out). Reusing recently freed pages keeps their memory warm in the CPU caches. One page
is one ``pop``/``append`` of the array; ``allocate(n)`` and the push of ``n`` freed pages
are one slice copy each, O(n) in C.
"""

from __future__ import annotations

from array import array

import numpy as np

from allocators.refcounting import RefCountingAllocator

_frombuffer, _INT64 = np.frombuffer, np.dtype(np.int64)  # bound once: a small allocate is ~1 us in all


class FreeListAllocator(RefCountingAllocator):
    """LIFO strategy of :class:`RefCountingAllocator`; see its doc for the state machine."""

    def _init_free(self, ids: np.ndarray) -> None:
        # Lowest id at the end: a fresh pool hands out 0, 1, 2...
        self._free = array("q", ids[::-1].astype(np.int64).tobytes())
        self._take_free = self._free.pop
        self._give_free = self._free.append
        self._give_free_list = self._free.extend

    def _pop_free(self, n: int) -> np.ndarray:
        stack = self._free
        taken = stack[len(stack) - n :]  # a new array('q'): the returned ids own it
        del stack[len(stack) - n :]
        taken.reverse()
        return _frombuffer(taken, _INT64)

    def _push_free(self, ids: np.ndarray) -> None:
        # Released in order a, b, c: c was freed last, so it is handed out first.
        self._free.frombytes(ids.astype(np.int64, copy=False).tobytes())

    def _free_ids(self) -> np.ndarray:
        return np.array(self._free, dtype=np.int64)
