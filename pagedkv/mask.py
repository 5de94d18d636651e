"""Causal (optionally windowed) attention masks, in the form mlx-lm models accept.

Kept here so pagedkv's core does not import mlx-lm (an optional extra).
"""

from __future__ import annotations

import mlx.core as mx


def causal_mask(n_queries: int, offset: int, window: int | None = None) -> mx.array:
    """Bool [n_queries, offset + n_queries]: query i (at offset + i) sees key j iff
    j <= offset + i and, with a window, j > offset + i - window."""
    keys = mx.arange(offset + n_queries)[None]
    queries = mx.arange(offset, offset + n_queries)[:, None]
    mask = queries >= keys
    if window is not None:
        mask = mask & (queries < keys + window)
    return mask


def attention_mask(n_queries: int, offset: int, return_array: bool, window: int | None):
    """What an mlx-lm model expects for ``n_queries`` new tokens after ``offset`` keys:
    ``None`` (one query sees everything), ``"causal"``, or an explicit bool array."""
    if window is not None:
        return causal_mask(n_queries, offset, window)
    if n_queries == 1:
        return None
    if return_array:
        return causal_mask(n_queries, offset)
    return "causal"
