"""Helpers for a serving loop's scheduler (the scheduler itself stays the user's).

- ``pages_for(tokens, page_size)``: pages a sequence of that many tokens occupies.
- ``can_admit(pool, prompt_tokens, max_new_tokens, ...)``: would a new request fit in
  the free + evictable pages (and, for a hybrid model, a recurrent-state slot), keeping
  a watermark free for the running sequences?
- ``preempt(cache)``: give a sequence's pages back (its registered prefix pages stay
  cached, so it can resume from them or be recomputed later).
"""

from __future__ import annotations

import math

from pagedkv.cache import PagedPromptCache
from pagedkv.errors import InvalidValueError, check_int
from pagedkv.pool import PagePool
from pagedkv.state_pool import StatePool


def pages_for(tokens: int, page_size: int) -> int:
    """Pages ``tokens`` tokens occupy (``InvalidValueError`` for a page size below 1)."""
    tokens = check_int("tokens", tokens, minimum=0)
    return -(-tokens // check_int("page_size", page_size, minimum=1))


def check_watermark(watermark: float) -> float:
    """``InvalidValueError`` unless ``watermark`` is a fraction in [0, 1) (the share of a
    pool kept free for running sequences); returns it."""
    if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
        raise InvalidValueError(f"watermark must be a fraction in [0, 1), got {watermark!r}")
    return watermark


def can_admit(pool: PagePool, prompt_tokens: int, max_new_tokens: int, *, cached_tokens: int = 0,
              watermark: float = 0.01, state_pool: StatePool | None = None, releasable: int = 0,
              revived: int = 0, extra_pages: int = 0) -> bool:
    """True if a request needs no more than the available pages minus a watermark.

    ``cached_tokens`` are prompt tokens a prefix cache will serve (they cost no new
    pages). ``revived``: how many of the hit's pages are CACHED now (no sequence holds
    them): taking them removes them from the evictable pages, so they stop counting as
    available. ``extra_pages``: pages the request needs beyond its full-attention table
    (a sliding-window model's sliding tables). ``watermark`` is the fraction of the pool
    kept free for running sequences. ``state_pool`` (hybrid models): the request also
    needs one free or evictable recurrent-state slot beyond the same watermark of that
    pool. ``releasable``: pages the caller holds ahead of need and gives back for the
    request (a ``CompiledDecode``'s ``lookahead_pages``), counted as available.
    """
    check_int("prompt_tokens", prompt_tokens, minimum=1)
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    check_int("cached_tokens", cached_tokens, minimum=0, maximum=prompt_tokens)  # (a hit covers prompt tokens)
    check_int("releasable", releasable, minimum=0)
    check_int("revived", revived, minimum=0)
    check_int("extra_pages", extra_pages, minimum=0)
    check_watermark(watermark)
    need = pages_for(prompt_tokens + max_new_tokens, pool.page_size) - cached_tokens // pool.page_size \
        + extra_pages + revived
    reserve = math.ceil(watermark * pool.usable_pages)
    if state_pool is not None:
        if not isinstance(state_pool, StatePool):
            raise InvalidValueError(f"state_pool must be a StatePool, got {type(state_pool).__name__}")
        if 1 > state_pool.allocator.num_available() - math.ceil(watermark * state_pool.usable_slots):
            return False
    return need <= pool.allocator.num_available() + releasable - reserve


def preempt(cache: PagedPromptCache) -> int:
    """Release a sequence's pages (and recurrent-state slot) now; returns how many
    references were given back."""
    held = sum(t.num_pages for t in cache.tables)
    if cache.rows.states is not None:
        held += int((cache.rows.states.slots != cache.rows.states.pool.null_slot).sum())
    cache.release()
    return held
