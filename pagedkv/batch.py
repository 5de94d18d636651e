"""``PagedBatch``: B sequences of different lengths decoded together, with no padding.

The batch is a multi-row ``RowSet`` (:mod:`pagedkv.row_set`), the same engine as a
single sequence's cache: each row owns its own page tables, so memory is the sum of
the rows' pages, never B × the longest row. Rows join and leave between steps without
touching the other rows' K/V: a new request is prefilled on its own
(``make_paged_cache``, prefix cache hits included) and ``extend`` moves its rows in;
``extract`` hands a row back out as a one-sequence cache; ``filter`` keeps some rows
and releases the rest::

    batch = PagedBatch.for_model(model, pool)      # per-layer caches: batch.caches
    batch.extend(prefilled_prompt_cache)            # the prompt cache is moved in
    logits = model(tokens[:, None], cache=batch.caches)   # one step for every row

Per layer, ``PagedBatchKVCache`` follows the batched cache protocol mlx-lm's models read:
``offset`` is an int32 [B] array of per-row positions (RoPE), ``update_and_fetch`` takes
[B, kv_heads, T, D] (every row appends T tokens at its own position) and returns
[B, kv_heads, W, D] with each row's tokens left-aligned (W = the longest row rounded up to
a page), and ``make_mask`` masks every row to its own causal range. Every page kind
works, as for one sequence (affine pages with one codec give mlx-lm's quantised path).
A hybrid model's recurrent layers get ``PagedStateCache`` faces (:mod:`pagedkv.state_cache`);
each row's state slot joins and leaves with the row.

Ownership: the batch owns its rows from ``extend`` until ``extract``, ``filter`` or
``release``. A step that cannot get pages for every row raises ``PoolExhausted`` and
leaves every row as it was; a layer with bad input rolls the step back.
"""

from __future__ import annotations

import mlx.core as mx

from pagedkv.cache import LayerFace, PagedPromptCache, layer_faces, layout_for
from pagedkv.errors import (
    InvalidTypeError,
    KvShapeError,
    check_int,
)
from pagedkv.pool import PagePool
from pagedkv.row_set import LayerLayout, RowSet
from pagedkv.state_pool import StatePool
from pagedkv.visibility import check_mask_request


class PagedBatch:
    def __init__(self, pool: PagePool | LayerLayout, num_layers: int | None = None) -> None:
        """A batch over ``num_layers`` full-attention layers of ``pool`` (or any layer
        layout, e.g. ``layout_for(model, pool)``)."""
        if isinstance(pool, LayerLayout):
            layout = pool
        elif isinstance(pool, PagePool):
            num_layers = check_int("num_layers", num_layers, minimum=1, maximum=pool.num_layers)
            layout = LayerLayout.uniform(pool, range(num_layers))
        else:
            raise InvalidTypeError(f"pool must be a PagePool, got {type(pool).__name__}")
        self.rows = RowSet(layout)
        self.pool = layout.specs[0].pool
        self.caches = layer_faces(self.rows, PagedBatchKVCache)

    @classmethod
    def for_model(cls, model, pool: PagePool, *, state_pool: StatePool | None = None) -> PagedBatch:
        """A batch for ``model``'s layers in ``pool`` (routes its attention, as
        ``make_paged_cache`` does); a hybrid model's recurrent state goes to
        ``state_pool``."""
        from pagedkv.attention_routing import route_attention

        layout = layout_for(model, pool, state_pool=state_pool)
        route_attention(model)
        return cls(layout)

    @property
    def size(self) -> int:
        return self.rows.num_rows

    @property
    def lengths(self) -> list[int]:
        """Each row's tokens (``ReleasedError`` once released, not the zeros of
        released tables)."""
        self.rows.check_alive()
        return [t.num_tokens for t in self.rows.tables(0)]

    def tables(self, row: int | None = None):
        """The page tables of row ``row`` (one per attention kind), or with no row every
        row's full-attention table."""
        self.rows.check_alive()
        if row is None:
            return self.rows.tables(0)
        return self.rows.row_tables(row)

    # ------------------------------------------------------------------ rows join / leave
    def extend(self, prompt_cache: PagedPromptCache) -> int:
        """Move a one-sequence paged cache in as a new row (no K/V is copied); returns
        its row. It must use the batch's layout (same pools, layers and windows) with
        every layer at its tables' length; it is emptied (the batch owns its pages)."""
        self.rows.check_alive()
        if not isinstance(prompt_cache, PagedPromptCache):
            raise InvalidTypeError(f"extend takes a PagedPromptCache, got {type(prompt_cache).__name__}")
        new = self.rows.take_rows(prompt_cache.rows, "moved into a batch by PagedBatch.extend")
        prompt_cache.clear()
        return new[0]

    def extract(self, row: int) -> PagedPromptCache:
        """Move row ``row`` out as a one-sequence cache (no copy); the other rows stay."""
        self.rows.check_alive()
        return PagedPromptCache.of_rows(self.rows.split_row(row))

    def filter(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (in that order) and release every other row's pages."""
        self.rows.keep_rows(keep)

    def release(self) -> None:
        """Release every row (exactly once)."""
        self.rows.release()


class PagedBatchKVCache(LayerFace):
    """One layer of a ``PagedBatch`` (see the module doc). It refers to the batch's
    rows, not to the batch, so a batch is in no reference cycle: once the last
    references to a batch and its pool go, the pool's arrays are freed then, not at
    the next garbage collection. (Its rows' pages go back only through ``release``.)"""

    exact = False

    @property
    def offset(self) -> mx.array:
        """int32 [B]: each row's position before this layer's next write (RoPE start)."""
        return self.rows.position_array(self.rows.offsets[self.layer])

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """Bool [B, 1, N, W]: row b's query i (at position len_b + i) sees keys
        j <= len_b + i (and, with a window, j > len_b + i - window)."""
        self.rows.check_alive()
        if not self.rows.num_rows:
            raise KvShapeError("a mask needs rows, but the batch has none (add rows with extend)")
        check_mask_request(N, window_size)
        return self.rows.mask(self.layer, N, window_size)

    def empty(self) -> bool:
        return self.rows.num_rows == 0
