"""``RefCountingAllocator``: the page state machine every allocator strategy shares.

Strategies (:mod:`allocators.free_list`, :mod:`allocators.sorted`) differ only in how
they keep the set of FREE pages; reference counts, the CACHED LRU, the reserved null
page, validation, ``check()`` and ``stats()`` live here, once.

Layout (one entry per page id; each table is one buffer seen two ways: a Python object
for the one-page calls, a numpy view of the same memory for the batched calls)::

    refcount   array('i')  / int32 view   >= 1 iff the page is IN_USE
    state      bytearray   / int8 view    FREE 0, CACHED 2, RESERVED 3; read only when
                                          the count is 0 (an IN_USE page keeps 0 here)
    cacheable  bytearray   / bool view    a count reaching 0 sends the page to CACHED
    log_pos    array('q')  / int64 view   where the page's live entry in the LRU log is
                                          (-1, or an entry behind ``head``: none)

The LRU of CACHED pages is a log: each time a page becomes CACHED its id is appended
(``log``, read from ``head``, oldest first). An entry is live iff ``log_pos[page]``
points at it: a page revived by ``touch`` or un-cached gets ``log_pos`` -1, and a page
cached again points at its new entry, so either leaves a dead entry behind. Evicting takes live entries from the head (a slice
test in numpy for many pages), so neither caching nor reviving nor evicting a page
moves anything else. The log is compacted (live entries only) when it has doubled,
which keeps it O(num_pages) and the compaction O(1) per append, amortised.

The one-page calls (``allocate_page``, ``decref_page``: what a decode step does when a
sequence crosses a page boundary) touch a handful of Python objects and build no numpy
array; the batched calls (a prompt's pages, a view's pages, a released sequence) are a
few vectorised numpy operations, O(n) in C, with as few reductions as possible (each numpy
call costs about a microsecond whatever its size). A list or 1-d array of up to ``_FEW``
ids given to ``decref``, ``touch`` or ``set_cacheable`` takes one plain Python loop
instead, cheaper at that size: it checks each page as it changes it and undoes what
it changed when a page is refused, and the array path then checks again and reports.
``IN_USE`` lives in the count alone, so handing out a free page writes one count and
freeing it writes one count back.

Counters: only the transitions that cannot be derived are counted (pages whose count
reached 0, pages cached, evicted, revived, un-cached); ``in_use`` is
``num_pages - reserved - free - cached`` and ``pages_allocated`` follows from those.

Atomicity: a public call that raises leaves the allocator as it was. The calls validate
all of their input before they change anything, except the short loops above, which
undo their own changes before the array path raises.

Costs: ``allocate``/``incref``/``decref``/``fork``/``touch`` are O(n) in the ids passed,
plus O(1) per page that becomes CACHED; the one-page calls O(1); ``evict`` O(n);
``check`` and ``stats`` are O(num_pages) and meant for tests, debugging and leak checks.

Set ``PAGEDKV_CHECK_INVARIANTS=1`` (or ``check_invariants=True``) to run ``check()``
after every mutating call; the checks wrap the methods, so the fast paths carry no flag.
"""

from __future__ import annotations

import functools
import os
import sys
from array import array
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

_FREE = 0
_IN_USE = 1
_CACHED = 2
_RESERVED = 3

NULL_PAGE = 0
"""Id of the reserved null page when an allocator is built with ``null_page=True``."""

DEBUG_ENV = "PAGEDKV_CHECK_INVARIANTS"

_FEW = 32
"""Lists up to this long take a plain Python loop where one exists: below it, a loop
costs less than the ~1 us that each numpy call costs whatever its size."""

_SIGN_BYTE = 7 if sys.byteorder == "little" else 0
"""The byte of an int64 that holds its sign: 0 in every id in range."""

_MUTATORS = ("allocate", "allocate_page", "incref", "decref", "decref_page", "fork", "touch",
             "set_cacheable", "evict", "allocate_contiguous")


