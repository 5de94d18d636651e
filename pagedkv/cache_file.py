"""``save_cache`` / ``load_cache``: one paged sequence to a file and back, crash-safe.

The file is a page file (:mod:`pagedkv.page_file`: safetensors, format version, the
pool's layout, a model fingerprint, a CRC-32 per page) holding the sequence's pages in
order, plus ``kind = "cache"``, ``num_tokens`` and, if given, the token ids. Loading
validates the whole file before it takes a page, so a truncated, corrupted,
other-version or other-model file raises a typed ``KvFileError`` and the pool is exactly
as it was; ``PoolExhausted`` likewise leaves it unchanged.

Why not mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache``: the loader rebuilds
each layer by looking its class name up in ``mlx_lm.models.cache``, so it can only
produce mlx-lm's own caches, and a file of paged caches does not load (``KeyError:
'PagedKVCache'``). These two functions keep pages, quantised codecs and the checks. A
file of mlx-lm ``KVCache``s comes into pages layer by layer: ``paged.state =
kv_cache.state`` (see ``PagedKVCache.state``).

Cost: O(bytes of the sequence's pages) each way, plus one CRC-32 pass.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from pagedkv.cache import PagedPromptCache, make_paged_cache
from pagedkv.errors import (
    CorruptKvFileError,
    InvalidTypeError,
    InvalidValueError,
    NotSupportedError,
)
from pagedkv.page_file import PageFileSpec, read_pages_file, write_pages_file
from pagedkv.pool import PagePool


def save_cache(path: str | os.PathLike, cache: PagedPromptCache, *, tokens: Sequence[int] | None = None,
               model_id: str = "") -> int:
    """Write ``cache`` (one full-attention sequence, between steps) to ``path``; the
    cache is unchanged. ``tokens``: its token ids, stored for the caller (and for
    prefix-cache registration after loading). Returns the file size in bytes."""
    if not isinstance(cache, PagedPromptCache):
        raise InvalidTypeError(f"save_cache takes a PagedPromptCache, got {type(cache).__name__}")
    cache.rows.check_alive()
    if len(cache.tables) != 1 or cache.tables[0].window is not None:
        raise NotSupportedError("save_cache saves one full-attention sequence (one page table, no window)")
    if cache.rows.states is not None:
        raise NotSupportedError("save_cache keeps K/V pages; a hybrid model's recurrent state is not saved yet")
    table = cache.tables[0]
    if any(int(o) != table.num_tokens for o in cache.rows.offsets.reshape(-1)):
        raise InvalidValueError("save_cache needs every layer at the same length (between steps)")
    if tokens is not None:
        tokens = [int(t) for t in tokens]
        if len(tokens) != table.num_tokens:
            raise InvalidValueError(f"tokens holds {len(tokens)} ids; the cache holds {table.num_tokens} tokens")
    pool = table.pool
    data = pool.read_pages(table.page_ids(0, table.num_pages))
    extra = {"kind": "cache", "num_tokens": str(table.num_tokens),
             "tokens": json.dumps(tokens) if tokens is not None else ""}
    return write_pages_file(path, data, PageFileSpec(pool, model_id), extra)


def load_cache(path: str | os.PathLike, model, pool: PagePool, *,
               model_id: str = "") -> tuple[PagedPromptCache, list[int] | None]:
    """A new cache for ``model`` in ``pool`` holding the saved sequence, and its token
    ids (None if none were saved). Typed errors, with the pool unchanged, for a bad
    file (``KvFileError`` subclasses) or a full pool (``PoolExhausted``)."""
    data, meta = read_pages_file(path, PageFileSpec(pool, model_id))
    n = int(meta["pages"])
    try:
        if meta.get("kind") != "cache":
            raise ValueError
        num_tokens = int(meta["num_tokens"])
        tokens = json.loads(meta["tokens"]) if meta.get("tokens") else None
        if not (n - 1) * pool.page_size < num_tokens <= n * pool.page_size:
            raise ValueError
        if tokens is not None and (len(tokens) != num_tokens or not all(isinstance(t, int) for t in tokens)):
            raise ValueError
    except (KeyError, ValueError, TypeError):
        raise CorruptKvFileError(f"{path}: not a saved cache, or its length or tokens are inconsistent") from None
    cache = make_paged_cache(model, pool)
    try:
        if len(cache.tables) != 1 or cache.tables[0].window is not None:
            raise NotSupportedError("load_cache loads into full-attention models (one page table)")
        pages = pool.allocator.allocate(n)  # PoolExhausted: nothing taken
        try:
            pool.write_pages(pages, data)
            cache.rows.adopt_prefix(pages, num_tokens)
        except BaseException:
            pool.allocator.decref(pages)
            raise
    except BaseException:
        cache.release()
        raise
    return cache, tokens
