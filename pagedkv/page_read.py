"""``PageRead``: tokens [lo[b], hi[b]) of B rows in a pool, and how to read them.

The one read path. A page id names the same slot in every layer, so one PageRead serves
every layer of a table: its methods take the pool layer. A ``RowSet`` builds one per step
and table kind (memoised) for all its layers, a ``KvAttentionView`` keeps one for its life. It snapshots each row's page ids from the
row's first needed page, padded with the null page to the widest row::

    table [B, width]:  row b = pages first[b] .. stop[b]-1 of its page table, then null
    gathered column c of row b = key position key_base[b] + c   (key_base = first * ps)

``parts(exact)`` gathers the page components (one row ``exact``: the tokens [lo, hi)
themselves; else [B, kv_heads, width * page_size, c]); ``mask`` says which gathered
keys each query sees; ``attend`` computes attention: the CUDA decode or prefill kernel
straight from the pool where it applies, else the gathered parts through
:func:`pagedkv.attention.attend_parts`.

Ownership: a PageRead holds page ids, not references; its owner keeps the pages alive
(a row set's tables, a view's references). Costs: building O(B) plus O(width) per row
that changed since the owner's last read (``PaddedPageTable``), and one copy of the
[B, width] table to MLX where it changed; ``parts`` one gather of O(B · width) pages
(``borrowed``: a slice, for one row whose pages are one run of ids); ``mask`` one
broadcast.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import mlx.core as mx
import numpy as np

from pagedkv.attention import attend_parts
from pagedkv.kernels import paged_decode, paged_prefill
from pagedkv.padded_page_table import PaddedPageTable
from pagedkv.pool import PagePool
from pagedkv.table import PageTable
from pagedkv.visibility import page_span, range_mask


@attrs.frozen
class PageRead:
    pool: PagePool
    lo: np.ndarray  # int64 [B]: first token of each row
    hi: np.ndarray  # int64 [B]: one past the last
    key_base: np.ndarray  # int64 [B]: key position of each row's first gathered column
    width: int  # gathered tokens per row (a multiple of the page size)
    table: mx.array  # int32 [B, width / page_size] page ids, null-padded
    run: int = -1  # one row whose pages are consecutive ids: the first (PaddedPageTable.run), else -1
    _kernel_ranges: list = attrs.field(factory=list, eq=False, repr=False)  # made once, for every layer
    # the gather index, made once if needed (shared with other reads of the same table)
    _index: list = attrs.field(factory=list, eq=False, repr=False)

    @classmethod
    def of(cls, pool: PagePool, tables: Sequence[PageTable], lo: np.ndarray, hi: np.ndarray,
           bucket: int = 1, padded: PaddedPageTable | None = None) -> PageRead:
        """The read of tokens [lo[b], hi[b]) of ``tables``; ``bucket``: the width (in
        pages) is rounded up to a multiple of it (null pages), so reads of growing rows
        keep one shape for a while (a compiled step is traced once per shape).
        ``padded``: the reader's ``PaddedPageTable`` from its last read of these rows,
        so only the rows that changed since are rebuilt (default: a fresh one)."""
        ps = pool.page_size
        first, stop, width = page_span(lo, hi, ps)
        width = -(-width // bucket) * bucket
        if padded is None:
            padded = PaddedPageTable(pool.null_page)
        padded.update(tables, first, stop, width)
        table, derived = padded.device()
        return cls(pool, lo, hi, first * ps, width * ps, table, padded.run, index=derived)

    @property
    def num_rows(self) -> int:
        return self.lo.shape[0]

    @property
    def index(self) -> mx.array:
        """The take-indices ``parts`` gathers with (``PagePool.gather_index`` of the
        table), made on first use for every layer: the kernels read the table alone."""
        if not self._index:
            self._index.append(self.pool.gather_index(self.table))
        return self._index[0]

    def parts(self, layer: int, exact: bool):
        """The gathered K and V components of pool layer ``layer`` (packed pages stay
        packed); see module doc."""
        if exact and self.num_rows == 1:
            base = int(self.key_base[0])
            return self.pool.gather(layer, self.index, int(self.lo[0]) - base, int(self.hi[0]) - base)
        return self.pool.gather(layer, self.index, 0, self.width, rows=self.num_rows)

    def borrowed(self, layer: int, exact: bool):
        """``parts(exact)`` of one row whose pages are one run of ids, as views of the
        pool's arrays (``PagePool.borrow_run``: no copy of the context), or None (other
        rows, or a pool that lends no views). For a reader done with them before the
        layer's next write."""
        if self.run < 0 or not exact or self.num_rows != 1:
            return None
        base = int(self.key_base[0])
        return self.pool.borrow_run(layer, self.run, int(self.lo[0]) - base, int(self.hi[0]) - base)

    def mask(self, n_queries: int, exact: bool, causal: bool = True, window: int | None = None) -> mx.array:
        """Bool [B, 1, n_queries, keys] over ``parts(exact)``: the queries are each row's
        last ``n_queries`` positions (ending at hi)."""
        return range_mask(self.lo, self.hi, n_queries, self.pool.page_size, exact=exact, causal=causal,
                          window=window)

    def attend(self, layer: int, q: mx.array, scale: float, mask, *, exact: bool, kernel: bool,
               parts=None, window: int | None = None, sinks: mx.array | None = None,
               borrow: bool = False) -> mx.array:
        """Attention of ``q`` [B, n_heads, L, D] over these keys of pool layer ``layer``. ``mask`` is over
        ``parts(exact)``; ``kernel``: the caller vouches that ``mask`` adds nothing to
        the rows' ranges but causality and ``window`` (the queries are each row's last L
        positions), so the CUDA kernels may apply them instead: decode (one query per
        row) or prefill (several). ``parts``: this read's ``parts(exact)`` if the caller
        already gathered them. ``sinks``: [n_heads] attention-sink logits (gpt_oss), or
        None; the kernels apply them in their merge. ``borrow``: the caller evaluates
        the result before the layer's next write (a model's step), so the keys may be
        ``borrowed`` views instead of ``parts``; False with ``parts``: they are such views.

        One query of one row goes to MLX's own attention even where the decode kernel
        could run, if its keys are at hand: views of the pool (``borrowed``; none where MLX's
        attention would misread them: ``PagePool.borrow_run``), or ``parts``
        the caller gathered already, if they are short (``paged_decode.MLX_SHORT_GATHER_BYTES``:
        a sliding window's keys, a short sequence). On CUDA that is one fused kernel
        (``paged_decode.MLX_VECTOR_HEAD_DIMS``), the one mlx-lm's own cache runs, and it
        takes less host time to build than the paged kernel's two launches, which is what
        bounds a one-sequence step (bench/RESULTS.md); a short gather costs the device
        little more than the kernel's read."""
        pool = self.pool
        ready = None  # K/V parts MLX's attention can take as they are
        if kernel and pool.kind.decode_kernel and exact and self.num_rows == 1 and q.shape[2] == 1 \
                and q.shape[3] in paged_decode.MLX_VECTOR_HEAD_DIMS and not isinstance(mask, mx.array):
            ready = self.borrowed(layer, exact) if borrow else parts
            if ready is None and parts is not None and int(self.hi[0] - self.lo[0]) * \
                    pool.bytes_per_page_per_layer <= paged_decode.MLX_SHORT_GATHER_BYTES * pool.page_size:
                ready = parts  # (gathered for this read already: see LayerFace.update_and_fetch)
            kernel = ready is None
        if kernel and pool.kind.decode_kernel:
            if paged_decode.fits(q, pool.num_kv_heads, pool.dtype):
                return paged_decode.paged_decode(
                    q, *pool.layer_arrays(layer), self.table, *self.kernel_ranges(),
                    scale, rows_per_head=pool.rows_per_head, page_size=pool.page_size, sinks=sinks,
                    after=pool.write_order(layer))
            if paged_prefill.fits(q, pool.num_kv_heads, pool.dtype) and paged_prefill.preferred(q, mask):
                return paged_prefill.paged_prefill(
                    q, *pool.layer_arrays(layer), self.table, *self.kernel_ranges(),
                    scale, rows_per_head=pool.rows_per_head, page_size=pool.page_size, window=window, sinks=sinks,
                    after=pool.write_order(layer))
        if ready is None and borrow:
            ready = self.borrowed(layer, exact)
        k_parts, v_parts = ready or parts or self.parts(layer, exact)
        return attend_parts(q, k_parts, v_parts, scale, mask, pool.kind, sinks)

    def kernel_ranges(self) -> list:
        """The kernels' (lengths, starts): [lo, hi) in gathered columns, made once for
        every layer."""
        if not self._kernel_ranges:
            self._kernel_ranges.extend((mx.array((self.hi - self.key_base).astype(np.int32)),
                                        mx.array((self.lo - self.key_base).astype(np.int32))))
        return self._kernel_ranges
