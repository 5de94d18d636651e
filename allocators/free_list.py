"""``FreeListAllocator``: O(1) LIFO free list; the most recently freed page is reused first.

The free set is a numpy stack (``_stack[:_top]``); the top is the next page handed out.
Reusing recently freed pages keeps their memory warm in the CPU caches. ``allocate(n)``
and the push of ``n`` freed pages are one slice each, O(n) in C.
"""

from __future__ import annotations

import numpy as np

from allocators.refcounting import RefCountingAllocator


class FreeListAllocator(RefCountingAllocator):
    """LIFO strategy of :class:`RefCountingAllocator`; see its doc for the state machine."""

    def _init_free(self, ids: np.ndarray) -> None:
        self._stack = np.empty(self._n, dtype=np.int64)
        self._top = ids.size
        self._stack[: ids.size] = ids[::-1]  # lowest id on top: a fresh pool hands out 0, 1, 2...

    def _free_len(self) -> int:
        return self._top

    def _pop_free(self, n: int) -> np.ndarray:
        top = self._top
        out = self._stack[top - n : top][::-1].copy()
        self._top = top - n
        return out

    def _push_free(self, ids: np.ndarray) -> None:
        top = self._top
        # Released in order a, b, c: c was freed last, so it is handed out first.
        self._stack[top : top + ids.size] = ids
        self._top = top + ids.size

    def _free_ids(self) -> np.ndarray:
        return self._stack[: self._top]
