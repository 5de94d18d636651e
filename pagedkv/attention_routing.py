"""``route_attention``: mlx-lm's attention reads pagedkv's pages directly.

mlx-lm's attention layers call ``scaled_dot_product_attention(queries, keys, values,
cache=cache, scale=..., mask=...)`` (``mlx_lm.models.base``) with the K/V that
``cache.update_and_fetch`` returned. ``route_attention(model)`` replaces that name in
the modules of the model's attention classes with a router: when ``cache`` is a
pagedkv layer cache it calls ``cache.attend(queries, scale, mask)``, which reads the
pages (its class sets ``reads_pages``: pagedkv's layer caches and ``DonorCache``; the
CUDA decode kernel on a GPU, quantised matmuls on packed pages, SDPA on the gathered
pages); any other cache goes to mlx-lm's own function, unchanged. The K/V that
``update_and_fetch`` returned are then never computed (MLX is lazy), and where they are
views of the pool (``LayerFace.update_and_fetch``) no gather is built either. Attention with
sinks (gpt_oss) goes to ``cache.attend(..., sinks=)`` where the class sets
``takes_sinks`` (the layer caches of a sequence, a batch and a compiled step), and to
mlx-lm's function with those K/V otherwise.

Idempotent; ``make_paged_cache`` and ``PagedBatch.for_model`` call it. Costs: one
``isinstance`` per attention call.
"""

from __future__ import annotations

import sys

_ROUTED = "_pagedkv_original"


def _router(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if getattr(cache, "reads_pages", False):
            if sinks is None:
                return cache.attend(queries, scale, mask)
            if getattr(cache, "takes_sinks", False):
                return cache.attend(queries, scale, mask, sinks=sinks)
        if sinks is None:
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    setattr(scaled_dot_product_attention, _ROUTED, original)
    return scaled_dot_product_attention


def route_attention(model) -> int:
    """Route the attention of every module ``model``'s layers come from; returns how
    many modules were newly routed (0 when they already were, or the model does not
    use mlx-lm's ``scaled_dot_product_attention``)."""
    names = {type(m).__module__ for _, m in _modules(model)}
    routed = 0
    for name in names:
        module = sys.modules.get(name)
        fn = getattr(module, "scaled_dot_product_attention", None)
        if fn is None or hasattr(fn, _ROUTED) or not callable(fn):
            continue
        module.scaled_dot_product_attention = _router(fn)
        routed += 1
    return routed


def _modules(model):
    named = getattr(model, "named_modules", None)
    if named is None:
        return []
    return named()
