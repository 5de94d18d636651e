"""``RefCountingAllocator``: the page state machine every allocator strategy shares.

Strategies (:mod:`allocators.free_list`, :mod:`allocators.sorted`) differ only in how
they keep the set of FREE pages; reference counts, the CACHED LRU, the reserved null
page, validation, ``check()`` and ``stats()`` live here, once.

Layout (numpy arrays of length ``num_pages``; one entry per page id)::

    state      int8   PageState of the page
    refcount   int32  >= 1 iff IN_USE, else 0
    cacheable  bool   a count reaching 0 sends the page to CACHED instead of FREE
    lru        OrderedDict[int, None]: CACHED pages, least recently used first

Why numpy: batched calls (a whole prompt's pages, a view's pages) are validated and
updated with a handful of vectorised operations, O(n) in C rather than n Python round
trips. A pure-Python refcount loop measured no faster than a ``deque`` of per-page
objects (about 65 ns per page either way, see bench/RESULTS.md).

Atomicity: every public call validates all of its input before it changes anything.

Costs: ``allocate``/``incref``/``decref``/``fork``/``touch`` are O(n) in the ids passed,
plus O(1) per page that becomes CACHED; ``evict`` is O(n); ``check`` and ``stats`` are
O(num_pages) and meant for tests, debugging and periodic leak checks.

Set ``PAGEDKV_CHECK_INVARIANTS=1`` to run ``check()`` after every mutating call.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np

from allocators.errors import (
    InvalidArgumentType,
    InvalidArgumentValue,
    InvalidPage,
    InvariantViolation,
    PoolExhausted,
    RefCountError,
)
from allocators.protocol import AllocatorStats, PageState

_FREE = np.int8(PageState.FREE)
_IN_USE = np.int8(PageState.IN_USE)
_CACHED = np.int8(PageState.CACHED)
_RESERVED = np.int8(PageState.RESERVED)

NULL_PAGE = 0
"""Id of the reserved null page when an allocator is built with ``null_page=True``."""

DEBUG_ENV = "PAGEDKV_CHECK_INVARIANTS"


def _require_count(n: object, what: str = "n") -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise InvalidArgumentType(f"{what} must be an int, got {type(n).__name__}")
    if n < 0:
        raise InvalidArgumentValue(f"{what} must be >= 0, got {n}")
    return int(n)


class RefCountingAllocator:
    """Reference-counted page allocator over ``range(num_pages)``; see the module doc.

    Subclasses implement the free set: ``_free_len``, ``_pop_free``, ``_push_free`` and
    ``_free_ids``. ``evict_listeners`` is a list of callables, each called with the ids
    of CACHED pages just evicted to FREE, so owners of page hashes (a prefix cache, a
    disk tier) can forget them; ``on_evict`` (optional) starts the list.
    """

    def __init__(
        self,
        num_pages: int,
        *,
        null_page: bool = False,
        on_evict: Callable[[list[int]], None] | None = None,
        check_invariants: bool | None = None,
    ) -> None:
        num_pages = _require_count(num_pages, "num_pages")
        if num_pages < (2 if null_page else 1):
            raise InvalidArgumentValue(f"num_pages must leave at least one usable page, got {num_pages}")
        self._n = num_pages
        self._null_page = bool(null_page)
        self._state = np.zeros(num_pages, dtype=np.int8)
        self._refcount = np.zeros(num_pages, dtype=np.int32)
        self._cacheable = np.zeros(num_pages, dtype=bool)
        self._scratch = np.zeros(num_pages, dtype=np.int64)  # duplicate detection
        self._positions = np.arange(num_pages, dtype=np.int64)
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._ever_cacheable = False  # lets the common, cache-free release skip a lookup
        self._in_use = 0
        self._peak_in_use = 0
        self._allocated = 0
        self._freed = 0
        self._evicted = 0
        self._revived = 0
        self.evict_listeners: list[Callable[[list[int]], None]] = [] if on_evict is None else [on_evict]
        if check_invariants is None:
            check_invariants = os.environ.get(DEBUG_ENV, "") not in ("", "0")
        self._debug = bool(check_invariants)
        first = 0
        if null_page:
            self._state[NULL_PAGE] = _RESERVED
            first = 1
        self._init_free(np.arange(first, num_pages, dtype=np.int64))

    # ------------------------------------------------------------------ free set (strategy)
    def _init_free(self, ids: np.ndarray) -> None:
        raise NotImplementedError

    def _free_len(self) -> int:
        raise NotImplementedError

    def _pop_free(self, n: int) -> np.ndarray:
        """Remove and return ``n`` free ids (``n <= _free_len()``), in hand-out order."""
        raise NotImplementedError

    def _push_free(self, ids: np.ndarray) -> None:
        """Add ids that just became FREE, in the order they were released."""
        raise NotImplementedError

    def _free_ids(self) -> np.ndarray:
        """Every FREE id (any order, duplicates would be a bug)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ validation
    def _ids(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Validate page ids and return them as a 1-d int64 array (no state change)."""
        if isinstance(ids, np.ndarray):
            arr = ids
        elif isinstance(ids, (list, tuple, range)):
            arr = np.asarray(ids)
        else:
            raise InvalidArgumentType(
                f"page ids must be a list, tuple, range or numpy array, got {type(ids).__name__}"
            )
        if arr.ndim != 1:
            raise InvalidArgumentType(f"page ids must be 1-d, got shape {arr.shape}")
        if arr.size == 0:
            return arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise InvalidArgumentType(f"page ids must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
        # One pass: negatives wrap to huge values as uint64.
        if arr.view(np.uint64).max() >= self._n:
            bad = int(arr[(arr < 0) | (arr >= self._n)][0])
            raise InvalidPage(f"page id {bad} out of range [0, {self._n})")
        return arr

    def checked_ids(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """``ids`` validated (integers, 1-d, in range) as a new int64 array; no state
        change. Raises ``InvalidArgumentType`` / ``InvalidPage``."""
        return self._ids(ids).copy()

    def _has_duplicates(self, a: np.ndarray) -> bool:
        if a.size < 2:
            return False
        if a.size > self._n:  # more ids than pages: some id repeats (and no scratch fits)
            return True
        pos = self._positions[: a.size]
        self._scratch[a] = pos
        return not np.array_equal(self._scratch[a], pos)

    def _require_state(self, a: np.ndarray, allowed: tuple[np.int8, ...], call: str) -> None:
        st = self._state[a]
        ok = st == allowed[0]
        for s in allowed[1:]:
            ok |= st == s
        if not ok.all():
            i = int(np.argmin(ok))
            page, state = int(a[i]), PageState(int(st[i])).name
            if state == "RESERVED":
                raise InvalidPage(f"{call}: page {page} is the reserved null page")
            raise RefCountError(f"{call}: page {page} is {state}")

    def _debug_check(self) -> None:
        if self._debug:
            self.check()

    # ------------------------------------------------------------------ public API
    @property
    def num_pages(self) -> int:
        return self._n

    @property
    def null_page(self) -> int | None:
        """The reserved placeholder page id, or None when the allocator has none."""
        return NULL_PAGE if self._null_page else None

    def num_free(self) -> int:
        return self._free_len()

    def num_cached(self) -> int:
        return len(self._lru)

    def num_in_use(self) -> int:
        return self._in_use

    def num_available(self) -> int:
        """Pages ``allocate`` can hand out: free plus cached-evictable."""
        return self._free_len() + len(self._lru)

    def allocate(self, n: int) -> np.ndarray:
        """Hand out ``n`` pages, each with reference count 1, as an int64 array.

        Takes FREE pages first and evicts CACHED pages (LRU first, calling the ``evict_listeners``)
        only when the free set is short. Raises ``PoolExhausted`` and changes nothing
        when fewer than ``n`` pages are available.
        """
        n = _require_count(n)
        short = n - self._free_len()
        if short > 0:
            if short > len(self._lru):
                raise PoolExhausted(n, self.num_available())
            self._evict(short)
        ids = self._pop_free(n)
        if n == 1:  # scalar path: the common decode-time allocation
            page = int(ids[0])
            self._state[page] = _IN_USE
            self._refcount[page] = 1
        else:
            self._state[ids] = _IN_USE
            self._refcount[ids] = 1
        self._in_use += n
        self._allocated += n
        if self._in_use > self._peak_in_use:
            self._peak_in_use = self._in_use
        if self._debug:
            self.check()
        return ids

    def incref(self, ids: Sequence[int] | np.ndarray) -> None:
        """Add a reference per listed IN_USE page; CACHED pages need ``touch`` instead."""
        a = self._ids(ids)
        if a.size == 0:
            return
        rc = self._refcount
        r = rc[a]
        if r.min() < 1:  # count >= 1 iff IN_USE
            self._require_state(a, (_IN_USE,), "incref")
        if self._has_duplicates(a):
            np.add.at(rc, a, 1)
        else:
            rc[a] = r + 1
        if self._debug:
            self.check()

    def fork(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Share the pages with a new owner: one more reference each; returns a new array."""
        a = self._ids(ids)
        self.incref(a)
        return a.copy()

    def decref(self, ids: Sequence[int] | np.ndarray) -> None:
        """Drop a reference per listed page (a page may be listed more than once).

        Pages whose count reaches zero become CACHED (if marked cacheable, appended at
        the most-recently-used end in the order listed) or FREE. Raises ``RefCountError``
        (a double free) if a page is not IN_USE or would drop below zero.
        """
        a = self._ids(ids)
        if a.size == 0:
            return
        rc = self._refcount
        if a.size == 1:  # scalar path: one page, no vector machinery
            page = int(a[0])
            count = int(rc[page])
            if count < 1:
                self._require_state(a, (_IN_USE,), "decref")
            rc[page] = count - 1
            if count == 1:
                self._release_zero(a)
            if self._debug:
                self.check()
            return
        r = rc[a]
        if r.min() < 1:  # count >= 1 iff IN_USE
            self._require_state(a, (_IN_USE,), "decref")
        if self._has_duplicates(a):
            u, c = np.unique(a, return_counts=True)
            if (rc[u] < c).any():
                page = int(u[np.argmax(rc[u] < c)])
                raise RefCountError(f"decref: page {page} released more times than referenced")
            rc[u] -= c.astype(np.int32)
            zero = a[rc[a] == 0]
            _, first = np.unique(zero, return_index=True)
            zero = zero[np.sort(first)]
        else:
            r -= 1
            rc[a] = r
            zero = a[r == 0]
        if zero.size:
            self._release_zero(zero)
        if self._debug:
            self.check()

    def touch(self, ids: Sequence[int] | np.ndarray) -> None:
        """Take a reference on pages that are IN_USE or CACHED (a prefix-cache hit).

        CACHED pages are revived (removed from the LRU) with count 1.
        """
        a = self._ids(ids)
        if a.size == 0:
            return
        self._require_state(a, (_IN_USE, _CACHED), "touch")
        cached = a[self._state[a] == _CACHED]
        if cached.size:
            cached = np.unique(cached)
            for page in cached.tolist():
                del self._lru[page]
            self._state[cached] = _IN_USE
            self._in_use += cached.size
            self._revived += cached.size
            if self._in_use > self._peak_in_use:
                self._peak_in_use = self._in_use
        np.add.at(self._refcount, a, 1)
        self._debug_check()

    def set_cacheable(self, ids: Sequence[int] | np.ndarray, cacheable: bool = True) -> None:
        """Mark IN_USE or CACHED pages as (not) kept CACHED when their count reaches 0.

        Un-marking a CACHED page frees it at once (its hash was dropped).
        """
        a = self._ids(ids)
        if a.size == 0:
            return
        self._require_state(a, (_IN_USE, _CACHED), "set_cacheable")
        self._cacheable[a] = bool(cacheable)
        self._ever_cacheable |= bool(cacheable)
        if not cacheable:
            cached = np.unique(a[self._state[a] == _CACHED])
            if cached.size:
                for page in cached.tolist():
                    del self._lru[page]
                self._state[cached] = _FREE
                self._freed += cached.size
                self._push_free(cached)
        self._debug_check()

    def _page(self, page: int) -> int:
        """Validate one page id (a Python or numpy int) without building an array."""
        if isinstance(page, bool) or not isinstance(page, (int, np.integer)):
            raise InvalidArgumentType(f"a page id must be an int, got {type(page).__name__}")
        if not 0 <= page < self._n:
            raise InvalidPage(f"page id {page} out of range [0, {self._n})")
        return int(page)

    def is_cacheable(self, page: int) -> bool:
        return bool(self._cacheable[self._page(page)])

    def evict(self, n: int) -> list[int]:
        """Evict the ``n`` least recently used CACHED pages to FREE; returns their ids."""
        n = _require_count(n)
        if n > len(self._lru):
            raise PoolExhausted(n, len(self._lru), what="cached pages")
        out = self._evict(n)
        self._debug_check()
        return out

    def cached_pages(self) -> list[int]:
        """CACHED page ids, least recently used first."""
        return list(self._lru)

    def refcount(self, page: int) -> int:
        return int(self._refcount[self._page(page)])

    def page_state(self, page: int) -> PageState:
        return PageState(int(self._state[self._page(page)]))

    # ------------------------------------------------------------------ internals
    def _release_zero(self, zero: np.ndarray) -> None:
        self._in_use -= zero.size
        keep = self._cacheable[zero] if self._ever_cacheable else None
        if keep is not None and keep.any():
            to_cache = zero[keep]
            self._state[to_cache] = _CACHED
            self._lru.update(dict.fromkeys(to_cache.tolist()))
            zero = zero[~keep]
        if zero.size:
            self._state[zero] = _FREE
            self._freed += zero.size
            self._push_free(zero)

    def _evict(self, n: int) -> list[int]:
        lru = self._lru
        out = [lru.popitem(last=False)[0] for _ in range(n)]
        if out:
            a = np.asarray(out, dtype=np.int64)
            self._state[a] = _FREE
            self._cacheable[a] = False
            self._evicted += n
            self._freed += n
            self._push_free(a)
            for listener in self.evict_listeners:
                listener(out)
        return out

    # ------------------------------------------------------------------ invariants, stats
    def check(self) -> None:
        """Verify that every page is in exactly one state and that the counts add up.

        O(num_pages). Raises ``InvariantViolation`` describing the first problem found.
        """
        st, rc = self._state, self._refcount
        n = self._n
        if not np.isin(st, (0, 1, 2, 3)).all():
            raise InvariantViolation("a page has an unknown state")
        in_use = st == _IN_USE
        if (rc[in_use] < 1).any():
            raise InvariantViolation("an IN_USE page has reference count < 1")
        if (rc[~in_use] != 0).any():
            raise InvariantViolation("a page that is not IN_USE has a non-zero reference count")
        free_ids = np.asarray(self._free_ids(), dtype=np.int64)
        if np.unique(free_ids).size != free_ids.size:
            raise InvariantViolation("a page is in the free set twice")
        if not np.array_equal(np.sort(free_ids), np.flatnonzero(st == _FREE)):
            raise InvariantViolation("the free set and the FREE states disagree")
        cached_ids = np.asarray(list(self._lru), dtype=np.int64)
        if not np.array_equal(np.sort(cached_ids), np.flatnonzero(st == _CACHED)):
            raise InvariantViolation("the LRU and the CACHED states disagree")
        if self._cacheable[st == _FREE].any() or self._cacheable[st == _RESERVED].any():
            raise InvariantViolation("a FREE or RESERVED page is marked cacheable")
        reserved = np.flatnonzero(st == _RESERVED).tolist()
        if reserved != ([NULL_PAGE] if self._null_page else []):
            raise InvariantViolation(f"reserved pages are {reserved}")
        n_in_use = int(in_use.sum())
        if n_in_use != self._in_use:
            raise InvariantViolation(f"in-use counter {self._in_use} != {n_in_use} IN_USE pages")
        if free_ids.size + n_in_use + cached_ids.size + len(reserved) != n:
            raise InvariantViolation("free + in_use + cached + reserved != total")

    def _fragmentation(self) -> tuple[int, int]:
        free = np.sort(np.asarray(self._free_ids(), dtype=np.int64))
        if free.size == 0:
            return 0, 0
        breaks = np.flatnonzero(np.diff(free) != 1)
        starts = np.concatenate(([0], breaks + 1))
        ends = np.concatenate((breaks + 1, [free.size]))
        return int(starts.size), int((ends - starts).max())

    def stats(self) -> AllocatorStats:
        runs, largest = self._fragmentation()
        return AllocatorStats(
            total=self._n,
            free=self._free_len(),
            in_use=self._in_use,
            cached=len(self._lru),
            reserved=1 if self._null_page else 0,
            peak_in_use=self._peak_in_use,
            pages_allocated=self._allocated,
            pages_freed=self._freed,
            pages_evicted=self._evicted,
            pages_revived=self._revived,
            free_runs=runs,
            largest_free_run=largest,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_pages={self._n}, free={self._free_len()}, "
            f"in_use={self._in_use}, cached={len(self._lru)})"
        )


