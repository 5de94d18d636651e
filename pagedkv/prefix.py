"""``PrefixCache``: reuse the K/V pages of prompt prefixes that were computed before.

A *full* page's identity is a chained hash (blake2b, 32 bytes) of its parent page's
hash, the cache's extra keys (model/adapter id, a salt) and the page's token ids::

    h0 = H(b"" | extra | tokens[0:ps])     h1 = H(h0 | extra | tokens[ps:2ps]) ...

so equal hashes mean equal whole prefixes. On a hit the stored token ids are compared
before the page is trusted (a hash collision can never serve wrong K/V). A page whose
sequence ends keeps its hash and becomes CACHED (reference count 0, evictable) in the
allocator; it is evicted in LRU order only when an allocation needs the room, and its
hash is forgotten then. A new request takes every cached page of its longest matching
prefix (one more reference each) and computes only the rest; at least its last token
is always computed, so the model yields logits.

Ownership: the prefix cache owns the hash → page map and no references; pages are kept
alive by the tables that hold them, or by the allocator's CACHED state.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import attrs
import numpy as np

from pagedkv.cache import PagedPromptCache, make_paged_cache
from pagedkv.errors import (
    InvalidTypeError,
    InvalidValueError,
    NotSupportedError,
    ReleasedError,
)
from pagedkv.pool import PagePool
from pagedkv.table import PageTable


@attrs.frozen
class PrefixStats:
    queries: int
    query_tokens: int
    hit_tokens: int
    hit_pages: int
    registered_pages: int
    cached_pages: int
    evictions: int

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class PrefixCache:
    def __init__(self, pool: PagePool, *, extra_keys: bytes | str = b"") -> None:
        self.pool = pool
        self.extra = extra_keys.encode() if isinstance(extra_keys, str) else bytes(extra_keys)
        self._by_hash: dict[bytes, int] = {}
        self._info: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # page -> (hash, tokens)
        pool.allocator.evict_listeners.append(self._forget)
        self._queries = self._query_tokens = self._hit_tokens = self._hit_pages = self._evictions = 0

    def page_hash(self, parent: bytes, tokens: Sequence[int]) -> bytes:
        h = hashlib.blake2b(digest_size=32)
        h.update(parent)
        h.update(len(self.extra).to_bytes(4, "little"))
        h.update(self.extra)
        h.update(np.asarray(tokens, dtype=np.int64).tobytes())
        return h.digest()

    def _forget(self, ids: list[int]) -> None:
        for page in ids:
            info = self._info.pop(page, None)
            if info is not None:
                del self._by_hash[info[0]]
                self._evictions += 1

    # ------------------------------------------------------------------ lookups
    def match(self, tokens: Sequence[int]) -> list[int]:
        """Pages of the longest cached prefix of ``tokens`` (no references taken).

        Only full pages count, and the last token is never covered.
        """
        ps = self.pool.page_size
        ids = _token_ids(tokens)
        pages, parent = [], b""
        for i in range((len(ids) - 1) // ps):
            chunk = ids[i * ps : (i + 1) * ps]
            parent = self.page_hash(parent, chunk)
            page = self._by_hash.get(parent)
            if page is None or self._info[page][1] != chunk:  # verify the tokens themselves
                break
            pages.append(page)
        return pages

    def new_cache(self, model, tokens: Sequence[int]) -> tuple[PagedPromptCache, list[int]]:
        """A one-sequence cache already holding the longest cached prefix of ``tokens``.

        Returns (cache, the tokens still to run through the model).
        """
        pages = self.match(tokens)  # checks the token ids before anything is built
        if len(tokens) == 0:
            raise InvalidValueError("a request needs at least one token")
        cache = make_paged_cache(model, self.pool)
        if len(cache.tables) != 1 or cache.tables[0].window is not None:
            cache.release()
            raise NotSupportedError("prefix caching serves full-attention models")
        self._queries += 1
        self._query_tokens += len(tokens)
        if pages:
            self.pool.allocator.touch(pages)  # one reference each; revives CACHED pages
            cache.rows.adopt_prefix(pages)
            self._hit_pages += len(pages)
            self._hit_tokens += len(pages) * self.pool.page_size
        return cache, list(tokens[len(pages) * self.pool.page_size :])

    def register(self, table: PageTable | PagedPromptCache, tokens: Sequence[int]) -> int:
        """Make the full pages of a sequence findable; ``tokens`` are its token ids
        (at least its first ``num_tokens``). Returns the number of pages newly registered."""
        if isinstance(table, PagedPromptCache):
            table.rows.check_alive()
            if len(table.tables) != 1:
                raise NotSupportedError("prefix caching serves full-attention models (one page table)")
            table = table.tables[0]
        if not isinstance(table, PageTable):
            raise InvalidTypeError(f"register takes a PageTable or PagedPromptCache, got {type(table).__name__}")
        if table.released:
            raise ReleasedError("cannot register a released page table")
        if table.pool is not self.pool:
            raise InvalidValueError("the table's pages are in another pool than the prefix cache's")
        if table.window is not None:
            raise NotSupportedError("prefix caching serves full-attention tables; a sliding window drops pages")
        ps = self.pool.page_size
        full = table.num_tokens // ps
        if len(tokens) < full * ps:
            raise InvalidValueError(f"need the ids of the {full * ps} tokens in full pages, got {len(tokens)}")
        ids = _token_ids(tokens[: full * ps])  # all checked before anything is registered
        pages = table.pages
        parent, new = b"", []
        for i in range(full):
            chunk = ids[i * ps : (i + 1) * ps]
            parent = self.page_hash(parent, chunk)
            page = int(pages[i])
            if parent in self._by_hash or page in self._info:
                continue  # already cached (maybe as another page with the same content)
            self._by_hash[parent] = page
            self._info[page] = (parent, chunk)
            new.append(page)
        if new:
            self.pool.allocator.set_cacheable(new)
        return len(new)

    def stats(self) -> PrefixStats:
        return PrefixStats(
            queries=self._queries, query_tokens=self._query_tokens, hit_tokens=self._hit_tokens,
            hit_pages=self._hit_pages, registered_pages=len(self._info),
            cached_pages=self.pool.allocator.num_cached(), evictions=self._evictions,
        )


def _token_ids(tokens: Sequence[int]) -> tuple[int, ...]:
    """Token ids as a tuple of Python ints, or ``InvalidTypeError`` (nothing changes)."""
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as e:
        raise InvalidTypeError(f"token ids must be a sequence of ints: {e}") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidTypeError(f"token ids must be a 1-d sequence of ints, got {arr.dtype} of shape {arr.shape}")
    return tuple(arr.tolist())
