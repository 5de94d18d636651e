"""``PagedBatch``: B sequences of different lengths decoded together, with no padding.

Each row owns its own ``PageTable``; memory is the sum of the rows' pages, never
B × the longest row. Rows join and leave between steps without touching the other
rows' K/V: a new request is prefilled on its own (``make_paged_cache``, prefix cache
hits included) and ``extend`` adopts its page table; ``extract`` hands a row back out
as a one-sequence cache; ``filter`` keeps some rows and releases the rest::

    batch = PagedBatch.for_model(model, pool)      # per-layer caches: batch.caches
    batch.extend(prefilled_prompt_cache)            # the prompt cache is moved in
    logits = model(tokens[:, None], cache=batch.caches)   # one step for every row

Per layer, ``PagedBatchKVCache`` follows the batched cache protocol mlx-lm's models read:
``offset`` is an int32 [B] array of per-row positions (RoPE), ``update_and_fetch`` takes
[B, kv_heads, T, D] (every row appends T tokens at its own position) and returns
[B, kv_heads, W, D] with each row's tokens left-aligned (W = the longest row rounded up to
a page), and ``make_mask`` masks every row to its own causal range.

Ownership: the batch owns its rows' tables from ``extend`` until ``extract``, ``filter``
or ``release``. A step that cannot get pages for every row raises ``PoolExhausted``
and leaves every row as it was.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from pagedkv.attention import decode_kv
from pagedkv.cache import PagedKVCache, PagedPromptCache, cache_class_for
from pagedkv.errors import (
    InvalidTypeError,
    InvalidValueError,
    KvDTypeError,
    KvShapeError,
    NotSupportedError,
    PoolExhausted,
    ReleasedError,
    check_int,
)
from pagedkv.pool import PagePool
from pagedkv.sequence import PagedSequence
from pagedkv.shared import ViewKv
from pagedkv.table import PageTable
from pagedkv.view import KvAttentionView


class PagedBatch:
    def __init__(self, pool: PagePool, num_layers: int) -> None:
        if not isinstance(pool, PagePool):
            raise InvalidTypeError(f"pool must be a PagePool, got {type(pool).__name__}")
        num_layers = check_int("num_layers", num_layers, minimum=1, maximum=pool.num_layers)
        if cache_class_for(pool) is not PagedKVCache:
            raise NotSupportedError("the batched cache stores full-precision or rotated/mixed pages; "
                                    "affine pages with mlx-lm's quantised path are single-sequence only")
        self.pool = pool
        self.rows: list[PageTable] = []
        self._offsets = np.zeros((num_layers, 0), dtype=np.int64)  # [layer, row] tokens written
        self.caches = [PagedBatchKVCache(self, i) for i in range(num_layers)]
        self._released = False
        self._version = 0  # bumped whenever rows or their pages change
        self._memo: dict = {}  # per-step index arrays, shared by every layer of the step

    def _changed(self) -> None:
        self._version += 1
        self._memo.clear()

    @classmethod
    def for_model(cls, model, pool: PagePool) -> PagedBatch:
        if hasattr(model, "make_cache") and any(type(c).__name__ != "KVCache" for c in model.make_cache()):
            raise NotSupportedError("PagedBatch serves full-attention models (no sliding windows)")
        return cls(pool, len(model.layers))

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def lengths(self) -> list[int]:
        return [t.num_tokens for t in self.rows]

    def _check(self) -> None:
        if self._released:
            raise ReleasedError("batch used after release()")

    def _row(self, row: object) -> int:
        if not self.rows:
            _no_rows(f"row {row!r}")
        return check_int("row", row, minimum=0, maximum=len(self.rows) - 1)

    # ------------------------------------------------------------------ rows join / leave
    def extend(self, prompt_cache: PagedPromptCache) -> int:
        """Adopt a one-sequence paged cache as a new row (no K/V is copied); returns its row.

        ``prompt_cache`` must come from the same pool and hold one full-attention table
        with every layer at the same length; it is emptied (the batch owns the table now).
        """
        self._check()
        if not isinstance(prompt_cache, PagedPromptCache):
            raise InvalidTypeError(f"extend takes a PagedPromptCache, got {type(prompt_cache).__name__}")
        prompt_cache.sequence.check_alive()  # released, or already moved into a batch
        if len(prompt_cache.tables) != 1 or prompt_cache.tables[0].window is not None:
            raise NotSupportedError("rows must be full-attention one-table caches (no sliding-window layers)")
        table = prompt_cache.tables[0]
        if table.pool is not self.pool:
            raise InvalidValueError("the row's pages are in another pool than the batch's")
        offsets = [c.offset for c in prompt_cache]
        if len(offsets) != len(self.caches) or len(set(offsets)) != 1 or offsets[0] != table.num_tokens:
            raise InvalidValueError(f"every one of the batch's {len(self.caches)} layers must hold the same "
                                    f"{table.num_tokens} tokens, got {offsets}")
        prompt_cache.sequence.move_out("moved into a batch by PagedBatch.extend")
        prompt_cache.clear()
        self.rows.append(table)
        self._offsets = np.concatenate([self._offsets, np.full((len(self.caches), 1), table.num_tokens)], axis=1)
        self._changed()
        return len(self.rows) - 1

    def extract(self, row: int) -> PagedPromptCache:
        """Move row ``row`` out as a one-sequence cache (no copy); the other rows stay."""
        self._check()
        row = self._row(row)
        table = self.rows.pop(row)
        offsets = self._offsets[:, row]
        self._offsets = np.delete(self._offsets, row, axis=1)
        self._changed()
        PagedSequence([table])  # a fresh owner; the layers built below join it
        caches = []
        for layer, off in enumerate(offsets.tolist()):
            c = PagedKVCache(table, layer)
            c.offset = c._step_start = off
            caches.append(c)
        return PagedPromptCache(caches)

    def filter(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (in that order) and release every other row's pages."""
        self._check()
        if not isinstance(keep, (list, tuple, range)):
            raise InvalidTypeError(f"keep must be a list of row indices, got {type(keep).__name__}")
        keep = [check_int("row", i) for i in keep]
        if len(set(keep)) != len(keep) or any(not 0 <= i < len(self.rows) for i in keep):
            raise InvalidValueError(f"bad row indices {keep} for a batch of {len(self.rows)} rows")
        for i, table in enumerate(self.rows):
            if i not in keep:
                table.release()
        self.rows = [self.rows[i] for i in keep]
        self._offsets = self._offsets[:, keep]
        self._changed()

    def release(self) -> None:
        """Release every row (exactly once)."""
        self._check()
        for t in self.rows:
            t.release()
        self.rows = []
        self._offsets = self._offsets[:, :0]
        self._released = True
        self._changed()

    # ------------------------------------------------------------------ one layer's step
    def _reserve(self, layer: int, count: int) -> None:
        """Make room for ``count`` tokens after layer ``layer``'s offsets in every row;
        all rows or none (a row whose reserve fails rolls the earlier rows back)."""
        needs = [int(self._offsets[layer, b]) + count - t.num_tokens for b, t in enumerate(self.rows)]
        total = sum(t.pages_needed(n) for t, n in zip(self.rows, needs) if n > 0)
        available = self.pool.allocator.num_available()
        if total > available:
            raise PoolExhausted(total, available)
        if total == 0 and all(n <= 0 for n in needs):
            return
        self._changed()
        grown = []
        try:  # cannot fail after the check above; the rollback is a second line of defence
            for b, table in enumerate(self.rows):
                need = int(self._offsets[layer, b]) + count - table.num_tokens
                if need > 0:
                    table.reserve(need)
                    grown.append((table, need))
        except PoolExhausted:
            for table, need in grown:
                table.trim(need)
            raise

    def _write_index(self, layer: int, count: int) -> tuple[mx.array, mx.array]:
        key = ("w", self._offsets[layer].tobytes(), count)
        if key not in self._memo:
            self._memo[key] = self._build_write_index(layer, count)
        return self._memo[key]

    def _build_write_index(self, layer: int, count: int) -> tuple[mx.array, mx.array]:
        rows, slots = [], []
        ps = self.pool.page_size
        for b, table in enumerate(self.rows):
            start = int(self._offsets[layer, b])
            pages = table.pages
            pos = np.arange(start, start + count)
            rows.append(self.pool.rows(pages[pos // ps]))
            slots.append(pos % ps)
        return (mx.array(np.concatenate(rows, axis=1).astype(np.int32)),
                mx.array(np.concatenate(slots).astype(np.int32)))

    def _read_index(self) -> tuple[mx.array, int]:
        """(take-indices, width in pages) of every row; built once per change of rows/pages."""
        if "r" not in self._memo:
            table, index = self.pool.gather_index([t.pages for t in self.rows])
            self._memo["r"] = (index, table.shape[1])
        return self._memo["r"]

    def _read(self, layer: int) -> tuple[mx.array, mx.array]:
        """Every row's K/V, left-aligned: [B, kv_heads, width * page_size, D] each."""
        index, width = self._read_index()
        k_parts, v_parts = self.pool.gather(layer, index, 0, width * self.pool.page_size, rows=len(self.rows))
        return decode_kv(k_parts, v_parts, self.pool.k_codec, self.pool.v_codec, self.pool.dtype)


class PagedBatchKVCache:
    """One layer of a ``PagedBatch`` (see the module doc)."""

    def __init__(self, batch: PagedBatch, layer: int) -> None:
        self.batch = batch
        self.layer = layer
        self._step_offsets: mx.array | None = None

    @property
    def offset(self) -> mx.array:
        """int32 [B]: each row's position before this layer's next write (RoPE start)."""
        return mx.array(self.batch._offsets[self.layer].astype(np.int32))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        batch = self.batch
        batch._check()
        if not batch.rows:
            _no_rows("a step")
        pool = batch.pool
        if not isinstance(keys, mx.array) or not isinstance(values, mx.array) or keys.ndim != 4 or values.ndim != 4:
            raise KvShapeError("keys and values must be [B, kv_heads, T, D] mx.arrays")
        b, h, t, d = keys.shape
        if b != batch.size or h != pool.num_kv_heads or d != pool.head_dim or t == 0 \
                or values.shape != (b, h, t, pool.v_head_dim):
            raise KvShapeError(f"keys {tuple(keys.shape)} / values {tuple(values.shape)} do not fit a batch "
                               f"of {batch.size} rows, {pool.num_kv_heads} kv heads, head_dim {pool.head_dim}")
        if keys.dtype != pool.dtype or values.dtype != pool.dtype:
            raise KvDTypeError(f"keys/values must be {pool.dtype}")
        self._step_offsets = self.offset
        batch._reserve(self.layer, t)  # atomic across rows
        rows, slots = batch._write_index(self.layer, t)
        flat_k = keys.transpose(1, 0, 2, 3).reshape(h, b * t, d)
        flat_v = values.transpose(1, 0, 2, 3).reshape(h, b * t, values.shape[-1])
        pool.write(self.layer, rows, slots, flat_k, flat_v)
        batch._offsets[self.layer] += t
        return batch._read(self.layer)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """Bool [B, 1, N, W]: row b's query i (at position len_b + i) sees keys
        j <= len_b + i (and, with a window, j > len_b + i - window)."""
        self.batch._check()
        if not self.batch.rows:
            _no_rows("a mask")
        ps = self.batch.pool.page_size
        lengths = self.batch._offsets[self.layer]
        width = max(-(-(int(n) + N) // ps) for n in lengths) * ps
        cols = mx.arange(width)[None, None, :]
        qpos = mx.array(lengths.astype(np.int32))[:, None, None] + mx.arange(N)[None, :, None]
        mask = cols <= qpos
        if window_size is not None:
            mask = mask & (cols > qpos - window_size)
        return mask[:, None]

    def fetch_shared(self) -> ViewKv:
        """This step's K/V of every row as a ViewKv, with ``offset_arr`` = the rows'
        pre-write positions (an owned copy). The caller releases it."""
        batch = self.batch
        batch._check()
        if self._step_offsets is None or not batch.rows:
            raise KvShapeError("no step has been written yet")
        if self._step_offsets.shape[0] != batch.size:
            raise KvShapeError("rows joined or left since this layer's last step; run a step first")
        view = KvAttentionView(batch.pool, self.layer, batch.rows,
                               [int(x) for x in batch._offsets[self.layer]], [0] * batch.size)
        return ViewKv(view, offset=int(np.min(np.asarray(self._step_offsets))), offset_arr=self._step_offsets)

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return self.batch.size == 0

    @property
    def nbytes(self) -> int:
        return sum(t.num_pages for t in self.batch.rows) * self.batch.pool.bytes_per_page_per_layer


def _no_rows(what: str):
    raise KvShapeError(f"{what} needs rows, but the batch has none (add rows with extend)")
