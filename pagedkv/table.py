"""``PageTable``: one sequence's page ids and token count in one ``PagePool``.

Layout, for page_size 4 and 10 tokens::

    pages:   [ 7 | 3 | 12 ]          token t lives in page pages[t // 4], slot t % 4
    tokens:    0-3  4-7  8-9 (+2 free slots in page 12)

With a sliding ``window`` W, pages whose tokens can no longer be seen by any future
query (every token < num_tokens - W + 1) are released and replaced by the allocator's
null page, so a sequence holds at most ceil(W / page_size) + 1 pages. ``rewind`` R > 0
keeps R more tokens behind the window (pages go once every token < num_tokens - W - R
+ 1): a sequence can then always be trimmed back by R tokens, however many steps wrote
them (a draft model decoding token by token, then dropping its rejected drafts), for
ceil(R / page_size) more pages at most. Without it, a trim may only go back to the
start of the last step that dropped pages.

Ownership: the table holds exactly one allocator reference per listed page (the null
page is not counted). ``trim`` and ``release`` give them back; ``fork`` takes one more
per page for the new table. Every write goes through ``prepare_write``: a page in the
written range that someone else also references (a fork, a view) or that a prefix
cache registered is copied first (copy-on-write), so no other holder ever sees the
write. That covers appends into a shared partial last page and rewrites after a trim.

All mutations are atomic: on ``PoolExhausted`` (or any error) nothing has changed.
``version`` goes up with every change of the listed page ids (not with a length that
moves inside a page), so a reader that keeps a copy of them (``PaddedPageTable``)
rebuilds it only when it changed.
Costs: ``prepare_write`` O(new pages + pages in the range) plus one page copy per
shared page; ``trim`` O(pages dropped); ``fork``/``release`` O(pages).

``BatchAppend`` is the same append for a list of tables at once (a decode step's
rows): one allocation for all of them, undone as a unit.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import attrs
import numpy as np

from pagedkv.errors import InvalidTypeError, InvalidValueError, ReleasedError, TrimError, check_int
from pagedkv.pool import PagePool, check_held_pages
from pagedkv.visibility import window_start

_NO_PAGES = np.empty(0, dtype=np.int64)


def _must_copy(alloc, page: int) -> bool:
    """A writer must copy ``page`` before changing it: another holder references it,
    or a prefix cache keeps its content. O(1), two allocator queries."""
    return alloc.refcount(page) > 1 or alloc.is_cacheable(page)


def _any_must_copy(alloc, pages: np.ndarray) -> bool:
    """Whether any of ``pages`` must be copied before a write: one vectorised query
    where the allocator offers ``needs_copy`` (``RefCountingAllocator``), else
    ``_must_copy`` page by page. O(len(pages))."""
    needs_copy = getattr(alloc, "needs_copy", None)
    if needs_copy is not None and pages.size > 4:
        return bool(needs_copy(pages).any())
    return any(_must_copy(alloc, p) for p in pages.tolist())  # (a few pages: cheaper one by one)


def _check_supply(alloc, need: np.ndarray, supply) -> np.ndarray:
    """The supplied page each table takes (-1: none), int64 [B]; ``InvalidValueError``
    unless ``supply`` is int [B] and each page taken is a distinct page in use by its
    supplier alone (reference count 1, not cached content). O(B) numpy plus O(taken)."""
    if supply.__class__ is not np.ndarray:
        supply = np.asarray(supply)
    if supply.shape != need.shape or supply.dtype.kind not in "iu":
        raise InvalidValueError(f"supply must be int [{need.size}] (a page id or -1 per table), "
                                f"got {supply.dtype} {supply.shape}")
    supplied = np.where(need == 1, supply, -1)
    taken = supplied[supplied >= 0].tolist()
    if taken and (len(set(taken)) != len(taken) or any(
            alloc.refcount(p) != 1 or alloc.is_cacheable(p) for p in taken)):
        raise InvalidValueError("a supplied page must be a distinct page its supplier alone holds")
    return supplied


def peak_pages(tokens: int, page_size: int, window: int | None = None, rewind: int = 0, chunk: int = 1) -> int:
    """The most pages one table holds for a sequence of ``tokens`` tokens written at
    most ``chunk`` per forward. Without a window: every page. With one: the window (plus
    ``rewind``) behind the last forward's start, that forward's chunk and the next one's,
    which is allocated before the pages that left the window go (they go when a forward
    opens, so that a trim back to a forward's start still finds its window); ``chunk``
    0 counts a table between forwards, as admission estimates do. O(1)."""
    full = -(-tokens // page_size)
    if window is None:
        return full
    return min(full, -(-(window + rewind + 2 * chunk) // page_size) + 1)


def check_dropped(num_tokens: int, window: int | None, dropped: int, page_size: int) -> None:
    """``InvalidValueError`` unless a table of ``window`` holding ``num_tokens`` tokens
    may list its first ``dropped`` pages as dropped: a query at the end sees no key in
    them (so ``window`` is a sliding window)."""
    if dropped < 0 or (dropped and (window is None or window_start(num_tokens, window) < dropped * page_size)):
        raise InvalidValueError(f"a query at token {num_tokens} sees keys in the {dropped} dropped pages "
                                f"(window {window}, pages of {page_size})")


@attrs.define(slots=True)
class UndoRecord:
    """What a journaled ``prepare_write`` changed: the table before it, the pages it
    allocated, and the references it still owes (see ``PageTable.prepare_write``)."""

    pages: np.ndarray | None  # None: the write listed no new page (only the length moved)
    dropped: int
    num_tokens: int
    allocated: np.ndarray
    owed: np.ndarray = _NO_PAGES


class PageTable:
    releases = 0  # tables released so far, process-wide (owners re-check their tables when it moves)
    # slots: a decode step reads and writes a few attributes of every row's table, right
    # after the GPU work has evicted them from the CPU caches (there, reserving a step
    # took 2.7x its time in a loop of its own); no per-object dict means fewer memory lines
    __slots__ = ("pool", "window", "rewind", "_retain", "_pages", "_n", "_dropped", "version", "num_tokens", "_released", "claimed")

    def __init__(self, pool: PagePool, window: int | None = None, rewind: int = 0) -> None:
        if not isinstance(pool, PagePool):
            raise InvalidTypeError(f"pool must be a PagePool, got {type(pool).__name__}")
        if window is not None:
            window = check_int("window", window, minimum=1)
        self.pool = pool
        self.window = window
        self.rewind = check_int("rewind", rewind, minimum=0)  # (no effect without a window)
        self._retain = None if window is None else window + self.rewind  # tokens kept behind a query
        self._pages = np.empty(16, dtype=np.int64)
        self._n = 0  # pages listed
        self._dropped = 0  # leading pages replaced by the null page (sliding window)
        self.version = 0  # bumped by every change of the listed page ids (readers keep copies)
        self.num_tokens = 0
        self._released = False
        self.claimed = False  # True while a cache's RowSet owns this table

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
    def num_listed(self) -> int:
        """Page indices listed, dropped pages included (``num_pages`` plus the pages a
        window dropped): the next page appended goes to index ``num_listed``."""
        return self._n

    @property
    def released(self) -> bool:
        return self._released

    def _check_alive(self) -> None:
        if self._released:
            raise ReleasedError("page table used after release()")

    # ------------------------------------------------------------------ mutations
    def _plan(self, start: int, count: int) -> tuple[int, np.ndarray]:
        """(new pages, indices of listed pages to copy first) for writing tokens
        [start, start + count).

        A listed page in that range is copied first (copy-on-write) when anyone else
        references it (a fork, a view) or when it is registered in a prefix cache (its
        content must never change). Raises unless ``start`` lies in
        [first_visible(), num_tokens].
        """
        if not self.first_visible() <= start <= self.num_tokens:
            raise InvalidValueError(
                f"cannot write at token {start}: the table holds [{self.first_visible()}, "
                f"{self.num_tokens}) and writes may not leave a gap"
            )
        ps = self.pool.page_size
        stop_page = -(-(start + count) // ps)
        need = max(0, stop_page - self._n)
        first, last = start // ps, min(stop_page, self._n)
        if first >= last:
            return need, _NO_PAGES
        alloc = self.pool.allocator
        if last - first == 1:  # the common case: the partial last page of an append
            page = int(self._pages[first])
            return need, np.array([first]) if _must_copy(alloc, page) else _NO_PAGES
        idx = np.arange(first, last)
        shared = [_must_copy(alloc, p) for p in self._pages[first:last].tolist()]
        return need, idx[np.array(shared, dtype=bool)]

    def plan_write(self, start: int, count: int) -> tuple[int, np.ndarray]:
        """(pages to allocate, indices of listed pages to copy first) for writing tokens
        [start, start + count); see ``prepare_write``."""
        return self._plan(start, count)

    def pages_needed(self, count: int, start: int | None = None) -> int:
        """Pages writing ``count`` tokens at ``start`` (default: appending) would
        allocate, copy-on-write included."""
        count = check_int("count", count, minimum=0)
        start = self.num_tokens if start is None else check_int("start", start, minimum=0)
        need, cow = self._plan(start, count)
        return need + cow.size

    def prepare_write(self, start: int, count: int, undo: list | None = None,
                      plan: tuple[int, np.ndarray] | None = None) -> None:
        """Make tokens [start, start + count) writable by this table alone.

        Allocates pages past the end (one atomic ``allocate``, also covering the
        copies), copies every shared page in the range first (copy-on-write), extends
        ``num_tokens`` to ``start + count`` if that is further, and drops pages that left
        the sliding window. On ``PoolExhausted`` or bad input nothing has changed.

        With ``undo`` (a list; a step in progress), the references this write gives up
        (pages copied away from, pages dropped by the window) are kept for now and an
        ``UndoRecord`` is appended: ``commit(record)`` gives them up, ``undo(record)``
        puts the table back exactly as it was. ``plan``: what ``plan_write(start, count)``
        returned, if nothing changed since (a row set checks every table's need first).
        """
        self._check_alive()
        count = check_int("count", count, minimum=1)
        start = check_int("start", start, minimum=0)
        need, cow = self._plan(start, count) if plan is None else plan
        if need == 0 and not cow.size and self.window is None:  # the common decode step
            if undo is not None:
                undo.append(UndoRecord(None, self._dropped, self.num_tokens, _NO_PAGES))
            self.num_tokens = max(self.num_tokens, start + count)
            return
        alloc = self.pool.allocator
        new = alloc.allocate(need + cow.size)  # atomic: raises before anything changes
        record = UndoRecord(self._pages[: self._n].copy(), self._dropped, self.num_tokens, new) \
            if undo is not None else None
        owed = []
        if cow.size:
            old = self._pages[cow].copy()
            self.pool.copy_pages(old, new[: cow.size])
            owed.append(old)
            self._pages[cow] = new[: cow.size]
            self.version += 1
            new = new[cow.size :]
        self._append(new)
        self.num_tokens = max(self.num_tokens, start + count)
        owed.append(self._drop_outside_window(start))
        owed = np.concatenate(owed) if len(owed) > 1 else owed[0]
        if record is None:
            alloc.decref(owed)
        else:
            record.owed = owed
            undo.append(record)

    def commit(self, record: UndoRecord) -> None:
        """Give up the references a journaled ``prepare_write`` kept (the step stands)."""
        if record.owed.size:
            self.pool.allocator.decref(record.owed)

    def undo(self, record: UndoRecord) -> None:
        """Put the table back as it was before the journaled ``prepare_write``: its page
        ids, length and window, with the pages allocated for it given back in reverse
        order (so a LIFO free list is as it was)."""
        self.num_tokens = record.num_tokens
        if record.pages is None:
            return
        n = record.pages.size
        self._pages[:n] = record.pages
        self._n, self._dropped = n, record.dropped
        self.version += 1
        self.pool.allocator.decref(record.allocated[::-1].copy())

    def adopt(self, pages: Sequence[int], num_tokens: int | None = None, dropped: int = 0) -> None:
        """Start an empty table with ``pages``, on which the caller has already taken one
        reference each (a prefix-cache hit, a loaded cache), holding ``num_tokens``
        tokens (default: every page full; a partial last page that another holder
        shares is copied before it is written, as for any table). ``dropped``: pages
        before ``pages`` that a sliding window has already let go (listed as the null
        page); a query at the end must see no key in them. Distinct pages in use only:
        an id out of range, a page with no reference (free, cached, the null page) or
        one listed twice is refused with a typed error, and the table stays empty."""
        self._check_alive()
        if self._n:
            raise InvalidValueError("adopt() needs an empty table")
        dropped = check_int("dropped", dropped, minimum=0)
        ids = self.pool.allocator.checked_ids(pages)  # (ints in range, 1-d; typed errors)
        check_held_pages(self.pool.allocator, ids, "adopt()")
        ps = self.pool.page_size
        full = (dropped + ids.size) * ps
        if num_tokens is None:
            num_tokens = full
        elif not full - ps < check_int("num_tokens", num_tokens) <= full:
            raise InvalidValueError(f"{num_tokens} tokens do not fill {dropped + ids.size} pages of {ps}")
        if dropped:
            check_dropped(num_tokens, self.window, dropped, ps)
            self._append(np.full(dropped, self.pool.null_page, dtype=np.int64))
            self._dropped = dropped
        self._append(ids)
        self.num_tokens = num_tokens

    def _append(self, ids: np.ndarray) -> None:
        if ids.size == 0:
            return
        if self._n + ids.size > self._pages.size:
            grown = np.empty(max(2 * self._pages.size, self._n + ids.size), dtype=np.int64)
            grown[: self._n] = self._pages[: self._n]
            self._pages = grown
        self._pages[self._n : self._n + ids.size] = ids
        self._n += ids.size
        self.version += 1

    def _drop_outside_window(self, first_query: int) -> np.ndarray:
        """Replace pages no query from ``first_query`` on can see by the null page;
        returns their ids (the caller gives their references back)."""
        if self.window is None:
            return _NO_PAGES
        droppable = self._droppable(first_query)
        if droppable <= self._dropped:
            return _NO_PAGES
        gone = self._pages[self._dropped : droppable].copy()
        self._pages[self._dropped : droppable] = self.pool.null_page
        self._dropped = droppable
        self.version += 1
        return gone

    def _droppable(self, first_query: int) -> int:
        """Pages before the one holding the earliest key a query from ``first_query`` on
        sees (or ``rewind`` tokens before it): a write there drops those still held. A
        windowed table only. O(1)."""
        return window_start(first_query, self._retain) // self.pool.page_size

    def drops_pages_at(self, first_query: int) -> bool:
        """Whether a write whose first query is at ``first_query`` drops pages behind the
        window (as ``prepare_write`` does). O(1)."""
        check_int("first_query", first_query, minimum=0)
        return self.window is not None and self._droppable(first_query) > self._dropped

    def first_visible(self) -> int:
        """First token position whose page is still held (0 without a window)."""
        return self._dropped * self.pool.page_size

    def _min_rewind_length(self) -> int:
        """The shortest length a layer may go back to: a query there must still find
        every key of its window held (0 without a window or before any page dropped)."""
        if self.window is None or self._dropped == 0:
            return 0
        return self.first_visible() + self.window - 1

    def max_rewind(self, length: int) -> int:
        """How many of the first ``length`` tokens can be un-written (trimmed)."""
        length = check_int("length", length, minimum=0)
        return max(0, length - self._min_rewind_length())

    def check_rewind(self, new_length: int) -> None:
        """Raise ``TrimError`` unless a layer may go back to ``new_length`` tokens."""
        new_length = check_int("new_length", new_length, minimum=0)
        if new_length < self._min_rewind_length():
            raise TrimError(
                f"cannot go back to {new_length} tokens: a query there sees keys from "
                f"{max(0, new_length - self.window + 1)}, but pages before token "
                f"{self.first_visible()} already left the sliding window of {self.window}"
            )

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (at most all); free now-unused tail pages.

        Returns the number trimmed. Raises ``TrimError`` (and changes nothing) if a query
        at the new end would need keys whose pages already left the sliding window.
        """
        self._check_alive()
        n = min(check_int("n", n, minimum=0), self.num_tokens)
        if n == 0:
            return 0
        new_len = self.num_tokens - n
        self.check_rewind(new_len)
        keep = -(-new_len // self.pool.page_size)
        if keep < self._n:
            self.pool.allocator.decref(self._pages[keep : self._n].copy())
            self._n = keep
            self.version += 1
        self.num_tokens = new_len
        return n

    def fork(self) -> PageTable:
        """A new table sharing every page (one more reference each); copy-on-write later."""
        self._check_alive()
        held = self._pages[self._dropped : self._n]
        self.pool.allocator.incref(held)
        other = PageTable(self.pool, self.window, self.rewind)
        other._append(self._pages[: self._n].copy())
        other._dropped = self._dropped
        other.num_tokens = self.num_tokens
        return other

    def release(self) -> None:
        """Give back every page reference, last page first, so that a prefix cache's LRU
        evicts a released chain from its tail and what survives still matches a prefix.
        A second call raises ``ReleasedError``."""
        self._check_alive()
        self.pool.allocator.decref(self._pages[self._dropped : self._n][::-1].copy())
        self._released = True
        PageTable.releases += 1
        self._n = self._dropped = self.num_tokens = 0
        self.version += 1

    # ------------------------------------------------------------------ page ids
    def page_ids(self, first: int, stop: int) -> np.ndarray:
        """Listed page ids [first, stop) (a view; stop is clipped to the listed pages).
        ``InvalidValueError`` unless 0 <= first <= stop (a negative index would read
        past the listed pages, into the table's spare capacity)."""
        if not 0 <= first <= stop:
            raise InvalidValueError(f"page range [{first}, {stop}) is not a range of page indices")
        return self._pages[first : min(stop, self._n)]

    def page_at(self, index: int) -> int:
        """The page id at page index ``index`` (which must be listed); O(1)."""
        if not self._dropped <= index < self._n:
            raise InvalidValueError(f"page {index} is not held by this table")
        return int(self._pages[index])

    def page_ids_at(self, index: np.ndarray) -> np.ndarray:
        """The page ids at page indices ``index`` (which must be listed)."""
        if index.size and (index.min() < self._dropped or index.max() >= self._n):
            raise InvalidValueError(f"pages {index.min()}..{index.max()} are not held by this table")
        return self._pages[index]

    def __del__(self) -> None:
        # A table dropped while it lists pages keeps them in use for good. Nothing gives
        # them back here: a finalizer may run on any thread, in the middle of the owner's
        # own allocator call. Say so, as Python does for a file never closed.
        held = getattr(self, "_n", 0) - getattr(self, "_dropped", 0)
        if held > 0 and not getattr(self, "_released", True):
            try:
                warnings.warn(f"a PageTable listing {held} pages was dropped without release(): they stay in use "
                              "(release() the cache or table, or use it in a with block)", ResourceWarning,
                              stacklevel=2)
            except Exception:  # noqa: BLE001 - (interpreter shutdown: warnings may be gone)
                pass

    def __repr__(self) -> str:
        state = "released" if self._released else f"tokens={self.num_tokens}, pages={self.num_pages}"
        rewind = f", rewind={self.rewind}" if self.rewind else ""
        return f"PageTable({state}, window={self.window}{rewind})"


class BatchAppend:
    """``count`` tokens appended to the end of every table of a list (a decode step's
    tables of one pool, window and rewind: ``LayerLayout.append_groups``) as one change
    that can be undone: the vectorised form of a
    journaled ``prepare_write(num_tokens, count)`` per table.

    ``plan`` decides without changing anything; it returns None where the per-table path
    must run instead: tables of other pools or windows, a released table, a written
    range that spans more than one listed page, or a listed page that needs copying
    first (shared, or registered in a prefix cache). ``apply`` then takes every new page
    in one ``allocate`` (``PoolExhausted`` before any change), hands them out in table
    order, moves each table's length and, with a sliding window, replaces the pages that
    left it by the null page, as ``prepare_write`` does; ``undo`` puts the lengths,
    listed pages and dropped pages back and returns the new pages last first, so a LIFO
    free list is as it was; ``commit`` gives up the dropped pages' references (rows in
    table order, pages in page order: what a ``prepare_write`` per table gives up).

    A caller that holds pages ahead of need (a compiled decode step's lookahead,
    :mod:`pagedkv.compiled_decode`) passes them as ``supply``: int64 [B], a page id per
    table or -1. A table that needs exactly one new page takes its supplied page instead
    of an allocated one; the caller's reference becomes the table's when the step
    commits, and ``undo`` takes the page off the table without freeing it (the caller
    still holds it). The caller sees what was taken by the page ids the tables list.

    Ownership: the tables stay their owner's; the record holds the new page ids until
    the step closes. Costs: ``plan`` O(B) Python attribute reads plus one allocator
    query; ``apply`` one allocation and O(pages allocated), plus O(B) with a window.
    """

    __slots__ = ("tables", "count", "need", "num_new_pages", "_tokens", "_listed", "_new", "_supplied", "_drops")

    def __init__(self, tables: list[PageTable], count: int, need: np.ndarray, tokens: np.ndarray,
                 listed: np.ndarray, supplied: np.ndarray) -> None:
        self.tables, self.count = tables, count
        self.need = need  # int64 [B]: pages each table gets
        self._tokens, self._listed = tokens, listed
        self._supplied = supplied  # int64 [B]: the supplied page each table takes, or -1
        # pages to allocate (supplied pages not counted)
        self.num_new_pages = int(need.sum()) - (int((supplied >= 0).sum()) if supplied.size else 0)
        self._new = _NO_PAGES
        self._drops: list[tuple[PageTable, int, np.ndarray]] = []  # (table, its _dropped before, pages dropped)

    @classmethod
    def plan(cls, tables: list[PageTable], count: int, tokens: np.ndarray | None = None,
             supply: np.ndarray | None = None, vouched: bool = False) -> BatchAppend | None:
        """``tokens``: the tables' ``num_tokens`` as int64 [B], where the caller has them;
        ``supply``: pages the caller holds for the tables (see the class doc);
        ``vouched``: the caller has made sure the tables are live, of one pool and of one
        window and rewind (a ``RowSet`` for one spec), so they are not checked again."""
        if not tables:
            return None
        pool, retain = tables[0].pool, tables[0]._retain
        ps, b = pool.page_size, len(tables)
        if not vouched and any(t._released or t.pool is not pool or t._retain != retain for t in tables):
            return None
        if b == 1 and supply is None:  # one row (a sequence's step): the same decisions on ints
            t = tables[0]
            n = t.num_tokens if tokens is None else int(tokens[0])
            first, stop, listed = n // ps, -(-(n + count) // ps), t._n
            span = min(stop, listed) - first
            if span > 1 or (span == 1 and _must_copy(pool.allocator, int(t._pages[first]))):
                return None
            return cls(tables, count, np.array([max(stop - listed, 0)]), np.array([n]), np.array([listed]),
                       _NO_PAGES)
        if tokens is None:
            tokens = np.fromiter((t.num_tokens for t in tables), np.int64, b)
        listed = np.fromiter((t._n for t in tables), np.int64, b)
        stop = -(-(tokens + count) // ps)
        first = tokens // ps
        span = np.minimum(stop, listed) - first  # listed pages in the written range
        if span.max() > 1:
            return None
        partial = (span == 1).nonzero()[0]
        if partial.size:
            at = first[partial].tolist()
            last = np.fromiter((tables[i]._pages[p] for i, p in zip(partial.tolist(), at)), np.int64, partial.size)
            if _any_must_copy(pool.allocator, last):
                return None
        need = np.maximum(stop - listed, 0)
        supplied = _NO_PAGES if supply is None else _check_supply(pool.allocator, need, supply)
        return cls(tables, count, need, tokens, listed, supplied)

    @property
    def pool(self) -> PagePool:
        return self.tables[0].pool

    def apply(self) -> None:
        total = self.num_new_pages
        if total:
            self._new = self.pool.allocator.allocate(total)  # atomic: raises before anything changes
        if total or self._supplied.size:
            supplied = self._supplied.tolist() if self._supplied.size else None
            at = 0
            for i in self.need.nonzero()[0].tolist():
                if supplied is not None and supplied[i] >= 0:
                    self.tables[i]._append(self._supplied[i : i + 1])
                    continue
                n = int(self.need[i])
                self.tables[i]._append(self._new[at : at + n])
                at += n
        for t, n in zip(self.tables, (self._tokens + self.count).tolist()):
            t.num_tokens = n
        window = self.tables[0].window
        if window is not None:
            # as _drop_outside_window, for every row at once: which rows drop pages now
            droppable = window_start(self._tokens, self.tables[0]._retain) // self.pool.page_size
            dropped = np.fromiter((t._dropped for t in self.tables), np.int64, len(self.tables))
            for i in (droppable > dropped).nonzero()[0].tolist():
                t = self.tables[i]
                self._drops.append((t, t._dropped, t._drop_outside_window(int(self._tokens[i]))))

    def commit(self) -> None:
        self._new = _NO_PAGES
        if self._drops:
            owed = np.concatenate([gone for _, _, gone in self._drops])
            self._drops = []
            self.pool.allocator.decref(owed)

    def undo(self) -> None:
        for t, dropped, gone in reversed(self._drops):
            t._pages[dropped : dropped + gone.size] = gone
            t._dropped = dropped
            t.version += 1
        self._drops = []
        for t, n, listed in zip(self.tables, self._tokens.tolist(), self._listed.tolist()):
            if t._n != listed:
                t._n = listed
                t.version += 1
            t.num_tokens = n
        if self._new.size:
            self.pool.allocator.decref(self._new[::-1].copy())
            self._new = _NO_PAGES
