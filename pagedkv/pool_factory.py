"""``pool_for``: a ``PagePool`` sized and shaped for a loaded model; ``pools_for_model``:
the page pool and, for a hybrid model, the recurrent-state pool of any mlx-lm model,
within one byte budget."""

from __future__ import annotations

import mlx.core as mx

from pagedkv.cache import kv_pages_for, kv_pool_layers
from pagedkv.codec import AffineQuant, rotated
from pagedkv.errors import InvalidValueError, NotSupportedError, check_int
from pagedkv.mlx_lm_caches import flat_caches
from pagedkv.pool import PagePool
from pagedkv.state_pool import StatePool


def _probe(model) -> list:
    """mlx-lm's own caches for ``model`` after a one-token forward."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    return cache


def _attention_caches(cache: list) -> list:
    return [c for c in flat_caches(cache) if getattr(c, "keys", None) is not None]


def kv_dtype(model) -> mx.Dtype:
    """The dtype a model's attention hands its cache (found by a one-token forward)."""
    return _attention_caches(_probe(model))[0].keys.dtype


def kv_shape(model) -> tuple[int, int, int, int]:
    """(attention cache slots, KV heads, key width, value width) of a model's caches,
    read off mlx-lm's own after a one-token forward, so every family reports them the
    same way. ``NotSupportedError`` for a model with no attention layers."""
    attn = _attention_caches(_probe(model))
    if not attn:
        raise NotSupportedError("the model has no attention layers to page")
    _, heads, _, head_dim = attn[0].keys.shape
    return len(attn), int(heads), int(head_dim), int(attn[0].values.shape[-1])


def pools_for_model(model, *, max_bytes: int, page_size: int = 16,
                    state_slots: int | None = None) -> tuple[PagePool, StatePool | None]:
    """A ``PagePool`` for ``model``'s attention layers (shapes and dtype from a one-token
    forward on mlx-lm's own caches) and, for a hybrid model, a ``StatePool`` for its
    recurrent layers, together within ``max_bytes``: ``state_slots`` slots (default 64:
    running requests plus prefix checkpoints) come off the budget first, the rest is
    pages. The pool has ``kv_pool_layers(model)`` layers: one per attention cache for a
    model of one kind, and for a model with sliding-window layers (``RotatingKVCache``)
    as many as it has full-attention layers, so that ``make_paged_cache`` lays the
    layers out in groups (``layout_for``) and a long sequence's full-attention pages
    keep no room for the sliding layers.
    """
    check_int("max_bytes", max_bytes, minimum=1)
    cache = _probe(model)
    names = {type(c).__name__ for c in flat_caches(cache)}
    if not names <= {"KVCache", "RotatingKVCache", "ArraysCache"}:
        raise NotSupportedError(f"pools_for_model sizes KVCache, RotatingKVCache and ArraysCache layers, the model "
                                f"has {sorted(names)}")
    attn = _attention_caches(cache)
    if not attn:
        raise NotSupportedError("the model has no attention layers to page")
    states = None
    if "ArraysCache" in names:
        slots = 64 if state_slots is None else check_int("state_slots", state_slots, minimum=2)
        states = StatePool.for_model(model, num_slots=slots)  # (refuses states that count no tokens)
    elif state_slots is not None:
        raise InvalidValueError("state_slots is for hybrid models; this one has no recurrent layers")
    left = max_bytes - (states.nbytes if states is not None else 0)
    _, heads, _, head_dim = attn[0].keys.shape
    kv = dict(num_layers=kv_pool_layers(model), num_kv_heads=heads, head_dim=head_dim, v_head_dim=attn[0].values.shape[-1],
              page_size=page_size, dtype=attn[0].keys.dtype)
    per_page = PagePool(**kv, num_pages=2, cache_limit=None).bytes_per_page
    if left < 2 * per_page:
        raise InvalidValueError(f"max_bytes={max_bytes} leaves {max(left, 0)} bytes after the state slots: "
                                f"fewer than 2 pages of {per_page}")
    return PagePool(**kv, max_bytes=left), states


def pool_for(lm, *, page_size: int = 16, tokens: int = 4096, max_bytes: int | None = None,
             kv_bits: int | None = None) -> PagePool:
    """A pool for ``lm`` (a ``LoadedModel``) holding one sequence of ``tokens`` tokens,
    or as many pages as ``max_bytes`` (K + V of all its layers) holds when it is given.
    It has ``kv_pool_layers(lm.model)`` layers, as ``pools_for_model``'s pool (a model
    with sliding-window layers is laid out in groups), and ``kv_pages_for`` pages.

    ``kv_bits`` stores K and V quantised with scales in the model's dtype (as mlx-lm's
    ``QuantizedKVCache``, so a bf16 model's quantised step stays bf16): 8 bits plain affine (group
    64; mlx-lm's quantised attention path), fewer bits TurboQuant-style rotated K and V
    (group 32), which measured 2.6x lower KL than plain affine at 4 bits on SmolLM2
    (bench/RESULTS.md).
    """
    layers = kv_pool_layers(lm.model)
    size = (dict(max_bytes=max_bytes) if max_bytes is not None
            else dict(num_pages=kv_pages_for(lm.model, tokens, page_size, layers)))
    v_head_dim = lm.v_head_dim or lm.head_dim
    common = dict(num_layers=layers, num_kv_heads=lm.num_kv_heads, head_dim=lm.head_dim,
                  v_head_dim=v_head_dim, page_size=page_size, dtype=kv_dtype(lm.model), **size)
    if kv_bits is None:
        return PagePool(**common)
    if kv_bits >= 8:
        codec = AffineQuant(kv_bits, 64)
        return PagePool(**common, k_codec=codec, v_codec=codec)
    return PagePool(**common, k_codec=rotated(kv_bits, lm.head_dim, 32, seed=1),
                    v_codec=rotated(kv_bits, v_head_dim, 32, seed=2))
