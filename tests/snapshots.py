"""Byte-for-byte snapshots of everything a failed call must leave unchanged.

``state_of(pool, *owners)`` captures the allocator (stats, per-page state, reference
counts, cacheable flags, the LRU and the free list in hand-out order), the pool's arrays,
and every page table and per-layer position reachable from ``owners`` (prompt caches,
per-layer caches, tables, batches). Two snapshots compare equal iff nothing changed.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from pagedkv import PagedBatch, PagedKVCache, PagedPromptCache, PageTable, RowSet


def _table(t: PageTable) -> tuple:
    return ("table", t.released, t.num_tokens, t._dropped, t.pages.tobytes(), t.window)


def _rows(r: RowSet) -> tuple:
    states = None if r.states is None else (r.states.slots.tobytes(), r.states.tokens.tobytes())
    return ("rows", r.released, r.offsets.tobytes(), r.step_starts.tobytes(),
            tuple(_table(t) for t in r.all_tables()), states)


def _owner(o) -> tuple:
    if isinstance(o, PageTable):
        return _table(o)
    if isinstance(o, PagedKVCache):
        return ("layer", o.layer, _rows(o.rows))
    if isinstance(o, PagedPromptCache):
        return ("prompt", len(o), _rows(o.rows))
    if isinstance(o, PagedBatch):
        return ("batch", _rows(o.rows))
    raise TypeError(f"no snapshot for {type(o).__name__}")


def _allocator(a) -> tuple:
    return (a.stats(), a._state.tobytes(), a._refcount.tobytes(), a._cacheable.tobytes(),
            tuple(a.cached_pages()), np.asarray(a._free_ids()).tobytes())


def state_of(pool, *owners, arrays: bool = True) -> tuple:
    alloc = _allocator(pool.allocator)
    data = []
    if arrays:
        data = [(_bytes(k), _bytes(v)) for ks, vs in zip(pool._k, pool._v) for k, v in zip(ks, vs)]
    return alloc, tuple(data), tuple(_owner(o) for o in owners)


def state_pool_of(pool) -> tuple:
    """A ``StatePool``'s allocator and arrays, as ``state_of`` captures a page pool's."""
    return _allocator(pool.allocator), tuple(_bytes(x) for r in range(pool.num_layers) for x in pool.storage(r))


def _bytes(x: mx.array) -> bytes:
    return np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x).tobytes()
