"""``PagedSequence``: one sequence's page tables, its per-layer caches, and its steps.

A sequence of a model with full and sliding-window layers has one ``PageTable`` per
attention kind; each layer's ``PagedKVCache`` writes through one of them::

    PagedSequence
      tables:  [full table, sliding table(s) ...]     owned until release() or a move
      caches:  [layer 0 → sliding, layer 1 → full, ...]  each with its own ``offset``

A *step* is one ``update_and_fetch`` of every layer with the same T tokens. mlx-lm calls
the layers one after another, so the sequence makes the step atomic:

- the first layer of a step reserves the step's pages in *every* table of the sequence
  that stands at the same position, after checking that each pool has the pages for all
  of them; a full pool raises ``PoolExhausted`` before any layer has written;
- a later layer whose input is bad (shape, dtype) rolls the step back: the layers that
  already wrote it return to their pre-step offsets and the tables to their pre-step
  pages, so the sequence is as it was before the step. While a step is open the tables
  keep their references to pages they copied away from or dropped from the window;
  closing the step (every layer wrote it, or anything else happens to the sequence)
  gives them up. Only allocator counters such as ``pages_allocated``, and prefix pages
  evicted to make room, record the round trip;
- a write at a position the table already holds (a layer trimmed on its own, then
  written again) is a rewrite: its pages are made private first (copy-on-write), so a
  fork or a view never sees it.

Ownership: the sequence owns its tables. ``release()`` gives every page back once;
``move_out()`` hands the tables to a batch, after which every cache of the sequence
raises ``ReleasedError``. Costs: per write O(tables) Python work plus what the table
does; rollback O(layers of the step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from pagedkv.errors import InvalidValueError, KvShapeError, PoolExhausted, ReleasedError
from pagedkv.table import PageTable

if TYPE_CHECKING:
    from pagedkv.cache import PagedKVCache


class PagedSequence:
    def __init__(self, tables: Sequence[PageTable]) -> None:
        tables = list(tables)
        if not tables:
            raise InvalidValueError("a sequence needs at least one page table")
        for t in tables:
            if not isinstance(t, PageTable):
                raise InvalidValueError(f"expected PageTables, got {type(t).__name__}")
            if t.released:
                raise ReleasedError("cannot build a sequence on a released page table")
        self.tables = tables
        for t in tables:
            t.sequence = self
        self.caches: list[PagedKVCache] = []
        self._moved: str | None = None  # why the tables are gone, once moved out
        # The open step (none while the journal is empty): the tables it grew, each with
        # its UndoRecord, in reservation order; where it started; the positions of the
        # layers that wrote it so far; how many layers write it in all.
        self._journal: list = []
        self._step_start = 0
        self._saved: dict[int, tuple] = {}  # id(cache) -> (cache, its position before)
        self._writers = 0

    # ------------------------------------------------------------------ lifetime
    def check_alive(self) -> None:
        if self._moved is not None:
            raise ReleasedError(f"this cache's pages were {self._moved}; use the new owner instead")
        if any(t.released for t in self.tables):
            raise ReleasedError("cache used after its pages were released")

    @property
    def released(self) -> bool:
        return self._moved is not None or all(t.released for t in self.tables)

    def release(self) -> None:
        """Give back every page of every table; a second call raises ``ReleasedError``."""
        if self._moved is not None:
            raise ReleasedError(f"this cache's pages were {self._moved}")
        if all(t.released for t in self.tables):
            raise ReleasedError("prompt cache released twice")
        self._close_step()
        for t in self.tables:
            if not t.released:
                t.release()

    def move_out(self, where: str) -> list[PageTable]:
        """Hand the tables to a new owner; this sequence and its caches are dead after."""
        self.check_alive()
        self._close_step()
        self._moved = where
        tables, self.tables = self.tables, []
        for t in tables:
            t.sequence = None
        return tables

    def members(self, table: PageTable) -> list[PagedKVCache]:
        return [c for c in self.caches if c.table is table]

    # ------------------------------------------------------------------ steps
    def prepare(self, cache: PagedKVCache, start: int, count: int) -> None:
        """Make tokens [start, start + count) of ``cache``'s table writable (see the
        module doc); atomic."""
        table = cache.table
        end = start + count
        if end > table.num_tokens:
            if start != table.num_tokens:
                raise KvShapeError(
                    f"layer {cache.layer} is at {start} but its table at {table.num_tokens}: "
                    "layers of one sequence must advance together"
                )
            self._open_step(start, count)
        elif not self._in_step(table) or start < self._step_start:
            table.prepare_write(start, count)  # a rewrite: copy-on-write of shared pages
            return
        if id(cache) not in self._saved:  # a layer of the open step: saved for rollback
            self._saved[id(cache)] = (cache, cache.save_position())

    def _in_step(self, table: PageTable) -> bool:
        return any(t is table for t, _ in self._journal)

    def _open_step(self, start: int, count: int) -> None:
        growing = [t for t in self.tables if t.num_tokens == start]
        by_pool: dict[int, list] = {}
        for t in growing:
            by_pool.setdefault(id(t.pool), [t.pool, 0])[1] += t.pages_needed(count)
        for pool, need in by_pool.values():
            available = pool.allocator.num_available()
            if need > available:
                raise PoolExhausted(need, available)
        self._close_step()  # a step some layers never finished stands as it is
        for t in growing:  # cannot run out now: every pool was checked for all its tables
            records: list = []
            t.prepare_write(start, count, undo=records)
            self._journal.append((t, records[0]))
        self._step_start = start
        self._writers = sum(1 for c in self.caches if self._in_step(c.table))

    def finished_write(self) -> None:
        """Close the step once every layer of the tables it grew has written it."""
        if self._journal and len(self._saved) >= self._writers:
            self._close_step()

    def _close_step(self) -> None:
        """The step stands: tables give up the pages they copied away from or dropped."""
        for table, record in self._journal:
            table.commit(record)
        self._forget_step()

    def abort_write(self, cache: PagedKVCache) -> None:
        """``cache``'s write failed. If it is a layer of the open step that has not
        written it yet, undo the step: layers and tables exactly as before it, page ids
        and reference counts included. Any other failed write changed nothing."""
        if not self._in_step(cache.table) or id(cache) in self._saved:
            return
        for layer, position in self._saved.values():
            layer.restore_position(position)
        for table, record in reversed(self._journal):  # the free list's order returns too
            table.undo(record)
        self._forget_step()

    def _forget_step(self) -> None:
        self._journal = []
        self._saved = {}
        self._writers = 0

    def trim_tables(self) -> None:
        """Shrink each table to its furthest layer (after layers trimmed)."""
        self._close_step()
        for t in self.tables:
            members = self.members(t)
            target = max((c.offset for c in members), default=0)
            if target < t.num_tokens:
                t.trim(t.num_tokens - target)
