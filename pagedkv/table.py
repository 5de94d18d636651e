"""``PageTable``: one sequence's page ids and token count in one ``PagePool``.

Layout, for page_size 4 and 10 tokens::

    pages:   [ 7 | 3 | 12 ]          token t lives in page pages[t // 4], slot t % 4
    tokens:    0-3  4-7  8-9 (+2 free slots in page 12)

With a sliding ``window`` W, pages whose tokens can no longer be seen by any future
query (every token < num_tokens - W + 1) are released and replaced by the allocator's
null page, so a sequence holds at most ceil(W / page_size) + 1 pages.

Ownership: the table holds exactly one allocator reference per listed page (the null
page is not counted). ``trim`` and ``release`` give them back; ``fork`` takes one more
per page for the new table. A write into a partial last page that someone else also
references (a fork, or a view taken before a trim) first copies that page
(copy-on-write), so no other holder ever sees the write.

All mutations are atomic: on ``PoolExhausted`` (or any error) nothing has changed.
Costs: ``reserve`` O(new pages) plus one page copy for copy-on-write; ``trim`` O(pages
dropped); ``fork``/``release`` O(pages); index helpers are memoised per table version.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from pagedkv.errors import ReleasedError
from pagedkv.pool import PagePool


class PageTable:
    def __init__(self, pool: PagePool, window: int | None = None) -> None:
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        self.pool = pool
        self.window = window
        self._pages = np.empty(16, dtype=np.int64)
        self._n = 0  # pages listed
        self._dropped = 0  # leading pages replaced by the null page (sliding window)
        self.num_tokens = 0
        self._released = False
        self._version = 0
        self._memo: dict = {}
        self.members: list = []  # per-layer caches sharing this table (set by the cache)

    # ------------------------------------------------------------------ queries
    @property
    def pages(self) -> np.ndarray:
        """The listed page ids (a copy; null page ids where a window dropped pages)."""
        return self._pages[: self._n].copy()

    @property
    def num_pages(self) -> int:
        """Pages this table holds a reference on (dropped pages excluded)."""
        return self._n - self._dropped

    @property
    def released(self) -> bool:
        return self._released

    def _check_alive(self) -> None:
        if self._released:
            raise ReleasedError("page table used after release()")

    # ------------------------------------------------------------------ mutations
    def _plan(self, count: int) -> tuple[int, bool]:
        """(new pages, copy-on-write?) for appending ``count`` tokens.

        The partial last page is copied first when anyone else references it (a fork, a
        view) or when it is registered in a prefix cache (its content must never change).
        """
        ps = self.pool.page_size
        start = self.num_tokens
        need = -(-(start + count) // ps) - self._n
        if start % ps == 0:
            return need, False
        last = int(self._pages[self._n - 1])
        alloc = self.pool.allocator
        return need, alloc.refcount(last) > 1 or alloc.is_cacheable(last)

    def pages_needed(self, count: int) -> int:
        """Pages ``reserve(count)`` would allocate, copy-on-write included."""
        need, cow = self._plan(count)
        return need + int(cow)

    def reserve(self, count: int) -> int:
        """Make room for ``count`` more tokens; returns the first new position.

        Allocates pages as needed (one atomic ``allocate``), copies a shared partial last
        page first, and drops pages that left the sliding window.
        """
        self._check_alive()
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be a positive int, got {count!r}")
        start = self.num_tokens
        need, cow = self._plan(count)
        alloc = self.pool.allocator
        new = alloc.allocate(need + int(cow))  # atomic: raises before anything changes
        if cow:
            last = self._pages[self._n - 1 : self._n].copy()
            self.pool.copy_pages(last, new[:1])
            alloc.decref(last)
            self._pages[self._n - 1] = new[0]
            new = new[1:]
        self._append(new)
        self.num_tokens = start + count
        self._drop_outside_window(start)
        self._version += 1
        return start

    def _append(self, ids: np.ndarray) -> None:
        if ids.size == 0:
            return
        if self._n + ids.size > self._pages.size:
            grown = np.empty(max(2 * self._pages.size, self._n + ids.size), dtype=np.int64)
            grown[: self._n] = self._pages[: self._n]
            self._pages = grown
        self._pages[self._n : self._n + ids.size] = ids
        self._n += ids.size

    def _drop_outside_window(self, first_query: int) -> None:
        if self.window is None:
            return
        # The earliest key any query from ``first_query`` on can see.
        keep_from = first_query - self.window + 1
        droppable = max(0, keep_from // self.pool.page_size)
        if droppable > self._dropped:
            gone = self._pages[self._dropped : droppable].copy()
            self._pages[self._dropped : droppable] = self.pool.null_page
            self._dropped = droppable
            self.pool.allocator.decref(gone)

    def first_visible(self) -> int:
        """First token position whose page is still held (0 without a window)."""
        return self._dropped * self.pool.page_size

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (at most all); free now-unused tail pages.

        Returns the number trimmed. Raises ``ValueError`` if the trim would reach tokens
        whose pages already left the sliding window.
        """
        self._check_alive()
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        n = min(n, self.num_tokens)
        if n == 0:
            return 0
        new_len = self.num_tokens - n
        keep = -(-new_len // self.pool.page_size)
        if keep < self._dropped or (self._dropped and new_len < self.first_visible()):
            raise ValueError("cannot trim into pages that already left the sliding window")
        if keep < self._n:
            self.pool.allocator.decref(self._pages[keep : self._n].copy())
            self._n = keep
        self.num_tokens = new_len
        self._version += 1
        return n

    def fork(self) -> PageTable:
        """A new table sharing every page (one more reference each); copy-on-write later."""
        self._check_alive()
        held = self._pages[self._dropped : self._n]
        self.pool.allocator.incref(held)
        other = PageTable(self.pool, self.window)
        other._append(self._pages[: self._n].copy())
        other._dropped = self._dropped
        other.num_tokens = self.num_tokens
        return other

    def release(self) -> None:
        """Give back every page reference. A second call raises ``ReleasedError``."""
        self._check_alive()
        self.pool.allocator.decref(self._pages[self._dropped : self._n].copy())
        self._released = True
        self._n = self._dropped = self.num_tokens = 0
        self._memo.clear()

    # ------------------------------------------------------------------ index helpers
    def write_index(self, start: int, count: int) -> tuple[mx.array, mx.array]:
        """Pool scatter indices for tokens [start, start + count); memoised per version."""
        key = ("w", self._version, start, count)
        hit = self._memo.get(key)
        if hit is None:
            if start < self.first_visible() or start + count > self._n * self.pool.page_size:
                raise ValueError(f"tokens [{start}, {start + count}) are not reserved in this table")
            hit = self.pool.token_rows_slots(self._pages[: self._n], start, count)
            self._remember(key, hit)
        return hit

    def read_index(self, first_page: int, stop_page: int) -> mx.array:
        """Pool gather indices for pages [first_page, stop_page); memoised per version."""
        key = ("r", self._version, first_page, stop_page)
        hit = self._memo.get(key)
        if hit is None:
            _, hit = self.pool.gather_index([self._pages[first_page:stop_page]])
            self._remember(key, hit)
        return hit

    def _remember(self, key: tuple, value) -> None:
        if len(self._memo) > 8:
            self._memo = {k: v for k, v in self._memo.items() if k[1] == self._version}
        self._memo[key] = value

    def __repr__(self) -> str:
        state = "released" if self._released else f"tokens={self.num_tokens}, pages={self.num_pages}"
        return f"PageTable({state}, window={self.window})"
