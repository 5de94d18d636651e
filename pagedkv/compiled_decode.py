"""``CompiledDecode``: a ``PagedBatch``'s decode step under ``mx.compile``.

An eager step builds the model's graph in Python every token: at B=32 on an H200 that
host work took longer than the GPU's (bench/RESULTS.md, issue 15). Compiling the step
replays a traced graph instead, but pagedkv's caches make their index arrays from numpy
inside the model call, and a trace would freeze those as constants. So the step is cut
in two:

    host (Python, every step)              compiled (traced once per shape)
    -------------------------              ---------------------------------------
    RowSet.reserve_step(1): pages,         model(tokens) with one _StepLayer per layer:
      positions, undo records                RoPE at `positions`, pool.scatter of the
    per table kind: write rows/slots,        step's K/V at (rows, slots), attention
      page table padded to `bucket`          through the decode kernel (GPU) or the
      pages (PaddedPageTable: only the       pages gathered by the table (CPU), from
      rows that grew are rebuilt),           these inputs
      [start, length) per row              pool arrays: the compiled state, written
                                             back into the pool's own lists

The per-row vectors travel as one flat int32 array, and each table kind's page table
as its own [B, width] input, so a step makes 1 + kinds MLX arrays on the host (each
copy to the device costs tens of microseconds) and the table shapes tell the traces
apart::

    vectors = [positions (B) | per table kind: write rows (B x kv_heads) |
               write slots (B x kv_heads) | lengths (B) | starts (B)]

The write rows and slots come [B, kv_heads, 1], the shape of the model's keys and
values, so each layer scatters them as they are (no transpose, no copy per layer).

Everything that varies per step is an input, so the trace is reused until the batch
size, the token dtype or a table's bucketed width changes (``traces`` counts them).
The pools' arrays are the compiled function's state (``PagePool.compile_state``): MLX
feeds them in and puts the written arrays back, donated, so writes stay in place.

Contract: ``step(tokens)`` is ``model(tokens, cache=batch.caches)`` for one token per
row, with the same bookkeeping (the rows, their pages and positions end up exactly
where the eager step leaves them; the batch can continue either way) and the same
logits up to float rounding. Bad tokens raise a typed error and change nothing; a step
that cannot get its pages raises ``PoolExhausted`` with every row as it was. Not for
hybrid (recurrent) models or sliding windows (``PagedBatch.for_model`` refuses those),
nor KV-sharing ``DonorCache`` layers: ``NotSupportedError``.

Ownership: the batch keeps its rows; this object holds the model, the batch and the
traces. Costs per step on the host: the reservation (O(B)), O(B) index building
plus O(width) per row that grew a page, per table kind; no graph building after the
first trace.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from pagedkv.attention import attend_parts
from pagedkv.attention_routing import route_attention
from pagedkv.batch import PagedBatch
from pagedkv.errors import InvalidTypeError, KvShapeError, NotSupportedError, check_int
from pagedkv.kernels import paged_decode
from pagedkv.padded_page_table import PaddedPageTable
from pagedkv.page_read import PageRead


class _StepLayer:
    """One layer's cache inside the traced step: reads the step's inputs from
    ``CompiledDecode._inputs``; mlx-lm's attention is routed to ``attend``."""

    reads_pages = True

    def __init__(self, owner: CompiledDecode, layer: int) -> None:
        self.owner = owner
        spec, self.pool_layer = owner.batch.rows.layout.layers[layer]
        self.spec = spec
        self.pool = owner.batch.rows.layout.specs[spec].pool

    @property
    def offset(self) -> mx.array:
        return self.owner._inputs[0]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return None  # one query per row: its range says it all

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        rows, slots = self.owner._inputs[1][self.spec][:2]
        self.pool.scatter(self.pool_layer, rows, slots, keys, values)
        return keys, values  # unused: attention is routed to ``attend``

    def attend(self, queries: mx.array, scale: float, mask) -> mx.array:
        _, _, table, lengths, starts = self.owner._inputs[1][self.spec]
        pool = self.pool
        if pool.kind.decode_kernel and paged_decode.fits(queries, pool.num_kv_heads, pool.dtype):
            return paged_decode.paged_decode(queries, *pool.layer_arrays(self.pool_layer), table, lengths, starts,
                                             scale, num_pages=pool.num_pages, page_size=pool.page_size)
        b, width = table.shape
        keys = width * pool.page_size
        k_parts, v_parts = pool.gather(self.pool_layer, pool.gather_index(table), 0, keys, rows=b, track=False)
        col = mx.arange(keys, dtype=mx.int32)[None]
        visible = ((col >= starts[:, None]) & (col < lengths[:, None]))[:, None, None, :]
        return attend_parts(queries, k_parts, v_parts, scale, visible, pool.kind)


