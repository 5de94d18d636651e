"""pagedkv: a paged KV-cache memory manager for MLX.

- :class:`PagePool`: the physical K/V pages of all layers (the only writer).
- :class:`PageTable`: one sequence's pages and length; reserve / trim / fork / release.
- :class:`PagedKVCache`, :func:`make_paged_cache`: mlx-lm's cache protocol on pages.
"""

from allocators import PoolExhausted
from pagedkv.cache import PagedKVCache, PagedPromptCache, make_paged_cache
from pagedkv.errors import (
    KvDTypeError,
    KvShapeError,
    NotSupportedError,
    PagedKvError,
    ReleasedError,
)
from pagedkv.pool import PagePool, raise_cache_limit
from pagedkv.table import PageTable

__all__ = [
    "KvDTypeError",
    "KvShapeError",
    "NotSupportedError",
    "PagePool",
    "PageTable",
    "PagedKVCache",
    "PagedKvError",
    "PagedPromptCache",
    "PoolExhausted",
    "ReleasedError",
    "make_paged_cache",
    "raise_cache_limit",
]
