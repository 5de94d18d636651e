"""``PaddedPageTable``: the [B, width] page-id table of a list of ``PageTable`` rows,
kept on the host from one read to the next and rebuilt only where a row changed.

A read of B rows (``PageRead``) needs each row's page ids from its first needed page,
padded with the null page to one width::

    row b:  [ pages first[b] .. stop[b]-1 of tables[b] | null ... null ]   int32 [B, width]

Building that from scratch is O(B * width) numpy work and O(B) Python calls per step,
though a decode step changes at most the rows that grew a page (one row in
``page_size`` per step on average). So the table is kept, and each row remembers what
it was built from: the table object, its ``version`` (bumped by every change of its
page list) and its (first, stop). A call compares those for all rows at once and
rewrites only the rows that differ; a new row count or width rebuilds everything.

Ownership: the host array is this object's and is overwritten by the next call, so a
caller that keeps the content copies it. ``device()`` is that copy as an MLX array,
made once and handed out again until a call changes the table (a decode step's read
changes it once every ``page_size`` steps per row), together with a list its readers
share to keep what they derive from it (``PageRead``'s gather index). For one row,
``run`` says whether its pages are consecutive ids (then a reader may take them as one
slice of the pool's arrays: ``PagePool.borrow_run``). No page references are held.
Costs per call: O(B) comparisons, plus O(width) per changed row; O(B * width) after a
change of shape.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from pagedkv.table import PageTable


class PaddedPageTable:
    """One reader's padded page-id table (see the module doc); ``null`` pads rows."""

    __slots__ = ("null", "host", "run", "_tables", "_versions", "_first", "_stop", "_device")

    def __init__(self, null: int) -> None:
        self.null = null
        self.host = np.empty((0, 0), dtype=np.int32)
        self._tables: list[PageTable] = []
        self._versions: list[int] = []
        self._first = self._stop = np.empty(0, dtype=np.int64)
        self._device: tuple[mx.array, list] | None = None  # (host as MLX, derived arrays)
        # one row whose pages [first, stop) are consecutive ids (a sequence that took its
        # pages in order from a fresh pool): the first of them, else -1
        self.run = -1

    def update(self, tables: Sequence[PageTable], first: np.ndarray, stop: np.ndarray, width: int) -> np.ndarray:
        """The table for pages [first[b], stop[b]) of ``tables[b]`` (stop clipped to
        the listed pages), ``width`` columns; returns ``host`` (see Ownership)."""
        b = len(tables)
        versions = [t.version for t in tables]
        if self.host.shape != (b, width):
            self.host = np.full((b, width), self.null, dtype=np.int32)
            changed = range(b)
            self._device = None
        else:
            moved = (first != self._first) | (stop != self._stop)
            if versions == self._versions and tables == self._tables:  # (the usual step: in C)
                changed = moved.nonzero()[0].tolist()
            else:
                changed = [i for i, (t, v, p, pv, m) in enumerate(
                    zip(tables, versions, self._tables, self._versions, moved.tolist()))
                    if m or t is not p or v != pv]
        if changed:
            self._device = None
            host = self.host
            for i in changed:
                ids = tables[i].page_ids(int(first[i]), int(stop[i]))
                n = ids.size
                host[i, :n] = ids
                host[i, n:] = self.null
            self.run = -1  # (with one row, ``ids`` and ``n`` are that row's)
            if b == 1 and n and int(ids[-1]) - int(ids[0]) == n - 1 and (ids == ids[0] + np.arange(n)).all():
                self.run = int(ids[0])
        self._tables = list(tables)
        self._versions = versions
        self._first, self._stop = first, stop
        return self.host

    def device(self) -> tuple[mx.array, list]:
        """``host`` as of the last ``update``, as an int32 MLX array, and a list its
        readers share for arrays derived from it; the same two objects until an
        ``update`` changes the table. O(1), or one copy of the table."""
        if self._device is None:
            self._device = (mx.array(self.host), [])
        return self._device