class CompiledDecode:
    def __init__(self, model, batch: PagedBatch, bucket: int = 64) -> None:
        """Decode steps of ``batch`` (built by ``PagedBatch.for_model(model, ...)``)
        under ``mx.compile``; page tables are padded to a multiple of ``bucket`` pages."""
        if not isinstance(batch, PagedBatch):
            raise InvalidTypeError(f"batch must be a PagedBatch, got {type(batch).__name__}")
        self.bucket = check_int("bucket", bucket, minimum=1)
        layout = batch.rows.layout
        why = self.refusal(batch)
        if why is not None:
            raise NotSupportedError(why)
        route_attention(model)
        self.model, self.batch = model, batch
        self._layers = [_StepLayer(self, i) for i in range(layout.num_layers)]
        pools = list({id(spec.pool): spec.pool for spec in layout.specs}.values())
        self._pools = pools
        self._state = [pool.compile_state() for pool in pools]
        self._inputs: tuple = ()
        # per spec: the step's padded page table, kept from step to step (the rows that
        # grew a page are rebuilt; a step that fails leaves it checking, not wrong)
        self._padded = [PaddedPageTable(spec.pool.null_page) for spec in layout.specs]
        self.traces = 0
        self._compiled = mx.compile(self._step, inputs=self._state, outputs=self._state)

    @staticmethod
    def refusal(batch: PagedBatch) -> str | None:
        """Why a compiled step cannot serve ``batch``'s layers (None: it can)."""
        layout = batch.rows.layout
        if layout.state_slots or any(spec.window is not None for spec in layout.specs):
            return "a compiled decode step serves full-attention layers only (no recurrent layers, no sliding windows)"
        if len(batch.caches) != layout.num_layers:
            return "a compiled decode step needs one cache per model layer (no KV sharing)"
        return None

    def _step(self, tokens: mx.array, vectors: mx.array, *tables: mx.array) -> mx.array:
        self.traces += 1  # Python runs here only while tracing
        b = tokens.shape[0]
        per_spec, at = [], b
        for spec, table in zip(self.batch.rows.layout.specs, tables):
            n = b * spec.pool.num_kv_heads
            rows, slots = vectors[at : at + n].reshape(b, -1, 1), vectors[at + n : at + 2 * n].reshape(b, -1, 1)
            at += 2 * n
            lengths, starts = vectors[at : at + b], vectors[at + b : at + 2 * b]
            at += 2 * b
            per_spec.append((rows, slots, table, lengths, starts))
        self._inputs = (vectors[:b], per_spec)
        try:
            return self.model(tokens, cache=self._layers)
        finally:
            self._inputs = ()

    def __call__(self, tokens: mx.array) -> mx.array:
        """One decode step: ``tokens`` int [B] or [B, 1]; returns the model's logits
        [B, 1, vocab] (see the module doc)."""
        rows = self.batch.rows
        rows.check_alive()
        if not isinstance(tokens, mx.array):
            raise InvalidTypeError(f"tokens must be an mx.array, got {type(tokens).__name__}")
        if not mx.issubdtype(tokens.dtype, mx.integer):
            raise InvalidTypeError(f"tokens must be integers, got {tokens.dtype}")
        if tokens.ndim == 1:
            tokens = tokens[:, None]
        if tokens.ndim != 2 or tokens.shape != (rows.num_rows, 1) or rows.num_rows == 0:
            raise KvShapeError(f"a decode step takes one token per row: [{rows.num_rows}, 1], "
                               f"got {tuple(tokens.shape)}")
        for pool in self._pools:
            pool.settle_reads()
        start = rows.reserve_step(1)
        # the pool's lists as they are: a trace that fails leaves placeholders in them
        arrays = [(arrs, list(arrs)) for state in self._state for part in state for arrs in part]
        try:
            vectors, tables = [start.astype(np.int32)], []
            for spec, config in enumerate(rows.layout.specs):
                layer = rows.layers_of(spec)[0]
                lo, hi = rows.visible_range(layer)
                read = PageRead.of(config.pool, rows.tables(spec), lo, hi, bucket=self.bucket,
                                   padded=self._padded[spec])
                write_rows, slots = rows.write_slots(spec, start, 1)
                lengths, starts = read.kernel_range_values()
                vectors += [write_rows.ravel(), slots.ravel(), lengths, starts]
                tables.append(read.table)
            logits = self._compiled(tokens, mx.array(np.concatenate(vectors)), *tables)
        except BaseException:
            for arrs, kept in arrays:
                arrs[:] = kept
            rows.finish_reserved(ok=False)
            raise
        rows.finish_reserved(ok=True)
        return logits
