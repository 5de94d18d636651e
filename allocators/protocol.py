"""The public allocator protocol, page states and the stats value type.

A block allocator owns the *state* of every page id in ``range(num_pages)``; it knows
nothing about the arrays those ids index. Every page is in exactly one state::

                 allocate                decref -> 0 (not cacheable)
       FREE ─────────────────> IN_USE ──────────────────────────────> FREE
        ^                      │  ^  incref / fork: count + 1
        │ evict (LRU)          │  │
        │                      │  └── touch (revive, count = 1)
        └──── CACHED <─────────┘
                decref -> 0 (cacheable: the page keeps a prefix hash)

    RESERVED: the optional null page (id 0); never handed out, never counted.

``free + in_use + cached + reserved == num_pages`` holds after every call.
"""

from __future__ import annotations

import enum
from typing import Protocol, Sequence, Union, runtime_checkable

import attrs
import numpy as np


class PageState(enum.IntEnum):
    FREE = 0
    IN_USE = 1
    CACHED = 2
    RESERVED = 3


@attrs.frozen
class AllocatorStats:
    """A snapshot of an allocator's counters (a value; it does not change afterwards)."""

    total: int
    free: int
    in_use: int
    cached: int
    reserved: int
    peak_in_use: int
    pages_allocated: int  # pages handed out by allocate() since creation
    pages_freed: int  # pages that went back to FREE
    pages_evicted: int  # CACHED pages evicted to FREE
    pages_revived: int  # CACHED pages revived by touch()
    free_runs: int  # number of maximal runs of consecutive free ids
    largest_free_run: int

    @property
    def available(self) -> int:
        """Pages an ``allocate`` call can get: free plus cached-evictable."""
        return self.free + self.cached


PageIds = Union[Sequence[int], np.ndarray]
"""Page ids in: a list/tuple/range of ints or a 1-d integer numpy array."""


@runtime_checkable
class BlockAllocator(Protocol):
    """What pagedkv (and ``python -m allocators.stress``) needs from an allocator.

    Every mutating call is atomic: it either succeeds completely or raises a typed
    error from :mod:`allocators.errors` and leaves the allocator unchanged.
    """

    @property
    def num_pages(self) -> int: ...

    def allocate(self, n: int) -> np.ndarray:
        """Hand out ``n`` pages with reference count 1 (int64 ids), or raise ``PoolExhausted``."""

    def incref(self, ids: PageIds) -> None:
        """Add one reference to each listed in-use page (a page may appear twice)."""

    def decref(self, ids: PageIds) -> None:
        """Drop one reference per listed page; pages reaching zero become free or cached."""

    def fork(self, ids: PageIds) -> np.ndarray:
        """Share ``ids`` with a new owner (incref) and return them as a new array."""

    def num_free(self) -> int: ...

    def num_available(self) -> int: ...

    def check(self) -> None:
        """Raise ``InvariantViolation`` unless every page is in exactly one state."""

    def stats(self) -> AllocatorStats: ...
