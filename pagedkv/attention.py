"""Attention over gathered page components: the one place that dispatches on page kind.

- full precision K and V: ``mx.fast.scaled_dot_product_attention`` (exact).
- affine-quantised K and/or V: quantised matmuls on the packed pages (the context is
  never dequantised as a whole); mlx-lm's ``quantized_scaled_dot_product_attention`` is
  the numerical reference, but unlike it this never scales the caller's query in place.
- rotated K (TurboQuant): the query is rotated to match (R is orthogonal, so q·k is kept).
- rotated V: attention runs on rotated values; the *output* is un-rotated once per query
  row (deferred-V), which equals un-rotating every cached value (attention is linear in V).
"""

from __future__ import annotations

import mlx.core as mx

from pagedkv.codec import FullPrecision


def is_plain(k_codec, v_codec, dtype: mx.Dtype) -> bool:
    """Pages that hold exactly the values attention wants (no decoding needed)."""
    return (isinstance(k_codec, FullPrecision) and isinstance(v_codec, FullPrecision)
            and k_codec.dtype == dtype and v_codec.dtype == dtype)


def _mask_scores(scores: mx.array, mask, n_repeats: int) -> mx.array:
    if mask is None:
        return scores
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}")
        q_len, k_len = scores.shape[-2:]
        mask = mx.arange(k_len - q_len, k_len)[:, None] >= mx.arange(k_len)[None]
    elif n_repeats > 1 and mask.ndim > 3:
        mask = mx.expand_dims(mask, -3)
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.finfo(scores.dtype).min)
    return scores + mask


def quantized_attention(q: mx.array, k_parts, v_parts, scale: float, mask, *, k_bits: int,
                        k_group: int, v_bits: int, v_group: int) -> mx.array:
    """Attention of ``q`` [B, n_heads, L, D] over quantised (packed, scales, biases) K/V."""
    b, n_heads, n_q, d = q.shape
    n_kv = k_parts[0].shape[-3]
    # quantized_matmul computes in the scales' dtype: promote fp16 scales to the query's
    k_parts = (k_parts[0], k_parts[1].astype(q.dtype), k_parts[2].astype(q.dtype))
    v_parts = (v_parts[0], v_parts[1].astype(q.dtype), v_parts[2].astype(q.dtype))
    rep = n_heads // n_kv
    queries = q * scale  # a new array: the caller's q is left alone
    if rep > 1:
        queries = queries.reshape(b, n_kv, rep, n_q, d)
        k_parts = tuple(mx.expand_dims(x, -3) for x in k_parts)
        v_parts = tuple(mx.expand_dims(x, -3) for x in v_parts)
    scores = mx.quantized_matmul(queries, *k_parts, transpose=True, group_size=k_group, bits=k_bits)
    scores = mx.softmax(_mask_scores(scores, mask, rep), axis=-1, precise=True)
    out = mx.quantized_matmul(scores, *v_parts, transpose=False, group_size=v_group, bits=v_bits)
    if rep > 1:
        out = out.reshape(b, n_heads, n_q, -1)
    return out


def decode_kv(k_parts, v_parts, k_codec, v_codec, dtype: mx.Dtype,
              unrotate_values: bool = True) -> tuple[mx.array, mx.array]:
    """``dtype`` K/V from gathered components; keys always un-rotated, values if asked."""
    k = k_codec.decode(k_parts, dtype)
    if k_codec.rotated:
        k = k_codec.unrotate(k)
    v = v_codec.decode(v_parts, dtype)
    if v_codec.rotated and unrotate_values:
        v = v_codec.unrotate(v)
    return k, v


def attend_parts(q: mx.array, k_parts, v_parts, scale: float, mask, k_codec, v_codec) -> mx.array:
    """Attention over one page kind's gathered components (see module doc)."""
    if is_plain(k_codec, v_codec, q.dtype):
        return mx.fast.scaled_dot_product_attention(q, k_parts[0], v_parts[0], scale=scale, mask=mask)
    if k_codec.rotated:
        q = k_codec.rotate(q)
    if k_codec.quantized and v_codec.quantized:
        out = quantized_attention(q, k_parts, v_parts, scale, mask, k_bits=k_codec.bits,
                                  k_group=k_codec.group_size, v_bits=v_codec.bits, v_group=v_codec.group_size)
    else:
        k = k_codec.decode(k_parts, q.dtype)
        v = v_codec.decode(v_parts, q.dtype)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    if v_codec.rotated:
        out = v_codec.unrotate(out)
    return out.astype(q.dtype)