def _short_list(ids: object) -> list | None:
    """``ids`` as a list for the short loops (a list, or a 1-d array, of up to ``_FEW``
    ids), or None: the array path takes it."""
    if ids.__class__ is list:
        return ids if len(ids) <= _FEW else None
    if ids.__class__ is np.ndarray and ids.size <= _FEW and ids.ndim == 1:
        return ids.tolist()
    return None


def _require_count(n: object, what: str = "n") -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise InvalidArgumentType(f"{what} must be an int, got {type(n).__name__}")
    if n < 0:
        raise InvalidArgumentValue(f"{what} must be >= 0, got {n}")
    return int(n)


class RefCountingAllocator:
    """Reference-counted page allocator over ``range(num_pages)``; see the module doc.

    Subclasses keep the FREE pages: ``_init_free`` sets ``self._free`` (any container with
    ``len``), ``_take_free`` (a callable returning the next free id), ``_give_free``
    (a callable taking one freed id) and ``_give_free_list`` (the same for a list of ids,
    in order), and they implement the batched ``_pop_free``,
    ``_push_free`` and ``_free_ids``. ``evict_listeners`` is a list of callables, each
    called with the ids of CACHED pages just evicted to FREE, so owners of page keys (a
    prefix cache, a disk tier) can forget them; ``on_evict`` (optional) starts the list.
    """

    _free: Sequence[int]
    _take_free: Callable[[], int]
    _give_free: Callable[[int], None]
    _give_free_list: Callable[[list[int]], None]

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
        self._reserved = 1 if null_page else 0
        self._rc = array("i", bytes(4 * num_pages))
        self._state_b = bytearray(num_pages)
        self._cacheable_b = bytearray(num_pages)
        self._refcount = np.frombuffer(self._rc, dtype=np.int32)
        self._state = np.frombuffer(self._state_b, dtype=np.int8)
        self._cacheable = np.frombuffer(self._cacheable_b, dtype=bool)
        self._scratch = np.zeros(num_pages, dtype=np.int64)  # duplicate detection
        self._positions = np.arange(num_pages, dtype=np.int64)
        self._log = array("q")
        self._log_base = 0  # log position of self._log[0]
        self._head = 0  # index in self._log of the oldest entry not yet consumed
        self._log_limit = 1024  # compact when the log grows past this
        self._log_pos = array("q", bytes(8 * num_pages))
        self._log_pos_np = np.frombuffer(self._log_pos, dtype=np.int64)
        self._num_cached = 0
        self._caching = False  # set once any page is marked cacheable
        self._low = num_pages - self._reserved  # fewest free + cached pages seen: the peak
        self._zeroed = self._to_cached = self._evicted = self._revived = self._uncached = 0
        self.evict_listeners: list[Callable[[list[int]], None]] = [] if on_evict is None else [on_evict]
        if null_page:
            self._state_b[NULL_PAGE] = _RESERVED
        self._init_free(np.arange(self._reserved, num_pages, dtype=np.int64))
        if check_invariants is None:
            check_invariants = os.environ.get(DEBUG_ENV, "") not in ("", "0")
        self._debug = bool(check_invariants)
        if self._debug:
            for name in _MUTATORS:
                if hasattr(self, name):
                    setattr(self, name, self._checked(getattr(self, name)))

    def _checked(self, method: Callable) -> Callable:
        @functools.wraps(method)
        def run_then_check(*args, **kwargs):
            out = method(*args, **kwargs)
            self.check()
            return out

        return run_then_check

    # ------------------------------------------------------------------ free set (strategy)
    def _init_free(self, ids: np.ndarray) -> None:
        raise NotImplementedError

    def _pop_free(self, n: int) -> np.ndarray:
        """Remove and return ``n`` free ids (``n <= len(self._free)``), in hand-out order."""
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
        return self._counted(ids)[0]

    def _counted(self, ids: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``_ids`` and the reference count of each id (int32, a new array).

        The range check of a short list costs no reduction (a numpy reduction is ~2 us
        whatever its size): a negative id has a non-zero sign byte, found by a scan of
        the ids' bytes, and an id past the end makes the gather of the counts raise."""
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
            return arr.astype(np.int64), self._refcount[:0].copy()
        if arr.dtype.kind not in "iu":
            raise InvalidArgumentType(f"page ids must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
        if arr.size < 1024:  # no id is negative (the scan costs ~1 ns an id: the reduction wins past ~2k)
            in_range = arr.tobytes()[_SIGN_BYTE::8].count(0) == arr.size
        else:  # negatives wrap to huge values as uint64
            in_range = arr.view(np.uint64).max() < self._n
        if in_range:
            try:
                return arr, self._refcount[arr]
            except IndexError:
                pass
        bad = int(np.asarray(ids)[(arr < 0) | (arr >= self._n)][0])  # (as given: a uint64 past 2**63 wraps in arr)
        raise InvalidPage(f"page id {bad} out of range [0, {self._n})")

    def checked_ids(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """``ids`` validated (integers, 1-d, in range) as a new int64 array; no state
        change. Raises ``InvalidArgumentType`` / ``InvalidPage``."""
        return self._ids(ids).copy()

    def _page(self, page: object) -> int:
        """Validate one page id (a Python or numpy int) without building an array."""
        if isinstance(page, bool) or not isinstance(page, (int, np.integer)):
            raise InvalidArgumentType(f"a page id must be an int, got {type(page).__name__}")
        if not 0 <= page < self._n:
            raise InvalidPage(f"page id {page} out of range [0, {self._n})")
        return int(page)

    def _has_duplicates(self, a: np.ndarray) -> bool:
        if a.size < 2:
            return False
        if a.size > self._n:  # more ids than pages: some id repeats (and no scratch fits)
            return True
        pos = self._positions[: a.size]
        self._scratch[a] = pos
        return self._scratch[a].tobytes() != pos.tobytes()

    def _states_of(self, a: np.ndarray) -> np.ndarray:
        """The PageState of each page in ``a`` (IN_USE lives in the count)."""
        return np.where(self._refcount[a] > 0, np.int8(_IN_USE), self._state[a])

    def _refuse(self, call: str, page: int) -> None:
        state = self.page_state(page)
        if state == PageState.RESERVED:
            raise InvalidPage(f"{call}: page {page} is the reserved null page")
        raise RefCountError(f"{call}: page {page} is {state.name}")

    def _require_state(self, a: np.ndarray, allowed: tuple[int, ...], call: str) -> None:
        st = self._states_of(a)
        ok = st == allowed[0]
        for s in allowed[1:]:
            ok |= st == s
        if not ok.all():
            self._refuse(call, int(a[int(np.argmin(ok))]))

    def _idle_of(self, a: np.ndarray, counts: np.ndarray, call: str) -> np.ndarray | None:
        """Raise unless every page is IN_USE or CACHED; return the CACHED ones (count 0),
        or None when every page is IN_USE."""
        held = np.count_nonzero(counts)
        if held == counts.size:
            return None
        idle = a if held == 0 else a[counts == 0]
        st = self._state[idle].tobytes()
        if st.count(_CACHED) != len(st):
            self._require_state(a, (_IN_USE, _CACHED), call)
        return idle

    def _note_peak(self) -> None:
        """Record the fewest free + cached pages seen (``allocate_page`` inlines this)."""
        avail = len(self._free) + self._num_cached
        if avail < self._low:
            self._low = avail

    # ------------------------------------------------------------------ queries
    @property
    def num_pages(self) -> int:
        return self._n

    @property
    def null_page(self) -> int | None:
        """The reserved placeholder page id, or None when the allocator has none."""
        return NULL_PAGE if self._null_page else None

    def num_free(self) -> int:
        return len(self._free)

    def num_cached(self) -> int:
        return self._num_cached

    def num_in_use(self) -> int:
        return self._n - self._reserved - len(self._free) - self._num_cached

    def num_available(self) -> int:
        """Pages ``allocate`` can hand out: free plus cached-evictable."""
        return len(self._free) + self._num_cached

    def is_cacheable(self, page: int) -> bool:
        return bool(self._cacheable_b[self._page(page)])

    def cached_pages(self) -> list[int]:
        """CACHED page ids, least recently used first."""
        return self._live_log().tolist()

    def refcount(self, page: int) -> int:
        return self._rc[self._page(page)]

    def needs_copy(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Bool per listed page: a writer must copy it before changing it, because
        another holder references it (count > 1) or a prefix cache keeps its content
        (cacheable). One vectorised test for a batch of tables' last pages, O(n);
        ``InvalidPage`` for bad ids. Not part of ``BlockAllocator``: pagedkv asks
        ``refcount`` and ``is_cacheable`` page by page where an allocator lacks it."""
        a, counts = self._counted(ids)
        return (counts > 1) | self._cacheable[a]

    def refcounts(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The reference count of each listed page (a new int32 array; 0: not IN_USE).
        One vectorised read, O(n); ``InvalidPage`` for bad ids. Not part of
        ``BlockAllocator``: pagedkv asks ``refcount`` page by page where an allocator
        lacks it."""
        return self._counted(ids)[1]

    def page_state(self, page: int) -> PageState:
        page = self._page(page)
        return PageState.IN_USE if self._rc[page] > 0 else PageState(self._state_b[page])

    # ------------------------------------------------------------------ one page
    def allocate_page(self) -> int:
        """Hand out one page with reference count 1 and return its id (a Python int).

        O(1); the same policy as ``allocate(1)``: a FREE page first, else the least
        recently used CACHED page is evicted. Raises ``PoolExhausted`` (nothing changes)
        when no page is available.
        """
        free = self._free
        if free:
            page = self._take_free()
        else:  # evict the least recently used cached page straight into use
            if not self._num_cached:
                raise PoolExhausted(1, 0)
            page = self._evict_page()
        self._rc[page] = 1
        avail = len(free) + self._num_cached
        if avail < self._low:
            self._low = avail
        return page

    def decref_page(self, page: int) -> None:
        """Drop one reference to ``page``; at zero it becomes CACHED (if cacheable) or
        FREE. O(1). Raises ``RefCountError`` (a double free) if the page is not IN_USE."""
        if page.__class__ is not int or page < 0:
            page = self._page(page)
        rc = self._rc
        try:
            count = rc[page]
        except IndexError:
            raise InvalidPage(f"page id {page} out of range [0, {self._n})") from None
        if count > 1:
            rc[page] = count - 1
            return
        if count != 1:
            self._refuse("decref", page)
        rc[page] = 0
        self._zeroed += 1
        if self._caching and self._cacheable_b[page]:
            self._state_b[page] = _CACHED
            log = self._log
            self._log_pos[page] = self._log_base + len(log)
            log.append(page)
            self._num_cached += 1
            self._to_cached += 1
            if len(log) > self._log_limit:
                self._compact_log()
        else:
            self._give_free(page)

    def set_cacheable_page(self, page: int) -> None:
        """``set_cacheable([page])``, without building a list: the page (IN_USE or
        CACHED) is kept CACHED when its count reaches 0. O(1); the same typed errors as
        ``set_cacheable``, and nothing changes, for an id that is not an int in range or
        a page that is neither IN_USE nor CACHED."""
        if page.__class__ is not int or not 0 <= page < self._n or self._rc[page] <= 0:
            self.set_cacheable([page])  # (the checked path says what is wrong, or handles a numpy int)
            return
        self._cacheable_b[page] = 1
        self._caching = True

    # ------------------------------------------------------------------ batched
    def allocate(self, n: int) -> np.ndarray:
        """Hand out ``n`` pages, each with reference count 1, as an int64 array.

        Takes FREE pages first and evicts CACHED pages (LRU first, calling the
        ``evict_listeners``) only when the free set is short. Raises ``PoolExhausted``
        and changes nothing when fewer than ``n`` pages are available.
        """
        if n.__class__ is not int or n < 0:
            n = _require_count(n)
        free = self._free
        short = n - len(free)
        if short > 0:
            if short > self._num_cached:
                raise PoolExhausted(n, self.num_available())
            self._evict(short)
        ids = self._pop_free(n)
        self._refcount[ids] = 1
        avail = len(free) + self._num_cached  # _note_peak, inlined
        if avail < self._low:
            self._low = avail
        return ids

    def incref(self, ids: Sequence[int] | np.ndarray) -> None:
        """Add a reference per listed IN_USE page; CACHED pages need ``touch`` instead."""
        a, r = self._counted(ids)
        if a.size == 0:
            return
        rc = self._refcount
        if np.count_nonzero(r) != r.size:  # count >= 1 iff IN_USE (counts are never < 0)
            self._require_state(a, (_IN_USE,), "incref")
        if self._has_duplicates(a):
            np.add.at(rc, a, 1)
        else:
            rc[a] = r + 1

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
        few = _short_list(ids)
        if few is not None and self._decref_few(few):
            return
        a, r = self._counted(ids)
        if a.size <= 1:
            if a.size:
                self.decref_page(a.item())
            return
        rc = self._refcount
        if np.count_nonzero(r) != r.size:  # count >= 1 iff IN_USE (counts are never < 0)
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
            left = np.count_nonzero(r)  # a released sequence: usually none left, or all
            if left == r.size:
                return
            zero = a if left == 0 else a[r == 0]
        if zero.size:
            self._release_zero(zero)

    def touch(self, ids: Sequence[int] | np.ndarray) -> None:
        """Take a reference on pages that are IN_USE or CACHED (a prefix-cache hit).

        CACHED pages are revived (removed from the LRU) with count 1.
        """
        few = _short_list(ids)
        if few is not None and self._touch_few(few):
            return
        a, r = self._counted(ids)
        if a.size == 0:
            return
        rc = self._refcount
        cached = self._idle_of(a, r, "touch")
        dup = self._has_duplicates(a)
        if cached is not None:
            if dup:
                cached = np.unique(cached)
            self._state[cached] = _FREE  # the byte an IN_USE page keeps
            self._log_pos_np[cached] = -1  # its log entry dies
            self._num_cached -= cached.size
            self._revived += cached.size
            self._note_peak()
        if dup:
            np.add.at(rc, a, 1)
        else:
            r += 1
            rc[a] = r

    def set_cacheable(self, ids: Sequence[int] | np.ndarray, cacheable: bool = True) -> None:
        """Mark IN_USE or CACHED pages as (not) kept CACHED when their count reaches 0.

        Un-marking a CACHED page frees it at once (its key was dropped).
        """
        few = _short_list(ids) if cacheable is True else None
        if few is not None:  # a few pages in use
            rc, n = self._rc, self._n
            for page in few:
                if page.__class__ is not int or not 0 <= page < n or rc[page] <= 0:
                    break  # (the array path says what is wrong)
            else:
                flags = self._cacheable_b
                for page in few:
                    flags[page] = 1
                self._caching = True
                return
        a, counts = self._counted(ids)
        if a.size == 0:
            return
        cached = self._idle_of(a, counts, "set_cacheable")
        self._cacheable[a] = bool(cacheable)
        if cacheable:
            self._caching = True
        elif cached is not None:
            cached = np.unique(cached)
            self._num_cached -= cached.size
            self._state[cached] = _FREE
            self._log_pos_np[cached] = -1
            self._uncached += cached.size
            self._push_free(cached)

    def evict(self, n: int) -> list[int]:
        """Evict the ``n`` least recently used CACHED pages to FREE; returns their ids."""
        n = _require_count(n)
        if n > self._num_cached:
            raise PoolExhausted(n, self._num_cached, what="cached pages")
        return self._evict(n)

    # ------------------------------------------------------------------ internals
    def _decref_few(self, ids: list) -> bool:
        """``decref`` of a short list of IN_USE ids in one Python loop. Returns False,
        having changed nothing, when the list needs the array path (an id that is not an
        int in range, or a page with no reference left to drop: that path says which).
        Each count is checked as it is dropped and the drops are undone on a refusal; a
        page listed twice is dropped twice, as on the array path."""
        rc = self._rc
        zero = []
        done = 0
        try:
            for page in ids:
                count = rc[page]  # IndexError past the end, TypeError for a non-index
                if count < 1 or page < 0 or page.__class__ is not int:
                    break
                rc[page] = count - 1
                if count == 1:
                    zero.append(page)
                done += 1
        except (IndexError, TypeError):
            pass
        if done != len(ids):
            for page in ids[:done]:
                rc[page] += 1
            return False
        if zero:
            # a repeat: list order is first sight, as on the array path (when every listed id
            # reached zero, none was listed twice: a page reaches zero once per call)
            if 1 < len(zero) < len(ids) and len(set(ids)) != len(ids):
                zero.sort(key=ids.index)
            self._zeroed += len(zero)
            if self._caching:  # decref_page's transition, page by page
                flags, state, pos, log, give = self._cacheable_b, self._state_b, self._log_pos, self._log, self._give_free
                at = first = self._log_base + len(log)
                for page in zero:
                    if flags[page]:
                        state[page] = _CACHED
                        pos[page] = at
                        log.append(page)
                        at += 1
                    else:
                        give(page)
                self._num_cached += at - first
                self._to_cached += at - first
                if len(log) > self._log_limit:
                    self._compact_log()
            else:
                self._give_free_list(zero)
        return True

    def _touch_few(self, ids: list) -> bool:
        """``touch`` of a short list of ids, each IN_USE or CACHED, in one Python loop;
        False (nothing changed) when the list needs the array path. A CACHED page listed
        twice is revived once and gets a count of 2, as on the array path."""
        rc, state, pos = self._rc, self._state_b, self._log_pos
        revived = []
        done = 0
        try:
            for page in ids:
                count = rc[page]
                if page < 0 or page.__class__ is not int:
                    break
                if not count:
                    if state[page] != _CACHED:
                        break
                    revived.append((page, pos[page]))
                    state[page] = _FREE  # the byte an IN_USE page keeps; its log entry dies
                    pos[page] = -1
                rc[page] = count + 1
                done += 1
        except (IndexError, TypeError):
            pass
        if done != len(ids):
            for page in ids[:done]:
                rc[page] -= 1
            for page, at in revived:
                state[page] = _CACHED
                pos[page] = at
            return False
        if revived:
            self._num_cached -= len(revived)
            self._revived += len(revived)
            self._note_peak()
        return True

    def _release_zero(self, zero: np.ndarray) -> None:
        """Pages whose count just reached 0: to the LRU if cacheable, else FREE."""
        self._zeroed += zero.size
        if self._caching:
            keep = self._cacheable[zero]
            kept = np.count_nonzero(keep)
            if kept:
                to_cache = zero if kept == zero.size else zero[keep]
                self._state[to_cache] = _CACHED
                start = self._log_base + len(self._log)
                self._log_pos_np[to_cache] = np.arange(start, start + to_cache.size)
                self._log.frombytes(to_cache.tobytes())
                self._num_cached += to_cache.size
                self._to_cached += to_cache.size
                if len(self._log) > self._log_limit:
                    self._compact_log()
                if kept == zero.size:
                    return
                zero = zero[~keep]
        self._push_free(zero)

    def _evict(self, n: int) -> list[int]:
        """Evict the ``n`` least recently used CACHED pages to FREE (``n <= num_cached``)."""
        if n == 0:
            return []
        if n == 1:
            page = self._evict_page()
            self._give_free(page)
            return [page]
        a = self._take_lru(n)
        self._state[a] = _FREE
        self._cacheable[a] = False
        self._push_free(a)
        out = a.tolist()
        self._evicted += n
        for listener in self.evict_listeners:
            listener(out)
        return out

    def _evict_page(self) -> int:
        """Evict the least recently used CACHED page (the oldest live log entry, tested
        as ``_live`` tests many); it is FREE but in no free set yet."""
        log, pos = self._log, self._log_pos
        h, base = self._head, self._log_base
        while True:
            page = log[h]
            if pos[page] == base + h:
                break
            h += 1
        self._head = h + 1
        self._num_cached -= 1
        self._state_b[page] = _FREE
        self._cacheable_b[page] = False
        self._evicted += 1
        for listener in self.evict_listeners:
            listener([page])
        return page

    def _take_lru(self, n: int) -> np.ndarray:
        """Consume the ``n`` oldest live log entries; their pages, oldest first."""
        log = np.frombuffer(self._log, dtype=np.int64)  # a view: no resize while it lives
        parts, need, h = [], n, self._head
        while need:
            m = min(log.size - h, max(2 * need, 64))
            chunk = log[h : h + m]
            live = np.flatnonzero(self._live(chunk, h))[:need]
            parts.append(chunk[live])
            if live.size == need:
                h += int(live[-1]) + 1
                need = 0
            else:
                need -= live.size
                h += m
        self._head = h
        self._num_cached -= n
        out = parts[0].copy() if len(parts) == 1 else np.concatenate(parts)
        del log, chunk
        return out

    def _live_log(self) -> np.ndarray:
        """The pages of the live log entries, oldest first (a copy)."""
        log = np.frombuffer(self._log, dtype=np.int64)[self._head :]
        out = log[self._live(log, self._head)].copy()
        del log
        return out

    def _live(self, entries: np.ndarray, index: int) -> np.ndarray:
        """Which of the log entries starting at ``self._log[index]`` are live (see the
        module doc; ``_evict_page`` tests one entry the same way)."""
        at = np.arange(self._log_base + index, self._log_base + index + entries.size)
        return self._log_pos_np[entries] == at

    def _compact_log(self) -> None:
        """Keep only the live entries (O(log length), after the log doubled)."""
        live = self._live_log()
        self._log = array("q", live.tobytes())
        self._log_base, self._head = 0, 0
        self._log_pos_np[live] = np.arange(live.size)
        self._log_limit = 2 * live.size + 1024

    # ------------------------------------------------------------------ invariants, stats
    def check(self) -> None:
        """Verify that every page is in exactly one state and that the counts add up.

        O(num_pages). Raises ``InvariantViolation`` describing the first problem found.
        """
        st, rc = self._state, self._refcount
        n = self._n
        if (rc < 0).any():
            raise InvariantViolation("a page has a negative reference count")
        if not np.isin(st, (_FREE, _CACHED, _RESERVED)).all():
            raise InvariantViolation("a page has an unknown state")
        in_use = rc > 0
        if (st[in_use] != _FREE).any():
            raise InvariantViolation("an IN_USE page is also marked CACHED or RESERVED")
        idle = ~in_use
        free_ids = np.asarray(self._free_ids(), dtype=np.int64)
        if np.unique(free_ids).size != free_ids.size:
            raise InvariantViolation("a page is in the free set twice")
        if not np.array_equal(np.sort(free_ids), np.flatnonzero(idle & (st == _FREE))):
            raise InvariantViolation("the free set and the FREE pages (count 0) disagree")
        cached_ids = self._live_log()
        if not np.array_equal(np.sort(cached_ids), np.flatnonzero(idle & (st == _CACHED))):
            raise InvariantViolation("the LRU log and the CACHED pages disagree")
        if cached_ids.size != self._num_cached:
            raise InvariantViolation(f"cached counter {self._num_cached} != {cached_ids.size} CACHED pages")
        free_or_reserved = idle & (st != _CACHED)
        if self._cacheable[free_or_reserved].any():
            raise InvariantViolation("a FREE or RESERVED page is marked cacheable")
        reserved = np.flatnonzero(st == _RESERVED).tolist()
        if reserved != ([NULL_PAGE] if self._null_page else []):
            raise InvariantViolation(f"reserved pages are {reserved}")
        n_in_use = int(in_use.sum())
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
        in_use = self.num_in_use()
        return AllocatorStats(
            total=self._n,
            free=len(self._free),
            in_use=in_use,
            cached=self._num_cached,
            reserved=self._reserved,
            peak_in_use=self._n - self._reserved - self._low,
            pages_allocated=in_use + self._zeroed - self._revived,
            pages_freed=self._zeroed - self._to_cached + self._evicted + self._uncached,
            pages_evicted=self._evicted,
            pages_revived=self._revived,
            free_runs=runs,
            largest_free_run=largest,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_pages={self._n}, free={len(self._free)}, "
            f"in_use={self.num_in_use()}, cached={self._num_cached})"
        )
