"""Which keys a query sees: the one definition of visible ranges and masks.

A query at position p sees key position j iff ``window_start(p, W) <= j <= p`` (no
window: ``W`` is None and the start is 0), and, for a batch or a view, j lies in its
row's held range. Readers gather each row's pages from a first page on (``page_span``),
so gathered column c of row b holds key position ``key_base[b] + c``::

    row b:  | page first[b] | ...            | page stop[b]-1 |  (padding: null page)
            ^ key_base[b] = first[b] * page_size

Names used for positions everywhere: ``offsets`` (tokens a layer holds), ``step_starts``
(positions before a layer's last write: the RoPE start, ``SharedKv.offset``),
``window_start(p)`` (first key a query at p sees), ``PageTable.first_visible()`` (first
token whose page is still held), ``lo``/``hi`` (a row's visible range) and ``key_base``
(the key position of a row's first gathered column).

Every function here takes numpy vectors over rows (a single sequence is one row) and
does O(rows) Python work; masks are built as one broadcast, never per row.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from pagedkv.errors import check_int


def window_start(query_pos, window: int | None):
    """First key position a query at ``query_pos`` sees (int or int64 array)."""
    if window is None:
        return query_pos * 0 if isinstance(query_pos, np.ndarray) else 0
    return np.maximum(query_pos - window + 1, 0) if isinstance(query_pos, np.ndarray) \
        else max(0, query_pos - window + 1)


def page_span(lo: np.ndarray, hi: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(first page [B], stop page [B], width in pages = the widest row) covering tokens
    [lo[b], hi[b]) of every row."""
    first = lo // page_size
    stop = -(-hi // page_size)
    return first, stop, int((stop - first).max()) if first.size else 0


def key_mask(query_start: np.ndarray, n_queries: int, key_base: np.ndarray, width: int,
             lo: np.ndarray, hi: np.ndarray, *, causal: bool = True,
             window: int | None = None) -> mx.array:
    """Bool [B, 1, n_queries, width]: query i of row b (at ``query_start[b] + i``) sees
    gathered column c (key ``key_base[b] + c``) iff the key is in [lo[b], hi[b]) and,
    when ``causal``, not after the query and, with a ``window``, within it."""
    # Built as MLX graph from O(rows) host data: the [B, width] positions are never made
    # on the host, and a reader that does not use the mask (the GPU decode kernel) leaves
    # it unevaluated.
    rows = mx.array(np.stack([key_base, query_start, lo, hi], axis=1).astype(np.int32))
    keys = (rows[:, 0:1] + mx.arange(width, dtype=mx.int32))[:, None, None, :]
    queries = (rows[:, 1:2] + mx.arange(n_queries, dtype=mx.int32))[:, None, :, None]
    rng = rows[:, 2:4, None, None, None]
    mask = (keys >= rng[:, 0]) & (keys < rng[:, 1])
    if causal:
        mask = mask & (keys <= queries)
    if window is not None:
        mask = mask & (keys > queries - window)
    return mask


def range_mask(lo: np.ndarray, hi: np.ndarray, n_queries: int, page_size: int, *, exact: bool = False,
               causal: bool = True, window: int | None = None) -> mx.array:
    """``key_mask`` for readers of tokens [lo[b], hi[b]) whose queries are each row's last
    ``n_queries`` positions, over the columns they gather: exactly [lo, hi) for one row
    read ``exact``, else each row's pages from its first (``page_span``)."""
    if exact and lo.shape[0] == 1:
        base, width = lo, int(hi[0] - lo[0])
    else:
        first, _, pages = page_span(lo, hi, page_size)
        base, width = first * page_size, pages * page_size
    return key_mask(hi - n_queries, n_queries, base, width, lo, hi, causal=causal, window=window)


def causal_mask(n_queries: int, offset: int, window: int | None = None) -> mx.array:
    """Bool [n_queries, offset + n_queries] for one row whose keys start at 0."""
    m = range_mask(np.array([0]), np.array([offset + n_queries]), n_queries, 1, exact=True, window=window)
    return m[0, 0]


def check_mask_request(n_queries: object, window: object) -> None:
    """Typed errors unless ``n_queries`` is an int >= 1 and ``window`` None or an int
    >= 1: what a model's ``cache.make_mask(N, window_size=...)`` must pass (2.5 or -1
    would build a mask of no meaning)."""
    check_int("N", n_queries, minimum=1)
    if window is not None:
        check_int("window_size", window, minimum=1)


def attention_mask(n_queries: int, offset: int, return_array: bool, window: int | None):
    """What an mlx-lm model expects for ``n_queries`` new tokens after ``offset`` keys
    (all of them returned): ``None`` (one query sees everything), ``"causal"``, or an
    explicit bool array."""
    if window is not None:
        return causal_mask(n_queries, offset, window)
    if n_queries == 1:
        return None
    if return_array:
        return causal_mask(n_queries, offset)
    return "causal"
