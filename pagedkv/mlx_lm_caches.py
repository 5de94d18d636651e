"""Reading mlx-lm's own cache lists (``model.make_cache()``, ``make_prompt_cache``).

A model's cache list has one entry per layer; an entry is one cache, or (Falcon-H1) a
``CacheList`` bundling a layer's caches, e.g. ``CacheList(ArraysCache, KVCache)`` for a
layer that runs Mamba and attention side by side. pagedkv lays out one *face* per cache
(``layout_for``) and groups a ``CacheList``'s faces back into a ``PagedCacheList``.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from pagedkv.errors import NotSupportedError


def entry_caches(entry) -> list:
    """The caches of one cache-list entry: itself, or a ``CacheList``'s members (one
    level; a nested ``CacheList`` raises ``NotSupportedError``)."""
    if type(entry).__name__ != "CacheList":
        return [entry]
    members = list(entry.caches)
    if any(type(c).__name__ == "CacheList" for c in members):
        raise NotSupportedError("nested CacheLists are not supported")
    return members


def flat_caches(caches: Iterable) -> Iterator:
    """Every cache of a cache list, ``CacheList`` members in order."""
    for entry in caches:
        yield from entry_caches(entry)
