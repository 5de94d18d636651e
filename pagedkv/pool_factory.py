"""``pool_for``: a ``PagePool`` sized and shaped for a loaded model."""

from __future__ import annotations

import mlx.core as mx

from pagedkv.errors import NotSupportedError
from pagedkv.pool import PagePool


def kv_dtype(model) -> mx.Dtype:
    """The dtype a model's attention hands its cache (found by a one-token forward)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    return cache[0].keys.dtype


def pool_for(lm, *, page_size: int = 16, tokens: int = 4096, kv_bits: int | None = None,
             group_size: int = 32) -> PagePool:
    """A pool for ``lm`` (a ``LoadedModel``) holding ``tokens`` tokens per layer."""
    num_pages = -(-tokens // page_size) + 1  # + the null page
    common = dict(num_layers=lm.num_layers, num_kv_heads=lm.num_kv_heads, head_dim=lm.head_dim,
                  page_size=page_size, num_pages=num_pages, dtype=kv_dtype(lm.model))
    if kv_bits is None:
        return PagePool(**common)
    raise NotSupportedError("quantised pages are not available in this build")
