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
from typing import Callable, Protocol, Sequence, Union, runtime_checkable

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
    error from :mod:`allocators.errors` and leaves the allocator unchanged. A pool
    (``pagedkv.PagePool(allocator=...)``) also needs the reserved null page and the
    prefix-cache calls (``touch``, ``set_cacheable``, the CACHED state and
    ``evict_listeners``); :class:`RefCountingAllocator` implements all of it, and
    ``tests/test_allocator_protocol.py`` runs a user class through the same checks.
    """

    evict_listeners: list[Callable[[list[int]], None]]
    """Called, in order, with the ids of CACHED pages just evicted to FREE."""

    @property
    def num_pages(self) -> int: ...

    @property
    def null_page(self) -> int | None:
        """The reserved page id (never handed out), or None."""

    def allocate(self, n: int) -> np.ndarray:
        """Hand out ``n`` pages with reference count 1 (int64 ids), or raise ``PoolExhausted``."""

    def incref(self, ids: PageIds) -> None:
        """Add one reference to each listed in-use page (a page may appear twice)."""

    def decref(self, ids: PageIds) -> None:
        """Drop one reference per listed page; pages reaching zero become free or cached."""

    def fork(self, ids: PageIds) -> np.ndarray:
        """Share ``ids`` with a new owner (incref) and return them as a new array."""

    def touch(self, ids: PageIds) -> None:
        """Take one reference on each page, reviving CACHED pages (a prefix hit)."""

    def set_cacheable(self, ids: PageIds, cacheable: bool = True) -> None:
        """Mark in-use pages so that their last decref sends them to CACHED, not FREE."""

    def is_cacheable(self, page: int) -> bool: ...

    def refcount(self, page: int) -> int: ...

    def page_state(self, page: int) -> PageState: ...

    def checked_ids(self, ids: PageIds) -> np.ndarray:
        """``ids`` as int64 page ids, or a typed error for bad ids (nothing changes)."""

    def num_free(self) -> int: ...

    def num_cached(self) -> int: ...

    def num_available(self) -> int: ...

    def check(self) -> None:
        """Raise ``InvariantViolation`` unless every page is in exactly one state."""

    def stats(self) -> AllocatorStats: ...


_MEMBERS = tuple(sorted({name for name in vars(BlockAllocator) if not name.startswith("_")}
                        | set(BlockAllocator.__annotations__)))


def implements_block_allocator(obj: object) -> bool:
    """Whether ``obj`` has every member of ``BlockAllocator``, looked up as a caller
    would (``hasattr``, so members a class supplies through ``__getattr__`` count).

    ``isinstance(obj, BlockAllocator)`` answers differently by Python version: from
    3.12 on it looks members up statically and misses ``__getattr__`` (a delegating
    wrapper is refused there and accepted on 3.11). pagedkv checks with this function,
    so an allocator is accepted or refused the same way on every version. O(members)."""
    return all(hasattr(obj, name) for name in _MEMBERS)
