"""``KvAttentionView``: a captured, reference-holding view of K/V pages for one layer.

At creation a view snapshots the page tables of its rows into int32 gather indices,
records each row's visible token range [start, length), and takes one allocator
reference per page it covers. From then on nothing the owning caches do (append, trim,
fork, release, or other sequences reusing freed capacity) changes what it returns:
its pages cannot be freed, and a write into one of its pages by a table goes to a
copy first (the table's copy-on-write). It reads the pool's *current* array when it
attends, never a captured one, so holding a view never blocks in-place pool writes.

Rows (B > 1) are padded with the null page to the longest row; padding and tokens
outside [start, length) are masked out. Layout of the gathered keys::

    row b: [ pages[b][0] | pages[b][1] | ... ]  -> [B, kv_heads, n_pages * page_size, D]
           ^ start_b (first visible)    ^ length_b (exclusive)

Ownership: the view owns its page references and its index snapshot; ``release()``
gives the references back exactly once. ``attend``/``keys_values`` after release, or a
second release, raise ``ReleasedError``. Costs: creation O(pages) (one batched
incref); ``attend`` one gather of O(pages) + SDPA; ``release`` one batched decref.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import attrs
import mlx.core as mx
import numpy as np

from pagedkv.errors import (
    InvalidTypeError,
    InvalidValueError,
    KvShapeError,
    ReleasedError,
    check_int,
)
from pagedkv.page_read import PageRead
from pagedkv.pool import PagePool
from pagedkv.visibility import page_span, window_start

if TYPE_CHECKING:
    from pagedkv.cache import PagedKVCache
    from pagedkv.table import PageTable


class KvAttentionView:
    def __init__(
        self,
        pool: PagePool,
        layer: int,
        tables: Sequence[PageTable],
        lengths: Sequence[int] | None = None,
        starts: Sequence[int] | None = None,
    ) -> None:
        if not isinstance(pool, PagePool):
            raise InvalidTypeError(f"pool must be a PagePool, got {type(pool).__name__}")
        layer = pool.check_layer(layer)
        tables = list(tables)
        if not tables:
            raise InvalidValueError("a view needs at least one page table")
        lengths = [t.num_tokens for t in tables] if lengths is None else [check_int("length", n) for n in lengths]
        starts = [t.first_visible() for t in tables] if starts is None else [check_int("start", n) for n in starts]
        if len(lengths) != len(tables) or len(starts) != len(tables):
            raise InvalidValueError("one length and one start per table")
        for t, lo, hi in zip(tables, starts, lengths):
            if getattr(t, "pool", None) is not pool:
                raise InvalidValueError("every table of a view must list pages of the view's pool")
            if t.released:
                raise ReleasedError("cannot view a released page table")
            if not (t.first_visible() <= lo <= hi <= t.num_tokens) or hi < 1:
                raise InvalidValueError(
                    f"rows must view a non-empty range of held tokens [{t.first_visible()}, "
                    f"{t.num_tokens}), got [{lo}, {hi})"
                )
        self.starts = list(starts)  # first visible token per row
        self.lengths = list(lengths)  # one past the last
        lo, hi = np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64)
        self._read = PageRead.of(pool, tables, lo, hi)
        first, stop, _ = page_span(lo, hi, pool.page_size)
        held = np.concatenate([t.page_ids(f, e) for t, f, e in zip(tables, first.tolist(), stop.tolist())])
        pool.allocator.incref(held)  # the last step that can fail: nothing to undo
        self._held = held
        self.pool = pool
        self.layer = layer
        self.batch = len(tables)
        self._released = False

    @classmethod
    def of_cache(cls, cache: PagedKVCache, start: int | None = None) -> KvAttentionView:
        """A view of what ``cache`` holds now: tokens [start, offset) of its layer.

        ``start`` defaults to the first key the cache's own window still shows.
        """
        cache.rows.check_alive()
        if start is None:  # what the cache's last query (at offset - 1) sees
            start = max(window_start(cache.offset - 1, cache.window), cache.table.first_visible())
        return cls(cache.pool, cache.pool_layer, [cache.table], [cache.offset], [start])

    # ------------------------------------------------------------------ reading
    @property
    def released(self) -> bool:
        return self._released

    def _check(self) -> None:
        if self._released:
            raise ReleasedError("KvAttentionView used after release()")

    def parts(self):
        """The gathered page components of K and V (packed pages stay packed).

        One row: tokens [start, length) exactly; several rows: [B, kv_heads, width, c]
        with each row's tokens from its first page (see ``valid_mask``).
        """
        self._check()
        return self._read.parts(self.layer, exact=True)

    def keys_values(self) -> tuple[mx.array, mx.array]:
        """Contiguous float K/V (decoded and un-rotated for quantised pages); layout as
        ``parts``."""
        return self.pool.kind.decode(*self.parts())

    def valid_mask(self, n_queries: int, causal: bool, window: int | None = None) -> mx.array:
        """Bool [B, 1, n_queries, keys]: which keys of ``parts`` each row's last
        ``n_queries`` positions may see. ``ReleasedError`` after ``release``."""
        self._check()
        n_queries = check_int("n_queries", n_queries, minimum=1)
        window = None if window is None else check_int("window", window, minimum=1)
        return self._read.mask(n_queries, exact=True, causal=causal, window=window)

    def attend(self, q: mx.array, scale: float, mask=None, window: int | None = None) -> mx.array:
        """Attention of ``q`` [B, n_heads, L, D] over the view (GQA: n_heads % kv_heads == 0).

        ``mask``: None, "causal" (queries are the last L positions) or an array
        broadcastable to [B, n_heads, L, keys]; ``window`` additionally limits each query
        to the last ``window`` keys up to its position (a drafter's sliding window).
        On a CUDA GPU, one query per row (mask None or "causal") or several ("causal")
        read the pool through the decode or prefill kernel; otherwise the pages are
        gathered (``PageRead.attend``).
        """
        self._check()
        if not isinstance(q, mx.array) or q.ndim != 4:
            raise KvShapeError(f"queries must be [B, n_heads, L, D], got {getattr(q, 'shape', q)}")
        if isinstance(mask, str) and mask != "causal":
            raise InvalidValueError(f"mask must be None, 'causal' or an array, got {mask!r}")
        window = None if window is None else check_int("window", window, minimum=1)
        b, n_heads, n_q, d = q.shape
        pool = self.pool
        if b != self.batch or n_heads % pool.num_kv_heads or d != pool.head_dim:
            raise KvShapeError(
                f"queries {tuple(q.shape)} do not fit a view of {self.batch} rows, "
                f"{pool.num_kv_heads} kv heads, head_dim {pool.head_dim}"
            )
        read, causal = self._read, isinstance(mask, str) and mask == "causal"
        # the rows' ranges, causality and the window are all the mask says: the kernels apply them
        kernel = causal or (n_q == 1 and mask is None)
        if n_q == 1 and kernel and window is not None:  # one query: its window is a range
            read, window = attrs.evolve(read, lo=np.maximum(read.lo, read.hi - window)), None
        if read.num_rows > 1 or window is not None:
            row = read.mask(n_q, exact=True, causal=causal or window is not None, window=window)
            row = row[0, 0] if read.num_rows == 1 else row
            if isinstance(mask, mx.array):
                row = row & mask if mask.dtype == mx.bool_ else mx.where(row, mask, -mx.inf)
            mask = row
        elif n_q == 1 and kernel:
            mask = None
        return read.attend(self.layer, q, scale, mask, exact=True, kernel=kernel, window=window)

    # ------------------------------------------------------------------ lifetime
    def release(self) -> None:
        """Give back the page references (exactly once)."""
        self._check()
        self._released = True
        self.pool.allocator.decref(self._held)
        self._held = None

    def __enter__(self) -> KvAttentionView:
        return self

    def __exit__(self, *exc) -> None:
        if not self._released:
            self.release()

    def __repr__(self) -> str:
        if not hasattr(self, "_released"):
            return "KvAttentionView(not built)"
        state = "released" if self._released else f"rows={list(zip(self.starts, self.lengths))}"
        return f"KvAttentionView(layer={self.layer}, {state})"
