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

import mlx.core as mx
import numpy as np

from pagedkv.attention import attend_parts, decode_kv
from pagedkv.errors import (
    InvalidTypeError,
    InvalidValueError,
    KvShapeError,
    ReleasedError,
    check_int,
)
from pagedkv.kernels import paged_decode
from pagedkv.mask import causal_mask
from pagedkv.pool import PagePool

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
        layer = check_int("layer", layer, minimum=0, maximum=pool.num_layers - 1)
        tables = list(tables)
        if not tables:
            raise InvalidValueError("a view needs at least one page table")
        ps = pool.page_size
        lengths = [t.num_tokens for t in tables] if lengths is None else [check_int("length", n) for n in lengths]
        starts = [t.first_visible() for t in tables] if starts is None else [check_int("start", n) for n in starts]
        if len(lengths) != len(tables) or len(starts) != len(tables):
            raise InvalidValueError("one length and one start per table")
        rows = []
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
            rows.append(t.pages[lo // ps : -(-hi // ps)])
        # the page-table snapshot [B, width] and head-major take-indices, one set per view
        snapshot, self._index = pool.gather_index(rows)
        self._table = mx.array(snapshot.astype(np.int32))  # the kernel path reads this
        held = np.concatenate(rows)
        pool.allocator.incref(held)  # the last step that can fail: nothing to undo
        self._held = held
        self.pool = pool
        self.layer = layer
        self.batch = len(rows)
        self.first_page_token = [(lo // ps) * ps for lo in starts]
        self.starts = starts
        self.lengths = lengths
        self._width_tokens = snapshot.shape[1] * ps
        self._released = False

    @classmethod
    def of_cache(cls, cache: PagedKVCache, start: int | None = None) -> KvAttentionView:
        """A view of what ``cache`` holds now: tokens [start, offset) of its layer.

        ``start`` defaults to the first key the cache's own window still shows.
        """
        cache._check_alive()
        if start is None:
            start = 0 if cache.window is None else max(0, cache.offset - cache.window)
            start = max(start, cache.table.first_visible())
        return cls(cache.pool, cache.layer, [cache.table], [cache.offset], [start])

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
        pool = self.pool
        if self.batch == 1:
            off = self.first_page_token[0]
            return pool.gather(self.layer, self._index, self.starts[0] - off, self.lengths[0] - off)
        return pool.gather(self.layer, self._index, 0, self._width_tokens, rows=self.batch)

    def keys_values(self) -> tuple[mx.array, mx.array]:
        """Contiguous float K/V (decoded and un-rotated for quantised pages); layout as
        ``parts``."""
        k_parts, v_parts = self.parts()
        pool = self.pool
        return decode_kv(k_parts, v_parts, pool.k_codec, pool.v_codec, pool.dtype)

    def valid_mask(self, n_queries: int, causal: bool) -> mx.array:
        """Bool [B, 1, n_queries, width]: which gathered keys each row's queries may see.

        Queries are the row's last ``n_queries`` positions (ending at its length).
        """
        cols = mx.arange(self._width_tokens)[None, :]
        out = []
        for b in range(self.batch):
            off = self.first_page_token[b]
            lo, hi = self.starts[b] - off, self.lengths[b] - off
            m = (cols >= lo) & (cols < hi)
            m = mx.broadcast_to(m, (n_queries, self._width_tokens))
            if causal:
                qpos = mx.arange(hi - n_queries, hi)[:, None]
                m = m & (cols <= qpos)
            out.append(m)
        return mx.stack(out)[:, None]

    def attend(self, q: mx.array, scale: float, mask=None, window: int | None = None) -> mx.array:
        """Attention of ``q`` [B, n_heads, L, D] over the view (GQA: n_heads % kv_heads == 0).

        ``mask``: None, "causal" (queries are the last L positions) or an array
        broadcastable to [B, n_heads, L, keys]; ``window`` additionally limits each query
        to the last ``window`` keys up to its position (a drafter's sliding window).
        Gathers the pages; full-precision pages go to ``mx.fast.scaled_dot_product_attention``
        (exact), quantised ones to quantised matmuls (:mod:`pagedkv.attention`).
        """
        self._check()
        if not isinstance(q, mx.array) or q.ndim != 4:
            raise KvShapeError(f"queries must be [B, n_heads, L, D], got {getattr(q, 'shape', q)}")
        b, n_heads, n_q, d = q.shape
        if b != self.batch or n_heads % self.pool.num_kv_heads or d != self.pool.head_dim:
            raise KvShapeError(
                f"queries {tuple(q.shape)} do not fit a view of {self.batch} rows, "
                f"{self.pool.num_kv_heads} kv heads, head_dim {self.pool.head_dim}"
            )
        if paged_decode.usable(q, mask, self.pool):
            return self._attend_kernel(q, scale, window)
        k_parts, v_parts = self.parts()
        n_keys = k_parts[0].shape[2]
        if self.batch > 1:
            row = self.valid_mask(n_q, causal=(mask == "causal"))
            if window is not None:
                row = row & self._window_mask(n_q, window, n_keys)
            if isinstance(mask, mx.array):
                row = row & mask if mask.dtype == mx.bool_ else mx.where(row, mask, -mx.inf)
            mask = row
        elif window is not None:
            wm = causal_mask(n_q, n_keys - n_q, window)  # a window implies causality
            if mask is None or isinstance(mask, str):
                mask = wm
            elif mask.dtype == mx.bool_:
                mask = mask & wm
            else:
                mask = mx.where(wm, mask, -mx.inf)
        return attend_parts(q, k_parts, v_parts, scale, mask, self.pool.k_codec, self.pool.v_codec)

    def _attend_kernel(self, q: mx.array, scale: float, window: int | None) -> mx.array:
        """CUDA: attention read straight from the pool through the page snapshot."""
        off = self.first_page_token
        starts = [s - o for s, o in zip(self.starts, off)]
        lengths = [n - o for n, o in zip(self.lengths, off)]
        if window is not None:
            starts = [max(s, n - window) for s, n in zip(starts, lengths)]
        k, v = self.pool.layer_arrays(self.layer)
        return paged_decode.paged_decode(
            q, k, v, self._table, mx.array(lengths, dtype=mx.int32), mx.array(starts, dtype=mx.int32),
            scale, num_pages=self.pool.num_pages, page_size=self.pool.page_size,
        )

    def _window_mask(self, n_q: int, window: int, width: int) -> mx.array:
        cols = mx.arange(width)[None, :]
        out = []
        for b in range(self.batch):
            hi = self.lengths[b] - self.first_page_token[b]
            qpos = mx.arange(hi - n_q, hi)[:, None]
            out.append(cols > qpos - window)
        return mx.stack(out)[:, None]

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
